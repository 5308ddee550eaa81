//! SGLang's control surface over real HTTP: aborts (by `rid`, by a client that goes away, by a pause), and weight
//! updates under load: no request lost, every response decoded by one weight version (its tokens are exactly the
//! in-process greedy decoding of the version it reports), bad updates refused by field.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tlt_model::{Llama, LlamaConfig};
use tlt_spec_decode::{Engine, Plan, SpecParams};

mod common;
use common::*;

/// A fresh directory for this test (removed first if a run before left it).
fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tlt-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Waits until `cond` holds (polling), at most 30 s.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A greedy request that runs `n` tokens without stopping early, tagged `rid`.
fn long_request(rid: &str, n: u64) -> Value {
    json!({"rid": rid, "input_ids": [5, 9, 11], "return_logprob": true,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": true}})
}

/// `model`'s plain greedy decoding of each `(prompt, limit)`, in process.
fn greedy(model: &Llama, reqs: &[(Vec<u32>, usize)]) -> Vec<Vec<u32>> {
    let mut e = Engine::new(model, SpecParams::greedy(512)).unwrap();
    for (p, n) in reqs {
        e.add_request_with_limit(p, *n).unwrap();
    }
    e.run_to_completion(None, &Plan::chain(1)).unwrap();
    let mut done = e.take_finished();
    done.sort_by_key(|f| f.id);
    done.into_iter().map(|f| f.tokens).collect()
}

#[test]
fn abort_request_by_rid_returns_what_was_generated() {
    let addr = serve_model(slow(3), true);
    let req = long_request("long-1", 3000);
    let client = std::thread::spawn(move || post(addr, "/generate", &req));
    wait_for("rounds of the long request", || metric(addr, "request_rounds_total") >= 20.0);
    let (status, v) = post(addr, "/abort_request", &json!({"rid": "long-1"}));
    assert_eq!((status, &v["num_aborted_requests"]), (200, &json!(1)), "{v}");
    let (status, out) = client.join().unwrap();
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort", "{out}");
    let got = ids(&out);
    assert!(got.len() >= 20 && got.len() < 3000, "{} tokens", got.len());
    assert_eq!(out["meta_info"]["output_token_logprobs"].as_array().unwrap().len(), got.len());
    // What it generated is the start of its uninterrupted decoding.
    let full = greedy(&slow(3), &[(vec![5, 9, 11], 3000)]);
    assert_eq!(got[..], full[0][..got.len()]);
    // Nothing else runs; an unknown rid aborts nothing; a body naming nothing is a 400.
    assert_eq!(metric(addr, "running_requests"), 0.0);
    assert_eq!(post(addr, "/abort_request", &json!({"rid": "nobody"})).1["num_aborted_requests"], 0);
    let (status, v) = post(addr, "/abort_request", &json!({}));
    assert_eq!((status, &v["error"]["param"]), (400, &json!("rid")), "{v}");
}

#[test]
fn a_client_that_goes_away_aborts_its_request() {
    let addr = serve_model(slow(4), true);
    let s = send_post(addr, "/generate", long_request("gone", 3000).to_string().as_bytes());
    wait_for("the request to run", || metric(addr, "request_rounds_total") >= 10.0);
    drop(s);
    wait_for("the abort", || metric(addr, "aborted_requests_total") == 1.0);
    assert_eq!(metric(addr, "running_requests"), 0.0);
    assert_eq!(metric(addr, "requests_total"), 0.0, "it did not run to its end");
    // The engine serves the next client.
    let (status, v) = post(addr, "/generate", &long_request("next", 8));
    assert_eq!((status, ids(&v).len()), (200, 8), "{v}");
}

#[test]
fn pause_aborts_running_requests_by_default_and_holds_new_ones() {
    let addr = serve_model(slow(5), true);
    let client = std::thread::spawn(move || post(addr, "/generate", &long_request("a", 3000)));
    wait_for("the request to run", || metric(addr, "request_rounds_total") >= 10.0);
    let (status, v) = post_raw(addr, "/pause_generation", b"");
    assert_eq!((status, &v["num_aborted_requests"]), (200, &json!(1)), "{v}");
    assert_eq!(client.join().unwrap().1["meta_info"]["finish_reason"]["type"], "abort");
    // Paused: a new request waits for the continue, not admitted (as SGLang holds it); `retract` is refused by name.
    let held = std::thread::spawn(move || post(addr, "/generate", &long_request("b", 16)));
    wait_for("the held request to wait", || metric(addr, "waiting_requests") == 1.0);
    assert_eq!(metric(addr, "running_requests"), 0.0, "a request that arrived while paused was admitted");
    let rounds = metric(addr, "engine_rounds_total");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(metric(addr, "engine_rounds_total"), rounds, "a paused server ran a round");
    let (status, v) = post(addr, "/pause_generation", &json!({"mode": "retract"}));
    assert_eq!((status, &v["error"]["param"]), (400, &json!("mode")), "{v}");
    // In-place pause keeps it; continue finishes it.
    let (status, v) = post(addr, "/pause_generation", &json!({"mode": "in_place"}));
    assert_eq!((status, &v["num_aborted_requests"]), (200, &json!(0)), "{v}");
    assert_eq!(post(addr, "/continue_generation", &json!({})).0, 200);
    let (status, v) = held.join().unwrap();
    assert_eq!((status, ids(&v).len(), &v["meta_info"]["finish_reason"]["type"]), (200, 16, &json!("length")));
}

/// Requests of several lengths, the `i`th on prompt `[2 + i % 7, 3, 4 + i % 5]`.
fn load(n: usize) -> Vec<(Vec<u32>, usize)> {
    (0..n).map(|i| (vec![2 + (i % 7) as u32, 3, 4 + (i % 5) as u32], 8 + (i * 37) % 200)).collect()
}

fn send(addr: SocketAddr, (prompt, n): &(Vec<u32>, usize)) -> std::thread::JoinHandle<(u16, Value)> {
    let body = json!({"input_ids": prompt, "return_logprob": true,
        "sampling_params": {"temperature": 0, "max_new_tokens": n}});
    std::thread::spawn(move || post(addr, "/generate", &body))
}

#[test]
fn a_weight_update_under_load_loses_nothing_and_never_mixes_versions() {
    let (old, new) = (slow(7), slow(8));
    let dir = scratch("update-load");
    tlt_model::save_hf_dir(&new, None, &dir, candle_core::DType::F32).unwrap();
    let addr = serve_model(slow(7), true);
    let reqs = load(48);
    let expect = [("v1", greedy(&old, &reqs)), ("v2", greedy(&new, &reqs))];
    assert_ne!(expect[0].1, expect[1].1, "the two versions must decode differently for the test to see a mix");

    let first: Vec<_> = reqs[..24].iter().map(|r| send(addr, r)).collect();
    wait_for("the first requests to run", || metric(addr, "running_requests") >= 1.0);
    let path = dir.display().to_string();
    let update = std::thread::spawn(move || {
        post(addr, "/update_weights_from_disk", &json!({"model_path": path, "weight_version": "v2"}))
    });
    let during: Vec<_> = reqs[24..36].iter().map(|r| send(addr, r)).collect();
    let (status, v) = update.join().unwrap();
    assert_eq!((status, &v["success"], &v["weight_version"]), (200, &json!(true), &json!("v2")), "{v}");
    let after: Vec<_> = reqs[36..].iter().map(|r| send(addr, r)).collect();

    let mut versions = Vec::new();
    for (i, h) in first.into_iter().chain(during).chain(after).enumerate() {
        let (status, out) = h.join().unwrap();
        assert_eq!(status, 200, "request {i}: {out}");
        let version = out["meta_info"]["weight_version"].as_str().unwrap().to_string();
        let want = &expect.iter().find(|(v, _)| *v == version).unwrap_or_else(|| panic!("version {version}")).1[i];
        assert_eq!(&ids(&out), want, "request {i} ({version}) is not that version's decoding");
        assert_eq!(out["meta_info"]["output_token_logprobs"].as_array().unwrap().len(), want.len());
        versions.push(version);
    }
    assert!(versions[..24].contains(&"v1".to_string()), "{versions:?}");
    assert!(versions[36..].iter().all(|v| v == "v2"), "{versions:?}");
    assert_eq!(get_body(addr, "/get_weight_version").1, r#"{"weight_version":"v2"}"#);
    assert_eq!((metric(addr, "weight_updates_total"), metric(addr, "requests_total")), (1.0, 48.0));
}

#[test]
fn an_update_can_abort_what_runs_and_bad_updates_are_refused_by_field() {
    let addr = serve_model(slow(9), true);
    let dir = scratch("update-abort");
    tlt_model::save_hf_dir(&slow(10), None, &dir, candle_core::DType::F32).unwrap();
    let path = dir.display().to_string();

    // Refused: a model of another shape, a path with no model (not under the roots), a load format not served.
    let other = dir.join("other-shape");
    let mut cfg = LlamaConfig::tiny(VOCAB, 64, 2);
    cfg.max_position_embeddings = 4096;
    tlt_model::save_hf_dir(&Llama::random(cfg, 1).unwrap(), None, &other, candle_core::DType::F32).unwrap();
    for (body, want, param) in [
        (json!({"model_path": other.display().to_string()}), 400, "model_path"),
        (json!({"model_path": "/nonexistent/model"}), 403, "model_path"),
        (json!({"model_path": path, "load_format": "dummy"}), 400, "load_format"),
    ] {
        let (status, v) = post(addr, "/update_weights_from_disk", &body);
        assert_eq!((status, &v["error"]["param"]), (want, &json!(param)), "{body}: {v}");
    }

    // Paused in place with a request running: an update that would let it finish is refused (it could not finish
    // before `continue`, and continuing it on new weights would mix versions); one that aborts it goes through.
    let client = std::thread::spawn(move || post(addr, "/generate", &long_request("r", 3000)));
    wait_for("the request to be admitted", || metric(addr, "running_requests") == 1.0);
    assert_eq!(post(addr, "/pause_generation", &json!({"mode": "in_place"})).0, 200);
    let (status, v) = post(addr, "/update_weights_from_disk", &json!({"model_path": path}));
    assert_eq!(status, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("paused in place"), "{v}");
    let body = json!({"model_path": path, "weight_version": "v2", "abort_all_requests": true});
    let (status, v) = post(addr, "/update_weights_from_disk", &body);
    assert_eq!((status, &v["num_paused_requests"]), (200, &json!(1)), "{v}");
    let (_, out) = client.join().unwrap();
    assert_eq!(
        (&out["meta_info"]["finish_reason"]["type"], &out["meta_info"]["weight_version"]),
        (&json!("abort"), &json!("v1"))
    );
    assert_eq!(post(addr, "/continue_generation", &json!({})).0, 200);
    let (status, v) = post(addr, "/generate", &long_request("s", 4));
    assert_eq!((status, &v["meta_info"]["weight_version"]), (200, &json!("v2")), "{v}");
}

#[test]
fn past_max_running_requests_wait_in_the_queue() {
    let decode = tlt_serve::worker::DecodeConfig { max_running: 4, ..tlt_serve::worker::DecodeConfig::default() };
    let addr = serve_with(slow(11), decode);
    let hs: Vec<_> = (0..20)
        .map(|i| std::thread::spawn(move || post(addr, "/generate", &long_request(&format!("q{i}"), 200))))
        .collect();
    let (mut most, mut queued) = (0.0f64, 0.0f64);
    while metric(addr, "requests_total") < 20.0 {
        most = most.max(metric(addr, "running_requests"));
        queued = queued.max(metric(addr, "waiting_requests"));
        std::thread::sleep(Duration::from_millis(2));
    }
    for h in hs {
        let (status, v) = h.join().unwrap();
        assert_eq!((status, ids(&v).len()), (200, 200), "{v}");
    }
    assert!(most <= 4.0, "{most} requests ran at once");
    assert!(queued > 0.0, "no request ever waited: the bound was not exercised");
}
