//! Who may reach the server and how much it takes: the API key (SGLang's `--api-key`: `Authorization: Bearer KEY` on
//! every route but `/health*` and `/metrics`, as SGLang exempts them), JSON bodies on every POST (a form or
//! `text/plain` post, which a web page can send cross-site without asking, is a 415), the 503 every route answers
//! once the engine thread has died, and per-request timeouts. The weight roots of `/update_weights_from_disk` are
//! [`crate::weights`]'s; the queue and batch bounds are enforced where requests are queued ([`crate::routes`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::state::AppState;

pub use crate::guard_config::{GuardConfig, DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUED};

/// `a == b` in time that depends on their lengths only, not on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// Routes anyone may call without the key (SGLang exempts paths starting with `/health`, and `/metrics`).
fn exempt(path: &str) -> bool {
    path.starts_with("/health") || path == "/metrics"
}

/// An error answer in the server's JSON shape.
fn refuse(status: StatusCode, message: &str) -> Response {
    let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

/// Whether a POST's body is acceptable: JSON (`application/json`, `application/*+json`, any parameters), or an
/// empty body from a client that is not a browser (no `Origin` header, which browsers send on every POST a page
/// makes), whatever its content type: `requests.post(url)` sends none, aiohttp `application/octet-stream`, as
/// clients call `/flush_cache` or `/continue_generation`.
fn json_body(req: &Request) -> bool {
    let headers = req.headers();
    let empty = headers.get(header::CONTENT_LENGTH).is_none_or(|l| l.as_bytes() == b"0")
        && headers.get(header::TRANSFER_ENCODING).is_none();
    if empty && headers.get(header::ORIGIN).is_none() {
        return true;
    }
    match headers.get(header::CONTENT_TYPE).map(|v| v.to_str().map(str::to_ascii_lowercase)) {
        Some(Ok(ct)) => {
            let essence = ct.split(';').next().unwrap_or("").trim().to_owned();
            essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
        }
        _ => false,
    }
}

/// The middleware in front of every route: the key (401), the content type (415), the engine's death (503), the
/// timeout (504), in that order.
pub(crate) async fn guard(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    if let (Some(key), false) = (&s.guard.api_key, exempt(&path)) {
        let given = req.headers().get(header::AUTHORIZATION).map(|v| v.as_bytes()).unwrap_or_default();
        if !constant_time_eq(given, format!("Bearer {key}").as_bytes()) {
            return refuse(StatusCode::UNAUTHORIZED, "Unauthorized: send `Authorization: Bearer <the --api-key>`");
        }
    }
    if req.method() == Method::POST && !json_body(&req) {
        return refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "POST bodies must be JSON: send `Content-Type: application/json`",
        );
    }
    if s.stats.engine_failure.get().is_some() {
        return refuse(StatusCode::SERVICE_UNAVAILABLE, "the engine thread died (the cause is in the server's log)");
    }
    match s.guard.request_timeout.filter(|_| path != "/update_weights_from_disk") {
        // Dropping the handler's future drops its reply channels: the engine aborts its requests next round.
        Some(limit) => match tokio::time::timeout(limit, next.run(req)).await {
            Ok(r) => r,
            Err(_) => refuse(
                StatusCode::GATEWAY_TIMEOUT,
                &format!("not answered within the server's request timeout ({} s): aborted", limit.as_secs_f64()),
            ),
        },
        None => next.run(req).await,
    }
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn keys_compare_whole() {
        assert!(constant_time_eq(b"Bearer k", b"Bearer k"));
        assert!(!constant_time_eq(b"Bearer k", b"Bearer kk"));
        assert!(!constant_time_eq(b"Bearer k", b"Bearer j"));
        assert!(!constant_time_eq(b"", b"Bearer k"));
    }
}
