//! The reference implementations benchmarks compare against: candle-transformers' own Llama, built from the very
//! tensors our model holds (same dequantized f32 weights, shared storage), and candle-transformers' quantized Llama
//! loaded from a GGUF.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_transformers::models::llama::{Cache, Config, Llama, LlamaEosToks};
use candle_transformers::models::quantized_llama::ModelWeights;
use tlt_model::{Architecture, EosTokens};

/// candle-transformers' Llama with its configuration.
pub struct CandleLlama {
    model: Llama,
    cfg: Config,
}

/// candle-transformers' configuration for one of our models, or why it cannot express it.
fn config(cfg: &tlt_model::LlamaConfig) -> Result<Config> {
    if cfg.architecture()? != Architecture::Llama {
        bail!("candle-transformers' Llama has no q/k/v biases; only llama-architecture models compare");
    }
    if cfg.head_dim() * cfg.num_attention_heads != cfg.hidden_size {
        bail!("candle-transformers' Llama requires head_dim * heads == hidden_size");
    }
    if cfg.rope_scaling.is_some() {
        bail!("rope scaling is not mapped to candle-transformers' Llama");
    }
    Ok(Config {
        hidden_size: cfg.hidden_size,
        intermediate_size: cfg.intermediate_size,
        vocab_size: cfg.vocab_size,
        num_hidden_layers: cfg.num_hidden_layers,
        num_attention_heads: cfg.num_attention_heads,
        num_key_value_heads: cfg.kv_heads(),
        use_flash_attn: false,
        rms_norm_eps: cfg.rms_norm_eps,
        rope_theta: cfg.rope_theta as f32,
        bos_token_id: cfg.bos_token_id,
        eos_token_id: cfg.eos_token_id.as_ref().map(|e| match e {
            EosTokens::One(id) => LlamaEosToks::Single(*id),
            EosTokens::Many(ids) => LlamaEosToks::Multiple(ids.clone()),
        }),
        rope_scaling: None,
        max_position_embeddings: cfg.max_position_embeddings,
        tie_word_embeddings: cfg.tie_word_embeddings,
    })
}

impl CandleLlama {
    /// Builds candle-transformers' Llama over `model`'s tensors (HF names; a tied head reuses the embedding).
    pub fn from_model(model: &tlt_model::Llama) -> Result<Self> {
        let cfg = config(model.config())?;
        let map: HashMap<String, Tensor> = model.weights().named_tensors().into_iter().collect();
        let vb = candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
        let model = Llama::load(vb, &cfg)?;
        Ok(Self { model, cfg })
    }

    /// A fresh KV cache (kv caching on).
    pub fn new_cache(&self) -> Result<Cache> {
        Ok(Cache::new(true, DType::F32, &self.cfg, &Device::Cpu)?)
    }

    /// Forward of `[batch, len]` tokens at position `pos` for every row; returns `[batch, vocab]` last-token logits.
    pub fn forward(&self, cache: &mut Cache, tokens: &[u32], batch: usize, pos: usize) -> Result<Tensor> {
        let len = tokens.len().checked_div(batch).unwrap_or(0);
        if len == 0 || len * batch != tokens.len() {
            bail!("{} tokens do not split into {batch} equal non-empty rows", tokens.len());
        }
        let ids = Tensor::from_slice(tokens, (batch, len), &Device::Cpu)?;
        Ok(self.model.forward(&ids, pos, cache)?)
    }
}

/// candle-transformers' quantized Llama (`quantized_llama::ModelWeights`), batch 1; it keeps its KV cache inside.
pub struct CandleQuantLlama {
    model: ModelWeights,
}

impl CandleQuantLlama {
    /// Loads a llama-architecture GGUF with `ModelWeights::from_gguf`.
    pub fn load(path: &Path) -> Result<Self> {
        let mut file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let content = gguf_file::Content::read(&mut file).with_context(|| format!("reading {}", path.display()))?;
        Ok(Self { model: ModelWeights::from_gguf(content, &mut file, &Device::Cpu)? })
    }

    /// Empties the KV cache (before a new sequence).
    pub fn reset(&mut self) {
        self.model.clear_kv_cache();
    }

    /// Forward of one sequence's `tokens` at position `pos`; returns `[1, vocab]` last-token logits.
    pub fn forward(&mut self, tokens: &[u32], pos: usize) -> Result<Tensor> {
        let ids = Tensor::from_slice(tokens, (1, tokens.len()), &Device::Cpu)?;
        Ok(self.model.forward(&ids, pos)?)
    }
}

/// GGUF `general.file_type` of a model whose matrices are all `dtype` (llama.cpp's `LLAMA_FTYPE_MOSTLY_*`).
fn file_type(dtype: GgmlDType) -> Option<u32> {
    match dtype {
        GgmlDType::F32 => Some(0),
        GgmlDType::F16 => Some(1),
        GgmlDType::Q4_0 => Some(2),
        GgmlDType::Q4_1 => Some(3),
        GgmlDType::Q8_0 => Some(7),
        _ => None,
    }
}

/// Where the copy of the GGUF `src` re-written in format `name` (`q8_0`, `f32`) lives:
/// `<cache>/requant/<stem>.<NAME>.gguf`.
pub fn requant_path(src: &Path, name: &str) -> anyhow::Result<std::path::PathBuf> {
    let stem = src.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    Ok(crate::env::cache_dir()?.join("requant").join(format!("{stem}.{}.gguf", name.to_ascii_uppercase())))
}

/// Writes `dst`, a copy of the GGUF `src` whose matrices are re-quantized to `dtype`: every tensor is read with
/// `gguf_file::Content`, dequantized to f32 and quantized again with `QTensor::quantize`; 1-D tensors (norm weights)
/// and matrices whose rows do not split into `dtype`'s blocks stay f32. Metadata is copied (`general.file_type`
/// updated). Does nothing when `dst` exists (it is written under a temporary name, then renamed).
pub fn requantize_gguf(src: &Path, dst: &Path, dtype: GgmlDType) -> Result<()> {
    if dst.exists() {
        return Ok(());
    }
    let mut file = std::fs::File::open(src).with_context(|| format!("opening {}", src.display()))?;
    let content = gguf_file::Content::read(&mut file).with_context(|| format!("reading {}", src.display()))?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let t = content.tensor(&mut file, name, &Device::Cpu)?.dequantize(&Device::Cpu)?;
        let blocked = t.rank() >= 2 && t.dims().last().is_some_and(|&k| k % dtype.block_size() == 0);
        let target = if blocked { dtype } else { GgmlDType::F32 };
        tensors.push((name.as_str(), QTensor::quantize(&t, target)?));
    }
    let file_type = file_type(dtype).map(gguf_file::Value::U32);
    let mut metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| match (k.as_str(), &file_type) {
            ("general.file_type", Some(ft)) => (k.as_str(), ft),
            _ => (k.as_str(), v),
        })
        .collect();
    metadata.sort_by_key(|(k, _)| *k);
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    if let Some(dir) = dst.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = dst.with_extension("gguf.partial");
    {
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        gguf_file::write(&mut out, &metadata, &tensor_refs).with_context(|| format!("writing {}", tmp.display()))?;
        std::io::Write::flush(&mut out)?;
    }
    std::fs::rename(&tmp, dst).with_context(|| format!("renaming {} to {}", tmp.display(), dst.display()))?;
    Ok(())
}
