//! What SGLang's gateway (sglang-router) and slime's and TRL's start-up send and read, against the server in
//! process: the fields the router adds to every `/generate` it forwards (captured from sglang-router 0.3.2) accepted
//! at their neutral values and the answer unchanged; the same fields at other values, and unknown fields, refused by
//! name; `/server_info` and `/get_server_info` carrying the server arguments as this server runs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use serde_json::{json, Value};

mod common;

/// What sglang-router 0.3.2 forwarded for slime's rollout payload (`input_ids`, slime's `sampling_params`,
/// `return_logprob`), captured from the router: the body rebuilt from its own struct, with these fields added.
/// (It also drops `sampling_params.stop` when null and `spaces_between_special_tokens`.)
fn router_added() -> Value {
    json!({"model": null, "return_text_in_logprobs": false, "stream": false, "log_metrics": true,
        "return_hidden_states": false, "background": false, "no_logs": false, "return_bytes": false,
        "return_entropy": false})
}

fn slime_body() -> Value {
    json!({"input_ids": [3, 9, 27], "return_logprob": true,
        "sampling_params": {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12,
            "skip_special_tokens": false, "no_stop_trim": true, "sampling_seed": 11}})
}

fn merged(base: &Value, extra: &Value) -> Value {
    let mut out = base.clone();
    for (k, v) in extra.as_object().unwrap() {
        out[k] = v.clone();
    }
    out
}

#[test]
fn the_routers_neutral_fields_are_accepted_and_change_nothing() {
    let addr = common::serve(true);
    let (status, direct) = common::post(addr, "/generate", &slime_body());
    assert_eq!(status, 200, "{direct}");
    let (status, routed) = common::post(addr, "/generate", &merged(&slime_body(), &router_added()));
    assert_eq!(status, 200, "{routed}");
    assert_eq!(routed["output_ids"], direct["output_ids"]);
    assert_eq!(routed["meta_info"]["output_token_logprobs"], direct["meta_info"]["output_token_logprobs"]);
    // The other values of the options that change nothing for this server, and the ones the router forwards
    // when a client sent them at their neutral values.
    let also = json!({"model": "any-name", "log_metrics": false, "no_logs": true, "extra_key": "salt",
        "data_parallel_rank": 0, "logprob_start_len": -1, "top_logprobs_num": 0, "return_routed_experts": false,
        "priority": null, "lora_path": null, "session_params": null, "image_data": null});
    let (status, other) = common::post(addr, "/generate", &merged(&merged(&slime_body(), &router_added()), &also));
    assert_eq!(status, 200, "{other}");
    assert_eq!(other["output_ids"], direct["output_ids"]);
    println!("router-added fields accepted; the answer equals the direct one ({} tokens)", ids_len(&direct));
}

fn ids_len(v: &Value) -> usize {
    v["output_ids"].as_array().map_or(0, Vec::len)
}

#[test]
fn unserved_values_and_unknown_fields_are_refused_by_name() {
    let addr = common::serve(false);
    let cases = [
        ("return_hidden_states", json!(true)),
        ("return_entropy", json!(true)),
        ("return_bytes", json!(true)),
        ("background", json!(true)),
        ("return_routed_experts", json!(true)),
        ("top_logprobs_num", json!(2)),
        ("logprob_start_len", json!(0)),
        ("data_parallel_rank", json!(1)),
        ("token_ids_logprob", json!([1, 2])),
        ("lora_path", json!("adapter")),
        ("image_data", json!("http://x/y.png")),
        ("input_embeds", json!([[0.5]])),
        ("session_params", json!({"id": "s"})),
        ("custom_logit_processor", json!("f")),
        ("bootstrap_room", json!(3)),
        ("priority", json!(1)),
    ];
    for (field, value) in cases {
        let body = merged(&merged(&slime_body(), &router_added()), &json!({ field: value }));
        let (status, err) = common::post(addr, "/generate", &body);
        assert_eq!(status, 400, "{field}: {err}");
        assert_eq!(err["error"]["param"], field, "{err}");
    }
    for (field, value) in [("json_schema", json!("{}")), ("regex", json!("a+")), ("custom_params", json!({"a": 1}))] {
        let mut body = slime_body();
        body["sampling_params"][field] = value;
        let (status, err) = common::post(addr, "/generate", &body);
        assert_eq!(status, 400, "{field}: {err}");
        assert_eq!(err["error"]["param"], format!("sampling_params.{field}"), "{err}");
    }
    // Not one of SGLang's fields: refused as unknown, naming it.
    let (status, err) = common::post(addr, "/generate", &merged(&slime_body(), &json!({"bogus_option": true})));
    assert_eq!(status, 422, "{err}");
    assert!(err.to_string().contains("bogus_option"), "{err}");
    let mut body = slime_body();
    body["sampling_params"]["bogus_sampling"] = json!(1);
    let (status, err) = common::post(addr, "/generate", &body);
    assert_eq!(status, 422, "{err}");
    assert!(err.to_string().contains("bogus_sampling"), "{err}");
}

#[test]
fn text_in_logprobs_is_each_tokens_text() {
    let mut cfg = tlt_model::LlamaConfig::tiny(264, 64, 2);
    cfg.eos_token_id = Some(tlt_model::EosTokens::One(258));
    let model = tlt_model::Llama::random(cfg, 3).unwrap();
    let tok = tlt_model::byte_tokenizer().unwrap();
    let serve = tlt_serve::ServeConfig { model_name: "bytes".into(), ..Default::default() };
    let addr = common::serve_config(model, Some(tok.clone()), serve);
    let body = json!({"input_ids": [72, 105], "return_logprob": true, "return_text_in_logprobs": true,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": true}});
    let (status, out) = common::post(addr, "/generate", &body);
    assert_eq!(status, 200, "{out}");
    for item in out["meta_info"]["output_token_logprobs"].as_array().unwrap() {
        let id = item[1].as_u64().unwrap() as u32;
        assert_eq!(item[2].as_str().unwrap(), tok.decode(&[id], false).unwrap(), "{item}");
    }
}

#[test]
fn server_info_carries_the_args_slime_trl_and_the_router_read() {
    let addr = common::serve(true);
    let (status, text) = common::get_body(addr, "/get_server_info");
    assert_eq!(status, 200, "{text}");
    let info: Value = serde_json::from_str(&text).unwrap();
    let (status, text) = common::get_body(addr, "/server_info?config_format=json");
    assert_eq!(status, 200, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), info, "/server_info and /get_server_info differ");
    for (key, want) in [
        ("tp_size", json!(1)),
        ("dp_size", json!(1)),
        ("pp_size", json!(1)),
        ("ep_size", json!(1)),
        ("enable_memory_saver", json!(false)),
        ("disaggregation_mode", json!("null")),
        ("dtype", json!("float32")),
        ("model_path", json!("tiny")),
        ("context_length", json!(common::tiny().config().max_position_embeddings)),
        ("max_running_requests", json!(256)),
        ("speculative_algorithm", json!("NGRAM")),
        ("weight_version", json!("v1")),
    ] {
        assert_eq!(info[key], want, "{key} in {info}");
    }
    // The KV pool, sized from the host's memory: at least one full context, and what /v1/loads bounds the caches by.
    let pool = info["max_total_tokens"].as_u64().unwrap();
    assert!(pool >= common::tiny().config().max_position_embeddings as u64, "{info}");
    assert_eq!(info["kv_pool"]["tokens"], pool);
    assert_eq!(info["internal_states"][0]["max_total_num_tokens"], pool);
    let (_, loads) = common::get_body(addr, "/v1/loads");
    let loads: Value = serde_json::from_str(&loads).unwrap();
    assert_eq!(loads["loads"][0]["max_total_num_tokens"], info["max_total_tokens"]);
    // TRL 1.16 reads vLLM's config from /server_info.
    let vllm = &info["vllm_config"];
    assert_eq!(vllm["model_config"]["logprobs_mode"], "processed_logprobs");
    assert!(vllm["weight_transfer_config"].is_null(), "{vllm}");
}
