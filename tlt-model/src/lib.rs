//! # tlt-model
//!
//! A Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) on [candle](https://github.com/huggingface/candle), shaped for
//! speculative decoding and RL:
//!
//! - weights are read-only (`&self`); all per-sequence state lives in an explicit, batched [`KvCache`];
//! - one batched [`Llama::forward`] serves prefill, ragged single-token decode and **tree verification**
//!   (depth-based positions, ancestor-only attention, tentative cache entries kept by [`KvCache::commit`]);
//! - [`Tap`]s return hidden states at chosen layers (EAGLE-3 reads layers 2, L/2, L-3 and the final norm);
//! - [`Llama::forward_train`] is differentiable end to end for policy-gradient training; its building blocks
//!   (RMSNorm, RoPE, GQA repeat, causal mask, linear) are public in [`nn`] for other training forwards;
//! - checkpoints load from HF (`config.json` + safetensors, sharded or not, + `tokenizer.json`) and from GGUF
//!   (dequantized, with llama.cpp's q/k permutation undone and the embedded tokenizer rebuilt), and save as HF
//!   safetensors that `transformers` loads.
//!
//! ```
//! use tlt_model::{Llama, LlamaConfig, LogitsFor, SeqInput};
//!
//! # fn main() -> tlt_model::Result<()> {
//! let model = Llama::random(LlamaConfig::tiny(32, 64, 2), 0)?;
//! let mut cache = model.new_cache();
//! let seq = cache.add_sequence();
//! let logits = model.prefill(&mut cache, seq, &[1, 2, 3])?;
//! assert_eq!(logits.dims(), &[32]);
//! // Verify a 3-node tree: node 0 follows the prefix, nodes 1 and 2 are alternative children of node 0.
//! let tree = [None, Some(0), Some(0)];
//! let out = model.forward(&mut cache, &[SeqInput { seq, tokens: &[4, 5, 6], tree: Some(&tree), logits: LogitsFor::All }], &[])?;
//! assert_eq!(out.logits.dims(), &[3, 32]);
//! cache.commit(seq, &[0, 2])?; // keep node 0 and its child node 2
//! assert_eq!(cache.len(seq)?, 5);
//! # Ok(()) }
//! ```
//!
//! # Features
//! None yet: the crate is CPU-only and f32 at compute time.

pub mod assets;
mod cache;
pub mod chaos;
mod config;
pub mod cuda;
mod device;
pub mod device_step;
mod error;
mod gguf;
mod gguf_check;
mod hf;
mod init;
mod linear;
mod model;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod peft;
mod tokenizer;
mod train;
mod weights;

pub use cache::{KvCache, SeqId};
pub use config::{Architecture, AttentionBias, EosTokens, LlamaConfig, RopeScaling};
pub use device::Device;
pub use error::{Error, Result};
pub use gguf::{hf_to_gguf_name, load_gguf, load_gguf_with, unpermute_rows, GgufFile, GgufWeights};
pub use hf::{atomic_write, load_hf_dir, recover_dir, save_hf_dir, write_dir_atomic};
pub use model::{ForwardOutput, Llama, LogitsFor, SeqInput, Tap};
pub use tlt_kernels::WeightDType;
pub use tokenizer::{
    byte_tokenizer, decode, encode, load_tokenizer_json, tokenizer_from_gguf_vocab, GgufVocab, BYTE_TOKENIZER_SPECIALS,
};
pub use train::{accumulate_grads, Checkpoints};
pub use weights::{LayerWeights, Linear, LlamaWeights, ProjectionShape, Projections, QkNorm, TensorSource};

/// A model with what came with it in the checkpoint.
#[derive(Debug)]
pub struct LoadedModel {
    /// The decoder.
    pub model: Llama,
    /// The tokenizer, when the checkpoint carries one.
    pub tokenizer: Option<tokenizers::Tokenizer>,
    /// The chat template (GGUF `tokenizer.chat_template`), when present.
    pub chat_template: Option<String>,
}

/// Loads a model from a `.gguf` file or an HF checkpoint directory.
pub fn load(path: &std::path::Path) -> Result<LoadedModel> {
    if path.is_dir() {
        load_hf_dir(path)
    } else {
        load_gguf(path)
    }
}

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
