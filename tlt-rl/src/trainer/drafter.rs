//! The drafter side of TLT rollouts: an n-gram drafter, or an EAGLE-2 drafter trained online from the policy's
//! own hidden states (on finished requests, during the rollout's tail or in fixed synchronous steps) and
//! hot-swapped into the engine through versioned weights.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tlt_drafter::checkpoint::{save_eagle2_serving, save_eagle3};
use tlt_drafter::online::{BackgroundTrainer, FeatureSample, MicroStepOutcome, OnlineBuffer, WeightsSlot};
use tlt_drafter::train::{online_step_fn, train_offline, Budget, OfflineReport, OnlineStepConfig};
use tlt_drafter::{
    DraftRuntime, DrafterConfig, DrafterKind, DrafterTrainer, Eagle2Drafter, EagleProposer, FrozenTarget,
    RuntimeOptions, SaveDType, TrainableDrafter, VocabMap,
};
use tlt_model::Llama;
use tlt_spec_decode::{Drafter, Finished, HybridDrafter, NgramDrafter, SuffixConfig, SuffixDrafter};

use super::config::{DrafterChoice, DrafterSchedule, SdConfig};
use crate::Result;

/// The online EAGLE-2 drafter: trainer, sample buffer, weights slot and background worker.
pub(crate) struct OnlineEagle {
    trainer: Arc<Mutex<DrafterTrainer>>,
    buffer: Arc<OnlineBuffer>,
    slot: Arc<WeightsSlot<DraftRuntime>>,
    worker: Option<BackgroundTrainer>,
    schedule: DrafterSchedule,
    tail_batch: usize,
    publish_every: u64,
    /// Merge its trees with group drafts ([`DrafterChoice::Hybrid`]).
    hybrid: Option<SuffixConfig>,
    /// The worker is running (tail schedule).
    training: bool,
    /// Wall seconds the worker ran in the current rollout.
    train_since: Option<Instant>,
    train_s: f64,
}

/// A rollout drafter.
pub(crate) enum RolloutDrafter {
    /// Model-free, per request.
    Ngram,
    /// Model-free, per group.
    Suffix(SuffixConfig),
    /// Online EAGLE-2.
    Eagle(Box<OnlineEagle>),
}

impl std::fmt::Debug for RolloutDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ngram => f.write_str("Ngram"),
            Self::Suffix(_) => f.write_str("Suffix"),
            Self::Eagle(e) => write!(f, "Eagle2(version {})", e.slot.version()),
        }
    }
}

impl RolloutDrafter {
    /// A drafter for `policy` as `cfg` says.
    pub(crate) fn new(cfg: &SdConfig, policy: &Llama) -> Result<Self> {
        match cfg.drafter {
            DrafterChoice::Ngram => Ok(Self::Ngram),
            DrafterChoice::Suffix => Ok(Self::Suffix(cfg.suffix)),
            DrafterChoice::Eagle2 | DrafterChoice::Hybrid => {
                let dcfg = DrafterConfig::eagle2_from_target(policy.config(), false);
                let d = Eagle2Drafter::random(dcfg, FrozenTarget::new(policy), cfg.drafter_seed)?;
                Self::eagle(cfg, DrafterTrainer::new(d, cfg.drafter_train.clone())?, 0)
            }
        }
    }

    /// An EAGLE-2 drafter from its trainer, publishing from weights version `version` on.
    pub(crate) fn eagle(cfg: &SdConfig, trainer: DrafterTrainer, version: u64) -> Result<Self> {
        let slot = Arc::new(WeightsSlot::with_version(trainer.runtime(&RuntimeOptions::default())?, version));
        let trainer = Arc::new(Mutex::new(trainer));
        let buffer = Arc::new(OnlineBuffer::new(cfg.buffer)?);
        let worker = match cfg.schedule {
            DrafterSchedule::Tail => {
                let step_cfg =
                    OnlineStepConfig { publish_every: cfg.publish_every, runtime: RuntimeOptions::default() };
                let step = online_step_fn(trainer.clone(), buffer.clone(), slot.clone(), step_cfg)?;
                Some(BackgroundTrainer::spawn(step, Duration::from_millis(5)))
            }
            _ => None,
        };
        Ok(Self::Eagle(Box::new(OnlineEagle {
            trainer,
            buffer,
            slot,
            worker,
            schedule: cfg.schedule,
            tail_batch: cfg.tail_batch,
            publish_every: cfg.publish_every,
            hybrid: (cfg.drafter == DrafterChoice::Hybrid).then_some(cfg.suffix),
            training: false,
            train_since: None,
            train_s: 0.0,
        })))
    }

    /// Whether the engine must record hidden states for this drafter.
    pub(crate) fn needs_hidden(&self) -> bool {
        matches!(self, Self::Eagle(_))
    }

    /// A fresh proposer for one rollout (per-request drafter caches live in it).
    pub(crate) fn proposer(&self) -> Result<Box<dyn Drafter>> {
        Ok(match self {
            Self::Ngram => Box::new(NgramDrafter::default()),
            Self::Suffix(cfg) => Box::new(SuffixDrafter::new(*cfg)?),
            Self::Eagle(e) => match e.hybrid {
                Some(cfg) => Box::new(HybridDrafter::new(SuffixDrafter::new(cfg)?, EagleProposer::new(e.slot.clone()))),
                None => Box::new(EagleProposer::new(e.slot.clone())),
            },
        })
    }

    /// A rollout starts: the buffer moves to RL step `step`.
    pub(crate) fn begin_rollout(&mut self, step: u64) {
        if let Self::Eagle(e) = self {
            e.buffer.set_step(step);
            e.train_s = 0.0;
        }
    }

    /// A request finished: its tokens and hidden states become training data.
    pub(crate) fn on_finished(&self, f: &Finished, step: u64) -> Result<()> {
        if let Self::Eagle(e) = self {
            let sample = FeatureSample::from_finished(f, step)?;
            if sample.train_positions() > 0 {
                e.buffer.push(sample)?;
            }
        }
        Ok(())
    }

    /// After each round: in the tail (at most `tail_batch` running) the background worker trains.
    pub(crate) fn on_round(&mut self, running: usize) {
        if let Self::Eagle(e) = self {
            if let Some(w) = &e.worker {
                if !e.training && running <= e.tail_batch && running > 0 {
                    w.resume();
                    e.training = true;
                    e.train_since = Some(Instant::now());
                }
            }
        }
    }

    /// The rollout ended: stop the worker (or run the fixed steps). Returns drafter training seconds of this
    /// rollout and the preemption latency of the stop (tail schedule).
    pub(crate) fn end_rollout(&mut self) -> Result<(f64, Option<Duration>)> {
        let Self::Eagle(e) = self else { return Ok((0.0, None)) };
        let mut latency = None;
        if let (Some(w), true) = (&e.worker, e.training) {
            latency = Some(w.pause());
            e.training = false;
            if let Some(t) = e.train_since.take() {
                e.train_s += t.elapsed().as_secs_f64();
            }
        }
        if let DrafterSchedule::Fixed { steps } = e.schedule {
            let t = Instant::now();
            let step_cfg = OnlineStepConfig { publish_every: e.publish_every, runtime: RuntimeOptions::default() };
            let mut step = online_step_fn(e.trainer.clone(), e.buffer.clone(), e.slot.clone(), step_cfg)?;
            for _ in 0..steps {
                if step()? == MicroStepOutcome::NoData {
                    break;
                }
            }
            e.train_s += t.elapsed().as_secs_f64();
        }
        Ok((e.train_s, latency))
    }

    /// The policy changed: point the drafter at its new embedding and head and publish the result.
    pub(crate) fn retarget(&self, policy: &Llama) -> Result<()> {
        if let Self::Eagle(e) = self {
            let mut t = e.trainer.lock();
            t.set_target(FrozenTarget::new(policy))?;
            e.slot.publish(t.runtime(&RuntimeOptions::default())?);
        }
        Ok(())
    }

    /// Published weights version (0 for the n-gram drafter).
    pub(crate) fn version(&self) -> u64 {
        match self {
            Self::Ngram | Self::Suffix(_) => 0,
            Self::Eagle(e) => e.slot.version(),
        }
    }

    /// Drafter optimizer steps so far.
    pub(crate) fn steps(&self) -> u64 {
        match self {
            Self::Ngram | Self::Suffix(_) => 0,
            Self::Eagle(e) => e.trainer.lock().steps_done(),
        }
    }

    /// Trains the EAGLE drafter on `samples` until `budget` is spent and publishes it (`None`, nothing done, for
    /// the model-free drafters). With `hot_vocab > 0` the drafter is first restricted to the `hot_vocab` tokens
    /// most frequent in the samples' responses, with the ids `keep` (end of sequence) ([`SdConfig::hot_vocab`]).
    pub(crate) fn warm_up(
        &self,
        samples: &[Arc<FeatureSample>],
        budget: Budget,
        hot_vocab: usize,
        keep: &[u32],
    ) -> Result<Option<OfflineReport>> {
        let Self::Eagle(e) = self else { return Ok(None) };
        let mut t = e.trainer.lock();
        if hot_vocab > 0 {
            let vocab = t.drafter().target().vocab_size();
            let tokens = samples.iter().flat_map(|s| s.tokens[s.response_start.min(s.tokens.len())..].iter().copied());
            let hot = VocabMap::from_tokens(tokens, vocab, hot_vocab.min(vocab), keep)?;
            t.set_hot_vocab(Some(hot.used()))?;
        }
        let report = train_offline(&mut t, samples, budget, |_| {})?;
        e.slot.publish(t.runtime(&RuntimeOptions::default())?);
        Ok(Some(report))
    }

    /// Checkpoints the drafter trainer into `dir` (nothing for the n-gram drafter).
    pub(crate) fn save(&self, dir: &Path) -> Result<()> {
        if let Self::Eagle(e) = self {
            e.trainer.lock().save_checkpoint(dir)?;
        }
        Ok(())
    }

    /// Exports the drafter's weights now in the format the serving engines load (EAGLE-2: the original EAGLE
    /// layout; EAGLE-3: the SGLang/vLLM format) to `dir`; returns its kind, or `None` (nothing written) for the
    /// model-free drafters.
    pub(crate) fn export(&self, dir: &Path, dtype: SaveDType) -> Result<Option<DrafterKind>> {
        let Self::Eagle(e) = self else { return Ok(None) };
        let t = e.trainer.lock();
        match t.drafter() {
            TrainableDrafter::Eagle2(d) => save_eagle2_serving(d, dir, dtype)?,
            TrainableDrafter::Eagle3(d) => save_eagle3(d, dir, dtype)?,
        }
        Ok(Some(t.drafter().kind()))
    }

    /// Stops the background worker.
    pub(crate) fn shutdown(&mut self) -> Result<()> {
        if let Self::Eagle(e) = self {
            if let Some(w) = e.worker.take() {
                w.shutdown()?;
            }
        }
        Ok(())
    }
}

impl Drop for RolloutDrafter {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
