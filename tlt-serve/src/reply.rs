//! The shapes of HTTP replies every handler shares: errors as OpenAI's JSON
//! `{"error": {"message", "type", "param", "code"}}` (400 for a bad request naming the field, 503 when the engine
//! thread is gone, 500 for an engine failure), rejected bodies in the same shape, a JSON endpoint's run, and
//! OpenAI's token counts and timestamps.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::api::Usage;
use crate::state::AppState;
use crate::worker::Output;
use crate::Error;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let (status, kind, param) = match &self {
            Error::Invalid { field, .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", Some(field.clone())),
            Error::Model(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            Error::Busy(_) => (StatusCode::CONFLICT, "invalid_request_error", None),
            Error::Forbidden { field, .. } => (StatusCode::FORBIDDEN, "invalid_request_error", Some(field.clone())),
            Error::Full(_) => (StatusCode::TOO_MANY_REQUESTS, "server_error", None),
            Error::TooLarge { field, .. } => {
                (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", Some(field.clone()))
            }
            Error::Stopped => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None),
            Error::Engine(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        let body =
            json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": status.as_u16()}});
        (status, Json(body)).into_response()
    }
}

/// A body that is not the expected JSON: a 400 (413 when too large) saying why, in the same shape.
pub(crate) fn rejected(r: &JsonRejection) -> Response {
    let status = r.status();
    let body = json!({"error": {"message": r.body_text(), "type": "invalid_request_error", "param": null,
        "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

/// A JSON endpoint: the body parsed (or its rejection answered), `run` on it, its answer as JSON or an error.
pub(crate) async fn answer<T, R>(
    s: Arc<AppState>,
    body: Result<Json<T>, JsonRejection>,
    run: impl AsyncFnOnce(&AppState, T) -> crate::Result<R>,
) -> Response
where
    R: serde::Serialize,
{
    match body {
        Ok(Json(req)) => match run(&s, req).await {
            Ok(r) => Json(r).into_response(),
            Err(e) => e.into_response(),
        },
        Err(r) => rejected(&r),
    }
}

/// OpenAI's token counts of a request's outputs (every choice's prompt counted, as vLLM counts them).
pub(crate) fn usage(outs: &[Output]) -> Usage {
    let prompt_tokens = outs.iter().map(|o| o.prompt_tokens).sum();
    let completion_tokens = outs.iter().map(|o| o.tokens.len()).sum();
    Usage { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
}

/// Now in Unix seconds (OpenAI's `created`).
pub(crate) fn unix_seconds() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
