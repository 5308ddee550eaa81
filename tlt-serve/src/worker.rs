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
    Drafter, Engine, FinishReason, Finished, GroupId, NgramDrafter, Plan, RequestId, SamplingParams, SpecParams,
};
use tokio::sync::oneshot;

use crate::api::Sampling;
use crate::drafter::{EagleConfig, OnlineDrafter};
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

/// New weights for the engine thread.
#[derive(Debug)]
pub struct Update {
    /// The model (already loaded, off the engine thread; same architecture as the served one).
    pub model: Llama,
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

/// How the engine thread decodes: TLT's adaptive rollout. Each lane's rounds go through a
/// [`tlt_scheduler::AdaptiveDecoder`]: the SD gate sees the lane's live batch before every round and turns
/// speculation on once it has shrunk (the long tail), off when it grows again; in the speculative phase the bandit
/// picks the draft plan for the batch's bucket, rewarded with the round's committed tokens per second.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// Speculate where the gate lets it (prompt-lookup n-grams, or the online EAGLE drafter with
    /// [`DecodeConfig::eagle`]); off: plain decoding always.
    pub speculate: bool,
    /// When to speculate. Default TLT's: on once the batch has been at most 32 for 10 rounds, off above 48.
    pub gate: tlt_scheduler::GateConfig,
    /// The draft plans to choose from. Default: one chain of 4 drafts (5 tokens verified).
    pub mab: tlt_scheduler::MabConfig,
    /// Most requests decoding at once, all engines together (SGLang's `--max-running-requests`); more wait in a
    /// queue, so the KV caches stay bounded however many clients connect. Default 256.
    pub max_running: usize,
    /// Draft with TLT's online EAGLE-2 drafter (trained on the served requests' hidden states) instead of n-grams.
    pub eagle: Option<EagleConfig>,
    /// Tests only (no flag sets it): the engine thread panics when it admits a request with this `rid`, so that
    /// tests can see what a dead engine thread answers.
    #[doc(hidden)]
    pub panic_on_rid: Option<String>,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            speculate: true,
            gate: tlt_scheduler::GateConfig::default(),
            mab: tlt_scheduler::MabConfig {
                arms: vec![Plan { steps: 4, top_k: 1, verify_tokens: 5 }],
                thresholds: vec![1],
                ..tlt_scheduler::MabConfig::default()
            },
            max_running: 256,
            eagle: None,
            panic_on_rid: None,
        }
    }
}

impl DecodeConfig {
    /// Speculation in every round, whatever the batch (no gate): for tests and for measuring SD at any batch.
    pub fn always_speculate() -> Self {
        let gate =
            tlt_scheduler::GateConfig { threshold: usize::MAX, on_after: 1, off_threshold: usize::MAX, off_after: 1 };
        Self { gate, ..Self::default() }
    }

    /// A fresh decoder for a lane.
    ///
    /// # Errors
    /// [`Error::Engine`] when the gate or bandit settings are invalid.
    pub fn decoder(&self) -> Result<tlt_scheduler::AdaptiveDecoder> {
        let decoder = if self.speculate {
            tlt_scheduler::AdaptiveDecoder::new(self.gate.clone(), self.mab.clone())
        } else {
            tlt_scheduler::AdaptiveDecoder::plain()
        };
        decoder.map_err(|e| Error::Engine(e.to_string()))
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
}

/// One engine and its requests' reply channels.
struct Lane {
    key: Key,
    engine: Engine<Arc<Llama>>,
    drafter: Option<Box<dyn Drafter>>,
    decoder: tlt_scheduler::AdaptiveDecoder,
    pending: HashMap<RequestId, Pending>,
}

impl Lane {
    fn new(
        model: Arc<Llama>,
        s: &Sampling,
        cfg: &DecodeConfig,
        eagle: Option<&OnlineDrafter>,
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
        let mut engine = Engine::new(model, params).map_err(|e| Error::Engine(e.to_string()))?;
        if !s.stop_strings.is_empty() {
            let tok = tokenizer.ok_or_else(|| Error::Engine("stop strings without a tokenizer".into()))?;
            engine = engine.with_decoder(Box::new(SharedTokenizer(tok.clone())));
        }
        // The online drafter trains on the target's hidden states of what this engine decodes.
        engine.record_hidden(eagle.is_some());
        let drafter: Option<Box<dyn Drafter>> = match (cfg.speculate, eagle) {
            (false, _) => None,
            (true, Some(d)) => Some(Box::new(d.proposer())),
            (true, None) => Some(Box::new(NgramDrafter::default())),
        };
        Ok(Self { key: Key::of(s), engine, drafter, decoder: cfg.decoder()?, pending: HashMap::new() })
    }

    /// One round; the requests it finished go back to their handlers. On an engine error every request of the lane
    /// gets it, and the lane is to be dropped (returns false).
    fn round(&mut self, stats: &Stats, eagle: Option<&OnlineDrafter>) -> bool {
        let drafter = self.drafter.as_deref_mut();
        let before = self.engine.counters().seq_rounds;
        let stepped = self.decoder.step(&mut self.engine, drafter);
        // The decisions are the gate's and the bandit's to keep; the trace would only grow.
        let _ = self.decoder.drain_trace();
        if let Ok(tlt_scheduler::Phase::Speculative) = stepped {
            Stats::add(&stats.sd_rounds, 1);
        }
        if let Err(e) = stepped {
            Stats::sub(&stats.running, self.pending.len() as u64);
            Stats::add(&stats.failed, self.pending.len() as u64);
            for (_, p) in self.pending.drain() {
                let _ = p.reply.send(Err(Error::Engine(e.to_string())));
            }
            return false;
        }
        Stats::add(&stats.rounds, 1);
        Stats::add(&stats.request_rounds, self.engine.counters().seq_rounds.saturating_sub(before));
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
            Stats::sub(&stats.running, 1);
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
                        Stats::sub(&stats.running, 1);
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
struct Worker<'c> {
    model: Arc<Llama>,
    cfg: &'c DecodeConfig,
    stats: &'c Stats,
    lanes: Vec<Lane>,
    /// Requests received and not yet admitted: beyond `max_running`, or held while an update waits for the running
    /// ones to finish.
    held: VecDeque<Job>,
    /// A pending update and how many requests it aborted.
    update: Option<(Box<Update>, usize)>,
    paused: bool,
    /// TLT's online EAGLE drafter, when the server drafts with it.
    eagle: Option<OnlineDrafter>,
    /// The model's tokenizer (stop strings are matched in its decoding).
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
}

/// The engine thread's loop: until every sender of `msgs` is gone and nothing runs; then the online drafter (`eagle`,
/// drafting for every engine when given) is checkpointed. `tokenizer` matches stop strings.
pub fn run(
    model: Llama,
    msgs: &mpsc::Receiver<Msg>,
    cfg: &DecodeConfig,
    stats: &Stats,
    eagle: Option<OnlineDrafter>,
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
) {
    let mut w = Worker {
        model: Arc::new(model),
        cfg,
        stats,
        lanes: Vec::new(),
        held: VecDeque::new(),
        update: None,
        paused: false,
        eagle,
        tokenizer,
    };
    loop {
        let live: usize = w.lanes.iter().map(|l| l.engine.live_tokens()).sum();
        stats.live_tokens.store(live as u64, Ordering::Relaxed);
        let first = if w.running() > 0 || w.update.is_some() || !w.held.is_empty() {
            None
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
        w.lanes.retain(|l| !l.engine.is_idle() || !l.pending.is_empty());
        let running = w.running();
        if let Some(d) = w.eagle.as_mut() {
            d.on_round(running);
        }
    }
    if let Some(Err(e)) = w.eagle.as_ref().map(OnlineDrafter::save) {
        tracing::error!(error = %e, "checkpointing the online drafter at shutdown");
    }
}

impl Worker<'_> {
    fn running(&self) -> usize {
        self.lanes.iter().map(|l| l.engine.num_live()).sum()
    }

    fn handle(&mut self, m: Msg) {
        match m {
            // Admitted by `admit_held`; counted as waiting until then.
            Msg::Job(job) => self.held.push_back(job),
            Msg::Abort { rid, reply } => {
                let which = |p: Option<&String>| rid.is_none() || p == rid.as_ref();
                let n = self.abort_running(|p| which(p.rid.as_ref())) + self.abort_held(|j| which(j.rid.as_ref()));
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
                self.paused = false;
                self.stats.paused.store(false, Ordering::Relaxed);
            }
            Msg::Update(u) => self.begin_update(u),
        }
    }

    fn begin_update(&mut self, u: Box<Update>) {
        if self.update.is_some() {
            let _ = u.reply.send(Err(Error::Busy("another weight update is in progress".into())));
            return;
        }
        if !u.model.config().same_architecture(self.model.config()) {
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
        // Engines hold the old model; idle lanes go with it.
        self.lanes.clear();
        let Update { model, version, reply, .. } = *u;
        self.model = Arc::new(model);
        if let Some(d) = self.eagle.as_mut() {
            if let Err(e) = d.retarget(&self.model) {
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

    /// Admits held requests, oldest first, while no update waits and fewer than `max_running` run (the bound on the
    /// engines' caches: past it, a request costs its queue entry only). A request whose client went away while it
    /// waited is dropped.
    fn admit_held(&mut self) {
        while self.update.is_none() && self.running() < self.cfg.max_running {
            let Some(job) = self.held.pop_front() else { break };
            Stats::sub(&self.stats.waiting, 1);
            if job.reply.is_closed() {
                Stats::add(&self.stats.aborted, 1);
                continue;
            }
            self.admit(job);
        }
    }

    /// Ends the waiting requests `which` picks (they answer `abort` with no tokens); returns how many.
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
    fn admit(&mut self, job: Job) {
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
            None => match Lane::new(
                self.model.clone(),
                &job.sampling,
                self.cfg,
                self.eagle.as_ref(),
                self.tokenizer.as_ref(),
            ) {
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
                let progress = job.progress.map(|tx| (tx, 0));
                lane.pending.insert(id, Pending { rid: job.rid, reply: job.reply, progress });
            }
            Err(e) => {
                Stats::add(&stats.failed, 1);
                let _ = job.reply.send(Err(Error::Engine(e.to_string())));
            }
        }
    }
}
