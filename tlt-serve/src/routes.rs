//! The HTTP surface: axum handlers that validate a request ([`crate::api`]), hand it to the engine thread
//! ([`crate::worker`]) and shape its output as SGLang or OpenAI clients read it. Errors are JSON:
//! `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape), 400 for a bad request naming the field, 503
//! when the engine thread is gone, 500 for an engine failure.
//!
//! This module only assembles the router: the shared state ([`AppState`]) lives in `state.rs`, the reply shapes
//! in `reply.rs`, the handlers in `generate.rs`, [`crate::chat`], [`crate::control`], [`crate::trl`], `info.rs`
//! and `stream.rs`; none of them imports this module.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::api::GenerateRequest;
use crate::info::{health, health_generate, loads, metrics, model_info, models, server_info};
use crate::reply::answer;
use crate::{control, generate};

pub use crate::info::LoadsQuery;
pub use crate::state::AppState;

/// Largest request body (bytes); a larger one is a 413.
pub const BODY_LIMIT: usize = 16 << 20;

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/generate", post(generate_or_stream))
        .route("/v1/completions", post(generate::completions))
        .route("/v1/chat/completions", post(crate::chat::completions))
        .route("/v1/loads", get(loads))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/get_model_info", get(model_info))
        .route("/model_info", get(model_info))
        .route("/get_server_info", get(server_info))
        .route("/server_info", get(server_info))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/get_weight_version", get(control::weight_version))
        .route("/flush_cache", post(control::flush_cache).get(control::flush_cache))
        .route("/pause_generation", post(control::pause))
        .route("/continue_generation", post(control::resume))
        .route("/abort_request", post(control::abort))
        .route("/update_weights_from_disk", post(control::update_weights))
        .route("/init_weights_update_group", post(crate::sync_routes::init))
        .route("/update_weights_from_distributed", post(crate::sync_routes::update))
        .route("/destroy_weights_update_group", post(crate::sync_routes::destroy))
        .route("/generate/", post(crate::trl::generate))
        .route("/health/", get(crate::trl::health))
        .route("/get_world_size/", get(crate::trl::world_size))
        .route("/get_world_size", get(crate::trl::world_size))
        .route("/get_tensor_parallel_size/", get(crate::trl::tensor_parallel_size))
        .route("/reset_prefix_cache/", post(crate::trl::reset_prefix_cache))
        .route("/reset_prefix_cache", post(crate::trl::reset_prefix_cache))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(state.clone(), crate::guard::guard))
        .with_state(state)
}

/// `/generate`: streamed as server-sent events when the request asks, else one JSON answer.
async fn generate_or_stream(
    State(s): State<Arc<AppState>>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Response {
    match body {
        Ok(Json(req)) if req.stream => crate::stream::generate(s, req).await,
        body => answer(s, body, generate::run_generate).await,
    }
}
