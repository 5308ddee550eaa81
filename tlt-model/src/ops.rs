//! Row-wise f32 building blocks of the inference forward (public so drafters reuse them).
//!
//! Plain, portable loops for the cheap element-wise steps; matmuls and attention live in `tlt-kernels`.

/// Cosine and sine tables, `[positions, head_dim / 2]` each.
pub fn rope_table(inv_freq: &[f64], positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
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
pub fn apply_rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
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
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(w.len()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let scale = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| v * scale * g));
    }
    out
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// `gate = silu(gate) * up`.
pub fn silu_mul_assign(gate: &mut [f32], up: &[f32]) {
    gate.iter_mut().zip(up).for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
}
