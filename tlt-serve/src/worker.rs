//! The engine thread: continuous batching over `tlt_spec_decode::Engine`. Requests arrive on a channel and join the
//! running batch at the next round boundary; every round runs one batched target forward (speculative, with the
//! drafter, when SD is on) and hands finished requests back to their HTTP handlers. Requests with the same sampling
//! (temperature, top-p, top-k, stop tokens; a seed only picks a request's coin stream) share one engine; each distinct sampling has its own, and the
//! engines take rounds in turn.
//!
//! Control messages share the channel and act between rounds: aborts (by request id, or all), pauses (in place, or
//! aborting what runs, SGLang's default) and weight updates. An update never mixes versions inside a response: it
//! holds new requests back, lets the running ones finish on the old weights (or aborts them, when asked), swaps the
//! model while nothing runs, then admits the held requests on the new weights. A request whose client went away is
//! aborted at the next round boundary.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use tlt_model::Llama;
use tlt_spec_decode::{
    Drafter, Engine, FinishReason, Finished, GroupId, RequestId, SamplingParams, SpecParams, Target,
};
use tokio::sync::oneshot;

use crate::api::Sampling;
use crate::backend::Backend;
pub use crate::decode::DecodeConfig;
use crate::drafter::OnlineDrafter;
use crate::stats::Stats;
use crate::{Error, Result};

/// A message for the engine thread.
#[derive(Debug)]
pub enum Msg {
    /// A request to decode.
    Job(Job),
    /// End the requests with this SGLang `rid` (every request when `None`), waiting or running; they answer with
    /// what they generated and finish reason `abort`. Replies how many were ended.
    Abort {
        /// The request id, or every request.
        rid: Option<String>,
        /// How many were ended.
        reply: oneshot::Sender<usize>,
    },
    /// Stop running rounds until [`Msg::Continue`]; with `abort`, the running requests end first (SGLang's default
    /// mode), else they stay where they are (`in_place`). Replies how many were aborted.
    Pause {
        /// Abort what runs.
        abort: bool,
        /// How many were aborted.
        reply: oneshot::Sender<usize>,
    },
    /// Run rounds again.
    Continue,
    /// Whether SGLang's `/flush_cache` may succeed: nothing waits or runs and no update waits.
    Flush {
        /// The answer.
        reply: oneshot::Sender<bool>,
    },
    /// `/health_generate`: answered at once (with no tokens) when the engine is busy, paused or updating, since the
    /// engine thread answering proves it alive; decoded (its one token) when idle.
    Health(Job),
    /// Swap in new weights (see the module docs).
    Update(Box<Update>),
}

/// What an update brings.
#[derive(Debug)]
pub enum Weights {
    /// A whole model (loaded off the engine thread; same architecture as the served one).
    Model(Box<Llama>),
    /// Tensors by HF name, laid over the served weights (a bucket of a distributed update).
    Tensors(Vec<(String, candle_core::Tensor)>),
}

/// New weights for the engine thread.
#[derive(Debug)]
pub struct Update {
    /// The weights.
    pub model: Weights,
    /// Its version, reported in every response decoded with it.
    pub version: String,
    /// End the running requests now (they answer with finish reason `abort`) instead of letting them finish.
    pub abort_running: bool,
    /// Answers with the number of requests aborted once the new weights serve, or why not.
    pub reply: oneshot::Sender<Result<usize>>,
}

/// A request for the engine thread.
#[derive(Debug)]
pub struct Job {
    /// The client's request id (SGLang's `rid`), for `/abort_request`.
    pub rid: Option<String>,
    /// Prompt token ids (checked against the vocabulary and context).
    pub prompt: Vec<u32>,
    /// Sampling (validated).
    pub sampling: Sampling,
    /// Where the output goes.
    pub reply: oneshot::Sender<Result<Output>>,
    /// Streaming: where the tokens each round committed go (with their log-probs), before the output; closed when
    /// the request ends.
    pub progress: Option<tokio::sync::mpsc::UnboundedSender<Progress>>,
}

/// Tokens a round committed for a streaming request.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// The new tokens.
    pub tokens: Vec<u32>,
    /// Their log-probs.
    pub logprobs: Vec<f32>,
    /// The version of the weights decoding it.
    pub weight_version: Arc<str>,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (a stop token, if any, last).
    pub tokens: Vec<u32>,
    /// The target's log-probability of each generated token at the sampling temperature (1 when greedy), without
    /// top-k/top-p, from the pass that committed it (the verify pass under SD).
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub reason: FinishReason,
    /// Its speculative rounds.
    pub spec_rounds: usize,
    /// Drafted tokens accepted over its speculative rounds.
    pub spec_accepted: usize,
    /// Drafted tokens verified over its speculative rounds.
    pub spec_drafted: usize,
    /// The version of the weights every one of its tokens was decoded with.
    pub weight_version: Arc<str>,
}

impl Output {
    /// An output with no tokens yet (a stream's start) or ever (a request ended before it was admitted).
    pub fn empty(prompt_tokens: usize, reason: FinishReason, weight_version: Arc<str>) -> Self {
        Self {
            prompt_tokens,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            reason,
            spec_rounds: 0,
            spec_accepted: 0,
            spec_drafted: 0,
            weight_version,
        }
    }

    /// An output for a request ended before it was admitted.
    fn aborted_unadmitted(job: &Job, version: Arc<str>) -> Self {
        Self::empty(job.prompt.len(), FinishReason::Abort, version)
    }
}

/// Requests that share an engine: same sampling, same stop tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    temperature: u32,
    top_p: Option<u32>,
    top_k: Option<usize>,
    stop: Option<Vec<u32>>,
    stop_strings: Vec<String>,
}

impl Key {
    fn of(s: &Sampling) -> Self {
        Self {
            temperature: s.temperature.to_bits(),
            top_p: s.top_p.map(f32::to_bits),
            top_k: s.top_k,
            stop: s.stop_token_ids.clone(),
            stop_strings: s.stop_strings.clone(),
        }
    }
}

impl Key {
    /// The sampling, for reports.
    fn name(&self) -> String {
        let f = |bits: u32| f32::from_bits(bits);
        format!(
            "temperature={} top_p={:?} top_k={:?} stop={:?} stop_strings={:?}",
            f(self.temperature),
            self.top_p.map(f),
            self.top_k,
            self.stop,
            self.stop_strings
        )
    }
}

/// The server's tokenizer, shared, as the engine's stop-string decoder (special tokens skipped).
#[derive(Debug)]
struct SharedTokenizer(Arc<tokenizers::Tokenizer>);

impl tlt_spec_decode::TokenDecoder for SharedTokenizer {
    fn decode(&self, tokens: &[u32]) -> tlt_spec_decode::Result<String> {
        // tlt-spec-decode's own decoding for a tokenizer (special tokens skipped).
        tlt_spec_decode::TokenDecoder::decode(&*self.0, tokens)
    }
}

/// A running request's handler.
struct Pending {
    rid: Option<String>,
    reply: oneshot::Sender<Result<Output>>,
    /// Streaming: the channel, and how many tokens went out on it.
    progress: Option<(tokio::sync::mpsc::UnboundedSender<Progress>, usize)>,
    /// Tokens of the KV pool it holds (its prompt and `max_new_tokens`).
    reserved: u64,
}

impl Pending {
    /// Gives the request's tokens back to the pool and counts it as no longer running.
    fn release(&self, stats: &Stats) {
        Stats::sub(&stats.running, 1);
        Stats::sub(&stats.reserved_tokens, self.reserved);
    }
}

/// One engine and its requests' reply channels.
struct Lane<T: Target> {
    key: Key,
    engine: Engine<T>,
    drafter: Option<Box<dyn Drafter>>,
    decoder: tlt_scheduler::AdaptiveDecoder,
    pending: HashMap<RequestId, Pending>,
}

impl<T: Target> Lane<T> {
    /// A lane over `target` for requests sampled as `s`, with `decoder` (a fresh one, or the one a lane of the same
    /// sampling left: the gate and the bandit keep what they learned).
    fn new(
        target: T,
        s: &Sampling,
        cfg: &DecodeConfig,
        decoder: tlt_scheduler::AdaptiveDecoder,
        eagle: Option<&OnlineDrafter>,
        exec: Option<&crate::drafter::DeviceExec>,
        tokenizer: Option<&Arc<tokenizers::Tokenizer>>,
    ) -> Result<Self> {
        let params = SpecParams {
            sampling: SamplingParams { temperature: s.temperature, top_k: s.top_k, top_p: s.top_p },
            max_new_tokens: s.max_new_tokens,
            stop_token_ids: s.stop_token_ids.clone(),
            stop: s.stop_strings.clone(),
            // One seed for every engine: a request's own seed chose its coin stream.
            seed: 0,
        };
        let mut engine = Engine::new(target, params).map_err(|e| Error::Engine(e.to_string()))?;
        if !s.stop_strings.is_empty() {
            let tok = tokenizer.ok_or_else(|| Error::Engine("stop strings without a tokenizer".into()))?;
            engine = engine.with_decoder(Box::new(SharedTokenizer(tok.clone())));
        }
        // The online drafter trains on the target's hidden states of what this engine decodes.
        engine.record_hidden(eagle.is_some());
        let drafter = cfg.drafter_on(eagle, exec)?;
        Ok(Self { key: Key::of(s), engine, drafter, decoder, pending: HashMap::new() })
    }

    /// One round; the requests it finished go back to their handlers. On an engine error every request of the lane
    /// gets it, and the lane is to be dropped (returns false).
    fn round(&mut self, stats: &Stats, eagle: Option<&OnlineDrafter>) -> bool {
        let drafter = self.drafter.as_deref_mut();
        let before = *self.engine.counters();
        let stepped = self.decoder.step(&mut self.engine, drafter);
        // The decisions are the gate's and the bandit's to keep; the trace would only grow.
        let _ = self.decoder.drain_trace();
        if let Ok(tlt_scheduler::Phase::Speculative) = stepped {
            Stats::add(&stats.sd_rounds, 1);
            let after = self.engine.counters();
            stats.record_accept(after.seq_rounds - before.seq_rounds, after.committed - before.committed);
        }
        // The bandit learns in the gate's speculative phase, from its plain arm's rounds too.
        if self.decoder.gate().phase() == tlt_scheduler::Phase::Speculative {
            let leaders = crate::decode::bandit_leaders(self.decoder.mab());
            stats.bandit.lock().insert(self.key.name(), serde_json::Value::Array(leaders));
        }
        if let Err(e) = stepped {
            Stats::add(&stats.failed, self.pending.len() as u64);
            for (_, p) in self.pending.drain() {
                p.release(stats);
                let _ = p.reply.send(Err(Error::Engine(e.to_string())));
            }
            return false;
        }
        Stats::add(&stats.rounds, 1);
        Stats::add(&stats.request_rounds, self.engine.counters().seq_rounds.saturating_sub(before.seq_rounds));
        self.stream_progress(stats);
        self.answer_finished(stats, eagle);
        true
    }

    /// Sends streaming requests that are still live the tokens committed since the last send.
    fn stream_progress(&mut self, stats: &Stats) {
        let version = stats.version();
        for (&id, p) in &mut self.pending {
            let Some((tx, sent)) = p.progress.as_mut() else { continue };
            let Some((tokens, logprobs)) = self.engine.progress(id) else { continue };
            if tokens.len() > *sent {
                let _ = tx.send(Progress {
                    tokens: tokens[*sent..].to_vec(),
                    logprobs: logprobs[*sent..].to_vec(),
                    weight_version: version.clone(),
                });
                *sent = tokens.len();
            }
        }
    }

    /// Sends every finished request its output; the online drafter keeps its hidden states as training data.
    fn answer_finished(&mut self, stats: &Stats, eagle: Option<&OnlineDrafter>) {
        let version = stats.version();
        for mut f in self.engine.take_finished() {
            if let Some(d) = eagle {
                if let Err(e) = d.observe(&f) {
                    tracing::warn!(error = %e, "the online drafter could not take a finished request");
                }
            }
            f.hidden = None;
            let Some(p) = self.pending.remove(&f.id) else { continue };
            p.release(stats);
            let out = output(f, version.clone(), stats);
            let _ = p.reply.send(Ok(out));
        }
    }

    /// Aborts the running requests `which` picks; they answer with what they generated. Returns how many.
    fn abort_where(&mut self, stats: &Stats, eagle: Option<&OnlineDrafter>, which: impl Fn(&Pending) -> bool) -> usize {
        let ids: Vec<RequestId> = self.pending.iter().filter(|(_, p)| which(p)).map(|(&id, _)| id).collect();
        let mut n = 0;
        for id in ids {
            match self.engine.abort(id, self.drafter.as_deref_mut()) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    if let Some(p) = self.pending.remove(&id) {
                        p.release(stats);
                        Stats::add(&stats.failed, 1);
                        let _ = p.reply.send(Err(Error::Engine(e.to_string())));
                    }
                }
            }
        }
        self.answer_finished(stats, eagle);
        n
    }
}

/// A prompt's group id.
fn prompt_hash(prompt: &[u32]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prompt.hash(&mut h);
    // Below 2^63, so that the engine's next group id never overflows.
    h.finish() >> 1
}

/// A finished request's output, counted.
fn output(f: Finished, weight_version: Arc<str>, stats: &Stats) -> Output {
    let spec_accepted: usize = f.sd_rounds.iter().map(|&(_, n)| n.saturating_sub(1) as usize).sum();
    let done = if f.reason == FinishReason::Abort { &stats.aborted } else { &stats.finished };
    Stats::add(done, 1);
    Stats::add(&stats.prompt_tokens, f.prompt.len() as u64);
    Stats::add(&stats.generated_tokens, f.tokens.len() as u64);
    Stats::add(&stats.spec_rounds, f.sd_rounds.len() as u64);
    Stats::add(&stats.spec_accepted, spec_accepted as u64);
    Output {
        prompt_tokens: f.prompt.len(),
        spec_rounds: f.sd_rounds.len(),
        spec_accepted,
        spec_drafted: f.draft_tokens as usize,
        reason: f.reason,
        logprobs: f.logprobs,
        tokens: f.tokens,
        weight_version,
    }
}

/// How long a paused engine thread sleeps between looks at its queue.
const PAUSED_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// The engine thread's state.
struct Worker<'c, B: Backend> {
    backend: B,
    cfg: &'c DecodeConfig,
    stats: &'c Stats,
    lanes: Vec<Lane<B::Target>>,
    /// The decoders of lanes gone idle or dropped for a weight update, newest last (at most [`KEPT_DECODERS`]): a
    /// new lane of the same sampling continues with its gate and bandit.
    kept: VecDeque<(Key, tlt_scheduler::AdaptiveDecoder)>,
    /// Requests received and not yet admitted: beyond `max_running`, or held while an update waits for the running
    /// ones to finish.
    held: VecDeque<Job>,
    /// Requests that arrived while paused, admitted after the continue (not counted by a flush).
    parked: VecDeque<Job>,
    /// A pending update and how many requests it aborted.
    update: Option<(Box<Update>, usize)>,
    paused: bool,
    /// TLT's online EAGLE drafter, when the server drafts with it.
    eagle: Option<OnlineDrafter>,
    /// The model's tokenizer (stop strings are matched in its decoding).
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// On a device, the EAGLE drafter's forward there, shared by the engines' proposers.
    device_drafter: Option<crate::drafter::DeviceExec>,
}

/// Samplings whose gate and bandit the engine thread keeps while no request of theirs runs.
const KEPT_DECODERS: usize = 64;

/// The engine thread's loop on `backend`: until every sender of `msgs` is gone and nothing runs; then the online
/// drafter (`eagle`, drafting for every engine when given) is checkpointed. `tokenizer` matches stop strings.
pub fn run<B: Backend>(
    backend: B,
    msgs: &mpsc::Receiver<Msg>,
    cfg: &DecodeConfig,
    stats: &Stats,
    eagle: Option<OnlineDrafter>,
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
) {
    let pool = backend.pool();
    stats.pool_tokens.store(pool.tokens as u64, Ordering::Relaxed);
    // The drafter's forward beside the target's on a device (as the trainer's rollouts draft there); on failure
    // it drafts on the host.
    let device_drafter = match (eagle.is_some() && cfg.speculate, backend.device_slots()) {
        (true, Some((gpu, slots, max_len))) => {
            let opts = tlt_drafter::cuda::CudaDraftOptions { slots, max_len };
            match tlt_drafter::cuda::CudaDrafter::new(gpu, opts) {
                Ok(d) => {
                    stats.drafter.on_device.store(1, Ordering::Relaxed);
                    Some(Arc::new(parking_lot::Mutex::new(d)))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the EAGLE drafter drafts on the host: its device cache failed");
                    None
                }
            }
        }
        _ => None,
    };
    let mut w = Worker {
        backend,
        cfg,
        stats,
        lanes: Vec::new(),
        kept: VecDeque::new(),
        held: VecDeque::new(),
        parked: VecDeque::new(),
        update: None,
        paused: false,
        eagle,
        tokenizer,
        device_drafter,
    };
    loop {
        let live: usize = w.lanes.iter().map(|l| l.engine.live_tokens()).sum();
        stats.live_tokens.store(live as u64, Ordering::Relaxed);
        let first = if w.running() > 0 || w.update.is_some() || !w.held.is_empty() {
            None
        } else if w.eagle.as_ref().is_some_and(OnlineDrafter::trains_when_idle) {
            // Idle with a drafter to train on the device: a step per pass, messages between them.
            match msgs.try_recv() {
                Ok(m) => Some(m),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else {
            match msgs.recv() {
                Ok(m) => Some(m),
                Err(_) => break,
            }
        };
        for m in first.into_iter().chain(msgs.try_iter()) {
            w.handle(m);
        }
        w.abort_gone();
        w.apply_update();
        w.admit_held();
        if w.paused {
            std::thread::sleep(PAUSED_POLL);
            continue;
        }
        let eagle = w.eagle.as_ref();
        w.lanes.retain_mut(|l| l.engine.is_idle() || l.round(stats, eagle));
        w.keep_idle_decoders();
        let running = w.running();
        if let Some(d) = w.eagle.as_mut() {
            d.on_round(running);
        }
    }
    if let Some(Err(e)) = w.eagle.as_mut().map(OnlineDrafter::save) {
        tracing::error!(error = %e, "checkpointing the online drafter at shutdown");
    }
}

impl<B: Backend> Worker<'_, B> {
    fn running(&self) -> usize {
        self.lanes.iter().map(|l| l.engine.num_live()).sum()
    }

    /// Drops the idle lanes (`all`: every lane, for a weight update), keeping their decoders.
    fn drop_lanes(&mut self, all: bool) {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.lanes)
            .into_iter()
            .partition(|l| all || (l.engine.is_idle() && l.pending.is_empty()));
        self.lanes = kept;
        for lane in gone {
            self.kept.retain(|(k, _)| *k != lane.key);
            if self.kept.len() == KEPT_DECODERS {
                self.kept.pop_front();
            }
            self.kept.push_back((lane.key, lane.decoder));
        }
    }

    fn keep_idle_decoders(&mut self) {
        if self.lanes.iter().any(|l| l.engine.is_idle() && l.pending.is_empty()) {
            self.drop_lanes(false);
        }
    }

    /// The decoder for a new lane of sampling `key`: the one a lane of it left, else a fresh one.
    fn decoder_for(&mut self, key: &Key) -> Result<tlt_scheduler::AdaptiveDecoder> {
        match self.kept.iter().position(|(k, _)| k == key).and_then(|i| self.kept.remove(i)) {
            Some((_, d)) => Ok(d),
            None => self.cfg.decoder(),
        }
    }

    fn handle(&mut self, m: Msg) {
        match m {
            // Admitted by `admit_held`; counted as waiting until then. While paused, parked until the continue (as
            // SGLang holds requests that arrive while paused before its scheduler, so they never block a flush).
            Msg::Job(job) if self.paused => self.parked.push_back(job),
            Msg::Job(job) => self.held.push_back(job),
            Msg::Abort { rid, reply } => {
                let which = |p: Option<&String>| rid.is_none() || p == rid.as_ref();
                let n = self.abort_running(|p| which(p.rid.as_ref())) + self.abort_waiting(|j| which(j.rid.as_ref()));
                let _ = reply.send(n);
            }
            Msg::Flush { reply } => {
                let quiet = self.running() == 0 && self.update.is_none() && self.held.is_empty();
                let _ = reply.send(quiet);
            }
            Msg::Health(job) => {
                if self.paused || self.running() > 0 || !self.held.is_empty() || self.update.is_some() {
                    Stats::sub(&self.stats.waiting, 1);
                    let _ =
                        job.reply.send(Ok(Output::empty(job.prompt.len(), FinishReason::Length, self.stats.version())));
                } else {
                    self.held.push_front(job);
                }
            }
            // SGLang's abort mode ends the queued requests too, not only the running ones.
            Msg::Pause { abort, reply } => {
                let n = if abort { self.abort_running(|_| true) + self.abort_held(|_| true) } else { 0 };
                self.paused = true;
                self.stats.paused.store(true, Ordering::Relaxed);
                let _ = reply.send(n);
            }
            Msg::Continue => {
                self.held.append(&mut self.parked);
                self.paused = false;
                self.stats.paused.store(false, Ordering::Relaxed);
            }
            Msg::Update(u) => self.begin_update(u),
        }
    }

    fn begin_update(&mut self, mut u: Box<Update>) {
        if self.update.is_some() {
            let _ = u.reply.send(Err(Error::Busy("another weight update is in progress".into())));
            return;
        }
        if let Weights::Tensors(t) = &mut u.model {
            match crate::distributed::overlay(self.backend.model(), std::mem::take(t)) {
                Ok(m) => u.model = Weights::Model(Box::new(m)),
                Err(e) => {
                    let _ = u.reply.send(Err(e));
                    return;
                }
            }
        }
        let Weights::Model(model) = &u.model else { return };
        if !model.config().same_architecture(self.backend.model().config()) {
            let _ = u.reply.send(Err(Error::Invalid {
                field: "model_path".into(),
                reason: "its config.json differs from the served model's: only weights can change".into(),
            }));
            return;
        }
        if self.paused && !u.abort_running && self.running() > 0 {
            let _ = u.reply.send(Err(Error::Busy(
                "requests are paused in place: continue them or set abort_all_requests, so that no response mixes \
                 two weight versions"
                    .into(),
            )));
            return;
        }
        let aborted = if u.abort_running { self.abort_running(|_| true) } else { 0 };
        self.update = Some((u, aborted));
    }

    /// Swaps the weights once nothing runs, then admits the requests held meanwhile.
    fn apply_update(&mut self) {
        if self.running() > 0 {
            return;
        }
        let Some((u, aborted)) = self.update.take() else { return };
        // Engines hold the old model; idle lanes go with it (their gates and bandits stay).
        self.drop_lanes(true);
        let Update { model, version, reply, .. } = *u;
        let Weights::Model(model) = model else {
            let _ = reply.send(Err(Error::Engine("an update's tensors were not laid over the weights".into())));
            return;
        };
        if let Err(e) = self.backend.update(*model) {
            tracing::error!(error = %e, "the weight update failed");
            let _ = reply.send(Err(e));
            return;
        }
        if let Some(d) = self.eagle.as_mut() {
            if let Err(e) = d.retarget(self.backend.model()) {
                tracing::error!(error = %e, "the online drafter after the weight update");
            }
        }
        match self.stats.weight_version.write() {
            Ok(mut v) => *v = version.as_str().into(),
            Err(p) => *p.into_inner() = version.as_str().into(),
        }
        Stats::add(&self.stats.weight_updates, 1);
        tracing::info!(%version, "weights updated");
        let _ = reply.send(Ok(aborted));
    }

    /// Admits held requests, oldest first, while no update waits, fewer than `max_running` run and the KV pool has
    /// room for the oldest one's prompt and `max_new_tokens` (a request never starts without the cache it may
    /// need; past the bounds it costs its queue entry only). A request whose client went away while it waited is
    /// dropped; one larger than the whole pool is refused.
    fn admit_held(&mut self) {
        let pool = self.backend.pool();
        while self.update.is_none() && self.running() < self.cfg.max_running.min(pool.sequences) {
            let Some(job) = self.held.front() else { break };
            let need = (job.prompt.len() + job.sampling.max_new_tokens) as u64;
            let closed = job.reply.is_closed();
            let reserved = self.stats.reserved_tokens.load(Ordering::Relaxed);
            if !closed && need <= pool.tokens as u64 && reserved + need > pool.tokens as u64 {
                break;
            }
            let Some(job) = self.held.pop_front() else { break };
            Stats::sub(&self.stats.waiting, 1);
            if closed {
                Stats::add(&self.stats.aborted, 1);
                continue;
            }
            if need > pool.tokens as u64 {
                Stats::add(&self.stats.failed, 1);
                let _ = job.reply.send(Err(Error::Invalid {
                    field: "max_new_tokens".into(),
                    reason: format!(
                        "the prompt and max_new_tokens need {need} tokens of the KV pool, which holds {}",
                        pool.tokens
                    ),
                }));
                continue;
            }
            self.admit(job, need);
        }
    }

    /// Ends the waiting requests `which` picks (they answer `abort` with no tokens); returns how many.
    /// Ends the held requests `which` selects, and the parked ones too.
    fn abort_waiting(&mut self, which: impl Fn(&Job) -> bool) -> usize {
        let parked = std::mem::take(&mut self.parked);
        let (gone, kept): (VecDeque<Job>, VecDeque<Job>) = parked.into_iter().partition(|j| which(j));
        self.parked = kept;
        self.held.extend(gone);
        self.abort_held(which)
    }

    fn abort_held(&mut self, which: impl Fn(&Job) -> bool) -> usize {
        let version = self.stats.version();
        let (gone, kept): (VecDeque<Job>, VecDeque<Job>) = self.held.drain(..).partition(|j| which(j));
        self.held = kept;
        let n = gone.len();
        Stats::sub(&self.stats.waiting, n as u64);
        Stats::add(&self.stats.aborted, n as u64);
        for job in gone {
            let out = Output::aborted_unadmitted(&job, version.clone());
            let _ = job.reply.send(Ok(out));
        }
        n
    }

    /// Aborts the running requests `which` picks; returns how many.
    fn abort_running(&mut self, which: impl Fn(&Pending) -> bool) -> usize {
        let (stats, eagle) = (self.stats, self.eagle.as_ref());
        self.lanes.iter_mut().map(|l| l.abort_where(stats, eagle, &which)).sum()
    }

    /// Aborts the requests whose handler is gone (the client disconnected).
    fn abort_gone(&mut self) {
        let n = self.abort_running(|p| p.reply.is_closed());
        if n > 0 {
            tracing::debug!(requests = n, "aborted requests whose clients went away");
        }
    }

    /// Adds `job` to the lane of its sampling (made when new); an error goes straight back to its handler.
    fn admit(&mut self, job: Job, need: u64) {
        if job.rid.is_some() && job.rid == self.cfg.panic_on_rid {
            #[allow(clippy::panic)] // The failpoint's purpose.
            {
                panic!("failpoint: a request with rid {:?} kills the engine thread", job.rid);
            }
        }
        let stats = self.stats;
        let key = Key::of(&job.sampling);
        let at = match self.lanes.iter().position(|l| l.key == key) {
            Some(i) => i,
            None => match self.decoder_for(&key).and_then(|decoder| {
                let target = self.backend.target();
                let (eagle, exec, tok) = (self.eagle.as_ref(), self.device_drafter.as_ref(), self.tokenizer.as_ref());
                Lane::new(target, &job.sampling, self.cfg, decoder, eagle, exec, tok)
            }) {
                Ok(lane) => {
                    self.lanes.push(lane);
                    self.lanes.len() - 1
                }
                Err(e) => {
                    Stats::add(&stats.failed, 1);
                    let _ = job.reply.send(Err(e));
                    return;
                }
            },
        };
        let lane = &mut self.lanes[at];
        // The request's coins are keyed by its own stream, not by its position in the lane.
        lane.engine.key_streams_from(job.sampling.stream);
        // Requests with the same prompt form one group: a live sibling's prefilled prompt is forked, not prefilled
        // again (a GRPO group sent as separate requests), and group drafters see them together. The group is the
        // prompt's hash; a collision only costs a prefill (the engine forks a member holding this exact prompt).
        let group = GroupId(prompt_hash(&job.prompt));
        let forks = lane.engine.counters().prefill_forks;
        let added = lane.engine.add_to_group(group, &job.prompt, 1, job.sampling.max_new_tokens);
        Stats::add(&stats.prefill_forks, lane.engine.counters().prefill_forks - forks);
        match added.map(|ids| ids[0]) {
            Ok(id) => {
                Stats::add(&stats.running, 1);
                Stats::add(&stats.reserved_tokens, need);
                let progress = job.progress.map(|tx| (tx, 0));
                lane.pending.insert(id, Pending { rid: job.rid, reply: job.reply, progress, reserved: need });
            }
            Err(e) => {
                Stats::add(&stats.failed, 1);
                let _ = job.reply.send(Err(Error::Engine(e.to_string())));
            }
        }
    }
}
