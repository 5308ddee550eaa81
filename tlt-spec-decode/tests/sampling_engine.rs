//! Sampling is lossless through the whole [`Engine`]: on a tiny seeded `tlt_model::Llama` over a 16-token
//! vocabulary, with an imperfect drafter proposing EAGLE-2 trees, the first 3 generated tokens of >= 20,000
//! seeded requests follow the target's exact distribution (computed independently, by enumerating every
//! continuation with `Llama::prefill`), at temperature 1.0 and 0.7 and with top-p 0.9; and the same test fails
//! with a known-biased verifier plugged into the engine. The same holds for group drafting (a `SuffixDrafter`
//! over each batch as one GRPO group, drafting from the siblings), with the biased control failing there too.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::collections::HashMap;

use common::{chi_square, chi_square_p_value, mix, BiasedVerifier};
use tlt_kernels::probs;
use tlt_model::{Llama, LlamaConfig};
use tlt_spec_decode::{
    DraftContext, DraftTree, Drafter, Engine, Plan, Result, SamplingParams, SpecParams, SuffixConfig, SuffixDrafter,
    Verifier,
};

const VOCAB: usize = 16;
const PROMPT: [u32; 3] = [3, 9, 4];
const RUNS: usize = 20_000;
const BATCH: usize = 500;

fn model() -> Llama {
    Llama::random(LlamaConfig::tiny(VOCAB, 32, 2), 2024).unwrap()
}

/// The target's next-token probabilities (temperature 1, raw) after `ctx`.
fn next_probs(m: &Llama, ctx: &[u32], params: &SamplingParams) -> Vec<f64> {
    let mut cache = m.new_cache();
    let seq = cache.add_sequence();
    let logits = m.prefill(&mut cache, seq, ctx).unwrap().to_vec1::<f32>().unwrap();
    probs(&logits, params).unwrap().into_iter().map(f64::from).collect()
}

/// The exact distribution of the first 3 tokens after [`PROMPT`], indexed `(a * V + b) * V + c`.
fn exact3(m: &Llama, params: &SamplingParams) -> Vec<f64> {
    let mut out = vec![0.0; VOCAB * VOCAB * VOCAB];
    let p0 = next_probs(m, &PROMPT, params);
    for a in 0..VOCAB {
        let ctx_a: Vec<u32> = PROMPT.iter().copied().chain([a as u32]).collect();
        let p1 = next_probs(m, &ctx_a, params);
        for b in 0..VOCAB {
            if p0[a] * p1[b] == 0.0 {
                continue;
            }
            let ctx_ab: Vec<u32> = ctx_a.iter().copied().chain([b as u32]).collect();
            let p2 = next_probs(m, &ctx_ab, params);
            for c in 0..VOCAB {
                out[(a * VOCAB + b) * VOCAB + c] = p0[a] * p1[b] * p2[c];
            }
        }
    }
    out
}

/// An imperfect but informed drafter: EAGLE-2 trees scored by the target's own temperature-1 log-probs plus
/// a fixed pseudo-random perturbation of the context (so it often, but not always, proposes likely tokens).
/// Deterministic given the context, as the engine's point-mass verification requires.
struct NoisyDrafter<'a> {
    model: &'a Llama,
    memo: HashMap<Vec<u32>, Vec<f64>>,
}

impl NoisyDrafter<'_> {
    fn scores(&mut self, ctx: &[u32]) -> Vec<(u32, f32)> {
        let m = self.model;
        let p = self.memo.entry(ctx.to_vec()).or_insert_with(|| next_probs(m, ctx, &SamplingParams::default()));
        let key: Vec<u64> = ctx.iter().map(|&t| t as u64).collect();
        p.iter()
            .enumerate()
            .map(|(t, &pt)| {
                let noise = ((mix(&[&key[..], &[t as u64]].concat()) >> 40) as f64 / (1u64 << 24) as f64) * 3.0;
                (t as u32, (pt.max(1e-12).ln() + noise - 3.0) as f32)
            })
            .collect()
    }
}

impl Drafter for NoisyDrafter<'_> {
    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
        let root = *ctx.history.last().unwrap();
        let history = ctx.history.to_vec();
        DraftTree::eagle2(root, plan, |path: &[u32]| {
            let full: Vec<u32> = history.iter().chain(&path[1..]).copied().collect();
            self.scores(&full)
        })
    }
}

/// Which drafter proposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// [`NoisyDrafter`], requests added one by one.
    Noisy,
    /// A [`SuffixDrafter`] over each batch as one group ([`Engine::add_group`]): drafts are the siblings'
    /// most frequent continuations.
    Suffix,
}

/// Counts of the first-3-token cells over [`RUNS`] requests, and the mean drafted tokens accepted per round.
fn sample(m: &Llama, params: &SamplingParams, verifier: Option<BiasedVerifier>, kind: Kind) -> (Vec<u64>, f64) {
    let mut counts = vec![0u64; VOCAB * VOCAB * VOCAB];
    let mut noisy = NoisyDrafter { model: m, memo: HashMap::new() };
    let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
    let (mut accepted, mut seq_rounds) = (0, 0);
    for chunk in 0..RUNS / BATCH {
        let spec = SpecParams {
            sampling: *params,
            max_new_tokens: 3,
            stop_token_ids: Some(vec![]),
            seed: 1000 + chunk as u64,
            ..SpecParams::default()
        };
        let mut engine = Engine::new(m, spec).unwrap();
        if let Some(v) = verifier {
            engine = engine.with_verifier(Box::new(v) as Box<dyn Verifier>);
        }
        let mut suffix =
            SuffixDrafter::new(SuffixConfig { min_match: 1, min_prob: 0.0, ..SuffixConfig::default() }).unwrap();
        let drafter: &mut dyn Drafter = match kind {
            Kind::Noisy => {
                for _ in 0..BATCH {
                    engine.add_request(&PROMPT).unwrap();
                }
                &mut noisy
            }
            Kind::Suffix => {
                engine.add_group(&PROMPT, BATCH, 3).unwrap();
                &mut suffix
            }
        };
        engine.run_to_completion(Some(drafter), &plan).unwrap();
        for f in engine.take_finished() {
            assert_eq!(f.tokens.len(), 3);
            let g = &f.tokens;
            counts[(g[0] as usize * VOCAB + g[1] as usize) * VOCAB + g[2] as usize] += 1;
        }
        accepted += engine.counters().accepted;
        seq_rounds += engine.counters().seq_rounds;
    }
    (counts, accepted as f64 / seq_rounds as f64)
}

fn p_value(m: &Llama, params: &SamplingParams, verifier: Option<BiasedVerifier>, kind: Kind) -> f64 {
    let exact = exact3(m, params);
    let (counts, accepted) = sample(m, params, verifier, kind);
    let (stat, df) = chi_square(&counts, &exact);
    let p = chi_square_p_value(stat, df);
    println!(
        "{kind:?} {params:?} verifier {verifier:?}: {accepted:.2} drafts accepted/round, chi2 {stat:.1}, df {df}, p {p:.3e}"
    );
    // Group drafts have nothing to draft from in the first round (no sibling has committed yet), so fewer
    // drafts are accepted per round on average; still enough to exercise multi-token acceptance.
    let floor = if kind == Kind::Suffix { 0.1 } else { 0.3 };
    assert!(accepted > floor, "the drafter must be good enough to exercise multi-token acceptance");
    p
}

#[test]
fn engine_sampling_matches_the_exact_target_distribution() {
    let m = model();
    for params in [
        SamplingParams { temperature: 1.0, top_k: None, top_p: None },
        SamplingParams { temperature: 0.7, top_k: None, top_p: None },
        SamplingParams { temperature: 1.0, top_k: None, top_p: Some(0.9) },
    ] {
        let p = p_value(&m, &params, None, Kind::Noisy);
        assert!(p > 1e-3, "{params:?}: p = {p:.3e}");
    }
}

#[test]
fn group_drafting_samples_the_exact_target_distribution() {
    let m = model();
    let params = SamplingParams { temperature: 1.0, top_k: None, top_p: None };
    let p = p_value(&m, &params, None, Kind::Suffix);
    assert!(p > 1e-3, "suffix drafter: p = {p:.3e}");
    // The negative control: the same group drafts through a biased verifier must be caught.
    let p = p_value(&m, &params, Some(BiasedVerifier::AcceptIfPossible), Kind::Suffix);
    assert!(p < 1e-3, "biased verifier with the suffix drafter must be caught: p = {p:.3e}");
}

#[test]
fn engine_sampling_test_fails_with_biased_verifiers() {
    let m = model();
    let params = SamplingParams { temperature: 1.0, top_k: None, top_p: None };
    for v in [BiasedVerifier::AcceptIfPossible, BiasedVerifier::NoResidual] {
        let p = p_value(&m, &params, Some(v), Kind::Noisy);
        assert!(p < 1e-3, "{v:?} must be caught: p = {p:.3e}");
    }
}
