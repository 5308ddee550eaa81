//! Engine features on a tiny seeded `tlt_model::Llama`: stop strings, tapped hidden features, drafters that
//! need hidden states.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod engine_common;

use engine_common::{greedy_reference, oracle};
use tlt_model::{Llama, LlamaConfig, LogitsFor, SeqInput, Tap};
use tlt_spec_decode::{
    DraftContext, DraftTree, Drafter, Engine, Error, FinishReason, Plan, Result, SpecParams, TappedLlama, TokenDecoder,
};

const VOCAB: usize = 32;

fn model() -> Llama {
    Llama::random(LlamaConfig::tiny(VOCAB, 64, 4), 11).unwrap()
}

/// Token `t` decodes to the character `'A' + t` (one byte each).
#[derive(Debug)]
struct Letters;

impl TokenDecoder for Letters {
    fn decode(&self, tokens: &[u32]) -> Result<String> {
        Ok(tokens.iter().map(|&t| char::from(b'A' + t as u8)).collect())
    }
}

fn text(tokens: &[u32]) -> String {
    Letters.decode(tokens).unwrap()
}

#[test]
fn stop_strings_end_requests_at_the_completing_token_with_and_without_drafts() {
    let m = model();
    let prompts = vec![vec![1u32, 2, 3], vec![4, 5], vec![9, 9, 9, 9]];
    let n = 24;
    let refs: Vec<Vec<u32>> = prompts.iter().map(|p| greedy_reference(&m, p, n, &[])).collect();
    // A two-token stop string taken from the middle of the first reference, and one that never occurs.
    let stop = text(&refs[0][6..8]);
    let params =
        SpecParams { stop_token_ids: Some(vec![]), stop: vec!["#".into(), stop.clone()], ..SpecParams::greedy(n) };
    for drafted in [false, true] {
        let mut engine = Engine::new(&m, params.clone()).unwrap().with_decoder(Box::new(Letters));
        for p in &prompts {
            engine.add_request(p).unwrap();
        }
        let mut oracle = oracle(VOCAB, &prompts, &refs, 9, false);
        let d: Option<&mut dyn Drafter> = if drafted { Some(&mut oracle) } else { None };
        engine.run_to_completion(d, &Plan::chain(6)).unwrap();
        let mut fin = engine.take_finished();
        fin.sort_by_key(|f| f.id);
        for (k, f) in fin.iter().enumerate() {
            // The expected output: the reference cut at the first token whose prefix text contains the stop.
            let cut = (1..=n).find(|&i| text(&refs[k][..i]).contains(&stop));
            match cut {
                Some(i) => {
                    assert_eq!(f.tokens, refs[k][..i], "prompt {k}, drafted {drafted}");
                    assert_eq!(f.reason, FinishReason::StopString { index: 1 });
                }
                None => {
                    assert_eq!(f.tokens, refs[k], "prompt {k}, drafted {drafted}");
                    assert_eq!(f.reason, FinishReason::Length);
                }
            }
            assert_eq!(f.logprobs.len(), f.tokens.len());
        }
        assert!(fin[0].tokens.len() <= 8, "the first prompt stops by its 8th token");
        if drafted {
            assert!(engine.counters().accepted > 0);
        }
    }
}

#[test]
fn stop_strings_need_a_decoder_and_must_not_be_empty() {
    let m = model();
    let params = SpecParams { stop: vec!["x".into()], ..SpecParams::greedy(4) };
    let mut engine = Engine::new(&m, params).unwrap();
    assert!(matches!(engine.add_request(&[1, 2]), Err(Error::InvalidArgument(_))));
    let empty = SpecParams { stop: vec![String::new()], ..SpecParams::greedy(4) };
    assert!(matches!(Engine::new(&m, empty), Err(Error::InvalidArgument(_))));
}

#[test]
fn tapped_target_records_the_taps_side_by_side_at_every_position() {
    let m = model();
    let taps = Tap::eagle3(m.config().num_hidden_layers);
    let target = TappedLlama { model: &m, taps: &taps };
    let mut engine =
        Engine::new(target, SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(10) }).unwrap();
    engine.record_hidden(true);
    let prompt = [3u32, 1, 4, 1, 5];
    engine.add_request(&prompt).unwrap();
    let refs = greedy_reference(&m, &prompt, 10, &[]);
    let mut oracle = oracle(VOCAB, &[prompt.to_vec()], std::slice::from_ref(&refs), 3, false);
    engine.run_to_completion(Some(&mut oracle), &Plan::chain(4)).unwrap();
    let f = &engine.finished()[0];
    assert_eq!(f.tokens, refs);
    let h = f.hidden.as_ref().unwrap();
    let width = 4 * m.config().hidden_size;
    assert_eq!(h.width(), width);
    assert_eq!(h.len(), prompt.len() + refs.len() - 1);
    // Teacher-forced taps over the whole fed context.
    let ctx: Vec<u32> = prompt.iter().chain(&refs[..refs.len() - 1]).copied().collect();
    let mut cache = m.new_cache();
    let seq = cache.add_sequence();
    let out =
        m.forward(&mut cache, &[SeqInput { seq, tokens: &ctx, tree: None, logits: LogitsFor::None }], &taps).unwrap();
    let parts: Vec<Vec<Vec<f32>>> = out.taps.iter().map(|t| t.to_vec2::<f32>().unwrap()).collect();
    for t in 0..ctx.len() {
        let want: Vec<f32> = parts.iter().flat_map(|p| p[t].iter().copied()).collect();
        let got = h.row(t).unwrap();
        let d = want.iter().zip(got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d < 1e-3, "position {t} differs by {d}");
    }
}

/// A drafter that needs hidden states and checks what it is given: one row per fed position.
struct NeedsHidden {
    seen: usize,
}

impl Drafter for NeedsHidden {
    fn needs_hidden(&self) -> bool {
        true
    }
    fn propose(&mut self, ctx: &DraftContext<'_>, _: &Plan) -> Result<DraftTree> {
        let h = ctx.hidden.expect("the engine checks");
        assert_eq!(h.len(), ctx.history.len() - 1);
        self.seen += 1;
        Ok(DraftTree::new(*ctx.history.last().unwrap()))
    }
}

#[test]
fn drafters_that_need_hidden_states_get_every_position_or_a_clear_error() {
    let m = model();
    let mut engine = Engine::new(&m, SpecParams::greedy(5)).unwrap();
    engine.add_request(&[1, 2, 3]).unwrap();
    let mut d = NeedsHidden { seen: 0 };
    assert!(matches!(engine.step(Some(&mut d), &Plan::chain(2)), Err(Error::InvalidArgument(_))));
    let mut engine = Engine::new(&m, SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(5) }).unwrap();
    engine.record_hidden(true);
    engine.add_request(&[1, 2, 3]).unwrap();
    engine.add_request(&[7]).unwrap();
    engine.step(None, &Plan::chain(2)).unwrap(); // plain first: switching on later still sees every row
    engine.run_to_completion(Some(&mut d), &Plan::chain(2)).unwrap();
    assert_eq!(d.seen, 2 * 4);
}

/// Every committed token carries the largest probability of the distribution it was drawn from (checked against a
/// plain forward of the final sequence at the same temperature), and the speculative rounds are listed with the
/// tokens they committed: their sum is the tokens committed in rounds that drafted, and plain rounds add none.
#[test]
fn committed_tokens_carry_p_max_and_speculative_rounds_are_listed() {
    let m = model();
    let prompts = vec![vec![1u32, 2, 3], vec![4, 5]];
    let n = 20;
    let refs: Vec<Vec<u32>> = prompts.iter().map(|p| greedy_reference(&m, p, n, &[])).collect();
    let t = 0.8f32;
    let params = SpecParams {
        sampling: tlt_kernels::SamplingParams { temperature: t, top_k: None, top_p: None },
        stop_token_ids: Some(vec![]),
        max_new_tokens: n,
        seed: 5,
        ..SpecParams::default()
    };
    let mut e = Engine::new(&m, params).unwrap();
    for p in &prompts {
        e.add_request(p).unwrap();
    }
    // Drafts every round: the continuation greedy decoding took where the history matches it, else token 7s.
    struct Always(Vec<Vec<u32>>);
    impl Drafter for Always {
        fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
            let done = ctx.history.len() - ctx.prompt_len;
            let r = &self.0[ctx.request.0];
            let mut t = DraftTree::new(*ctx.history.last().unwrap());
            let mut at = 0;
            for k in 0..plan.steps {
                let tok = if ctx.history[ctx.prompt_len..] == r[..done.min(r.len())] {
                    r.get(done + k).copied().unwrap_or(7)
                } else {
                    7
                };
                at = t.push_child(at, tok, 0.0)?;
            }
            Ok(t)
        }
    }
    let mut d = Always(refs.clone());
    let plan = Plan::chain(3);
    e.step(None, &plan).unwrap(); // one plain round: not listed
    e.run_to_completion(Some(&mut d), &plan).unwrap();
    let mut fin = e.take_finished();
    fin.sort_by_key(|f| f.id);
    for f in &fin {
        assert_eq!(f.p_max.len(), f.tokens.len());
        let seq: Vec<u32> = [f.prompt.clone(), f.tokens.clone()].concat();
        let mut cache = m.new_cache();
        let s = cache.add_sequence();
        let input = SeqInput { seq: s, tokens: &seq, tree: None, logits: LogitsFor::All };
        let logits = m.forward(&mut cache, &[input], &[]).unwrap().logits.to_vec2::<f32>().unwrap();
        for (i, &pm) in f.p_max.iter().enumerate() {
            let sp = tlt_kernels::SamplingParams { temperature: t, top_k: None, top_p: None };
            let p = tlt_kernels::probs(&logits[f.prompt.len() - 1 + i], &sp).unwrap();
            let want = p.iter().copied().fold(0.0f32, f32::max);
            assert!((pm - want).abs() < 1e-4, "token {i}: p_max {pm} vs {want}");
            assert!(pm > 0.0 && pm <= 1.0 + 1e-6);
        }
        assert!(!f.sd_rounds.is_empty(), "the drafter drafted");
        assert_eq!(f.sd_rounds[0].0, 1, "the first token came from the plain round");
        let in_sd: u32 = f.sd_rounds.iter().map(|&(_, c)| c).sum();
        // Every round after the first drafted (the oracle always proposes), so they committed the rest.
        assert_eq!(in_sd as usize, f.tokens.len() - 1);
        assert!(f.sd_rounds.windows(2).all(|w| w[1].0 == w[0].0 + w[0].1), "contiguous rounds");
    }
}
