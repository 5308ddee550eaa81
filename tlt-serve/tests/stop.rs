//! Stop strings on `/generate` (`sampling_params.stop`, as slime's `--rollout-stop` and its eval configs send them):
//! the answer ends at the token whose text completes one, SGLang's finish reason names the string, `text` is cut
//! before it unless `no_stop_trim`, and the tokens and log-probs are the unstopped decoding's prefix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use serde_json::{json, Value};
use tlt_model::{EosTokens, Llama, LlamaConfig};

mod common;

/// A server of a tiny model with the byte-level tokenizer (token `b` < 256 is the byte `b`), SD gate at TLT's
/// defaults; its address.
fn serve_bytes(tokenizer: bool) -> std::net::SocketAddr {
    let mut cfg = LlamaConfig::tiny(264, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(258));
    let model = Llama::random(cfg, 3).unwrap();
    let tok = tokenizer.then(|| tlt_model::byte_tokenizer().unwrap());
    let serve = tlt_serve::ServeConfig { model_name: "bytes".into(), ..Default::default() };
    common::serve_config(model, tok, serve)
}

fn body(seed: u64, stop: Value, no_stop_trim: bool) -> Value {
    json!({"input_ids": [72, 105, 33], "return_logprob": true,
        "sampling_params": {"temperature": 0.9, "max_new_tokens": 96, "ignore_eos": true, "sampling_seed": seed,
            "stop": stop, "no_stop_trim": no_stop_trim, "skip_special_tokens": true}})
}

/// Printable ASCII: one byte, one character.
fn ascii(t: u32) -> bool {
    (32..127).contains(&t)
}

#[test]
fn stop_strings_end_the_answer_as_sglang_reports_it() {
    let addr = serve_bytes(true);
    let tok = tlt_model::byte_tokenizer().unwrap();
    // The unstopped decoding (seeded: the same sample every time), then a two-character stop string taken from it
    // where it first completes: at token `end`.
    let mut found = None;
    for seed in 0..32u64 {
        let (status, full) = common::post(addr, "/generate", &body(seed, Value::Null, false));
        assert_eq!(status, 200, "{full}");
        let ids = common::ids(&full);
        let pick = (1..ids.len()).find(|&k| {
            let stop = tok.decode(&ids[k - 1..=k], true).unwrap();
            ascii(ids[k - 1]) && ascii(ids[k]) && !tok.decode(&ids[..k], true).unwrap().contains(&stop)
        });
        if let Some(end) = pick.filter(|&k| k + 1 < ids.len()) {
            found = Some((seed, full, ids.clone(), end));
            break;
        }
    }
    let (seed, full, ids, end) = found.expect("no seed gave two printable characters in a row");
    let stop = tok.decode(&ids[end - 1..=end], true).unwrap();
    let lps = |v: &Value| v["meta_info"]["output_token_logprobs"].as_array().unwrap().clone();

    // As a list with a string that never occurs first: it ends at `end`, the string named, the text cut before it.
    let (status, out) = common::post(addr, "/generate", &body(seed, json!(["\u{1}never\u{2}", stop]), false));
    assert_eq!(status, 200, "{out}");
    assert_eq!(common::ids(&out), ids[..=end], "the tokens up to the one completing {stop:?}");
    assert_eq!(lps(&out), lps(&full)[..=end], "the log-probs are the unstopped decoding's prefix");
    assert_eq!(out["meta_info"]["finish_reason"], json!({"type": "stop", "matched": stop}));
    let text = tok.decode(&ids[..=end], true).unwrap();
    let cut = &text[..text.find(&stop).unwrap()];
    assert_eq!(out["text"], cut, "text cut before the stop string");
    assert_eq!(out["meta_info"]["completion_tokens"], end + 1);

    // As one string, with no_stop_trim (slime's default): the same tokens, the string kept in the text.
    let (status, kept) = common::post(addr, "/generate", &body(seed, json!(stop), true));
    assert_eq!(status, 200, "{kept}");
    assert_eq!(common::ids(&kept), ids[..=end]);
    assert_eq!(kept["text"], text);
    assert_eq!(kept["meta_info"]["finish_reason"]["matched"], json!(stop));
    println!("seed {seed}: stop {stop:?} ended the answer at token {end} of {}; text {cut:?}", ids.len());

    // A stop string that never occurs changes nothing.
    let (_, none) = common::post(addr, "/generate", &body(seed, json!(["\u{1}never\u{2}"]), false));
    assert_eq!(common::ids(&none), ids);
    assert_eq!(none["meta_info"]["finish_reason"]["type"], "length");
}

#[test]
fn bad_stop_strings_are_refused_by_name() {
    let addr = serve_bytes(true);
    for (stop, field) in [
        (json!([""]), "sampling_params.stop[0]"),
        (json!(["a", 3]), "sampling_params.stop[1]"),
        (json!(5), "sampling_params.stop"),
        (json!(vec!["x"; 33]), "sampling_params.stop"),
        (json!(["y".repeat(257)]), "sampling_params.stop[0]"),
    ] {
        let (status, err) = common::post(addr, "/generate", &body(1, stop.clone(), false));
        assert_eq!(status, 400, "{stop}: {err}");
        assert_eq!(err["error"]["param"], field, "{err}");
    }
    // Absent, null, "" and [] are no stop strings.
    for stop in [Value::Null, json!(""), json!([])] {
        let (status, out) = common::post(addr, "/generate", &body(1, stop, false));
        assert_eq!(status, 200, "{out}");
    }
    // Without a tokenizer nothing can match them.
    let (status, err) = common::post(serve_bytes(false), "/generate", &body(1, json!(["ab"]), false));
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "sampling_params.stop", "{err}");
}
