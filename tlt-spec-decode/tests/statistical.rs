//! Losslessness of tree speculative sampling, tested statistically.
//!
//! A tiny exact target (vocabulary 8, next-token logits a fixed pseudo-random function of the last two tokens)
//! and an imperfect drafter (a different function) generate the first three tokens after a fixed prompt by
//! speculative rounds (trees of 2 levels x 2 children), many times with independent seeds. The empirical joint
//! distribution of those three tokens (512 cells) is compared with the exact target distribution by Pearson's
//! chi-square test, cells with an expected count below 5 merged, the p-value from the regularized upper
//! incomplete gamma function. A correct verifier must give p > 0.001; the deliberately lossy verifiers must give
//! a statistic far above the critical value.

mod common;

use common::{chi_square, chi_square_p_value, exact3, generate3, BiasedVerifier, Scheme, VerifyFn, VOCAB};
use tlt_spec_decode::{verify_sampling, DraftTree, Proposal, SamplingParams, SeededRng};

/// Independent speculative generations per configuration.
const RUNS: usize = 30_000;

/// Runs [`RUNS`] generations and returns `(chi-square statistic, degrees of freedom, p-value, mean rounds)`.
fn run(verify: &VerifyFn, scheme: Scheme, params: &SamplingParams, seed: u64) -> (f64, usize, f64, f64) {
    let root = SeededRng::new(seed);
    let mut counts = vec![0u64; VOCAB * VOCAB * VOCAB];
    let mut rounds = 0usize;
    for i in 0..RUNS {
        let mut rng = root.fork(i as u64);
        let (cell, r) = generate3(verify, scheme, params, &mut rng);
        counts[cell] += 1;
        rounds += r;
    }
    let (stat, df) = chi_square(&counts, &exact3(params));
    let p = chi_square_p_value(stat, df);
    (stat, df, p, rounds as f64 / RUNS as f64)
}

fn configs() -> Vec<(&'static str, SamplingParams)> {
    vec![
        ("T=1.0", SamplingParams::default()),
        ("T=0.7", SamplingParams { temperature: 0.7, ..Default::default() }),
        ("top-p 0.9", SamplingParams { top_p: Some(0.9), ..Default::default() }),
    ]
}

fn check_lossless(scheme: Scheme, seed: u64) {
    for (name, params) in configs() {
        let (stat, df, p, rounds) = run(&verify_sampling, scheme, &params, seed);
        eprintln!("{scheme:?} {name}: chi2 {stat:.1} df {df} p {p:.4} rounds/3 tokens {rounds:.3}");
        assert!(p > 0.001, "{scheme:?} {name}: chi2 {stat:.1} on {df} df, p = {p:.2e}");
        // Speculation must actually help: fewer than 3 rounds for 3 tokens on average.
        assert!(rounds < 2.9, "{scheme:?} {name}: {rounds} rounds per 3 tokens");
    }
}

#[test]
fn lossless_iid_children() {
    check_lossless(Scheme::Iid, 11);
}

#[test]
fn lossless_children_without_replacement() {
    check_lossless(Scheme::WithoutReplacement, 12);
}

#[test]
fn lossless_deterministic_eagle2_tree() {
    check_lossless(Scheme::Eagle2, 13);
}

/// The test's sensitivity: biased verifiers must fail it by a wide margin.
#[test]
fn biased_verifiers_fail() {
    let params = SamplingParams::default();
    let cases = [
        (BiasedVerifier::AcceptIfPossible, Scheme::Iid),
        (BiasedVerifier::AcceptIfPossible, Scheme::Eagle2),
        (BiasedVerifier::NoResidual, Scheme::Iid),
        (BiasedVerifier::NoResidual, Scheme::Eagle2),
    ];
    for (biased, scheme) in cases {
        let verify = move |t: &DraftTree, r: &[Vec<f32>], q: Proposal<'_>, p: &SamplingParams, rng: &mut SeededRng| {
            biased.verify(t, r, q, p, rng)
        };
        let (stat, df, p, _) = run(&verify, scheme, &params, 14);
        eprintln!("{biased:?} {scheme:?}: chi2 {stat:.1} df {df} p {p:.2e}");
        // Far above the critical value: the 0.001 critical value of chi2(df) is below df + 5 sqrt(2 df) for
        // these df, and we ask for twice that.
        let critical = df as f64 + 5.0 * (2.0 * df as f64).sqrt();
        assert!(
            stat > 2.0 * critical,
            "{biased:?} {scheme:?}: chi2 {stat:.1} on {df} df is not far above {critical:.1}"
        );
        assert!(p < 1e-12);
    }
}

/// The chi-square machinery itself: known quantiles and a multinomial sample of the exact distribution.
#[test]
fn chi_square_machinery() {
    // Q(df/2, x/2) at tabulated 0.05 critical values.
    for (x, df) in [(3.841, 1), (11.070, 5), (18.307, 10), (124.342, 100)] {
        let p = chi_square_p_value(x, df);
        assert!((p - 0.05).abs() < 5e-4, "df {df}: p {p}");
    }
    assert!((chi_square_p_value(2.0, 2) - (-1.0f64).exp()).abs() < 1e-12);
    // Plain (non-speculative) sampling from the exact distribution passes.
    let params = SamplingParams::default();
    let exact = exact3(&params);
    let mut counts = vec![0u64; exact.len()];
    let mut rng = SeededRng::new(99);
    let cdf: Vec<f32> = exact.iter().map(|&x| x as f32).collect();
    for _ in 0..RUNS {
        counts[tlt_kernels::categorical(&cdf, rng.uniform()).expect("valid")] += 1;
    }
    let (stat, df) = chi_square(&counts, &exact);
    assert!(chi_square_p_value(stat, df) > 0.001, "chi2 {stat} on {df}");
}
