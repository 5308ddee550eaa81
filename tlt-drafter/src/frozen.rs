//! The target's embedding and LM head, shared read-only with a drafter.

use candle_core::{DType, Tensor};
use tlt_model::{Llama, LlamaWeights};

use crate::{Error, Result};

/// The target's token embedding and LM head as a drafter sees them: the same storage as the target's tensors
/// (no copy), detached from autograd (never a [`candle_core::Var`], never in a drafter's parameter list), so
/// drafter training cannot write to them while updates the target's own optimizer makes in place stay visible.
#[derive(Debug, Clone)]
pub struct FrozenTarget {
    embed_tokens: Tensor,
    lm_head: Tensor,
}

impl FrozenTarget {
    /// Shares `target`'s embedding and LM head (the embedding when tied).
    pub fn new(target: &Llama) -> Self {
        Self::from_weights(target.weights())
    }

    /// Shares the embedding and LM head of `weights`.
    pub fn from_weights(weights: &LlamaWeights) -> Self {
        Self { embed_tokens: weights.embed_tokens.detach(), lm_head: weights.lm_head().detach() }
    }

    /// From explicit `[vocab, hidden]` tensors (detached, storage shared).
    pub fn from_tensors(embed_tokens: &Tensor, lm_head: &Tensor) -> Result<Self> {
        let (v, h) = embed_tokens.dims2()?;
        if lm_head.dims() != [v, h] {
            return Err(Error::InvalidConfig {
                field: "lm_head".into(),
                value: format!("{:?}", lm_head.dims()),
                reason: "must have the embedding's shape [vocab, hidden]",
            });
        }
        if lm_head.dtype() != embed_tokens.dtype() {
            return Err(Error::config("lm_head.dtype", format!("{:?}", lm_head.dtype()), "must match the embedding"));
        }
        Ok(Self { embed_tokens: embed_tokens.detach(), lm_head: lm_head.detach() })
    }

    /// `[vocab, hidden]` token embedding.
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// `[vocab, hidden]` LM head.
    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Target vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.embed_tokens.dims().first().copied().unwrap_or(0)
    }

    /// Target hidden size.
    pub fn hidden_size(&self) -> usize {
        self.embed_tokens.dims().get(1).copied().unwrap_or(0)
    }

    /// The dtype drafter computation runs in.
    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    /// Copies converted to `dtype` (no longer shared with the target): for gradient checks in f64.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(Self { embed_tokens: self.embed_tokens.to_dtype(dtype)?, lm_head: self.lm_head.to_dtype(dtype)? })
    }

    /// `[b, t, hidden]` embeddings of `ids` (row-major `b * t`).
    /// Checks that `other` can stand in for `self` (same shapes and dtype).
    pub(crate) fn check_replacement(&self, other: &FrozenTarget) -> Result<()> {
        for (name, a, b) in
            [("embed_tokens", &self.embed_tokens, &other.embed_tokens), ("lm_head", &self.lm_head, &other.lm_head)]
        {
            if a.dims() != b.dims() || a.dtype() != b.dtype() {
                return Err(Error::config(
                    name,
                    format!("{:?} {:?}", b.dims(), b.dtype()),
                    "a replacement target must keep the shape and dtype",
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn embed(&self, ids: &[u32], b: usize, t: usize) -> Result<Tensor> {
        let idx = Tensor::from_slice(ids, ids.len(), self.embed_tokens.device())?;
        Ok(self.embed_tokens.index_select(&idx, 0)?.reshape((b, t, self.hidden_size()))?)
    }

    /// `x @ lm_head^T`: `[.., hidden]` -> `[.., vocab]` logits.
    pub(crate) fn logits(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.broadcast_matmul(&self.lm_head.t()?)?)
    }
}
