//! The drafter on a CUDA device against the host drafter. Without a CUDA driver every test prints SKIP and passes
//! (`cargo xtask test-cuda --gpu` sets `TLT_REQUIRE_GPU=1`, which turns a missing driver into a failure).
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::sync::Arc;

use common::*;
use tlt_drafter::cuda::{CudaDraftOptions, CudaDrafter};
use tlt_drafter::online::WeightsSlot;
use tlt_drafter::{
    Attend, DraftExecutor, DraftRuntime, DrafterConfig, Eagle2Drafter, Eagle3Drafter, EagleProposer, FrozenTarget,
    HostExecutor, Row, RuntimeOptions, VocabMap,
};
use tlt_kernels::cuda::gpu_or_skip;
use tlt_kernels::WeightDType;
use tlt_model::{Llama, Tap};
use tlt_spec_decode::{Engine, Plan, SpecParams, TappedLlama};

const F32: RuntimeOptions =
    RuntimeOptions { layer_dtype: WeightDType::F32, head_dtype: WeightDType::F32, hot_vocab: None };

fn runtimes(target: &Llama) -> Vec<(&'static str, DraftRuntime)> {
    let e2 =
        Eagle2Drafter::random(DrafterConfig::eagle2_from_target(target.config(), true), FrozenTarget::new(target), 9)
            .unwrap();
    let vocab = VocabMap::from_tokens(tokens(4, 20, 2).into_iter().flatten(), VOCAB, 16, &[2]).unwrap();
    let cfg3 = DrafterConfig::eagle3_from_target(target.config(), 16);
    let e3 = Eagle3Drafter::random(cfg3, vocab, FrozenTarget::new(target), 9).unwrap();
    vec![("eagle2", DraftRuntime::eagle2(&e2, &F32).unwrap()), ("eagle3", DraftRuntime::eagle3(&e3, &F32).unwrap())]
}

fn device() -> CudaDrafter {
    CudaDrafter::new(CudaDraftOptions { ordinal: 0, slots: 8, max_len: 256 }).unwrap()
}

/// The target's feature rows of every position of `tokens` for a drafter kind, flat.
fn features(target: &Llama, kind: &str, tokens: &[u32]) -> (Vec<f32>, usize) {
    let taps = if kind == "eagle2" { vec![Tap::FinalNorm] } else { Tap::eagle3(LAYERS)[..3].to_vec() };
    let mut cache = target.new_cache();
    let seq = cache.add_sequence();
    let input = tlt_model::SeqInput { seq, tokens, tree: None, logits: tlt_model::LogitsFor::None };
    let out = target.forward(&mut cache, &[input], &taps).unwrap();
    let cat = candle_core::Tensor::cat(&out.taps, 1).unwrap();
    (cat.flatten_all().unwrap().to_vec1::<f32>().unwrap(), cat.dim(1).unwrap())
}

/// One catch-up (causal) forward of two sequences, then one tree level under it, through `exec`: the outputs and
/// the top-3 candidates of every row.
fn two_levels<E: DraftExecutor>(
    exec: &mut E,
    rt: &DraftRuntime,
    target: &Llama,
    kind: &str,
) -> (Vec<f32>, Vec<Vec<(u32, f32)>>) {
    exec.load(rt, 0).unwrap();
    let seqs = tokens(2, 9, 4);
    let feats: Vec<(Vec<f32>, usize)> = seqs.iter().map(|s| features(target, kind, s)).collect();
    let mut rows = Vec::new();
    for (s, (f, w)) in seqs.iter().zip(&feats) {
        for t in 0..s.len() - 1 {
            rows.push(Row { token: s[t + 1], feature: &f[t * w..(t + 1) * w], pos: t });
        }
    }
    let (mut c0, mut c1) = (E::Cache::default(), E::Cache::default());
    let n = seqs[0].len() - 1;
    let mut groups = [(&mut c0, 0..n, Attend::Causal), (&mut c1, n..2 * n, Attend::Causal)];
    let a = exec.forward(rt, &rows, &mut groups, 3).unwrap();
    E::commit(&mut c0, n);
    E::commit(&mut c1, n);
    // A level of two children under each sequence's last position, fed its output (H wide).
    let h = rt.hidden_size();
    let last = |s: usize| &a.out[((s + 1) * n - 1) * h..(s + 1) * n * h];
    let level = [
        Row { token: 3, feature: last(0), pos: n },
        Row { token: 5, feature: last(0), pos: n },
        Row { token: 7, feature: last(1), pos: n },
        Row { token: 4, feature: last(1), pos: n },
    ];
    let parents = [None, None];
    let mut groups = [(&mut c0, 0..2, Attend::Tree(&parents)), (&mut c1, 2..4, Attend::Tree(&parents))];
    let b = exec.forward(rt, &level, &mut groups, 3).unwrap();
    let mut out = a.out;
    out.extend(b.out);
    let mut cands = a.candidates;
    cands.extend(b.candidates);
    (out, cands)
}

#[test]
fn device_forward_and_top_k_match_the_host_drafter() {
    if !gpu_or_skip("device_forward_and_top_k_match_the_host_drafter").unwrap() {
        return;
    }
    let target = target("llama", 8);
    for (kind, rt) in runtimes(&target) {
        let (host_out, host_c) = two_levels(&mut HostExecutor, &rt, &target, kind);
        let (dev_out, dev_c) = two_levels(&mut device(), &rt, &target, kind);
        assert_eq!(host_out.len(), dev_out.len(), "{kind}");
        let scale = host_out.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = host_out.iter().zip(&dev_out).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        // bf16 weights and activations against f32: ~3 significant digits per operand.
        assert!(diff <= 0.05 * scale.max(1.0), "{kind}: layer outputs differ by {diff} (scale {scale})");
        let agree = host_c.iter().zip(&dev_c).filter(|(a, b)| a[0].0 == b[0].0).count();
        assert!(agree * 10 >= host_c.len() * 9, "{kind}: top-1 agrees on {agree} of {} rows", host_c.len());
        for (a, b) in host_c.iter().zip(&dev_c) {
            assert_eq!(b.len(), 3);
            assert!(b.windows(2).all(|w| w[0].1 >= w[1].1), "{kind}: device candidates best first");
            if a[0].0 == b[0].0 {
                assert!((a[0].1 - b[0].1).abs() < 0.1, "{kind}: top-1 log-probs {} vs {}", a[0].1, b[0].1);
            }
        }
    }
}

#[test]
fn speculative_decoding_with_the_device_drafter_is_lossless() {
    if !gpu_or_skip("speculative_decoding_with_the_device_drafter_is_lossless").unwrap() {
        return;
    }
    let target = target("llama", 8);
    let prompts = tokens(3, 6, 5);
    let n = 20;
    let params = SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(n) };
    let plain = {
        let mut e = Engine::new(&target, params.clone()).unwrap();
        for p in &prompts {
            e.add_request(p).unwrap();
        }
        e.run_to_completion(None, &Plan::chain(1)).unwrap();
        let mut f = e.take_finished();
        f.sort_by_key(|f| f.id);
        f.into_iter().map(|f| f.tokens).collect::<Vec<_>>()
    };
    let taps = Tap::eagle3(LAYERS);
    let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
    for (kind, rt) in runtimes(&target) {
        let mut p = EagleProposer::with_executor(Arc::new(WeightsSlot::new(rt)), device());
        let mut e = if kind == "eagle2" {
            Engine::new(TappedLlama { model: &target, taps: &[Tap::FinalNorm] }, params.clone()).unwrap()
        } else {
            Engine::new(TappedLlama { model: &target, taps: &taps }, params.clone()).unwrap()
        };
        e.record_hidden(true);
        for q in &prompts {
            e.add_request(q).unwrap();
        }
        e.run_to_completion(Some(&mut p), &plan).unwrap();
        assert!(e.counters().drafted > 0, "{kind} drafted");
        let mut fin = e.take_finished();
        fin.sort_by_key(|f| f.id);
        for (f, r) in fin.iter().zip(&plain) {
            assert_eq!(&f.tokens, r, "{kind}: greedy SD with the device drafter differs from plain decoding");
        }
        // Every finished sequence's slot went back to the drafter.
        assert_eq!(p.executor().free_slots(), 8, "{kind}: device draft slots leaked");
    }
}
