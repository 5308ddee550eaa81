//! The HTTP surface: axum handlers that validate a request ([`crate::api`]), hand it to the engine thread
//! ([`crate::worker`]) and shape its output as SGLang or OpenAI clients read it. Errors are JSON:
//! `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape), 400 for a bad request naming the field, 503
//! when the engine thread is gone, 500 for an engine failure.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokenizers::Tokenizer;
use tokio::sync::oneshot;

use crate::api::{
    check_ids, finish_kind, Choice, ChoiceLogprobs, CompletionRequest, CompletionResponse, FinishReason,
    GenerateRequest, GenerateResponse, Limits, MetaInfo, Prompt, Sampling, Usage,
};
use crate::stats::Stats;
use crate::worker::{Job, Msg, Output};
use crate::{control, Error};

/// Largest request body (bytes); a larger one is a 413.
pub const BODY_LIMIT: usize = 16 << 20;

/// What the handlers share.
pub struct AppState {
    /// The engine thread's queue (bounded: [`crate::guard::GuardConfig::max_queued`] requests and
    /// [`crate::CONTROL_SLOTS`] control messages).
    pub msgs: mpsc::SyncSender<Msg>,
    /// The model's tokenizer (text prompts and outputs need it).
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// Request limits.
    pub limits: Limits,
    /// The served model's name (its path).
    pub model_name: String,
    /// Request ids made here.
    pub next_id: AtomicU64,
    /// The next coin stream for requests without a seed (from 1; seeded requests take `api::seeded_stream`).
    pub next_stream: AtomicU64,
    /// Counters and the pause switch, shared with the engine thread.
    pub stats: Arc<Stats>,
    /// The model's chat template (`/v1/chat/completions` needs it).
    pub chat_template: Option<tlt_rl::task::ChatTemplate>,
    /// Most requests decoding at once (`DecodeConfig::max_running`).
    pub max_running: usize,
    /// SGLang's server arguments as this server runs (`/get_server_info`, `/server_info`; [`crate::server_info`]).
    pub server_args: serde_json::Value,
    /// Where `/update_weights_from_disk` may load from.
    pub weight_roots: crate::weights::WeightRoots,
    /// The key, the bounds.
    pub guard: crate::guard::GuardConfig,
}

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

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/generate", post(generate))
        .route("/v1/completions", post(completions))
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
        .route("/generate/", post(crate::trl::generate))
        .route("/health/", get(crate::trl::health))
        .route("/get_world_size/", get(crate::trl::world_size))
        .route("/get_world_size", get(crate::trl::world_size))
        .route("/get_tensor_parallel_size/", get(crate::trl::tensor_parallel_size))
        .route("/reset_prefix_cache/", post(crate::trl::reset_prefix_cache))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(state.clone(), crate::guard::guard))
        .with_state(state)
}

impl AppState {
    /// Queues `prompt` with `sampling` for the engine thread; its output arrives on the returned channel (dropping
    /// it aborts the request at the next round boundary); each round's new tokens go to `progress` when given.
    pub(crate) fn enqueue_with(
        &self,
        rid: Option<String>,
        prompt: Vec<u32>,
        sampling: Sampling,
        progress: Option<tokio::sync::mpsc::UnboundedSender<crate::worker::Progress>>,
    ) -> crate::Result<oneshot::Receiver<crate::Result<Output>>> {
        self.reserve(1)?;
        self.send_reserved(rid, prompt, sampling, progress)
    }

    /// Takes `n` places in the waiting queue, all or none.
    ///
    /// # Errors
    /// [`Error::Full`] (a 429) when fewer than `n` are free.
    pub(crate) fn reserve(&self, n: usize) -> crate::Result<()> {
        let max = self.guard.max_queued as u64;
        self.stats
            .waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| w.checked_add(n as u64).filter(|&t| t <= max))
            .map(|_| ())
            .map_err(|_| {
                Error::Full(format!(
                    "the queue is full ({} requests wait for the engine): retry later",
                    self.guard.max_queued
                ))
            })
    }

    /// Sends a job whose place in the queue [`AppState::reserve`] took (given back when it cannot be sent).
    fn send_reserved(
        &self,
        rid: Option<String>,
        prompt: Vec<u32>,
        sampling: Sampling,
        progress: Option<tokio::sync::mpsc::UnboundedSender<crate::worker::Progress>>,
    ) -> crate::Result<oneshot::Receiver<crate::Result<Output>>> {
        let (reply, rx) = oneshot::channel();
        match self.msgs.try_send(Msg::Job(Job { rid, prompt, sampling, reply, progress })) {
            Ok(()) => Ok(rx),
            Err(e) => {
                Stats::sub(&self.stats.waiting, 1);
                Err(match e {
                    mpsc::TrySendError::Full(_) => Error::Full("the engine's queue is full: retry later".into()),
                    mpsc::TrySendError::Disconnected(_) => Error::Stopped,
                })
            }
        }
    }

    /// Refuses a request of more than [`crate::guard::GuardConfig::max_batch`] samples.
    ///
    /// # Errors
    /// [`Error::TooLarge`] naming `field`.
    pub(crate) fn check_batch(&self, field: &str, samples: usize) -> crate::Result<()> {
        // A request larger than the queue could never be queued whole.
        let most = self.guard.max_batch.min(self.guard.max_queued);
        if samples > most {
            let reason = format!("{samples} samples (prompts x n) in one request: at most {most}");
            return Err(Error::TooLarge { field: field.into(), reason });
        }
        Ok(())
    }

    /// Queues `n` samples of every prompt at once (the engine batches them all; a prompt's samples fork its
    /// prefill) and awaits them, prompt-major. Sample `k` of the batch is tagged `rid-k` and samples on coin stream
    /// `seeded_stream(seed, k)` with a seed, on a fresh stream without one (the same prompts sent again are sampled
    /// anew). Dropping the future aborts them all.
    pub(crate) async fn submit_batch(
        &self,
        prompts: &[Vec<u32>],
        n: usize,
        sampling: &Sampling,
        rid: &str,
    ) -> crate::Result<Vec<Output>> {
        let total = prompts.len().saturating_mul(n);
        self.check_batch("n", total)?;
        self.reserve(total)?;
        let first = if sampling.seed.is_some() { 0 } else { self.fresh_streams(total as u64) };
        let mut pending = Vec::with_capacity(total);
        for (k, p) in prompts.iter().flat_map(|p| std::iter::repeat_n(p, n)).enumerate() {
            let stream = match sampling.seed {
                Some(seed) => crate::api::seeded_stream(seed, k as u64),
                None => first + k as u64,
            };
            let sampling = Sampling { stream, ..sampling.clone() };
            match self.send_reserved(Some(format!("{rid}-{k}")), p.clone(), sampling, None) {
                Ok(rx) => pending.push(rx),
                Err(e) => {
                    // The places of the samples not sent go back (this one's went back in `send_reserved`).
                    Stats::sub(&self.stats.waiting, (total - k - 1) as u64);
                    return Err(e);
                }
            }
        }
        let mut outs = Vec::with_capacity(total);
        for rx in pending {
            outs.push(rx.await.map_err(|_| Error::Stopped)??);
        }
        Ok(outs)
    }

    /// Sends the engine thread a control message made around `reply` and waits for its answer.
    pub(crate) async fn control<A>(&self, msg: impl FnOnce(oneshot::Sender<A>) -> Msg) -> crate::Result<A> {
        let (reply, rx) = oneshot::channel();
        self.msgs.try_send(msg(reply)).map_err(|e| match e {
            mpsc::TrySendError::Full(_) => Error::Full("the engine's queue is full: retry later".into()),
            mpsc::TrySendError::Disconnected(_) => Error::Stopped,
        })?;
        rx.await.map_err(|_| Error::Stopped)
    }

    pub(crate) fn tokenize(&self, field: &str, text: &str) -> crate::Result<Vec<i64>> {
        let tok = self.tokenizer.as_ref().ok_or_else(|| Error::Invalid {
            field: field.into(),
            reason: "this model has no tokenizer: send token ids".into(),
        })?;
        let enc = tok.encode(text, false).map_err(|e| Error::Model(format!("tokenizing `{field}`: {e}")))?;
        Ok(enc.get_ids().iter().map(|&t| i64::from(t)).collect())
    }

    fn detokenize(&self, ids: &[u32]) -> String {
        self.detokenize_with(ids, true)
    }

    /// `ids` as text, special tokens skipped or not (empty without a tokenizer).
    pub(crate) fn detokenize_with(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        self.tokenizer.as_ref().and_then(|t| t.decode(ids, skip_special_tokens).ok()).unwrap_or_default()
    }

    /// `n` coin streams no request took before (unseeded requests); the first of them.
    pub(crate) fn fresh_streams(&self, n: u64) -> u64 {
        self.next_stream.fetch_add(n, Ordering::Relaxed)
    }

    /// The model name an OpenAI answer carries: the one the request gave, else the served model's.
    pub(crate) fn answer_model(&self, requested: Option<&str>) -> String {
        requested.map_or_else(|| self.model_name.clone(), str::to_owned)
    }

    /// A fresh request id: `prefix` and a counter.
    pub(crate) fn id(&self, prefix: &str) -> String {
        format!("{prefix}{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

async fn generate(State(s): State<Arc<AppState>>, body: Result<Json<GenerateRequest>, JsonRejection>) -> Response {
    match body {
        Ok(Json(req)) if req.stream => crate::stream::generate(s, req).await,
        body => answer(s, body, run_generate).await,
    }
}

/// One prompt of a `/generate` request, checked: its request id, token ids and sampling.
pub(crate) type Prepared = (String, Vec<u32>, Sampling);

/// A `/generate` request checked: each prompt's id, ids and sampling (with a fresh coin stream when unseeded), and
/// whether it was a batch.
pub(crate) fn prepare_generate(s: &AppState, req: &GenerateRequest) -> crate::Result<(Vec<Prepared>, bool)> {
    req.check_unserved()?;
    let sampling = req.sampling_params.validate(&s.limits)?;
    if !sampling.stop_strings.is_empty() && s.tokenizer.is_none() {
        let reason = "this model has no tokenizer to match stop strings with: use stop_token_ids";
        return Err(Error::Invalid { field: "sampling_params.stop".into(), reason: reason.into() });
    }
    let (field, prompts, batched) = match (&req.input_ids, &req.text) {
        (Some(ids), None) => {
            let (items, batched) = ids.items();
            ("input_ids", items.into_iter().cloned().collect::<Vec<_>>(), batched)
        }
        (None, Some(text)) => {
            let (items, batched) = text.items();
            let ids = items.iter().map(|t| s.tokenize("text", t)).collect::<crate::Result<Vec<_>>>()?;
            ("text", ids, batched)
        }
        _ => {
            return Err(Error::Invalid {
                field: "input_ids".into(),
                reason: "give exactly one of text and input_ids".into(),
            })
        }
    };
    if prompts.is_empty() {
        return Err(Error::Invalid { field: field.into(), reason: "an empty batch".into() });
    }
    s.check_batch(field, prompts.len())?;
    let rids: Vec<Option<String>> = match &req.rid {
        None => vec![None; prompts.len()],
        Some(r) => {
            let (items, many) = r.items();
            if many != batched || items.len() != prompts.len() {
                let reason = format!("{} ids for {} prompts", items.len(), prompts.len());
                return Err(Error::Invalid { field: "rid".into(), reason });
            }
            items.into_iter().cloned().map(Some).collect()
        }
    };
    let mut out = Vec::with_capacity(prompts.len());
    for (i, (ids, rid)) in prompts.iter().zip(rids).enumerate() {
        let name = if batched { format!("{field}[{i}]") } else { field.to_owned() };
        let prompt = check_ids(&name, ids, sampling.max_new_tokens, &s.limits)?;
        let mut sampling = sampling.clone();
        if sampling.seed.is_none() {
            sampling.stream = s.fresh_streams(1);
        }
        out.push((rid.unwrap_or_else(|| s.id("")), prompt, sampling));
    }
    Ok((out, batched))
}

/// SGLang's answer for `out`; `finished` false: a streamed partial answer (finish reason null).
pub(crate) fn generate_response(
    s: &AppState,
    req: &GenerateRequest,
    rid: &str,
    out: &Output,
    finished: bool,
) -> GenerateResponse {
    let text = |t: u32| req.return_text_in_logprobs.then(|| s.detokenize_with(&[t], false));
    let logprobs =
        req.return_logprob.then(|| out.logprobs.iter().zip(&out.tokens).map(|(&l, &t)| (l, t, text(t))).collect());
    let stop = req.sampling_params.stop_strings().unwrap_or_default();
    let mut text = s.detokenize_with(&out.tokens, req.sampling_params.skip_special_tokens.unwrap_or(true));
    // SGLang's trim: the text ends before the first occurrence of the stop string that ended it.
    if let (true, tlt_spec_decode::FinishReason::StopString { index }) = (finished, out.reason) {
        let at = stop.get(index).and_then(|m| text.find(m.as_str()));
        if let (Some(at), false) = (at, req.sampling_params.no_stop_trim.unwrap_or(false)) {
            text.truncate(at);
        }
    }
    GenerateResponse {
        text,
        meta_info: MetaInfo {
            id: rid.to_owned(),
            finish_reason: finished.then(|| FinishReason::of(out.reason, out.tokens.last().copied(), &stop)),
            prompt_tokens: out.prompt_tokens,
            completion_tokens: out.tokens.len(),
            cached_tokens: 0,
            weight_version: out.weight_version.to_string(),
            output_token_logprobs: logprobs,
            spec_verify_ct: out.spec_rounds,
            spec_accept_token_num: out.spec_accepted,
            spec_draft_token_num: out.spec_drafted,
        },
        output_ids: out.tokens.clone(),
    }
}

/// `/generate`'s answer: one, or a list for a batch.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum GenerateAnswer {
    One(Box<GenerateResponse>),
    Many(Vec<GenerateResponse>),
}

async fn run_generate(s: &AppState, req: GenerateRequest) -> crate::Result<GenerateAnswer> {
    let (items, batched) = prepare_generate(s, &req)?;
    // Every prompt of a batch is queued before any is awaited (the engine batches them), or none is.
    s.reserve(items.len())?;
    let mut pending = Vec::with_capacity(items.len());
    let total = items.len();
    for (k, (rid, prompt, sampling)) in items.into_iter().enumerate() {
        match s.send_reserved(Some(rid.clone()), prompt, sampling, None) {
            Ok(rx) => pending.push((rx, rid)),
            Err(e) => {
                Stats::sub(&s.stats.waiting, (total - k - 1) as u64);
                return Err(e);
            }
        }
    }
    let mut answers = Vec::with_capacity(pending.len());
    for (rx, rid) in pending {
        let out = rx.await.map_err(|_| Error::Stopped)??;
        answers.push(generate_response(s, &req, &rid, &out, true));
    }
    match answers.pop() {
        Some(one) if !batched => Ok(GenerateAnswer::One(Box::new(one))),
        last => Ok(GenerateAnswer::Many(answers.into_iter().chain(last).collect())),
    }
}

async fn completions(State(s): State<Arc<AppState>>, body: Result<Json<CompletionRequest>, JsonRejection>) -> Response {
    answer(s, body, run_completion).await
}

async fn run_completion(s: &AppState, req: CompletionRequest) -> crate::Result<CompletionResponse> {
    let sampling = req.validate(&s.limits)?;
    let n = req.options.samples()?;
    let batched = matches!(req.prompt, crate::api::Prompts::Many(_));
    let mut prompts = Vec::new();
    for (i, p) in req.prompts().into_iter().enumerate() {
        let field = if batched { format!("prompt[{i}]") } else { "prompt".into() };
        let ids = match p {
            Prompt::Ids(ids) => ids.clone(),
            Prompt::Text(text) => s.tokenize(&field, text)?,
        };
        prompts.push(check_ids(&field, &ids, sampling.max_new_tokens, &s.limits)?);
    }
    let id = s.id("cmpl-");
    let outs = s.submit_batch(&prompts, n, &sampling, &id).await?;
    let usage = usage(&outs);
    let token = |t: u32| if req.return_tokens_as_token_ids { format!("token_id:{t}") } else { s.detokenize(&[t]) };
    let mut choices = Vec::with_capacity(outs.len());
    for (index, out) in outs.into_iter().enumerate() {
        let logprobs = req.logprobs.map(|k| {
            let tokens: Vec<String> = out.tokens.iter().map(|&t| token(t)).collect();
            let top = (k == 0).then(|| {
                tokens.iter().zip(&out.logprobs).map(|(t, &l)| std::iter::once((t.clone(), l)).collect()).collect()
            });
            ChoiceLogprobs { tokens, token_logprobs: out.logprobs.clone(), top_logprobs: top }
        });
        choices.push(Choice {
            index,
            text: s.detokenize(&out.tokens),
            finish_reason: finish_kind(out.reason).into(),
            logprobs,
            prompt_token_ids: req.return_token_ids.then(|| prompts[index / n].clone()),
            token_ids: req.return_token_ids.then_some(out.tokens),
        });
    }
    Ok(CompletionResponse {
        id,
        object: "text_completion".into(),
        created: unix_seconds(),
        model: s.answer_model(req.options.model.as_deref()),
        choices,
        usage,
    })
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

async fn health() -> StatusCode {
    StatusCode::OK
}

/// How long `/health_generate` waits for the engine thread before it answers 503.
const HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Healthy when the engine thread answers: decoding one token of a one-token prompt when idle, at once (SGLang's
/// behaviour) when it is busy, paused or updating, so that the check never queues behind the load.
async fn health_generate(State(s): State<Arc<AppState>>) -> Response {
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

async fn model_info(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"model_path": s.model_name, "tokenizer_path": s.model_name, "is_generation": true,
        "weight_version": &*s.stats.version()}))
}

/// The server arguments, and what changes: the weights' version.
async fn server_info(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let mut info = s.server_args.clone();
    if let Some(map) = info.as_object_mut() {
        map.insert("weight_version".into(), json!(&*s.stats.version()));
    }
    Json(info)
}

async fn models(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
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
/// `max_total_num_tokens` is what the caches may hold at most (`max_running` requests of a full context), and
/// `token_usage` their ratio. SGLang's fields this server does not measure (`num_total_tokens`, `gen_throughput`,
/// `cache_hit_rate`, `utilization`, the optional sections) are left out, as SGLang leaves out unset ones.
async fn loads(State(s): State<Arc<AppState>>, query: Result<Query<LoadsQuery>, QueryRejection>) -> Response {
    let q = match query {
        Ok(Query(q)) => q,
        Err(r) => return crate::api::invalid("query", r.body_text()).into_response(),
    };
    if q.dp_rank.as_deref().is_some_and(|r| r.trim() != "0") {
        return crate::api::invalid("dp_rank", "this server has one data-parallel rank, 0").into_response();
    }
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (running, waiting, used) = (get(&s.stats.running), get(&s.stats.waiting), get(&s.stats.live_tokens));
    let capacity = s.max_running.saturating_mul(s.limits.context) as u64;
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
async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.stats.prometheus()).into_response()
}
