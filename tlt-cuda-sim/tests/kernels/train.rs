//! The policy update's kernels (`train.cu`) executed in the simulated device with the host's launch plans, against
//! f64 references, finite differences and (AdamW) the host optimizer's arithmetic reimplemented here: RoPE equal to
//! the decoder's bit for bit and its backward the rotation's transpose, RMSNorm's, SiLU-gating's and the
//! embedding's backward, column sums, token log-probabilities with entropy and their gradient, the sum of squares.
//! The reductions must give the same bits under every schedule (interleavings, sequential, seeded block orders).

#![allow(clippy::unwrap_used, clippy::needless_range_loop, clippy::too_many_lines)] // Tests: a panic is the failure report; indices mirror the kernels.

use crate::common::{bf16_ulp, round_bf16, to_bf16, to_f32, variants, worst, Rng};
use half::bf16;
use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::plan::{self, AdamWStep, RowBufs, SUM_SQUARES_BLOCKS};
use tlt_kernels::cuda::CacheDims;
use tlt_kernels::AttnShape;

/// `dev` under every schedule the determinism checks compare: both thread orders, blocks in grid order, and two
/// other seeded block interleavings.
fn schedules(dev: &SimDevice) -> Vec<(String, SimDevice)> {
    let mut v: Vec<(String, SimDevice)> = variants(dev).into_iter().map(|(n, d)| (n.to_string(), d)).collect();
    v.push(("sequential".into(), dev.sequential()));
    for seed in [7, 1234] {
        v.push((format!("seed {seed}"), dev.with_block_seed(seed)));
    }
    v
}

fn inv_freq(hd: usize, theta: f64) -> Vec<f64> {
    (0..hd / 2).map(|i| theta.powf(-2.0 * i as f64 / hd as f64)).collect()
}

/// The sine and cosine the kernels use: the f64 angle's, rounded to f32.
fn sin_cos(pos: i32, f: f64) -> (f64, f64) {
    let (s, c) = (f64::from(pos) * f).sin_cos();
    (f64::from(s as f32), f64::from(c as f32))
}

/// RoPE (or its transpose with `back`) in f64 of the `heads` vectors from `col0` of every row; other columns kept.
#[allow(clippy::too_many_arguments)]
fn rope_ref(
    x: &[f32],
    stride: usize,
    col0: usize,
    heads: usize,
    hd: usize,
    pos: &[i32],
    f: &[f64],
    back: bool,
) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let half = hd / 2;
    for (r, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let o = r * stride + col0 + h * hd;
            for i in 0..half {
                let (s, c) = sin_cos(p, f[i]);
                let s = if back { -s } else { s };
                let (x0, x1) = (out[o + i], out[o + i + half]);
                out[o + i] = x0 * c - x1 * s;
                out[o + i + half] = x1 * c + x0 * s;
            }
        }
    }
    out
}

pub fn rope_rows_matches_f64_and_the_decode_path(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        // The q part and the k part of packed q/k/v rows (GQA), and a head dim of 128 at theta 5e5.
        for (h, kv, hd, theta) in [(4, 2, 64, 1e4), (2, 1, 128, 5e5), (1, 1, 8, 1e4)] {
            let (rows, stride) = (6, (h + 2 * kv) * hd);
            let mut rng = Rng::new(hd as u64 + h as u64);
            let x = round_bf16(&rng.vec(rows * stride, -2.0, 2.0));
            let pos: Vec<i32> = [0, 1, 17, 1000, 4095, 40_000].into();
            let f = inv_freq(hd, theta);
            let (xb, pb, fb) = (dev.upload(&to_bf16(&x)), dev.upload(&pos), dev.upload(&f));
            dev.launch(&plan::rope_rows(rows, stride, 0, h, hd, pb.buf(), fb.buf(), xb.buf()).unwrap()).unwrap();
            dev.launch(&plan::rope_rows(rows, stride, h * hd, kv, hd, pb.buf(), fb.buf(), xb.buf()).unwrap()).unwrap();
            let want = rope_ref(&x, stride, 0, h, hd, &pos, &f, false);
            let want: Vec<f32> =
                rope_ref(&want.iter().map(|&v| v as f32).collect::<Vec<_>>(), stride, h * hd, kv, hd, &pos, &f, false)
                    .iter()
                    .map(|&v| v as f32)
                    .collect();
            let got = to_f32(&xb.download());
            let (e, i) = worst(&got, &want, |_, v| bf16_ulp(v, 1e-3));
            assert!(e <= 1.0, "{order}: rope h{h} kv{kv} d{hd}: element {i} off by {e} bf16 ulps");
            // The v columns are untouched.
            for r in 0..rows {
                let v0 = r * stride + (h + kv) * hd;
                assert_eq!(got[v0..v0 + kv * hd], x[v0..v0 + kv * hd], "{order}: v columns of row {r}");
            }

            // The decoder's kernel (rope_kv_write_bf16, padded rows: q only) gives the same bits on the q heads.
            let q: Vec<f32> = (0..rows).flat_map(|r| x[r * stride..][..h * hd].to_vec()).collect();
            let qb = dev.upload(&to_bf16(&q));
            let cache = CacheDims { layers: 1, slots: 1, max_len: 4, attn: AttnShape::new(h, kv, hd) };
            let (kvb, kc, vc) = (dev.zeros::<bf16>(rows * cache.row()), dev.zeros(cache.len()), dev.zeros(cache.len()));
            let (slot, dst) = (dev.upload(&vec![-1i32; rows]), dev.upload(&vec![0i32; rows]));
            let meta = RowBufs { slot: slot.buf(), pos: pb.buf(), dst: dst.buf() };
            let l =
                plan::rope_kv_write(cache, 0, rows, qb.buf(), kvb.buf(), kvb.buf(), kc.buf(), vc.buf(), meta, fb.buf());
            dev.launch(&l.unwrap()).unwrap();
            let decoded = qb.download();
            let trained = xb.download();
            for r in 0..rows {
                assert_eq!(
                    decoded[r * h * hd..][..h * hd],
                    trained[r * stride..][..h * hd],
                    "{order}: row {r} vs decode"
                );
            }
        }
    }
    println!("rope_rows_bf16: q and k parts of packed rows, d64 GQA 2, d128 theta 5e5, d8; positions to 40,000; == rope_kv_write_bf16");
}

pub fn rope_rows_back_is_the_transpose(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (rows, stride, col0, heads, hd) in [(1, 8, 0, 1, 8), (5, 448, 64, 3, 128), (7, 300, 10, 4, 64)] {
            let mut rng = Rng::new(stride as u64);
            let pos: Vec<i32> = (0..rows).map(|_| rng.below(50_000) as i32).collect();
            let f = inv_freq(hd, 1e6);
            let (x, y) = (rng.vec(rows * stride, -1.0, 1.0), rng.vec(rows * stride, -1.0, 1.0));
            let (yb, pb, fb) = (dev.upload(&y), dev.upload(&pos), dev.upload(&f));
            let l = plan::rope_rows_back(rows, stride, col0, heads, hd, pb.buf(), fb.buf(), yb.buf()).unwrap();
            dev.launch(&l).unwrap();
            let rt_y = yb.download();
            // Against R^T y in f64.
            let want = rope_ref(&y, stride, col0, heads, hd, &pos, &f, true);
            for (i, (&g, &w)) in rt_y.iter().zip(&want).enumerate() {
                assert!((f64::from(g) - w).abs() <= 1e-6, "{order}: element {i}: {g} vs {w}");
            }
            // <R x, y> == <x, R^T y>.
            let rx = rope_ref(&x, stride, col0, heads, hd, &pos, &f, false);
            let lhs: f64 = rx.iter().zip(&y).map(|(a, &b)| a * f64::from(b)).sum();
            let rhs: f64 = x.iter().zip(&rt_y).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
            let scale: f64 = x.iter().zip(&y).map(|(&a, &b)| f64::from(a * b).abs()).sum();
            assert!((lhs - rhs).abs() <= 1e-6 * scale, "{order}: <Rx, y> = {lhs}, <x, R^T y> = {rhs}");
        }
    }
    println!("rope_rows_back_f32: == R^T y in f64 and <Rx, y> == <x, R^T y>, strided rows with col0 > 0");
}

/// `y = x * r * w` per row (RMSNorm) in f64, and the loss `sum(dy * y)`.
fn rms_loss(x: &[f64], w: &[f64], dy: &[f32], width: usize, eps: f64) -> f64 {
    let mut loss = 0.0;
    for (r, xr) in x.chunks(width).enumerate() {
        let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / width as f64 + eps).sqrt();
        for c in 0..width {
            loss += f64::from(dy[r * width + c]) * xr[c] * inv * w[c];
        }
    }
    loss
}

pub fn rms_norm_back_matches_f64_and_finite_differences(dev: &SimDevice) {
    let eps = 1e-6f32;
    for (rows, width) in [(1, 1), (3, 64), (4, 255), (2, 2048)] {
        let mut rng = Rng::new(width as u64 + 3);
        let x = rng.vec(rows * width, -2.0, 2.0);
        let w = round_bf16(&rng.vec(width, 0.5, 1.5));
        let dy = rng.vec(rows * width, -1.0, 1.0);
        let dx0 = rng.vec(rows * width, -0.5, 0.5);
        let mut bits: Option<(Vec<f32>, Vec<f32>)> = None;
        for (order, dev) in schedules(dev) {
            let (xb, wb, dyb) = (dev.upload(&x), dev.upload(&to_bf16(&w)), dev.upload(&dy));
            let (dxb, dwb) = (dev.upload(&dx0), dev.zeros::<f32>(rows * width));
            let l = plan::rms_norm_back(rows, width, eps, xb.buf(), wb.buf(), dyb.buf(), dxb.buf(), dwb.buf()).unwrap();
            dev.launch(&l).unwrap();
            let (dx, dw) = (dxb.download(), dwb.download());
            // The f64 reference.
            let (mut want_dx, mut want_dw) = (Vec::new(), Vec::new());
            for r in 0..rows {
                let o = r * width;
                let xr: Vec<f64> = x[o..o + width].iter().map(|&v| f64::from(v)).collect();
                let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / width as f64 + f64::from(eps)).sqrt();
                let g: Vec<f64> = (0..width).map(|c| f64::from(dy[o + c]) * f64::from(w[c])).collect();
                let dot: f64 = g.iter().zip(&xr).map(|(a, b)| a * b).sum();
                for c in 0..width {
                    want_dx.push(f64::from(dx0[o + c]) + inv * g[c] - xr[c] * inv.powi(3) * dot / width as f64);
                    want_dw.push(f64::from(dy[o + c]) * xr[c] * inv);
                }
            }
            for (name, got, want) in [("dx", &dx, &want_dx), ("dw_rows", &dw, &want_dw)] {
                for (i, (&g, &wv)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        (f64::from(g) - wv).abs() <= 2e-5 * (1.0 + wv.abs()),
                        "{order} {rows}x{width} {name}[{i}]: {g} vs {wv}"
                    );
                }
            }
            match &bits {
                None => bits = Some((dx, dw)),
                Some(b) => {
                    assert!(b.0 == dx && b.1 == dw, "{order} {rows}x{width}: other bits than the first schedule")
                }
            }
        }
        // Finite differences of the loss sum(dy * y) in f64: dx (from zero) at a few elements, and dw via col_sum.
        let (xb, wb, dyb) = (dev.upload(&x), dev.upload(&to_bf16(&w)), dev.upload(&dy));
        let (dxb, dwb, dwsum) =
            (dev.zeros::<f32>(rows * width), dev.zeros::<f32>(rows * width), dev.zeros::<f32>(width));
        dev.launch(
            &plan::rms_norm_back(rows, width, eps, xb.buf(), wb.buf(), dyb.buf(), dxb.buf(), dwb.buf()).unwrap(),
        )
        .unwrap();
        dev.launch(&plan::col_sum(rows, width, dwb.buf(), dwsum.buf(), false).unwrap()).unwrap();
        let (dx, dw) = (dxb.download(), dwsum.download());
        let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let w64: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
        let h = 1e-5;
        for i in [0, rows * width / 2, rows * width - 1] {
            let (mut xp, mut xm) = (x64.clone(), x64.clone());
            xp[i] += h;
            xm[i] -= h;
            let fd = (rms_loss(&xp, &w64, &dy, width, f64::from(eps))
                - rms_loss(&xm, &w64, &dy, width, f64::from(eps)))
                / (2.0 * h);
            assert!(
                (fd - f64::from(dx[i])).abs() <= 1e-4 * (1.0 + fd.abs()),
                "{rows}x{width}: dx[{i}] {} vs fd {fd}",
                dx[i]
            );
        }
        for c in [0, width / 2, width - 1] {
            let (mut wp, mut wm) = (w64.clone(), w64.clone());
            wp[c] += h;
            wm[c] -= h;
            let fd = (rms_loss(&x64, &wp, &dy, width, f64::from(eps))
                - rms_loss(&x64, &wm, &dy, width, f64::from(eps)))
                / (2.0 * h);
            assert!(
                (fd - f64::from(dw[c])).abs() <= 1e-4 * (1.0 + fd.abs()),
                "{rows}x{width}: dw[{c}] {} vs fd {fd}",
                dw[c]
            );
        }
    }
    println!("rms_norm_back_f32: rows x width 1x1, 3x64, 4x255, 2x2048 vs f64 and finite differences; same bits on 5 schedules");
}

pub fn col_sum_matches_f64_and_accumulates(dev: &SimDevice) {
    for (rows, cols) in [(0, 5), (1, 1), (7, 33), (1000, 70), (3, 4096)] {
        let mut rng = Rng::new(rows as u64 * 13 + cols as u64);
        let src = rng.vec(rows * cols, -1.0, 1.0);
        let prev = rng.vec(cols, -4.0, 4.0);
        for accumulate in [false, true] {
            let mut first: Option<Vec<f32>> = None;
            for (order, dev) in schedules(dev) {
                let (sb, db) = (dev.upload(&src), dev.upload(&prev));
                dev.launch(&plan::col_sum(rows, cols, sb.buf(), db.buf(), accumulate).unwrap()).unwrap();
                let got = db.download();
                for c in 0..cols {
                    let base = if accumulate { f64::from(prev[c]) } else { 0.0 };
                    let want = base + (0..rows).map(|r| f64::from(src[r * cols + c])).sum::<f64>();
                    let tol = f64::from(f32::EPSILON) * (want.abs() + 1e-30);
                    assert!(
                        (f64::from(got[c]) - want).abs() <= tol,
                        "{order} {rows}x{cols} acc {accumulate}: column {c}"
                    );
                }
                match &first {
                    None => first = Some(got),
                    Some(b) => assert_eq!(b, &got, "{order} {rows}x{cols}: other bits than the first schedule"),
                }
            }
        }
    }
    println!(
        "col_sum_f32: rows x cols 0x5, 1x1, 7x33, 1000x70, 3x4096, written and accumulated; same bits on 5 schedules"
    );
}

pub fn silu_mul_back_matches_f64(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        // 2 x 700,000 needs 5,469 blocks: the grid is capped at 4,096 and the loop strides.
        for (rows, inter) in [(1, 1), (3, 100), (7, 1000), (2, 700_000)] {
            let mut rng = Rng::new(inter as u64);
            let gu = round_bf16(&rng.vec(rows * 2 * inter, -8.0, 8.0));
            let d = rng.vec(rows * inter, -2.0, 2.0);
            let (gb, db, out) = (dev.upload(&to_bf16(&gu)), dev.upload(&d), dev.zeros::<bf16>(rows * 2 * inter));
            dev.launch(&plan::silu_mul_back(rows, inter, gb.buf(), db.buf(), out.buf()).unwrap()).unwrap();
            let mut want = vec![0f32; rows * 2 * inter];
            for r in 0..rows {
                for j in 0..inter {
                    let (gi, ui) = (r * 2 * inter + j, r * 2 * inter + inter + j);
                    let (g, u, dd) = (f64::from(gu[gi]), f64::from(gu[ui]), f64::from(d[r * inter + j]));
                    let s = 1.0 / (1.0 + (-g).exp());
                    want[gi] = (dd * u * s * (1.0 + g * (1.0 - s))) as f32;
                    want[ui] = (dd * g * s) as f32;
                }
            }
            let (e, i) = worst(&to_f32(&out.download()), &want, |_, v| bf16_ulp(v, 1e-4));
            assert!(e <= 1.0, "{order}: silu_mul_back {rows}x{inter}: element {i} off by {e} bf16 ulps");
        }
    }
    println!("silu_mul_back_bf16: rows x inter 1x1, 3x100, 7x1000, 2x700,000 (grid-stride) vs f64");
}

/// A row's `(lse, logp, entropy)` in f64 at inverse temperature `inv_temp`.
fn logprob_ref(row: &[f32], target: i32, inv_temp: f32) -> (f64, f64, f64) {
    let z: Vec<f64> = row.iter().map(|&v| f64::from(v * inv_temp)).collect();
    let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = z.iter().map(|&v| (v - m).exp()).sum();
    let lse = m + s.ln();
    let ent: f64 = z.iter().map(|&v| (v - lse).exp()).filter(|&p| p > 0.0).map(|p| -p * p.ln()).sum();
    let logp = if target < 0 { 0.0 } else { z[target as usize] - lse };
    (lse, logp, ent)
}

/// Logits of `rows` rows (one -inf in the second row when the vocabulary allows) and targets (row 1: -1).
fn logits_case(rows: usize, vocab: usize, seed: u64) -> (Vec<f32>, Vec<i32>) {
    let mut rng = Rng::new(seed);
    let mut x = rng.vec(rows * vocab, -6.0, 6.0);
    if vocab > 2 {
        x[vocab + 2] = f32::NEG_INFINITY;
    }
    let t = (0..rows).map(|r| if r == 1 { -1 } else { rng.below(vocab) as i32 }).collect();
    (x, t)
}

pub fn token_logprobs_match_f64(dev: &SimDevice) {
    for (vocab, inv_temp) in [(1, 1.0), (7, 1.0 / 0.7), (1000, 1.0), (49_152, 1.0 / 0.6)] {
        let rows = 3;
        let (x, t) = logits_case(rows, vocab, vocab as u64);
        let mut first: Option<Vec<f32>> = None;
        for (order, dev) in schedules(dev) {
            for with_entropy in [true, false] {
                let (xb, tb) = (dev.upload(&x), dev.upload(&t));
                let (lp, lse, ent) = (dev.zeros::<f32>(rows), dev.zeros::<f32>(rows), dev.upload(&[-9f32; 3]));
                let e = with_entropy.then(|| ent.buf());
                dev.launch(
                    &plan::token_logprobs(rows, vocab, inv_temp, xb.buf(), tb.buf(), lp.buf(), lse.buf(), e).unwrap(),
                )
                .unwrap();
                let (glp, glse, gent) = (lp.download(), lse.download(), ent.download());
                for r in 0..rows {
                    let (wl, wp, we) = logprob_ref(&x[r * vocab..][..vocab], t[r], inv_temp);
                    let ctx = format!("{order} vocab {vocab} row {r}");
                    assert!(
                        (f64::from(glse[r]) - wl).abs() <= 2e-6 * (1.0 + wl.abs()),
                        "{ctx}: lse {} vs {wl}",
                        glse[r]
                    );
                    assert!(
                        (f64::from(glp[r]) - wp).abs() <= 2e-6 * (1.0 + wp.abs()),
                        "{ctx}: logp {} vs {wp}",
                        glp[r]
                    );
                    if t[r] < 0 {
                        assert_eq!(glp[r], 0.0, "{ctx}: no target, logp 0");
                    }
                    if with_entropy {
                        assert!(
                            (f64::from(gent[r]) - we).abs() <= 2e-6 * (1.0 + we),
                            "{ctx}: entropy {} vs {we}",
                            gent[r]
                        );
                    } else {
                        assert_eq!(gent[r], -9.0, "{ctx}: entropy written without a buffer");
                    }
                }
                if with_entropy {
                    let all: Vec<f32> = glp.iter().chain(&glse).chain(&gent).copied().collect();
                    match &first {
                        None => first = Some(all),
                        Some(b) => assert_eq!(b, &all, "{order} vocab {vocab}: other bits than the first schedule"),
                    }
                }
            }
        }
    }
    println!("token_logprobs_f32: vocab 1, 7, 1000, 49,152; -inf logits, target -1, with and without entropy; same bits on 5 schedules");
}

/// Runs `token_logprobs_f32` on `x` and returns `(logp, lse, entropy)`.
fn logprobs_on(dev: &SimDevice, x: &[f32], t: &[i32], vocab: usize, inv_temp: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = t.len();
    let (xb, tb) = (dev.upload(x), dev.upload(t));
    let (lp, lse, ent) = (dev.zeros::<f32>(rows), dev.zeros::<f32>(rows), dev.zeros::<f32>(rows));
    let l = plan::token_logprobs(rows, vocab, inv_temp, xb.buf(), tb.buf(), lp.buf(), lse.buf(), Some(ent.buf()));
    dev.launch(&l.unwrap()).unwrap();
    (lp.download(), lse.download(), ent.download())
}

pub fn token_logprobs_back_matches_f64_and_finite_differences(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (vocab, inv_temp) in [(1, 1.0f32), (7, 1.0 / 0.7), (1000, 1.0), (49_152, 1.0)] {
            let rows = 3;
            let (x, t) = logits_case(rows, vocab, vocab as u64 + 1);
            let (_, lse, ent) = logprobs_on(&dev, &x, &t, vocab, inv_temp);
            let (gl, ge) = (vec![0.7f32, -1.3, 2.0], vec![-0.05f32, 0.2, 0.01]);
            for with_ent in [false, true] {
                let (xb, tb, lb, eb) = (dev.upload(&x), dev.upload(&t), dev.upload(&lse), dev.upload(&ent));
                let (glb, geb, out) = (dev.upload(&gl), dev.upload(&ge), dev.zeros::<bf16>(rows * vocab));
                let g_ent = with_ent.then(|| geb.buf());
                let l = plan::token_logprobs_back(
                    rows,
                    vocab,
                    inv_temp,
                    xb.buf(),
                    tb.buf(),
                    lb.buf(),
                    Some(eb.buf()),
                    glb.buf(),
                    g_ent,
                    out.buf(),
                );
                dev.launch(&l.unwrap()).unwrap();
                let got = to_f32(&out.download());
                for r in 0..rows {
                    let row = &x[r * vocab..][..vocab];
                    let (wl, _, we) = logprob_ref(row, t[r], inv_temp);
                    let want: Vec<f32> = (0..vocab)
                        .map(|j| {
                            let lp = f64::from(row[j] * inv_temp) - wl;
                            let p = lp.exp();
                            let mut dz = if t[r] < 0 {
                                0.0
                            } else {
                                f64::from(gl[r]) * (f64::from(u8::from(j as i32 == t[r])) - p)
                            };
                            if with_ent && p > 0.0 {
                                dz += f64::from(ge[r]) * (-p * (lp + we));
                            }
                            (dz * f64::from(inv_temp)) as f32
                        })
                        .collect();
                    let floor = want.iter().fold(0f32, |a, &b| a.max(b.abs())) * 1e-4;
                    let (e, i) = worst(&got[r * vocab..][..vocab], &want, |_, v| bf16_ulp(v, floor.max(1e-30)));
                    assert!(
                        e <= 1.0,
                        "{order} vocab {vocab} row {r} entropy {with_ent}: element {i} off by {e} bf16 ulps"
                    );
                }
            }
        }
        // Finite differences of L = sum_r g_logp[r] logp[r] + g_ent[r] H[r] through token_logprobs_f32 itself.
        let (vocab, inv_temp) = (7, 1.0 / 0.7);
        let (x, t) = logits_case(2, vocab, 99);
        let t = vec![t[0], 3];
        let (gl, ge) = ([0.7f32, -1.3], [0.3f32, -0.2]);
        let (_, lse, ent) = logprobs_on(&dev, &x, &t, vocab, inv_temp);
        let (xb, tb, lb, eb) = (dev.upload(&x), dev.upload(&t), dev.upload(&lse), dev.upload(&ent));
        let (glb, geb, out) = (dev.upload(&gl), dev.upload(&ge), dev.zeros::<bf16>(2 * vocab));
        let l = plan::token_logprobs_back(
            2,
            vocab,
            inv_temp,
            xb.buf(),
            tb.buf(),
            lb.buf(),
            Some(eb.buf()),
            glb.buf(),
            Some(geb.buf()),
            out.buf(),
        );
        dev.launch(&l.unwrap()).unwrap();
        let got = to_f32(&out.download());
        let loss = |x: &[f32]| {
            let (lp, _, en) = logprobs_on(&dev, x, &t, vocab, inv_temp);
            (0..2).map(|r| f64::from(gl[r]) * f64::from(lp[r]) + f64::from(ge[r]) * f64::from(en[r])).sum::<f64>()
        };
        let h = 1e-2f32;
        for i in 0..2 * vocab {
            if x[i].is_infinite() {
                continue;
            }
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += h;
            xm[i] -= h;
            let fd = (loss(&xp) - loss(&xm)) / f64::from(2.0 * h);
            let g = f64::from(got[i]);
            assert!((fd - g).abs() <= 1e-2 * fd.abs() + 2e-3, "{order}: dlogits[{i}] = {g}, finite difference {fd}");
        }
    }
    println!("token_logprobs_back_f32: vocab 1, 7, 1000, 49,152 with and without the entropy term vs f64; finite differences of token_logprobs_f32");
}

/// The host's side of the embedding backward: rows sorted by token (stably), segments of equal tokens.
fn segments(tokens: &[i32]) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let mut order: Vec<i32> = (0..tokens.len() as i32).collect();
    order.sort_by_key(|&r| tokens[r as usize]);
    let (mut start, mut tok) = (Vec::new(), Vec::new());
    for (k, &r) in order.iter().enumerate() {
        if k == 0 || tokens[r as usize] != tokens[order[k - 1] as usize] {
            start.push(k as i32);
            tok.push(tokens[r as usize]);
        }
    }
    start.push(order.len() as i32);
    (order, start, tok)
}

pub fn embed_back_sums_rows_by_token(dev: &SimDevice) {
    for (rows, width, vocab) in [(1, 1, 1), (50, 5, 10), (200, 300, 37), (0, 4, 3)] {
        let mut rng = Rng::new(rows as u64 + width as u64);
        // Repeated tokens: a few frequent ones, each row's token drawn from a vocabulary of `vocab`.
        let tokens: Vec<i32> = (0..rows).map(|_| (rng.below(vocab) * rng.below(2)) as i32).collect();
        let (order, start, tok) = segments(&tokens);
        let dx = rng.vec(rows * width, -1.0, 1.0);
        let table = rng.vec(vocab * width, -1.0, 1.0);
        let mut want = table.clone();
        for s in 0..tok.len() {
            for c in 0..width {
                let mut acc = 0f32;
                for &r in &order[start[s] as usize..start[s + 1] as usize] {
                    acc += dx[r as usize * width + c];
                }
                want[tok[s] as usize * width + c] += acc;
            }
        }
        for (name, dev) in schedules(dev) {
            let (ob, sb, tb, db, tab) =
                (dev.upload(&order), dev.upload(&start), dev.upload(&tok), dev.upload(&dx), dev.upload(&table));
            dev.launch(&plan::embed_back(width, ob.buf(), sb.buf(), tb.buf(), db.buf(), tab.buf()).unwrap()).unwrap();
            assert_eq!(tab.download(), want, "{name}: embed_back {rows}x{width} vocab {vocab}");
        }
    }
    println!("embed_back_f32: rows x width x vocab 1x1x1, 50x5x10, 200x300x37 (repeated tokens), 0 rows; the host's bits on 5 schedules");
}

pub fn sum_squares_matches_f64(dev: &SimDevice) {
    for n in [1, 1000, 3_000_001] {
        let mut rng = Rng::new(n as u64);
        let x = rng.vec(n, -3.0, 3.0);
        // The reference summed with Neumaier's compensation (a plain running sum of 3M terms is itself off by more
        // than 1e-12).
        let (mut want, mut comp) = (0f64, 0f64);
        for &v in &x {
            let sq = f64::from(v) * f64::from(v);
            let t = want + sq;
            comp += if want.abs() >= sq { (want - t) + sq } else { (sq - t) + want };
            want = t;
        }
        let want = want + comp;
        let mut first = None;
        let devs = if n > 1000 {
            variants(dev).into_iter().map(|(n, d)| (n.to_string(), d)).collect()
        } else {
            schedules(dev)
        };
        for (name, dev) in devs {
            let (xb, pb) = (dev.upload(&x), dev.upload(&vec![f64::NAN; SUM_SQUARES_BLOCKS]));
            dev.launch(&plan::sum_squares(xb.buf(), pb.buf()).unwrap()).unwrap();
            let parts = pb.download();
            let got: f64 = parts.iter().sum();
            assert!((got - want).abs() <= 1e-12 * want, "{name}: n = {n}: {got} vs {want}");
            match &first {
                None => first = Some(parts),
                Some(b) => assert!(
                    b.iter().zip(&parts).all(|(a, c)| a.to_bits() == c.to_bits()),
                    "{name}: n = {n}: other bits"
                ),
            }
        }
    }
    println!("sum_squares_f32: n = 1, 1000, 3,000,001 within 1e-12 of the f64 sum; same partials on every schedule");
}

/// tlt-model's `AdamW::update` for one f32 element, reimplemented here exactly (tlt-model is not a dependency):
/// returns the new `(w, m, v)`.
fn adamw_host(s: &AdamWStep, w: f32, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    let t = i32::try_from(s.step).unwrap_or(i32::MAX);
    let bc1 = 1.0 - s.beta1.powi(t);
    let bc2_sqrt = (1.0 - s.beta2.powi(t)).sqrt();
    let step_size = s.lr / bc1;
    let decay = 1.0 - s.lr * s.weight_decay;
    let (beta1, beta2, eps, coef) = (s.beta1, s.beta2, s.eps, s.coef);
    let gk = f64::from(g);
    let gk = if coef < 1.0 { gk * coef } else { gk };
    let m = (beta1 * f64::from(m) + (1.0 - beta1) * gk) as f32;
    let v = (beta2 * f64::from(v) + (1.0 - beta2) * gk * gk) as f32;
    let denom = f64::from(v).sqrt() / bc2_sqrt + eps;
    let p = f64::from(w) * decay - step_size * f64::from(m) / denom;
    (p as f32, m, v)
}

pub fn adamw_equals_the_host_optimizer_bit_for_bit(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (n, coef, wd) in
            [(1, 1.0, 0.0), (1000, 0.37, 0.01), (1000, 1.0, 0.01), (5000, 0.0123, 0.0), (1_050_000, 0.8, 0.01)]
        {
            let mut rng = Rng::new(n as u64 + (coef * 1000.0) as u64);
            let mut w = rng.vec(n, -1.0, 1.0);
            let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
            let (wb, mb, vb, out) = (dev.upload(&w), dev.upload(&m), dev.upload(&v), dev.zeros::<bf16>(n));
            for step in 1..=3u64 {
                // Gradients over many magnitudes, zeros among them.
                let g: Vec<f32> = (0..n)
                    .map(|i| if i % 17 == 3 { 0.0 } else { rng.uniform(-1.0, 1.0) * 10f32.powi((i % 9) as i32 - 6) })
                    .collect();
                let s = AdamWStep {
                    lr: 3e-4 * step as f64,
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay: wd,
                    step,
                    coef,
                };
                let gb = dev.upload(&g);
                dev.launch(&plan::adamw(&s, wb.buf(), mb.buf(), vb.buf(), gb.buf(), out.buf()).unwrap()).unwrap();
                for i in 0..n {
                    (w[i], m[i], v[i]) = adamw_host(&s, w[i], m[i], v[i], g[i]);
                }
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let ctx = format!("{order} n {n} coef {coef} wd {wd} step {step}");
                assert!(bits(&wb.download()) == bits(&w), "{ctx}: weights differ from the host's");
                assert!(bits(&mb.download()) == bits(&m), "{ctx}: first moments differ");
                assert!(bits(&vb.download()) == bits(&v), "{ctx}: second moments differ");
                assert_eq!(out.download(), to_bf16(&w), "{ctx}: bf16 weights");
            }
        }
    }
    println!("adamw_f32: == the host AdamW's bits (w, m, v, bf16 w) over 3 steps, coef 1, 0.8, 0.37, 0.0123; weight decay 0, 0.01; n to 1,050,000");
}

pub fn cast_and_add_cover_every_element(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for n in [1, 257, 2_000_000] {
            let mut rng = Rng::new(n as u64);
            let mut x = rng.vec(n, -100.0, 100.0);
            // Ties to even, NaN, infinities, a subnormal, the largest finite value.
            let special = [
                1.0 + 2f32.powi(-8),
                1.0 + 3.0 * 2f32.powi(-8),
                f32::NAN,
                f32::INFINITY,
                -f32::INFINITY,
                1e-40,
                f32::MAX,
                -0.0,
            ];
            for (i, &s) in special.iter().enumerate().take(n) {
                x[i] = s;
            }
            let (xb, out) = (dev.upload(&x), dev.zeros::<bf16>(n));
            dev.launch(&plan::cast_bf16(xb.buf(), out.buf()).unwrap()).unwrap();
            let got: Vec<u16> = out.download().iter().map(|b| b.to_bits()).collect();
            let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            assert!(got == want, "{order}: cast n = {n}");
            let y = rng.vec(n, -1.0, 1.0);
            let (db, sb) = (dev.upload(&y), dev.upload(&x));
            dev.launch(&plan::add_f32(db.buf(), sb.buf()).unwrap()).unwrap();
            let want: Vec<u32> = y.iter().zip(&x).map(|(a, b)| (a + b).to_bits()).collect();
            assert!(db.download().iter().map(|v| v.to_bits()).collect::<Vec<_>>() == want, "{order}: add n = {n}");
        }
    }
    println!("cast_f32_bf16 (== half::bf16::from_f32, ties, NaN, inf, subnormal), add_f32: n = 1, 257, 2,000,000");
}

/// `scale_f32` against the host's `x * s` bit for bit, and `lora_merge_bf16` against `bf16(base + s * delta)` from
/// the host's f32 arithmetic bit for bit; the control: merging with another scale changes the result.
pub fn scale_and_lora_merge_match_the_host(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for n in [1, 257, 300_001] {
            let mut rng = Rng::new(n as u64 + 5);
            let x = rng.vec(n, -10.0, 10.0);
            let xb = dev.upload(&x);
            dev.launch(&plan::scale_f32(xb.buf(), 0.37).unwrap()).unwrap();
            let want: Vec<u32> = x.iter().map(|v| (v * 0.37).to_bits()).collect();
            assert!(xb.download().iter().map(|v| v.to_bits()).collect::<Vec<_>>() == want, "{order}: scale n = {n}");
            let base: Vec<bf16> = rng.vec(n, -1.0, 1.0).into_iter().map(bf16::from_f32).collect();
            let delta = rng.vec(n, -0.01, 0.01);
            let (bb, db, out) = (dev.upload(&base), dev.upload(&delta), dev.zeros::<bf16>(n));
            let merged = |s: f32| -> Vec<u16> {
                base.iter().zip(&delta).map(|(b, d)| bf16::from_f32(b.to_f32() + s * d).to_bits()).collect()
            };
            dev.launch(&plan::lora_merge(bb.buf(), db.buf(), 2.0, out.buf()).unwrap()).unwrap();
            let got: Vec<u16> = out.download().iter().map(|b| b.to_bits()).collect();
            assert!(got == merged(2.0), "{order}: lora_merge n = {n}");
            if n > 1000 {
                assert!(got != merged(1.0), "{order}: the control: another scale gives the same bits");
            }
        }
    }
    println!("scale_f32, lora_merge_bf16: == the host's f32 arithmetic bit for bit, n = 1, 257, 300,001");
}

kernel_tests!(
    rope_rows_matches_f64_and_the_decode_path => [rope_kv_write_bf16, rope_rows_bf16],
    rope_rows_back_is_the_transpose => [rope_rows_back_f32],
    rms_norm_back_matches_f64_and_finite_differences => [col_sum_f32, rms_norm_back_f32],
    col_sum_matches_f64_and_accumulates => [col_sum_f32],
    silu_mul_back_matches_f64 => [silu_mul_back_bf16],
    token_logprobs_match_f64 => [token_logprobs_f32],
    token_logprobs_back_matches_f64_and_finite_differences => [token_logprobs_back_f32, token_logprobs_f32],
    embed_back_sums_rows_by_token => [embed_back_f32],
    sum_squares_matches_f64 => [sum_squares_f32],
    adamw_equals_the_host_optimizer_bit_for_bit => [adamw_f32],
    cast_and_add_cover_every_element => [add_f32, cast_f32_bf16],
    scale_and_lora_merge_match_the_host => [lora_merge_bf16, scale_f32],
);
