//! OpenAI's `/v1/chat/completions` and SGLang's `/v1/loads` over real HTTP: a tiny model with the byte-level
//! tokenizer (ChatML's special tokens included) and a ChatML chat template.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tlt_model::{EosTokens, Llama, LlamaConfig};
use tlt_rl::task::{ChatMessage, ChatTemplate, CHATML_JINJA};
use tlt_serve::worker::DecodeConfig;
use tlt_serve::ServeConfig;

mod common;
use common::*;

/// ChatML, refusing a `tool` message (to see a template's `raise_exception` come back as a 400).
fn template() -> ChatTemplate {
    let src = format!(
        "{{% for m in messages %}}{{% if m.role == 'tool' %}}{{{{ raise_exception('no tool messages') }}}}\
         {{% endif %}}{{% endfor %}}{CHATML_JINJA}"
    );
    ChatTemplate::from_jinja(&src, "<|endoftext|>", "<|im_end|>").unwrap()
}

/// A tiny model over the byte tokenizer's 259 tokens (end of sequence `<|im_end|>`).
fn byte_model() -> Llama {
    let mut cfg = LlamaConfig::tiny(264, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(258));
    Llama::random(cfg, 3).unwrap()
}

fn serve_chat(template: Option<ChatTemplate>, decode: DecodeConfig) -> SocketAddr {
    let cfg = ServeConfig { decode, model_name: "tiny".into(), chat_template: template, ..ServeConfig::default() };
    serve_config(byte_model(), Some(tlt_model::byte_tokenizer().unwrap()), cfg)
}

fn chat(addr: SocketAddr, body: &Value) -> Value {
    let (status, v) = post(addr, "/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    v
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap().to_owned()).collect()
}

#[test]
fn chat_completions_are_completions_of_the_rendered_conversation() {
    let addr = serve_chat(Some(template()), DecodeConfig::always_speculate());
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"}]);
    let v = chat(addr, &json!({"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": true}));
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert!(v["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(v["model"], "tiny");
    let keys = |o: &Value| {
        let mut k = o.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        k.sort();
        k
    };
    assert_eq!(keys(&v), ["choices", "created", "id", "model", "object", "usage"]);
    let choice = &v["choices"][0];
    assert_eq!(keys(choice), ["finish_reason", "index", "logprobs", "message"]);
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"], json!({"role": "assistant", "content": choice["message"]["content"]}));
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    let usage = &v["usage"];
    let completion_tokens = usage["completion_tokens"].as_u64().unwrap();
    let entries = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len() as u64, completion_tokens);
    for e in entries {
        assert_eq!(keys(e), ["bytes", "logprob", "token", "top_logprobs"]);
        let token = e["token"].as_str().unwrap();
        let bytes: Vec<u8> = e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        assert_eq!(bytes, token.as_bytes());
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(e["top_logprobs"], json!([]));
    }

    // The same as /v1/completions on the conversation rendered by the template.
    let convo = [ChatMessage::system("Be brief."), ChatMessage::user("What is 1 + 1?")];
    let rendered = template().render(&convo, true).unwrap();
    let body = json!({"prompt": rendered, "max_tokens": 12, "temperature": 0, "logprobs": 1});
    let (status, c) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["choices"][0]["text"], choice["message"]["content"]);
    assert_eq!(c["usage"], v["usage"]);
    let served: Vec<&Value> = entries.iter().map(|e| &e["logprob"]).collect();
    let completed: Vec<&Value> = c["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().iter().collect();
    assert_eq!(served, completed);
    // The prompt is the rendering tokenized without added special tokens: `<|im_start|>` is one token.
    let tok = tlt_model::byte_tokenizer().unwrap();
    let ids = tok.encode(rendered.as_str(), false).unwrap().get_ids().to_vec();
    assert_eq!(usage["prompt_tokens"].as_u64().unwrap() as usize, ids.len());
    assert_eq!(ids[0], 257);

    // Content as text parts (joined with newlines), the model name echoed, no generation prompt.
    let parts = json!([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "1 + 1?"}]}]);
    let a = chat(addr, &json!({"messages": parts, "max_completion_tokens": 12, "temperature": 0, "model": "m"}));
    let split = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is\n1 + 1?"}]);
    let b = chat(addr, &json!({"messages": split, "max_tokens": 12, "temperature": 0, "logprobs": false}));
    assert_eq!(strings(&a["choices"]), strings(&b["choices"]));
    assert_eq!(a["model"], "m");
    assert_eq!(b["choices"][0]["logprobs"], Value::Null);
    let open = chat(addr, &json!({"messages": split, "max_tokens": 2, "add_generation_prompt": false}));
    // `<|im_start|>` + "assistant\n": 11 tokens fewer.
    let prompt = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompt(&open) + 11, prompt(&b));

    // n samples of one prompt, seeded: they repeat with the seed; the prompt counts once per choice.
    let body = json!({"messages": messages, "max_tokens": 16, "temperature": 0.9, "n": 3, "seed": 5});
    let (x, y) = (chat(addr, &body), chat(addr, &body));
    assert_eq!(x["choices"].as_array().unwrap().len(), 3);
    assert_eq!(strings(&x["choices"]), strings(&y["choices"]));
    for (i, c) in x["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    assert_eq!(prompt(&x), 3 * ids.len() as u64);
}

#[test]
fn chat_requests_that_cannot_be_served_are_refused_by_field() {
    let addr = serve_chat(Some(template()), DecodeConfig::default());
    let user = json!([{"role": "user", "content": "Hi"}]);
    let cases = [
        (json!({"messages": user, "stream": true}), "stream"),
        (json!({"messages": user, "logprobs": true, "top_logprobs": 3}), "top_logprobs"),
        (json!({"messages": user, "stop": ["\n"]}), "stop"),
        (json!({"messages": user, "tools": [{"type": "function"}]}), "tools"),
        (json!({"messages": user, "temperature": -1}), "temperature"),
        (json!({"messages": user, "max_completion_tokens": 600}), "messages"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"role": "tool", "content": "42"}]}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0].type",
        ),
        (json!({"messages": [{"role": "assistant", "content": null, "tool_calls": []}]}), "messages[0].tool_calls"),
    ];
    for (body, field) in cases {
        let (status, v) = post(addr, "/v1/chat/completions", &body);
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(field)), "{body}: {v}");
    }
    let (status, v) = post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "tool", "content": "4"}]}));
    assert!(status == 400 && v["error"]["message"].as_str().unwrap().contains("no tool messages"), "{v}");
    assert_eq!(post(addr, "/v1/chat/completions", &json!({"model": "x"})).0, 422);

    // No template, or no tokenizer: a 400 naming `messages` that says so.
    let plain = serve_chat(None, DecodeConfig::default());
    let (status, v) = post(plain, "/v1/chat/completions", &json!({"messages": user}));
    assert!(status == 400 && v["error"]["message"].as_str().unwrap().contains("no usable chat template"), "{v}");
    assert_eq!(v["error"]["param"], "messages");
    let (status, v) = post(serve(false), "/v1/chat/completions", &json!({"messages": user}));
    assert!(status == 400 && v["error"]["message"].as_str().unwrap().contains("no tokenizer"), "{v}");
    // The server goes on serving.
    chat(addr, &json!({"messages": user, "max_tokens": 2}));
}

fn loads(addr: SocketAddr) -> Value {
    let (status, body) = get_body(addr, "/v1/loads");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Polls `/v1/loads` until `ok` holds of the rank's load.
fn wait_for(addr: SocketAddr, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let v = loads(addr);
        if ok(&v["loads"][0]) {
            return v;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "{what}: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn loads_report_running_and_waiting_requests_and_their_tokens() {
    let capacity = 4096; // the KV pool's tokens, given
    let cfg = tlt_serve::ServeConfig {
        decode: DecodeConfig { max_running: 1, ..DecodeConfig::default() },
        pool: tlt_serve::pool::PoolSpec { max_total_tokens: Some(capacity), ..Default::default() },
        ..tlt_serve::ServeConfig::default()
    };
    let addr = serve_config(slow(3), None, cfg);
    let v = loads(addr);
    assert_eq!(v["dp_rank_count"], 1);
    assert!(v["timestamp"].as_str().unwrap().ends_with('Z'), "{v}");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(
        v["loads"][0],
        json!({"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
            "max_total_num_tokens": capacity, "token_usage": 0.0, "max_running_requests": 1, "num_total_reqs": 0})
    );

    // The first request runs, then the server pauses in place: it holds its cache, and the second, arriving while
    // paused, waits.
    let send = |prompt: Vec<u32>, n: usize| {
        std::thread::spawn(move || {
            let body = json!({"input_ids": prompt,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": true}});
            post(addr, "/generate", &body)
        })
    };
    let first = send(vec![2, 3, 4, 5, 6], 3000);
    wait_for(addr, "the first request running", |l| l["num_running_reqs"] == 1);
    assert_eq!(post(addr, "/pause_generation", &json!({"mode": "in_place"})).0, 200);
    let second = send(vec![7, 8, 9], 8);
    let v = wait_for(addr, "one running, one waiting", |l| l["num_waiting_reqs"] == 1);
    let load = &v["loads"][0];
    let used = load["num_used_tokens"].as_u64().unwrap();
    assert!((5..3005).contains(&used), "the running request's prompt and tokens so far: {v}");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(loads(addr)["loads"][0]["num_used_tokens"].as_u64(), Some(used), "tokens grew while paused");
    assert_eq!((load["num_running_reqs"].as_u64(), load["num_total_reqs"].as_u64()), (Some(1), Some(2)));
    assert_eq!(load["token_usage"].as_f64().unwrap(), used as f64 / capacity as f64);
    assert_eq!(
        v["aggregate"],
        json!({"total_running_reqs": 1, "total_waiting_reqs": 1, "total_reqs": 2, "total_used_tokens": used,
            "avg_token_usage": used as f64 / capacity as f64})
    );
    let (status, text) = get_body(addr, "/v1/loads?format=prometheus&dp_rank=0");
    assert_eq!(status, 200);
    assert!(
        text.contains("# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs{dp_rank=\"0\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("sglang_num_waiting_reqs{dp_rank=\"0\"} 1\n"), "{text}");
    for (query, field) in [("dp_rank=1", "dp_rank"), ("format=xml", "format")] {
        let (status, body) = get_body(addr, &format!("/v1/loads?{query}"));
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(field)), "{body}");
    }

    assert_eq!(post(addr, "/continue_generation", &json!({})).0, 200);
    for h in [first, second] {
        assert_eq!(h.join().unwrap().0, 200);
    }
    wait_for(addr, "idle again", |l| l["num_total_reqs"] == 0 && l["num_used_tokens"] == 0);
}
