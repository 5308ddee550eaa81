//! The EAGLE-2 drafter's training losses (`draft_train.cu`) executed in the simulated device with the host's launch
//! plans, against f64 references and finite differences of the f64 losses: the soft cross-entropy (loss, both
//! log-sum-exps and argmaxes) and its gradient with respect to the draft's logits, the SmoothL1 regression and its
//! gradient. The reductions must give the same bits under every schedule (interleavings, sequential, seeded block
//! orders).

#![allow(clippy::unwrap_used, clippy::needless_range_loop)] // Tests: a panic is the failure report; indices mirror the kernels.

use crate::common::{bf16_ulp, to_f32, variants, worst, Rng};
use half::bf16;
use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::plan::{self, SoftCeBufs};

/// `dev` under every schedule the determinism checks compare.
fn schedules(dev: &SimDevice) -> Vec<(String, SimDevice)> {
    let mut v: Vec<(String, SimDevice)> = variants(dev).into_iter().map(|(n, d)| (n.to_string(), d)).collect();
    v.push(("sequential".into(), dev.sequential()));
    for seed in [7, 1234] {
        v.push((format!("seed {seed}"), dev.with_block_seed(seed)));
    }
    v
}

/// A row's log-sum-exp in f64.
fn lse(row: &[f64]) -> f64 {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    m + row.iter().map(|&v| (v - m).exp()).sum::<f64>().ln()
}

/// The first index of a row's largest element.
fn argmax(row: &[f32]) -> i32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as i32
}

/// `-sum_v softmax(t)_v log softmax(d)_v` in f64 (entries with `p_v == 0` add nothing).
fn soft_ce_ref(t: &[f64], d: &[f64]) -> f64 {
    let (lt, ld) = (lse(t), lse(d));
    t.iter().map(|&a| (a - lt).exp()).zip(d).filter(|(p, _)| *p > 0.0).map(|(p, &b)| -p * (b - ld)).sum()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Target and draft logits of `rows` rows: uniform in [-6, 6), with `-inf` at the same entry of both in row 1 when
/// the vocabulary allows (a token neither side can produce).
fn logits_pair(rows: usize, vocab: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let (mut t, mut d) = (rng.vec(rows * vocab, -6.0, 6.0), rng.vec(rows * vocab, -6.0, 6.0));
    if rows > 1 && vocab > 2 {
        t[vocab + 2] = f32::NEG_INFINITY;
        d[vocab + 2] = f32::NEG_INFINITY;
    }
    (t, d)
}

pub fn soft_ce_matches_f64(dev: &SimDevice) {
    for (rows, vocab) in [(1, 1), (3, 7), (4, 1000), (2, 49_152)] {
        let (t, d) = logits_pair(rows, vocab, vocab as u64);
        let mut first: Option<Vec<u32>> = None;
        for (order, dev) in schedules(dev) {
            let (tb, db) = (dev.upload(&t), dev.upload(&d));
            let (loss, lt, ld) = (dev.zeros::<f32>(rows), dev.zeros::<f32>(rows), dev.zeros::<f32>(rows));
            let (at, ad) = (dev.zeros::<i32>(rows), dev.zeros::<i32>(rows));
            let out =
                SoftCeBufs { loss: loss.buf(), lse_t: lt.buf(), lse_d: ld.buf(), arg_t: at.buf(), arg_d: ad.buf() };
            dev.launch(&plan::soft_ce(rows, vocab, tb.buf(), db.buf(), &out).unwrap()).unwrap();
            let (gl, glt, gld, gat, gad) =
                (loss.download(), lt.download(), ld.download(), at.download(), ad.download());
            for r in 0..rows {
                let (tr, dr) = (&t[r * vocab..][..vocab], &d[r * vocab..][..vocab]);
                let (wl, wlt, wld) = (soft_ce_ref(&f64s(tr), &f64s(dr)), lse(&f64s(tr)), lse(&f64s(dr)));
                let ctx = format!("{order} {rows}x{vocab} row {r}");
                assert!((f64::from(gl[r]) - wl).abs() <= 1e-5 * (1.0 + wl.abs()), "{ctx}: loss {} vs {wl}", gl[r]);
                assert!(
                    (f64::from(glt[r]) - wlt).abs() <= 2e-6 * (1.0 + wlt.abs()),
                    "{ctx}: lse_t {} vs {wlt}",
                    glt[r]
                );
                assert!(
                    (f64::from(gld[r]) - wld).abs() <= 2e-6 * (1.0 + wld.abs()),
                    "{ctx}: lse_d {} vs {wld}",
                    gld[r]
                );
                assert_eq!((gat[r], gad[r]), (argmax(tr), argmax(dr)), "{ctx}: argmaxes");
            }
            let bits: Vec<u32> = gl.iter().chain(&glt).chain(&gld).map(|x| x.to_bits()).collect();
            match &first {
                None => first = Some(bits),
                Some(b) => assert_eq!(b, &bits, "{order} {rows}x{vocab}: other bits than the first schedule"),
            }
        }
    }
    // The same logits on both sides: the loss is the entropy; ties in the argmax go to the smaller index.
    let row = [1.0f32, 3.0, 3.0, -2.0];
    let (tb, db) = (dev.upload(&row), dev.upload(&row));
    let (loss, lt, ld, at, ad) = (dev.zeros(1), dev.zeros(1), dev.zeros(1), dev.zeros::<i32>(1), dev.zeros::<i32>(1));
    let out = SoftCeBufs { loss: loss.buf(), lse_t: lt.buf(), lse_d: ld.buf(), arg_t: at.buf(), arg_d: ad.buf() };
    dev.launch(&plan::soft_ce(1, 4, tb.buf(), db.buf(), &out).unwrap()).unwrap();
    let want = soft_ce_ref(&f64s(&row), &f64s(&row));
    assert!((f64::from(loss.download()[0]) - want).abs() <= 1e-6, "entropy {:?} vs {want}", loss.download());
    assert_eq!((at.download()[0], ad.download()[0]), (1, 1), "ties to the smaller index");
    println!("soft_ce_f32: rows x vocab 1x1, 3x7, 4x1000, 2x49,152 with -inf entries vs f64; same bits on 5 schedules");
}

/// Runs `soft_ce_f32` and returns the two log-sum-exps.
fn lses_on(dev: &SimDevice, t: &[f32], d: &[f32], rows: usize, vocab: usize) -> (Vec<f32>, Vec<f32>) {
    let (tb, db) = (dev.upload(t), dev.upload(d));
    let (loss, lt, ld, at, ad) =
        (dev.zeros(rows), dev.zeros(rows), dev.zeros(rows), dev.zeros::<i32>(rows), dev.zeros::<i32>(rows));
    let out = SoftCeBufs { loss: loss.buf(), lse_t: lt.buf(), lse_d: ld.buf(), arg_t: at.buf(), arg_d: ad.buf() };
    dev.launch(&plan::soft_ce(rows, vocab, tb.buf(), db.buf(), &out).unwrap()).unwrap();
    (lt.download(), ld.download())
}

pub fn soft_ce_back_matches_f64_and_finite_differences(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (rows, vocab) in [(1, 1), (3, 7), (4, 1000), (2, 49_152)] {
            let (t, d) = logits_pair(rows, vocab, vocab as u64 + 5);
            let w: Vec<f32> = [0.7f32, 0.0, -1.3, 0.25][..rows].to_vec();
            let (lt, ld) = lses_on(&dev, &t, &d, rows, vocab);
            let (tb, db, ltb, ldb, wb) =
                (dev.upload(&t), dev.upload(&d), dev.upload(&lt), dev.upload(&ld), dev.upload(&w));
            let out = dev.upload(&vec![bf16::from_f32(9.0); rows * vocab]);
            let l = plan::soft_ce_back(rows, vocab, tb.buf(), db.buf(), ltb.buf(), ldb.buf(), wb.buf(), out.buf());
            dev.launch(&l.unwrap()).unwrap();
            let got = to_f32(&out.download());
            let mut want = Vec::with_capacity(rows * vocab);
            for r in 0..rows {
                let (tr, dr) = (f64s(&t[r * vocab..][..vocab]), f64s(&d[r * vocab..][..vocab]));
                let (a, b) = (lse(&tr), lse(&dr));
                want.extend((0..vocab).map(|v| (f64::from(w[r]) * ((dr[v] - b).exp() - (tr[v] - a).exp())) as f32));
            }
            let (e, i) = worst(&got, &want, |_, v| bf16_ulp(v, 1e-6));
            assert!(e <= 1.0, "{order} {rows}x{vocab}: element {i} off by {e} bf16 ulps ({} vs {})", got[i], want[i]);
            if rows > 1 {
                assert!(got[vocab..2 * vocab].iter().all(|&x| x == 0.0), "{order}: a row of weight 0 gets zeros");
            }
            // Finite differences of L = sum_r w_r CE_r (f64) in the draft logits at a few entries per row.
            let loss = |dd: &[f64]| -> f64 {
                (0..rows)
                    .map(|r| f64::from(w[r]) * soft_ce_ref(&f64s(&t[r * vocab..][..vocab]), &dd[r * vocab..][..vocab]))
                    .sum()
            };
            let d64 = f64s(&d);
            let h = 1e-4;
            for r in 0..rows {
                for v in [0, vocab / 2, vocab - 1] {
                    let k = r * vocab + v;
                    if !d64[k].is_finite() {
                        continue;
                    }
                    let (mut p, mut m) = (d64.clone(), d64.clone());
                    p[k] += h;
                    m[k] -= h;
                    let fd = (loss(&p) - loss(&m)) / (2.0 * h);
                    let tol = f64::from(bf16_ulp(fd as f32, 1e-6)) + 1e-7;
                    assert!(
                        (fd - f64::from(got[k])).abs() <= tol,
                        "{order} {rows}x{vocab} [{r}, {v}]: {} vs fd {fd}",
                        got[k]
                    );
                }
            }
        }
    }
    println!("soft_ce_back_f32: rows x vocab 1x1, 3x7, 4x1000, 2x49,152 (38 chunks a row), weights 0.7, 0, -1.3, 0.25 vs f64 and finite differences");
}

/// SmoothL1 of `d` (beta 1) in f64.
fn sl1(d: f64) -> f64 {
    if d.abs() < 1.0 {
        0.5 * d * d
    } else {
        d.abs() - 0.5
    }
}

pub fn smooth_l1_matches_f64_and_finite_differences(dev: &SimDevice) {
    for (rows, width) in [(1, 1), (3, 16), (5, 257), (2, 4096)] {
        let mut rng = Rng::new(width as u64 * 3 + 1);
        let (p, t) = (rng.vec(rows * width, -3.0, 3.0), rng.vec(rows * width, -3.0, 3.0));
        let w: Vec<f32> = (0..rows).map(|r| [0.5f32, 0.0, 2.0, -1.0, 1.0][r % 5]).collect();
        let mut first: Option<Vec<u32>> = None;
        for (order, dev) in schedules(dev) {
            let (pb, tb, wb) = (dev.upload(&p), dev.upload(&t), dev.upload(&w));
            let (loss, dx) = (dev.zeros::<f32>(rows), dev.upload(&vec![7f32; rows * width]));
            dev.launch(&plan::smooth_l1(rows, width, pb.buf(), tb.buf(), loss.buf()).unwrap()).unwrap();
            dev.launch(&plan::smooth_l1_back(rows, width, pb.buf(), tb.buf(), wb.buf(), dx.buf()).unwrap()).unwrap();
            let (gl, gd) = (loss.download(), dx.download());
            for r in 0..rows {
                let o = r * width;
                let want =
                    (0..width).map(|c| sl1(f64::from(p[o + c]) - f64::from(t[o + c]))).sum::<f64>() / width as f64;
                assert!(
                    (f64::from(gl[r]) - want).abs() <= 1e-6 * (1.0 + want),
                    "{order} {rows}x{width} row {r}: {} vs {want}",
                    gl[r]
                );
                for c in 0..width {
                    let diff = f64::from(p[o + c]) - f64::from(t[o + c]);
                    let want = f64::from(w[r]) * diff.clamp(-1.0, 1.0) / width as f64;
                    let g = f64::from(gd[o + c]);
                    assert!((g - want).abs() <= 1e-6 * (want.abs() + 1e-9), "{order} dx[{r}, {c}]: {g} vs {want}");
                }
            }
            let bits: Vec<u32> = gl.iter().chain(&gd).map(|x| x.to_bits()).collect();
            match &first {
                None => first = Some(bits),
                Some(b) => assert_eq!(b, &bits, "{order} {rows}x{width}: other bits than the first schedule"),
            }
            // Finite differences of L = sum_r w_r mean_c sl1 (f64) in pred, away from the kink at |d| = 1.
            if order == "forward" {
                let loss = |pp: &[f64]| -> f64 {
                    (0..rows * width)
                        .map(|k| f64::from(w[k / width]) * sl1(pp[k] - f64::from(t[k])) / width as f64)
                        .sum()
                };
                let p64 = f64s(&p);
                let h = 1e-6;
                for k in [0, rows * width / 2, rows * width - 1] {
                    if ((p64[k] - f64::from(t[k])).abs() - 1.0).abs() < 1e-3 {
                        continue;
                    }
                    let (mut a, mut b) = (p64.clone(), p64.clone());
                    a[k] += h;
                    b[k] -= h;
                    let fd = (loss(&a) - loss(&b)) / (2.0 * h);
                    assert!(
                        (fd - f64::from(gd[k])).abs() <= 1e-6 * (1.0 + fd.abs()),
                        "{rows}x{width} dx[{k}]: {} vs fd {fd}",
                        gd[k]
                    );
                }
            }
        }
    }
    println!("smooth_l1_f32 / smooth_l1_back_f32: rows x width 1x1, 3x16, 5x257, 2x4096, both branches, weights incl. 0 and < 0, vs f64 and finite differences; same bits on 5 schedules");
}

kernel_tests!(
    soft_ce_matches_f64 => [soft_ce_f32],
    soft_ce_back_matches_f64_and_finite_differences => [soft_ce_back_f32, soft_ce_f32],
    smooth_l1_matches_f64_and_finite_differences => [smooth_l1_back_f32, smooth_l1_f32],
);
