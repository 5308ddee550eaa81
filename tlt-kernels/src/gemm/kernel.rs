//! The register-tiled skinny GEMM, written once over [`Simd`] and [`Format`].
//!
//! `y[m, n] = x[m, k] · W[n, k]^T`. The outer loop walks `NR`-row panels of `W`; for each panel every block of
//! up to `MR` rows of `x` is multiplied while the panel is hot in L1, so each weight byte comes from memory once
//! per call whatever `m` is. Weights are converted to f32 in registers.

use super::format::{Format, F32};
use crate::quant::QK;
use crate::simd::Simd;

/// Largest row block of `x` computed per tile.
pub(crate) const MR: usize = 4;

/// Computes `out[i][r] = x_i · w_r` for `mr` rows of x and `NR` weight rows.
///
/// # Safety
/// `x` points at `MR_` rows of `k` f32 with stride `ldx`; each `w[r]` at a row of `k` elements of `F`.
#[inline(always)]
unsafe fn tile<S: Simd, F: Format, const MR_: usize, const NR: usize>(
    x: *const f32,
    ldx: usize,
    w: [*const F::Elem; NR],
    k: usize,
    prefetch: bool,
) -> [[f32; NR]; MR_] {
    unsafe {
        let mut acc = [[S::zero(); NR]; MR_];
        let chunks = k / QK;
        let per_chunk = QK / S::LANES;
        // Prefetch the same chunk of the next panel (rows are contiguous, so it starts NR rows further on).
        let ahead = NR * k / QK * F::CHUNK_BYTES;
        for c in 0..chunks {
            for wr in w.iter().filter(|_| prefetch) {
                let mut line = 0;
                while line < F::CHUNK_BYTES {
                    S::prefetch((*wr as *const u8).wrapping_add(ahead + c * F::CHUNK_BYTES + line));
                    line += 64;
                }
            }
            for j in 0..per_chunk {
                // Plain loops, not closures: a closure would not inherit the caller's target features.
                let mut wv = [S::zero(); NR];
                for r in 0..NR {
                    wv[r] = F::load::<S>(w[r], c, j);
                }
                let off = c * QK + j * S::LANES;
                for (i, acc_i) in acc.iter_mut().enumerate() {
                    let xv = S::load(x.add(i * ldx + off));
                    for r in 0..NR {
                        acc_i[r] = S::fma(xv, wv[r], acc_i[r]);
                    }
                }
            }
        }
        let mut out = [[0f32; NR]; MR_];
        for i in 0..MR_ {
            for r in 0..NR {
                let mut s = S::reduce_add(acc[i][r]);
                for e in chunks * QK..k {
                    s += *x.add(i * ldx + e) * F::get(w[r], e);
                }
                out[i][r] = s;
            }
        }
        out
    }
}

/// Shape of one call: `x` is `[m, k]` row-major, `w` rows hold `k` elements, `y` is `[m, n]` row-major.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Multiplies the weight rows `rows` (a sub-range of `0..n`) for all `m` rows of `x`, writing `y[.., rows]`;
/// `prefetch` asks for software prefetches of the next panel (only formats with `F::PREFETCH` issue them).
///
/// # Safety
/// `x` holds `m * k` f32; `w` holds `n` rows of `row_elems` `F::Elem` each; `y` holds `m * n` f32 and no other
/// thread writes the columns `rows` concurrently. The CPU supports `S`.
#[inline(always)]
pub(crate) unsafe fn panel_range<S: Simd, F: Format, const NR: usize>(
    x: *const f32,
    w: *const F::Elem,
    row_elems: usize,
    y: *mut f32,
    d: Dims,
    rows: std::ops::Range<usize>,
    prefetch: bool,
) {
    let prefetch = prefetch && F::PREFETCH;
    unsafe {
        let mut r0 = rows.start;
        while r0 < rows.end {
            if rows.end - r0 >= NR {
                let mut wr = [w; NR];
                for (r, p) in wr.iter_mut().enumerate() {
                    *p = w.add((r0 + r) * row_elems);
                }
                row_blocks::<S, F, NR>(x, wr, y, d, r0, prefetch);
                r0 += NR;
            } else {
                row_blocks::<S, F, 1>(x, [w.add(r0 * row_elems)], y, d, r0, prefetch);
                r0 += 1;
            }
        }
    }
}

#[inline(always)]
unsafe fn row_blocks<S: Simd, F: Format, const NR: usize>(
    x: *const f32,
    w: [*const F::Elem; NR],
    y: *mut f32,
    d: Dims,
    r0: usize,
    pf: bool,
) {
    unsafe {
        // With 32 vector registers (16-lane ISAs) a last block of 5 or 6 rows fits one tile (6 x 4 accumulators
        // + 4 weights + 1 input), instead of a 4-row tile plus a latency-bound 1- or 2-row tail.
        let wide = S::LANES >= 16 && NR <= 4;
        let mut i0 = 0;
        while i0 < d.m {
            let xi = x.add(i0 * d.k);
            let left = d.m - i0;
            let rows = match left {
                6 if wide => {
                    store(y, d.n, i0, r0, tile::<S, F, 6, NR>(xi, d.k, w, d.k, pf));
                    6
                }
                5 if wide => {
                    store(y, d.n, i0, r0, tile::<S, F, 5, NR>(xi, d.k, w, d.k, pf));
                    5
                }
                _ => {
                    match left.min(MR) {
                        4 => store(y, d.n, i0, r0, tile::<S, F, 4, NR>(xi, d.k, w, d.k, pf)),
                        3 => store(y, d.n, i0, r0, tile::<S, F, 3, NR>(xi, d.k, w, d.k, pf)),
                        2 => store(y, d.n, i0, r0, tile::<S, F, 2, NR>(xi, d.k, w, d.k, pf)),
                        _ => store(y, d.n, i0, r0, tile::<S, F, 1, NR>(xi, d.k, w, d.k, pf)),
                    }
                    MR
                }
            };
            i0 += rows;
        }
    }
}

#[inline(always)]
unsafe fn store<const MR_: usize, const NR: usize>(y: *mut f32, n: usize, i0: usize, r0: usize, v: [[f32; NR]; MR_]) {
    for (i, row) in v.iter().enumerate() {
        for (r, val) in row.iter().enumerate() {
            unsafe { *y.add((i0 + i) * n + r0 + r) = *val };
        }
    }
}

/// Dequantizes weight rows `rows` into `scratch` (f32, `k` per row) for the many-row path.
///
/// # Safety
/// As [`panel_range`]; `scratch` holds `rows.len() * k` f32.
#[inline(always)]
pub(crate) unsafe fn dequant_rows<S: Simd, F: Format>(
    w: *const F::Elem,
    row_elems: usize,
    k: usize,
    rows: std::ops::Range<usize>,
    scratch: *mut f32,
) {
    unsafe {
        for (o, r) in rows.enumerate() {
            let row = w.add(r * row_elems);
            let dst = scratch.add(o * k);
            for c in 0..k / QK {
                for j in 0..QK / S::LANES {
                    S::store(dst.add(c * QK + j * S::LANES), F::load::<S>(row, c, j));
                }
            }
            for e in (k / QK) * QK..k {
                *dst.add(e) = F::get(row, e);
            }
        }
    }
}

/// The f32 format, re-exported for the many-row path.
pub(crate) type F32Format = F32;
