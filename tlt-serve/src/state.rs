//! What the HTTP handlers share: [`AppState`] (the engine thread's queue, the tokenizer, the limits, the counters)
//! and its helpers that queue requests and control messages. Every handler module imports it; it imports none of
//! them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use tokenizers::Tokenizer;
use tokio::sync::oneshot;

use crate::api::{Limits, Sampling};
use crate::stats::Stats;
use crate::worker::{Job, Msg, Output};
use crate::Error;

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
    pub guard: crate::guard_config::GuardConfig,
    /// The weight-update groups joined (`/init_weights_update_group`).
    pub groups: crate::distributed::Groups,
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
    pub(crate) fn send_reserved(
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

    pub(crate) fn detokenize(&self, ids: &[u32]) -> String {
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
