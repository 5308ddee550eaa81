//! The engine on a tiny seeded `tlt_model::Llama`: plain and speculative greedy decoding equal plain
//! prefill/decode, sampling is seeded, log-probs and hidden states match a teacher-forced forward, stop tokens,
//! bad input.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod engine_common;

use engine_common::{greedy_reference, oracle, run_batches};
use tlt_kernels::log_softmax;
use tlt_model::{Llama, LlamaConfig, LogitsFor, SeqInput, Tap};
use tlt_spec_decode::{
    DraftContext, Drafter, Engine, Error, FinishReason, Finished, NgramDrafter, Plan, SamplingParams, SpecParams,
};

const VOCAB: usize = 32;

fn model() -> Llama {
    Llama::random(LlamaConfig::tiny(VOCAB, 64, 2), 7).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5, 1, 2, 3],
        vec![7],
        vec![9, 8, 7, 6, 9, 8, 7, 6, 9, 8],
        vec![3, 3, 3, 3],
        vec![10, 20, 30, 11, 21, 31, 12, 22],
        vec![5, 6],
    ]
}

#[test]
fn greedy_engine_matches_prefill_decode_for_every_drafter_and_batch() {
    let m = model();
    let n = 24;
    let refs: Vec<Vec<u32>> = prompts().iter().map(|p| greedy_reference(&m, p, n, &[])).collect();
    let params = SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(n) };
    let ngram_plan = Plan { steps: 4, top_k: 2, verify_tokens: 8 };
    for batch in [1, 3, 6] {
        let (plain, acc) = run_batches(&m, &params, &prompts(), batch, None, &Plan::chain(1), None, false);
        assert_eq!(acc, 0);
        let mut ng = NgramDrafter::default();
        let (ngram, _) = run_batches(&m, &params, &prompts(), batch, Some(&mut ng), &ngram_plan, None, false);
        let (oracle, acc) = run_batches(&m, &params, &prompts(), batch, None, &Plan::chain(5), Some(&refs), false);
        assert!(acc > 0, "the oracle's drafts are accepted");
        let tree_plan = Plan { steps: 5, top_k: 2, verify_tokens: 8 };
        let (otree, acc) = run_batches(&m, &params, &prompts(), batch, None, &tree_plan, Some(&refs), true);
        assert!(acc > 0, "the tree oracle's drafts are accepted");
        for (k, r) in refs.iter().enumerate() {
            for (name, got) in [("plain", &plain), ("ngram", &ngram), ("oracle", &oracle), ("tree oracle", &otree)] {
                assert_eq!(&got[k].tokens, r, "{name}, batch {batch}, prompt {k}");
                assert_eq!(got[k].reason, FinishReason::Length);
            }
        }
    }
}

#[test]
fn switching_the_drafter_mid_generation_needs_no_prefill() {
    let m = model();
    let n = 30;
    let ps = prompts();
    let refs: Vec<Vec<u32>> = ps.iter().map(|p| greedy_reference(&m, p, n, &[])).collect();
    let params = SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(n) };
    let mut engine = Engine::new(&m, params).unwrap();
    for p in &ps {
        engine.add_request(p).unwrap();
    }
    let mut oracle = oracle(VOCAB, &ps, &refs, 4, true);
    let mut ngram = NgramDrafter::default();
    let mut round = 0;
    while !engine.is_idle() {
        let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
        match round % 3 {
            0 => engine.step(None, &plan).unwrap(),
            1 => engine.step(Some(&mut oracle), &plan).unwrap(),
            _ => engine.step(Some(&mut ngram), &plan).unwrap(),
        }
        round += 1;
    }
    assert!(engine.counters().accepted > 0);
    let mut fin = engine.take_finished();
    fin.sort_by_key(|f| f.id);
    for (k, f) in fin.iter().enumerate() {
        assert_eq!(f.tokens, refs[k], "prompt {k}");
        assert_eq!(f.prompt, ps[k]);
    }
}

/// Teacher-forced log-probs of `tokens` after `prompt`, and final-norm states of every position fed.
fn teacher_forced(m: &Llama, prompt: &[u32], tokens: &[u32], temperature: f32) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut cache = m.new_cache();
    let seq = cache.add_sequence();
    let ctx: Vec<u32> = prompt.iter().chain(&tokens[..tokens.len() - 1]).copied().collect();
    let out = m
        .forward(&mut cache, &[SeqInput { seq, tokens: &ctx, tree: None, logits: LogitsFor::All }], &[Tap::FinalNorm])
        .unwrap();
    let rows = out.logits.to_vec2::<f32>().unwrap();
    let hid = out.taps[0].to_vec2::<f32>().unwrap();
    let p = prompt.len() - 1;
    // The engine records log-probabilities at the sampling temperature (greedy: 1), without top-p.
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let scaled = |row: &[f32]| row.iter().map(|x| x / t).collect::<Vec<f32>>();
    let lps =
        tokens.iter().enumerate().map(|(i, &tok)| log_softmax(&scaled(&rows[p + i])).unwrap()[tok as usize]).collect();
    (lps, hid)
}

#[test]
fn logprobs_and_hidden_states_match_a_teacher_forced_forward() {
    let m = model();
    for temperature in [0.0, 0.8] {
        let params = SpecParams {
            sampling: SamplingParams { temperature, top_k: None, top_p: Some(0.95) },
            max_new_tokens: 20,
            stop_token_ids: Some(vec![]),
            seed: 3,
            ..SpecParams::default()
        };
        let mut engine = Engine::new(&m, params).unwrap();
        engine.record_hidden(true);
        for p in prompts() {
            engine.add_request(&p).unwrap();
        }
        let mut ngram = NgramDrafter { min_ngram: 1, max_ngram: 2 };
        engine.run_to_completion(Some(&mut ngram), &Plan { steps: 3, top_k: 2, verify_tokens: 6 }).unwrap();
        for f in engine.finished() {
            assert_eq!(f.tokens.len(), 20);
            assert_eq!(f.logprobs.len(), 20);
            let hidden = f.hidden.as_ref().expect("recorded");
            assert_eq!(hidden.len(), f.prompt.len() + 20 - 1, "every fed position, prompt included");
            let (lps, hid) = teacher_forced(&m, &f.prompt, &f.tokens, temperature);
            for (i, (want, got)) in lps.iter().zip(&f.logprobs).enumerate() {
                assert!((want - got).abs() < 1e-3, "logprob {i}: {want} vs {got}");
                assert!(*got <= 0.0);
            }
            for (t, want) in hid.iter().enumerate() {
                let d = want.iter().zip(hidden.row(t).unwrap()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(d < 1e-3, "hidden {t} differs by {d}");
            }
            assert_eq!(f.token_hidden(0), hidden.row(f.prompt.len() - 1));
        }
    }
}

/// Speculative decoding commits plain decoding's tokens with plain decoding's log-probabilities, by bits, whether
/// a request runs alone or beside five others (other trees, other round starts), greedy and sampled, over contexts
/// that cross the attention's key tiles. The drafts come from an oracle of the plain run's own tokens (every 3rd
/// wrong), so most are accepted and committed from verify trees.
#[test]
fn speculative_log_probs_are_plain_decodings_bits_alone_and_in_any_batch() {
    let m = model();
    let ps = prompts();
    let bits =
        |f: &Finished| -> (Vec<u32>, Vec<u32>) { (f.tokens.clone(), f.logprobs.iter().map(|v| v.to_bits()).collect()) };
    for temperature in [0.0, 0.8] {
        let params = SpecParams {
            sampling: SamplingParams { temperature, top_k: None, top_p: Some(0.95) },
            max_new_tokens: 48,
            stop_token_ids: Some(vec![]),
            seed: 3,
            ..SpecParams::default()
        };
        // Runs `prompts` (whose first is prompt `first` of the whole list) in one engine.
        let run = |first: usize, prompts: &[Vec<u32>], source: Option<&[Vec<u32>]>| -> (Vec<Finished>, u64) {
            let mut engine = Engine::new(&m, params.clone()).unwrap();
            engine.key_streams_from(first as u64);
            for p in prompts {
                engine.add_request(p).unwrap();
            }
            let plan = Plan { steps: 5, top_k: 2, verify_tokens: 8 };
            match source {
                Some(src) => {
                    let mut o = oracle(VOCAB, prompts, src, 3, true);
                    engine.run_to_completion(Some(&mut o), &plan).unwrap();
                }
                None => engine.run_to_completion(None, &Plan::chain(1)).unwrap(),
            }
            let mut fin = engine.take_finished();
            fin.sort_by_key(|f| f.id);
            (fin, engine.counters().accepted)
        };
        let plain: Vec<Finished> = (0..ps.len()).map(|k| run(k, &ps[k..=k], None).0.remove(0)).collect();
        let source: Vec<Vec<u32>> = plain.iter().map(|f| f.tokens.clone()).collect();
        let (together, accepted) = run(0, &ps, Some(&source));
        assert!(accepted > 100, "T={temperature}: only {accepted} drafts accepted");
        for k in 0..ps.len() {
            let (alone, _) = run(k, &ps[k..=k], Some(&source[k..=k]));
            assert_eq!(bits(&alone[0]), bits(&plain[k]), "T={temperature}, prompt {k}: speculative alone");
            assert_eq!(bits(&together[k]), bits(&plain[k]), "T={temperature}, prompt {k}: beside the others");
        }
    }
}

fn sample_all(m: &Llama, seed: u64, drafter: Option<&mut dyn Drafter>) -> Vec<Vec<u32>> {
    let params = SpecParams {
        sampling: SamplingParams { temperature: 1.0, top_k: Some(20), top_p: Some(0.9) },
        max_new_tokens: 16,
        stop_token_ids: Some(vec![]),
        seed,
        ..SpecParams::default()
    };
    let mut engine = Engine::new(m, params).unwrap();
    for p in prompts() {
        engine.add_request(&p).unwrap();
    }
    engine.run_to_completion(drafter, &Plan { steps: 3, top_k: 2, verify_tokens: 6 }).unwrap();
    let mut fin = engine.take_finished();
    fin.sort_by_key(|f| f.id);
    fin.into_iter().map(|f| f.tokens).collect()
}

#[test]
fn sampling_is_deterministic_per_seed() {
    let m = model();
    let a = sample_all(&m, 11, None);
    assert_eq!(a, sample_all(&m, 11, None));
    assert_ne!(a, sample_all(&m, 12, None), "another seed gives other samples");
    let mut d1 = NgramDrafter::default();
    let mut d2 = NgramDrafter::default();
    assert_eq!(sample_all(&m, 5, Some(&mut d1)), sample_all(&m, 5, Some(&mut d2)));
}

/// A shard of the requests, its coin streams keyed by their indices in the whole batch
/// ([`Engine::key_streams_from`]), samples exactly the tokens the whole batch's engine gave those requests, with
/// and without a drafter; unkeyed (streams by the shard's own request ids) it does not: the negative control.
#[test]
fn keyed_streams_let_a_shard_reproduce_the_whole_batch() {
    let m = model();
    let whole = sample_all(&m, 13, None);
    let params = SpecParams {
        sampling: SamplingParams { temperature: 1.0, top_k: Some(20), top_p: Some(0.9) },
        max_new_tokens: 16,
        stop_token_ids: Some(vec![]),
        seed: 13,
        ..SpecParams::default()
    };
    let shard = |first: usize, keyed: bool, drafter: Option<&mut dyn Drafter>| -> Vec<Vec<u32>> {
        let mut engine = Engine::new(&m, params.clone()).unwrap();
        if keyed {
            engine.key_streams_from(first as u64);
        }
        for p in &prompts()[first..] {
            engine.add_request(p).unwrap();
        }
        engine.run_to_completion(drafter, &Plan { steps: 3, top_k: 2, verify_tokens: 6 }).unwrap();
        let mut fin = engine.take_finished();
        fin.sort_by_key(|f| f.id);
        fin.into_iter().map(|f| f.tokens).collect()
    };
    assert_eq!(shard(3, true, None), whole[3..], "keyed streams reproduce the whole batch's samples");
    let mut ngram = NgramDrafter::default();
    assert_eq!(shard(3, true, Some(&mut ngram)), whole[3..], "and with speculative decoding");
    assert_ne!(shard(3, false, None), whole[3..], "streams by the shard's own ids sample other tokens");
}

#[test]
fn stop_tokens_end_sequences_inclusively() {
    let m = model();
    let ps = prompts();
    let long: Vec<Vec<u32>> = ps.iter().map(|p| greedy_reference(&m, p, 24, &[])).collect();
    // Stop on the 5th greedy token of the first prompt (and whatever else uses it).
    let stop = long[0][4];
    let params = SpecParams { stop_token_ids: Some(vec![stop]), ..SpecParams::greedy(24) };
    for drafted in [false, true] {
        let mut engine = Engine::new(&m, params.clone()).unwrap();
        for p in &ps {
            engine.add_request(p).unwrap();
        }
        let mut oracle = oracle(VOCAB, &ps, &long, 7, false);
        let d: Option<&mut dyn Drafter> = if drafted { Some(&mut oracle) } else { None };
        engine.run_to_completion(d, &Plan::chain(6)).unwrap();
        let mut fin = engine.take_finished();
        fin.sort_by_key(|f| f.id);
        for (k, f) in fin.iter().enumerate() {
            let expect = greedy_reference(&m, &ps[k], 24, &[stop]);
            assert_eq!(f.tokens, expect, "prompt {k}, drafted {drafted}");
            assert_eq!(f.logprobs.len(), f.tokens.len());
            let reason = if expect.last() == Some(&stop) { FinishReason::Stop } else { FinishReason::Length };
            assert_eq!(f.reason, reason);
        }
        assert_eq!(fin[0].tokens.len(), long[0].iter().position(|&t| t == stop).unwrap() + 1);
    }
}

#[test]
fn bad_input_is_an_error() {
    let m = model();
    assert!(matches!(Engine::new(&m, SpecParams::greedy(0)), Err(Error::InvalidArgument(_))));
    let bad_p = SpecParams {
        sampling: SamplingParams { top_p: Some(1.5), ..SamplingParams::default() },
        ..SpecParams::default()
    };
    assert!(Engine::new(&m, bad_p).is_err());
    let bad_t = SpecParams {
        sampling: SamplingParams { temperature: -0.5, ..SamplingParams::default() },
        ..SpecParams::default()
    };
    assert!(Engine::new(&m, bad_t).is_err());
    let nan_t = SpecParams {
        sampling: SamplingParams { temperature: f32::NAN, ..SamplingParams::default() },
        ..SpecParams::default()
    };
    assert!(Engine::new(&m, nan_t).is_err());
    let bad_k = SpecParams {
        sampling: SamplingParams { top_k: Some(0), ..SamplingParams::default() },
        ..SpecParams::default()
    };
    assert!(bad_k.validate().is_err());

    let mut engine = Engine::new(&m, SpecParams::greedy(4)).unwrap();
    assert!(matches!(engine.add_request(&[]), Err(Error::InvalidArgument(_))));
    assert!(matches!(engine.add_request(&[1, VOCAB as u32]), Err(Error::InvalidArgument(_))));
    let too_long = vec![1u32; m.config().max_position_embeddings];
    assert!(matches!(engine.add_request(&too_long), Err(Error::InvalidArgument(_))));
    assert!(engine.is_idle(), "rejected requests leave nothing behind");
    engine.add_request(&[1, 2]).unwrap();
    assert!(engine.step(Some(&mut NgramDrafter::default()), &Plan::chain(0)).is_err(), "invalid plan");
    // A drafter whose tree is not rooted at the last token.
    struct Wrong;
    impl Drafter for Wrong {
        fn propose(&mut self, _: &DraftContext<'_>, _: &Plan) -> tlt_spec_decode::Result<tlt_spec_decode::DraftTree> {
            Ok(tlt_spec_decode::DraftTree::chain(5, &[1]))
        }
    }
    assert!(matches!(engine.step(Some(&mut Wrong), &Plan::chain(1)), Err(Error::InvalidTree(_))));
    // Plain decoding still works afterwards: the failed step touched nothing.
    engine.run_to_completion(None, &Plan::chain(1)).unwrap();
    assert_eq!(engine.finished()[0].tokens, greedy_reference(&m, &[1, 2], 4, &[]));
}

#[test]
fn params_round_trip_through_serde() {
    let p = SpecParams {
        sampling: SamplingParams { temperature: 0.7, top_k: Some(5), top_p: Some(0.9) },
        max_new_tokens: 9,
        stop_token_ids: Some(vec![2]),
        stop: vec!["\n\n".into()],
        seed: 4,
    };
    let text = serde_json::to_string(&p).unwrap();
    assert_eq!(serde_json::from_str::<SpecParams>(&text).unwrap(), p);
    let d: SpecParams = serde_json::from_str("{}").unwrap();
    assert_eq!(d, SpecParams::default());
    assert!(d.validate().is_ok());
}

/// The sequential (pre-coupling) lossless verifier: fresh coins per sibling, so its tokens depend on the tree.
#[derive(Debug)]
struct SequentialVerifier;

impl tlt_spec_decode::Verifier for SequentialVerifier {
    fn verify(
        &self,
        tree: &tlt_spec_decode::DraftTree,
        rows: &[&[f32]],
        params: &SamplingParams,
        coins: &tlt_spec_decode::Coins,
    ) -> tlt_spec_decode::Result<tlt_spec_decode::Accepted> {
        let mut rng = coins.sequential();
        tlt_spec_decode::verify_sampling(tree, rows, tlt_spec_decode::Proposal::PointMass, params, &mut rng)
    }
}

/// Generated tokens of every prompt with `drafter` (plain without one), and the drafts accepted.
fn sampled(
    m: &Llama,
    params: &SpecParams,
    drafter: Option<&mut dyn Drafter>,
    sequential: bool,
) -> (Vec<Vec<u32>>, u64) {
    let mut engine = Engine::new(m, params.clone()).unwrap();
    if sequential {
        engine = engine.with_verifier(Box::new(SequentialVerifier));
    }
    for p in prompts() {
        engine.add_request(&p).unwrap();
    }
    engine.run_to_completion(drafter, &Plan { steps: 4, top_k: 2, verify_tokens: 8 }).unwrap();
    let accepted = engine.counters().accepted;
    let mut fin = engine.take_finished();
    fin.sort_by_key(|f| f.id);
    (fin.into_iter().map(|f| f.tokens).collect(), accepted)
}

/// Coupled verification: sampled speculative decoding commits exactly plain decoding's tokens (same seed), at
/// temperature 1 and at 0.7 with top-p, whatever the drafter; the sequential verifier (lossless in distribution
/// only) is the negative control.
#[test]
fn sampled_speculative_decoding_commits_plain_decodings_tokens() {
    let m = model();
    for sampling in [
        SamplingParams { temperature: 1.0, top_k: None, top_p: None },
        SamplingParams { temperature: 0.7, top_k: None, top_p: Some(0.9) },
    ] {
        let params = SpecParams {
            sampling,
            max_new_tokens: 40,
            stop_token_ids: Some(vec![]),
            seed: 11,
            ..SpecParams::default()
        };
        let (plain, _) = sampled(&m, &params, None, false);
        let mut ngram = NgramDrafter { min_ngram: 1, max_ngram: 3 };
        let (ng, ng_acc) = sampled(&m, &params, Some(&mut ngram), false);
        // An oracle drafting plain's own samples: most drafts are accepted, and the tokens still match.
        let mut orc = oracle(VOCAB, &prompts(), &plain, 1, true);
        let (or, or_acc) = sampled(&m, &params, Some(&mut orc), false);
        assert!(ng_acc > 0 && or_acc > ng_acc, "{sampling:?}: accepted {ng_acc} / {or_acc}");
        assert_eq!(ng, plain, "{sampling:?}: n-gram drafting changed the samples");
        assert_eq!(or, plain, "{sampling:?}: oracle drafting changed the samples");
        let mut ngram = NgramDrafter { min_ngram: 1, max_ngram: 3 };
        let (seq, seq_acc) = sampled(&m, &params, Some(&mut ngram), true);
        assert!(seq_acc > 0);
        assert_ne!(seq, plain, "{sampling:?}: the negative control should depend on the drafts");
    }
}
