//! TLT's adaptive drafter inside the server: an EAGLE-2 drafter trained online on the hidden states of the requests
//! the server decodes, in the server's idle time and long tail, hot-swapped into the engines through versioned
//! weights, re-pointed at the new embedding and LM head on every weight update, and checkpointed.
//!
//! The parts are the trainer's (`tlt_drafter`): the [`OnlineBuffer`] of finished requests' features, the
//! [`WeightsSlot`] the engines' [`EagleProposer`]s read at round boundaries, and a trainer where the engines are. On
//! a device backend that is [`CudaOnlineTrainer`] on the engines' device: the engine thread takes one step after
//! each round in the tail (and steps between messages while idle), so a growing batch stops it within the round.
//! On the CPU it is [`DrafterTrainer`] in the preemptible [`BackgroundTrainer`] thread. What is the server's own:
//! when to train (while at most [`EagleConfig::tail_batch`] requests run), a step budget per weight version, and
//! where samples of one weight version end (the buffer's "RL step" is the server's weight version counter, so
//! samples of older policies age out as in the trainer).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tlt_drafter::cuda::CudaOnlineTrainer;
use tlt_drafter::online::{
    BackgroundTrainer, BufferConfig, FeatureSample, MicroStepOutcome, OnlineBuffer, WeightsSlot,
};
use tlt_drafter::train::{online_step_fn, OnlineStepConfig};
use tlt_drafter::{
    DraftRuntime, DrafterConfig, DrafterTrainer, Eagle2Drafter, EagleProposer, FrozenTarget, RuntimeOptions,
    TrainConfig,
};
use tlt_kernels::cuda::SharedGpu;
use tlt_model::Llama;
use tlt_spec_decode::Finished;

use crate::{Error, Result};

/// Tokens the online drafter's sample buffer holds by default (a million: at SmolLM2's width, 2.3 GB of final-norm
/// features, were it not for the byte bound).
pub const DEFAULT_BUFFER_TOKENS: usize = 1 << 20;
/// Bytes the online drafter's sample buffer holds by default (1 GiB).
pub const DEFAULT_BUFFER_BYTES: usize = 1 << 30;

/// The executor the EAGLE proposers of a device backend share: the drafter's forward on the device (its weights
/// uploaded once per published version, its KV cache in slots), as the trainer's rollouts on a device draft.
pub type DeviceExec = Arc<parking_lot::Mutex<tlt_drafter::cuda::CudaDrafter>>;

/// How the server's online EAGLE-2 drafter starts, trains and is kept.
#[derive(Debug, Clone)]
pub struct EagleConfig {
    /// Start from this directory: a drafter-trainer checkpoint (what [`EagleConfig::checkpoint`] writes; resumed
    /// exactly, optimizer state included) or an EAGLE-2 checkpoint in the fastrl/EAGLE layout (weights only, a
    /// fresh optimizer). `None`: a fresh drafter from [`EagleConfig::seed`].
    pub init: Option<PathBuf>,
    /// Seed of a fresh drafter's weights.
    pub seed: u64,
    /// Where the drafter trainer is saved (atomically: written beside, then renamed): after every weight update
    /// and when the engine thread stops. `None`: never saved.
    pub checkpoint: Option<PathBuf>,
    /// Train while at most this many requests run (the tail, and idle time); above it the trainer is paused
    /// within one step. Default 4 (the trainer's `sd.tail_batch`).
    pub tail_batch: usize,
    /// Most optimizer steps per weight version (then the drafter is kept as it is until the next update); `None`:
    /// unbounded.
    pub steps_per_version: Option<u64>,
    /// Optimizer, batch and loss settings. Default the trainer's (`sd.drafter_train`: constant LR 3e-4).
    pub train: TrainConfig,
    /// Samples kept: the last 2 weight versions', at most 2,000 of them, [`DEFAULT_BUFFER_TOKENS`] tokens and
    /// [`DEFAULT_BUFFER_BYTES`] bytes.
    pub buffer: BufferConfig,
    /// Publish the weights to the engines every this many steps. Default 5.
    pub publish_every: u64,
}

impl Default for EagleConfig {
    fn default() -> Self {
        Self {
            init: None,
            seed: 0,
            checkpoint: None,
            tail_batch: 4,
            steps_per_version: None,
            train: TrainConfig { schedule: tlt_model::optim::LrSchedule::constant(3e-4), ..TrainConfig::default() },
            buffer: BufferConfig {
                max_tokens: Some(DEFAULT_BUFFER_TOKENS),
                max_bytes: Some(DEFAULT_BUFFER_BYTES),
                ..BufferConfig::default()
            },
            publish_every: 5,
        }
    }
}

/// The live figures of the online drafter, for `/metrics`.
#[derive(Debug, Default)]
pub struct DrafterStats {
    /// Optimizer steps so far (a resumed trainer's included).
    pub steps: AtomicU64,
    /// The weights version the engines draft with.
    pub version: AtomicU64,
    /// Samples in the training buffer.
    pub samples: AtomicU64,
    /// Bytes they hold (tokens and hidden rows).
    pub buffer_bytes: AtomicU64,
    /// 1 when the drafter's forward runs on the device (the engines' device), else 0.
    pub on_device: AtomicU64,
    /// 1 when the drafter trains on the device (the engines' device), else 0.
    pub trains_on_device: AtomicU64,
    /// Checkpoints written.
    pub checkpoints: AtomicU64,
}

/// Where the online drafter trains.
enum Site {
    /// On the host: the trainer thread, resumed while the batch is in the tail and paused above it (within a step).
    Host { trainer: Arc<Mutex<DrafterTrainer>>, worker: BackgroundTrainer, training: bool },
    /// On the engines' device: one step at the end of each round in the tail (and between messages while idle), in
    /// the engine thread on the device's stream, so it yields in the round the batch grows in.
    Device {
        trainer: Box<CudaOnlineTrainer>,
        publish_every: u64,
        budget: Option<u64>,
        /// The last step trained (the idle loop keeps stepping while it does).
        trained: bool,
    },
}

/// The server's online EAGLE-2 drafter.
pub struct OnlineDrafter {
    site: Site,
    buffer: Arc<OnlineBuffer>,
    slot: Arc<WeightsSlot<DraftRuntime>>,
    tail_batch: usize,
    checkpoint: Option<PathBuf>,
    /// Weight updates so far: the buffer's step.
    epoch: u64,
    /// Steps done when the current weight version began; the budget counts from it.
    epoch_start: Arc<AtomicU64>,
    stats: Arc<DrafterStats>,
    /// A sample arrived since the device trainer's last step.
    fresh: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for OnlineDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnlineDrafter")
            .field("version", &self.slot.version())
            .field("epoch", &self.epoch)
            .field("on_device", &matches!(self.site, Site::Device { .. }))
            .finish()
    }
}

/// A failure of the drafter's parts, as the server's error.
fn drafter_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Model(format!("online drafter: {what}: {e}"))
}

/// The drafter trainer `cfg` starts from for `model`.
fn start_trainer(model: &Llama, cfg: &EagleConfig) -> Result<DrafterTrainer> {
    let invalid =
        |field: &str, e: &dyn std::fmt::Display| Error::Invalid { field: field.into(), reason: e.to_string() };
    match &cfg.init {
        Some(dir) if dir.join(tlt_drafter::train::STATE_FILE).is_file() => {
            DrafterTrainer::resume(dir, model).map_err(|e| invalid("drafter", &e))
        }
        Some(dir) => {
            let d = Eagle2Drafter::load(dir, model).map_err(|e| invalid("drafter", &e))?;
            DrafterTrainer::new(d, cfg.train.clone()).map_err(|e| invalid("drafter", &e))
        }
        None => {
            let dcfg = DrafterConfig::eagle2_from_target(model.config(), false);
            let d = Eagle2Drafter::random(dcfg, FrozenTarget::new(model), cfg.seed)
                .map_err(|e| drafter_err("building the drafter", e))?;
            DrafterTrainer::new(d, cfg.train.clone()).map_err(|e| invalid("drafter_train", &e))
        }
    }
}

/// Device memory the online drafter of `cfg` takes beside a device target of `model` (its training and its forward),
/// out of the static share the KV pool is sized from. A drafter the device trainer does not cover trains on the host
/// ([`OnlineDrafter::new`]) and takes no training memory there.
pub fn device_footprint(model: &tlt_model::LlamaConfig, cfg: &EagleConfig) -> crate::pool::Beside {
    let dcfg = DrafterConfig::eagle2_from_target(model, false);
    let train = CudaOnlineTrainer::memory(&dcfg, &cfg.train).unwrap_or(0);
    let forward =
        tlt_drafter::cuda::CudaDrafter::memory(&dcfg, tlt_drafter::cuda::CudaDraftOptions { slots: 0, max_len: 0 });
    // The drafter's cache: keys and values of its one layer, bf16, per position of every slot.
    crate::pool::Beside { bytes: (train + forward) as u64, per_token: 2 * dcfg.llama.kv_dim() * 2 }
}

/// Whether a trainer at `steps` has used the budget of `budget` steps of the version begun at `start` (`None`:
/// unbounded).
fn budget_spent(steps: u64, start: u64, budget: Option<u64>) -> bool {
    budget.is_some_and(|b| steps >= start.saturating_add(b))
}

impl OnlineDrafter {
    /// The drafter for `model` as `cfg` says, its figures kept in `stats`: trained on `gpu` when given (the
    /// engines' device) and the device trainer covers it, else on the host by its trainer thread (started paused).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the setting for a bad configuration or a checkpoint that does not fit `model`.
    pub fn new(model: &Llama, cfg: &EagleConfig, stats: Arc<DrafterStats>, gpu: Option<SharedGpu>) -> Result<Self> {
        let trainer = start_trainer(model, cfg)?;
        let invalid =
            |field: &str, e: &dyn std::fmt::Display| Error::Invalid { field: field.into(), reason: e.to_string() };
        let steps = trainer.steps_done();
        let slot = Arc::new(WeightsSlot::new(
            trainer.runtime(&RuntimeOptions::default()).map_err(|e| drafter_err("packing the drafter", e))?,
        ));
        let buffer = Arc::new(OnlineBuffer::new(cfg.buffer).map_err(|e| invalid("drafter_buffer", &e))?);
        if cfg.publish_every == 0 {
            return Err(invalid("publish_every", &"must be >= 1"));
        }
        let epoch_start = Arc::new(AtomicU64::new(steps));
        let host = |t| Self::host_site(t, cfg, &buffer, &slot, &epoch_start, &stats);
        let site = match gpu {
            None => host(trainer)?,
            Some(g) => match CudaOnlineTrainer::new(g, trainer) {
                Ok(t) => Site::Device {
                    trainer: Box::new(t),
                    publish_every: cfg.publish_every,
                    budget: cfg.steps_per_version,
                    trained: false,
                },
                Err(e) => {
                    tracing::warn!(error = %e, "the online drafter trains on the host: the device trainer refused it");
                    host(start_trainer(model, cfg)?)?
                }
            },
        };
        stats.trains_on_device.store(u64::from(matches!(site, Site::Device { .. })), Ordering::Relaxed);
        stats.steps.store(steps, Ordering::Relaxed);
        Ok(Self {
            site,
            buffer,
            slot,
            tail_batch: cfg.tail_batch,
            checkpoint: cfg.checkpoint.clone(),
            epoch: 0,
            epoch_start,
            stats,
            fresh: false.into(),
        })
    }

    /// The host's trainer thread over `trainer`, paused, stepping within the per-version budget.
    fn host_site(
        trainer: DrafterTrainer,
        cfg: &EagleConfig,
        buffer: &Arc<OnlineBuffer>,
        slot: &Arc<WeightsSlot<DraftRuntime>>,
        epoch_start: &Arc<AtomicU64>,
        stats: &Arc<DrafterStats>,
    ) -> Result<Site> {
        let trainer = Arc::new(Mutex::new(trainer));
        let step_cfg = OnlineStepConfig { publish_every: cfg.publish_every, runtime: RuntimeOptions::default() };
        let mut step = online_step_fn(trainer.clone(), buffer.clone(), slot.clone(), step_cfg)
            .map_err(|e| Error::Invalid { field: "publish_every".into(), reason: e.to_string() })?;
        let (budget, start, counted) = (cfg.steps_per_version, epoch_start.clone(), trainer.clone());
        let (live, published) = (stats.clone(), slot.clone());
        let bounded = move || {
            if budget_spent(counted.lock().steps_done(), start.load(Ordering::Relaxed), budget) {
                return Ok(MicroStepOutcome::NoData);
            }
            let out = step()?;
            live.steps.store(counted.lock().steps_done(), Ordering::Relaxed);
            live.version.store(published.version(), Ordering::Relaxed);
            Ok(out)
        };
        let worker = BackgroundTrainer::spawn(bounded, Duration::from_millis(5));
        Ok(Site::Host { trainer, worker, training: false })
    }

    /// A proposer for one engine: it drafts with the newest published weights, picked up between rounds.
    pub fn proposer(&self) -> EagleProposer {
        EagleProposer::new(self.slot.clone())
    }

    /// A proposer for one engine drafting on a device with `exec` (shared by every engine on it).
    pub fn proposer_on(&self, exec: DeviceExec) -> EagleProposer<DeviceExec> {
        EagleProposer::with_executor(self.slot.clone(), exec)
    }

    /// A request finished (or was aborted): its tokens and the target's hidden states become training data.
    ///
    /// # Errors
    /// When its hidden states are missing or inconsistent (the engine was not recording them).
    pub fn observe(&self, f: &Finished) -> Result<()> {
        let sample = FeatureSample::from_finished(f, self.epoch).map_err(|e| drafter_err("a finished request", e))?;
        if sample.train_positions() > 0 {
            self.buffer.push(sample).map_err(|e| drafter_err("the sample buffer", e))?;
            self.fresh.store(true, Ordering::Relaxed);
            self.report();
        }
        Ok(())
    }

    /// Whether the engine thread, with nothing running, should keep calling [`Self::on_round`] instead of waiting
    /// for a message: the drafter trains on the device, and its last step trained or a sample arrived since.
    pub fn trains_when_idle(&self) -> bool {
        match self.site {
            Site::Device { trained, .. } => trained || self.fresh.load(Ordering::Relaxed),
            Site::Host { .. } => false,
        }
    }

    /// Between rounds: train while at most [`EagleConfig::tail_batch`] requests run (on the device: one step now;
    /// on the host: the trainer thread resumed), pause above it.
    pub fn on_round(&mut self, running: usize) {
        let train = running <= self.tail_batch;
        match &mut self.site {
            Site::Host { worker, training, .. } => {
                if train && !*training {
                    worker.resume();
                } else if !train && *training {
                    worker.pause();
                }
                *training = train;
            }
            Site::Device { .. } if train => self.device_step(),
            Site::Device { .. } => {}
        }
    }

    /// One step of the device trainer within the version's budget; publishes every `publish_every` steps.
    fn device_step(&mut self) {
        let Site::Device { trainer, publish_every, budget, trained } = &mut self.site else { return };
        self.fresh.store(false, Ordering::Relaxed);
        if budget_spent(trainer.steps_done(), self.epoch_start.load(Ordering::Relaxed), *budget) {
            *trained = false;
            return;
        }
        *trained = match trainer.step_from_buffer(&self.buffer) {
            Ok(Some(_)) => true,
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = %e, "an online drafter step on the device failed");
                false
            }
        };
        let steps = trainer.steps_done();
        self.stats.steps.store(steps, Ordering::Relaxed);
        if *trained && steps.is_multiple_of(*publish_every) {
            match trainer.runtime(&RuntimeOptions::default()) {
                Ok(rt) => {
                    self.slot.publish(rt);
                    self.stats.version.store(self.slot.version(), Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(error = %e, "publishing the device-trained drafter"),
            }
        }
    }

    /// The served weights changed to `model` (nothing runs): the trainer stops, the drafter takes the new
    /// embedding and LM head, the engines get the result, samples start a new version, and the trainer is
    /// checkpointed. Training resumes at the next round in the tail.
    ///
    /// Returns whether a checkpoint was written.
    ///
    /// # Errors
    /// When the drafter does not fit `model` or the checkpoint cannot be written.
    pub fn retarget(&mut self, model: &Llama) -> Result<bool> {
        let opts = RuntimeOptions::default();
        let steps = match &mut self.site {
            Site::Host { trainer, worker, training } => {
                worker.pause();
                *training = false;
                let mut t = trainer.lock();
                t.set_target(FrozenTarget::new(model)).map_err(|e| drafter_err("the new weights", e))?;
                self.slot.publish(t.runtime(&opts).map_err(|e| drafter_err("packing", e))?);
                t.steps_done()
            }
            Site::Device { trainer, trained, .. } => {
                trainer.set_target(model).map_err(|e| drafter_err("the new weights", e))?;
                self.slot.publish(trainer.runtime(&opts).map_err(|e| drafter_err("packing", e))?);
                *trained = true;
                trainer.steps_done()
            }
        };
        self.epoch_start.store(steps, Ordering::Relaxed);
        self.epoch += 1;
        self.buffer.set_step(self.epoch);
        self.report();
        self.save()
    }

    /// Saves the trainer to [`EagleConfig::checkpoint`] (a host trainer waits for the step in flight). Returns
    /// whether it wrote one (not without a checkpoint directory).
    ///
    /// # Errors
    /// When the checkpoint cannot be written.
    pub fn save(&mut self) -> Result<bool> {
        let Some(dir) = &self.checkpoint else { return Ok(false) };
        let saved = match &mut self.site {
            Site::Host { trainer, .. } => trainer.lock().save_checkpoint(dir),
            Site::Device { trainer, .. } => trainer.save_checkpoint(dir),
        };
        saved.map_err(|e| drafter_err(&format!("saving to {}", dir.display()), e))?;
        self.stats.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Refreshes the figures the trainer thread does not keep (it keeps steps and versions as it publishes).
    fn report(&self) {
        self.stats.version.store(self.slot.version(), Ordering::Relaxed);
        let held = self.buffer.stats();
        self.stats.samples.store(held.held as u64, Ordering::Relaxed);
        self.stats.buffer_bytes.store(held.held_bytes as u64, Ordering::Relaxed);
    }
}
