//! The engine thread: continuous batching over `tlt_spec_decode::Engine`. Requests arrive on a channel and join the
//! running batch at the next round boundary; every round runs one batched target forward (speculative, with the
//! drafter, when SD is on) and hands finished requests back to their HTTP handlers. Requests with the same sampling
//! (temperature, top-p, top-k, stop tokens, seed) share one engine; each distinct sampling has its own, and the
//! engines take rounds in turn.

use std::collections::HashMap;
use std::sync::mpsc;

use tlt_model::Llama;
use tlt_spec_decode::{Drafter, Engine, FinishReason, NgramDrafter, Plan, RequestId, SamplingParams, SpecParams};
use tokio::sync::oneshot;

use crate::api::Sampling;
use crate::stats::Stats;
use crate::{Error, Result};

/// A request for the engine thread.
#[derive(Debug)]
pub struct Job {
    /// Prompt token ids (checked against the vocabulary and context).
    pub prompt: Vec<u32>,
    /// Sampling (validated).
    pub sampling: Sampling,
    /// Where the output goes.
    pub reply: oneshot::Sender<Result<Output>>,
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
    /// Whether it ended on a stop token (else: length).
    pub stopped: bool,
    /// Its speculative rounds, and the drafted tokens they accepted.
    pub spec_rounds: usize,
    /// Drafted tokens accepted over its speculative rounds.
    pub spec_accepted: usize,
}

/// How the engine thread decodes.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// Speculate with the n-gram drafter (prompt lookup) on a chain of `plan.steps` drafts; off: plain decoding.
    pub speculate: bool,
    /// The draft plan when speculating.
    pub plan: Plan,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self { speculate: true, plan: Plan { steps: 4, top_k: 1, verify_tokens: 5 } }
    }
}

/// Requests that share an engine: same sampling, same stop tokens, same seed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    temperature: u32,
    top_p: Option<u32>,
    top_k: Option<usize>,
    stop: Option<Vec<u32>>,
    seed: u64,
}

impl Key {
    fn of(s: &Sampling) -> Self {
        Self {
            temperature: s.temperature.to_bits(),
            top_p: s.top_p.map(f32::to_bits),
            top_k: s.top_k,
            stop: s.stop_token_ids.clone(),
            seed: s.seed,
        }
    }
}

/// One engine and its requests' reply channels.
struct Lane<'m> {
    key: Key,
    engine: Engine<&'m Llama>,
    drafter: Option<NgramDrafter>,
    replies: HashMap<RequestId, oneshot::Sender<Result<Output>>>,
}

impl<'m> Lane<'m> {
    fn new(model: &'m Llama, s: &Sampling, cfg: &DecodeConfig) -> Result<Self> {
        let params = SpecParams {
            sampling: SamplingParams { temperature: s.temperature, top_k: s.top_k, top_p: s.top_p },
            max_new_tokens: s.max_new_tokens,
            stop_token_ids: s.stop_token_ids.clone(),
            stop: Vec::new(),
            seed: s.seed,
        };
        let engine = Engine::new(model, params).map_err(|e| Error::Engine(e.to_string()))?;
        Ok(Self {
            key: Key::of(s),
            engine,
            drafter: cfg.speculate.then(NgramDrafter::default),
            replies: HashMap::new(),
        })
    }

    /// One round; the requests it finished go back to their handlers. On an engine error every request of the lane
    /// gets it, and the lane is to be dropped (returns false).
    fn round(&mut self, plan: &Plan, stats: &Stats) -> bool {
        let drafter = self.drafter.as_mut().map(|d| d as &mut dyn Drafter);
        let plan = drafter.is_some().then_some(plan);
        let before = self.engine.counters().seq_rounds;
        if let Err(e) = self.engine.round(drafter, plan) {
            Stats::sub(&stats.running, self.replies.len() as u64);
            Stats::add(&stats.failed, self.replies.len() as u64);
            for (_, reply) in self.replies.drain() {
                let _ = reply.send(Err(Error::Engine(e.to_string())));
            }
            return false;
        }
        Stats::add(&stats.rounds, 1);
        Stats::add(&stats.request_rounds, self.engine.counters().seq_rounds.saturating_sub(before));
        for f in self.engine.take_finished() {
            let Some(reply) = self.replies.remove(&f.id) else { continue };
            let spec_accepted: usize = f.sd_rounds.iter().map(|&(_, n)| n.saturating_sub(1) as usize).sum();
            Stats::sub(&stats.running, 1);
            Stats::add(&stats.finished, 1);
            Stats::add(&stats.prompt_tokens, f.prompt.len() as u64);
            Stats::add(&stats.generated_tokens, f.tokens.len() as u64);
            Stats::add(&stats.spec_rounds, f.sd_rounds.len() as u64);
            Stats::add(&stats.spec_accepted, spec_accepted as u64);
            let _ = reply.send(Ok(Output {
                prompt_tokens: f.prompt.len(),
                spec_rounds: f.sd_rounds.len(),
                spec_accepted,
                stopped: f.reason != FinishReason::Length,
                logprobs: f.logprobs,
                tokens: f.tokens,
            }));
        }
        true
    }
}

/// How long a paused engine thread sleeps between looks at its queue and the pause switch.
const PAUSED_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// The engine thread's loop: until every sender of `jobs` is gone and nothing runs. While `stats.paused` it admits
/// requests but runs no round (`/pause_generation`): no request advances, none is lost.
pub fn run(model: &Llama, jobs: &mpsc::Receiver<Job>, cfg: &DecodeConfig, stats: &Stats) {
    let mut lanes: Vec<Lane<'_>> = Vec::new();
    loop {
        let busy = lanes.iter().any(|l| !l.engine.is_idle());
        let first = if busy {
            None
        } else {
            match jobs.recv() {
                Ok(job) => Some(job),
                Err(_) => return,
            }
        };
        for job in first.into_iter().chain(jobs.try_iter()) {
            admit(model, &mut lanes, job, cfg, stats);
        }
        if stats.paused.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(PAUSED_POLL);
            continue;
        }
        lanes.retain_mut(|l| l.engine.is_idle() || l.round(&cfg.plan, stats));
        lanes.retain(|l| !l.engine.is_idle() || !l.replies.is_empty());
    }
}

/// Adds `job` to the lane of its sampling (made when new); an error goes straight back to its handler.
fn admit<'m>(model: &'m Llama, lanes: &mut Vec<Lane<'m>>, job: Job, cfg: &DecodeConfig, stats: &Stats) {
    Stats::sub(&stats.waiting, 1);
    let key = Key::of(&job.sampling);
    let at = match lanes.iter().position(|l| l.key == key) {
        Some(i) => i,
        None => match Lane::new(model, &job.sampling, cfg) {
            Ok(lane) => {
                lanes.push(lane);
                lanes.len() - 1
            }
            Err(e) => {
                Stats::add(&stats.failed, 1);
                let _ = job.reply.send(Err(e));
                return;
            }
        },
    };
    let lane = &mut lanes[at];
    // The request's coins are keyed by its own stream, not by its position in the lane.
    lane.engine.key_streams_from(job.sampling.stream);
    match lane.engine.add_request_with_limit(&job.prompt, job.sampling.max_new_tokens) {
        Ok(id) => {
            Stats::add(&stats.running, 1);
            lane.replies.insert(id, job.reply);
        }
        Err(e) => {
            Stats::add(&stats.failed, 1);
            let _ = job.reply.send(Err(Error::Engine(e.to_string())));
        }
    }
}
