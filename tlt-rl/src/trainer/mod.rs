//! The reference TLT trainer: GRPO steps of rollout → reward → policy update → publication, with adaptive
//! speculative rollouts and an online drafter in [`Mode::Tlt`], plain rollouts in [`Mode::Baseline`], and
//! atomic checkpoints that resume bit for bit.
//!
//! One step:
//! 1. **Rollout.** `prompts_per_step` prompts from the [`Environment`] at data indices `step * prompts_per_step
//!    ..`, `group_size` samples each, decoded by one batched engine. In TLT mode the [`AdaptiveDecoder`] turns SD
//!    on when the running batch has shrunk (the long tail) and the bandit picks the plan; finished requests feed
//!    the drafter's buffer, and (tail schedule) the drafter trains in the background while the batch is small.
//! 2. **Reward.** The environment scores each completion; an overlong penalty is added if configured.
//! 3. **Update.** Group-relative advantages, zero-variance groups dropped, micro-batches by token budget with
//!    gradient accumulation, AdamW at the scheduled learning rate.
//! 4. **Publication.** The rollout model becomes a snapshot of the new policy; the drafter is pointed at the new
//!    embedding and LM head and republished.
//!
//! [`Trainer::export`] writes the byproduct: the policy as a Hugging Face directory and its drafter in the EAGLE
//! format SGLang and vLLM serve (see [`ExportConfig`]).

mod checkpoint;
mod config;
mod device;
mod drafter;
mod env;
mod export;
mod head;
mod rollout;
mod update;
mod warmup;

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use tlt_drafter::DrafterTrainer;
use tlt_kernels::SplitMix64;
use tlt_model::optim::AdamW;
use tlt_model::{Llama, WeightDType};
use tlt_scheduler::AdaptiveDecoder;

pub use checkpoint::{TrainerState, DRAFTER_DIR, OPTIMIZER_FILE, POLICY_DIR, STATE_FILE};
pub use config::{DrafterChoice, DrafterSchedule, Mode, OptimConfig, SdConfig, TrainerConfig};
pub use env::{Environment, Prompt, TextEnv};
pub use export::{
    make_readable, serve_commands, serve_instructions, tokenizer_config, ExportConfig, Exported, EXPORT_DRAFTER_DIR,
    EXPORT_POLICY_DIR, SERVE_FILE,
};
pub use rollout::{Observer, Quiet, RolloutOutput, Sample, SdCeiling, CEILING_DEPTHS};
pub use update::UpdateStats;
pub use warmup::{cache_key, WarmupConfig, WarmupReport, WARMUP_DATA_BASE};

use crate::grpo::group_advantages;
use crate::metrics::{mean_std, percentile, StepMetrics};
use crate::task::{Score, Split};
use crate::{Error, Result};
use device::RolloutDevice;
use drafter::RolloutDrafter;

/// Prompt positions the device drafter's cache reserves per request (beyond the answer and a draft tree); a longer
/// prompt is a clear error of the drafter's forward.
const PROMPT_ROOM: usize = 1024;
use rollout::{spec_params, RolloutJob};
use update::{policy_update, TrainSeq, UpdateContext};

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
    env: E,
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
    step: u64,
}

impl<E: Environment> std::fmt::Debug for Trainer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer").field("step", &self.step).field("mode", &self.cfg.mode).finish_non_exhaustive()
    }
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

/// The rollout sampling seed of RL step `step`.
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
        let rollouts = RolloutDevice::new(cfg.device)?;
        let mut drafter = drafter;
        if let (tlt_model::Device::Cuda(ordinal), Some(d)) = (cfg.device, drafter.as_mut()) {
            // Room for the running requests, a prompt, the answer and the largest draft tree.
            let slots = cfg.rollout.max_running.min(cfg.prompts_per_step * cfg.group_size).max(1);
            let max_len = PROMPT_ROOM + cfg.max_new_tokens + tlt_kernels::cuda::MAX_TREE_NODES;
            d.draft_on_device(ordinal, slots, max_len);
        }
        Ok(Self { cfg, env, policy, opt, rollout_model, reference, decoder, drafter, rollouts, step })
    }

    /// Resumes the run checkpointed in `dir`. `initial` is the run's starting policy (the KL reference; its
    /// weights are replaced by the checkpoint's); `cfg` must equal the checkpoint's config except for `steps`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] if the checkpoint is incomplete or belongs to another run.
    pub fn resume(dir: &Path, initial: Llama, env: E, cfg: TrainerConfig) -> Result<Self> {
        let state = TrainerState::read(dir)?;
        // The step count and the rollout device may change on resume.
        let mismatch = TrainerConfig { steps: cfg.steps, device: cfg.device, ..state.config.clone() } != cfg;
        if mismatch {
            return Err(Error::Checkpoint {
                path: dir.into(),
                reason: "the config differs from the checkpoint's".into(),
            });
        }
        let saved = tlt_model::load_hf_dir(&dir.join(POLICY_DIR))?.model;
        let drafter = match cfg.mode {
            Mode::Tlt if cfg.sd.has_eagle() => {
                let t = DrafterTrainer::resume(&dir.join(DRAFTER_DIR), &saved)?;
                Some(RolloutDrafter::eagle(&cfg.sd, t, state.drafter_version)?)
            }
            Mode::Tlt => Some(RolloutDrafter::new(&cfg.sd, &saved)?),
            Mode::Baseline => None,
        };
        let mut t = Self::assemble(initial, env, cfg, drafter, state.step)?;
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

    /// Writes a checkpoint of the run so far to `dir` (atomically).
    ///
    /// # Errors
    /// On an I/O failure.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        tlt_model::write_dir_atomic(dir, |tmp| -> Result<()> {
            tlt_model::save_hf_dir(&self.policy, None, &tmp.join(POLICY_DIR), candle_core::DType::F32)?;
            checkpoint::save_optimizer(&self.opt, &tmp.join(OPTIMIZER_FILE))?;
            if let Some(d) = &self.drafter {
                d.save(&tmp.join(DRAFTER_DIR))?;
            }
            let version = self.drafter.as_ref().map_or(0, RolloutDrafter::version);
            TrainerState::new(self.step, self.cfg.clone(), &self.opt, version).write(tmp)
        })
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
        &self.env
    }

    /// The policy's inference copy.
    fn rollout_model(&self) -> Result<&Llama> {
        inference_copy(&self.rollout_model)
    }

    /// Greedy, plain decoding of one sample per held-out prompt at evaluation positions `indices` with the current
    /// policy.
    ///
    /// # Errors
    /// Engine or environment failures.
    pub fn evaluate(&self, indices: Range<u64>, max_new_tokens: usize) -> Result<Evaluation> {
        let t = Instant::now();
        let prompts = indices.map(|i| self.env.prompt(Split::Eval, i)).collect::<Result<Vec<_>>>()?;
        let params = spec_params(0.0, 1.0, max_new_tokens, 0);
        let mut plain = AdaptiveDecoder::plain()?;
        let job = RolloutJob {
            limits: self.cfg.rollout,
            prompts: &prompts,
            group_size: 1,
            params,
            rl_step: self.step,
            record_features: false,
        };
        let out = self.rollouts.rollout(self.rollout_model()?, job, &mut plain, None, &mut Quiet)?;
        let mut e = Evaluation { prompts: prompts.len(), ..Evaluation::default() };
        for s in &out.samples {
            let score = self.env.score(&prompts[s.group], &s.tokens)?;
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
    /// Any failure of the rollout, the reward, the update or the publication; the trainer is then left at the
    /// step it was at (resume from the last checkpoint).
    pub fn step(&mut self, obs: &mut dyn Observer) -> Result<StepReport> {
        let t_step = Instant::now();
        let step = self.step;
        let (p, g) = (self.cfg.prompts_per_step, self.cfg.group_size);
        obs.on_phase(step, "rollout");
        let base = step * p as u64;
        let prompts = (0..p as u64).map(|i| self.env.prompt(Split::Train, base + i)).collect::<Result<Vec<_>>>()?;
        let params =
            spec_params(self.cfg.temperature, self.cfg.top_p, self.cfg.max_new_tokens, step_seed(self.cfg.seed, step));
        let drafter = if self.cfg.mode == Mode::Tlt { self.drafter.as_mut() } else { None };
        let job = RolloutJob {
            limits: self.cfg.rollout,
            prompts: &prompts,
            group_size: g,
            params,
            rl_step: step,
            record_features: false,
        };
        let model = inference_copy(&self.rollout_model)?;
        let out = self.rollouts.rollout(model, job, &mut self.decoder, drafter, obs)?;

        obs.on_phase(step, "reward");
        let t_reward = Instant::now();
        let mut scored = Vec::with_capacity(out.samples.len());
        for s in &out.samples {
            let score = self.env.score(&prompts[s.group], &s.tokens)?;
            let reward = self.cfg.grpo.shaped_reward(score.reward, s.tokens.len(), self.cfg.max_new_tokens);
            scored.push((score, reward));
        }
        let rewards: Vec<f64> = scored.iter().map(|&(_, r)| r).collect();
        let adv = group_advantages(&rewards, g, &self.cfg.grpo)?;
        let reward_s = t_reward.elapsed().as_secs_f64();

        obs.on_phase(step, "update");
        let t_train = Instant::now();
        let seqs: Vec<TrainSeq> = out
            .samples
            .iter()
            .enumerate()
            .filter(|&(i, s)| adv.keep(i) && !s.tokens.is_empty())
            .map(|(i, s)| TrainSeq { sample: s, advantage: adv.values[i] })
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
        };
        // The rollout's copy of the weights is not needed until the next rollout: free it for the update's peak.
        self.rollout_model = None;
        let update = policy_update(&ctx, &mut self.opt, &seqs);
        let train_s = t_train.elapsed().as_secs_f64();

        obs.on_phase(step, "publish");
        let t_pub = Instant::now();
        // Snapshotted even when the update failed, so the trainer stays usable (from its last checkpoint).
        let model = self.rollout_model.insert(snapshot(&self.policy)?);
        let update = update?;
        if let Some(d) = &self.drafter {
            d.retarget(model)?;
        }
        let publish_s = t_pub.elapsed().as_secs_f64();
        self.step += 1;

        let metrics = self.metrics(step, &out, &scored, &adv.zero_variance_group, &update, lr);
        let metrics = StepMetrics { reward_s, train_s, publish_s, step_s: t_step.elapsed().as_secs_f64(), ..metrics };
        let samples = out.samples.into_iter().zip(scored).map(|(s, (score, r))| (s, score, r)).collect();
        Ok(StepReport { metrics, samples, update })
    }

    fn metrics(
        &self,
        step: u64,
        out: &RolloutOutput,
        scored: &[(Score, f64)],
        zero_var: &[bool],
        update: &UpdateStats,
        lr: f64,
    ) -> StepMetrics {
        let n = scored.len().max(1) as f64;
        let rewards: Vec<f64> = scored.iter().map(|&(_, r)| r).collect();
        let (reward_mean, reward_std) = mean_std(&rewards);
        let lens: Vec<usize> = out.samples.iter().map(|s| s.tokens.len()).collect();
        let lens_f: Vec<f64> = lens.iter().map(|&l| l as f64).collect();
        let total = out.samples.len().max(1) as f64;
        let active = &out.trace.active;
        let idle_fraction = if active.is_empty() {
            0.0
        } else {
            1.0 - active.iter().sum::<usize>() as f64 / (active.len() as f64 * total)
        };
        StepMetrics {
            step,
            mode: match self.cfg.mode {
                Mode::Tlt => "tlt".into(),
                Mode::Baseline => "baseline".into(),
            },
            reward_mean,
            reward_std,
            accuracy: scored.iter().filter(|(s, _)| s.correct).count() as f64 / n,
            format_rate: scored.iter().filter(|(s, _)| s.formatted).count() as f64 / n,
            response_len_p50: percentile(&lens_f, 0.5),
            response_len_p90: percentile(&lens_f, 0.9),
            response_len_max: lens.iter().copied().max().unwrap_or(0),
            response_len_mean: lens_f.iter().sum::<f64>() / n,
            truncation_rate: out.samples.iter().filter(|s| s.truncated).count() as f64 / n,
            samples: out.samples.len(),
            rollout_tokens: lens.iter().sum(),
            rollout_s: out.seconds,
            drafter_s: out.drafter_s,
            drafter_after_s: out.drafter_after_s,
            idle_fraction,
            sd_on_fraction: out.trace.sd_fraction(),
            accept_len: out.trace.mean_accept_len(),
            arms: out.trace.arms.clone(),
            drafter_version: self.drafter.as_ref().map_or(0, RolloutDrafter::version),
            drafter_steps: self.drafter.as_ref().map_or(0, RolloutDrafter::steps),
            loss: update.loss.loss,
            pg_loss: update.loss.pg_loss,
            kl: update.loss.kl,
            entropy: update.loss.entropy,
            clip_frac: update.loss.clip_frac_low + update.loss.clip_frac_high,
            ratio_mean: update.loss.ratio_mean,
            tis_weight: update.loss.tis_weight_mean,
            optimizer_steps: update.optimizer_steps,
            grad_norm: update.grad_norm,
            lr,
            zero_variance_groups: zero_var.iter().filter(|&&z| z).count(),
            tail_share: out.trace.tail_share(self.cfg.sd.gate.threshold),
            active_requests: active.clone(),
            round_seconds: out.trace.round_seconds.clone(),
            round_tokens: out.trace.round_tokens.clone(),
            plain_arm_steps: out.trace.plain_arm_steps,
            drafter_prepare_s: out.trace.prepare_seconds,
            sd_ceiling: out.sd_ceiling,
            response_lengths: lens,
            accept_lens: out.trace.accept_lens.clone(),
            ..StepMetrics::default()
        }
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
