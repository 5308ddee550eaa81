//! The reference TLT trainer: GRPO steps of rollout → reward → policy update → publication, with adaptive
//! speculative rollouts and an online drafter in [`Mode::Tlt`], plain rollouts in [`Mode::Baseline`], and
//! atomic checkpoints that resume exactly.
//!
//! One step:
//! 1. **Rollout.** `prompts_per_step` prompts from the [`Environment`] at the next data positions, `group_size`
//!    samples each, decoded by one batched engine. In TLT mode the [`AdaptiveDecoder`] turns SD on when the running
//!    batch has shrunk (the long tail) and the bandit picks the plan; finished requests feed the drafter's buffer,
//!    and (tail schedule) the drafter trains in the background while the batch is small.
//! 2. **Reward**, overlapped with the rollout: each answer is scored as soon as it finishes, on worker threads,
//!    under a deadline ([`ScoringConfig`]); an overlong penalty is added if configured. With dynamic sampling
//!    ([`DynamicSampling`]) groups whose rewards are all equal are set aside and more prompts are rolled out.
//! 3. **Update.** Group-relative advantages, micro-batches by token budget with gradient accumulation, equal
//!    mini-batches, AdamW at the scheduled learning rate; a step whose gradient norm is not finite is skipped.
//! 4. **Publication.** The rollout model becomes a snapshot of the new policy; the drafter is pointed at the new
//!    embedding and LM head and republished.
//!
//! A step that fails stops the trainer: its rollout has already fed the drafter and the bandit (and its update
//! may have moved the weights), so later steps and checkpoints are refused with the reason, and the run resumes
//! from its last checkpoint ([`Trainer::resume`]), which restores everything a step reads.
//!
//! [`Trainer::export`] writes the byproduct: the policy as a Hugging Face directory and its drafter in the EAGLE
//! format SGLang and vLLM serve (see [`ExportConfig`]).

mod checkpoint;
mod config;
mod device;
mod drafter;
mod env;
mod export;
mod generate;
mod head;
mod memory;
mod parallel;
mod reward;
mod rollout;
#[cfg(test)]
mod tests;
mod types;
mod update;
mod update_device;
mod warmup;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use tlt_drafter::DrafterTrainer;
use tlt_kernels::SplitMix64;
use tlt_model::optim::AdamW;
use tlt_model::{Llama, WeightDType};
use tlt_scheduler::AdaptiveDecoder;

pub use crate::ceiling::{SdCeiling, CEILING_DEPTHS};
pub use checkpoint::{TrainerState, DRAFTER_BUFFER_FILE, DRAFTER_DIR, OPTIMIZER_FILE, POLICY_DIR, STATE_FILE};
pub use config::{
    DrafterChoice, DrafterSchedule, DynamicSampling, Mode, OptimConfig, SdConfig, TrainerConfig, WarmupConfig,
};
pub use env::{Environment, Prompt, TextEnv};
pub use export::{
    make_readable, serve_commands, serve_instructions, tokenizer_config, ExportConfig, Exported, EXPORT_DRAFTER_DIR,
    EXPORT_POLICY_DIR, SERVE_FILE,
};
pub use memory::{update_options, weight_count, DeviceMemoryPlan};
pub use parallel::shard;
pub use reward::ScoringConfig;
pub use rollout::{Observer, Quiet, RolloutOutput};
pub use types::Sample;
pub use update::UpdateStats;
pub use warmup::{cache_key, WarmupReport, WARMUP_DATA_BASE};

use crate::grpo::group_advantages;
use crate::metrics::StepMetrics;
use crate::task::{Score, Split};
use crate::{Error, Result};
use device::RolloutDevice;
use drafter::RolloutDrafter;

use reward::RewardPool;
use rollout::{spec_params, RolloutJob};
use update::{policy_update, HostUpdate, TrainSeq, UpdateContext};

/// Greedy evaluation of the current policy.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Evaluation {
    /// Prompts evaluated.
    pub prompts: usize,
    /// Mean reward.
    pub reward_mean: f64,
    /// Fraction correct.
    pub accuracy: f64,
    /// Fraction in the required format.
    pub format_rate: f64,
    /// Mean response length (tokens).
    pub mean_len: f64,
    /// Wall seconds.
    pub seconds: f64,
    /// Whether each prompt was answered correctly, in prompt order (for paired comparisons of two evaluations
    /// on the same prompts).
    #[serde(default)]
    pub correct: Vec<bool>,
}

/// Everything one [`Trainer::step`] produced.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The metrics line.
    pub metrics: StepMetrics,
    /// The samples with their scores and rewards (group-major).
    pub samples: Vec<(Sample, Score, f64)>,
    /// The update.
    pub update: UpdateStats,
}

/// A GRPO run over one policy and one environment.
pub struct Trainer<E: Environment> {
    cfg: TrainerConfig,
    policy: Llama,
    opt: AdamW,
    /// The policy packed for inference; dropped during the update (its memory goes to the update's peak instead)
    /// and snapshotted again when the update is done.
    rollout_model: Option<Llama>,
    reference: Option<Llama>,
    decoder: AdaptiveDecoder,
    drafter: Option<RolloutDrafter>,
    /// Where rollouts run.
    rollouts: RolloutDevice,
    /// The environment, behind the workers that score answers as they finish.
    scoring: RewardPool<E>,
    step: u64,
    /// Prompts drawn so far: the next step's first data position.
    data_pos: u64,
    /// Why the trainer refuses to go on (a step failed); `None` while it is usable.
    stopped: Option<String>,
    /// The data-parallel job this trainer is one rank of ([`Trainer::with_comm`]).
    comm: parallel::SharedComm,
    /// Every rank's gate and bandit state from the checkpoint this trainer resumed, for [`Trainer::with_comm`].
    resumed_decoders: Vec<tlt_scheduler::DecoderState>,
    /// Whether the device memory plan was checked and reported (before the first rollout on a device).
    memory_checked: bool,
}

impl<E: Environment> std::fmt::Debug for Trainer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer").field("step", &self.step).field("mode", &self.cfg.mode).finish_non_exhaustive()
    }
}

/// Puts the EAGLE drafter's forward on the rollouts' device, with room for the running requests, a prompt, the
/// answer and the largest draft tree.
fn draft_on(cfg: &TrainerConfig, d: &mut RolloutDrafter, handle: Arc<types::GpuHandle>) {
    let slots = cfg.rollout.max_running.min(cfg.prompts_per_step * cfg.group_size).max(1);
    let max_len = cfg.max_prompt_tokens + cfg.max_new_tokens + tlt_kernels::cuda::MAX_TREE_NODES;
    d.draft_on_device(handle, slots, max_len);
}

/// A deep copy of `policy` for inference (the rollout never sees a half-updated policy).
fn snapshot(policy: &Llama) -> Result<Llama> {
    let mut m = policy.deep_copy()?;
    m.pack_for_inference(WeightDType::F32)?;
    Ok(m)
}

/// The trainer's inference copy of the policy (absent only if copying the policy after an update failed).
fn inference_copy(m: &Option<Llama>) -> Result<&Llama> {
    m.as_ref().ok_or_else(|| {
        Error::InvalidArgument("the trainer has no rollout model since a failed step: resume from a checkpoint".into())
    })
}

/// The rollout sampling seed of RL step `step` (its first rollout; dynamic sampling's later rollouts fork it).
fn step_seed(seed: u64, step: u64) -> u64 {
    SplitMix64::new(seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next_u64()
}

impl<E: Environment> Trainer<E> {
    /// A trainer at step 0 for `policy` (f32; its weights become trainable in place).
    ///
    /// # Errors
    /// An invalid config, or a model/drafter construction failure.
    pub fn new(policy: Llama, env: E, cfg: TrainerConfig) -> Result<Self> {
        cfg.validate()?;
        let drafter = match cfg.mode {
            Mode::Tlt => Some(RolloutDrafter::new(&cfg.sd, &policy)?),
            Mode::Baseline => None,
        };
        Self::assemble(policy, env, cfg, drafter, 0)
    }

    fn assemble(
        mut policy: Llama,
        env: E,
        cfg: TrainerConfig,
        drafter: Option<RolloutDrafter>,
        step: u64,
    ) -> Result<Self> {
        let reference = match cfg.grpo.kl {
            Some(_) => Some(snapshot(&policy)?),
            None => None,
        };
        let vars = policy.make_trainable()?;
        let opt = AdamW::new(vars, cfg.adamw())?;
        let rollout_model = Some(snapshot(&policy)?);
        let decoder = match cfg.mode {
            Mode::Tlt => AdaptiveDecoder::new(cfg.sd.gate.clone(), cfg.sd.bandit())?,
            Mode::Baseline => AdaptiveDecoder::plain()?,
        };
        if cfg.device.is_cuda() && cfg.update_on_device {
            tlt_model::cuda::train::check_trainable(policy.config())
                .map_err(|e| Error::config("update_on_device", e.to_string()))?;
        }
        let rollouts = RolloutDevice::new(cfg.device)?;
        if cfg.device.is_cuda() && !cfg.update_on_device && cfg.grpo.tis_cap.is_none() {
            tracing::warn!(
                "rollouts on {} compute log-probabilities in bf16 while the update runs f32 on the CPU; consider \
                 grpo.tis_cap (truncated importance sampling) to correct for the mismatch",
                cfg.device
            );
        }
        let mut drafter = drafter;
        if let (true, Some(d)) = (rollouts.handle().on_device(), drafter.as_mut()) {
            draft_on(&cfg, d, rollouts.handle().clone());
        }
        let scoring = RewardPool::new(Arc::new(env), cfg.scoring.clone());
        let data_pos = step * cfg.prompts_per_step as u64;
        Ok(Self {
            cfg,
            policy,
            opt,
            rollout_model,
            reference,
            decoder,
            drafter,
            rollouts,
            scoring,
            step,
            data_pos,
            stopped: None,
            comm: Arc::new(tlt_comm::SelfComm),
            resumed_decoders: Vec::new(),
            memory_checked: false,
        })
    }

    /// Resumes the run checkpointed in `dir` (first brought to a complete state by [`tlt_model::recover_dir`], if a
    /// kill interrupted its last write). `initial` is the run's starting policy (the KL reference; its
    /// weights are replaced by the checkpoint's); `cfg` must equal the checkpoint's config except for `steps`,
    /// `device` and `scoring`.
    ///
    /// Everything a step reads comes back: the policy and its AdamW moments, the step and the data position, the
    /// SD gate's and the bandit's state, the drafter trainer (weights, moments, step count) and its sample buffer.
    /// Decisions that depend on wall time are not reproducible by any run, resumed or not: see
    /// [`TrainerConfig`]'s `sd` (the bandit's tokens-per-second rewards when a bucket has several arms), the tail
    /// drafter schedule and the scoring deadline.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] if the checkpoint is incomplete or belongs to another run.
    pub fn resume(dir: &Path, initial: Llama, env: E, cfg: TrainerConfig) -> Result<Self> {
        tlt_model::recover_dir(dir)?;
        let state = TrainerState::read(dir)?;
        // The step count, the rollout device, where the update runs and the scoring workers may change on resume.
        let same = TrainerConfig {
            steps: cfg.steps,
            device: cfg.device,
            update_on_device: cfg.update_on_device,
            scoring: cfg.scoring.clone(),
            ..state.config.clone()
        };
        if same != cfg {
            return Err(Error::Checkpoint {
                path: dir.into(),
                reason: "the config differs from the checkpoint's".into(),
            });
        }
        let saved = tlt_model::load_hf_dir(&dir.join(POLICY_DIR))?.model;
        let drafter = match cfg.mode {
            Mode::Tlt if cfg.sd.has_eagle() => {
                let t = DrafterTrainer::resume(&dir.join(DRAFTER_DIR), &saved)?;
                let buffer = tlt_drafter::online::OnlineBuffer::load(cfg.sd.buffer, &dir.join(DRAFTER_BUFFER_FILE))?;
                Some(RolloutDrafter::eagle(&cfg.sd, t, state.drafter_version, buffer)?)
            }
            Mode::Tlt => Some(RolloutDrafter::new(&cfg.sd, &saved)?),
            Mode::Baseline => None,
        };
        let mut t = Self::assemble(initial, env, cfg, drafter, state.step)?;
        t.data_pos = state.data_pos;
        t.decoder.restore(&state.decoder).map_err(|e| Error::Checkpoint { path: dir.into(), reason: e.to_string() })?;
        t.resumed_decoders = state.rank_decoders.clone();
        let saved_w: std::collections::HashMap<String, candle_core::Tensor> =
            saved.weights().named_tensors().into_iter().collect();
        for (name, var) in t.opt.params() {
            let w = saved_w
                .get(name)
                .ok_or_else(|| Error::Checkpoint { path: dir.join(POLICY_DIR), reason: format!("missing `{name}`") })?;
            if w.dims() != var.dims() {
                return Err(Error::Checkpoint {
                    path: dir.join(POLICY_DIR),
                    reason: format!("`{name}` has the wrong shape"),
                });
            }
            var.set(w)?;
        }
        checkpoint::load_optimizer(&mut t.opt, &dir.join(OPTIMIZER_FILE), &state)?;
        t.rollout_model = Some(snapshot(&t.policy)?);
        Ok(t)
    }

    /// Makes this trainer rank [`Comm::rank`](tlt_comm::Comm::rank) of a data-parallel job of
    /// [`Comm::size`](tlt_comm::Comm::size) ranks (see [`shard`]): every rank builds its trainer from the same
    /// policy, config and checkpoint, then calls this (collectively: it checks that all ranks agree).
    ///
    /// Each rank decodes and scores its [`shard`] of every step's groups, with coins keyed by the requests'
    /// indices in the whole step, so the tokens do not depend on the number of ranks; a rank out of work takes
    /// groups others have not started ([`TrainerConfig::steal_queued_groups`]); the shards are gathered, each rank
    /// computes the gradients of its own groups, and the summed gradients make the same update on every rank. The
    /// online EAGLE drafter is replicated: rank 0 trains it on every rank's features once its own share is decoded,
    /// and the ranks still decoding hot-swap its versions between rounds; every rank ends the step on rank 0's
    /// version. Rank 0 writes checkpoints ([`Self::save_checkpoint`]); a resume rebuilds every rank from them.
    ///
    /// # Errors
    /// With several ranks: dynamic sampling (not supported across ranks yet); ranks whose configs or steps differ;
    /// the communicator's failure.
    pub fn with_comm(mut self, comm: Arc<dyn tlt_comm::Comm>) -> Result<Self> {
        if comm.size() > 1 {
            if self.cfg.dynamic_sampling.is_some() {
                return Err(Error::config(
                    "dynamic_sampling",
                    "not supported across data-parallel ranks yet (each rank would need the others' informative groups)",
                ));
            }
            parallel::check_same(comm.as_ref(), "trainer", &self.cfg)?;
            parallel::check_same(comm.as_ref(), "step", &(self.step, self.data_pos))?;
            if let Some(d) = self.drafter.as_mut() {
                d.replicate(comm.clone())?;
            }
            match self.resumed_decoders.get(comm.rank()) {
                Some(own) if self.resumed_decoders.len() == comm.size() => self.decoder.restore(own)?,
                Some(_) => tracing::warn!(
                    saved = self.resumed_decoders.len(),
                    ranks = comm.size(),
                    "the checkpoint holds the SD gate and bandit of another number of ranks: every rank resumes rank \
                     0's"
                ),
                None => {}
            }
        }
        self.resumed_decoders.clear();
        self.comm = comm;
        Ok(self)
    }

    /// Runs the rollouts (and the EAGLE drafter's forward) on `gpu` from now on, whatever `device` the config
    /// names: a device the caller opened (`tlt_kernels::cuda::CudaGpu`), or the simulated device (`tlt-cuda-sim`'s
    /// `SimGpu`), on which CI runs the trainer's device path.
    #[must_use]
    pub fn with_gpu(mut self, gpu: tlt_kernels::cuda::SharedGpu) -> Self {
        let handle = Arc::new(types::GpuHandle::with(gpu));
        self.rollouts = RolloutDevice::on(handle.clone());
        if let Some(d) = self.drafter.as_mut() {
            draft_on(&self.cfg, d, handle);
        }
        self
    }

    /// The device memory this trainer plans for, part by part (`None` with rollouts on the CPU): the rollout
    /// engine's policy, KV cache (prompts up to `max_prompt_tokens`) and graph pool, the EAGLE drafter's forward,
    /// and with the update on the device its reference, f32 state and activations ([`DeviceMemoryPlan::new`]).
    /// Checked against the device's memory and logged before the first rollout.
    pub fn device_memory_plan(&self) -> Option<DeviceMemoryPlan> {
        if !self.rollouts.handle().on_device() {
            return None;
        }
        let params = self.policy.weights().num_params() as u64;
        let drafter = self.drafter.as_ref().map_or(0, RolloutDrafter::device_bytes);
        Some(DeviceMemoryPlan::new(self.policy.config(), params, &self.cfg, drafter))
    }

    /// With rollouts on a device, every prompt within the room the device's caches reserve (`max_prompt_tokens`).
    fn check_prompt_room(&self, prompts: &[Prompt]) -> Result<()> {
        let room = self.cfg.max_prompt_tokens;
        match prompts.iter().find(|p| p.ids.len() > room) {
            Some(p) if self.rollouts.handle().on_device() => Err(Error::config(
                "max_prompt_tokens",
                format!(
                    "prompt {} has {} tokens, more than the {room} the device's caches reserve",
                    p.index,
                    p.ids.len()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Once, before the first rollout on a device: the memory plan against the device's memory (an error when it
    /// cannot fit), logged.
    fn check_device_memory(&mut self) -> Result<()> {
        if self.memory_checked {
            return Ok(());
        }
        let Some(plan) = self.device_memory_plan() else { return Ok(()) };
        if self.cfg.update_on_device {
            // A device given after `new` (`with_gpu`): the architecture's check `new` makes for a CUDA config.
            tlt_model::cuda::train::check_trainable(self.policy.config())
                .map_err(|e| Error::config("update_on_device", e.to_string()))?;
        }
        let gpu = self.rollouts.handle().gpu()?;
        let (free, total) = gpu.memory().map_err(|e| Error::Model(e.into()))?;
        tracing::info!(device = %gpu.info().name, free, total, "device memory plan:\n{plan}");
        if plan.total() > total as u64 {
            return Err(Error::config(
                "device",
                format!("the run needs {} bytes of device memory, the device has {total}:\n{plan}", plan.total()),
            ));
        }
        self.memory_checked = true;
        Ok(())
    }

    /// The groups of a step whose sequences this rank trains on (every group for one rank).
    fn owned_groups(&self) -> Range<usize> {
        match self.comm.size() {
            1 => 0..usize::MAX,
            n => parallel::shard(self.cfg.prompts_per_step, n, self.comm.rank()),
        }
    }

    /// This trainer's rank in its data-parallel job (0 for one process).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the data-parallel job (1 for one process).
    pub fn ranks(&self) -> usize {
        self.comm.size()
    }

    /// Writes a checkpoint of the run so far to `dir` (atomically). In a data-parallel job rank 0 writes it (every
    /// rank holds the same state) and every rank returns its outcome: call it on every rank.
    ///
    /// # Errors
    /// On an I/O failure, or after a failed step ([`Error::Stopped`]: the state is no longer a step boundary's).
    pub fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        self.check_usable()?;
        if self.comm.size() == 1 {
            return self.write_checkpoint(dir, Vec::new());
        }
        // Every rank's gate and bandit (they learn from their own rollouts), for a resume on as many ranks.
        let parts = self.comm.all_gather_bytes(&parallel::encode(&self.decoder.state())?)?;
        let mut outcome = match self.comm.rank() {
            0 => match parts
                .iter()
                .enumerate()
                .map(|(r, b)| parallel::decode(b, r))
                .collect::<Result<Vec<_>>>()
                .and_then(|decoders| self.write_checkpoint(dir, decoders))
            {
                Ok(()) => Vec::new(),
                Err(e) => e.to_string().into_bytes(),
            },
            _ => Vec::new(),
        };
        self.comm.broadcast_bytes(0, &mut outcome)?;
        if outcome.is_empty() {
            Ok(())
        } else {
            Err(Error::Checkpoint {
                path: dir.into(),
                reason: format!("rank 0: {}", String::from_utf8_lossy(&outcome)),
            })
        }
    }

    fn write_checkpoint(&self, dir: &Path, rank_decoders: Vec<tlt_scheduler::DecoderState>) -> Result<()> {
        // With the update on a device its moments live there (the host mirrors only the weights each step).
        let synced = match self.rollouts.optimizer_state(&self.opt)? {
            Some(state) => {
                let mut o = AdamW::new(self.opt.params().to_vec(), *self.opt.hyper())?;
                o.set_state(state)?;
                Some(o)
            }
            None => None,
        };
        let opt = synced.as_ref().unwrap_or(&self.opt);
        tlt_model::write_dir_atomic(dir, |tmp| -> Result<()> {
            tlt_model::save_hf_dir(&self.policy, None, &tmp.join(POLICY_DIR), candle_core::DType::F32)?;
            checkpoint::save_optimizer(opt, &tmp.join(OPTIMIZER_FILE))?;
            if let Some(d) = &self.drafter {
                d.save(&tmp.join(DRAFTER_DIR))?;
                d.save_buffer(&tmp.join(DRAFTER_BUFFER_FILE))?;
            }
            let version = self.drafter.as_ref().map_or(0, RolloutDrafter::version);
            let state = TrainerState {
                rank_decoders,
                ..TrainerState::new(self.step, self.cfg.clone(), opt, version, self.data_pos, self.decoder.state())
            };
            state.write(tmp)
        })
    }

    /// The SD gate's and the plan bandit's state now (what a checkpoint saves of them).
    pub fn decoder_state(&self) -> tlt_scheduler::DecoderState {
        self.decoder.state()
    }

    /// EAGLE drafter weight versions uploaded to the rollout device so far: one when the first rollout drafts, then
    /// one per new version a later round drafted with (trained here, or received from the trainer rank). 0 when
    /// rollouts run on the CPU or without an EAGLE drafter.
    pub fn drafter_device_uploads(&self) -> u64 {
        self.drafter.as_ref().map_or(0, RolloutDrafter::device_uploads)
    }

    /// RL steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The config.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }

    /// The policy being trained.
    pub fn policy(&self) -> &Llama {
        &self.policy
    }

    /// The environment.
    pub fn env(&self) -> &E {
        self.scoring.env()
    }

    /// The policy's inference copy.
    fn rollout_model(&self) -> Result<&Llama> {
        inference_copy(&self.rollout_model)
    }

    /// [`Error::Stopped`] after a failed step.
    fn check_usable(&self) -> Result<()> {
        match &self.stopped {
            Some(why) => Err(Error::Stopped(why.clone())),
            None => Ok(()),
        }
    }

    /// Greedy, plain decoding of one sample per held-out prompt at evaluation positions `indices` with the current
    /// policy.
    ///
    /// # Errors
    /// Engine or environment failures.
    pub fn evaluate(&self, indices: Range<u64>, max_new_tokens: usize) -> Result<Evaluation> {
        let t = Instant::now();
        let prompts = indices.map(|i| self.env().prompt(Split::Eval, i)).collect::<Result<Vec<_>>>()?;
        self.check_prompt_room(&prompts)?;
        let params = spec_params(0.0, 1.0, max_new_tokens, 0);
        let mut plain = AdaptiveDecoder::plain()?;
        let job = RolloutJob {
            limits: self.cfg.rollout,
            prompts: &prompts,
            group_size: 1,
            params,
            rl_step: self.step,
            stream_keys: None,
            record_features: false,
            on_finish: None,
            give_away: None,
        };
        let out = self.rollouts.rollout(self.rollout_model()?, job, &mut plain, None, &mut Quiet)?;
        let mut e = Evaluation { prompts: prompts.len(), ..Evaluation::default() };
        for s in &out.samples {
            let score = self.env().score(&prompts[s.group], &s.tokens)?;
            e.reward_mean += score.reward;
            e.accuracy += f64::from(u8::from(score.correct));
            e.correct.push(score.correct);
            e.format_rate += f64::from(u8::from(score.formatted));
            e.mean_len += s.tokens.len() as f64;
        }
        let n = out.samples.len().max(1) as f64;
        e.reward_mean /= n;
        e.accuracy /= n;
        e.format_rate /= n;
        e.mean_len /= n;
        e.seconds = t.elapsed().as_secs_f64();
        Ok(e)
    }

    /// Runs one RL step.
    ///
    /// # Errors
    /// Any failure of the rollout, the reward, the update or the publication. The trainer then stops: this and
    /// every later call, and [`Self::save_checkpoint`], return [`Error::Stopped`] with the reason (the failed step
    /// already fed the drafter and the bandit, and may have moved the weights); resume from the last checkpoint.
    pub fn step(&mut self, obs: &mut dyn Observer) -> Result<StepReport> {
        self.check_usable()?;
        let mut update = UpdateStats::default();
        let r = self.try_step(obs, &mut update);
        if let Err(e) = &r {
            let moved = if update.optimizer_steps > 0 {
                format!(" after {} of its optimizer steps had moved the weights", update.optimizer_steps)
            } else {
                String::new()
            };
            let why = format!("step {} failed{moved} ({e}); resume the run from its last checkpoint", self.step);
            tracing::error!("{why}");
            self.stopped = Some(why);
        }
        r
    }

    fn try_step(&mut self, obs: &mut dyn Observer, update: &mut UpdateStats) -> Result<StepReport> {
        self.check_device_memory()?;
        let t_step = Instant::now();
        let step = self.step;
        let g = self.cfg.group_size;
        let gen = self.generate(step, obs)?;
        let rewards: Vec<f64> =
            gen.kept.iter().flat_map(|&k| gen.rewards[k * g..(k + 1) * g].iter().copied()).collect();
        let adv = if rewards.is_empty() { None } else { Some(group_advantages(&rewards, g, &self.cfg.grpo)?) };

        obs.on_phase(step, "update");
        let t_train = Instant::now();
        let seqs: Vec<TrainSeq> = gen
            .kept
            .iter()
            .flat_map(|&k| (k * g..(k + 1) * g).map(|i| &gen.out.samples[i]))
            .enumerate()
            .filter(|&(j, s)| adv.as_ref().is_some_and(|a| a.keep(j)) && !s.tokens.is_empty())
            .map(|(j, s)| TrainSeq { sample: s, advantage: adv.as_ref().map_or(0.0, |a| a.values[j]) })
            .collect();
        let lr = self.cfg.optim.schedule.lr_at(step);
        let ctx = UpdateContext {
            policy: &self.policy,
            reference: self.reference.as_ref(),
            grpo: &self.cfg.grpo,
            temperature: self.cfg.temperature,
            max_new_tokens: self.cfg.max_new_tokens,
            micro_batch_tokens: self.cfg.micro_batch_tokens,
            mini_batch_seqs: self.cfg.ppo_mini_batch_size.map_or(usize::MAX, |m| m.saturating_mul(g)),
            ppo_epochs: self.cfg.ppo_epochs,
            checkpoint: self.cfg.activation_checkpointing,
            shuffle_seed: SplitMix64::new(step_seed(self.cfg.seed, step)).fork(0x5eed).next_u64(),
            lr,
            max_grad_norm: self.cfg.optim.max_grad_norm,
            comm: self.comm.as_ref(),
            owned: self.owned_groups(),
        };
        // The rollout's copy of the weights is not needed until the next rollout: free it for the update's peak.
        self.rollout_model = None;
        let opts = memory::update_options(&self.cfg);
        let updated = if self.cfg.update_on_device && self.rollouts.handle().on_device() {
            self.rollouts.update_policy(&ctx, &mut self.opt, &opts, &seqs, update)
        } else {
            policy_update(&ctx, &mut HostUpdate { opt: &mut self.opt }, &seqs, update)
        };
        let train_s = t_train.elapsed().as_secs_f64();

        obs.on_phase(step, "publish");
        let t_pub = Instant::now();
        // Snapshotted even when the update failed, so the error is the update's.
        let model = self.rollout_model.insert(snapshot(&self.policy)?);
        updated?;
        if let Some(d) = &self.drafter {
            d.retarget(model)?;
        }
        let publish_s = t_pub.elapsed().as_secs_f64();
        self.step += 1;
        self.data_pos = gen.data_pos;

        let zero_var = gen.zero_variance_groups(g);
        let metrics = self.metrics(step, &gen, &zero_var, update, lr);
        let metrics = StepMetrics { train_s, publish_s, step_s: t_step.elapsed().as_secs_f64(), ..metrics };
        let samples =
            gen.out.samples.into_iter().zip(gen.scores).zip(gen.rewards).map(|((s, sc), r)| (s, sc, r)).collect();
        Ok(StepReport { metrics, samples, update: *update })
    }

    /// Stops the drafter's background worker (also done on drop).
    ///
    /// # Errors
    /// An error the worker hit.
    pub fn shutdown(mut self) -> Result<()> {
        match self.drafter.as_mut() {
            Some(d) => d.shutdown(),
            None => Ok(()),
        }
    }
}
