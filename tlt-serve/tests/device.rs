//! The server on a device (`CudaTarget`): in CI on the simulated device (every CUDA kernel and the host's stream
//! protocol on the CPU), on a GPU machine on the CUDA device (the GPU plan runs this suite):
//! - `/generate` with log-probs, greedy and sampled, gives SD on exactly the tokens of SD off, on the device;
//! - a weight update written into the device buffers in place serves the new model's tokens (those of a server
//!   started on it), not the old ones;
//! - the KV pool (slots of the device cache) queues what it cannot hold at once and refuses only what it can never
//!   hold; without the pool's bound the device target runs out of slots (the negative control);
//! - the online EAGLE drafter learns from the device target's hidden states, and its accept length rises (in
//!   `drafter.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::net::SocketAddr;

use serde_json::{json, Value};
use tlt_model::Llama;
use tlt_serve::decode::DrafterChoice;
use tlt_serve::worker::DecodeConfig;

mod common;
use common::*;

/// Repetitive prompts (n-gram drafts get accepted).
fn prompts() -> Vec<Vec<u32>> {
    (0..4u32).map(|i| (0..10).map(|j| 2 + (i * 5 + j % 4) % 30).collect()).collect()
}

/// `/generate` of `prompts` in one request at `temperature` (seeded), `n` tokens each, with log-probs.
fn generate(addr: SocketAddr, prompts: &[Vec<u32>], temperature: f64, n: usize) -> Vec<Value> {
    let body = json!({"input_ids": prompts, "return_logprob": true,
        "sampling_params": {"temperature": temperature, "max_new_tokens": n, "ignore_eos": true, "sampling_seed": 7}});
    let (status, v) = post(addr, "/generate", &body);
    assert_eq!(status, 200, "{v}");
    v.as_array().unwrap().clone()
}

fn logprobs(v: &Value) -> Vec<f64> {
    v["meta_info"]["output_token_logprobs"].as_array().unwrap().iter().map(|e| e[0].as_f64().unwrap()).collect()
}

fn accepted(answers: &[Value]) -> u64 {
    answers.iter().map(|a| a["meta_info"]["spec_accept_token_num"].as_u64().unwrap()).sum()
}

#[test]
fn sd_on_the_device_serves_the_tokens_of_sd_off_greedy_and_sampled_with_log_probs() {
    let ngram = DecodeConfig { drafters: vec![DrafterChoice::Ngram], ..DecodeConfig::always_speculate() };
    let sd = serve_sim(tiny(), ngram, 4 * sim_slot());
    let off = serve_sim(tiny(), DecodeConfig { speculate: false, ..DecodeConfig::default() }, 4 * sim_slot());
    let info: Value = serde_json::from_str(&get_body(sd, "/get_server_info").1).unwrap();
    assert_eq!(info["device"], test_device().1, "{info}");
    assert_eq!(info["dtype"], "bfloat16");
    assert_eq!(info["kv_pool"]["sequences"], 4);
    for temperature in [0.0, 0.8] {
        let (a, b) = (generate(sd, &prompts(), temperature, 16), generate(off, &prompts(), temperature, 16));
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(ids(x), ids(y), "temperature {temperature}");
            assert_eq!(ids(x).len(), 16);
            let (lx, ly) = (logprobs(x), logprobs(y));
            assert_eq!(lx.len(), 16);
            // The verify pass and the decode pass run different shapes; their log-probs agree to bf16 rounding.
            let worst = lx.iter().zip(&ly).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
            assert!(worst < 2e-2, "temperature {temperature}: log-probs differ by {worst}");
            assert!(lx.iter().all(|&l| l <= 0.0 && l.is_finite()));
        }
        assert!(accepted(&a) > 0, "temperature {temperature}: no draft accepted: the test cannot tell SD from plain");
        assert_eq!(accepted(&b), 0);
    }
}

#[test]
fn a_weight_update_in_place_serves_the_new_models_tokens() {
    let old = tiny();
    let mut cfg = old.config().clone();
    cfg.eos_token_id = old.config().eos_token_id.clone();
    let new = Llama::random(cfg, 99).unwrap();
    let decode = DecodeConfig { drafters: vec![DrafterChoice::Ngram], ..DecodeConfig::always_speculate() };
    let addr = serve_sim(old, decode.clone(), 2 * sim_slot());
    let fresh = serve_sim(new.clone(), decode, 2 * sim_slot());
    let before: Vec<Vec<u32>> = generate(addr, &prompts()[..2], 0.0, 12).iter().map(ids).collect();
    let dir = std::env::temp_dir().join(format!("tlt-serve-device-update-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    tlt_model::save_hf_dir(&new, None, &dir, candle_core::DType::F32).unwrap();
    let (status, v) = post(addr, "/update_weights_from_disk", &json!({"model_path": dir, "weight_version": "v2"}));
    assert_eq!(status, 200, "{v}");
    let after = generate(addr, &prompts()[..2], 0.0, 12);
    let want: Vec<Vec<u32>> = generate(fresh, &prompts()[..2], 0.0, 12).iter().map(ids).collect();
    let got: Vec<Vec<u32>> = after.iter().map(ids).collect();
    assert_eq!(got, want, "the updated server serves other tokens than a server started on the new weights");
    assert_ne!(got, before, "the new weights serve the old tokens: the test cannot tell an update from none");
    assert!(after.iter().all(|a| a["meta_info"]["weight_version"] == "v2"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_pool_queues_what_it_cannot_hold_and_refuses_only_what_it_never_can() {
    // Two slots; eight requests at once: they all run, at most two at a time, with the tokens they decode alone.
    let decode = DecodeConfig { drafters: vec![DrafterChoice::Ngram], ..DecodeConfig::always_speculate() };
    let addr = serve_sim(tiny(), decode, 2 * sim_slot() + sim_slot() / 2);
    let info: Value = serde_json::from_str(&get_body(addr, "/get_server_info").1).unwrap();
    assert_eq!(info["kv_pool"]["sequences"], 2, "{info}");
    assert_eq!(info["max_running_requests"], 2);
    let many: Vec<Vec<u32>> = (0..8u32).map(|i| vec![2 + i, 3 + i, 4, 5, 2 + i]).collect();
    let threads: Vec<_> = many
        .iter()
        .map(|p| {
            let body = json!({"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 10,
                "ignore_eos": true}});
            std::thread::spawn(move || post(addr, "/generate", &body))
        })
        .collect();
    let together: Vec<Vec<u32>> = threads
        .into_iter()
        .map(|t| {
            let (status, v) = t.join().unwrap();
            assert_eq!(status, 200, "{v}");
            ids(&v)
        })
        .collect();
    for (p, got) in many.iter().zip(&together) {
        let alone = generate(addr, std::slice::from_ref(p), 0.0, 10);
        assert_eq!(&ids(&alone[0]), got);
    }
    // A request the pool can never hold is a 400 that says why; one that fills its slot exactly runs.
    let context = tiny().config().max_position_embeddings;
    let (status, v) = post(
        addr,
        "/generate",
        &json!({"input_ids": [2, 3],
        "sampling_params": {"max_new_tokens": context - 2, "ignore_eos": true, "temperature": 0}}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(&v).len(), context - 2);
    let (status, v) = post(
        addr,
        "/generate",
        &json!({"input_ids": [2, 3],
        "sampling_params": {"max_new_tokens": context - 1}}),
    );
    assert_eq!(status, 400, "{v}");
}

#[test]
fn without_the_pool_the_device_target_runs_out_of_slots() {
    // The negative control of the test above: the device cache's slots are a hard bound, and an engine admitting
    // by requests alone fails the third request of a two-slot cache.
    let (gpu, _) = test_device();
    let target = tlt_spec_decode::cuda::CudaTarget::new(&tiny(), gpu, 2, sim_slot(), 0).unwrap();
    let mut engine = tlt_spec_decode::Engine::new(&target, tlt_spec_decode::SpecParams::greedy(4)).unwrap();
    engine.add_request(&[2, 3, 4]).unwrap();
    engine.add_request(&[3, 4, 5]).unwrap();
    let e = engine.add_request(&[4, 5, 6]).unwrap_err().to_string();
    assert!(e.contains("slots"), "{e}");
}
