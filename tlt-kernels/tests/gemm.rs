//! The skinny GEMM against a naive f64 reference, for every weight format and every instruction set this CPU
//! has, over odd shapes and m = 1..64; and batch invariance (a row's bits whatever rows share the call).
#![allow(clippy::unwrap_used, clippy::too_many_arguments)] // Tests: a panic is the failure report.

use proptest::prelude::*;
use tlt_kernels::{gemm_with, Error, GemmConfig, Isa, MatRef, Matrix, WeightDType, WeightsRef};

const DTYPES: [WeightDType; 6] =
    [WeightDType::F32, WeightDType::F16, WeightDType::Bf16, WeightDType::Q8_0, WeightDType::Q4_0, WeightDType::Q4_1];

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    tlt_kernels::SeededRng::new(seed).uniform_vec(n, -1.0, 1.0)
}

/// Checks `gemm` against f64 on the dequantized weights: |y - ref| <= 1e-5 * sum |x_i w_i| (+ tiny floor).
fn check(isa: Isa, threads: usize, dtype: WeightDType, m: usize, n: usize, k: usize, seed: u64, bias: bool) {
    let w = Matrix::from_f32(n, k, &values(n * k, seed), dtype).unwrap();
    let wf = w.to_f32();
    let x = values(m * k, seed + 1);
    let b = bias.then(|| values(n, seed + 2));
    let mut y = vec![f32::NAN; m * n];
    gemm_with(GemmConfig { isa, threads }, &x, m, w.view(), b.as_deref(), &mut y).unwrap();
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut scale) = (0f64, 0f64);
            for e in 0..k {
                let p = x[i * k + e] as f64 * wf[j * k + e] as f64;
                exact += p;
                scale += p.abs();
            }
            if let Some(b) = &b {
                exact += b[j] as f64;
                scale += (b[j] as f64).abs();
            }
            let err = (y[i * n + j] as f64 - exact).abs();
            assert!(
                err <= 1e-5 * scale + 1e-30,
                "{isa:?} {dtype:?} m={m} n={n} k={k} threads={threads}: y[{i},{j}]={} vs {exact} (err {err}, scale {scale})",
                y[i * n + j]
            );
        }
    }
}

#[test]
fn every_isa_and_dtype_on_fixed_shapes() {
    for isa in Isa::available() {
        for dtype in DTYPES {
            for (m, n, k) in
                [(1, 1, 32), (1, 7, 64), (3, 9, 96), (4, 16, 128), (5, 13, 160), (8, 33, 64), (17, 6, 32), (64, 19, 96)]
            {
                check(isa, 1, dtype, m, n, k, (m * n * k) as u64, m % 2 == 0);
            }
        }
        for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::Bf16] {
            for (m, n, k) in [(1, 3, 1), (2, 5, 7), (3, 11, 37), (9, 4, 100), (64, 3, 5)] {
                check(isa, 1, dtype, m, n, k, (m + n + k) as u64, true);
            }
        }
    }
}

#[test]
fn threads_split_rows_without_changing_results() {
    for isa in Isa::available() {
        check(isa, 2, WeightDType::F32, 3, 100, 64, 9, true);
        check(isa, 3, WeightDType::Q4_1, 9, 77, 64, 10, false);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_shapes_match_reference(
        isa_pick in any::<prop::sample::Index>(),
        dtype_pick in 0usize..6,
        m in 1usize..=64,
        n in 1usize..40,
        kb in 1usize..6,
        k_extra in 0usize..32,
        seed in any::<u64>(),
    ) {
        let isas = Isa::available();
        let isa = isas[isa_pick.index(isas.len())];
        let dtype = DTYPES[dtype_pick];
        let k = if dtype.is_blocked() { kb * 32 } else { kb * 32 - 31 + k_extra };
        check(isa, 1, dtype, m, n, k, seed, seed % 2 == 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Batch invariance: a row's output is the same bits whatever rows share the call (any m, up to 300, any
    /// thread count), so a request's logits do not depend on how many requests share its round.
    #[test]
    fn a_rows_output_does_not_depend_on_the_other_rows(
        isa_pick in any::<prop::sample::Index>(),
        dtype_pick in 0usize..6,
        m in 1usize..300,
        n in 1usize..70,
        kb in 1usize..5,
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let isas = Isa::available();
        let isa = isas[isa_pick.index(isas.len())];
        let dtype = DTYPES[dtype_pick];
        let k = kb * 32;
        let w = Matrix::from_f32(n, k, &values(n * k, seed), dtype).unwrap();
        let x = values(m * k, seed + 1);
        let b = values(n, seed + 2);
        let mut all = vec![f32::NAN; m * n];
        gemm_with(GemmConfig { isa, threads }, &x, m, w.view(), Some(&b), &mut all).unwrap();
        // Every row alone, and a few prefixes of the batch.
        for (start, len) in (0..m).map(|i| (i, 1)).chain([(0, m / 2), (m / 3, m - m / 3)]) {
            if len == 0 {
                continue;
            }
            let mut part = vec![f32::NAN; len * n];
            gemm_with(GemmConfig { isa, threads: 1 }, &x[start * k..(start + len) * k], len, w.view(), Some(&b), &mut part)
                .unwrap();
            let whole: Vec<u32> = all[start * n..(start + len) * n].iter().map(|v| v.to_bits()).collect();
            let alone: Vec<u32> = part.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(whole, alone, "{:?} {:?} m={} n={} k={} rows {}..{}", isa, dtype, m, n, k, start, start + len);
        }
    }
}

#[test]
fn shape_errors_are_reported() {
    let w = Matrix::from_f32(4, 64, &values(256, 1), WeightDType::F32).unwrap();
    let cfg = GemmConfig::default();
    let mut y = vec![0.0; 8];
    assert!(matches!(
        gemm_with(cfg, &[0.0; 10], 2, w.view(), None, &mut y),
        Err(Error::ShapeMismatch { what: "x", .. })
    ));
    assert!(matches!(
        gemm_with(cfg, &[0.0; 128], 2, w.view(), None, &mut y[..7]),
        Err(Error::ShapeMismatch { what: "y", .. })
    ));
    assert!(matches!(
        gemm_with(cfg, &[0.0; 128], 2, w.view(), Some(&[0.0; 3]), &mut y),
        Err(Error::ShapeMismatch { what: "bias", .. })
    ));
    assert!(matches!(
        gemm_with(GemmConfig { threads: 0, ..cfg }, &[0.0; 128], 2, w.view(), None, &mut y),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(Matrix::from_f32(2, 48, &[0.0; 96], WeightDType::Q8_0), Err(Error::BlockAlignment { k: 48 })));
    assert!(matches!(MatRef::new(2, 64, WeightsRef::F32(&[0.0; 127])), Err(Error::ShapeMismatch { .. })));
}
