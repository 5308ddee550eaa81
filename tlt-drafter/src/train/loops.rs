//! The offline training loop and the online micro-step for [`BackgroundTrainer`](crate::online::BackgroundTrainer).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{DrafterTrainer, StepStats};
use crate::online::{FeatureSample, MicroStepOutcome, OnlineBuffer, WeightsSlot};
use crate::runtime::{DraftRuntime, RuntimeOptions};
use crate::{Error, Result};

/// How long [`train_offline`] trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// This many more steps.
    Steps(u64),
    /// Until this much wall time has passed (checked between steps; at least one step runs).
    Time(Duration),
}

/// What [`train_offline`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct OfflineReport {
    /// Steps run.
    pub steps: u64,
    /// Window tokens trained on.
    pub tokens: u64,
    /// Training positions (loss-weight sum).
    pub targets: f64,
    /// Wall time.
    pub seconds: f64,
    /// `tokens / seconds`.
    pub tokens_per_s: f64,
    /// The first step's figures.
    pub first: Option<StepStats>,
    /// The last step's figures.
    pub last: Option<StepStats>,
}

impl OfflineReport {
    /// This report followed by `later` (a continuation of the same training): counts and times add up, `first`
    /// is this one's, `last` the later one's.
    pub fn merge(self, later: OfflineReport) -> OfflineReport {
        let seconds = self.seconds + later.seconds;
        let tokens = self.tokens + later.tokens;
        OfflineReport {
            steps: self.steps + later.steps,
            tokens,
            targets: self.targets + later.targets,
            seconds,
            tokens_per_s: if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 },
            first: self.first.or(later.first),
            last: later.last.or(self.last),
        }
    }
}

/// Trains `trainer` on `samples` until `budget` is spent: each step draws [`DrafterTrainer::draw`] (determined
/// by the trainer's seed and step, so a resumed trainer continues the same sequence) and calls `progress` with
/// its figures.
///
/// # Errors
/// [`Error::InvalidArgument`] if no sample has a training position; any step's error.
pub fn train_offline(
    trainer: &mut DrafterTrainer,
    samples: &[Arc<FeatureSample>],
    budget: Budget,
    mut progress: impl FnMut(&StepStats),
) -> Result<OfflineReport> {
    let t0 = Instant::now();
    let mut report =
        OfflineReport { steps: 0, tokens: 0, targets: 0.0, seconds: 0.0, tokens_per_s: 0.0, first: None, last: None };
    loop {
        let done = match budget {
            Budget::Steps(n) => report.steps >= n,
            Budget::Time(d) => report.steps > 0 && t0.elapsed() >= d,
        };
        if done {
            break;
        }
        let batch = trainer.draw(samples);
        if batch.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "none of the {} samples has a training position",
                samples.len()
            )));
        }
        let stats = trainer.step(&batch)?;
        progress(&stats);
        report.steps += 1;
        report.tokens += stats.eval.batch.tokens as u64;
        report.targets += stats.eval.targets;
        if report.first.is_none() {
            report.first = Some(stats.clone());
        }
        report.last = Some(stats);
    }
    report.seconds = t0.elapsed().as_secs_f64();
    report.tokens_per_s = if report.seconds > 0.0 { report.tokens as f64 / report.seconds } else { 0.0 };
    Ok(report)
}

/// How [`online_step_fn`] publishes.
#[derive(Debug, Clone, PartialEq)]
pub struct OnlineStepConfig {
    /// Publish a new [`DraftRuntime`] every this many trained steps (`>= 1`).
    pub publish_every: u64,
    /// How published runtimes are packed.
    pub runtime: RuntimeOptions,
}

impl Default for OnlineStepConfig {
    /// Publish every 10 steps, default runtime packing.
    fn default() -> Self {
        Self { publish_every: 10, runtime: RuntimeOptions::default() }
    }
}

/// The micro-step closure [`BackgroundTrainer::spawn`](crate::online::BackgroundTrainer::spawn) runs for online
/// training: lock `trainer`, draw from `buffer` ([`DrafterTrainer::draw_from_buffer`]), train one step, and
/// every `publish_every` steps publish [`DrafterTrainer::runtime`] to `slot`. Returns
/// [`MicroStepOutcome::NoData`] when the buffer holds no sample with a training position. The lock is held for
/// the whole step, so other users of `trainer` (a checkpoint, say) wait at most one step.
///
/// # Errors
/// [`Error::InvalidConfig`] if `publish_every` is 0. The closure fails with the step's or the packing's error.
pub fn online_step_fn(
    trainer: Arc<Mutex<DrafterTrainer>>,
    buffer: Arc<OnlineBuffer>,
    slot: Arc<WeightsSlot<DraftRuntime>>,
    cfg: OnlineStepConfig,
) -> Result<impl FnMut() -> Result<MicroStepOutcome> + Send + 'static> {
    if cfg.publish_every == 0 {
        return Err(Error::config("publish_every", 0, "must be >= 1"));
    }
    Ok(move || {
        let mut t = trainer.lock();
        let drawn = t.draw_from_buffer(&buffer);
        if drawn.is_empty() {
            return Ok(MicroStepOutcome::NoData);
        }
        let samples: Vec<Arc<FeatureSample>> = drawn.into_iter().map(|(_, s)| s).collect();
        t.step(&samples)?;
        if t.steps_done().is_multiple_of(cfg.publish_every) {
            slot.publish(t.runtime(&cfg.runtime)?);
        }
        Ok(MicroStepOutcome::Trained)
    })
}
