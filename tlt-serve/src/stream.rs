//! SGLang's streamed `/generate` (`"stream": true`): server-sent events, each `data:` a cumulative answer (the text,
//! `output_ids` and `meta_info` so far, finish reason null) after every engine round that committed tokens for the
//! request, then the final answer, then `data: [DONE]`, as SGLang streams. A client that goes away drops the
//! stream, which aborts the request at the next round boundary. A request that fails validation is answered with a
//! plain JSON 4xx before any event.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use tokio::sync::{mpsc, oneshot};

use crate::api::GenerateRequest;
use crate::generate::{generate_response, prepare_generate};
use crate::state::AppState;
use crate::worker::{Output, Progress};
use crate::Error;

/// Where a stream is.
enum Phase {
    /// Waiting for rounds' tokens.
    Running,
    /// The final answer went out; `[DONE]` is next.
    Done,
    /// Over.
    End,
}

/// A stream's state between events.
struct Streaming {
    s: Arc<AppState>,
    req: GenerateRequest,
    rid: String,
    progress: mpsc::UnboundedReceiver<Progress>,
    reply: oneshot::Receiver<crate::Result<Output>>,
    /// Everything streamed so far, as a partial output.
    so_far: Output,
    phase: Phase,
}

impl Streaming {
    /// The next event, or `None` at the end.
    async fn next(mut self) -> Option<(Result<Event, Infallible>, Self)> {
        match self.phase {
            Phase::End => None,
            Phase::Done => {
                self.phase = Phase::End;
                Some((Ok(Event::default().data("[DONE]")), self))
            }
            Phase::Running => {
                if let Some(p) = self.progress.recv().await {
                    self.so_far.tokens.extend(p.tokens);
                    self.so_far.logprobs.extend(p.logprobs);
                    self.so_far.weight_version = p.weight_version;
                    let partial = generate_response(&self.s, &self.req, &self.rid, &self.so_far, false);
                    return Some((Ok(json_event(&partial)), self));
                }
                // The engine thread dropped the progress channel: the request ended; its output follows.
                self.phase = Phase::Done;
                let event = match (&mut self.reply).await {
                    Ok(Ok(out)) => json_event(&generate_response(&self.s, &self.req, &self.rid, &out, true)),
                    Ok(Err(e)) => error_event(&e),
                    Err(_) => error_event(&Error::Stopped),
                };
                Some((Ok(event), self))
            }
        }
    }
}

fn json_event(v: &impl serde::Serialize) -> Event {
    Event::default().data(serde_json::to_string(v).unwrap_or_default())
}

fn error_event(e: &Error) -> Event {
    json_event(&serde_json::json!({"error": {"message": e.to_string(), "type": "server_error", "param": null}}))
}

/// `POST /generate` with `"stream": true`.
pub(crate) async fn generate(s: Arc<AppState>, req: GenerateRequest) -> Response {
    let (rid, prompt, sampling) = match prepare_generate(&s, &req) {
        Ok((mut items, false)) if items.len() == 1 => items.remove(0),
        Ok(_) => {
            let reason = "a batch is not streamed: send one request per prompt".into();
            return Error::Invalid { field: "stream".into(), reason }.into_response();
        }
        Err(e) => return e.into_response(),
    };
    let prompt_tokens = prompt.len();
    let (tx, progress) = mpsc::unbounded_channel();
    let reply = match s.enqueue_with(Some(rid.clone()), prompt, sampling, Some(tx)) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let so_far = Output::empty(prompt_tokens, tlt_spec_decode::FinishReason::Length, s.stats.version());
    let state = Streaming { s, req, rid, progress, reply, so_far, phase: Phase::Running };
    Sse::new(futures_util::stream::unfold(state, Streaming::next)).into_response()
}
