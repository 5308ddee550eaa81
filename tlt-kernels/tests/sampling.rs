//! Sampling primitives: top-k/top-p support and mass, renormalisation, temperature, argmax ties and errors,
//! a chi-square goodness-of-fit test of `sample` against `probs`, and RNG determinism.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use tlt_kernels::{
    argmax, categorical, log_softmax, probs, sample, token_logprob, token_logprob_pmax, Error, SamplingParams,
    SeededRng,
};

fn is_invalid<T: std::fmt::Debug>(r: tlt_kernels::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidArgument(_)))
}

/// f64 softmax at temperature `t`.
fn softmax64(logits: &[f32], t: f64) -> Vec<f64> {
    let mx = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let e: Vec<f64> = logits.iter().map(|&x| ((x as f64 - mx) / t).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

#[test]
fn argmax_picks_first_maximum_and_rejects_bad_rows() {
    assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]).unwrap(), 1);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]).unwrap(), 0);
    assert_eq!(argmax(&[0.0, f32::INFINITY, f32::INFINITY]).unwrap(), 1);
    let mut long = vec![0.5f32; 1000];
    long[517] = 2.0;
    long[900] = 2.0;
    assert_eq!(argmax(&long).unwrap(), 517);
    assert_eq!(argmax(&[-5.0]).unwrap(), 0);
    assert!(is_invalid(argmax(&[])));
    assert!(is_invalid(argmax(&[1.0, f32::NAN, 0.0])));
    let mut nan_late = vec![0.0f32; 37];
    nan_late[36] = f32::NAN;
    assert!(is_invalid(argmax(&nan_late)));
}

#[test]
fn params_validation_and_default() {
    let d = SamplingParams::default();
    assert_eq!(d, SamplingParams { temperature: 1.0, top_k: None, top_p: None });
    assert!(d.validate().is_ok());
    assert!(SamplingParams::greedy().validate().is_ok());
    for bad in [
        SamplingParams { temperature: -0.1, ..d },
        SamplingParams { temperature: f32::NAN, ..d },
        SamplingParams { temperature: f32::INFINITY, ..d },
        SamplingParams { top_k: Some(0), ..d },
        SamplingParams { top_p: Some(0.0), ..d },
        SamplingParams { top_p: Some(1.01), ..d },
        SamplingParams { top_p: Some(f32::NAN), ..d },
    ] {
        assert!(is_invalid(bad.validate()), "{bad:?}");
        assert!(is_invalid(probs(&[1.0, 2.0], &bad)), "{bad:?}");
        assert!(is_invalid(sample(&[1.0, 2.0], &bad, &mut SeededRng::new(0))), "{bad:?}");
    }
}

#[test]
fn temperature_scaling_matches_hand_computation() {
    // logits [0, ln 2, ln 4] at T = 1: weights 1, 2, 4 -> 1/7, 2/7, 4/7.
    let logits = [0.0, 2f32.ln(), 4f32.ln()];
    let p = probs(&logits, &SamplingParams::default()).unwrap();
    for (got, want) in p.iter().zip([1.0 / 7.0, 2.0 / 7.0, 4.0 / 7.0]) {
        assert!((*got as f64 - want).abs() < 1e-6, "{p:?}");
    }
    // T = 0.5 squares the weights: 1, 4, 16 -> 1/21, 4/21, 16/21.
    let p = probs(&logits, &SamplingParams { temperature: 0.5, ..Default::default() }).unwrap();
    for (got, want) in p.iter().zip([1.0 / 21.0, 4.0 / 21.0, 16.0 / 21.0]) {
        assert!((*got as f64 - want).abs() < 1e-6, "{p:?}");
    }
    // T = 2 takes square roots: 1, sqrt 2, 2.
    let z = 1.0 + 2f64.sqrt() + 2.0;
    let p = probs(&logits, &SamplingParams { temperature: 2.0, ..Default::default() }).unwrap();
    for (got, want) in p.iter().zip([1.0 / z, 2f64.sqrt() / z, 2.0 / z]) {
        assert!((*got as f64 - want).abs() < 1e-6, "{p:?}");
    }
    // T = 0: one-hot on the first maximum; tiny T approaches it without NaN.
    assert_eq!(probs(&[1.0, 5.0, 5.0], &SamplingParams::greedy()).unwrap(), vec![0.0, 1.0, 0.0]);
    let p = probs(&[1.0, 5.0, 4.0], &SamplingParams { temperature: 1e-30, ..Default::default() }).unwrap();
    assert_eq!(p, vec![0.0, 1.0, 0.0]);
    // Large logits do not overflow; -inf is a zero-probability token.
    let p = probs(&[1000.0, 1000.0, f32::NEG_INFINITY], &SamplingParams::default()).unwrap();
    assert_eq!(p, vec![0.5, 0.5, 0.0]);
}

#[test]
fn probs_and_log_softmax_reject_bad_logits() {
    let d = SamplingParams::default();
    assert!(is_invalid(probs(&[], &d)));
    assert!(is_invalid(probs(&[0.0, f32::NAN], &d)));
    assert!(is_invalid(probs(&[0.0, f32::INFINITY], &d)));
    assert!(is_invalid(probs(&[f32::NEG_INFINITY; 3], &d)));
    assert!(is_invalid(log_softmax(&[])));
    assert!(is_invalid(log_softmax(&[f32::NAN])));
    assert!(is_invalid(log_softmax(&[f32::NEG_INFINITY])));
}

#[test]
fn log_softmax_is_stable_and_exact() {
    let logits = [1000.0f32, 1001.0, 999.0, f32::NEG_INFINITY];
    let ls = log_softmax(&logits).unwrap();
    let want = softmax64(&logits, 1.0);
    for (l, w) in ls.iter().zip(&want) {
        if *w == 0.0 {
            assert_eq!(*l, f32::NEG_INFINITY);
        } else {
            assert!((*l as f64 - w.ln()).abs() < 1e-6, "{ls:?}");
        }
    }
}

#[test]
fn token_logprob_matches_the_temperature_softmax() {
    // Hand-computed: logits [2, 1, 0] at T = 0.7 -> scaled [2/0.7, 1/0.7, 0]; log p(0) = 2/0.7 - lse.
    let logits = [2.0f32, 1.0, 0.0];
    let s: Vec<f64> = logits.iter().map(|&x| f64::from(x) / 0.7).collect();
    let lse = s.iter().map(|x| x.exp()).sum::<f64>().ln();
    for (tok, want) in s.iter().map(|x| x - lse).enumerate() {
        let got = f64::from(token_logprob(&logits, tok, 0.7).unwrap());
        assert!((got - want).abs() < 1e-6, "token {tok}: {got} vs {want}");
    }
    // Over a vocabulary-sized row, several temperatures, against the f64 softmax; greedy (0) counts as 1.
    let mut rng = SeededRng::new(3);
    let row: Vec<f32> = (0..49_152).map(|_| (rng.uniform() * 20.0 - 10.0) as f32).collect();
    for t in [0.0f32, 0.5, 0.7, 1.0, 1.3] {
        let want = softmax64(&row, if t == 0.0 { 1.0 } else { f64::from(t) });
        let p_max = want.iter().copied().fold(0.0, f64::max);
        for tok in [0usize, 17, 49_151] {
            let got = f64::from(token_logprob(&row, tok, t).unwrap());
            assert!((got - want[tok].ln()).abs() < 1e-5, "T={t} token {tok}: {got} vs {}", want[tok].ln());
            let (lp, pm) = token_logprob_pmax(&row, tok, t).unwrap();
            assert_eq!(f64::from(lp), got);
            assert!((f64::from(pm) - p_max).abs() < 1e-6 * p_max.max(1e-3), "T={t}: p_max {pm} vs {p_max}");
        }
    }
    assert!(is_invalid(token_logprob(&logits, 3, 1.0)));
    assert!(is_invalid(token_logprob(&logits, 0, -1.0)));
    assert!(is_invalid(token_logprob(&[f32::NAN], 0, 1.0)));
}

#[test]
fn top_p_ties_go_to_lower_ids() {
    // Four equal tokens: top_p = 0.5 keeps exactly two, the lower ids.
    let p = probs(&[0.0; 4], &SamplingParams { top_p: Some(0.5), ..Default::default() }).unwrap();
    assert_eq!(p, vec![0.5, 0.5, 0.0, 0.0]);
    // top_k ties likewise.
    let p = probs(&[1.0, 2.0, 2.0, 2.0], &SamplingParams { top_k: Some(2), ..Default::default() }).unwrap();
    assert_eq!(p, vec![0.0, 0.5, 0.5, 0.0]);
    // top_p = 1 keeps everything.
    let p = probs(&[0.0, 1.0], &SamplingParams { top_p: Some(1.0), ..Default::default() }).unwrap();
    assert!(p.iter().all(|&x| x > 0.0));
}

#[test]
fn categorical_inverse_cdf() {
    let p = [0.0, 0.25, 0.0, 0.75, 0.0];
    assert_eq!(categorical(&p, 0.0).unwrap(), 1);
    assert_eq!(categorical(&p, 0.2499).unwrap(), 1);
    assert_eq!(categorical(&p, 0.25).unwrap(), 3);
    assert_eq!(categorical(&p, 0.999_999_999).unwrap(), 3);
    // Unnormalised weights are fine.
    assert_eq!(categorical(&[2.0, 6.0], 0.3).unwrap(), 1);
    // Long rows use the block-skipping path; never a zero-probability token.
    let mut long = vec![0.0f32; 1000];
    for i in (3..1000).step_by(7) {
        long[i] = 1.0;
    }
    for k in 0..200 {
        let i = categorical(&long, k as f64 / 200.0).unwrap();
        assert!(long[i] > 0.0);
    }
    assert!(is_invalid(categorical(&p, 1.0)));
    assert!(is_invalid(categorical(&p, -0.1)));
    assert!(is_invalid(categorical(&p, f64::NAN)));
    assert!(is_invalid(categorical(&[], 0.5)));
    assert!(is_invalid(categorical(&[0.0, 0.0], 0.5)));
    assert!(is_invalid(categorical(&[0.5, -0.1], 0.5)));
    assert!(is_invalid(categorical(&[0.5, f32::NAN], 0.5)));
    assert!(is_invalid(categorical(&[0.5, f32::INFINITY], 0.5)));
}

/// Mass-and-support checks of top-k then top-p against an f64 reference computed by sorting.
fn check_filtering(logits: &[f32], params: SamplingParams) {
    let p = probs(logits, &params).unwrap();
    let sum: f64 = p.iter().map(|&x| x as f64).sum();
    assert!((sum - 1.0).abs() <= 1e-6, "sum {sum}");
    let base = softmax64(logits, params.temperature as f64);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| base[b].total_cmp(&base[a]).then(a.cmp(&b)));
    let support: Vec<usize> = (0..p.len()).filter(|&i| p[i] > 0.0).collect();
    let k = params.top_k.unwrap_or(logits.len()).min(logits.len());
    assert!(support.len() <= k, "top_k {k}: support {}", support.len());
    // The support is a prefix of the sorted order (up to near-ties that f32 cannot separate).
    let mut kept: Vec<usize> = support.clone();
    kept.sort_by(|&a, &b| base[b].total_cmp(&base[a]).then(a.cmp(&b)));
    let cut = base[*kept.last().unwrap()];
    for &i in &order[..kept.len()] {
        assert!(base[i] >= cut * (1.0 - 1e-5), "token {i} outranks a kept token but was dropped");
    }
    // Kept tokens keep their relative probabilities.
    let z: f64 = kept.iter().map(|&i| base[i]).sum();
    for &i in &kept {
        assert!((p[i] as f64 - base[i] / z).abs() <= 1e-5 * (base[i] / z) + 1e-7, "renormalised mass of {i}");
    }
    if let Some(tp) = params.top_p {
        // Mass of the support within the top-k set reaches top_p, and dropping its last token would not.
        let zk: f64 = order[..k].iter().map(|&i| base[i]).sum();
        let mass: f64 = kept.iter().map(|&i| base[i]).sum::<f64>() / zk;
        assert!(mass >= tp as f64 - 1e-5, "mass {mass} < top_p {tp}");
        let without_last = mass - cut / zk;
        assert!(without_last < tp as f64 + 1e-5, "support not minimal: {without_last} >= {tp}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn top_k_top_p_mass_and_support(
        logits in prop::collection::vec(-8.0f32..8.0, 1..300),
        temperature in 0.05f32..3.0,
        top_k in prop::option::of(1usize..40),
        top_p in prop::option::of(0.01f32..=1.0),
    ) {
        check_filtering(&logits, SamplingParams { temperature, top_k, top_p });
    }

    #[test]
    fn renormalised_distributions_sum_to_one(
        logits in prop::collection::vec(-30.0f32..30.0, 1..2000),
        temperature in 0.01f32..5.0,
        top_p in prop::option::of(0.05f32..=1.0),
    ) {
        let p = probs(&logits, &SamplingParams { temperature, top_k: None, top_p }).unwrap();
        let sum: f64 = p.iter().map(|&x| x as f64).sum();
        prop_assert!((sum - 1.0).abs() <= 1e-6);
        prop_assert!(p.iter().all(|&x| (0.0..=1.0).contains(&x)));
        let am = argmax(&logits).unwrap();
        prop_assert!(p[am] > 0.0);
    }
}

#[test]
fn sample_matches_probs_chi_square() {
    let logits = [0.3f32, -1.2, 2.0, 0.0, 1.1, -0.5, 0.8, -2.5];
    let params = SamplingParams { temperature: 0.9, ..Default::default() };
    let p = probs(&logits, &params).unwrap();
    let draws = 50_000;
    let mut counts = [0usize; 8];
    let mut rng = SeededRng::new(0x5eed);
    for _ in 0..draws {
        counts[sample(&logits, &params, &mut rng).unwrap()] += 1;
    }
    let chi2: f64 = counts
        .iter()
        .zip(&p)
        .map(|(&c, &pi)| {
            let e = pi as f64 * draws as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum();
    // Critical value of chi-square with 7 degrees of freedom at p = 0.001.
    assert!(chi2 < 24.32, "chi2 = {chi2}, counts {counts:?}, probs {p:?}");
}

#[test]
fn sample_respects_top_k_support() {
    let logits = [0.3f32, -1.2, 2.0, 0.0, 1.1, -0.5, 0.8, -2.5];
    let params = SamplingParams { temperature: 1.5, top_k: Some(3), top_p: Some(0.9) };
    let p = probs(&logits, &params).unwrap();
    let mut rng = SeededRng::new(1);
    for _ in 0..2000 {
        assert!(p[sample(&logits, &params, &mut rng).unwrap()] > 0.0);
    }
    // Greedy sampling is argmax and draws nothing.
    let mut a = SeededRng::new(3);
    assert_eq!(sample(&logits, &SamplingParams::greedy(), &mut a).unwrap(), 2);
    assert_eq!(a, SeededRng::new(3));
}

#[test]
fn rng_is_deterministic_and_forks_independently() {
    let draws = |mut r: SeededRng| (0..100).map(|_| r.next_u64()).collect::<Vec<_>>();
    assert_eq!(draws(SeededRng::new(42)), draws(SeededRng::new(42)));
    assert_ne!(draws(SeededRng::new(42)), draws(SeededRng::new(43)));
    let root = SeededRng::new(7);
    assert_eq!(draws(root.fork(5)), draws(root.fork(5)));
    assert_ne!(draws(root.fork(5)), draws(root.fork(6)));
    assert_ne!(draws(root.fork(0)), draws(root.clone()));
    // Same seed, same sampled tokens.
    let logits: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32 * 0.05).collect();
    let params = SamplingParams { temperature: 0.8, top_k: Some(50), top_p: Some(0.95) };
    let run = |seed| {
        let mut r = SeededRng::new(seed);
        (0..50).map(|_| sample(&logits, &params, &mut r).unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(run(9), run(9));
    // Uniforms lie in [0, 1) with mean near 1/2.
    let mut r = SeededRng::new(11);
    let us: Vec<f64> = (0..100_000).map(|_| r.uniform()).collect();
    assert!(us.iter().all(|u| (0.0..1.0).contains(u)));
    let mean = us.iter().sum::<f64>() / us.len() as f64;
    assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
}
