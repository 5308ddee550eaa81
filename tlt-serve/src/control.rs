//! SGLang's control endpoints, as slime and verl's SGLang server mode call them: `/abort_request`,
//! `/pause_generation` (modes `abort` and `in_place`), `/continue_generation`, `/flush_cache`, `/get_weight_version`
//! and `/update_weights_from_disk`. Each acts on the engine thread between two rounds ([`crate::worker::Msg`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::api::{AbortRequest, PauseRequest, UpdateWeightsRequest};
use crate::reply::answer;
use crate::state::AppState;
use crate::worker::{Msg, Update, Weights};
use crate::Error;

/// `GET /get_weight_version`.
pub(crate) async fn weight_version(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"weight_version": &*s.stats.version()}))
}

/// `/flush_cache`: nothing is cached across requests; as SGLang, it succeeds only when no request waits or runs (asked
/// of the engine thread, so that requests sent just before are counted).
pub(crate) async fn flush_cache(State(s): State<Arc<AppState>>) -> Response {
    let quiet = match s.control(|reply| Msg::Flush { reply }).await {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    if quiet {
        (StatusCode::OK, "Cache flushed (nothing is cached across requests).").into_response()
    } else {
        let body = json!({"error": {"message": "requests are waiting or running: flush when idle",
            "type": "invalid_request_error", "param": null, "code": 400}});
        (StatusCode::BAD_REQUEST, Json(body)).into_response()
    }
}

/// `POST /pause_generation` (body optional, as SGLang's clients send it with or without `{"mode": ...}`): no round
/// runs until `/continue_generation`; requests are still taken and wait for it outside the queue (as SGLang holds
/// them before its scheduler: they block neither a flush nor an update; an abort ends them). Mode `abort` (the
/// default) first ends the running and the queued requests (SGLang's), `in_place` keeps them.
pub(crate) async fn pause(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: PauseRequest = if body.iter().all(u8::is_ascii_whitespace) {
        PauseRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => return Error::Invalid { field: "body".into(), reason: e.to_string() }.into_response(),
        }
    };
    let abort = match req.mode.as_deref() {
        None | Some("abort") => true,
        Some("in_place") => false,
        Some(other) => {
            let reason = format!(
                "`{other}` is not served: `abort` (default) or `in_place` (`retract` would re-prefill after a \
                 weight update and mix two versions in one response)"
            );
            return Error::Invalid { field: "mode".into(), reason }.into_response();
        }
    };
    match s.control(|reply| Msg::Pause { abort, reply }).await {
        Ok(n) => Json(json!({"message": "generation paused", "num_aborted_requests": n})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /continue_generation`.
pub(crate) async fn resume(State(s): State<Arc<AppState>>) -> Response {
    if let Err(e) = s.msgs.try_send(Msg::Continue) {
        return match e {
            std::sync::mpsc::TrySendError::Full(_) => Error::Full("the engine's queue is full: retry".into()),
            std::sync::mpsc::TrySendError::Disconnected(_) => Error::Stopped,
        }
        .into_response();
    }
    // The switch the engine thread sets; reported at once so that a client reading /metrics next sees it.
    s.stats.paused.store(false, Ordering::Relaxed);
    Json(json!({"message": "generation continued"})).into_response()
}

/// `POST /abort_request` (`rid`, or `abort_all`): the requests end and answer with what they generated, finish
/// reason `abort`.
pub(crate) async fn abort(State(s): State<Arc<AppState>>, body: Result<Json<AbortRequest>, JsonRejection>) -> Response {
    answer(s, body, async |s: &AppState, req: AbortRequest| {
        let rid = match (req.abort_all, req.rid) {
            (true, _) => None,
            (false, Some(rid)) if !rid.is_empty() => Some(rid),
            (false, _) => {
                return Err(Error::Invalid { field: "rid".into(), reason: "give a request id or abort_all".into() })
            }
        };
        let n = s.control(|reply| Msg::Abort { rid, reply }).await?;
        Ok(json!({"num_aborted_requests": n}))
    })
    .await
}

/// Hands `weights` to the engine thread, which swaps them in between rounds (see [`update_weights`]) under `version`
/// (absent: the version stays); the number of requests aborted for it (`abort_running`).
pub(crate) async fn swap_in(
    s: &AppState,
    weights: Weights,
    version: Option<String>,
    abort_running: bool,
) -> crate::Result<usize> {
    let version = version.unwrap_or_else(|| s.stats.version().to_string());
    s.control(|reply| Msg::Update(Box::new(Update { model: weights, version, abort_running, reply }))).await?
}

/// The update in progress: taken, or refused (409) while another holds it; released when dropped.
pub(crate) struct OneUpdate<'a>(&'a std::sync::atomic::AtomicBool);

impl<'a> OneUpdate<'a> {
    pub(crate) fn take(flag: &'a std::sync::atomic::AtomicBool) -> crate::Result<Self> {
        flag.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| Self(flag))
            .map_err(|_| Error::Busy("another weight update is in progress: refused before loading".into()))
    }
}

impl Drop for OneUpdate<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// `POST /update_weights_from_disk`: only from under the `--weights-dir` roots ([`crate::weights`]), one at a time;
/// loads the checkpoint off the engine thread (decoding goes on meanwhile), then
/// swaps it in between rounds once the running requests have finished on the old weights (or were aborted, with
/// `abort_all_requests`); requests that arrive meanwhile wait and decode on the new weights. Answers SGLang's
/// `{"success", "message", "num_paused_requests"}` once the new weights serve.
pub(crate) async fn update_weights(
    State(s): State<Arc<AppState>>,
    body: Result<Json<UpdateWeightsRequest>, JsonRejection>,
) -> Response {
    answer(s, body, async |s: &AppState, req: UpdateWeightsRequest| {
        if let Some(f) = req.load_format.as_deref().filter(|f| *f != "auto") {
            let reason = format!("`{f}` is not served: `auto` (read off the path: a directory or a .gguf file)");
            return Err(Error::Invalid { field: "load_format".into(), reason });
        }
        // One update at a time, refused before anything is read.
        let _one = OneUpdate::take(&s.stats.updating)?;
        let roots = s.weight_roots.clone();
        let requested = req.model_path.clone();
        let loaded = tokio::task::spawn_blocking(move || roots.load(&requested))
            .await
            .map_err(|_| Error::Engine("loading the weights failed (see the server's log)".into()))??;
        let weights = Weights::Model(Box::new(loaded.model));
        let aborted = swap_in(s, weights, req.weight_version.clone(), req.abort_all_requests).await?;
        Ok(json!({"success": true, "message": format!("loaded {}", req.model_path),
            "num_paused_requests": aborted, "weight_version": &*s.stats.version()}))
    })
    .await
}
