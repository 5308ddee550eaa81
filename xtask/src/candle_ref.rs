//! The reference implementation benchmarks compare against: candle-transformers' own Llama, built from the very
//! tensors our model holds (same dequantized f32 weights, shared storage).

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_transformers::models::llama::{Cache, Config, Llama, LlamaEosToks};
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
