//! Tree attention against a naive f64 reference that builds the explicit `[n, base + n]` mask, for every
//! instruction set this CPU has, over random trees, GQA ratios and head sizes with SIMD tails.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use tlt_kernels::{tree_attention, tree_attention_with, AttnShape, Error, Isa, Visibility};

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    tlt_kernels::SeededRng::new(seed).uniform_vec(n, -1.0, 1.0)
}

/// The reference: explicit mask from the parent links, f64 softmax.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    base: usize,
    parents: &[Option<usize>],
    shape: AttnShape,
    scale: f32,
) -> Vec<f64> {
    let AttnShape { n_heads: h, n_kv_heads: kvh, head_dim: d } = shape;
    let n = parents.len();
    let total = base + n;
    let mut mask = vec![vec![false; total]; n];
    for i in 0..n {
        mask[i][..base].iter_mut().for_each(|m| *m = true);
        let mut a = Some(i);
        while let Some(x) = a {
            mask[i][base + x] = true;
            a = parents[x];
        }
    }
    let mut out = vec![0f64; n * h * d];
    for i in 0..n {
        for hd in 0..h {
            let g = hd / (h / kvh);
            let qi = &q[i * h * d + hd * d..][..d];
            let scores: Vec<f64> = (0..total)
                .map(|r| {
                    let kr = &k[r * kvh * d + g * d..][..d];
                    qi.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale as f64
                })
                .collect();
            let mx = (0..total).filter(|&r| mask[i][r]).map(|r| scores[r]).fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = (0..total).map(|r| if mask[i][r] { (scores[r] - mx).exp() } else { 0.0 }).collect();
            let z: f64 = w.iter().sum();
            for e in 0..d {
                out[i * h * d + hd * d + e] =
                    (0..total).map(|r| w[r] * v[r * kvh * d + g * d + e] as f64).sum::<f64>() / z;
            }
        }
    }
    out
}

/// Runs `isa` on random data and compares with [`reference`].
#[allow(clippy::too_many_arguments)]
fn check(
    isa: Isa,
    base: usize,
    parents: &[Option<usize>],
    causal: bool,
    shape: AttnShape,
    scale: f32,
    amp: f32,
    seed: u64,
) {
    let n = parents.len();
    let q: Vec<f32> = values(n * shape.q_width(), seed).iter().map(|x| x * amp).collect();
    let k: Vec<f32> = values((base + n) * shape.kv_width(), seed + 1).iter().map(|x| x * amp).collect();
    let v = values((base + n) * shape.kv_width(), seed + 2);
    let mut out = vec![f32::NAN; n * shape.q_width()];
    let vis = if causal { Visibility::Causal } else { Visibility::Tree(parents) };
    tree_attention_with(isa, &q, &k, &v, base, vis, shape, scale, &mut out).unwrap();
    let want = reference(&q, &k, &v, base, parents, shape, scale);
    for (idx, (&got, &exp)) in out.iter().zip(&want).enumerate() {
        let err = (got as f64 - exp).abs();
        assert!(
            err <= 1e-5 * (1.0 + exp.abs()),
            "{isa:?} {shape:?} base={base} parents={parents:?} causal={causal}: out[{idx}] = {got} vs {exp} (err {err})"
        );
    }
}

fn chain(n: usize) -> Vec<Option<usize>> {
    (0..n).map(|i| i.checked_sub(1)).collect()
}

#[test]
fn every_isa_on_fixed_trees() {
    let trees: Vec<Vec<Option<usize>>> = vec![
        vec![None],
        chain(5),
        vec![None, None, None],
        vec![None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(3), Some(6)],
        vec![None, Some(0), None, Some(2), Some(1)],
    ];
    for isa in Isa::available() {
        for (h, kvh, d) in [(1, 1, 8), (4, 2, 64), (9, 3, 64), (3, 1, 80), (2, 2, 1), (6, 3, 17), (2, 1, 128)] {
            let shape = AttnShape::new(h, kvh, d);
            for parents in &trees {
                for base in [0, 1, 31, 32, 33, 70] {
                    check(isa, base, parents, false, shape, 1.0 / (d as f32).sqrt(), 1.0, (base + h * d) as u64);
                }
            }
        }
    }
}

#[test]
fn long_trees_cross_tiles_and_bitset_words() {
    // n > 64 needs several bitset words per node and several tiles of new rows.
    let n = 100;
    let parents: Vec<Option<usize>> = (0..n).map(|i| if i == 0 { None } else { Some((i * 7919) % i) }).collect();
    for isa in Isa::available() {
        check(isa, 45, &parents, false, AttnShape::new(4, 2, 24), 0.3, 1.0, 5);
        check(isa, 3, &chain(n), true, AttnShape::new(2, 1, 16), 0.3, 1.0, 6);
    }
}

#[test]
fn large_scores_stay_stable() {
    // Scores in the hundreds: a naive exp would overflow.
    for isa in Isa::available() {
        check(isa, 40, &chain(6), true, AttnShape::new(3, 1, 64), 1.0, 4.0, 11);
        check(isa, 0, &[None, Some(0), Some(0)], false, AttnShape::new(2, 2, 80), 1.0, 4.0, 12);
    }
}

#[test]
fn causal_equals_chain_tree() {
    let shape = AttnShape::new(6, 2, 80);
    for isa in Isa::available() {
        for (base, n) in [(0, 1), (0, 7), (13, 5), (64, 40)] {
            let q = values(n * shape.q_width(), 1);
            let k = values((base + n) * shape.kv_width(), 2);
            let v = values((base + n) * shape.kv_width(), 3);
            let mut a = vec![0.0; n * shape.q_width()];
            let mut b = vec![1.0; n * shape.q_width()];
            tree_attention_with(isa, &q, &k, &v, base, Visibility::Causal, shape, 0.1, &mut a).unwrap();
            tree_attention_with(isa, &q, &k, &v, base, Visibility::Tree(&chain(n)), shape, 0.1, &mut b).unwrap();
            assert_eq!(a, b, "{isa:?} base={base} n={n}");
        }
    }
}

#[test]
fn isas_agree_closely() {
    let shape = AttnShape::new(9, 3, 64);
    let (base, n) = (256, 8);
    let parents = [None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(3), Some(6)];
    let q = values(n * shape.q_width(), 1);
    let k = values((base + n) * shape.kv_width(), 2);
    let v = values((base + n) * shape.kv_width(), 3);
    let mut first: Option<Vec<f32>> = None;
    for isa in Isa::available() {
        let mut out = vec![0.0; n * shape.q_width()];
        tree_attention_with(isa, &q, &k, &v, base, Visibility::Tree(&parents), shape, 0.125, &mut out).unwrap();
        if let Some(f) = &first {
            for (a, b) in f.iter().zip(&out) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{isa:?}: {a} vs {b}");
            }
        } else {
            first = Some(out);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_trees_match_reference(
        isa_pick in any::<prop::sample::Index>(),
        raw_parents in prop::collection::vec((any::<bool>(), any::<prop::sample::Index>()), 1..16),
        base in 0usize..40,
        d_pick in 0usize..3,
        kvh in 1usize..3,
        ratio in 1usize..=3,
        causal in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let isas = Isa::available();
        let isa = isas[isa_pick.index(isas.len())];
        let parents: Vec<Option<usize>> = if causal {
            chain(raw_parents.len())
        } else {
            raw_parents.iter().enumerate().map(|(i, (root, p))| if *root || i == 0 { None } else { Some(p.index(i)) }).collect()
        };
        let d = [8, 64, 80][d_pick];
        let shape = AttnShape::new(kvh * ratio, kvh, d);
        check(isa, base, &parents, causal, shape, 1.0 / (d as f32).sqrt(), 1.5, seed);
    }
}

#[test]
fn errors_are_reported() {
    let shape = AttnShape::new(4, 2, 8);
    let (base, n) = (3, 2);
    let q = vec![0.0; n * 32];
    let kv = vec![0.0; (base + n) * 16];
    let mut out = vec![0.0; n * 32];
    let tree = [None, Some(0)];
    let vis = Visibility::Tree(&tree);
    let invalid = |r: tlt_kernels::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    let mismatch =
        |r: tlt_kernels::Result<()>, w: &str| matches!(r, Err(Error::ShapeMismatch { what, .. }) if what == w);

    assert!(tree_attention(&q, &kv, &kv, base, vis, shape, 1.0, &mut out).is_ok());
    assert!(tree_attention(&q, &kv, &kv, base, Visibility::Causal, shape, 1.0, &mut out).is_ok());
    // Parents must precede their children.
    assert!(invalid(tree_attention(&q, &kv, &kv, base, Visibility::Tree(&[None, Some(1)]), shape, 1.0, &mut out)));
    assert!(invalid(tree_attention(&q, &kv, &kv, base, Visibility::Tree(&[Some(0), None]), shape, 1.0, &mut out)));
    assert!(invalid(tree_attention(&q, &kv, &kv, base, Visibility::Tree(&[None, Some(7)]), shape, 1.0, &mut out)));
    // Bad shapes.
    for bad in [AttnShape::new(3, 2, 8), AttnShape::new(4, 0, 8), AttnShape::new(0, 2, 8), AttnShape::new(4, 2, 0)] {
        assert!(invalid(tree_attention(&q, &kv, &kv, base, vis, bad, 1.0, &mut out)), "{bad:?}");
    }
    assert!(invalid(tree_attention(&q, &kv, &kv, base, vis, AttnShape::new(usize::MAX, 1, 2), 1.0, &mut out)));
    assert!(invalid(tree_attention(&q, &kv, &kv, base, vis, shape, f32::NAN, &mut out)));
    assert!(invalid(tree_attention(&q, &kv, &kv, base, vis, shape, f32::INFINITY, &mut out)));
    // Lengths.
    assert!(mismatch(tree_attention(&q[..31], &kv, &kv, base, vis, shape, 1.0, &mut out), "q"));
    assert!(mismatch(tree_attention(&q[..33], &kv, &kv, base, Visibility::Causal, shape, 1.0, &mut out[..32]), "q"));
    assert!(mismatch(tree_attention(&q, &kv[..64], &kv, base, vis, shape, 1.0, &mut out), "keys"));
    assert!(mismatch(tree_attention(&q, &kv, &kv[..64], base, vis, shape, 1.0, &mut out), "values"));
    assert!(mismatch(tree_attention(&q, &kv, &kv, base + 1, vis, shape, 1.0, &mut out), "keys"));
    assert!(mismatch(tree_attention(&q, &kv, &kv, base, vis, shape, 1.0, &mut out[..63]), "out"));
    assert!(mismatch(tree_attention(&q, &kv, &kv, base, Visibility::Tree(&[None]), shape, 1.0, &mut out), "q"));
    assert!(invalid(tree_attention(&q, &kv, &kv, usize::MAX, vis, shape, 1.0, &mut out)));
    // n = 0 is a no-op.
    assert!(tree_attention(&[], &kv[..48], &kv[..48], base, Visibility::Causal, shape, 1.0, &mut []).is_ok());
    assert!(tree_attention(&[], &kv[..48], &kv[..48], base, Visibility::Tree(&[]), shape, 1.0, &mut []).is_ok());
    // An ISA this CPU lacks.
    for isa in [Isa::Avx2, Isa::Avx512] {
        if !isa.is_available() {
            assert!(matches!(
                tree_attention_with(isa, &q, &kv, &kv, base, vis, shape, 1.0, &mut out),
                Err(Error::IsaUnavailable(_))
            ));
        }
    }
}

#[test]
fn decode_is_fast_enough() {
    // SmolLM2-135M decode at context 256: far below the layer's matmuls (~0.5 ms). Generous bound for CI noise.
    let shape = AttnShape::new(9, 3, 64);
    let base = 256;
    let q = values(shape.q_width(), 1);
    let k = values((base + 1) * shape.kv_width(), 2);
    let v = values((base + 1) * shape.kv_width(), 3);
    let mut out = vec![0.0; shape.q_width()];
    let mut best = f64::MAX;
    for _ in 0..20 {
        let t = std::time::Instant::now();
        for _ in 0..10 {
            tree_attention(&q, &k, &v, base, Visibility::Causal, shape, 0.125, &mut out).unwrap();
        }
        best = best.min(t.elapsed().as_secs_f64() / 10.0);
    }
    assert!(best < 200e-6, "decode attention took {:.1} us", best * 1e6);
}
