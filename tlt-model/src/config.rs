//! Model configuration, read from and written to Hugging Face `config.json`.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Upper bound on every size of a config (hidden, intermediate, heads, head_dim, vocabulary, context): 2^24.
pub const MAX_DIM: usize = 1 << 24;
/// Upper bound on the number of decoder layers.
pub const MAX_LAYERS: usize = 4096;

/// The decoder families this crate implements. They differ only in details of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2/3, SmolLM/SmolLM2, Mistral-style dense models without biases.
    Llama,
    /// Qwen2/Qwen2.5: Llama with biases on the q, k and v projections.
    Qwen2,
}

impl Architecture {
    /// Parses an HF `model_type` (`"llama"`, `"qwen2"`, `"mistral"`).
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "llama" | "mistral" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// The HF `architectures` entry written when saving.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// The HF `model_type` written when saving.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    /// Whether the q, k and v projections carry a bias.
    pub fn qkv_bias(self) -> bool {
        matches!(self, Self::Qwen2)
    }
}

/// RoPE scaling as HF writes it under `rope_scaling`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama-3.1 style frequency-dependent scaling.
    Llama3 {
        /// Overall context extension factor.
        factor: f64,
        /// Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are unchanged.
        high_freq_factor: f64,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// Interpolation factor.
        factor: f64,
    },
}

/// A Llama-family decoder configuration with Hugging Face `config.json` field names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// The HF `model_type` (`llama`, `qwen2`, `mistral`).
    pub model_type: String,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder blocks.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (GQA); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Optional RoPE scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Longest context the model supports.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token(s).
    #[serde(default)]
    pub eos_token_id: Option<EosTokens>,
    /// Activation of the MLP; only `silu` is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

/// HF allows `eos_token_id` to be one id or a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EosTokens {
    /// A single id.
    One(u32),
    /// Several ids, any of which ends a sequence.
    Many(Vec<u32>),
}

impl EosTokens {
    /// All end-of-sequence ids.
    pub fn ids(&self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![*id],
            Self::Many(ids) => ids.clone(),
        }
    }
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    4096
}
fn default_act() -> String {
    "silu".into()
}

impl LlamaConfig {
    /// The architecture named by `model_type`.
    pub fn architecture(&self) -> Result<Architecture> {
        Architecture::from_model_type(&self.model_type).ok_or_else(|| Error::InvalidConfig {
            field: "model_type".into(),
            value: self.model_type.clone(),
            reason: "only llama, mistral and qwen2 are supported",
        })
    }

    /// Number of key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Width of all key (or value) heads of one token.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads() * self.head_dim()
    }

    /// Width of all query heads of one token.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim()
    }

    /// End-of-sequence ids (empty when the config names none).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id.as_ref().map(EosTokens::ids).unwrap_or_default()
    }

    /// Checks every value a forward pass relies on.
    pub fn validate(&self) -> Result<()> {
        self.architecture()?;
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
            ("head_dim", self.head_dim()),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(invalid(field, value, "must be positive"));
            }
            // Bounds far above any real checkpoint (the largest open models have hidden sizes of ~2^14, ~2^18
            // vocabularies, ~2^7 layers and ~2^20-token contexts), so a corrupt or hostile config.json or GGUF
            // header is refused before anything is allocated from it.
            let limit = if field == "num_hidden_layers" { MAX_LAYERS } else { MAX_DIM };
            if value > limit {
                return Err(invalid(field, value, "is beyond any supported model (corrupt config?)"));
            }
        }
        if self.num_attention_heads.saturating_mul(self.head_dim()) > MAX_DIM {
            return Err(invalid(
                "num_attention_heads",
                self.num_attention_heads,
                "times head_dim is beyond any supported model",
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(invalid("num_key_value_heads", self.kv_heads(), "must divide num_attention_heads"));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(invalid("head_dim", self.head_dim(), "must be even for RoPE"));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(invalid(
                "hidden_size",
                self.hidden_size,
                "must be a multiple of num_attention_heads when head_dim is absent",
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(invalid("rms_norm_eps", self.rms_norm_eps, "must be finite and positive"));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(invalid("rope_theta", self.rope_theta, "must be finite and > 1"));
        }
        if self.hidden_act != "silu" {
            return Err(invalid("hidden_act", &self.hidden_act, "only silu is supported"));
        }
        match &self.rope_scaling {
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                if !(*factor >= 1.0 && *low_freq_factor > 0.0 && high_freq_factor > low_freq_factor) {
                    return Err(invalid(
                        "rope_scaling",
                        format!("{factor}/{low_freq_factor}/{high_freq_factor}"),
                        "needs factor >= 1 and 0 < low_freq_factor < high_freq_factor",
                    ));
                }
                if *original_max_position_embeddings == 0 {
                    return Err(invalid("rope_scaling.original_max_position_embeddings", 0, "must be positive"));
                }
            }
            Some(RopeScaling::Linear { factor }) if !(*factor > 0.0 && factor.is_finite()) => {
                return Err(invalid("rope_scaling.factor", factor, "must be finite and positive"));
            }
            _ => {}
        }
        Ok(())
    }

    /// RoPE inverse frequencies (length `head_dim / 2`), with scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim();
        let base: Vec<f64> = (0..d / 2).map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d as f64)).collect();
        match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.into_iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Parses `config.json` text. `path` only labels errors.
    pub fn from_json(text: &str, path: &std::path::Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text).map_err(|e| Error::malformed(path, "config.json", e))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The `config.json` object HF transformers loads, with `architectures` and `torch_dtype`.
    pub fn to_hf_json(&self, torch_dtype: &str) -> Result<serde_json::Value> {
        let arch = self.architecture()?;
        let mut v = serde_json::to_value(self).map_err(|e| Error::InvalidInput(e.to_string()))?;
        if let Some(obj) = v.as_object_mut() {
            obj.retain(|_, value| !value.is_null());
            obj.insert("architectures".into(), serde_json::json!([arch.hf_class()]));
            obj.insert("model_type".into(), arch.model_type().into());
            obj.insert("torch_dtype".into(), torch_dtype.into());
            obj.insert("num_key_value_heads".into(), self.kv_heads().into());
            obj.insert("head_dim".into(), self.head_dim().into());
            obj.insert("attention_bias".into(), arch.qkv_bias().into());
            obj.insert("mlp_bias".into(), false.into());
        }
        Ok(v)
    }

    /// A tiny configuration for tests and examples: `layers` blocks of width `hidden`, GQA 4:2.
    pub fn tiny(vocab_size: usize, hidden_size: usize, layers: usize) -> Self {
        Self {
            model_type: "llama".into(),
            hidden_size,
            intermediate_size: hidden_size * 2,
            num_hidden_layers: layers,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            head_dim: None,
            vocab_size,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 512,
            tie_word_embeddings: false,
            bos_token_id: None,
            eos_token_id: None,
            hidden_act: "silu".into(),
        }
    }
}

fn invalid(field: &str, value: impl std::fmt::Display, reason: &'static str) -> Error {
    Error::InvalidConfig { field: field.into(), value: value.to_string(), reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_smollm2_style_config() {
        let text = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":576,
            "intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,
            "vocab_size":49152,"rms_norm_eps":1e-5,"rope_theta":100000.0,"tie_word_embeddings":true,
            "eos_token_id":2,"bos_token_id":1,"max_position_embeddings":8192,"torch_dtype":"bfloat16"}"#;
        let cfg = LlamaConfig::from_json(text, "x".as_ref()).unwrap();
        assert_eq!(cfg.head_dim(), 64);
        assert_eq!(cfg.kv_dim(), 192);
        assert_eq!(cfg.eos_ids(), vec![2]);
        let back = cfg.to_hf_json("float32").unwrap();
        assert_eq!(back["architectures"][0], "LlamaForCausalLM");
        let again: LlamaConfig = serde_json::from_value(back).unwrap();
        assert_eq!(again, LlamaConfig { head_dim: Some(64), ..cfg });
    }

    #[test]
    fn rejects_bad_values() {
        let mut cfg = LlamaConfig::tiny(16, 32, 1);
        cfg.num_key_value_heads = Some(3);
        assert!(matches!(cfg.validate(), Err(Error::InvalidConfig { field, .. }) if field == "num_key_value_heads"));
        let mut cfg = LlamaConfig::tiny(16, 32, 1);
        cfg.model_type = "gpt2".into();
        assert!(matches!(cfg.validate(), Err(Error::InvalidConfig { field, .. }) if field == "model_type"));
        let mut cfg = LlamaConfig::tiny(16, 32, 1);
        cfg.rms_norm_eps = f64::NAN;
        assert!(cfg.validate().is_err());
        assert!(LlamaConfig::from_json("{\"hidden_size\": 3", "c.json".as_ref()).is_err());
    }

    #[test]
    fn llama3_scaling_matches_reference_values() {
        let mut cfg = LlamaConfig::tiny(16, 128, 1);
        cfg.num_attention_heads = 1;
        cfg.num_key_value_heads = Some(1);
        cfg.rope_theta = 500_000.0;
        cfg.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        });
        cfg.validate().unwrap();
        let scaled = cfg.rope_inv_freq();
        cfg.rope_scaling = None;
        let plain = cfg.rope_inv_freq();
        // High frequencies (short wavelengths) are untouched, the lowest are divided by the factor.
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-15);
        assert!(scaled.iter().zip(&plain).all(|(s, p)| *s <= *p && *s >= *p / 8.0 - 1e-18));
    }
}
