//! The differentiable training forward (candle autograd).
//!
//! candle-nn's fused `softmax_last_dim`, `rms_norm` and `rope` kernels silently cut gradients, so this module
//! builds RMSNorm, RoPE and softmax from differentiable primitives (see [`crate::nn`]).

use candle_core::{DType, Tensor, Var, D};

use crate::model::Llama;
use crate::nn::{causal_mask, linear, repeat_kv, rms_norm, rope, rope_tensors};
use crate::Result;

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
        let cfg = self.config();
        let w = self.weights();
        let (b, t) = ids.dims2()?;
        let dtype = w.embed_tokens.dtype();
        let dev = w.embed_tokens.device().clone();
        let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let eps = cfg.rms_norm_eps;

        let (cos, sin) = rope_tensors(self.inv_freq(), t, dtype, &dev)?;
        let mask = causal_mask(t, dtype, &dev)?;
        let mut x = w.embed_tokens.index_select(&ids.flatten_all()?, 0)?.reshape((b, t, cfg.hidden_size))?;
        for lw in &w.layers {
            let xn = rms_norm(&x, &lw.input_layernorm, eps)?;
            let heads = |lin: &crate::Linear, n: usize| -> Result<Tensor> {
                Ok(linear(&xn, lin)?.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous()?)
            };
            let q = rope(&heads(&lw.q_proj, nh)?, &cos, &sin)?;
            let k = repeat_kv(&rope(&heads(&lw.k_proj, nkv)?, &cos, &sin)?, nh / nkv)?;
            let v = repeat_kv(&heads(&lw.v_proj, nkv)?, nh / nkv)?;
            let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
            let attn = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, nh * hd))?;
            x = (x + linear(&attn, &lw.o_proj)?)?;
            let xn = rms_norm(&x, &lw.post_attention_layernorm, eps)?;
            let act = (candle_nn::ops::silu(&linear(&xn, &lw.gate_proj)?)? * linear(&xn, &lw.up_proj)?)?;
            x = (x + linear(&act, &lw.down_proj)?)?;
        }
        rms_norm(&x, &w.norm, eps)
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

    /// Converts every parameter to `dtype` (e.g. f64 for gradient checks). Inference needs f32.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let mut out = self.clone();
        for (_, t) in out.weights_mut().entries_mut() {
            *t = t.to_dtype(dtype)?;
        }
        Ok(out)
    }
}
