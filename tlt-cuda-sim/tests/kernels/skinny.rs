//! The batch-invariant GEMM of decode and verify (`skinny.cu`): every prologue and epilogue against an f64
//! reference within the bf16 tolerance (rows not a multiple of the 16-row tiles or of a 64-row block, columns not a
//! multiple of the 32-column tiles, K not a multiple of the 32-wide steps); and batch invariance: a row's output
//! bits alone, beside 129 others and at another position of another batch are the same, under both interleavings,
//! while the negative control (the K split chosen from the row count) changes them.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use crate::common::{bf16_ulp, round_bf16, to_bf16, to_f32, variants, Rng};
use half::bf16;
use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::plan::{self, Launch, SkinnyIn, SkinnyOut};

/// One case: rows `m`, weight rows `n`, inner dimension `k`.
#[derive(Debug, Clone, Copy)]
struct Case {
    m: usize,
    n: usize,
    k: usize,
}

const CASES: [Case; 4] = [
    Case { m: 1, n: 8, k: 8 },
    Case { m: 3, n: 40, k: 72 },
    Case { m: 17, n: 100, k: 320 },
    Case { m: 65, n: 36, k: 64 },
];

struct Data {
    a: Vec<f32>,
    x: Vec<f32>,
    g: Vec<f32>,
    w: Vec<f32>,
    bias: Vec<f32>,
}

fn data(c: Case, seed: u64) -> Data {
    let mut rng = Rng::new(seed);
    Data {
        a: round_bf16(&rng.vec(c.m * c.k, -1.0, 1.0)),
        x: rng.vec(c.m * c.k, -3.0, 3.0),
        g: round_bf16(&rng.vec(c.k, 0.5, 1.5)),
        w: round_bf16(&rng.vec(c.n * c.k, -0.5, 0.5)),
        bias: round_bf16(&rng.vec(c.n, -1.0, 1.0)),
    }
}

/// `a` normalised in f64 (rounded to bf16, as the kernel stores it).
fn normalised(x: &[f32], g: &[f32], k: usize, eps: f64) -> Vec<f32> {
    x.chunks(k)
        .flat_map(|r| {
            let inv = 1.0 / (r.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / k as f64 + eps).sqrt();
            r.iter().zip(g).map(move |(&v, &w)| (f64::from(v) * inv * f64::from(w)) as f32).collect::<Vec<_>>()
        })
        .collect()
}

/// `a · wᵀ` in f64, and the sum of the products' magnitudes (the scale of an f32 sum's error).
fn product(a: &[f32], w: &[f32], c: Case) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; c.m * c.n];
    let mut s = vec![0.0; c.m * c.n];
    for r in 0..c.m {
        for j in 0..c.n {
            for e in 0..c.k {
                let p = f64::from(a[r * c.k + e]) * f64::from(w[j * c.k + e]);
                y[r * c.n + j] += p;
                s[r * c.n + j] += p.abs();
            }
        }
    }
    (y, s)
}

/// The largest error of `got` against `want` in bf16 ulps of `want` (at least those of `floor`).
fn ulps(got: &[f32], want: &[f64], floor: f32) -> (f32, usize) {
    let mut w = (0f32, 0usize);
    for (i, (&g, &x)) in got.iter().zip(want).enumerate() {
        let e = ((f64::from(g) - x).abs() as f32) / bf16_ulp(x as f32, floor);
        if e > w.0 || e.is_nan() {
            w = (if e.is_nan() { f32::INFINITY } else { e }, i);
        }
    }
    w
}

pub fn skinny_gemm_matches_f64_in_every_epilogue(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (ci, c) in CASES.into_iter().enumerate() {
            let d = data(c, 17 + ci as u64);
            let (m, n, k) = (c.m, c.n, c.k);
            let w = dev.upload(&to_bf16(&d.w));
            let a = dev.upload(&to_bf16(&d.a));
            let (want, mag) = product(&d.a, &d.w, c);
            // f32 logits: within 1e-5 of the products' magnitude (an f32 sum of k terms).
            let y = dev.zeros::<f32>(m * n);
            dev.launch(&plan::skinny_gemm(m, n, k, SkinnyIn::Bf16(a.buf()), w.buf(), SkinnyOut::F32(y.buf())).unwrap())
                .unwrap();
            for (i, (&g, (&x, &s))) in y.download().iter().zip(want.iter().zip(&mag)).enumerate() {
                assert!((f64::from(g) - x).abs() <= 1e-5 * s.max(1e-3), "{order} {c:?} f32 element {i}: {g} vs {x}");
            }
            // bf16 output: within a bf16 ulp. With a bias, bf16(bf16(acc) + b): within an ulp of acc (the first
            // rounding) plus one of the result (the second).
            let floor = 0.05;
            let b = dev.upload(&to_bf16(&d.bias));
            for with_bias in [false, true] {
                let y = dev.zeros::<bf16>(m * n);
                let out = SkinnyOut::Bf16 { y: y.buf(), bias: with_bias.then(|| b.buf()) };
                dev.launch(&plan::skinny_gemm(m, n, k, SkinnyIn::Bf16(a.buf()), w.buf(), out).unwrap()).unwrap();
                for (i, &got) in to_f32(&y.download()).iter().enumerate() {
                    let bias = if with_bias { f64::from(d.bias[i % n]) } else { 0.0 };
                    let exact = want[i] + bias;
                    let mut tol = bf16_ulp(exact as f32, floor);
                    if with_bias {
                        tol += bf16_ulp(want[i] as f32, floor);
                    }
                    let e = (f64::from(got) - exact).abs() as f32 / tol;
                    assert!(e <= 1.0, "{order} {c:?} bf16 (bias {with_bias}): element {i}: {got} vs {exact} ({e})");
                }
            }
            // The residual add: x0 + bf16(a · wᵀ).
            let x0 = Rng::new(5).vec(m * n, -2.0, 2.0);
            let res = dev.upload(&x0);
            let add = SkinnyOut::AddF32(res.buf());
            dev.launch(&plan::skinny_gemm(m, n, k, SkinnyIn::Bf16(a.buf()), w.buf(), add).unwrap()).unwrap();
            let got: Vec<f32> = res.download().iter().zip(&x0).map(|(&r, &x)| r - x).collect();
            let (e, i) = ulps(&got, &want, floor);
            assert!(e <= 1.5, "{order} {c:?} residual add: element {i} off by {e} ulps");
            // The norm prologue (storing its rows) with the SwiGLU epilogue, when n is even.
            let (x, g) = (dev.upload(&d.x), dev.upload(&to_bf16(&d.g)));
            let rows = dev.zeros::<bf16>(m * k);
            let norm = SkinnyIn::Norm { x: x.buf(), weight: g.buf(), eps: 1e-5, out: Some(rows.buf()) };
            let act = dev.zeros::<bf16>(m * n / 2);
            dev.launch(&plan::skinny_gemm(m, n, k, norm, w.buf(), SkinnyOut::SwiGlu(act.buf())).unwrap()).unwrap();
            let an = normalised(&d.x, &d.g, k, 1e-5);
            let an64: Vec<f64> = an.iter().map(|&v| f64::from(v)).collect();
            let (e, i) = ulps(&to_f32(&rows.download()), &an64, 1e-3);
            assert!(e <= 1.0, "{order} {c:?} normalised rows: element {i} off by {e} ulps");
            let (gu, _) = product(&round_bf16(&an), &d.w, c);
            let h = n / 2;
            let swiglu: Vec<f64> = (0..m * h)
                .map(|i| {
                    let (r, j) = (i / h, i % h);
                    let (gv, uv) = (gu[r * n + j], gu[r * n + h + j]);
                    gv / (1.0 + (-gv).exp()) * uv
                })
                .collect();
            let (e, i) = ulps(&to_f32(&act.download()), &swiglu, floor);
            assert!(e <= 3.0, "{order} {c:?} SwiGLU: element {i} off by {e} ulps");
        }
    }
    println!("skinny_gemm_bf16: every epilogue against f64 at m x n x k 1x8x8, 3x40x72, 17x100x320, 65x36x64");
}

/// Rows `rows` of `a` (bf16 `[_, k]`, or f32 residual rows normalised by the prologue) through the launch
/// `plan` makes, as f32 logits: the bits each row gets in that batch.
fn logits_of(
    dev: &SimDevice,
    rows: &[usize],
    src: &Data,
    c: Case,
    norm: bool,
    plan: &dyn Fn(usize, SkinnyIn, tlt_kernels::cuda::plan::Buf<bf16>, SkinnyOut) -> Launch,
) -> Vec<Vec<u32>> {
    let k = c.k;
    let pick = |v: &[f32]| rows.iter().flat_map(|&r| v[r * k..(r + 1) * k].to_vec()).collect::<Vec<f32>>();
    let w = dev.upload(&to_bf16(&src.w));
    let a = dev.upload(&to_bf16(&pick(&src.a)));
    let x = dev.upload(&pick(&src.x));
    let g = dev.upload(&to_bf16(&src.g));
    let y = dev.zeros::<f32>(rows.len() * c.n);
    let input = if norm {
        SkinnyIn::Norm { x: x.buf(), weight: g.buf(), eps: 1e-6, out: None }
    } else {
        SkinnyIn::Bf16(a.buf())
    };
    dev.launch(&plan(rows.len(), input, w.buf(), SkinnyOut::F32(y.buf()))).unwrap();
    y.download().chunks(c.n).map(|r| r.iter().map(|v| v.to_bits()).collect()).collect()
}

pub fn skinny_gemm_rows_are_batch_invariant(dev: &SimDevice) {
    let c = Case { m: 130, n: 40, k: 576 };
    let src = data(c, 99);
    let all: Vec<usize> = (0..c.m).collect();
    // Row r alone, beside all 129 others, and at position 63 - r % 64 of a batch of 64 rows.
    let batch_of_64 = |r: usize| {
        let mut rows: Vec<usize> = (0..64).map(|i| (r + 1 + i) % c.m).collect();
        rows[63 - r % 64] = r;
        (rows, 63 - r % 64)
    };
    let fixed = |m: usize, i: SkinnyIn, w, o| plan::skinny_gemm(m, c.n, c.k, i, w, o).unwrap();
    // The negative control: the K split chosen from the row count (8 warps alone, 4 in a batch).
    let by_rows = |m: usize, i: SkinnyIn, w, o| {
        plan::skinny_gemm_split(m, c.n, c.k, i, w, o, if m == 1 { 8 } else { 4 }).unwrap()
    };
    for norm in [false, true] {
        for (order, dev) in variants(dev) {
            let full = logits_of(&dev, &all, &src, c, norm, &fixed);
            for r in [0, 1, 15, 16, 63, 64, 100, 129] {
                let alone = logits_of(&dev, &[r], &src, c, norm, &fixed);
                assert_eq!(alone[0], full[r], "{order} norm {norm}: row {r} alone vs beside 129 others");
                let (rows, at) = batch_of_64(r);
                let mixed = logits_of(&dev, &rows, &src, c, norm, &fixed);
                assert_eq!(mixed[at], full[r], "{order} norm {norm}: row {r} at {at} of 64");
            }
        }
        let full = logits_of(dev, &all, &src, c, norm, &by_rows);
        let differ =
            [0, 1, 64, 129].iter().filter(|&&r| logits_of(dev, &[r], &src, c, norm, &by_rows)[0] != full[r]).count();
        assert!(differ > 0, "norm {norm}: the M-dependent split must change some row's bits");
        println!("negative control (norm {norm}): an M-dependent K split changes {differ} of 4 rows' bits");
    }
    println!("skinny_gemm_bf16: rows' bits alone = beside 129 others = at another position of 64, both orders");
}

kernel_tests!(
    skinny_gemm_matches_f64_in_every_epilogue => [skinny_gemm_bf16],
    skinny_gemm_rows_are_batch_invariant => [skinny_gemm_bf16],
);
