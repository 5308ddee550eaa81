//! The GEMM plans (`plan::gemm`, `gemm_dx`, `gemm_dw`) run by the simulated device's stand-in for cuBLAS against
//! row-major f64 products: the forward `y = x · wᵀ`, the input gradient `dx = dy · w` and the weight gradient
//! `dw (+)= dyᵀ · x`, so the operand orders and leading dimensions the training backward relies on are the ones
//! cuBLAS is asked for. Shapes are non-square so a swapped `m`/`n`/`k` or leading dimension fails.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use half::bf16;
use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::plan::{gemm, gemm_dw, gemm_dx, GemmY};
use tlt_kernels::SplitMix64;

/// `n` bf16-exact values in `[-1, 1)`.
fn data(rng: &mut SplitMix64, n: usize) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f64(rng.next_f64() * 2.0 - 1.0)).collect()
}

/// Row-major `a[r, i] · b[i, c]` where `a(r, i)` and `b(i, c)` index the operands.
fn product(
    rows: usize,
    cols: usize,
    inner: usize,
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
) -> Vec<f64> {
    let mut out = vec![0.0; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = (0..inner).map(|i| a(r, i) * b(i, c)).sum();
        }
    }
    out
}

fn close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((f64::from(g) - w).abs() <= 1e-4 * (1.0 + w.abs()), "{what}: element {i}: {g} vs {w}");
    }
}

#[test]
fn forward_input_and_weight_gradients_match_row_major_products() {
    let dev = SimDevice::new();
    let (m, n, k) = (5, 3, 7); // rows, outputs, inputs
    let mut rng = SplitMix64::new(11);
    let (x, w, dy) = (data(&mut rng, m * k), data(&mut rng, n * k), data(&mut rng, m * n));
    let f = |v: &[bf16], i: usize| v[i].to_f64();
    let (xb, wb, dyb) = (dev.upload(&x), dev.upload(&w), dev.upload(&dy));

    let y = dev.zeros::<f32>(m * n);
    dev.gemm(&gemm(m, n, k, xb.buf(), wb.buf(), GemmY::F32(y.buf())).unwrap()).unwrap();
    close(&y.download(), &product(m, n, k, |r, i| f(&x, r * k + i), |i, c| f(&w, c * k + i)), "y = x wᵀ");

    let dx = dev.zeros::<f32>(m * k);
    dev.gemm(&gemm_dx(m, n, k, dyb.buf(), wb.buf(), GemmY::F32(dx.buf())).unwrap()).unwrap();
    close(&dx.download(), &product(m, k, n, |r, o| f(&dy, r * n + o), |o, c| f(&w, o * k + c)), "dx = dy w");

    let want_dw = product(n, k, m, |o, r| f(&dy, r * n + o), |r, c| f(&x, r * k + c));
    let dw = dev.upload(&vec![0.5f32; n * k]);
    dev.gemm(&gemm_dw(m, n, k, dyb.buf(), xb.buf(), dw.buf(), false).unwrap()).unwrap();
    close(&dw.download(), &want_dw, "dw = dyᵀ x (overwrites)");
    dev.gemm(&gemm_dw(m, n, k, dyb.buf(), xb.buf(), dw.buf(), true).unwrap()).unwrap();
    close(&dw.download(), &want_dw.iter().map(|v| 2.0 * v).collect::<Vec<_>>(), "dw += dyᵀ x");
}

#[test]
fn gradient_plans_refuse_buffers_of_other_shapes() {
    let dev = SimDevice::new();
    let (a, b, c) = (dev.zeros::<bf16>(6), dev.zeros::<bf16>(6), dev.zeros::<f32>(5));
    assert!(gemm_dx(2, 3, 2, a.buf(), b.buf(), GemmY::F32(c.buf())).is_err(), "dx of 4 elements in 5");
    let x = dev.zeros::<bf16>(4);
    assert!(gemm_dw(2, 3, 2, a.buf(), x.buf(), c.buf(), true).is_err(), "dw of 6 elements in 5");
    assert!(gemm_dw(3, 2, 2, a.buf(), b.buf(), dev.zeros::<f32>(4).buf(), false).is_ok());
}
