//! Host-side layout of a padded or packed training batch: segments, positions, shifts, masks; and the
//! loss primitives both drafters share.

use candle_core::{DType, Device, Tensor, D};
use tlt_kernels::SeededRng;
use tlt_model::nn::rope_tensors_at;

use crate::config::UniformNoise;
use crate::{Error, Result};

/// A batch's token ids, loss mask and segment structure, read to the host once.
///
/// Rows are right-padded (padding carries loss mask 0) and may pack several documents, each a contiguous run
/// of one segment id: attention stays inside a segment, positions restart at 0 in each, and no shifted target
/// crosses a segment boundary.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    pub b: usize,
    pub t: usize,
    pub ids: Vec<u32>,
    seg: Vec<u32>,
    pos: Vec<usize>,
    loss_mask: Vec<f64>,
}

impl Layout {
    pub fn new(input_ids: &Tensor, loss_mask: &Tensor, segments: Option<&Tensor>, vocab: usize) -> Result<Self> {
        let (b, t) = input_ids.dims2().map_err(|_| Error::batch("input_ids", "must be [batch, seq]"))?;
        if b == 0 || t < 2 {
            return Err(Error::batch("input_ids", format!("needs batch >= 1 and seq >= 2, got [{b}, {t}]")));
        }
        if input_ids.dtype() != DType::U32 {
            return Err(Error::batch("input_ids", format!("must be u32, got {:?}", input_ids.dtype())));
        }
        let ids: Vec<u32> = input_ids.flatten_all()?.to_vec1()?;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::batch("input_ids", format!("token id {bad} >= vocab size {vocab}")));
        }
        if loss_mask.dims() != [b, t] {
            return Err(Error::batch("loss_mask", format!("shape {:?}, expected [{b}, {t}]", loss_mask.dims())));
        }
        let loss_mask: Vec<f64> = loss_mask.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        if loss_mask.iter().any(|m| !m.is_finite() || *m < 0.0) {
            return Err(Error::batch("loss_mask", "entries must be finite and >= 0"));
        }
        let seg: Vec<u32> = match segments {
            None => vec![0; b * t],
            Some(s) => {
                if s.dims() != [b, t] {
                    return Err(Error::batch("segments", format!("shape {:?}, expected [{b}, {t}]", s.dims())));
                }
                s.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?
            }
        };
        let mut pos = vec![0; b * t];
        for r in 0..b {
            let row = &seg[r * t..(r + 1) * t];
            let mut seen = Vec::new();
            for i in 0..t {
                if i > 0 && row[i] == row[i - 1] {
                    pos[r * t + i] = pos[r * t + i - 1] + 1;
                } else if seen.contains(&row[i]) {
                    return Err(Error::batch("segments", format!("row {r}: segment {} is not contiguous", row[i])));
                } else {
                    seen.push(row[i]);
                }
            }
        }
        Ok(Self { b, t, ids, seg, pos, loss_mask })
    }

    /// Each token's position inside its segment (row-major `b * t`; a segment starts at flat index `k - pos[k]`).
    pub fn positions(&self) -> &[usize] {
        &self.pos
    }

    /// Whether position `t` of row `r` has a target `s` tokens later in the same segment.
    fn shift_valid(&self, r: usize, i: usize, s: usize) -> bool {
        i + s < self.t && self.seg[r * self.t + i] == self.seg[r * self.t + i + s]
    }

    /// Token ids `s` positions ahead (0 where there is none), row-major `b * t`.
    pub fn shifted_ids(&self, s: usize) -> Vec<u32> {
        self.index_shifted(s, |k| self.ids[k], 0)
    }

    /// Loss weight of each position for a target `s` positions ahead: `loss_mask[t + s]` if it lies in the
    /// same segment, else 0.
    pub fn weights(&self, s: usize) -> Vec<f64> {
        self.index_shifted(s, |k| self.loss_mask[k], 0.0)
    }

    fn index_shifted<T: Copy>(&self, s: usize, f: impl Fn(usize) -> T, none: T) -> Vec<T> {
        let mut out = Vec::with_capacity(self.b * self.t);
        for r in 0..self.b {
            for i in 0..self.t {
                out.push(if self.shift_valid(r, i, s) { f(r * self.t + i + s) } else { none });
            }
        }
        out
    }

    /// `[b, 1, t, head_dim]` rotary cos/sin at each token's in-segment position plus `offset`.
    pub fn rope(&self, inv_freq: &[f64], offset: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
        let positions: Vec<usize> = self.pos.iter().map(|p| p + offset).collect();
        let (cos, sin) = rope_tensors_at(inv_freq, &positions, dtype, dev)?;
        let hd = 2 * inv_freq.len();
        Ok((cos.reshape((self.b, 1, self.t, hd))?, sin.reshape((self.b, 1, self.t, hd))?))
    }

    /// `[b, 1, t, t]` additive mask: causal and inside the segment.
    pub fn mask(&self, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.t;
        let mut data = vec![0f32; self.b * t * t];
        for r in 0..self.b {
            for i in 0..t {
                for j in 0..t {
                    if j > i || self.seg[r * t + i] != self.seg[r * t + j] {
                        data[(r * t + i) * t + j] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(Tensor::from_vec(data, (self.b, 1, t, t), dev)?.to_dtype(dtype)?)
    }

    /// `[b, t]` weights as a tensor and their sum.
    pub fn weight_tensor(&self, w: &[f64], dtype: DType, dev: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(w, (self.b, self.t), dev)?.to_dtype(dtype)?)
    }
}

/// Rows of `x: [b, t, d]` taken `s` positions ahead along dim 1, zero-padded at the end.
pub(crate) fn shift_rows(x: &Tensor, s: usize) -> Result<Tensor> {
    let (b, t, d) = x.dims3()?;
    if s == 0 {
        return Ok(x.clone());
    }
    let pad = Tensor::zeros((b, s.min(t), d), x.dtype(), x.device())?;
    if s >= t {
        return Ok(pad);
    }
    Ok(Tensor::cat(&[&x.narrow(1, s, t - s)?, &pad], 1)?)
}

/// `x + (U - 0.5) * std * 512 / seq_len` (EAGLE's `AddUniformNoise`), `x: [b, seq_len, d]`.
pub(crate) fn add_noise(x: &Tensor, noise: Option<&UniformNoise>) -> Result<Tensor> {
    let Some(n) = noise else { return Ok(x.clone()) };
    let (_, t, _) = x.dims3()?;
    let scale = n.std * 512.0 / t as f64;
    let mut rng = SeededRng::new(n.seed);
    let data: Vec<f64> = (0..x.elem_count()).map(|_| (rng.uniform() - 0.5) * scale).collect();
    let noise = Tensor::from_vec(data, x.shape(), x.device())?.to_dtype(x.dtype())?;
    Ok((x + noise)?)
}

/// Elementwise SmoothL1 (Huber, beta 1): `0.5 d^2` for `|d| < 1`, else `|d| - 0.5`; differentiable.
pub(crate) fn smooth_l1(d: &Tensor) -> Result<Tensor> {
    let a = d.abs()?;
    let m = a.minimum(1.0)?;
    Ok(((m.sqr()? * 0.5)? + (a - m)?)?)
}

/// Soft cross-entropy `-sum_v softmax(teacher)_v * log_softmax(student)_v` over the last dim; the teacher is
/// detached. Returns the leading dims.
pub(crate) fn soft_cross_entropy(teacher_logits: &Tensor, student_logits: &Tensor) -> Result<Tensor> {
    let p = candle_nn::ops::softmax(&teacher_logits.detach(), D::Minus1)?;
    let logq = candle_nn::ops::log_softmax(student_logits, D::Minus1)?;
    Ok((p * logq)?.sum(D::Minus1)?.neg()?)
}

/// `sum(w * per_pos) / denom` as a scalar tensor.
pub(crate) fn weighted_sum(per_pos: &Tensor, w: &Tensor, denom: f64) -> Result<Tensor> {
    Ok(((per_pos * w)?.sum_all()? / denom)?)
}

/// Argmax over the last dim of `[b, t, v]`, row-major on the host.
pub(crate) fn argmax_host(x: &Tensor) -> Result<Vec<u32>> {
    Ok(x.argmax(D::Minus1)?.flatten_all()?.to_vec1()?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests: a panic is the failure report.
mod tests {
    use super::*;

    #[test]
    fn segments_restart_positions_and_block_shifts() {
        let ids = Tensor::from_vec(vec![1u32, 2, 3, 4, 5, 6], (1, 6), &Device::Cpu).unwrap();
        let mask = Tensor::ones((1, 6), DType::F32, &Device::Cpu).unwrap();
        let seg = Tensor::from_vec(vec![0u32, 0, 0, 1, 1, 1], (1, 6), &Device::Cpu).unwrap();
        let l = Layout::new(&ids, &mask, Some(&seg), 10).unwrap();
        assert_eq!(l.pos, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(l.shifted_ids(1), vec![2, 3, 0, 5, 6, 0]);
        assert_eq!(l.weights(2), vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
        let m = l.mask(DType::F32, &Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(m[3 * 6 + 2], f32::NEG_INFINITY); // position 3 (segment 1) cannot see position 2
        assert_eq!(m[4 * 6 + 3], 0.0);
        let bad = Tensor::from_vec(vec![0u32, 1, 0, 1, 1, 1], (1, 6), &Device::Cpu).unwrap();
        assert!(Layout::new(&ids, &mask, Some(&bad), 10).is_err());
        assert!(Layout::new(&ids, &mask, None, 5).is_err());
    }

    #[test]
    fn smooth_l1_matches_definition() {
        let d = Tensor::new(&[-3.0f64, -1.0, -0.5, 0.0, 0.25, 2.0], &Device::Cpu).unwrap();
        let y = smooth_l1(&d).unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(y, vec![2.5, 0.5, 0.125, 0.0, 0.03125, 1.5]);
    }
}
