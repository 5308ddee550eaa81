//! The server's health and information endpoints: `/health`, `/health_generate`, `/get_model_info`,
//! `/get_server_info`, `/v1/models`, `/v1/loads` and `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tokio::sync::oneshot;

use crate::api::Sampling;
use crate::state::AppState;
use crate::stats::Stats;
use crate::worker::{Job, Msg};
use crate::Error;

pub(crate) async fn health() -> StatusCode {
    StatusCode::OK
}

/// How long `/health_generate` waits for the engine thread before it answers 503.
const HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Healthy when the engine thread answers: decoding one token of a one-token prompt when idle, at once (SGLang's
/// behaviour) when it is busy, paused or updating, so that the check never queues behind the load.
pub(crate) async fn health_generate(State(s): State<Arc<AppState>>) -> Response {
    let sampling = Sampling {
        temperature: 0.0,
        top_p: None,
        top_k: None,
        max_new_tokens: 1,
        stop_token_ids: Some(Vec::new()),
        stop_strings: Vec::new(),
        seed: None,
        stream: 0,
    };
    let (reply, rx) = oneshot::channel();
    // Counted as waiting (the engine thread takes it off), never refused for a full queue.
    Stats::add(&s.stats.waiting, 1);
    let job = Job { rid: None, prompt: vec![0], sampling, reply, progress: None };
    if s.msgs.try_send(Msg::Health(job)).is_err() {
        Stats::sub(&s.stats.waiting, 1);
        return Error::Stopped.into_response();
    }
    match tokio::time::timeout(HEALTH_TIMEOUT, rx).await {
        Ok(Ok(Ok(_))) => StatusCode::OK.into_response(),
        Ok(Ok(Err(e))) => e.into_response(),
        Ok(Err(_)) | Err(_) => Error::Stopped.into_response(),
    }
}

pub(crate) async fn model_info(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"model_path": s.model_name, "tokenizer_path": s.model_name, "is_generation": true,
        "weight_version": &*s.stats.version()}))
}

/// The server arguments, and what changes: the weights' version and what the bandits learned.
pub(crate) async fn server_info(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let mut info = s.server_args.clone();
    if let Some(map) = info.as_object_mut() {
        map.insert("weight_version".into(), json!(&*s.stats.version()));
        // What each sampling's bandit has learned so far (its leading arm per bucket).
        map.insert("speculative_bandit_state".into(), json!(&*s.stats.bandit.lock()));
    }
    Json(info)
}

pub(crate) async fn models(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [{"id": s.model_name, "object": "model", "owned_by": "tlt-serve"}]}))
}

/// `GET /v1/loads`'s query: SGLang's `dp_rank` (this server is rank 0 of 1), `include` (accepted; the sections
/// beyond the core counts are not served) and `format` (`json` or `prometheus`).
#[derive(Debug, Default, serde::Deserialize)]
pub struct LoadsQuery {
    /// Only this rank: 0.
    pub dp_rank: Option<String>,
    /// Sections (accepted, not served beyond the core).
    pub include: Option<String>,
    /// `json` (default) or `prometheus`.
    pub format: Option<String>,
}

/// `GET /v1/loads` (SGLang's): the load of the one rank (`dp_rank` 0) from the server's counters, and the
/// aggregate over ranks. `num_used_tokens` are the running requests' prompt and output tokens;
/// `max_total_num_tokens` is the KV pool's tokens (what the caches may hold at most, see [`crate::pool`]), and
/// `token_usage` their ratio. SGLang's fields this server does not measure (`num_total_tokens`, `gen_throughput`,
/// `cache_hit_rate`, `utilization`, the optional sections) are left out, as SGLang leaves out unset ones.
pub(crate) async fn loads(
    State(s): State<Arc<AppState>>,
    query: Result<Query<LoadsQuery>, QueryRejection>,
) -> Response {
    let q = match query {
        Ok(Query(q)) => q,
        Err(r) => return crate::api::invalid("query", r.body_text()).into_response(),
    };
    if q.dp_rank.as_deref().is_some_and(|r| r.trim() != "0") {
        return crate::api::invalid("dp_rank", "this server has one data-parallel rank, 0").into_response();
    }
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (running, waiting, used) = (get(&s.stats.running), get(&s.stats.waiting), get(&s.stats.live_tokens));
    let capacity = s.limits.pool_tokens as u64;
    let usage = used as f64 / capacity.max(1) as f64;
    let core: [(&str, f64); 6] = [
        ("num_running_reqs", running as f64),
        ("num_waiting_reqs", waiting as f64),
        ("num_used_tokens", used as f64),
        ("max_total_num_tokens", capacity as f64),
        ("token_usage", usage),
        ("max_running_requests", s.max_running as f64),
    ];
    match q.format.as_deref() {
        None | Some("json") => {}
        Some("prometheus") => {
            let mut text = String::new();
            for (name, value) in core {
                text.push_str(&format!("# TYPE sglang_{name} gauge\nsglang_{name}{{dp_rank=\"0\"}} {value}\n"));
            }
            return ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
                .into_response();
        }
        Some(other) => {
            return crate::api::invalid("format", format!("`{other}` is neither json nor prometheus")).into_response()
        }
    }
    let load = json!({"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_used_tokens": used,
        "max_total_num_tokens": capacity, "token_usage": usage, "max_running_requests": s.max_running,
        "num_total_reqs": running + waiting});
    let aggregate = json!({"total_running_reqs": running, "total_waiting_reqs": waiting,
        "total_reqs": running + waiting, "total_used_tokens": used, "avg_token_usage": usage});
    Json(json!({"timestamp": tlt_rl::metrics::utc_timestamp(), "version": env!("CARGO_PKG_VERSION"),
        "dp_rank_count": 1, "loads": [load], "aggregate": aggregate}))
    .into_response()
}

/// `GET /metrics`: Prometheus' text format.
pub(crate) async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.stats.prometheus()).into_response()
}
