//! An independent f64 reference of the drafter's arithmetic: plain loops over one position at a time.

#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

use candle_core::{DType, Tensor};

/// A row-major matrix.
pub type Mat = Vec<Vec<f64>>;

/// A 2-D tensor as f64 rows.
pub fn mat(t: &Tensor) -> Mat {
    t.to_dtype(DType::F64).unwrap().to_vec2().unwrap()
}
/// A 1-D tensor as f64.
pub fn vec1(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}
/// `W x` for `W: [out, in]`.
pub fn matvec(w: &Mat, x: &[f64]) -> Vec<f64> {
    w.iter().map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}
/// RMSNorm scaled by `w`.
pub fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let s = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * s * g).collect()
}
/// HF rotate-half RoPE of every head of `x` at `pos`.
pub fn rope(x: &mut [f64], hd: usize, pos: usize, inv: &[f64]) {
    for head in x.chunks_mut(hd) {
        let half = hd / 2;
        for j in 0..half {
            let (c, s) = ((pos as f64 * inv[j]).cos(), (pos as f64 * inv[j]).sin());
            let (a, b) = (head[j], head[j + half]);
            head[j] = a * c - b * s;
            head[j + half] = b * c + a * s;
        }
    }
}
/// `a + b`.
pub fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// Softmax attention of one query (all heads) over `keys`/`values` (kv heads, GQA), HF scaling.
pub fn attend(q: &[f64], keys: &[Vec<f64>], values: &[Vec<f64>], nh: usize, nkv: usize, hd: usize) -> Vec<f64> {
    let mut attn = vec![0f64; nh * hd];
    for h in 0..nh {
        let kvh = h / (nh / nkv);
        let qh = &q[h * hd..(h + 1) * hd];
        let s: Vec<f64> = keys
            .iter()
            .map(|k| qh.iter().zip(&k[kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt())
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for (p, v) in s.iter().zip(values) {
            for j in 0..hd {
                attn[h * hd + j] += (p - m).exp() / z * v[kvh * hd + j];
            }
        }
    }
    attn
}

/// SwiGLU MLP with residual: `x + down(silu(gate(n)) * up(n))`, `n = rms(x, post)`.
pub fn mlp_residual(x: &[f64], post: &[f64], gate: &Mat, up: &Mat, down: &Mat, eps: f64) -> Vec<f64> {
    let n = rms(x, post, eps);
    let act: Vec<f64> = matvec(gate, &n).iter().zip(matvec(up, &n)).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
    add(x, &matvec(down, &act))
}
