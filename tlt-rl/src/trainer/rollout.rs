//! One rollout: every prompt's group decoded by the engine (adaptive SD in TLT mode, plain in the baseline),
//! finished requests handed to the drafter as they finish.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tlt_drafter::online::FeatureSample;
use tlt_scheduler::{AdaptiveDecoder, AdmissionLimits, AdmissionQueue, DecodeTrace};
use tlt_spec_decode::{Counters, Engine, FinishReason, Finished, GroupId, SamplingParams, SpecParams, Target};

use super::drafter::RolloutDrafter;
use super::env::Prompt;
use super::types::Sample;
use crate::ceiling::SdCeiling;
use crate::{Error, Result};

/// Watches a rollout (progress bars, logs). Every method has a no-op default.
pub trait Observer {
    /// After each engine round: requests still running, finished so far, total, tokens generated so far.
    fn on_round(&mut self, _running: usize, _finished: usize, _total: usize, _tokens: usize) {}
    /// A phase of the RL step begins (`"rollout"`, `"reward"`, `"update"`, `"publish"`, `"checkpoint"`).
    fn on_phase(&mut self, _step: u64, _phase: &str) {}
}

/// An observer that does nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quiet;

impl Observer for Quiet {}

/// What a rollout produced.
#[derive(Debug, Clone)]
pub struct RolloutOutput {
    /// Samples, group-major (`group_size` consecutive samples per prompt).
    pub samples: Vec<Sample>,
    /// What the gate and the bandit did.
    pub trace: DecodeTrace,
    /// Engine counters.
    pub counters: Counters,
    /// Wall seconds of the decoding (fixed-schedule drafter steps after it not included).
    pub seconds: f64,
    /// Seconds the drafter trained during it (tail schedule) or right after it (fixed schedule).
    pub drafter_s: f64,
    /// The part of `drafter_s` after the decoding (fixed schedule).
    pub drafter_after_s: f64,
    /// How long stopping the drafter's background worker took.
    pub preempt_latency: Option<Duration>,
    /// Every finished request's tokens and hidden states as drafter training data, when the job asked for them
    /// (when the job records features; empty otherwise).
    pub features: Vec<Arc<FeatureSample>>,
    /// What the speculative rounds committed and what an argmax-chain drafter would have expected in the very
    /// same rounds.
    pub sd_ceiling: SdCeiling,
    /// Wall seconds from the start of the rollout to the end of each round (aligned with the trace's `active`):
    /// the running batch drawn against time, where rounds of different cost show as they ran.
    pub round_end_s: Vec<f64>,
    /// Whether each round speculated (aligned with `round_end_s`).
    pub round_sd: Vec<bool>,
}

impl RolloutOutput {
    /// Appends `other` (a later rollout of the same step, whose groups are numbered from 0) after this one, its
    /// groups renumbered from `group_offset`.
    pub(crate) fn append(&mut self, other: RolloutOutput, group_offset: usize) {
        self.samples.extend(other.samples.into_iter().map(|s| Sample { group: s.group + group_offset, ..s }));
        // A later rollout's clock starts where this one's decoding ended.
        let offset = self.seconds;
        self.round_end_s.extend(other.round_end_s.iter().map(|t| t + offset));
        self.round_sd.extend(other.round_sd);
        self.trace.append(other.trace);
        let (a, b) = (&mut self.counters, other.counters);
        a.rounds += b.rounds;
        a.seq_rounds += b.seq_rounds;
        a.drafted += b.drafted;
        a.accepted += b.accepted;
        a.committed += b.committed;
        a.draft_s += b.draft_s;
        a.forward_s += b.forward_s;
        a.verify_s += b.verify_s;
        a.commit_s += b.commit_s;
        a.prefill_s += b.prefill_s;
        a.prefill_tokens += b.prefill_tokens;
        a.prefill_forks += b.prefill_forks;
        self.seconds += other.seconds;
        self.drafter_s += other.drafter_s;
        self.drafter_after_s += other.drafter_after_s;
        self.preempt_latency = self.preempt_latency.max(other.preempt_latency);
        self.features.extend(other.features);
        self.sd_ceiling.merge(&other.sd_ceiling);
    }
}

/// The engine's sampling settings for a rollout at `temperature` / `top_p` with stream seed `seed`.
pub(crate) fn spec_params(temperature: f64, top_p: f64, max_new_tokens: usize, seed: u64) -> SpecParams {
    let sampling = if temperature == 0.0 {
        SamplingParams::greedy()
    } else {
        SamplingParams { temperature: temperature as f32, top_p: (top_p < 1.0).then_some(top_p as f32), top_k: None }
    };
    SpecParams { sampling, max_new_tokens, seed, ..SpecParams::default() }
}

/// What one rollout decodes: `group_size` samples of every prompt, engine settings `params`, during RL step
/// `rl_step`, admitted into the running batch within `limits` (continuous batching).
pub(crate) struct RolloutJob<'a> {
    pub limits: AdmissionLimits,
    pub prompts: &'a [Prompt],
    pub group_size: usize,
    pub params: SpecParams,
    pub rl_step: u64,
    /// Per prompt, the coin-stream key of its first sample (its siblings follow): the sample's index in the whole
    /// step when a data-parallel rank decodes a shard of it, so its tokens do not depend on the rank. `None`: the
    /// sample index in this job.
    pub stream_keys: Option<&'a [u64]>,
    /// Keep each finished request's hidden states as a [`FeatureSample`] in [`RolloutOutput::features`].
    pub record_features: bool,
    /// Called as each sample finishes, with its index (group-major, as in [`RolloutOutput::samples`]), its group
    /// and its tokens: the trainer scores answers while the rest decode.
    pub on_finish: Option<&'a mut OnFinish<'a>>,
    /// Called between rounds with the groups none of whose samples has started (queue order); the groups it
    /// returns leave the queue and the output (another data-parallel rank decodes them).
    pub give_away: Option<&'a mut GiveAway<'a>>,
}

/// A callback between rounds: given the groups not yet started, the ones to give away.
pub(crate) type GiveAway<'a> = dyn FnMut(&[usize]) -> Result<Vec<usize>> + 'a;

/// A callback on each finished sample: `(sample index, group, tokens)`.
pub(crate) type OnFinish<'a> = dyn FnMut(usize, usize, &[u32]) + 'a;

/// Runs `job` on `target` (the policy's inference copy: on the CPU, or a `CudaTarget`) with `decoder` (and `drafter`
/// in TLT mode).
pub(crate) fn run_rollout<T: Target>(
    target: T,
    job: RolloutJob,
    decoder: &mut AdaptiveDecoder,
    mut drafter: Option<&mut RolloutDrafter>,
    obs: &mut dyn Observer,
) -> Result<RolloutOutput> {
    let RolloutJob {
        limits,
        prompts,
        group_size,
        params,
        rl_step,
        stream_keys,
        record_features,
        mut on_finish,
        mut give_away,
    } = job;
    if stream_keys.is_some_and(|k| k.len() != prompts.len()) {
        return Err(Error::InvalidArgument("one stream key per prompt".into()));
    }
    let t0 = Instant::now();
    let mut engine = Engine::new(target, params)?;
    engine.record_hidden(record_features || drafter.as_ref().is_some_and(|d| d.needs_hidden()));
    let mut features = Vec::new();
    // Every sample waits in one FIFO queue (group-major) and enters the running batch when it fits. One engine
    // group per prompt: its prompt is prefilled once and forked to the siblings, and group drafters draft from the
    // siblings' tokens. Engine ids follow admission order, which is submission order: id = sample index.
    let mut queue = AdmissionQueue::new(limits).map_err(|e| Error::config("rollout limits", e.to_string()))?;
    for (g, p) in prompts.iter().enumerate() {
        for _ in 0..group_size {
            queue.submit(g, p.ids.len()).map_err(|e| Error::config("rollout limits", e.to_string()))?;
        }
    }
    let mut total = prompts.len() * group_size;
    let mut given = vec![false; prompts.len()];
    let max_new = engine.params().max_new_tokens;
    let mut owner: Vec<usize> = Vec::with_capacity(total);
    // Samples of each group admitted so far.
    let mut started = vec![0u64; prompts.len()];
    let admit = |engine: &mut Engine<T>,
                 owner: &mut Vec<usize>,
                 queue: &mut AdmissionQueue<usize>,
                 started: &mut [u64]|
     -> Result<()> {
        let admitted = queue.admit(engine.num_live());
        for run in admitted.chunk_by(|a, b| a == b) {
            let g = run[0];
            if let Some(keys) = stream_keys {
                engine.key_streams_from(keys[g] + started[g]);
            }
            started[g] += run.len() as u64;
            let ids = engine.add_to_group(GroupId(g as u64), &prompts[g].ids, run.len(), max_new)?;
            if ids.first().is_some_and(|id| id.0 != owner.len()) {
                return Err(Error::InvalidArgument("engine request ids are not dense".into()));
            }
            owner.extend(std::iter::repeat_n(g, ids.len()));
        }
        Ok(())
    };
    admit(&mut engine, &mut owner, &mut queue, &mut started)?;
    let mut proposer = drafter.as_ref().map(|d| d.proposer()).transpose()?;
    if let Some(d) = drafter.as_deref_mut() {
        d.begin_rollout(rl_step);
    }
    let mut done: Vec<Option<Finished>> = Vec::with_capacity(total);
    let mut sd_ceiling = SdCeiling::default();
    let (mut finished, mut tokens) = (0usize, 0usize);
    let (mut round_end_s, mut round_sd) = (Vec::new(), Vec::new());
    while !engine.is_idle() {
        let sd_before = decoder.trace().sd_steps;
        decoder.step(&mut engine, proposer.as_deref_mut())?;
        round_sd.push(decoder.trace().sd_steps > sd_before);
        for mut f in engine.take_finished() {
            if let Some(d) = drafter.as_deref() {
                d.on_finished(&f, rl_step)?;
            }
            if record_features {
                let sample = FeatureSample::from_finished(&f, rl_step)?;
                if sample.train_positions() > 0 {
                    features.push(Arc::new(sample));
                }
            }
            f.hidden = None;
            if let (Some(cb), Some(&group)) = (on_finish.as_mut(), owner.get(f.id.0)) {
                cb(f.id.0, group, &f.tokens);
            }
            sd_ceiling.add(&f.p_max, &f.sd_rounds);
            tokens += f.tokens.len();
            finished += 1;
            if done.len() < owner.len() {
                done.resize(owner.len(), None);
            }
            let slot = done.get_mut(f.id.0).ok_or_else(|| Error::InvalidArgument("unknown request id".into()))?;
            *slot = Some(f);
        }
        if let Some(d) = drafter.as_deref_mut() {
            d.on_round(engine.num_live())?;
        }
        round_end_s.push(t0.elapsed().as_secs_f64());
        obs.on_round(engine.num_live(), finished, total, tokens);
        tlt_model::chaos::kill_point("rollout.round");
        if let Some(hook) = give_away.as_mut() {
            let waiting: Vec<usize> = (0..prompts.len()).filter(|&g| started[g] == 0 && !given[g]).collect();
            for g in hook(&waiting)? {
                if !waiting.contains(&g) {
                    return Err(Error::InvalidArgument(format!("group {g} cannot be given away")));
                }
                queue.remove(g);
                given[g] = true;
                total -= group_size;
            }
        }
        admit(&mut engine, &mut owner, &mut queue, &mut started)?;
    }
    let seconds = t0.elapsed().as_secs_f64();
    let (drafter_s, preempt_latency) = match drafter {
        Some(d) => {
            obs.on_phase(rl_step, "drafter");
            d.end_rollout()?
        }
        None => (0.0, None),
    };
    let drafter_after_s = (t0.elapsed().as_secs_f64() - seconds).min(drafter_s);
    done.resize(owner.len(), None);
    let mut samples = Vec::with_capacity(total);
    for (f, group) in done.into_iter().zip(owner) {
        let f = f.ok_or_else(|| Error::InvalidArgument("a request never finished".into()))?;
        samples.push(Sample {
            group,
            prompt: f.prompt,
            truncated: f.reason == FinishReason::Length,
            tokens: f.tokens,
            logprobs: f.logprobs,
        });
    }
    Ok(RolloutOutput {
        samples,
        trace: decoder.take_trace(),
        counters: *engine.counters(),
        seconds,
        drafter_s,
        drafter_after_s,
        preempt_latency,
        features,
        sd_ceiling,
        round_end_s,
        round_sd,
    })
}
