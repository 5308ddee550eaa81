//! Drafter training from rollout samples: batch building, our own AdamW, the [`DrafterTrainer`] (one type for
//! EAGLE-2 and EAGLE-3) with bit-exact checkpoint/resume, the offline loop and the online step for
//! [`BackgroundTrainer`](crate::online::BackgroundTrainer).
//!
//! A step draws samples deterministically from `(seed, step)`, crops each to a window starting at its first
//! response token ([`window`]), packs the windows into rows with segment ids ([`pack`]), computes the EAGLE-2
//! or EAGLE-3 loss, clips the gradients by global norm and applies AdamW to the drafter's own [`Var`]s. The
//! target's embedding and LM head ([`FrozenTarget`]) are never among them.

mod batch;
mod checkpoint;
mod loops;
mod parallel;

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};
use tlt_kernels::SeededRng;
use tlt_model::optim::{AdamW, AdamWParams, GradNorm, LrSchedule};

pub use crate::config::{feature_slices, FeatureSlices};
pub use batch::{build_eagle2_batch, build_eagle3_batch, pack, window, BatchInfo, Packing, Window};
pub use checkpoint::{TrainState, OPTIMIZER_FILE, STATE_FILE};
pub use loops::{online_step_fn, train_offline, Budget, OfflineReport, OnlineStepConfig};

use crate::config::{DrafterConfig, DrafterKind, Eagle2LossConfig, Eagle3LossConfig};
use crate::eagle2::Eagle2Drafter;
use crate::eagle3::Eagle3Drafter;
use crate::frozen::FrozenTarget;
use crate::online::{FeatureSample, OnlineBuffer};
use crate::runtime::{DraftRuntime, RuntimeOptions};
use crate::{Error, Result};

/// How a [`DrafterTrainer`] trains. `Default` follows EAGLE/EAGLE-3's offline recipe without its 12k-step
/// warmup (TLT's online trainer uses `lr = 1e-6`, `weight_decay = 0.01`, 1000 warmup steps, clip 1.0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Learning rate: peak, linear warmup, decay after it (the workspace's one schedule,
    /// [`tlt_model::optim::LrSchedule`]). Default `5e-5`, no warmup, constant.
    pub schedule: LrSchedule,
    /// AdamW `(beta1, beta2)`. Default `[0.9, 0.95]`.
    pub betas: [f64; 2],
    /// AdamW epsilon. Default `1e-8`.
    pub eps: f64,
    /// Decoupled weight decay. Default 0.
    pub weight_decay: f64,
    /// Clip the gradients to this global L2 norm (`None`: no clipping). Default `Some(0.5)`.
    pub grad_clip: Option<f64>,
    /// Token budget of one step: windows are packed until it is used. Default 2048.
    pub tokens_per_step: usize,
    /// Most tokens of one sample in a step (TLT: 512, from the first response token). Default 512.
    pub window: usize,
    /// Most tokens of one packed row (`>= window`; attention cost grows with its square). Default 512.
    pub row_len: usize,
    /// Samples drawn per step (TLT: up to 4). Default 4.
    pub samples_per_step: usize,
    /// Seed of sample draws and input noise; step `s` uses `SeededRng::new(seed).fork(s)`. Default 0.
    pub seed: u64,
    /// EAGLE-2 objective (its noise seed is varied per step). Default `1.0 * vloss + 0.1 * ploss`.
    pub eagle2_loss: Eagle2LossConfig,
    /// EAGLE-3 objective (its noise seed is varied per step). Default 7 steps, decay 0.8.
    pub eagle3_loss: Eagle3LossConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            schedule: LrSchedule::constant(5e-5),
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: Some(0.5),
            tokens_per_step: 2048,
            window: 512,
            row_len: 512,
            samples_per_step: 4,
            seed: 0,
            eagle2_loss: Eagle2LossConfig::default(),
            eagle3_loss: Eagle3LossConfig::default(),
        }
    }
}

impl TrainConfig {
    /// Checks every value.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        self.schedule.validate().map_err(Error::from_model_config)?;
        self.adamw().validate().map_err(Error::from_model_config)?;
        if let Some(c) = self.grad_clip {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::config("grad_clip", c, "must be finite and > 0 (None disables clipping)"));
            }
        }
        if self.window < 2 {
            return Err(Error::config("window", self.window, "must be >= 2"));
        }
        if self.row_len < self.window {
            return Err(Error::config("row_len", self.row_len, "must be >= window"));
        }
        if self.tokens_per_step < self.window {
            return Err(Error::config("tokens_per_step", self.tokens_per_step, "must be >= window"));
        }
        if self.samples_per_step == 0 {
            return Err(Error::config("samples_per_step", 0, "must be >= 1"));
        }
        self.eagle2_loss.validate()?;
        self.eagle3_loss.validate()
    }

    /// The optimizer hyperparameters.
    pub fn adamw(&self) -> AdamWParams {
        AdamWParams { beta1: self.betas[0], beta2: self.betas[1], eps: self.eps, weight_decay: self.weight_decay }
    }

    /// The learning rate of the update after `step` completed steps.
    pub fn lr_at(&self, step: u64) -> f64 {
        self.schedule.lr_at(step)
    }

    /// The random stream of the step after `step` completed steps: `SeededRng::new(seed).fork(step)`.
    pub fn step_rng(&self, step: u64) -> SeededRng {
        SeededRng::new(self.seed).fork(step)
    }

    /// The input-noise seed of the step after `step` completed steps (what [`DrafterTrainer::step`] perturbs with).
    pub fn noise_seed(&self, step: u64) -> u64 {
        self.step_rng(step).fork(NOISE_STREAM).next_u64()
    }

    /// The samples the step after `step` completed steps trains on, from an [`OnlineBuffer`]: `samples_per_step`
    /// uniform draws with replacement ([`OnlineBuffer::sample`]), duplicates and samples without a training
    /// position dropped, with their buffer ids.
    pub fn draw_from_buffer(&self, step: u64, buffer: &OnlineBuffer) -> Vec<(u64, Arc<FeatureSample>)> {
        let mut rng = self.step_rng(step);
        let mut out: Vec<(u64, Arc<FeatureSample>)> = Vec::new();
        for (id, s) in buffer.sample(self.samples_per_step, &mut rng) {
            if window(&s, self.window).is_some() && !out.iter().any(|(i, _)| *i == id) {
                out.push((id, s));
            }
        }
        out
    }

    /// The most positions (rows x padded row length) one packed batch of a step has: at most `samples_per_step`
    /// rows (one window each at least), each at most `row_len` and `tokens_per_step` long.
    pub fn max_positions(&self) -> usize {
        self.samples_per_step.saturating_mul(self.row_len.min(self.tokens_per_step))
    }
}

/// The drafter a [`DrafterTrainer`] trains: EAGLE-2 or EAGLE-3.
#[derive(Debug, Clone)]
pub enum TrainableDrafter {
    /// An EAGLE-2 drafter.
    Eagle2(Eagle2Drafter),
    /// An EAGLE-3 drafter.
    Eagle3(Eagle3Drafter),
}

impl From<Eagle2Drafter> for TrainableDrafter {
    fn from(d: Eagle2Drafter) -> Self {
        Self::Eagle2(d)
    }
}

impl From<Eagle3Drafter> for TrainableDrafter {
    fn from(d: Eagle3Drafter) -> Self {
        Self::Eagle3(d)
    }
}

impl TrainableDrafter {
    /// EAGLE-2 or EAGLE-3.
    pub fn kind(&self) -> DrafterKind {
        self.config().kind
    }

    /// The drafter's configuration.
    pub fn config(&self) -> &DrafterConfig {
        match self {
            Self::Eagle2(d) => d.config(),
            Self::Eagle3(d) => d.config(),
        }
    }

    /// The frozen target parts it shares.
    pub fn target(&self) -> &FrozenTarget {
        match self {
            Self::Eagle2(d) => d.target(),
            Self::Eagle3(d) => d.target(),
        }
    }

    /// Replaces the shared target parts (the policy changed in RL; see [`Eagle2Drafter::set_target`]).
    ///
    /// # Errors
    /// If the shapes or dtype differ.
    pub fn set_target(&mut self, target: FrozenTarget) -> Result<()> {
        match self {
            Self::Eagle2(d) => d.set_target(target),
            Self::Eagle3(d) => d.set_target(target),
        }
    }

    /// The trainable parameters (named [`Var`]s sharing the drafter's storage).
    ///
    /// # Errors
    /// On a candle failure.
    pub fn vars(&self) -> Result<Vec<(String, Var)>> {
        match self {
            Self::Eagle2(d) => d.vars(),
            Self::Eagle3(d) => d.vars(),
        }
    }

    /// Every trainable parameter with its checkpoint name (storage shared).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        match self {
            Self::Eagle2(d) => d.weights().named_tensors(),
            Self::Eagle3(d) => d.weights().named_tensors(),
        }
    }

    /// An inference snapshot of the weights now ([`DraftRuntime::eagle2`] / [`DraftRuntime::eagle3`]).
    ///
    /// # Errors
    /// As the runtime constructors.
    pub fn runtime(&self, opts: &RuntimeOptions) -> Result<DraftRuntime> {
        match self {
            Self::Eagle2(d) => DraftRuntime::eagle2(d, opts),
            Self::Eagle3(d) => DraftRuntime::eagle3(d, opts),
        }
    }
}

/// The loss terms of a step or an evaluation.
#[derive(Debug, Clone, PartialEq)]
pub enum LossParts {
    /// EAGLE-2: the SmoothL1 feature loss and the soft cross-entropy (unweighted).
    Eagle2 {
        /// Feature regression.
        vloss: f64,
        /// Token soft cross-entropy.
        ploss: f64,
    },
    /// EAGLE-3: the per-TTT-step soft cross-entropies (unweighted) and argmax accuracies.
    Eagle3 {
        /// Loss of step `k`.
        steps: Vec<f64>,
        /// Accuracy of step `k`.
        accuracy: Vec<f64>,
    },
}

/// A loss evaluated on a packed batch.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftEvaluation {
    /// The weighted total the optimizer minimises.
    pub loss: f64,
    /// Its terms.
    pub parts: LossParts,
    /// Fraction of training positions where the draft's argmax is the target's (EAGLE-3: TTT step 0).
    pub accuracy: f64,
    /// Training positions (sum of the loss weights; EAGLE-3: step 0).
    pub targets: f64,
    /// The batch's layout.
    pub batch: BatchInfo,
}

/// What one [`DrafterTrainer::step`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// Steps done, this one included.
    pub step: u64,
    /// The loss before the update, with the step's input noise.
    pub eval: DraftEvaluation,
    /// Gradient norm before and after clipping.
    pub grad_norm: GradNorm,
    /// The learning rate used.
    pub lr: f64,
    /// Wall time of the step (batch building, forward, backward, update).
    pub seconds: f64,
}

/// Lifetime counts of a trainer (saved in its checkpoints).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    /// Samples trained on (with repetition).
    pub samples: u64,
    /// Window tokens trained on.
    pub tokens: u64,
    /// Training positions (loss-weight sum).
    pub targets: f64,
}

/// Trains one drafter (EAGLE-2 or EAGLE-3) with AdamW on rollout [`FeatureSample`]s; checkpoints and resumes
/// bit-exactly.
#[derive(Debug)]
pub struct DrafterTrainer {
    drafter: TrainableDrafter,
    cfg: TrainConfig,
    opt: AdamW,
    step: u64,
    totals: Totals,
    last: Option<StepStats>,
}

/// Stream of [`DrafterTrainer::step_rng`] forks for the input noise.
const NOISE_STREAM: u64 = 0x006e_6f69_7365;

impl DrafterTrainer {
    /// A trainer at step 0 with zero optimizer moments.
    ///
    /// # Errors
    /// If `cfg` is invalid.
    pub fn new(drafter: impl Into<TrainableDrafter>, cfg: TrainConfig) -> Result<Self> {
        cfg.validate()?;
        let drafter = drafter.into();
        let opt = AdamW::new(drafter.vars()?, cfg.adamw())?;
        Ok(Self { drafter, cfg, opt, step: 0, totals: Totals::default(), last: None })
    }

    /// Points the drafter at a changed target ([`TrainableDrafter::set_target`]); weights and optimizer state
    /// are kept.
    ///
    /// # Errors
    /// If the shapes or dtype differ.
    pub fn set_target(&mut self, target: FrozenTarget) -> Result<()> {
        self.drafter.set_target(target)
    }

    /// Replaces the learning-rate schedule (e.g. once the pace of a time-budgeted run is known); later steps
    /// follow it from their step count.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the resulting config is invalid.
    pub fn set_lr_schedule(&mut self, schedule: LrSchedule) -> Result<()> {
        let cfg = TrainConfig { schedule, ..self.cfg.clone() };
        cfg.validate()?;
        self.cfg = cfg;
        Ok(())
    }

    /// Restricts an EAGLE-2 drafter to a hot vocabulary ([`Eagle2Drafter::set_loss_vocab`]): its loss from the
    /// next step on, and the runtimes made from it, use only these target ids (`None`: the whole vocabulary).
    /// Saved with the checkpoint.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an EAGLE-3 drafter (it has its own draft vocabulary) or invalid ids.
    pub fn set_hot_vocab(&mut self, ids: Option<&[u32]>) -> Result<()> {
        match &mut self.drafter {
            TrainableDrafter::Eagle2(d) => d.set_loss_vocab(ids),
            TrainableDrafter::Eagle3(_) => {
                Err(Error::config("hot_vocab", "eagle3", "an EAGLE-3 drafter drafts over its own vocabulary (d2t)"))
            }
        }
    }

    /// The drafter (its weights are the trained ones; clones share their storage).
    pub fn drafter(&self) -> &TrainableDrafter {
        &self.drafter
    }

    /// The drafter, giving up the optimizer state.
    pub fn into_drafter(self) -> TrainableDrafter {
        self.drafter
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The optimizer (its moments are visible for inspection).
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    /// Steps done.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Lifetime counts.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// The last step's figures (`None` before the first step and after a resume).
    pub fn last_stats(&self) -> Option<&StepStats> {
        self.last.as_ref()
    }

    /// The random stream of the next step: `SeededRng::new(seed).fork(steps_done)`.
    pub fn step_rng(&self) -> SeededRng {
        self.cfg.step_rng(self.step)
    }

    /// The samples the next step trains on, drawn from `pool` without repetition (up to `samples_per_step`
    /// of those with a training position), determined by `(seed, steps_done)` and the pool.
    pub fn draw(&self, pool: &[Arc<FeatureSample>]) -> Vec<Arc<FeatureSample>> {
        let mut cand: Vec<usize> = (0..pool.len()).filter(|&i| window(&pool[i], self.cfg.window).is_some()).collect();
        let mut rng = self.step_rng();
        let k = self.cfg.samples_per_step.min(cand.len());
        for i in 0..k {
            let n = cand.len() - i;
            let j = i + ((rng.uniform() * n as f64) as usize).min(n - 1);
            cand.swap(i, j);
        }
        cand[..k].iter().map(|&i| pool[i].clone()).collect()
    }

    /// Like [`Self::draw`] from an [`OnlineBuffer`]: [`TrainConfig::draw_from_buffer`] at this trainer's step.
    pub fn draw_from_buffer(&self, buffer: &OnlineBuffer) -> Vec<(u64, Arc<FeatureSample>)> {
        self.cfg.draw_from_buffer(self.step, buffer)
    }

    /// The loss on `samples` (packed as a step would, in order, without input noise), without training.
    ///
    /// # Errors
    /// As [`Self::step`].
    pub fn evaluate(&self, samples: &[Arc<FeatureSample>]) -> Result<DraftEvaluation> {
        Ok(self.loss(samples, None)?.1)
    }

    fn loss(&self, samples: &[Arc<FeatureSample>], noise_seed: Option<u64>) -> Result<(Tensor, DraftEvaluation)> {
        let scalar = |t: &Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
        let (total, eval) = match &self.drafter {
            TrainableDrafter::Eagle2(d) => {
                let (batch, info) = build_eagle2_batch(samples, d.config().hidden_size(), &self.cfg)?;
                let mut lc = self.cfg.eagle2_loss;
                match (lc.noise.as_mut(), noise_seed) {
                    (Some(n), Some(s)) => n.seed ^= s,
                    (Some(_), None) => lc.noise = None,
                    _ => {}
                }
                let l = d.loss(&batch, &lc)?;
                let parts = LossParts::Eagle2 { vloss: scalar(&l.vloss)?, ploss: scalar(&l.ploss)? };
                let eval = DraftEvaluation {
                    loss: scalar(&l.total)?,
                    parts,
                    accuracy: l.accuracy,
                    targets: l.tokens,
                    batch: info,
                };
                (l.total, eval)
            }
            TrainableDrafter::Eagle3(d) => {
                let (batch, info) = build_eagle3_batch(samples, d.config().hidden_size(), &self.cfg)?;
                let mut lc = self.cfg.eagle3_loss;
                match (lc.noise.as_mut(), noise_seed) {
                    (Some(n), Some(s)) => n.seed ^= s,
                    (Some(_), None) => lc.noise = None,
                    _ => {}
                }
                let l = d.loss(&batch, &lc)?;
                let steps = l.steps.iter().map(scalar).collect::<Result<Vec<f64>>>()?;
                let eval = DraftEvaluation {
                    loss: scalar(&l.total)?,
                    accuracy: l.accuracy.first().copied().unwrap_or(0.0),
                    targets: l.tokens.first().copied().unwrap_or(0.0),
                    parts: LossParts::Eagle3 { steps, accuracy: l.accuracy },
                    batch: info,
                };
                (l.total, eval)
            }
        };
        Ok((total, eval))
    }

    /// One optimizer step on `samples` (packed in order up to the token budget): loss, backward, clipping,
    /// AdamW at [`TrainConfig::lr_at`]`(steps_done)`. Input noise, if configured, is seeded from the step.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when no sample has a training position or the loss is not finite (the
    /// weights are then left alone); [`Error::InvalidBatch`] for samples of the wrong width.
    pub fn step(&mut self, samples: &[Arc<FeatureSample>]) -> Result<StepStats> {
        let t0 = Instant::now();
        let lr = self.cfg.lr_at(self.step);
        let noise_seed = self.cfg.noise_seed(self.step);
        let (total, eval) = self.loss(samples, Some(noise_seed))?;
        if !eval.loss.is_finite() {
            return Err(Error::InvalidArgument(format!("non-finite loss {} at step {}", eval.loss, self.step)));
        }
        let grads = total.backward()?;
        let grad_norm = self.opt.step(&grads, lr, self.cfg.grad_clip)?;
        self.step += 1;
        Ok(self.record(eval, grad_norm, lr, t0))
    }

    /// Counts a step's batch in the totals and keeps its statistics (the step count already advanced).
    fn record(&mut self, eval: DraftEvaluation, grad_norm: GradNorm, lr: f64, t0: Instant) -> StepStats {
        self.totals.samples += eval.batch.samples as u64;
        self.totals.tokens += eval.batch.tokens as u64;
        self.totals.targets += eval.targets;
        let stats = StepStats { step: self.step, eval, grad_norm, lr, seconds: t0.elapsed().as_secs_f64() };
        self.last = Some(stats.clone());
        stats
    }

    /// An inference snapshot of the current weights, for publishing to a
    /// [`WeightsSlot`](crate::online::WeightsSlot).
    ///
    /// # Errors
    /// As [`DraftRuntime::eagle2`] / [`DraftRuntime::eagle3`].
    pub fn runtime(&self, opts: &RuntimeOptions) -> Result<DraftRuntime> {
        self.drafter.runtime(opts)
    }
}
