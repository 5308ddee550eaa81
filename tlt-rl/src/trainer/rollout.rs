//! One rollout: every prompt's group decoded by the engine (adaptive SD in TLT mode, plain in the baseline),
//! finished requests handed to the drafter as they finish.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tlt_drafter::online::FeatureSample;
use tlt_model::Llama;
use tlt_scheduler::{AdaptiveDecoder, DecodeTrace};
use tlt_spec_decode::{Counters, Engine, FinishReason, Finished, SamplingParams, SpecParams};

use super::drafter::RolloutDrafter;
use super::env::Prompt;
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

/// One generated sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Index of its prompt in the step (its GRPO group).
    pub group: usize,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Generated tokens (a stop token last if it stopped).
    pub tokens: Vec<u32>,
    /// The rollout's log-probabilities of `tokens` (temperature 1, as the engine records them).
    pub logprobs: Vec<f32>,
    /// It hit the length limit without stopping.
    pub truncated: bool,
}

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
    /// ([`RolloutJob::record_features`]; empty otherwise).
    pub features: Vec<Arc<FeatureSample>>,
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

/// What one rollout decodes: `group_size` samples of every prompt with `model`, engine settings `params`, during
/// RL step `rl_step`.
pub(crate) struct RolloutJob<'a> {
    pub model: &'a Llama,
    pub prompts: &'a [Prompt],
    pub group_size: usize,
    pub params: SpecParams,
    pub rl_step: u64,
    /// Keep each finished request's hidden states as a [`FeatureSample`] in [`RolloutOutput::features`].
    pub record_features: bool,
}

/// Runs `job` with `decoder` (and `drafter` in TLT mode).
pub(crate) fn run_rollout(
    job: RolloutJob,
    decoder: &mut AdaptiveDecoder,
    mut drafter: Option<&mut RolloutDrafter>,
    obs: &mut dyn Observer,
) -> Result<RolloutOutput> {
    let RolloutJob { model, prompts, group_size, params, rl_step, record_features } = job;
    let t0 = Instant::now();
    let mut engine = Engine::new(model, params)?;
    engine.record_hidden(record_features || drafter.as_ref().is_some_and(|d| d.needs_hidden()));
    let mut features = Vec::new();
    // One engine group per prompt: its prompt is prefilled once and forked to the siblings, and group drafters
    // draft from the siblings' tokens.
    let mut owner = Vec::new();
    let max_new = engine.params().max_new_tokens;
    for (g, p) in prompts.iter().enumerate() {
        let (_, ids) = engine.add_group(&p.ids, group_size, max_new)?;
        if ids.first().is_some_and(|id| id.0 != owner.len()) {
            return Err(Error::InvalidArgument("engine request ids are not dense".into()));
        }
        owner.extend(std::iter::repeat_n(g, ids.len()));
    }
    let total = owner.len();
    let mut proposer = drafter.as_ref().map(|d| d.proposer()).transpose()?;
    if let Some(d) = drafter.as_deref_mut() {
        d.begin_rollout(rl_step);
    }
    let mut done: Vec<Option<Finished>> = vec![None; total];
    let (mut finished, mut tokens) = (0usize, 0usize);
    while !engine.is_idle() {
        decoder.step(&mut engine, proposer.as_deref_mut())?;
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
            tokens += f.tokens.len();
            finished += 1;
            let slot = done.get_mut(f.id.0).ok_or_else(|| Error::InvalidArgument("unknown request id".into()))?;
            *slot = Some(f);
        }
        if let Some(d) = drafter.as_deref_mut() {
            d.on_round(engine.num_live());
        }
        obs.on_round(engine.num_live(), finished, total, tokens);
    }
    let seconds = t0.elapsed().as_secs_f64();
    let (drafter_s, preempt_latency) = match drafter {
        Some(d) => d.end_rollout()?,
        None => (0.0, None),
    };
    let drafter_after_s = (t0.elapsed().as_secs_f64() - seconds).min(drafter_s);
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
    })
}
