//! Model configuration, read from and written to Hugging Face `config.json`.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Upper bound on every size of a config (hidden, intermediate, heads, head_dim, vocabulary, context): 2^24.
pub const MAX_DIM: usize = 1 << 24;
/// Upper bound on the number of decoder layers.
pub const MAX_LAYERS: usize = 4096;
/// `head_dim` of a Qwen3 `config.json` that names none (transformers' `Qwen3Config` default).
const QWEN3_HEAD_DIM: usize = 128;

/// The decoder families this crate implements. They differ only in details of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2/3, SmolLM/SmolLM2, Mistral-style dense models (biases only with `attention_bias`).
    Llama,
    /// Qwen2/Qwen2.5: Llama with biases on the q, k and v projections (always; HF ignores `attention_bias`).
    Qwen2,
    /// Qwen3 (dense): Llama with a per-head RMSNorm of every query and key vector before RoPE
    /// (`self_attn.q_norm`/`k_norm`, `[head_dim]`), no biases unless `attention_bias`, and a `head_dim` of its own
    /// (HF's default 128, not `hidden_size / num_attention_heads`).
    Qwen3,
}

impl Architecture {
    /// Parses an HF `model_type` (`"llama"`, `"mistral"`, `"qwen2"`, `"qwen3"`).
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "llama" | "mistral" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// The HF `architectures` entry written when saving.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The HF `model_type` written when saving.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    /// Whether every query and key head is RMS-normalised (weights `self_attn.q_norm`/`k_norm`) before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Self::Qwen3)
    }

    /// The attention biases of this architecture given the config's `attention_bias`, as HF builds the layers:
    /// Qwen2 always has q/k/v biases and no o bias (its modeling code ignores the flag); Llama and Qwen3 put a bias
    /// on all four projections exactly when `attention_bias` is true.
    pub fn attention_bias(self, attention_bias: bool) -> AttentionBias {
        match self {
            Self::Qwen2 => AttentionBias { qkv: true, o: false },
            Self::Llama | Self::Qwen3 => AttentionBias { qkv: attention_bias, o: attention_bias },
        }
    }
}

/// Which attention projections carry a bias (the MLP's never do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttentionBias {
    /// The q, k and v projections.
    pub qkv: bool,
    /// The output projection.
    pub o: bool,
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
///
/// RoPE settings are read from the legacy `rope_theta` + `rope_scaling` (what checkpoints on the Hub carry) or
/// from `rope_parameters` (what transformers >= 5 writes instead; it wins when both are present), and from a
/// legacy `rope_scaling` keyed by `type`; they are always written in the legacy form, which every
/// transformers version and the serving engines read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct LlamaConfig {
    /// The HF `model_type` (`llama`, `mistral`, `qwen2`, `qwen3`).
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
    /// Per-head width; defaults to `hidden_size / num_attention_heads` (Qwen3: 128, HF's `Qwen3Config` default).
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
    /// Biases on the attention projections (Llama and Qwen3 honour it on q, k, v and o; Qwen2 ignores it, see
    /// [`Architecture::attention_bias`]). Default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP projections (`llama`; the other architectures ignore it); only `false` (the default) is
    /// supported.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Qwen2/Qwen3 sliding-window attention; only `false` is supported (the dense models turn it off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    /// Per-layer attention kinds (transformers writes them for Qwen2/Qwen3); only `full_attention` is supported.
    /// Kept so a config round-trips; checked against `num_hidden_layers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
}

impl Serialize for LlamaConfig {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        // The derived (remote = "Self") field-by-field form.
        LlamaConfig::serialize(self, serializer)
    }
}

impl<'de> Deserialize<'de> for LlamaConfig {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut value = serde_json::Value::deserialize(deserializer)?;
        if let Some(obj) = value.as_object_mut() {
            fold_rope_parameters(obj);
        }
        // The derived (remote = "Self") field-by-field form.
        LlamaConfig::deserialize(value).map_err(D::Error::custom)
    }
}

/// Rewrites transformers-5 `rope_parameters` (`{rope_type, rope_theta, factor, ...}`) into the legacy
/// `rope_theta` + `rope_scaling` fields, and a legacy `rope_scaling` keyed by `type` (or of type `default`) into
/// the form [`RopeScaling`] reads.
fn fold_rope_parameters(obj: &mut serde_json::Map<String, serde_json::Value>) {
    use serde_json::Value;
    if let Some(Value::Object(mut params)) = obj.remove("rope_parameters") {
        if let Some(theta) = params.remove("rope_theta") {
            obj.insert("rope_theta".into(), theta);
        }
        obj.insert("rope_scaling".into(), Value::Object(params));
    }
    if let Some(Value::Object(scaling)) = obj.get_mut("rope_scaling") {
        if !scaling.contains_key("rope_type") {
            if let Some(kind) = scaling.remove("type") {
                scaling.insert("rope_type".into(), kind);
            }
        }
        if scaling.get("rope_type").is_some_and(|t| t == "default") {
            obj.insert("rope_scaling".into(), Value::Null);
        }
    }
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
            reason: "only llama, mistral, qwen2 and qwen3 are supported",
        })
    }

    /// The attention biases this config implies ([`Architecture::attention_bias`]; a `mistral` config never has
    /// any: transformers' Mistral ignores `attention_bias`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown `model_type`.
    pub fn attention_bias(&self) -> Result<AttentionBias> {
        Ok(self.architecture()?.attention_bias(self.attention_bias && self.model_type != "mistral"))
    }

    /// Whether query and key heads are RMS-normalised before RoPE (Qwen3); false for an unknown `model_type`.
    pub fn qk_norm(&self) -> bool {
        Architecture::from_model_type(&self.model_type).is_some_and(Architecture::qk_norm)
    }

    /// Number of key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of one attention head: `head_dim` when given, else HF's default for the architecture (Qwen3: 128;
    /// the others: `hidden_size / num_attention_heads`).
    pub fn head_dim(&self) -> usize {
        match self.head_dim {
            Some(d) => d,
            None if Architecture::from_model_type(&self.model_type) == Some(Architecture::Qwen3) => QWEN3_HEAD_DIM,
            None => self.hidden_size / self.num_attention_heads.max(1),
        }
    }

    /// Width of all key (or value) heads of one token.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads() * self.head_dim()
    }

    /// Width of all query heads of one token.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim()
    }

    /// Whether `other` computes the same function shape for shape: equal once the defaults each leaves implicit
    /// (`head_dim`, `num_key_value_heads`) are filled in, as a checkpoint written and read back has them.
    pub fn same_architecture(&self, other: &Self) -> bool {
        let resolved =
            |c: &Self| Self { head_dim: Some(c.head_dim()), num_key_value_heads: Some(c.kv_heads()), ..c.clone() };
        resolved(self) == resolved(other)
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
        let derived_head_dim = self.head_dim.is_none() && !self.qk_norm();
        if derived_head_dim && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
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
        if self.mlp_bias && self.model_type == "llama" {
            return Err(invalid("mlp_bias", true, "MLP biases are not supported"));
        }
        if self.use_sliding_window == Some(true) {
            return Err(invalid("use_sliding_window", true, "sliding-window attention is not supported"));
        }
        if let Some(types) = &self.layer_types {
            if let Some(bad) = types.iter().find(|t| *t != "full_attention") {
                return Err(invalid("layer_types", bad, "only full_attention layers are supported"));
            }
            if types.len() != self.num_hidden_layers {
                return Err(invalid("layer_types", types.len(), "must have one entry per layer"));
            }
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
            // The flags in the saved model_type's terms: Mistral, saved as Llama, has neither kind of bias.
            obj.insert("attention_bias".into(), (self.attention_bias && self.model_type != "mistral").into());
            obj.insert("mlp_bias".into(), (self.mlp_bias && self.model_type == "llama").into());
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
            attention_bias: false,
            mlp_bias: false,
            use_sliding_window: None,
            layer_types: None,
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
    fn parses_qwen3_configs_as_transformers_writes_them() {
        // transformers 5: `rope_parameters`, `layer_types`, `use_sliding_window`; Qwen3's head_dim is its own.
        let text = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":1024,
            "intermediate_size":3072,"num_hidden_layers":2,"num_attention_heads":16,"num_key_value_heads":8,
            "head_dim":128,"vocab_size":151936,"rms_norm_eps":1e-6,"attention_bias":false,"sliding_window":null,
            "use_sliding_window":false,"max_window_layers":28,"layer_types":["full_attention","full_attention"],
            "rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"},"tie_word_embeddings":true}"#;
        let cfg = LlamaConfig::from_json(text, "x".as_ref()).unwrap();
        assert_eq!(cfg.architecture().unwrap(), Architecture::Qwen3);
        assert!(cfg.qk_norm());
        assert_eq!((cfg.head_dim(), cfg.q_dim(), cfg.kv_dim()), (128, 2048, 1024));
        assert_eq!(cfg.rope_theta, 1_000_000.0);
        assert_eq!(cfg.rope_scaling, None);
        assert_eq!(cfg.attention_bias().unwrap(), AttentionBias { qkv: false, o: false });
        let back = cfg.to_hf_json("float32").unwrap();
        assert_eq!(
            (back["architectures"][0].as_str(), back["head_dim"].as_u64()),
            (Some("Qwen3ForCausalLM"), Some(128))
        );
        assert_eq!(back["rope_theta"], 1_000_000.0);
        let again: LlamaConfig = serde_json::from_value(back).unwrap();
        assert_eq!(again, cfg);

        // Without head_dim a Qwen3 config means HF's default 128, not hidden / heads.
        let mut c = LlamaConfig::tiny(16, 64, 2);
        c.model_type = "qwen3".into();
        assert_eq!(c.head_dim(), 128);
        c.validate().unwrap();
        c.attention_bias = true;
        assert_eq!(c.attention_bias().unwrap(), AttentionBias { qkv: true, o: true });
        c.model_type = "qwen2".into();
        assert_eq!(c.attention_bias().unwrap(), AttentionBias { qkv: true, o: false }, "Qwen2 ignores the flag");
        c.model_type = "mistral".into();
        assert_eq!(c.attention_bias().unwrap(), AttentionBias::default(), "Mistral ignores the flag");
        assert_eq!(c.head_dim(), 16);
    }

    #[test]
    fn rope_parameters_and_legacy_type_keys_are_read() {
        let base = r#""model_type":"llama","hidden_size":64,"intermediate_size":96,"num_hidden_layers":1,
            "num_attention_heads":4,"vocab_size":16"#;
        let scaled = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        };
        let v5 = format!(
            r#"{{{base},"rope_parameters":{{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,
            "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":32}}}}"#
        );
        let cfg = LlamaConfig::from_json(&v5, "x".as_ref()).unwrap();
        assert_eq!((cfg.rope_theta, cfg.rope_scaling.clone()), (500_000.0, Some(scaled)));
        let legacy = format!(r#"{{{base},"rope_theta":20000.0,"rope_scaling":{{"type":"linear","factor":2.0}}}}"#);
        let cfg = LlamaConfig::from_json(&legacy, "x".as_ref()).unwrap();
        assert_eq!((cfg.rope_theta, cfg.rope_scaling), (20_000.0, Some(RopeScaling::Linear { factor: 2.0 })));
        let default = format!(r#"{{{base},"rope_scaling":{{"rope_type":"default"}}}}"#);
        assert_eq!(LlamaConfig::from_json(&default, "x".as_ref()).unwrap().rope_scaling, None);
        let yarn = format!(r#"{{{base},"rope_parameters":{{"rope_type":"yarn","factor":4.0}}}}"#);
        assert!(matches!(LlamaConfig::from_json(&yarn, "x".as_ref()), Err(Error::Malformed { .. })));
    }

    #[test]
    fn rejects_what_is_not_implemented() {
        let mut cfg = LlamaConfig::tiny(16, 32, 2);
        cfg.model_type = "qwen3".into();
        cfg.use_sliding_window = Some(true);
        assert!(matches!(cfg.validate(), Err(Error::InvalidConfig { field, .. }) if field == "use_sliding_window"));
        cfg.use_sliding_window = Some(false);
        cfg.layer_types = Some(vec!["full_attention".into(), "sliding_attention".into()]);
        assert!(matches!(cfg.validate(), Err(Error::InvalidConfig { field, .. }) if field == "layer_types"));
        cfg.layer_types = Some(vec!["full_attention".into()]);
        assert!(matches!(cfg.validate(), Err(Error::InvalidConfig { field, .. }) if field == "layer_types"));
        cfg.layer_types = None;
        cfg.mlp_bias = true;
        cfg.validate().unwrap(); // Qwen3's modeling code has no MLP biases whatever the flag says
        cfg.model_type = "llama".into();
        cfg.head_dim = Some(8);
        assert!(matches!(cfg.validate(), Err(Error::InvalidConfig { field, .. }) if field == "mlp_bias"));
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
