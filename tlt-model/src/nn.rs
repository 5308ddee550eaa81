//! Differentiable building blocks for training forwards (candle autograd), shared with `tlt-drafter`.
//!
//! candle-nn's fused `softmax_last_dim`, `rms_norm` and `rope` kernels silently cut gradients, so these are
//! written with differentiable primitives. `candle_nn::ops::softmax` and `candle_nn::ops::log_softmax` (not the
//! `_last_dim` variants) are built from primitives too and are safe to use.
//!
//! Layouts follow Hugging Face: linear weights `[out, in]`, attention tensors `[batch, heads, seq, head_dim]`,
//! RoPE with the `rotate_half` convention (dimension `j` pairs with `j + head_dim / 2`).

use candle_core::{DType, Device, Tensor, D};

use crate::weights::Linear;
use crate::Result;

/// `x W^T (+ b)` for `x: [.., in]` and a [`Linear`] with weight `[out, in]`; returns `[.., out]`.
pub fn linear(x: &Tensor, lin: &Linear) -> Result<Tensor> {
    let y = x.broadcast_matmul(&lin.weight.t()?)?;
    Ok(match &lin.bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// RMSNorm over the last dimension, scaled by `w` (`[.., hidden]` with `w: [hidden]`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

/// `[seq, head_dim]` cos and sin for positions `0..t` in the HF layout (the half-table repeated twice).
pub fn rope_tensors(inv_freq: &[f64], t: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
    let positions: Vec<usize> = (0..t).collect();
    rope_tensors_at(inv_freq, &positions, dtype, dev)
}

/// `[positions.len(), head_dim]` cos and sin for arbitrary positions, HF layout. Reshape them to
/// `[batch, 1, seq, head_dim]` for per-sequence positions; [`rope`] broadcasts either form.
pub fn rope_tensors_at(inv_freq: &[f64], positions: &[usize], dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    let n = positions.len();
    let (mut cos, mut sin) = (Vec::with_capacity(n * 2 * half), Vec::with_capacity(n * 2 * half));
    for &p in positions {
        for _ in 0..2 {
            for f in inv_freq {
                cos.push((p as f64 * f).cos());
                sin.push((p as f64 * f).sin());
            }
        }
    }
    let mk = |v: Vec<f64>| -> Result<Tensor> { Ok(Tensor::from_vec(v, (n, 2 * half), dev)?.to_dtype(dtype)?) };
    Ok((mk(cos)?, mk(sin)?))
}

/// HF rotary embedding of `x: [batch, heads, seq, head_dim]` with cos/sin broadcastable to it
/// (`[seq, head_dim]` or `[batch, 1, seq, head_dim]`).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

/// Repeats each key/value head `n_rep` times (GQA): `[b, kv_heads, t, d]` -> `[b, kv_heads * n_rep, t, d]`,
/// head `h` of the output reading kv head `h / n_rep` (HF `repeat_kv`).
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, kvh, t, d) = x.dims4()?;
    Ok(Tensor::cat(&vec![x; n_rep], 2)?.reshape((b, kvh * n_rep, t, d))?)
}

/// `[t, t]` additive causal mask: 0 where key `j <= i`, `-inf` above the diagonal.
pub fn causal_mask(t: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let data: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Ok(Tensor::from_vec(data, (t, t), dev)?.to_dtype(dtype)?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests: a panic is the failure report.
mod tests {
    use super::*;

    #[test]
    fn rope_at_positions_matches_prefix_table() {
        let inv = [1.0, 0.1, 0.01];
        let (c, s) = rope_tensors(&inv, 5, DType::F64, &Device::Cpu).unwrap();
        let (c2, s2) = rope_tensors_at(&inv, &[3, 4], DType::F64, &Device::Cpu).unwrap();
        assert_eq!(c.narrow(0, 3, 2).unwrap().to_vec2::<f64>().unwrap(), c2.to_vec2::<f64>().unwrap());
        assert_eq!(s.narrow(0, 3, 2).unwrap().to_vec2::<f64>().unwrap(), s2.to_vec2::<f64>().unwrap());
    }

    #[test]
    fn repeat_kv_interleaves_like_hf() {
        let x = Tensor::arange(0f32, 4.0, &Device::Cpu).unwrap().reshape((1, 2, 2, 1)).unwrap();
        let y = repeat_kv(&x, 2).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(y, vec![0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]);
    }
}
