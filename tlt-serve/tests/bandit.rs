//! The bandit inside the server settles on different arms at different batch sizes. The target is the tiny model
//! behind a roofline clock: a forward takes `max(OVERHEAD, tokens x PER_TOKEN)` (a memory-bound step at small
//! batches, a compute-bound one at large), slept for real, so the rewards the bandit measures are those of a device
//! whose small batches pay a fixed cost per step and whose large ones pay per token. At batch 1 a five-node tree
//! costs what one token does, so drafting wins whenever a draft is ever accepted; at batch 16 a three-node tree costs
//! three times a plain round and commits at most three tokens, so the plain arm wins. `/get_server_info` reports
//! each bucket's arms and what the bandit learned.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tlt_model::Llama;
use tlt_serve::backend::Backend;
use tlt_serve::decode::DrafterChoice;
use tlt_serve::pool::Pool;
use tlt_serve::worker::DecodeConfig;
use tlt_serve::{ServeConfig, Server};
use tlt_spec_decode::{Plan, Result, SeqHandle, Target, TargetInput, TargetOutput};

mod common;
use common::*;

const OVERHEAD: Duration = Duration::from_millis(20);
const PER_TOKEN: Duration = Duration::from_millis(2);

/// The tiny model on the roofline clock, at this cost per token.
#[derive(Debug, Clone)]
struct Timed(Arc<Llama>, Duration);

impl Target for Timed {
    type State = <Llama as Target>::State;
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn eos_ids(&self) -> Vec<u32> {
        Target::eos_ids(&*self.0)
    }
    fn max_context(&self) -> Option<usize> {
        self.0.max_context()
    }
    fn new_state(&self) -> Self::State {
        self.0.new_state()
    }
    fn new_sequence(&self, state: &mut Self::State) -> SeqHandle {
        self.0.new_sequence(state)
    }
    fn remove(&self, state: &mut Self::State, seq: SeqHandle) -> Result<()> {
        self.0.remove(state, seq)
    }
    fn truncate(&self, state: &mut Self::State, seq: SeqHandle, len: usize) -> Result<()> {
        self.0.truncate(state, seq, len)
    }
    fn forward(&self, state: &mut Self::State, inputs: &[TargetInput<'_>], hidden: bool) -> Result<TargetOutput> {
        let t0 = std::time::Instant::now();
        let tokens: u32 = inputs.iter().map(|i| i.tokens.len() as u32).sum();
        let out = self.0.forward(state, inputs, hidden);
        std::thread::sleep(OVERHEAD.max(self.1 * tokens).saturating_sub(t0.elapsed()));
        out
    }
    fn fork(&self, state: &mut Self::State, seq: SeqHandle) -> Result<Option<SeqHandle>> {
        self.0.fork(state, seq)
    }
    fn commit(&self, state: &mut Self::State, seq: SeqHandle, path: &[usize]) -> Result<()> {
        self.0.commit(state, seq, path)
    }
}

/// A backend serving [`Timed`].
struct TimedBackend(Arc<Llama>, Duration);

impl Backend for TimedBackend {
    type Target = Timed;
    fn target(&self) -> Timed {
        Timed(self.0.clone(), self.1)
    }
    fn model(&self) -> &Llama {
        &self.0
    }
    fn update(&mut self, model: Llama) -> tlt_serve::Result<()> {
        self.0 = Arc::new(model);
        Ok(())
    }
    fn pool(&self) -> Pool {
        Pool { tokens: 1 << 16, sequences: 64, token_bytes: 4 }
    }
    fn device(&self) -> String {
        "roofline".into()
    }
    fn dtype(&self) -> &'static str {
        "float32"
    }
    fn weight_dtype(&self) -> tlt_kernels::WeightDType {
        tlt_kernels::WeightDType::F32
    }
}

fn leaders(addr: std::net::SocketAddr) -> Vec<Value> {
    let info: Value = serde_json::from_str(&get_body(addr, "/get_server_info").1).unwrap();
    let state = info["speculative_bandit_state"].as_object().unwrap();
    assert_eq!(state.len(), 1, "one sampling, one bandit: {info}");
    state.values().next().unwrap().as_array().unwrap().clone()
}

/// Runs the batch-1 then batch-16 load on a server whose forward costs `per_token` per token past the overhead;
/// the bandit's leaders per bucket.
fn learn(per_token: Duration) -> Vec<Value> {
    let mab = tlt_scheduler::MabConfig {
        arms: vec![Plan { steps: 4, top_k: 1, verify_tokens: 5 }, Plan { steps: 2, top_k: 1, verify_tokens: 3 }],
        thresholds: vec![1, 3],
        plain_arm: true,
        // Exploration, so that an unlucky first sample (a round before any draft matched) does not lock an arm out.
        epsilon: 0.3,
        ..tlt_scheduler::MabConfig::default()
    };
    let decode = DecodeConfig { mab, drafters: vec![DrafterChoice::Ngram], ..DecodeConfig::always_speculate() };
    let cfg = ServeConfig { decode, model_name: "tiny".into(), ..ServeConfig::default() };
    let addr = serve_server(Server::start_on(TimedBackend(Arc::new(tiny()), per_token), None, cfg).unwrap());
    let info: Value = serde_json::from_str(&get_body(addr, "/get_server_info").1).unwrap();
    assert_eq!(
        info["speculative_bandit"]["buckets"],
        json!([{"min_batch": 1, "tree_size": 5, "arms": ["4:1:5", "plain"]},
               {"min_batch": 3, "tree_size": 3, "arms": ["2:1:3", "plain"]}])
    );
    // Batch 1: one request at a time, repetitive prompts (n-gram drafts get accepted).
    for i in 0..3u32 {
        let prompt: Vec<u32> = (0..12).map(|j| 2 + (i + j % 3) % 20).collect();
        let body = json!({"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 40,
            "ignore_eos": true}});
        assert_eq!(post(addr, "/generate", &body).0, 200);
    }
    let after_one = leaders(addr);
    assert!(after_one[1]["leader"].is_null(), "{after_one:?}");
    // Batch 16: one request of 16 prompts, decoding together.
    let prompts: Vec<Vec<u32>> = (0..16u32).map(|i| (0..8).map(|j| 2 + (i * 3 + j % 4) % 40).collect()).collect();
    let body = json!({"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 24,
        "ignore_eos": true}});
    assert_eq!(post(addr, "/generate", &body).0, 200);
    let l = leaders(addr);
    println!("per token {per_token:?}: after batch 1 {after_one:?}; after batch 16 {l:?}");
    // What batch 1 learned is kept.
    assert_eq!(l[0]["leader"], after_one[0]["leader"], "{l:?}");
    l
}

#[test]
fn the_bandit_drafts_at_batch_one_and_decodes_plainly_at_batch_sixteen() {
    let l = learn(PER_TOKEN);
    assert_eq!(l[0]["leader"], "4:1:5", "{l:?}");
    assert_eq!(l[1]["leader"], "plain", "{l:?}");
}

#[test]
fn without_a_per_token_cost_the_bandit_drafts_at_batch_sixteen_too() {
    // The control: the same load on a device that never turns compute-bound; the choice follows the measured cost.
    let l = learn(Duration::ZERO);
    assert_eq!(l[0]["leader"], "4:1:5", "{l:?}");
    assert_eq!(l[1]["leader"], "2:1:3", "{l:?}");
}

/// Engine rounds so far that the SD gate ran plain.
fn plain_rounds(addr: std::net::SocketAddr) -> f64 {
    metric(addr, "engine_rounds_total") - metric(addr, "engine_sd_rounds_total")
}

#[test]
fn the_gate_keeps_its_state_across_an_idle_spell_and_a_weight_update() {
    // TLT's gate (on after 10 rounds at a batch of at most 32), one chain arm and no plain arm: a fresh gate runs
    // its first 9 rounds plain (the control), a kept one speculates from the first round.
    let mab = tlt_scheduler::MabConfig {
        arms: vec![Plan { steps: 4, top_k: 1, verify_tokens: 5 }],
        thresholds: vec![1],
        ..tlt_scheduler::MabConfig::default()
    };
    let decode = DecodeConfig { mab, drafters: vec![DrafterChoice::Ngram], ..DecodeConfig::default() };
    let model = tiny();
    let addr = serve_with(model.clone(), decode);
    let body = json!({"input_ids": [2, 3, 4, 2, 3, 4, 2, 3], "sampling_params": {"temperature": 0,
        "max_new_tokens": 40, "ignore_eos": true}});
    let (status, first) = post(addr, "/generate", &body);
    assert_eq!(status, 200, "{first}");
    let plain = plain_rounds(addr);
    // The tenth qualifying round is the first speculative one.
    assert!(plain >= 9.0, "a fresh gate speculated after {plain} plain rounds");
    // Idle, then a weight update (the same weights, a new version): the engine is rebuilt, its gate kept.
    let dir = std::env::temp_dir().join(format!("tlt-serve-gate-kept-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    tlt_model::save_hf_dir(&model, None, &dir, candle_core::DType::F32).unwrap();
    let (status, v) = post(addr, "/update_weights_from_disk", &json!({"model_path": dir, "weight_version": "v2"}));
    assert_eq!(status, 200, "{v}");
    let (status, after) = post(addr, "/generate", &body);
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["meta_info"]["weight_version"], "v2");
    assert_eq!(plain_rounds(addr), plain, "the gate was reset by the update: it ran plain rounds again");
    assert_eq!(ids(&after), ids(&first), "the same weights decode the same tokens");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_drafter_kinds_are_arms_of_the_bandit_and_stay_lossless() {
    // `--drafters suffix,ngram`: every plan is an arm once per kind; the kinds draft in turn as the bandit picks,
    // and the tokens are plain decoding's.
    let mab = tlt_scheduler::MabConfig {
        arms: vec![Plan { steps: 4, top_k: 1, verify_tokens: 5 }],
        thresholds: vec![1],
        plain_arm: true,
        epsilon: 0.5,
        ..tlt_scheduler::MabConfig::default()
    };
    let kinds = vec![DrafterChoice::Suffix, DrafterChoice::Ngram];
    let decode = DecodeConfig { mab, drafters: kinds, ..DecodeConfig::always_speculate() };
    let sd = serve_with(tiny(), decode);
    let off = serve_with(tiny(), DecodeConfig { speculate: false, ..DecodeConfig::default() });
    let info: Value = serde_json::from_str(&get_body(sd, "/get_server_info").1).unwrap();
    assert_eq!(info["speculative_bandit"]["buckets"][0]["arms"], json!(["suffix/4:1:5", "ngram/4:1:5", "plain"]));
    let prompts: Vec<Vec<u32>> = (0..4u32).map(|i| (0..10).map(|j| 2 + (i + j % 3) % 20).collect()).collect();
    let body = json!({"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 32,
        "ignore_eos": true}});
    let (a, b) = (post(sd, "/generate", &body), post(off, "/generate", &body));
    assert_eq!((a.0, b.0), (200, 200));
    let (a, b) = (a.1.as_array().unwrap().clone(), b.1.as_array().unwrap().clone());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(ids(x), ids(y));
    }
    let accepted: u64 = a.iter().map(|v| v["meta_info"]["spec_accept_token_num"].as_u64().unwrap()).sum();
    assert!(accepted > 0, "no draft accepted: the test cannot tell SD from plain");
}
