//! Sampling and acceptance on the device (`sampling.cu`, `top_k_rows_f32` of `draft.cu`) executed in the simulated
//! device with the host's launch plans, against references with the CPU's semantics: argmax with ties to the
//! smaller index, inverse-CDF draws in vocabulary order, masked (-inf) logits, rows the CPU rejects (NaN, +inf, all
//! -inf: token -1 instead of a read out of bounds), vocabularies below, at and above the block size, the tree walk.

#![allow(clippy::unwrap_used, clippy::needless_range_loop)] // Tests: a panic is the failure report; indices mirror the kernels.

use crate::common::{variants, Rng};
use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::plan::{self, AcceptInBufs, AcceptOutBufs};
use tlt_kernels::cuda::TreeDims;

/// `got` within `tol` of `want`, or both NaN, or both the same infinity.
fn same_or_close(got: f32, want: f32, tol: f32) -> bool {
    (got.is_nan() && want.is_nan()) || got == want || (got - want).abs() <= tol
}

/// What `sample_rows_f32` returns for one row: token, log-probability, largest probability.
fn sample_ref(x: &[f32], coin: Option<f64>, inv_temp: f32) -> (i32, f32, f32) {
    let bad = x.iter().any(|v| v.is_nan() || *v == f32::INFINITY);
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if bad || mx == f32::NEG_INFINITY {
        return (-1, f32::NAN, f32::NAN);
    }
    let arg = x.iter().position(|&v| v == mx).unwrap();
    let e: Vec<f64> = x.iter().map(|&v| f64::from(((v - mx) * inv_temp).exp())).collect();
    let total: f64 = e.iter().sum();
    let tok = match coin {
        None => arg,
        Some(u) => {
            let target = u * total;
            let mut acc = 0.0;
            let mut last = arg;
            for (j, &ej) in e.iter().enumerate() {
                if ej > 0.0 {
                    last = j;
                }
                acc += ej;
                if ej > 0.0 && acc > target {
                    break;
                }
            }
            last
        }
    };
    let lp = (f64::from((x[tok] - mx) * inv_temp) - total.ln()) as f32;
    (tok as i32, lp, (1.0 / total) as f32)
}

pub fn sample_rows_argmax_draws_masks_and_rejected_rows(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for vocab in [1, 2, 255, 256, 257, 1000, 49_152] {
            for temperature in [0.0f32, 0.7, 1.0] {
                let mut rng = Rng::new(vocab as u64 + (temperature * 10.0) as u64);
                let mut rows: Vec<Vec<f32>> = (0..4).map(|_| rng.vec(vocab, -4.0, 4.0)).collect();
                // A masked row (all but a few -inf) and a row of tied maxima.
                for (j, v) in rows[1].iter_mut().enumerate() {
                    if j % 7 != 3 {
                        *v = f32::NEG_INFINITY;
                    }
                }
                if vocab > 2 {
                    let m = rows[2].iter().copied().fold(f32::MIN, f32::max) + 1.0;
                    for j in [vocab - 1, vocab / 2, 1] {
                        rows[2][j] = m;
                    }
                }
                let rows_n = rows.len();
                let coins: Vec<f64> = [0.0, 0.999_999, rng.coin(), rng.coin()].to_vec();
                let logits: Vec<f32> = rows.concat();
                let (lb, cb) = (dev.upload(&logits), dev.upload(&coins));
                let (tok, lp, pm) = (dev.zeros::<i32>(rows_n), dev.zeros::<f32>(rows_n), dev.zeros::<f32>(rows_n));
                let coins_arg = (temperature > 0.0).then(|| cb.buf());
                let l =
                    plan::sample_rows(rows_n, vocab, temperature, lb.buf(), coins_arg, tok.buf(), lp.buf(), pm.buf());
                dev.launch(&l.unwrap()).unwrap();
                let inv = if temperature == 0.0 { 1.0 } else { 1.0 / temperature };
                for (r, row) in rows.iter().enumerate() {
                    let coin = (temperature > 0.0).then_some(coins[r]);
                    let (t, p, m) = sample_ref(row, coin, inv);
                    let ctx = format!("{order} V{vocab} T{temperature} row {r}");
                    assert_eq!(tok.download()[r], t, "{ctx}: token");
                    let (gl, gm) = (lp.download()[r], pm.download()[r]);
                    assert!(same_or_close(gl, p, 1e-5 * p.abs().max(1.0)), "{ctx}: log-prob {gl} vs {p}");
                    assert!(same_or_close(gm, m, 1e-6 * m), "{ctx}: p_max {gm} vs {m}");
                }
            }
        }
        // Rows the CPU sampler rejects come back as token -1 (they used to index logits[0x7fffffff]); the other
        // rows of the launch are unaffected.
        let vocab = 300;
        let mut rows = vec![vec![0.5f32; vocab]; 5];
        rows[0] = vec![f32::NAN; vocab];
        rows[1][299] = f32::NAN;
        rows[2][0] = f32::INFINITY;
        rows[3] = vec![f32::NEG_INFINITY; vocab];
        rows[4][17] = 3.0;
        let lb = dev.upload(&rows.concat());
        let cb = dev.upload(&[0.5f64; 5]);
        let (tok, lp, pm) = (dev.zeros::<i32>(5), dev.zeros::<f32>(5), dev.zeros::<f32>(5));
        dev.launch(&plan::sample_rows(5, vocab, 0.0, lb.buf(), None, tok.buf(), lp.buf(), pm.buf()).unwrap()).unwrap();
        assert_eq!(tok.download(), [-1, -1, -1, -1, 17], "{order}: greedy");
        dev.launch(&plan::sample_rows(5, vocab, 1.0, lb.buf(), Some(cb.buf()), tok.buf(), lp.buf(), pm.buf()).unwrap())
            .unwrap();
        assert_eq!(&tok.download()[..4], [-1, -1, -1, -1], "{order}: sampled");
        assert!(lp.download()[..4].iter().chain(&pm.download()[..4]).all(|v| v.is_nan()));
        assert!(lp.download()[4].is_finite());
    }
    println!("sample_rows_f32: V 1, 2, 255, 256, 257, 1000, 49152 x T 0, 0.7, 1 (coins 0, 1-1e-6, random; masked row; ties); NaN / +inf / all -inf rows");
}

/// The walk of `tree_accept` for one sequence: (path, tokens, logprobs, pmax).
fn accept_ref(parent: &[i32], draft: &[i32], tt: &[i32], tl: &[f32], tp: &[f32], nn: usize) -> [Vec<f32>; 4] {
    let (mut path, mut tokens, mut lps, mut pms) = (vec![0f32], Vec::new(), Vec::new(), Vec::new());
    let mut cur = 0;
    loop {
        tokens.push(tt[cur] as f32);
        lps.push(tl[cur]);
        pms.push(tp[cur]);
        let next = (cur + 1..nn).find(|&c| parent[c] == cur as i32 && draft[c] == tt[cur]);
        match next {
            Some(c) if path.len() < parent.len() => {
                path.push(c as f32);
                cur = c;
            }
            _ => break,
        }
    }
    [path, tokens, lps, pms]
}

pub fn tree_accept_walks_every_tree(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        let (batch, n_max) = (9, 8);
        let tree = TreeDims { batch, n_max };
        let mut rng = Rng::new(11);
        let n = tree.nodes();
        let nn: Vec<i32> = (0..batch).map(|b| 1 + (b % n_max) as i32).collect();
        let mut parent = vec![-1i32; n];
        let mut draft = vec![0i32; n];
        for b in 0..batch {
            for c in 1..n_max {
                parent[b * n_max + c] = rng.below(c) as i32;
                draft[b * n_max + c] = rng.below(3) as i32;
            }
        }
        let tt: Vec<i32> = (0..n).map(|_| rng.below(3) as i32).collect();
        // Sequence 7 (8 nodes) is a chain that drafts exactly the target's tokens: accepted to the end.
        for c in 1..n_max {
            parent[7 * n_max + c] = c as i32 - 1;
            draft[7 * n_max + c] = tt[7 * n_max + c - 1];
        }
        let tl = rng.vec(n, -5.0, 0.0);
        let tp = rng.vec(n, 0.1, 1.0);
        let inp = [dev.upload(&parent), dev.upload(&draft), dev.upload(&tt), dev.upload(&nn)];
        let (tlb, tpb) = (dev.upload(&tl), dev.upload(&tp));
        let (path, n_acc, tokens) = (dev.upload(&vec![-9i32; n]), dev.zeros::<i32>(batch), dev.upload(&vec![-9i32; n]));
        let (lps, pms) = (dev.upload(&vec![9f32; n]), dev.upload(&vec![9f32; n]));
        let i = AcceptInBufs {
            parent: inp[0].buf(),
            draft_tok: inp[1].buf(),
            target_tok: inp[2].buf(),
            target_lp: tlb.buf(),
            target_pmax: tpb.buf(),
            n_nodes: inp[3].buf(),
        };
        let o = AcceptOutBufs {
            path: path.buf(),
            n_acc: n_acc.buf(),
            tokens: tokens.buf(),
            logprobs: lps.buf(),
            pmax: pms.buf(),
        };
        dev.launch(&plan::tree_accept(tree, i, o).unwrap()).unwrap();
        let (path, n_acc, tokens, lps, pms) =
            (path.download(), n_acc.download(), tokens.download(), lps.download(), pms.download());
        let mut longest = 0;
        for b in 0..batch {
            let s = b * n_max..(b + 1) * n_max;
            let [wp, wt, wl, wm] = accept_ref(
                &parent[s.clone()],
                &draft[s.clone()],
                &tt[s.clone()],
                &tl[s.clone()],
                &tp[s.clone()],
                nn[b] as usize,
            );
            let k = wp.len();
            longest = longest.max(k);
            assert_eq!(n_acc[b] as usize, k, "{order}: sequence {b}");
            let got = |v: &[i32]| v[s.start..s.start + k].iter().map(|&x| x as f32).collect::<Vec<_>>();
            assert_eq!(got(&path), wp, "{order}: path {b}");
            assert_eq!(got(&tokens), wt, "{order}: tokens {b}");
            assert_eq!(&lps[s.start..s.start + k], wl.as_slice(), "{order}: log-probs {b}");
            assert_eq!(&pms[s.start..s.start + k], wm.as_slice(), "{order}: p_max {b}");
            assert!(path[s.start + k..s.end].iter().all(|&p| p == -9), "{order}: written past the path");
        }
        assert_eq!(longest, n_max, "the chain that drafts the target's tokens is accepted to the end");
    }
    println!("tree_accept: 9 random trees of 1..8 nodes over a 3-token vocabulary (paths up to the root's depth)");
}

pub fn top_k_rows_in_order_with_ties_and_log_probs(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (vocab, k) in [(16, 16), (300, 4), (5000, 1), (5000, 16)] {
            let mut rng = Rng::new(vocab as u64 * 3 + k as u64);
            let rows = 3;
            // Values on a coarse grid, so ties are common; some -inf.
            let mut logits: Vec<f32> = (0..rows * vocab).map(|_| (rng.below(40) as f32 - 20.0) / 4.0).collect();
            for j in (0..logits.len()).step_by(11) {
                logits[j] = f32::NEG_INFINITY;
            }
            let lb = dev.upload(&logits);
            let (idx, lp) = (dev.zeros::<i32>(rows * k), dev.zeros::<f32>(rows * k));
            dev.launch(&plan::top_k_rows(rows, vocab, k, lb.buf(), idx.buf(), lp.buf()).unwrap()).unwrap();
            let (idx, lp) = (idx.download(), lp.download());
            for r in 0..rows {
                let x = &logits[r * vocab..(r + 1) * vocab];
                let mut order_ref: Vec<usize> = (0..vocab).collect();
                order_ref.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
                let mx = x[order_ref[0]];
                let lse = mx + x.iter().map(|&v| (v - mx).exp()).sum::<f32>().ln();
                for j in 0..k {
                    let i = order_ref[j];
                    assert_eq!(idx[r * k + j] as usize, i, "{order} V{vocab} k{k} row {r} rank {j}");
                    let want = x[i] - lse;
                    assert!(same_or_close(lp[r * k + j], want, 1e-5), "{order} V{vocab} k{k}: log-prob");
                }
            }
        }
    }
    println!("top_k_rows_f32: (V, k) (16, 16), (300, 4), (5000, 1), (5000, 16); tied values, -inf entries");
}

kernel_tests!(
    sample_rows_argmax_draws_masks_and_rejected_rows => [sample_rows_f32],
    tree_accept_walks_every_tree => [tree_accept],
    top_k_rows_in_order_with_ties_and_log_probs => [top_k_rows_f32],
);
