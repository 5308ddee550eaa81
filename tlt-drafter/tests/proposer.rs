//! The EAGLE drafters at inference: the packed runtime equals the training forward, proposed trees follow the
//! drafter's own sequential predictions, speculative decoding through the engine stays lossless, and weights
//! published by a concurrent trainer are picked up between rounds, one version per round.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::*;
use tlt_drafter::online::WeightsSlot;
use tlt_drafter::{
    DraftCache, DraftRuntime, DrafterConfig, Eagle2Batch, Eagle2Drafter, Eagle3Batch, Eagle3Drafter, EagleProposer,
    FrozenTarget, RuntimeOptions, Teacher, VocabMap,
};
use tlt_kernels::WeightDType;
use tlt_model::{Llama, Tap};
use tlt_spec_decode::{DraftContext, Drafter, Engine, HiddenStates, Plan, RequestId, SpecParams, TappedLlama};

const F32: RuntimeOptions =
    RuntimeOptions { layer_dtype: WeightDType::F32, head_dtype: WeightDType::F32, hot_vocab: None };

fn eagle2(target: &Llama, seed: u64) -> Eagle2Drafter {
    let cfg = DrafterConfig::eagle2_from_target(target.config(), true);
    Eagle2Drafter::random(cfg, FrozenTarget::new(target), seed).unwrap()
}

fn eagle3(target: &Llama, seed: u64) -> Eagle3Drafter {
    let cfg = DrafterConfig::eagle3_from_target(target.config(), 16);
    let vocab = VocabMap::from_tokens(tokens(4, 20, 2).into_iter().flatten(), VOCAB, 16, &[2]).unwrap();
    Eagle3Drafter::random(cfg, vocab, FrozenTarget::new(target), seed).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn rows_of(t: &Tensor) -> Vec<Vec<f32>> {
    t.squeeze(0).unwrap().to_vec2::<f32>().unwrap()
}

#[test]
fn eagle2_runtime_matches_the_training_forward() {
    for arch in ["llama", "qwen3"] {
        eagle2_runtime_matches_the_training_forward_for(arch);
    }
}

fn eagle2_runtime_matches_the_training_forward_for(arch: &str) {
    let target = target(arch, 3);
    let row = tokens(1, 12, 1);
    let out = run_target(&target, &row);
    let d = eagle2(&target, 5);
    let batch = Eagle2Batch {
        input_ids: out.ids.clone(),
        hidden: out.final_hidden.clone(),
        loss_mask: Tensor::ones((1, 12), DType::F32, &Device::Cpu).unwrap(),
        segments: None,
    };
    let pred = rows_of(&d.forward_train(&batch).unwrap());
    let hidden = rows_of(&out.final_hidden);
    let rt = DraftRuntime::eagle2(&d, &F32).unwrap();
    let mut cache = DraftCache::default();
    let feats: Vec<&[f32]> = hidden.iter().map(Vec::as_slice).collect();
    // In two chunks, to exercise the cache.
    let a = rt.extend(&mut cache, &row[0][..6], &feats).unwrap();
    let b = rt.extend(&mut cache, &row[0], &feats).unwrap();
    assert_eq!(cache.len(), 11);
    let got: Vec<f32> = a.into_iter().chain(b).collect();
    let want: Vec<f32> = pred[..11].concat();
    assert!(max_diff(&got, &want) < 1e-4, "{}", max_diff(&got, &want));
    // Logits through the packed head equal the target head's.
    let logits = rt.logits(&got).unwrap();
    let head = FrozenTarget::new(&target).lm_head().to_vec2::<f32>().unwrap();
    let want0: Vec<f32> = head.iter().map(|r| r.iter().zip(&pred[0]).map(|(w, x)| w * x).sum()).collect();
    assert!(max_diff(&logits[..VOCAB], &want0) < 1e-4);
}

#[test]
fn eagle3_runtime_matches_step0_of_the_training_forward() {
    for arch in ["llama", "qwen3"] {
        eagle3_runtime_matches_step0_for(arch);
    }
}

fn eagle3_runtime_matches_step0_for(arch: &str) {
    let target = target(arch, 4);
    let row = tokens(1, 10, 2);
    let out = run_target(&target, &row);
    let d = eagle3(&target, 6);
    let batch = Eagle3Batch {
        input_ids: out.ids.clone(),
        aux_hidden: out.aux.clone(),
        teacher: Teacher::Logits(out.logits.clone()),
        loss_mask: Tensor::ones((1, 10), DType::F32, &Device::Cpu).unwrap(),
        segments: None,
    };
    let step0 = rows_of(&d.forward_train(&batch, 1).unwrap()[0]);
    let aux = rows_of(&out.aux);
    let rt = DraftRuntime::eagle3(&d, &F32).unwrap();
    assert_eq!(rt.feature_width(), 3 * HIDDEN);
    let mut cache = DraftCache::default();
    let feats: Vec<&[f32]> = aux.iter().map(Vec::as_slice).collect();
    let a = rt.extend(&mut cache, &row[0], &feats).unwrap();
    let logits = rt.logits(&a).unwrap();
    assert!(max_diff(&logits, &step0[..9].concat()) < 1e-4, "{}", max_diff(&logits, &step0[..9].concat()));
}

/// Checks every node of `tree`: its children are among the top-`k` of the drafter's own distribution after the
/// node's path, computed by extending a fresh cache position by position with its own outputs as features.
fn check_tree_against_sequential(
    rt: &DraftRuntime,
    history: &[u32],
    hidden: &HiddenStates,
    tree: &tlt_spec_decode::DraftTree,
    k: usize,
) {
    for i in 0..tree.len() {
        let kids = tree.children(i).unwrap();
        if kids.is_empty() {
            continue;
        }
        let path: Vec<u32> = tree.path_to(i).unwrap().iter().map(|&j| tree.node(j).unwrap().token).collect();
        let mut cache = DraftCache::default();
        let mut feats: Vec<Vec<f32>> =
            (0..hidden.len()).map(|t| rt.feature_of(hidden.row(t).unwrap()).unwrap().to_vec()).collect();
        let mut toks = history.to_vec();
        let refs: Vec<&[f32]> = feats.iter().map(Vec::as_slice).collect();
        let mut last = rt.extend(&mut cache, &toks, &refs).unwrap();
        for &t in &path[1..] {
            let h = rt.hidden_size();
            feats.push(last[last.len() - h..].to_vec());
            toks.push(t);
            let refs: Vec<&[f32]> = feats.iter().map(Vec::as_slice).collect();
            last = rt.extend(&mut cache, &toks, &refs).unwrap();
        }
        let logits = rt.logits(&last[last.len() - rt.hidden_size()..]).unwrap();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let top: Vec<u32> = order[..k].iter().map(|&j| rt.target_id(j)).collect();
        for &c in kids {
            let tok = tree.node(c).unwrap().token;
            assert!(top.contains(&tok), "node {i}: child {tok} not in top-{k} {top:?}");
        }
    }
}

#[test]
fn proposed_trees_follow_the_drafters_sequential_predictions() {
    let target = target("llama", 5);
    for kind in ["eagle2", "eagle3"] {
        let (rt, taps) = if kind == "eagle2" {
            (DraftRuntime::eagle2(&eagle2(&target, 7), &F32).unwrap(), vec![Tap::FinalNorm])
        } else {
            (DraftRuntime::eagle3(&eagle3(&target, 7), &F32).unwrap(), Tap::eagle3(LAYERS).to_vec())
        };
        let mut proposer = EagleProposer::fixed(rt.clone());
        let histories = tokens(2, 9, 4);
        let hiddens: Vec<HiddenStates> = histories
            .iter()
            .map(|h| {
                let out = run_target_taps(&target, &h[..h.len() - 1], &taps);
                HiddenStates::from_flat(out.1, out.0).unwrap()
            })
            .collect();
        let ctxs: Vec<DraftContext<'_>> = histories
            .iter()
            .zip(&hiddens)
            .enumerate()
            .map(|(i, (h, hid))| DraftContext {
                request: RequestId(i),
                history: h,
                prompt_len: 3,
                hidden: Some(hid),
                group: None,
            })
            .collect();
        for plan in [Plan::chain(3), Plan { steps: 3, top_k: 2, verify_tokens: 7 }] {
            let trees = proposer.propose_batch(&ctxs, &plan).unwrap();
            for ((tree, h), hid) in trees.iter().zip(&histories).zip(&hiddens) {
                assert!(tree.len() <= plan.verify_tokens);
                assert!(tree.len() > 1, "{kind}: a draft was proposed");
                check_tree_against_sequential(&rt, h, hid, tree, plan.top_k);
            }
        }
    }
}

/// Features of every position of `tokens` with the given taps, flat, and the row width.
fn run_target_taps(target: &Llama, tokens: &[u32], taps: &[Tap]) -> (Vec<f32>, usize) {
    let mut cache = target.new_cache();
    let seq = cache.add_sequence();
    let out = target
        .forward(
            &mut cache,
            &[tlt_model::SeqInput { seq, tokens, tree: None, logits: tlt_model::LogitsFor::None }],
            taps,
        )
        .unwrap();
    let cat = Tensor::cat(&out.taps, 1).unwrap();
    (cat.flatten_all().unwrap().to_vec1::<f32>().unwrap(), cat.dim(1).unwrap())
}

/// Plain greedy continuations of `prompts` through the engine.
fn plain<T: tlt_spec_decode::Target>(t: T, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    let mut e = Engine::new(t, SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(n) }).unwrap();
    for p in prompts {
        e.add_request(p).unwrap();
    }
    e.run_to_completion(None, &Plan::chain(1)).unwrap();
    let mut f = e.take_finished();
    f.sort_by_key(|f| f.id);
    f.into_iter().map(|f| f.tokens).collect()
}

/// Greedy speculative decoding with EAGLE-2 and EAGLE-3 drafters commits the plain target's tokens, for a Llama and
/// a Qwen3 target (q/k head norms, head_dim decoupled from the width; its drafters are llama layers).
#[test]
fn eagle_speculative_decoding_is_lossless_through_the_engine() {
    for arch in ["llama", "qwen3"] {
        eagle_speculative_decoding_is_lossless_for(arch);
    }
}

fn eagle_speculative_decoding_is_lossless_for(arch: &str) {
    let target = target(arch, 8);
    let prompts = tokens(3, 6, 5);
    let n = 20;
    let refs = plain(&target, &prompts, n);
    let taps = Tap::eagle3(LAYERS);
    for kind in ["eagle2", "eagle3"] {
        let params = SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(n) };
        let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
        let (fin, drafted) = if kind == "eagle2" {
            let mut p =
                EagleProposer::fixed(DraftRuntime::eagle2(&eagle2(&target, 9), &RuntimeOptions::default()).unwrap());
            let mut e = Engine::new(&target, params).unwrap();
            e.record_hidden(true);
            for q in &prompts {
                e.add_request(q).unwrap();
            }
            e.step(None, &plan).unwrap(); // plain first: the drafter catches up later
            e.run_to_completion(Some(&mut p), &plan).unwrap();
            (e.take_finished(), e.counters().drafted)
        } else {
            let mut p =
                EagleProposer::fixed(DraftRuntime::eagle3(&eagle3(&target, 9), &RuntimeOptions::default()).unwrap());
            let mut e = Engine::new(TappedLlama { model: &target, taps: &taps }, params).unwrap();
            e.record_hidden(true);
            for q in &prompts {
                e.add_request(q).unwrap();
            }
            e.run_to_completion(Some(&mut p), &plan).unwrap();
            (e.take_finished(), e.counters().drafted)
        };
        assert!(drafted > 0, "{arch} {kind} drafted");
        let mut fin = fin;
        fin.sort_by_key(|f| f.id);
        for (f, r) in fin.iter().zip(&refs) {
            assert_eq!(&f.tokens, r, "{arch} {kind}");
        }
    }
}

#[test]
fn weights_published_by_a_concurrent_trainer_are_picked_up_one_version_per_round() {
    let target = target("llama", 10);
    let prompts = tokens(4, 5, 6);
    let n = 40;
    let refs = plain(&target, &prompts, n);
    let frozen = FrozenTarget::new(&target);
    let cfg = DrafterConfig::eagle2_from_target(target.config(), false);
    let make = |seed: u64| {
        let d = Eagle2Drafter::random(cfg.clone(), frozen.clone(), seed).unwrap();
        DraftRuntime::eagle2(&d, &RuntimeOptions::default()).unwrap()
    };
    let versions: Vec<DraftRuntime> = (1..=100).map(make).collect();
    let slot = Arc::new(WeightsSlot::new(make(0)));
    let mut proposer = EagleProposer::new(slot.clone());
    let publisher = {
        let slot = slot.clone();
        std::thread::spawn(move || {
            for rt in versions {
                slot.publish(rt);
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
        })
    };
    let mut fins = Vec::new();
    let mut rounds = 0;
    while fins.len() < 3 || !publisher.is_finished() {
        let mut e = Engine::new(&target, SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(n) }).unwrap();
        e.record_hidden(true);
        for q in &prompts {
            e.add_request(q).unwrap();
        }
        e.run_to_completion(Some(&mut proposer), &Plan { steps: 3, top_k: 2, verify_tokens: 6 }).unwrap();
        rounds += e.counters().rounds;
        let mut f = e.take_finished();
        f.sort_by_key(|f| f.id);
        fins.push(f);
    }
    publisher.join().unwrap();
    for f in &fins {
        for (g, r) in f.iter().zip(&refs) {
            assert_eq!(&g.tokens, r);
        }
    }
    let by_version = proposer.rounds_by_version();
    assert!(by_version.windows(2).all(|w| w[0].0 < w[1].0), "versions only move forward: {by_version:?}");
    assert_eq!(by_version.iter().map(|v| v.1).sum::<u64>(), rounds, "every round used exactly one version");
    assert!(by_version.len() > 3, "several versions were used: {by_version:?}");
}

/// `Engine::prepare_drafter` (the catch-up on positions committed in plain rounds, done outside a speculative
/// round's timing) changes nothing the drafter proposes: the same rounds with and without it draft and commit the
/// same tokens (a catch-up that fed a position twice, or skipped one, would change the drafter's cache and its trees).
#[test]
fn preparing_the_drafter_changes_no_draft() {
    let target = target("llama", 12);
    let prompts = tokens(3, 6, 7);
    let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
    let run = |prepare: bool| {
        let rt = DraftRuntime::eagle2(&eagle2(&target, 4), &F32).unwrap();
        let mut p = EagleProposer::fixed(rt);
        let params = SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(16) };
        let mut e = Engine::new(&target, params).unwrap();
        e.record_hidden(true);
        for q in &prompts {
            e.add_request(q).unwrap();
        }
        let mut drafted = Vec::new();
        for round in 0..6 {
            if round % 2 == 0 {
                e.round(Some(&mut p), None).unwrap(); // plain: the drafter falls behind
                continue;
            }
            if prepare {
                e.prepare_drafter(&mut p).unwrap();
            }
            let before = e.counters().drafted;
            e.round(Some(&mut p), Some(&plan)).unwrap();
            drafted.push(e.counters().drafted - before);
        }
        e.run_to_completion(None, &plan).unwrap();
        let mut f = e.take_finished();
        f.sort_by_key(|f| f.id);
        (drafted, f.into_iter().map(|f| f.tokens).collect::<Vec<_>>())
    };
    let (with, without) = (run(true), run(false));
    assert!(with.0.iter().all(|&d| d > 0), "every speculative round drafted: {:?}", with.0);
    assert_eq!(with, without);
}
