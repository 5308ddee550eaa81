//! Row-wise f32 building blocks of the inference forward.
//!
//! These are plain, portable loops; `tlt-kernels` provides the SIMD versions.

/// Shape of the attention heads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadLayout {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Cosine and sine tables, `[positions, head_dim / 2]` each.
pub(crate) fn rope_table(inv_freq: &[f64], positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &f in inv_freq {
            let angle = p as f64 * f;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Rotates every head of every row in place, HF `rotate_half` convention (pairs `j` and `j + d/2`).
pub(crate) fn apply_rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    let rows = cos.len() / half;
    let width = x.len() / rows;
    for (r, row) in x.chunks_exact_mut(width).enumerate() {
        let (c, s) = (&cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
        for head in row.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for j in 0..half {
                let (x1, x2) = (a[j], b[j]);
                a[j] = x1 * c[j] - x2 * s[j];
                b[j] = x2 * c[j] + x1 * s[j];
            }
        }
    }
}

/// RMSNorm of each row of `x` (width `w.len()`), scaled by `w`.
pub(crate) fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(w.len()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let scale = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| v * scale * g));
    }
    out
}

/// `x += y`.
pub(crate) fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// `gate = silu(gate) * up`.
pub(crate) fn silu_mul_assign(gate: &mut [f32], up: &[f32]) {
    gate.iter_mut().zip(up).for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
}

/// Attention of `n` new query rows against a sequence's cache.
///
/// `keys`/`values` hold `base` committed rows followed by the `n` new rows; new token `i` attends to all
/// committed rows and to the new rows listed in `visible[i]`.
pub(crate) fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    base: usize,
    visible: &[Vec<usize>],
    layout: HeadLayout,
    out: &mut [f32],
) {
    let HeadLayout { n_heads, n_kv_heads, head_dim: d } = layout;
    let (q_dim, kv_dim) = (n_heads * d, n_kv_heads * d);
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut scores = Vec::new();
    for (i, vis) in visible.iter().enumerate() {
        let rows = || (0..base).chain(vis.iter().map(|j| base + j));
        for h in 0..n_heads {
            let qh = &q[i * q_dim + h * d..i * q_dim + (h + 1) * d];
            let kv_off = (h / group) * d;
            scores.clear();
            scores.extend(rows().map(|r| dot(qh, &keys[r * kv_dim + kv_off..r * kv_dim + kv_off + d]) * scale));
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let oh = &mut out[i * q_dim + h * d..i * q_dim + (h + 1) * d];
            oh.fill(0.0);
            for (p, r) in scores.iter().zip(rows()) {
                let vr = &values[r * kv_dim + kv_off..r * kv_dim + kv_off + d];
                let w = p / sum;
                oh.iter_mut().zip(vr).for_each(|(o, v)| *o += w * v);
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociation flags.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}
