//! Who may reach the server and what it takes, over real HTTP: the API key, the weight roots (refusals that say
//! nothing of the file), one weight update at a time, the queue, batch and body bounds, the request timeout, JSON-only
//! POSTs (a cross-site form cannot pause the server) and the 503 of a dead engine thread. Every refusal has its
//! positive twin: the same request made acceptably succeeds, so each test can fail.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tlt_serve::guard::GuardConfig;
use tlt_serve::worker::DecodeConfig;
use tlt_serve::ServeConfig;

mod common;
use common::*;

/// A server of [`slow`] with `guard` and `decode`; its address.
fn guarded(guard: GuardConfig, decode: DecodeConfig) -> SocketAddr {
    let cfg = ServeConfig {
        decode,
        model_name: "slow".into(),
        weight_version: Some("v1".into()),
        guard,
        ..ServeConfig::default()
    };
    serve_config(slow(7), None, cfg)
}

/// A fresh directory for this test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tlt-serve-sec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A greedy request of `n` tokens that does not stop early, tagged `rid`.
fn long(rid: &str, n: u64) -> Value {
    json!({"rid": rid, "input_ids": [5, 9, 11], "sampling_params": {"temperature": 0, "max_new_tokens": n,
        "ignore_eos": true}})
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

#[test]
fn the_api_key_is_required_on_every_route_but_health_and_metrics() {
    let addr = guarded(GuardConfig { api_key: Some("s3cret".into()), ..Default::default() }, DecodeConfig::default());
    let body = long("a", 4).to_string();
    let good = ("Authorization", "Bearer s3cret");
    for auth in [
        None,
        Some(("Authorization", "Bearer wrong")),
        Some(("Authorization", "s3cret")),
        Some(("Authorization", "Bearer s3cret2")),
    ] {
        let headers: Vec<_> = [Some(JSON), auth].into_iter().flatten().collect();
        let (status, v) = request(addr, "POST", "/generate", &headers, body.as_bytes());
        assert_eq!(status, 401, "{auth:?}: {v}");
        for path in ["/get_model_info", "/v1/models", "/get_server_info", "/v1/loads"] {
            assert_eq!(request(addr, "GET", path, &headers, b"").0, 401, "{path} {auth:?}");
        }
        let pause = request(addr, "POST", "/pause_generation", &headers, b"{}");
        assert_eq!(pause.0, 401, "{auth:?}");
    }
    // The twins: with the key, each answers.
    let (status, v) = request(addr, "POST", "/generate", &[JSON, good], body.as_bytes());
    assert_eq!((status, ids(&v).len()), (200, 4), "{v}");
    for path in ["/get_model_info", "/v1/models", "/get_server_info", "/v1/loads"] {
        assert_eq!(request(addr, "GET", path, &[good], b"").0, 200, "{path}");
    }
    // Exempt, as SGLang exempts them: health checks and metrics.
    for path in ["/health", "/health_generate", "/health/", "/metrics"] {
        assert_eq!(get(addr, path), 200, "{path}");
    }
    // No key configured (the default): open.
    let open = guarded(GuardConfig::default(), DecodeConfig::default());
    assert_eq!(get(open, "/get_model_info"), 200);
    assert_eq!(post(open, "/generate", &long("b", 4)).0, 200);
}

/// `/update_weights_from_disk` of `path`: (status, answer).
fn update(addr: SocketAddr, path: &Path) -> (u16, Value) {
    post(addr, "/update_weights_from_disk", &json!({"model_path": path.display().to_string(), "weight_version": "v2"}))
}

#[test]
fn weight_paths_outside_the_roots_are_not_allowed_and_say_nothing_of_the_file() {
    let base = scratch("roots");
    let (root, outside) = (base.join("root"), base.join("outside"));
    tlt_model::save_hf_dir(&slow(8), None, &root.join("model"), candle_core::DType::F32).unwrap();
    tlt_model::save_hf_dir(&slow(8), None, &outside.join("model"), candle_core::DType::F32).unwrap();
    std::fs::write(outside.join("secret.gguf"), b"SECRETBYTES of a file outside").unwrap();
    std::fs::write(root.join("junk.gguf"), b"JUNKBYTES not a model").unwrap();
    std::os::unix::fs::symlink(outside.join("model"), root.join("link")).unwrap();
    // A model directory inside the root whose weights are a link out of it.
    let leaky = root.join("leaky");
    std::fs::create_dir_all(&leaky).unwrap();
    for e in std::fs::read_dir(outside.join("model")).unwrap() {
        let e = e.unwrap();
        std::os::unix::fs::symlink(e.path(), leaky.join(e.file_name())).unwrap();
    }
    let guard = GuardConfig { weights_dirs: vec![root.clone()], ..Default::default() };
    let addr = guarded(guard, DecodeConfig::default());

    let leaks = |v: &Value| {
        let m = v.to_string();
        m.contains("SECRET") || m.contains("JUNK") || m.contains("magic") || m.contains("0x") || m.contains("No such")
    };
    for path in [
        outside.join("model"),
        outside.join("secret.gguf"),
        outside.join("absent"),
        root.join("absent"),
        root.join("../outside/model"),
        root.join("link"),
        leaky.clone(),
        PathBuf::from("/etc/passwd"),
    ] {
        let (status, v) = update(addr, &path);
        assert_eq!((status, &v["error"]["param"]), (403, &json!("model_path")), "{}: {v}", path.display());
        assert!(v["error"]["message"].as_str().unwrap().contains("not allowed"), "{v}");
        assert!(!leaks(&v), "{}: {v}", path.display());
    }
    // Under the root but not a model: said so, and nothing of its bytes.
    let (status, v) = update(addr, &root.join("junk.gguf"));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("not a model directory") && !leaks(&v), "{v}");
    assert_eq!(get_body(addr, "/get_weight_version").1, r#"{"weight_version":"v1"}"#);
    // The twin: the model under the root loads.
    let (status, v) = update(addr, &root.join("model"));
    assert_eq!((status, &v["weight_version"]), (200, &json!("v2")), "{v}");
    // No root given (the default): every update from disk is refused, that one too.
    let none = guarded(GuardConfig::default(), DecodeConfig::default());
    let (status, v) = update(none, &root.join("model"));
    assert_eq!(status, 403, "{v}");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn concurrent_updates_one_loads_the_others_are_refused_at_once() {
    let base = scratch("one-update");
    tlt_model::save_hf_dir(&slow(8), None, &base.join("model"), candle_core::DType::F32).unwrap();
    std::fs::write(base.join("junk.gguf"), b"JUNKBYTES").unwrap();
    let guard = GuardConfig { weights_dirs: vec![base.clone()], ..Default::default() };
    let addr = guarded(guard, DecodeConfig::default());
    // A request running: the update waits for it to finish on the old weights, holding the update slot.
    let client = std::thread::spawn(move || post(addr, "/generate", &long("r", 4000)));
    wait_for("the request to run", || metric(addr, "running_requests") == 1.0);
    let model = base.join("model");
    let first = std::thread::spawn(move || update(addr, &model));
    wait_for("the update to wait", || metric(addr, "weight_update_in_progress") == 1.0);
    // Refused at once, before reading anything: a 409, not the 400 the junk file would get from a load.
    let t = Instant::now();
    let (status, v) = update(addr, &base.join("junk.gguf"));
    assert_eq!(status, 409, "{v}");
    assert!(t.elapsed() < Duration::from_millis(500), "refused after {:?}", t.elapsed());
    assert!(v["error"]["message"].as_str().unwrap().contains("in progress"), "{v}");
    let refused: Vec<_> = (0..4)
        .map(|_| {
            let model = base.join("model");
            std::thread::spawn(move || update(addr, &model).0)
        })
        .collect();
    for h in refused {
        assert_eq!(h.join().unwrap(), 409);
    }
    assert_eq!(get_body(addr, "/get_weight_version").1, r#"{"weight_version":"v1"}"#, "applied too early");
    let (status, v) = first.join().unwrap();
    assert_eq!((status, &v["weight_version"]), (200, &json!("v2")), "{v}");
    assert_eq!(client.join().unwrap().0, 200);
    assert_eq!(metric(addr, "weight_updates_total"), 1.0);
    // The twin: once it is done, the next update goes through.
    let (status, v) = update(addr, &base.join("model"));
    assert_eq!(status, 200, "{v}");
    assert_eq!((metric(addr, "weight_updates_total"), metric(addr, "weight_update_in_progress")), (2.0, 0.0));
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_full_queue_is_a_429_and_oversized_requests_are_413() {
    let guard = GuardConfig { max_queued: 4, max_batch: 4, ..Default::default() };
    let addr = guarded(guard, DecodeConfig { max_running: 1, ..DecodeConfig::default() });
    let running = std::thread::spawn(move || post(addr, "/generate", &long("r0", 3000)));
    wait_for("one running", || metric(addr, "running_requests") == 1.0);
    let waiting: Vec<_> =
        (1..5).map(|i| std::thread::spawn(move || post(addr, "/generate", &long(&format!("r{i}"), 4)))).collect();
    wait_for("four waiting", || metric(addr, "waiting_requests") == 4.0);
    let (status, v) = post(addr, "/generate", &long("r5", 4));
    assert_eq!(status, 429, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("queue is full"), "{v}");
    // A batch that does not fit whole is refused whole.
    let (status, _) = post(addr, "/v1/completions", &json!({"prompt": [[5, 6]], "n": 2, "max_tokens": 2}));
    assert_eq!(status, 429);
    assert_eq!(post(addr, "/abort_request", &json!({"rid": "r0"})).0, 200);
    assert_eq!(running.join().unwrap().0, 200);
    for h in waiting {
        assert_eq!(h.join().unwrap().0, 200);
    }
    // The twin: with room in the queue, the same request is served.
    let (status, v) = post(addr, "/generate", &long("r5", 4));
    assert_eq!((status, ids(&v).len()), (200, 4), "{v}");

    // Prompts x n past the bound: 413 naming the field; at the bound, served.
    let prompts = json!([[5, 6], [7, 8], [9, 10]]);
    let (status, v) = post(addr, "/v1/completions", &json!({"prompt": prompts, "n": 2, "max_tokens": 2}));
    assert_eq!((status, &v["error"]["param"]), (413, &json!("n")), "{v}");
    let (status, v) = post(addr, "/v1/completions", &json!({"prompt": [[5, 6], [7, 8]], "n": 2, "max_tokens": 2}));
    assert_eq!((status, v["choices"].as_array().map(Vec::len)), (200, Some(4)), "{v}");
    let five = json!({"input_ids": [[5], [6], [7], [8], [9]], "sampling_params": {"max_new_tokens": 2}});
    assert_eq!(post(addr, "/generate", &five).0, 413);
    // A body past the server's limit: 413.
    let mut big = br#"{"input_ids": [5], "rid": ""#.to_vec();
    big.extend(std::iter::repeat_n(b'x', tlt_serve::routes::BODY_LIMIT + 1));
    big.extend(br#""}"#);
    assert_eq!(request(addr, "POST", "/generate", &[JSON], &big).0, 413);
}

#[test]
fn a_slow_request_past_the_timeout_is_a_504_and_aborted() {
    let guard = GuardConfig { request_timeout: Some(Duration::from_millis(300)), ..Default::default() };
    let addr = guarded(guard, DecodeConfig::default());
    let (status, v) = post(addr, "/generate", &long("slow", 3000));
    assert_eq!(status, 504, "{v}");
    wait_for("the request aborted", || metric(addr, "aborted_requests_total") == 1.0);
    // The twin: a short request answers in time.
    assert_eq!(post(addr, "/generate", &long("fast", 4)).0, 200);
}

#[test]
fn a_cross_site_form_post_cannot_pause_the_server() {
    let addr = guarded(GuardConfig::default(), DecodeConfig::default());
    let client = std::thread::spawn(move || post(addr, "/generate", &long("r", 3000)));
    wait_for("the request to run", || metric(addr, "running_requests") == 1.0);
    let origin = ("Origin", "http://evil.example");
    for (headers, body) in [
        (vec![("Content-Type", "application/x-www-form-urlencoded"), origin], &b"mode=abort"[..]),
        (vec![("Content-Type", "multipart/form-data; boundary=x"), origin], b"--x--"),
        (vec![("Content-Type", "text/plain"), origin], br#"{"mode": "abort"}"#),
        (vec![("Content-Type", "text/plain")], br#"{"mode": "abort"}"#),
        (vec![origin], b""),
        (vec![], br#"{"mode": "abort"}"#),
    ] {
        let (status, v) = request(addr, "POST", "/pause_generation", &headers, body);
        assert_eq!(status, 415, "{headers:?}: {v}");
        let (status, _) = request(addr, "POST", "/abort_request", &headers, br#"{"abort_all": true}"#);
        assert_eq!(status, 415, "{headers:?}");
    }
    assert_eq!((metric(addr, "paused"), metric(addr, "aborted_requests_total")), (0.0, 0.0));
    // The twin: the same pause as JSON pauses and aborts what runs.
    let (status, v) = request(addr, "POST", "/pause_generation", &[JSON], br#"{"mode": "abort"}"#);
    assert_eq!((status, &v["num_aborted_requests"]), (200, &json!(1)), "{v}");
    assert_eq!(client.join().unwrap().1["meta_info"]["finish_reason"]["type"], "abort");
    // An empty POST from a client that is not a browser (no Origin) stays accepted: `requests.post(url)`.
    assert_eq!(request(addr, "POST", "/continue_generation", &[], b"").0, 200);
    assert_eq!(request(addr, "POST", "/flush_cache", &[], b"").0, 200);
    let octets = ("Content-Type", "application/octet-stream"); // aiohttp's, for a POST without a body
    assert_eq!(request(addr, "POST", "/flush_cache", &[octets], b"").0, 200);
    assert_eq!(request(addr, "POST", "/flush_cache", &[octets, origin], b"").0, 415);
}

#[test]
fn a_dead_engine_thread_turns_every_route_into_503() {
    let decode = DecodeConfig { panic_on_rid: Some("boom".into()), ..DecodeConfig::default() };
    let addr = guarded(GuardConfig::default(), decode);
    // The twins: alive, everything answers.
    assert_eq!(get(addr, "/health"), 200);
    assert_eq!(get(addr, "/health_generate"), 200);
    assert_eq!(post(addr, "/generate", &long("fine", 4)).0, 200);
    let (status, v) = post(addr, "/generate", &long("boom", 4));
    assert_eq!(status, 503, "{v}");
    wait_for("/health to fail", || get(addr, "/health") == 503);
    for path in ["/health", "/health_generate", "/get_model_info", "/v1/loads", "/metrics"] {
        assert_eq!(get(addr, path), 503, "{path}");
    }
    let (status, v) = post(addr, "/generate", &long("after", 4));
    assert_eq!(status, 503, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("engine thread died"), "{v}");
}
