//! TRL's older `vllm-serve` surface (`trl vllm-serve`; TRL 1.x's client uses `/v1/completions` instead, served by
//! [`crate::routes`]): `POST /generate/` with a batch of prompts
//! and `n` completions each, `GET /health/`, `/get_world_size/`, `/get_tensor_parallel_size/`, and
//! `POST /reset_prefix_cache/` and vLLM's `/reset_prefix_cache` (nothing is cached across requests: a no-op that says
//! so). Sampling options this
//! server does not implement (`repetition_penalty` other than 1, `min_p` above 0, guided decoding, extra
//! `generation_kwargs`) are refused with a 400 naming them rather than ignored.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::api::{check_ids, Prompt, SamplingParams};
use crate::reply::answer;
use crate::state::AppState;
use crate::Error;

/// TRL's `/generate/` body.
#[derive(Debug, Clone, Deserialize)]
pub struct TrlGenerateRequest {
    /// Prompts, as text or token ids.
    pub prompts: Vec<Prompt>,
    /// Completions per prompt. Default 1.
    pub n: Option<u64>,
    /// Must be 1 (not implemented otherwise).
    pub repetition_penalty: Option<f64>,
    /// Default 1.
    pub temperature: Option<f64>,
    /// Default 1.
    pub top_p: Option<f64>,
    /// `-1` (default): off.
    pub top_k: Option<i64>,
    /// Must be 0 (not implemented otherwise).
    pub min_p: Option<f64>,
    /// Default 16.
    pub max_tokens: Option<u64>,
    /// Must be null (not implemented).
    pub guided_decoding_regex: Option<String>,
    /// Must be empty (not implemented).
    #[serde(default)]
    pub generation_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Return each sampled token's log-probability (any value above 0; only the sampled token's is returned).
    pub logprobs: Option<u64>,
}

/// TRL's `/generate/` answer: every prompt's ids, and its `n` completions in order (prompt-major).
#[derive(Debug, Clone, Serialize)]
pub struct TrlGenerateResponse {
    /// Each prompt's token ids.
    pub prompt_ids: Vec<Vec<u32>>,
    /// Each completion's token ids.
    pub completion_ids: Vec<Vec<u32>>,
    /// Each completion's tokens' log-probabilities (the target's, at the sampling temperature).
    pub logprobs: Vec<Vec<f32>>,
}

fn refuse(field: &str, reason: &str) -> Error {
    Error::Invalid { field: field.into(), reason: reason.into() }
}

/// `POST /generate/`.
pub async fn generate(
    State(s): State<Arc<AppState>>,
    body: Result<Json<TrlGenerateRequest>, JsonRejection>,
) -> Response {
    answer(s, body, run).await
}

async fn run(s: &AppState, req: TrlGenerateRequest) -> crate::Result<TrlGenerateResponse> {
    if req.repetition_penalty.is_some_and(|p| p != 1.0) {
        return Err(refuse("repetition_penalty", "only 1.0 is served"));
    }
    if req.min_p.is_some_and(|p| p != 0.0) {
        return Err(refuse("min_p", "only 0.0 is served"));
    }
    if req.guided_decoding_regex.is_some() {
        return Err(refuse("guided_decoding_regex", "guided decoding is not served"));
    }
    if let Some(k) = req.generation_kwargs.keys().next() {
        return Err(refuse(&format!("generation_kwargs.{k}"), "extra generation arguments are not served"));
    }
    let n = match req.n.unwrap_or(1) {
        0 => return Err(refuse("n", "must be at least 1")),
        n if n > 1024 => return Err(refuse("n", "at most 1024 completions per prompt")),
        n => n as usize,
    };
    if req.prompts.is_empty() {
        return Err(refuse("prompts", "no prompt"));
    }
    let params = SamplingParams {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        max_new_tokens: Some(req.max_tokens.unwrap_or(16)),
        ..SamplingParams::default()
    };
    let sampling = params.validate(&s.limits).map_err(|e| match e {
        Error::Invalid { field, reason } => {
            let field = field.trim_start_matches("sampling_params.").replace("max_new_tokens", "max_tokens");
            Error::Invalid { field, reason }
        }
        other => other,
    })?;
    let mut prompt_ids = Vec::with_capacity(req.prompts.len());
    for (i, p) in req.prompts.iter().enumerate() {
        let field = format!("prompts[{i}]");
        let ids = match p {
            Prompt::Ids(ids) => ids.clone(),
            Prompt::Text(text) => s.tokenize(&field, text)?,
        };
        prompt_ids.push(check_ids(&field, &ids, sampling.max_new_tokens, &s.limits)?);
    }
    let outs = s.submit_batch(&prompt_ids, n, &sampling, "trl").await?;
    let (completion_ids, logprobs) = outs.into_iter().map(|o| (o.tokens, o.logprobs)).unzip();
    let _ = req.logprobs;
    Ok(TrlGenerateResponse { prompt_ids, completion_ids, logprobs })
}

/// `GET /health/`.
pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// `GET /get_world_size/`: one process serves.
pub async fn world_size() -> Json<serde_json::Value> {
    Json(json!({"world_size": 1}))
}

/// `GET /get_tensor_parallel_size/`.
pub async fn tensor_parallel_size() -> Json<serde_json::Value> {
    Json(json!({"tensor_parallel_size": 1}))
}

/// `POST /reset_prefix_cache/` (TRL's `vllm-serve`) and `POST /reset_prefix_cache` (vLLM's, which TRL 1.16's client
/// posts after a weight sync): nothing is cached across requests.
pub async fn reset_prefix_cache() -> Json<serde_json::Value> {
    Json(
        json!({"message": "Request received, resetting prefix cache status: True (nothing is cached across requests)"}),
    )
}
