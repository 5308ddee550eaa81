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
use tlt_spec_decode::{Drafter, DrafterSet, Finished, HybridDrafter, NgramDrafter, SuffixConfig, SuffixDrafter};

use super::config::{DrafterChoice, DrafterSchedule, SdConfig};
use super::types::GpuHandle;
use crate::{Error, Result};

#[path = "drafter_replica.rs"]
mod replica;

/// One rank's part in the replicated drafter (its methods are in `drafter_replica.rs`). Declared here, beside
/// the [`RolloutDrafter`] that holds it, so that this file names nothing of that child module, which extends
/// `RolloutDrafter` and so imports this one.
struct Replica {
    comm: super::parallel::SharedComm,
    /// Features this rank sent to the trainer this step.
    sent_features: std::sync::atomic::AtomicU64,
    /// Features the trainer received this step.
    received_features: u64,
    /// Versions the trainer sent to each rank this step.
    sent_weights: Vec<u64>,
    /// Versions this rank received this step.
    received_weights: u64,
    /// Versions this rank installed mid-rollout this step.
    swaps: u64,
    /// Drafter steps the trainer took in its idle time this step, and their seconds.
    idle_steps: u64,
    idle_s: f64,
    /// `fixed` schedule: the trainer holds the step's features, `(rank, sample)` in arrival order, until the step's
    /// end, and takes them in in rank order then ([`Self::take_in`]); otherwise features enter the buffer at once.
    ordered: Option<std::sync::Mutex<Vec<(usize, FeatureSample)>>>,
}

/// The online EAGLE-2 drafter: trainer, sample buffer, weights slot and background worker.
pub(crate) struct OnlineEagle {
    trainer: Arc<Mutex<DrafterTrainer>>,
    buffer: Arc<OnlineBuffer>,
    slot: Arc<WeightsSlot<DraftRuntime>>,
    worker: Option<BackgroundTrainer>,
    schedule: DrafterSchedule,
    tail_batch: usize,
    publish_every: u64,
    /// The worker is running (tail schedule).
    training: bool,
    /// Wall seconds the worker ran in the current rollout.
    train_since: Option<Instant>,
    train_s: f64,
    /// Its part in a data-parallel job ([`RolloutDrafter::replicate`]).
    replica: Option<Replica>,
}

/// The device executor EAGLE proposers share when rollouts run on a device (built once: cache, buffers).
type DeviceExec = Arc<Mutex<tlt_drafter::cuda::CudaDrafter>>;

/// Where the EAGLE drafter's forward runs when rollouts run on a device: built at the first rollout that drafts (as
/// the device target is), on the rollouts' device, then shared by every rollout's proposers.
struct DeviceDrafter {
    handle: Arc<GpuHandle>,
    slots: usize,
    max_len: usize,
    exec: Mutex<Option<DeviceExec>>,
}

impl DeviceDrafter {
    /// The shared executor, built on first use.
    ///
    /// # Errors
    /// When the device cannot be opened or allocated on (never a panic).
    fn exec(&self) -> Result<DeviceExec> {
        use tlt_drafter::cuda::{CudaDraftOptions, CudaDrafter};
        let mut slot = self.exec.lock();
        if let Some(e) = slot.as_ref() {
            return Ok(e.clone());
        }
        let opts = CudaDraftOptions { slots: self.slots, max_len: self.max_len };
        let e: DeviceExec = Arc::new(Mutex::new(CudaDrafter::new(self.handle.gpu()?, opts)?));
        *slot = Some(e.clone());
        Ok(e)
    }
}

/// The drafters of TLT rollouts: one or several kinds ([`SdConfig::kinds`]), with the online EAGLE-2 drafter
/// when a kind uses it; its forward runs on the rollout's device.
pub(crate) struct RolloutDrafter {
    kinds: Vec<DrafterChoice>,
    suffix: SuffixConfig,
    eagle: Option<Box<OnlineEagle>>,
    device: Option<DeviceDrafter>,
}

impl std::fmt::Debug for RolloutDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutDrafter")
            .field("kinds", &self.kinds)
            .field("eagle_version", &self.eagle.as_ref().map(|e| e.slot.version()))
            .finish()
    }
}

impl RolloutDrafter {
    /// The drafters for `policy` as `cfg` says (a fresh EAGLE-2 drafter when a kind needs one).
    pub(crate) fn new(cfg: &SdConfig, policy: &Llama) -> Result<Self> {
        if !cfg.has_eagle() {
            return Ok(Self { kinds: cfg.kinds(), suffix: cfg.suffix, eagle: None, device: None });
        }
        let dcfg = DrafterConfig::eagle2_from_target(policy.config(), false);
        let d = Eagle2Drafter::random(dcfg, FrozenTarget::new(policy), cfg.drafter_seed)?;
        Self::eagle(cfg, DrafterTrainer::new(d, cfg.drafter_train.clone())?, 0, OnlineBuffer::new(cfg.buffer)?)
    }

    /// The drafters of `cfg` with this EAGLE-2 drafter trainer and sample buffer, publishing from weights version
    /// `version` on.
    pub(crate) fn eagle(cfg: &SdConfig, trainer: DrafterTrainer, version: u64, buffer: OnlineBuffer) -> Result<Self> {
        let slot = Arc::new(WeightsSlot::with_version(trainer.runtime(&RuntimeOptions::default())?, version));
        let trainer = Arc::new(Mutex::new(trainer));
        let buffer = Arc::new(buffer);
        let worker = match cfg.schedule {
            DrafterSchedule::Tail => {
                let step_cfg =
                    OnlineStepConfig { publish_every: cfg.publish_every, runtime: RuntimeOptions::default() };
                let step = online_step_fn(trainer.clone(), buffer.clone(), slot.clone(), step_cfg)?;
                Some(BackgroundTrainer::spawn(step, Duration::from_millis(5)))
            }
            _ => None,
        };
        let eagle = OnlineEagle {
            trainer,
            buffer,
            slot,
            worker,
            schedule: cfg.schedule,
            tail_batch: cfg.tail_batch,
            publish_every: cfg.publish_every,
            training: false,
            train_since: None,
            train_s: 0.0,
            replica: None,
        };
        Ok(Self { kinds: cfg.kinds(), suffix: cfg.suffix, eagle: Some(Box::new(eagle)), device: None })
    }

    /// Runs the EAGLE drafter's forward on the rollouts' device (`handle`) for up to `slots` running requests of up
    /// to `max_len` positions, from the first rollout on; a no-op without an EAGLE kind.
    pub(crate) fn draft_on_device(&mut self, handle: Arc<GpuHandle>, slots: usize, max_len: usize) {
        if self.eagle.is_some() {
            self.device = Some(DeviceDrafter { handle, slots, max_len, exec: Mutex::new(None) });
        }
    }

    /// Device bytes of the EAGLE drafter's forward once it runs on the rollouts' device: its weights (bf16) and KV
    /// cache (0 on the CPU or without an EAGLE drafter).
    pub(crate) fn device_bytes(&self) -> u64 {
        let (Some(e), Some(d)) = (self.eagle.as_ref(), self.device.as_ref()) else { return 0 };
        let t = e.trainer.lock();
        let params: usize = t.drafter().named_tensors().iter().map(|(_, w)| w.elem_count()).sum();
        2 * params as u64 + super::memory::kv_bytes(&t.drafter().config().llama, d.slots, d.max_len)
    }

    /// Whether the engine must record hidden states for these drafters.
    pub(crate) fn needs_hidden(&self) -> bool {
        self.eagle.is_some()
    }

    /// A fresh proposer for one rollout (per-request drafter state lives in it): the one kind, or a
    /// [`DrafterSet`] of the kinds in order (the bandit's drafter index).
    pub(crate) fn proposer(&self) -> Result<Box<dyn Drafter>> {
        let mut members = self.kinds.iter().map(|&k| self.member(k)).collect::<Result<Vec<_>>>()?;
        if members.len() == 1 {
            if let Some(m) = members.pop() {
                return Ok(m);
            }
        }
        Ok(Box::new(DrafterSet::new(members)?))
    }

    fn member(&self, kind: DrafterChoice) -> Result<Box<dyn Drafter>> {
        let slot = || -> Result<Arc<WeightsSlot<DraftRuntime>>> {
            let e = self.eagle.as_ref().ok_or_else(|| Error::InvalidArgument("no EAGLE drafter".into()))?;
            Ok(e.slot.clone())
        };
        if let (Some(d), DrafterChoice::Eagle2 | DrafterChoice::Hybrid) = (&self.device, kind) {
            let eagle = EagleProposer::with_executor(slot()?, d.exec()?);
            return Ok(if kind == DrafterChoice::Hybrid {
                Box::new(HybridDrafter::new(SuffixDrafter::new(self.suffix)?, eagle))
            } else {
                Box::new(eagle)
            });
        }
        let eagle = || -> Result<EagleProposer> { Ok(EagleProposer::new(slot()?)) };
        Ok(match kind {
            DrafterChoice::Ngram => Box::new(NgramDrafter::default()),
            DrafterChoice::Suffix => Box::new(SuffixDrafter::new(self.suffix)?),
            DrafterChoice::Eagle2 => Box::new(eagle()?),
            DrafterChoice::Hybrid => Box::new(HybridDrafter::new(SuffixDrafter::new(self.suffix)?, eagle()?)),
        })
    }

    /// A rollout starts: the buffer moves to RL step `step`.
    pub(crate) fn begin_rollout(&mut self, step: u64) {
        if let Some(e) = self.eagle.as_mut() {
            e.buffer.set_step(step);
            e.train_s = 0.0;
        }
    }

    /// A request finished: its tokens and hidden states become training data.
    pub(crate) fn on_finished(&self, f: &Finished, step: u64) -> Result<()> {
        if let Some(e) = self.eagle.as_ref() {
            let sample = FeatureSample::from_finished(f, step)?;
            if sample.train_positions() > 0 {
                Self::keep_features(e, sample)?;
            }
        }
        Ok(())
    }

    /// After each round: in the tail (at most `tail_batch` running) the background worker trains; a data-parallel
    /// replica takes in what other ranks sent (features on the trainer, new versions elsewhere).
    ///
    /// # Errors
    /// A replica's message that fails to decode or install; the communicator's failure.
    pub(crate) fn on_round(&mut self, running: usize) -> Result<()> {
        if let Some(e) = self.eagle.as_mut() {
            Self::poll_replica(e)?;
            if let Some(w) = &e.worker {
                if !e.training && running <= e.tail_batch && running > 0 {
                    w.resume();
                    e.training = true;
                    e.train_since = Some(Instant::now());
                }
            }
        }
        Ok(())
    }

    /// The rollout ended: stop the worker (or run the fixed steps). Returns drafter training seconds of this
    /// rollout and the preemption latency of the stop (tail schedule).
    pub(crate) fn end_rollout(&mut self) -> Result<(f64, Option<Duration>)> {
        let Some(e) = self.eagle.as_mut() else { return Ok((0.0, None)) };
        let mut latency = None;
        if let (Some(w), true) = (&e.worker, e.training) {
            latency = Some(w.pause());
            e.training = false;
            if let Some(t) = e.train_since.take() {
                e.train_s += t.elapsed().as_secs_f64();
            }
        }
        // A data-parallel replica trains in the trainer rank's idle time and at the step's end instead.
        if let (DrafterSchedule::Fixed { steps }, None) = (e.schedule, &e.replica) {
            let t = Instant::now();
            let step_cfg = OnlineStepConfig { publish_every: e.publish_every, runtime: RuntimeOptions::default() };
            let mut step = online_step_fn(e.trainer.clone(), e.buffer.clone(), e.slot.clone(), step_cfg)?;
            for _ in 0..steps {
                if step()? == MicroStepOutcome::NoData {
                    break;
                }
                tlt_model::chaos::kill_point("drafter.step");
            }
            e.train_s += t.elapsed().as_secs_f64();
        }
        Ok((e.train_s, latency))
    }

    /// The policy changed: point the drafter at its new embedding and head and publish the result.
    pub(crate) fn retarget(&self, policy: &Llama) -> Result<()> {
        if let Some(e) = self.eagle.as_ref() {
            let mut t = e.trainer.lock();
            t.set_target(FrozenTarget::new(policy))?;
            e.slot.publish(t.runtime(&RuntimeOptions::default())?);
        }
        Ok(())
    }

    /// Published weights version (0 for the n-gram drafter).
    pub(crate) fn version(&self) -> u64 {
        self.eagle.as_ref().map_or(0, |e| e.slot.version())
    }

    /// EAGLE weight versions uploaded to the rollout device so far (0 when the drafter runs on the CPU).
    pub(crate) fn device_uploads(&self) -> u64 {
        if let Some(e) = self.device.as_ref().and_then(|d| d.exec.lock().clone()) {
            return e.lock().uploads();
        }
        0
    }

    /// Drafter optimizer steps so far.
    pub(crate) fn steps(&self) -> u64 {
        self.eagle.as_ref().map_or(0, |e| e.trainer.lock().steps_done())
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
        let Some(e) = self.eagle.as_ref() else { return Ok(None) };
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

    /// Checkpoints the drafter trainer into `dir` (nothing for the model-free drafters).
    pub(crate) fn save(&self, dir: &Path) -> Result<()> {
        if let Some(e) = self.eagle.as_ref() {
            e.trainer.lock().save_checkpoint(dir)?;
        }
        Ok(())
    }

    /// Writes the online sample buffer to `path` (nothing for the model-free drafters).
    pub(crate) fn save_buffer(&self, path: &Path) -> Result<()> {
        if let Some(e) = self.eagle.as_ref() {
            e.buffer.save(path)?;
        }
        Ok(())
    }

    /// Exports the drafter's weights now in the format the serving engines load (EAGLE-2: the original EAGLE
    /// layout; EAGLE-3: the SGLang/vLLM format) to `dir`; returns its kind, or `None` (nothing written) for the
    /// model-free drafters.
    pub(crate) fn export(&self, dir: &Path, dtype: SaveDType) -> Result<Option<DrafterKind>> {
        let Some(e) = self.eagle.as_ref() else { return Ok(None) };
        let t = e.trainer.lock();
        match t.drafter() {
            TrainableDrafter::Eagle2(d) => save_eagle2_serving(d, dir, dtype)?,
            TrainableDrafter::Eagle3(d) => save_eagle3(d, dir, dtype)?,
        }
        Ok(Some(t.drafter().kind()))
    }

    /// Stops the background worker.
    pub(crate) fn shutdown(&mut self) -> Result<()> {
        if let Some(e) = self.eagle.as_mut() {
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
