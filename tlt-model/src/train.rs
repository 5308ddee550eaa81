//! The differentiable training forward (candle autograd).
//!
//! candle-nn's fused `softmax_last_dim`, `rms_norm` and `rope` kernels silently cut gradients, so this module
//! builds RMSNorm, RoPE and softmax from differentiable primitives (see [`crate::nn`]).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var, D};

use crate::model::Llama;
use crate::nn::{causal_mask, linear, repeat_kv, rms_norm, rope, rope_tensors};
use crate::weights::LayerWeights;
use crate::{Error, Result};

/// What every decoder layer of one training forward shares: shapes, rotary tables and the causal mask.
#[derive(Debug, Clone)]
struct LayerCtx {
    b: usize,
    t: usize,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor,
}

impl LayerCtx {
    fn new(m: &Llama, ids: &Tensor) -> Result<Self> {
        let (b, t) = ids.dims2()?;
        let w = m.weights();
        let (dtype, dev) = (w.embed_tokens.dtype(), w.embed_tokens.device().clone());
        let (cos, sin) = rope_tensors(m.inv_freq(), t, dtype, &dev)?;
        let mask = causal_mask(t, dtype, &dev)?;
        Ok(Self { b, t, cos, sin, mask })
    }

    /// `[b, t, hidden]` token embeddings.
    fn embed(&self, m: &Llama, ids: &Tensor) -> Result<Tensor> {
        let e = m.weights().embed_tokens.index_select(&ids.flatten_all()?, 0)?;
        Ok(e.reshape((self.b, self.t, m.config().hidden_size))?)
    }

    /// One decoder layer (attention and MLP with their residuals) from differentiable primitives.
    fn layer(&self, m: &Llama, lw: &LayerWeights, x: &Tensor) -> Result<Tensor> {
        let cfg = m.config();
        let (b, t) = (self.b, self.t);
        let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let eps = cfg.rms_norm_eps;
        let xn = rms_norm(x, &lw.input_layernorm, eps)?;
        let heads = |lin: &crate::Linear, n: usize| -> Result<Tensor> {
            Ok(linear(&xn, lin)?.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous()?)
        };
        let (q, k) = (heads(&lw.proj.q_proj, nh)?, heads(&lw.proj.k_proj, nkv)?);
        // Qwen3: each head's query and key vector RMS-normalised before RoPE.
        let (q, k) = match &lw.qk_norm {
            Some(n) => (rms_norm(&q, &n.q_norm, eps)?, rms_norm(&k, &n.k_norm, eps)?),
            None => (q, k),
        };
        let q = rope(&q, &self.cos, &self.sin)?;
        let k = repeat_kv(&rope(&k, &self.cos, &self.sin)?, nh / nkv)?;
        let v = repeat_kv(&heads(&lw.proj.v_proj, nkv)?, nh / nkv)?;
        let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&self.mask)?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let attn = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, nh * hd))?;
        let x = (x + linear(&attn, &lw.proj.o_proj)?)?;
        let xn = rms_norm(&x, &lw.post_attention_layernorm, eps)?;
        let act = (candle_nn::ops::silu(&linear(&xn, &lw.proj.gate_proj)?)? * linear(&xn, &lw.proj.up_proj)?)?;
        Ok((x + linear(&act, &lw.proj.down_proj)?)?)
    }
}

/// Accumulates the gradients of one backward pass into `acc` (the first pass's become `acc`), every kept gradient
/// detached: candle builds a leaf's gradient from the forward's tensors, so a kept gradient would keep that whole
/// graph alive until the optimizer step.
///
/// # Errors
/// Tensor errors (mismatched shapes for the same tensor).
pub fn accumulate_grads(acc: &mut Option<GradStore>, mut grads: GradStore) -> Result<()> {
    match acc {
        Some(a) => add_grads(a, &grads),
        None => {
            let ids: Vec<_> = grads.get_ids().copied().collect();
            for id in ids {
                if let Some(g) = grads.get_id(id).map(Tensor::detach) {
                    grads.insert_id(id, g);
                }
            }
            *acc = Some(grads);
            Ok(())
        }
    }
}

/// Adds every gradient of `other` into `into`, detached (see [`accumulate_grads`]).
fn add_grads(into: &mut GradStore, other: &GradStore) -> Result<()> {
    let ids: Vec<_> = other.get_ids().copied().collect();
    for id in ids {
        let Some(g) = other.get_id(id) else { continue };
        let sum = match into.get_id(id) {
            Some(old) => (old + g)?,
            None => g.clone(),
        };
        into.insert_id(id, sum.detach());
    }
    Ok(())
}

/// The layer inputs a checkpointed forward kept ([`Llama::forward_train_hidden_checkpointed`]).
#[derive(Debug)]
pub struct Checkpoints {
    ids: Tensor,
    ctx: LayerCtx,
    inputs: Vec<Tensor>,
    last: Var,
}

impl Checkpoints {
    /// Completes the backward pass of a loss built on the checkpointed hidden states: `grads` is that loss's
    /// `backward()`; the result adds the gradients of every decoder layer and of the embedding, recomputing each
    /// layer's forward from its kept input, last layer first. `model` must be the model of the forward.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `grads` holds no gradient for the checkpointed states (the loss did not use them),
    /// and tensor errors.
    pub fn backward(self, model: &Llama, grads: GradStore) -> Result<GradStore> {
        let mut acc = None;
        self.backward_into(model, grads, &mut acc)?;
        acc.ok_or_else(|| Error::InvalidInput("Checkpoints::backward: no gradient".into()))
    }

    /// [`Self::backward`], accumulating every gradient into `acc` as it is computed ([`accumulate_grads`]):
    /// `grads` first (the loss's gradients above the checkpointed states), then one layer at a time, then the
    /// embedding. Peak memory is `acc` plus one layer's gradients, where [`Self::backward`] followed by
    /// [`accumulate_grads`] holds a second copy of every gradient.
    ///
    /// # Errors
    /// As [`Self::backward`].
    pub fn backward_into(self, model: &Llama, mut grads: GradStore, acc: &mut Option<GradStore>) -> Result<()> {
        // Gradients of leaves can carry a graph (candle builds them from the weights): detach them so each
        // surrogate's backward reaches only its own layer.
        let mut g = grads
            .remove(self.last.as_tensor())
            .ok_or_else(|| {
                Error::InvalidInput("Checkpoints::backward: the loss does not depend on the checkpointed states".into())
            })?
            .detach();
        accumulate_grads(acc, grads)?;
        for (lw, x) in model.weights().layers.iter().zip(&self.inputs).rev() {
            let xin = Var::from_tensor(x)?;
            let y = self.ctx.layer(model, lw, xin.as_tensor())?;
            let mut lg = (y * &g)?.sum_all()?.backward()?;
            g = lg
                .remove(xin.as_tensor())
                .ok_or_else(|| Error::InvalidInput("a layer without an input gradient".into()))?
                .detach();
            accumulate_grads(acc, lg)?;
        }
        let e = self.ctx.embed(model, &self.ids)?;
        accumulate_grads(acc, (e * &g)?.sum_all()?.backward()?)
    }
}

impl Llama {
    /// Causal forward over a right-padded batch `ids: [batch, seq]` (u32) at positions `0..seq`;
    /// returns `[batch, seq, vocab]` logits in the weights' dtype. Differentiable w.r.t. every weight.
    pub fn forward_train(&self, ids: &Tensor) -> Result<Tensor> {
        let xn = self.forward_train_hidden(ids)?;
        Ok(xn.broadcast_matmul(&self.weights().lm_head().t()?)?)
    }

    /// As [`Self::forward_train`] but stops before the LM head: `[batch, seq, hidden]` final-norm states, so a
    /// caller can apply [`LlamaWeights::lm_head`](crate::LlamaWeights::lm_head) to the positions it needs only.
    pub fn forward_train_hidden(&self, ids: &Tensor) -> Result<Tensor> {
        let ctx = LayerCtx::new(self, ids)?;
        let mut x = ctx.embed(self, ids)?;
        for lw in &self.weights().layers {
            x = ctx.layer(self, lw, &x)?;
        }
        rms_norm(&x, &self.weights().norm, self.config().rms_norm_eps)
    }

    /// As [`Self::forward_train_hidden`], keeping only each decoder layer's input instead of the whole graph
    /// (activation checkpointing): the returned states are differentiable w.r.t. the final norm (and whatever the
    /// caller builds on them); [`Checkpoints::backward`] then adds the gradients of every layer and the embedding
    /// by recomputing one layer at a time. Memory: the layer inputs plus one layer's graph, instead of every
    /// layer's; compute: one more forward of the layers.
    ///
    /// # Errors
    /// Shape or dtype errors.
    pub fn forward_train_hidden_checkpointed(&self, ids: &Tensor) -> Result<(Tensor, Checkpoints)> {
        let ctx = LayerCtx::new(self, ids)?;
        let mut x = ctx.embed(self, ids)?.detach();
        let mut inputs = Vec::with_capacity(self.weights().layers.len());
        for lw in &self.weights().layers {
            let next = ctx.layer(self, lw, &x)?.detach();
            inputs.push(x);
            x = next;
        }
        let last = Var::from_tensor(&x)?;
        let h = rms_norm(last.as_tensor(), &self.weights().norm, self.config().rms_norm_eps)?;
        Ok((h, Checkpoints { ids: ids.clone(), ctx, inputs, last }))
    }

    /// Log-probabilities `[batch, seq]` of `targets[b, s]` under the logits at `ids[b, s]` (differentiable).
    pub fn token_logprobs(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = self.forward_train(ids)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        Ok(logp.gather(&targets.unsqueeze(D::Minus1)?, D::Minus1)?.squeeze(D::Minus1)?)
    }

    /// Turns every parameter into a trainable [`Var`] (in place) and returns them, named, for an optimizer.
    ///
    /// The inference forward reads the same storage, so optimizer steps are visible to it immediately
    /// (packed inference copies, which would go stale, are dropped).
    pub fn make_trainable(&mut self) -> Result<Vec<(String, Var)>> {
        self.pack_for_inference(crate::WeightDType::F32)?;
        let mut vars = Vec::new();
        for (name, t) in self.weights_mut().entries_mut() {
            let var = Var::from_tensor(t)?;
            *t = var.as_tensor().clone();
            vars.push((name, var));
        }
        Ok(vars)
    }

    /// A copy with its own weight storage: later optimizer steps on `self` do not show through (a clone shares
    /// storage). RL publishes the policy to its rollout this way.
    pub fn deep_copy(&self) -> Result<Self> {
        let mut out = self.clone();
        for (_, t) in out.weights_mut().entries_mut() {
            *t = t.copy()?;
        }
        Ok(out)
    }

    /// The same model with every parameter rounded to the nearest bf16 value (kept in f32, packed inference copies
    /// dropped): exactly the weights a bf16 device holds, so a device-vs-CPU comparison measures only the device's
    /// bf16 activations and caches.
    ///
    /// # Errors
    /// A tensor conversion failure.
    pub fn rounded_to_bf16(&self) -> Result<Self> {
        let mut out = self.clone();
        let dtype = out.weights().embed_tokens.dtype();
        for (_, t) in out.weights_mut().entries_mut() {
            *t = t.to_dtype(DType::BF16)?.to_dtype(dtype)?;
        }
        for (_, lin) in out.weights_mut().linears_mut() {
            lin.packed = None;
        }
        out.weights_mut().head_packed = None;
        Ok(out)
    }

    /// Converts every parameter to `dtype` (e.g. f64 for gradient checks). Inference needs f32.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let mut out = self.clone();
        for (_, t) in out.weights_mut().entries_mut() {
            *t = t.to_dtype(dtype)?;
        }
        Ok(out)
    }
}
