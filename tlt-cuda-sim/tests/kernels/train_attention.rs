//! The training attention kernels (`train_attention.cu`: the causal forward over packed rows and its backward to q,
//! k and v) executed in the simulated device with the host's launch plans, against an f64 reference of the forward
//! and of the analytic backward; the reference backward is itself checked against central finite differences of the
//! reference forward. Packed sequences of lengths [1, 5, 17] and [33] (tiles of 32 keys, one sequence of one row),
//! GQA groups 1, 2 and 4, head dims 4, 8, 16, 64 and 256 (a thread's second output element). Every output buffer
//! starts as NaN, so an element no kernel writes fails. Negative controls: a reference without the causal mask or
//! without the separation of sequences, the dkv launch dropped or run before dq, barriers dropped. Determinism: the
//! same bits under in-order, reversed, sequential and seeded block interleavings.
//!
//! Tolerances: `o` (bf16) `2^-8 |o| + 2^-12` (its bf16 rounding plus f32 accumulation); `lse` (f32) `2^-20 (1 +
//! |lse|)` (16 f32 ulps); `delta` and the gradients (f32) `2^-18 (|x| + max |x|)` with the max over the tensor
//! (64 f32 ulps of the largest element: f32 sums of terms that cancel, the dS of a row sum to about 0). The
//! backward's reference takes the kernel's bf16 `o` for `delta`, as the kernel does.

// Tests: a panic is the failure report; indices mirror the kernels.
#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

use crate::common::{round_bf16, to_bf16, to_f32, variants, Rng};
use half::bf16;
use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::plan::{self, TrainAttnDims};

/// One case: the lengths of the packed sequences, the heads and the head dim; `amp`: the range of q and k.
struct Case {
    lens: Vec<usize>,
    heads: usize,
    kv: usize,
    hd: usize,
    amp: f32,
}

impl Case {
    fn new(lens: &[usize], heads: usize, kv: usize, hd: usize, amp: f32) -> Self {
        Self { lens: lens.to_vec(), heads, kv, hd, amp }
    }

    fn dims(&self) -> TrainAttnDims {
        let rows = self.lens.iter().sum();
        TrainAttnDims {
            rows,
            heads: self.heads,
            kv_heads: self.kv,
            head_dim: self.hd,
            scale: (self.hd as f32).sqrt().recip(),
        }
    }

    fn name(&self) -> String {
        format!("lens {:?} h{}/kv{} d{}", self.lens, self.heads, self.kv, self.hd)
    }

    /// `seq_start` of the packed rows.
    fn seq_start(&self) -> Vec<usize> {
        let mut s = Vec::new();
        let mut at = 0;
        for &l in &self.lens {
            s.extend(std::iter::repeat_n(at, l));
            at += l;
        }
        s
    }
}

/// Which keys a query row sees in the reference: the kernels' mask, or a wrong one (negative controls).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mask {
    /// `seq_start[i] ..= i`.
    Causal,
    /// The whole of row i's sequence (no causal mask).
    NoCausal,
    /// `0 ..= i` (sequences not separated).
    Unseparated,
}

/// The f64 reference: shapes, `seq_start` and the mask.
struct Reference<'a> {
    d: TrainAttnDims,
    seq_start: &'a [usize],
    mask: Mask,
}

impl Reference<'_> {
    fn keys(&self, i: usize) -> std::ops::Range<usize> {
        let s = self.seq_start[i];
        match self.mask {
            Mask::Causal => s..i + 1,
            Mask::NoCausal => s..(i..self.d.rows).find(|&e| self.seq_start[e] != s).unwrap_or(self.d.rows),
            Mask::Unseparated => 0..i + 1,
        }
    }

    fn at(&self, row: usize, col_head: usize) -> usize {
        row * self.d.width() + col_head * self.d.head_dim
    }

    fn dot(&self, a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// The scaled scores of (row i, head h) over its keys, with their maximum and log-sum-exp.
    fn scores(&self, qkv: &[f64], i: usize, h: usize) -> (Vec<(usize, f64)>, f64) {
        let (d, hd) = (self.d, self.d.head_dim);
        let g = h / d.group();
        let q = &qkv[self.at(i, h)..][..hd];
        let s: Vec<(usize, f64)> = self
            .keys(i)
            .map(|j| (j, f64::from(d.scale) * self.dot(q, &qkv[self.at(j, d.heads + g)..][..hd])))
            .collect();
        let m = s.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
        let lse = m + s.iter().map(|x| (x.1 - m).exp()).sum::<f64>().ln();
        (s, lse)
    }

    /// `(o [rows, heads, hd], lse [rows, heads])`.
    fn forward(&self, qkv: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (d, hd) = (self.d, self.d.head_dim);
        let (mut o, mut lse) = (vec![0f64; d.out_len()], vec![0f64; d.rows * d.heads]);
        for i in 0..d.rows {
            for h in 0..d.heads {
                let vo = self.at(0, d.heads + d.kv_heads + h / d.group());
                let (s, l) = self.scores(qkv, i, h);
                lse[i * d.heads + h] = l;
                for (j, x) in s {
                    let p = (x - l).exp();
                    for e in 0..hd {
                        o[(i * d.heads + h) * hd + e] += p * qkv[j * d.width() + vo + e];
                    }
                }
            }
        }
        (o, lse)
    }

    /// The analytic backward of `Σ d_o · o`: `(d_qkv [rows, width], delta [rows, heads])`, with `delta` from `o`.
    fn backward(&self, qkv: &[f64], o: &[f64], d_o: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (d, hd) = (self.d, self.d.head_dim);
        let scale = f64::from(d.scale);
        let (mut dq, mut delta) = (vec![0f64; d.rows * d.width()], vec![0f64; d.rows * d.heads]);
        for i in 0..d.rows {
            for h in 0..d.heads {
                let g = h / d.group();
                let ih = i * d.heads + h;
                let go = &d_o[ih * hd..][..hd];
                let dl = self.dot(go, &o[ih * hd..][..hd]);
                delta[ih] = dl;
                let (s, l) = self.scores(qkv, i, h);
                for (j, x) in s {
                    let p = (x - l).exp();
                    let (kj, vj) = (self.at(j, d.heads + g), self.at(j, d.heads + d.kv_heads + g));
                    let ds = p * (self.dot(go, &qkv[vj..][..hd]) - dl);
                    let qi = self.at(i, h);
                    for e in 0..hd {
                        dq[qi + e] += scale * ds * qkv[kj + e];
                        dq[kj + e] += scale * ds * qkv[qi + e];
                        dq[vj + e] += p * go[e];
                    }
                }
            }
        }
        (dq, delta)
    }
}

/// A case's inputs (bf16-representable values).
struct Inputs {
    qkv: Vec<f32>,
    d_o: Vec<f32>,
    seq_start: Vec<usize>,
}

fn inputs(c: &Case, seed: u64) -> Inputs {
    let d = c.dims();
    let mut rng = Rng::new(seed);
    let (qk, kv) = (d.heads + d.kv_heads, d.kv_heads);
    let mut qkv = Vec::with_capacity(d.rows * d.width());
    for _ in 0..d.rows {
        qkv.extend(round_bf16(&rng.vec(qk * d.head_dim, -c.amp, c.amp)));
        qkv.extend(round_bf16(&rng.vec(kv * d.head_dim, -1.0, 1.0)));
    }
    let d_o = round_bf16(&rng.vec(d.out_len(), -1.0, 1.0));
    Inputs { qkv, d_o, seq_start: c.seq_start() }
}

/// What the three kernels wrote.
#[derive(PartialEq)]
struct Outputs {
    o: Vec<bf16>,
    lse: Vec<f32>,
    delta: Vec<f32>,
    d_qkv: Vec<f32>,
}

impl Outputs {
    /// Every value as bits (NaN-safe bit equality).
    fn bits(&self) -> Vec<u32> {
        let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut b: Vec<u32> = self.o.iter().map(|x| u32::from(x.to_bits())).collect();
        b.extend(f(&self.lse));
        b.extend(f(&self.delta));
        b.extend(f(&self.d_qkv));
        b
    }
}

/// How a run launches the backward (negative controls alter it).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Backward {
    /// dq, then dkv.
    Both,
    /// dq only: the k and v columns of `d_qkv` are never written.
    NoDkv,
    /// dkv before dq: it reads `delta` before it is written.
    DkvFirst,
}

/// Runs the forward and the backward on `dev` with every output starting as NaN.
fn run(dev: &SimDevice, c: &Case, x: &Inputs, backward: Backward) -> Outputs {
    let d = c.dims();
    let ss: Vec<i32> = x.seq_start.iter().map(|&s| s as i32).collect();
    let (qkv, seq, d_o) = (dev.upload(&to_bf16(&x.qkv)), dev.upload(&ss), dev.upload(&to_bf16(&x.d_o)));
    let o = dev.upload(&vec![bf16::NAN; d.out_len()]);
    let nan = |n: usize| dev.upload(&vec![f32::NAN; n]);
    let (lse, delta, d_qkv) = (nan(d.rows * d.heads), nan(d.rows * d.heads), nan(d.rows * d.width()));
    dev.launch(&plan::causal_attention(&d, qkv.buf(), seq.buf(), o.buf(), lse.buf()).unwrap()).unwrap();
    let dq = plan::causal_attention_back_dq(
        &d,
        qkv.buf(),
        seq.buf(),
        o.buf(),
        d_o.buf(),
        lse.buf(),
        delta.buf(),
        d_qkv.buf(),
    )
    .unwrap();
    let dkv = plan::causal_attention_back_dkv(&d, qkv.buf(), seq.buf(), d_o.buf(), lse.buf(), delta.buf(), d_qkv.buf())
        .unwrap();
    let order = match backward {
        Backward::Both => vec![dq, dkv],
        Backward::NoDkv => vec![dq],
        Backward::DkvFirst => vec![dkv, dq],
    };
    for l in &order {
        dev.launch(l).unwrap();
    }
    Outputs { o: o.download(), lse: lse.download(), delta: delta.download(), d_qkv: d_qkv.download() }
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// The worst `|got - want| / tol(want, max |want|)` (infinite for NaN).
fn worst(got: &[f32], want: &[f64], tol: impl Fn(f64, f64) -> f64) -> (f64, usize) {
    assert_eq!(got.len(), want.len());
    let m = want.iter().fold(0f64, |a, w| a.max(w.abs()));
    let mut w = (0f64, 0usize);
    for (i, (&g, &x)) in got.iter().zip(want).enumerate() {
        let e = (f64::from(g) - x).abs() / tol(x, m);
        let e = if e.is_nan() { f64::INFINITY } else { e };
        if e > w.0 {
            w = (e, i);
        }
    }
    w
}

fn tol_o(w: f64, _: f64) -> f64 {
    w.abs() * 2f64.powi(-8) + 2f64.powi(-12)
}

fn tol_lse(w: f64, _: f64) -> f64 {
    (1.0 + w.abs()) * 2f64.powi(-20)
}

fn tol_grad(w: f64, m: f64) -> f64 {
    (w.abs() + m) * 2f64.powi(-18)
}

/// The worst error of each output (as a fraction of its tolerance) against the reference under `mask`:
/// `[o, lse, delta, d_qkv]`.
fn errors(c: &Case, x: &Inputs, got: &Outputs, mask: Mask) -> [(f64, usize); 4] {
    let r = Reference { d: c.dims(), seq_start: &x.seq_start, mask };
    let qkv = f64s(&x.qkv);
    let (o, lse) = r.forward(&qkv);
    // The backward's delta reads the bf16 o the forward wrote, as the kernel does.
    let (d_qkv, delta) = r.backward(&qkv, &f64s(&to_f32(&got.o)), &f64s(&x.d_o));
    [
        worst(&to_f32(&got.o), &o, tol_o),
        worst(&got.lse, &lse, tol_lse),
        worst(&got.delta, &delta, tol_grad),
        worst(&got.d_qkv, &d_qkv, tol_grad),
    ]
}

const NAMES: [&str; 4] = ["o", "lse", "delta", "d_qkv"];

fn cases() -> Vec<Case> {
    vec![
        Case::new(&[1, 5, 17], 4, 2, 8, 1.0),
        Case::new(&[33], 4, 1, 4, 1.0),
        Case::new(&[1, 5, 17], 2, 2, 64, 1.0),
        Case::new(&[33], 4, 2, 64, 1.0),
        Case::new(&[2, 33, 1], 4, 4, 16, 4.0),
        Case::new(&[3, 4], 2, 1, 256, 1.0),
    ]
}

pub fn train_attention_matches_the_f64_reference(dev: &SimDevice) {
    let mut worst_seen = [0f64; 4];
    for (n, c) in cases().iter().enumerate() {
        let x = inputs(c, 100 + n as u64);
        let mut first: Option<Vec<u32>> = None;
        for (order, dev) in variants(dev) {
            let got = run(&dev, c, &x, Backward::Both);
            for (k, (e, i)) in errors(c, &x, &got, Mask::Causal).into_iter().enumerate() {
                assert!(e <= 1.0, "{order} {}: {} element {i} off by {e:.2} of the tolerance", c.name(), NAMES[k]);
                worst_seen[k] = worst_seen[k].max(e);
            }
            let bits = got.bits();
            assert!(first.get_or_insert_with(|| bits.clone()) == &bits, "{order} {}: other bits", c.name());
        }
    }
    println!(
        "train_attention_fwd_bf16, train_attention_back_dq_bf16, train_attention_back_dkv_bf16: {}; worst error \
         (fraction of the tolerance) o {:.3}, lse {:.3}, delta {:.3}, d_qkv {:.3}",
        cases().iter().map(Case::name).collect::<Vec<_>>().join(", "),
        worst_seen[0],
        worst_seen[1],
        worst_seen[2],
        worst_seen[3]
    );
}

pub fn train_attention_is_bit_identical_under_every_block_interleaving(dev: &SimDevice) {
    for c in [Case::new(&[1, 5, 17], 4, 2, 8, 1.0), Case::new(&[3, 4], 2, 1, 256, 1.0)] {
        let x = inputs(&c, 7);
        let want = run(&dev.sequential(), &c, &x, Backward::Both).bits();
        let mut devs =
            vec![("reversed".to_string(), dev.reversed()), ("reversed sequential".into(), dev.reversed().sequential())];
        devs.extend((1..=4).map(|s| (format!("seed {s}"), dev.with_block_seed(s))));
        devs.push(("seed 5 reversed".into(), dev.with_block_seed(5).reversed()));
        for (what, dev) in devs {
            assert!(run(&dev, &c, &x, Backward::Both).bits() == want, "{what} {}: other bits", c.name());
        }
    }
    println!("train attention: the same bits in order, reversed, sequential and under block seeds 1 to 5");
}

pub fn train_attention_negative_controls_are_caught(dev: &SimDevice) {
    let c = Case::new(&[1, 5, 17], 4, 2, 8, 1.0);
    let x = inputs(&c, 11);
    let good = run(dev, &c, &x, Backward::Both);
    let fails = |got: &Outputs, mask: Mask, k: usize| errors(&c, &x, got, mask)[k].0 > 1.0;
    assert!((0..4).all(|k| !fails(&good, Mask::Causal, k)), "the unaltered run must pass");
    // References with the wrong mask disagree, forward and backward.
    for mask in [Mask::NoCausal, Mask::Unseparated] {
        for k in [0, 1, 3] {
            assert!(fails(&good, mask, k), "a reference with {mask:?} still matched {}", NAMES[k]);
        }
    }
    // The dkv launch dropped or run before dq (whose delta it reads), barriers dropped: wrong gradients.
    assert!(fails(&run(dev, &c, &x, Backward::NoDkv), Mask::Causal, 3), "no dkv launch went unnoticed");
    assert!(fails(&run(dev, &c, &x, Backward::DkvFirst), Mask::Causal, 3), "dkv before dq went unnoticed");
    let broken = run(&dev.without_barriers(), &c, &x, Backward::Both);
    assert!((0..4).any(|k| fails(&broken, Mask::Causal, k)), "dropping __syncthreads went unnoticed");
    println!(
        "train attention negative controls: no causal mask, sequences not separated, dkv dropped, dkv before dq, \
         barriers dropped"
    );
}

/// The reference backward is the gradient of `Σ d_o · o` through the reference forward: central differences of
/// every input element on a tiny case (two sequences, GQA 2, head dim 4) agree to 1e-6 relative.
#[test]
fn the_reference_backward_is_the_gradient_of_the_reference_forward() {
    let c = Case::new(&[2, 3], 4, 2, 4, 1.5);
    let x = inputs(&c, 3);
    let r = Reference { d: c.dims(), seq_start: &x.seq_start, mask: Mask::Causal };
    let (qkv, d_o) = (f64s(&x.qkv), f64s(&x.d_o));
    let loss = |v: &[f64]| r.forward(v).0.iter().zip(&d_o).map(|(a, b)| a * b).sum::<f64>();
    let (o, _) = r.forward(&qkv);
    let (grad, _) = r.backward(&qkv, &o, &d_o);
    let m = grad.iter().fold(0f64, |a, g| a.max(g.abs()));
    let eps = 1e-5;
    for e in 0..qkv.len() {
        let (mut plus, mut minus) = (qkv.clone(), qkv.clone());
        plus[e] += eps;
        minus[e] -= eps;
        let fd = (loss(&plus) - loss(&minus)) / (2.0 * eps);
        assert!((fd - grad[e]).abs() <= 1e-6 * (m + grad[e].abs()), "element {e}: {fd} vs {}", grad[e]);
    }
    // The check has power: a backward with the wrong mask is not the gradient.
    let wrong = Reference { mask: Mask::Unseparated, ..r };
    let (bad, _) = wrong.backward(&qkv, &o, &d_o);
    assert!(bad.iter().zip(&grad).any(|(b, g)| (b - g).abs() > 1e-3 * m), "a wrong backward matched");
}

kernel_tests!(
    train_attention_matches_the_f64_reference => [train_attention_back_dkv_bf16, train_attention_back_dq_bf16, train_attention_fwd_bf16],
    train_attention_is_bit_identical_under_every_block_interleaving => [train_attention_back_dkv_bf16, train_attention_back_dq_bf16, train_attention_fwd_bf16],
    train_attention_negative_controls_are_caught => [train_attention_back_dkv_bf16, train_attention_back_dq_bf16, train_attention_fwd_bf16],
);
