//! SGLang's control semantics as slime's async rollout relies on them, over real HTTP: a pause in `abort` mode ends
//! the queued requests too; `/health_generate` answers without queueing behind the load. (`/health` failing once the
//! engine thread died is in `security.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tlt_serve::worker::DecodeConfig;

mod common;
use common::*;

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A greedy request of `n` tokens that does not stop early, tagged `rid`, sent on its own thread.
fn send(addr: SocketAddr, rid: &str, n: u64) -> std::thread::JoinHandle<(u16, Value)> {
    let body = json!({"rid": rid, "input_ids": [5, 9, 11], "return_logprob": true,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": true}});
    std::thread::spawn(move || post(addr, "/generate", &body))
}

fn finish(v: &Value) -> &Value {
    &v["meta_info"]["finish_reason"]["type"]
}

#[test]
fn a_pause_in_abort_mode_ends_the_queued_requests_too() {
    let addr = serve_with(slow(3), DecodeConfig { max_running: 1, ..DecodeConfig::default() });
    let running = send(addr, "r0", 3000);
    wait_for("one running", || metric(addr, "running_requests") == 1.0);
    let queued: Vec<_> = (1..3).map(|i| send(addr, &format!("q{i}"), 3000)).collect();
    wait_for("two queued", || metric(addr, "waiting_requests") == 2.0);
    // The twin: in place, nothing ends, the queue stays.
    let (status, v) = post(addr, "/pause_generation", &json!({"mode": "in_place"}));
    assert_eq!((status, &v["num_aborted_requests"]), (200, &json!(0)), "{v}");
    assert_eq!((metric(addr, "running_requests"), metric(addr, "waiting_requests")), (1.0, 2.0));
    // Abort mode (slime's, before a weight update): the running one and both queued end.
    let (status, v) = post(addr, "/pause_generation", &json!({"mode": "abort"}));
    assert_eq!((status, &v["num_aborted_requests"]), (200, &json!(3)), "{v}");
    let (status, v) = running.join().unwrap();
    assert_eq!((status, finish(&v)), (200, &json!("abort")), "{v}");
    assert!(!ids(&v).is_empty() && ids(&v).len() < 3000, "{v}");
    for h in queued {
        let (status, v) = h.join().unwrap();
        assert_eq!((status, finish(&v), ids(&v).len()), (200, &json!("abort"), 0), "{v}");
        assert_eq!(v["meta_info"]["output_token_logprobs"], json!([]), "{v}");
    }
    assert_eq!((metric(addr, "running_requests"), metric(addr, "waiting_requests")), (0.0, 0.0));
    assert_eq!(post(addr, "/continue_generation", &json!({})).0, 200);
    assert_eq!(send(addr, "after", 4).join().unwrap().0, 200);
}

#[test]
fn health_generate_answers_without_queueing_behind_the_load() {
    let addr = serve_with(slow(3), DecodeConfig { max_running: 1, ..DecodeConfig::default() });
    // The twin: idle, it decodes its token (a finished request).
    assert_eq!(get(addr, "/health_generate"), 200);
    assert_eq!(metric(addr, "requests_total"), 1.0);
    // Loaded: one request running and three queued, seconds of work; the check answers at once.
    let load: Vec<_> = (0..4).map(|i| send(addr, &format!("l{i}"), 3000)).collect();
    wait_for("the load", || metric(addr, "running_requests") == 1.0 && metric(addr, "waiting_requests") == 3.0);
    let t = Instant::now();
    assert_eq!(get(addr, "/health_generate"), 200);
    let took = t.elapsed();
    assert!(took < Duration::from_millis(500), "/health_generate took {took:?} under load");
    assert_eq!(metric(addr, "requests_total"), 1.0, "the load finished first: the test saw no queue");
    // Paused: answered at once too.
    assert_eq!(post(addr, "/pause_generation", &json!({"mode": "abort"})).0, 200);
    let t = Instant::now();
    assert_eq!(get(addr, "/health_generate"), 200);
    assert!(t.elapsed() < Duration::from_millis(500), "paused: {:?}", t.elapsed());
    for h in load {
        assert_eq!(h.join().unwrap().0, 200);
    }
    assert_eq!(post(addr, "/continue_generation", &json!({})).0, 200);
}

#[test]
fn requests_arriving_while_paused_wait_for_the_continue_and_do_not_block_a_flush() {
    // slime's update sequence with its workers still sending: pause (abort), flush, update, continue. As SGLang holds
    // requests that arrive while paused before its scheduler, the flush succeeds and they run after the continue.
    let addr = serve_with(slow(3), DecodeConfig::default());
    let (status, v) = post(addr, "/pause_generation", &json!({"mode": "abort"}));
    assert_eq!((status, &v["num_aborted_requests"]), (200, &json!(0)), "{v}");
    let late: Vec<_> = (0..2).map(|i| send(addr, &format!("late{i}"), 4)).collect();
    wait_for("two waiting", || metric(addr, "waiting_requests") == 2.0);
    assert_eq!(metric(addr, "running_requests"), 0.0, "a request arriving while paused started");
    let (status, v) = post(addr, "/flush_cache", &json!({}));
    assert_eq!(status, 200, "requests that arrived while paused blocked the flush: {v}");
    // One of them aborted by its rid while parked; the other runs after the continue.
    let (status, v) = post(addr, "/abort_request", &json!({"rid": "late1"}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(post(addr, "/continue_generation", &json!({})).0, 200);
    let mut late = late.into_iter();
    let (status, v) = late.next().unwrap().join().unwrap();
    assert_eq!((status, finish(&v), ids(&v).len()), (200, &json!("length"), 4), "{v}");
    let (status, v) = late.next().unwrap().join().unwrap();
    assert_eq!((status, finish(&v), ids(&v).len()), (200, &json!("abort"), 0), "{v}");
    // The control: a request that arrived before the pause, paused in place, still blocks the flush.
    let running = send(addr, "before", 3000);
    wait_for("one running", || metric(addr, "running_requests") == 1.0);
    assert_eq!(post(addr, "/pause_generation", &json!({"mode": "in_place"})).0, 200);
    assert_eq!(post(addr, "/flush_cache", &json!({})).0, 400, "flushed with a request paused in place");
    assert_eq!(post(addr, "/abort_request", &json!({"rid": "before"})).0, 200);
    assert_eq!(running.join().unwrap().0, 200);
    assert_eq!(post(addr, "/continue_generation", &json!({})).0, 200);
}
