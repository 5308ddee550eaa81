//! The differentiable training forward (candle autograd).
//!
//! candle-nn's fused `softmax_last_dim`, `rms_norm` and `rope` kernels silently cut gradients, so this module
//! builds RMSNorm, RoPE and softmax from differentiable primitives.

use candle_core::{DType, Device, Tensor, Var, D};

use crate::model::Llama;
use crate::Result;

impl Llama {
    /// Causal forward over a right-padded batch `ids: [batch, seq]` (u32) at positions `0..seq`;
    /// returns `[batch, seq, vocab]` logits in the weights' dtype. Differentiable w.r.t. every weight.
    pub fn forward_train(&self, ids: &Tensor) -> Result<Tensor> {
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
        let xn = rms_norm(&x, &w.norm, eps)?;
        Ok(xn.broadcast_matmul(&w.lm_head().t()?)?)
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

    /// Converts every parameter to `dtype` (e.g. f64 for gradient checks). Inference needs f32.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let mut out = self.clone();
        for (_, t) in out.weights_mut().entries_mut() {
            *t = t.to_dtype(dtype)?;
        }
        Ok(out)
    }
}

fn linear(x: &Tensor, lin: &crate::Linear) -> Result<Tensor> {
    let y = x.broadcast_matmul(&lin.weight.t()?)?;
    Ok(match &lin.bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

/// `[seq, head_dim]` cos and sin in the HF layout (the half-table repeated twice).
fn rope_tensors(inv_freq: &[f64], t: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    let (mut cos, mut sin) = (Vec::with_capacity(t * 2 * half), Vec::with_capacity(t * 2 * half));
    for p in 0..t {
        for _ in 0..2 {
            for f in inv_freq {
                cos.push((p as f64 * f).cos());
                sin.push((p as f64 * f).sin());
            }
        }
    }
    let mk = |v: Vec<f64>| -> Result<Tensor> { Ok(Tensor::from_vec(v, (t, 2 * half), dev)?.to_dtype(dtype)?) };
    Ok((mk(cos)?, mk(sin)?))
}

/// HF rotary embedding on `[batch, heads, seq, head_dim]`.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, kvh, t, d) = x.dims4()?;
    Ok(Tensor::cat(&vec![x; n_rep], 2)?.reshape((b, kvh * n_rep, t, d))?)
}

fn causal_mask(t: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let data: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Ok(Tensor::from_vec(data, (t, t), dev)?.to_dtype(dtype)?)
}
