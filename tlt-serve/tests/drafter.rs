//! TLT's online EAGLE drafter inside the server: it learns from the requests served, keeps its acceptance across a
//! weight update (re-pointed at the new embedding and LM head), is checkpointed and resumes exactly, and stays
//! lossless.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tlt_drafter::TrainConfig;
use tlt_model::Llama;
use tlt_serve::decode::DrafterChoice;
use tlt_serve::drafter::EagleConfig;
use tlt_serve::worker::DecodeConfig;

mod common;
use common::*;

/// Optimizer steps the drafter takes on the first weight version.
const STEPS: u64 = 150;
/// Optimizer steps of the drafter trained on the simulated device (about 2 s each there: every kernel's threads are
/// fibers on the CPU).
const DEVICE_STEPS: u64 = 40;

/// The online drafter's settings for these tests: the drafter-training tests' small-model config, training only
/// while nothing runs (so a measurement's batch decodes with one drafter version), checkpointed to `checkpoint`.
fn eagle(init: Option<&Path>, checkpoint: Option<&Path>, steps_per_version: u64) -> DecodeConfig {
    let train = TrainConfig {
        schedule: tlt_model::optim::LrSchedule::constant(1e-2),
        window: 32,
        row_len: 64,
        tokens_per_step: 128,
        samples_per_step: 4,
        grad_clip: Some(1.0),
        seed: 3,
        ..TrainConfig::default()
    };
    let cfg = EagleConfig {
        init: init.map(Path::to_path_buf),
        seed: 1,
        checkpoint: checkpoint.map(Path::to_path_buf),
        tail_batch: 0,
        steps_per_version: Some(steps_per_version),
        train,
        publish_every: 5,
        ..EagleConfig::default()
    };
    // EAGLE alone (the default with it is the hybrid with group drafting), so that its acceptance is its own.
    DecodeConfig { eagle: Some(cfg), drafters: vec![DrafterChoice::Eagle2], ..DecodeConfig::always_speculate() }
}

/// `k` prompts of 6 tokens from `seed`.
fn prompts(k: u32, seed: u32) -> Vec<Vec<u32>> {
    (0..k).map(|i| (0..6).map(|j| 2 + (seed * 31 + i * 7 + j * 13) % (VOCAB as u32 - 2)).collect()).collect()
}

/// Greedy answers to `prompts`, sent as one batched `/generate` (so they decode together), 32 tokens each.
fn batch(addr: SocketAddr, prompts: &[Vec<u32>]) -> Vec<Value> {
    let body = json!({"input_ids": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": true}});
    let (status, v) = post(addr, "/generate", &body);
    assert_eq!(status, 200, "{v}");
    v.as_array().unwrap().clone()
}

/// Accept length (tokens committed per speculative round, SGLang's) of greedy decoding of `prompts`, and the ids.
fn accept_length(addr: SocketAddr, prompts: &[Vec<u32>]) -> (f64, Vec<Vec<u32>>) {
    let answers = batch(addr, prompts);
    let (mut accepted, mut rounds) = (0u64, 0u64);
    for a in &answers {
        let meta = &a["meta_info"];
        let n = meta["spec_accept_token_num"].as_u64().unwrap();
        let v = meta["spec_verify_ct"].as_u64().unwrap();
        // Chains of 4 drafts: 4 drafted tokens per speculative round, at most all accepted.
        assert_eq!(meta["spec_draft_token_num"].as_u64().unwrap(), 4 * v, "{meta}");
        assert!(n <= 4 * v);
        accepted += n;
        rounds += v;
    }
    assert!(rounds > 0, "no speculative rounds");
    ((accepted + rounds) as f64 / rounds as f64, answers.iter().map(ids).collect())
}

/// `model`'s plain greedy decoding of `prompts` (32 tokens each), in process.
fn plain(model: &Llama, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let params =
        tlt_spec_decode::SpecParams { stop_token_ids: Some(vec![]), ..tlt_spec_decode::SpecParams::greedy(32) };
    let mut e = tlt_spec_decode::Engine::new(model, params).unwrap();
    for p in prompts {
        e.add_request(p).unwrap();
    }
    e.run_to_completion(None, &tlt_spec_decode::Plan::chain(1)).unwrap();
    let mut done = e.take_finished();
    done.sort_by_key(|f| f.id);
    done.into_iter().map(|f| f.tokens).collect()
}

/// `(1 - t) * a + t * b`, weight by weight: a policy moved a fraction `t` of the way to `b`.
fn blend(a: &Llama, b: &Llama, t: f64) -> Llama {
    let other = b.weights().named_tensors();
    let mut w = a.weights().clone();
    for ((name, x), (name_b, y)) in w.entries_mut().into_iter().zip(&other) {
        assert_eq!(&name, name_b);
        *x = ((&*x * (1.0 - t)).unwrap() + (y * t).unwrap()).unwrap();
    }
    Llama::new(a.config().clone(), w).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tlt-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Waits (at most 240 s) until the live drafter has taken `steps` optimizer steps.
fn wait_for_steps(addr: SocketAddr, steps: u64) {
    let t0 = Instant::now();
    while metric(addr, "drafter_steps_total") < steps as f64 {
        let done = metric(addr, "drafter_steps_total");
        assert!(t0.elapsed() < Duration::from_secs(240), "the drafter did not train: {done} of {steps} steps");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The gauge `name` once the engine thread has set it (it builds the device drafter after the routes are up), or
/// what it reads after 60 s.
fn settled_gauge(addr: SocketAddr, name: &str, want: f64) -> f64 {
    let t0 = Instant::now();
    while metric(addr, name) != want && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    metric(addr, name)
}

fn update(addr: SocketAddr, model: &Llama, dir: &Path, version: &str) {
    tlt_model::save_hf_dir(model, None, dir, candle_core::DType::F32).unwrap();
    let body = json!({"model_path": dir, "weight_version": version});
    let (status, v) = post(addr, "/update_weights_from_disk", &body);
    assert_eq!(status, 200, "{v}");
}

#[test]
fn the_online_drafter_learns_keeps_acceptance_across_a_weight_update_and_resumes_exactly() {
    let dir = scratch("drafter");
    let ckpt = dir.join("drafter");
    let v1 = tiny();
    // The update: every weight 0.5% of the way to another random model's (about 0.7% relative change; an RL step at
    // learning rate 1e-6 moves a weight of ~0.02 by ~1e-6, so this is some hundred steps' drift). Measured with
    // this test's drafter: 1.02 of before at 0.1%, 0.98 at 0.2%, 0.93 at 0.5% and 1%, 0.89 at 2%, 0.67 at 5%.
    let v2 = blend(&v1, &Llama::random(v1.config().clone(), 77).unwrap(), 0.005);
    let measure = prompts(8, 1);

    // A fresh drafter (measured on a frozen twin) learns from what the server decodes, in its idle time. The
    // training requests go as one batch: training starts once it is done (at most 0 running), so every step sees
    // the same samples and the run is deterministic.
    let (a0, out) = accept_length(serve_with(tiny(), eagle(None, None, 0)), &measure);
    assert_eq!(out, plain(&v1, &measure), "SD with the online drafter is not lossless");
    let live = serve_with(tiny(), eagle(None, Some(&ckpt), STEPS));
    let training: Vec<Vec<u32>> = measure.iter().cloned().chain((2..5).flat_map(|seed| prompts(8, seed))).collect();
    batch(live, &training);
    wait_for_steps(live, STEPS);
    let (a1, out) = accept_length(live, &measure);
    assert_eq!(out, plain(&v1, &measure));
    assert_eq!(metric(live, "drafter_steps_total"), STEPS as f64, "the step budget per version was exceeded");
    assert_eq!(metric(live, "drafter_on_device"), 0.0, "a CPU server's drafter claims a device");
    assert_eq!(metric(live, "drafter_trains_on_device"), 0.0, "a CPU server's drafter claims to train on a device");
    let bytes = metric(live, "drafter_buffer_bytes");
    assert!(bytes > 0.0 && bytes <= tlt_serve::drafter::DEFAULT_BUFFER_BYTES as f64, "{bytes}");
    assert!(a1 > a0 + 0.3, "online training did not raise the accept length: {a0:.3} -> {a1:.3}");

    // A weight update: the drafter takes the new embedding and LM head and is checkpointed.
    let version = metric(live, "drafter_version");
    update(live, &v2, &dir.join("v2"), "v2");
    assert_eq!(metric(live, "drafter_version"), version + 1.0, "the re-pointed drafter was not published");
    assert_eq!(metric(live, "drafter_checkpoints_total"), 1.0);
    let state = tlt_drafter::DrafterTrainer::read_state(&ckpt).unwrap();
    assert_eq!(state.step, STEPS);
    let (a2_live, out) = accept_length(live, &measure);
    assert_eq!(out, plain(&v2, &measure), "SD after the update is not v2's plain decoding");
    // /metrics splits the accept length by weight and drafter version: both weight versions are there.
    let text = get_body(live, "/metrics").1;
    let by_version: Vec<(&str, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("tlt_serve_spec_accept_length_by_version{"))
        .filter_map(|l| l.split_once("} ").map(|(labels, v)| (labels, v.parse::<f64>().unwrap())))
        .collect();
    for version in ["v1", "v2"] {
        let want = format!("weight_version=\"{version}\"");
        assert!(by_version.iter().any(|(l, a)| l.contains(&want) && (1.0..=5.0).contains(a)), "{text}");
    }
    // Online training goes on with v2's requests (a new step budget for the new version).
    batch(live, &training);
    wait_for_steps(live, 2 * STEPS);
    let (a3_live, _) = accept_length(live, &measure);

    // The checkpoint resumes exactly (frozen: no more steps): on v1 it drafts as the live drafter did before the
    // update, token for token the same acceptance; on v2 it is the drafter right after the update.
    let (r1, _) = accept_length(serve_with(v1.clone(), eagle(Some(&ckpt), None, 0)), &measure);
    assert_eq!(r1, a1, "the resumed drafter does not draft as the live one did");
    let frozen_v2 = serve_with(v2.clone(), eagle(Some(&ckpt), None, 0));
    let (a2, out) = accept_length(frozen_v2, &measure);
    assert_eq!(out, plain(&v2, &measure));
    assert_eq!(metric(frozen_v2, "drafter_steps_total"), STEPS as f64);
    // Negative control: the same drafter on an unrelated target loses its acceptance, so the check below can fail.
    let other = Llama::random(v1.config().clone(), 78).unwrap();
    let (a_other, _) = accept_length(serve_with(other, eagle(Some(&ckpt), None, 0)), &measure);
    println!(
        "accept length: untrained {a0:.3}, after {STEPS} online steps {a1:.3} (resumed {r1:.3}); after the update to \
         v2 (0.5% of the way to other weights) {a2:.3} (live server {a2_live:.3}), {a3_live:.3} after {STEPS} more steps on v2's requests; on an unrelated target \
         {a_other:.3}"
    );
    assert!(a2 >= 0.9 * a1, "accept length after the update {a2:.3} is not within 10% of before ({a1:.3})");
    assert!(a_other < 0.9 * a1, "negative control: the drafter kept {a_other:.3} of {a1:.3} on an unrelated target");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_drafter_is_checkpointed_when_the_server_stops_and_starts_from_either_format() {
    let dir = scratch("drafter-shutdown");
    let ckpt = dir.join("drafter");
    let decode = eagle(None, Some(&ckpt), STEPS);
    let server = tlt_serve::Server::start(
        tiny(),
        None,
        tlt_serve::ServeConfig { decode, model_name: "tiny".into(), ..Default::default() },
    )
    .unwrap();
    assert!(!ckpt.exists());
    // The routes go (as when axum's graceful shutdown ends): the engine thread ends and saves the drafter.
    drop(server.router);
    server.engine.join().unwrap();
    assert_eq!(tlt_drafter::DrafterTrainer::read_state(&ckpt).unwrap().step, 0);
    // An EAGLE-2 drafter in the fastrl/EAGLE layout (weights only) starts the server too, drafting with exactly its
    // weights: the same accept length as a server resumed from the trainer checkpoint it was exported from.
    let trainer = tlt_drafter::DrafterTrainer::resume(&ckpt, &tiny()).unwrap();
    let tlt_drafter::TrainableDrafter::Eagle2(d) = trainer.drafter() else { panic!("an EAGLE-2 drafter") };
    let exported = dir.join("eagle2");
    tlt_drafter::checkpoint::save_eagle2(d, &exported, tlt_drafter::SaveDType::F32).unwrap();
    let measure = prompts(4, 9);
    let (from_export, _) = accept_length(serve_with(tiny(), eagle(Some(&exported), None, 0)), &measure);
    let (from_trainer, _) = accept_length(serve_with(tiny(), eagle(Some(&ckpt), None, 0)), &measure);
    assert_eq!(from_export, from_trainer);
    // A drafter checkpoint that does not fit the model is refused by name.
    let other = Llama::random(tlt_model::LlamaConfig::tiny(VOCAB, 32, 1), 3).unwrap();
    let decode = eagle(Some(&ckpt), None, 0);
    let err = tlt_serve::Server::start(other, None, tlt_serve::ServeConfig { decode, ..Default::default() });
    assert!(matches!(&err, Err(tlt_serve::Error::Invalid { field, .. }) if field == "drafter"), "{:?}", err.err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_online_drafter_learns_from_the_device_targets_hidden_states() {
    // The same drafter and requests as above, the target on the simulated device: its hidden rows come back from the
    // device's verification (packed for the accepted nodes), the drafter trains on them on the device (the engine
    // thread steps it while nothing runs) and drafts better, its forward on the device beside the target's.
    let v1 = tiny();
    let measure = prompts(8, 1);
    let want = plain(&v1, &measure);
    let slots = 40 * sim_slot();
    let (a0, _) = accept_length(serve_sim(tiny(), eagle(None, None, 0), slots), &measure);
    let live = serve_sim(tiny(), eagle(None, None, DEVICE_STEPS), slots);
    assert_eq!(settled_gauge(live, "drafter_on_device", 1.0), 1.0, "the drafter drafts on the host");
    assert_eq!(settled_gauge(live, "drafter_trains_on_device", 1.0), 1.0, "the drafter trains on the host");
    let training: Vec<Vec<u32>> = measure.iter().cloned().chain((2..5).flat_map(|seed| prompts(8, seed))).collect();
    batch(live, &training);
    wait_for_steps(live, DEVICE_STEPS);
    let (a1, out) = accept_length(live, &measure);
    println!("accept length on the simulated device: untrained {a0:.3}, after {DEVICE_STEPS} online steps {a1:.3}");
    assert!(
        a1 > a0 + 0.3,
        "online training on the device's hidden states did not raise the accept length: {a0:.3} -> {a1:.3}"
    );
    // The device computes in bf16: its greedy tokens may differ from the f32 host model's in a near-tie, but not
    // mostly.
    let same = out.iter().zip(&want).filter(|(a, b)| a == b).count();
    assert!(same * 2 >= want.len(), "{same} of {} answers equal the host's plain decoding", want.len());
}

#[test]
fn the_device_trainer_steps_once_per_round_in_the_tail_and_never_above_it() {
    // The online drafter on a device backend's GPU, driven as the engine thread drives it: a round with more
    // requests running than the tail threshold takes no step, a round in the tail (or idle) takes exactly one.
    let model = tiny();
    let (gpu, _) = test_device();
    let stats = std::sync::Arc::new(tlt_serve::drafter::DrafterStats::default());
    let DecodeConfig { eagle: Some(mut cfg), .. } = eagle(None, None, 100) else { unreachable!() };
    cfg.tail_batch = 2;
    let mut d = tlt_serve::drafter::OnlineDrafter::new(&model, &cfg, stats.clone(), Some(gpu)).unwrap();
    let steps = || stats.steps.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(stats.trains_on_device.load(std::sync::atomic::Ordering::Relaxed), 1, "the drafter trains on the host");
    assert!(!d.trains_when_idle(), "an empty buffer gives the idle engine nothing to train");
    d.on_round(0);
    assert_eq!(steps(), 0, "a step without samples");
    let params =
        tlt_spec_decode::SpecParams { stop_token_ids: Some(vec![]), ..tlt_spec_decode::SpecParams::greedy(24) };
    let mut e = tlt_spec_decode::Engine::new(&model, params).unwrap();
    e.record_hidden(true);
    for p in prompts(4, 9) {
        e.add_request(&p).unwrap();
    }
    e.run_to_completion(None, &tlt_spec_decode::Plan::chain(1)).unwrap();
    for f in e.take_finished() {
        d.observe(&f).unwrap();
    }
    assert!(d.trains_when_idle(), "new samples give the idle engine something to train");
    for (running, want) in [(3, 0), (8, 0), (2, 1), (3, 1), (0, 2), (1, 3), (5, 3)] {
        d.on_round(running);
        assert_eq!(steps(), want, "after a round with {running} running");
    }
}
