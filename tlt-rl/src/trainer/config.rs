//! [`TrainerConfig`]: everything a run needs besides the model and the task (serde, TOML-friendly).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tlt_drafter::online::BufferConfig;
use tlt_drafter::TrainConfig;
use tlt_scheduler::{AdmissionLimits, GateConfig, MabConfig};
use tlt_spec_decode::SuffixConfig;

use crate::grpo::GrpoConfig;
use crate::{Error, Result};
use tlt_model::optim::LrSchedule;
use tlt_model::Device;

/// How rollouts decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// TLT: the SD gate, the plan bandit and a drafter (trained online for EAGLE-2).
    #[default]
    Tlt,
    /// Plain decoding, everything else identical.
    Baseline,
}

/// The drafter of TLT rollouts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DrafterChoice {
    /// Group drafting ([`SuffixDrafter`](tlt_spec_decode::SuffixDrafter) over each prompt's GRPO group) merged
    /// with the online EAGLE-2 drafter into one tree per round
    /// ([`HybridDrafter`](tlt_spec_decode::HybridDrafter)).
    #[default]
    Hybrid,
    /// A one-layer EAGLE-2 drafter over the policy's final hidden states, trained online from rollouts.
    Eagle2,
    /// Model-free group drafting: the siblings' committed tokens in a suffix index per group (nothing to train).
    Suffix,
    /// A model-free n-gram drafter over each request's own history (nothing to train).
    Ngram,
}

impl DrafterChoice {
    /// Whether it has an online EAGLE-2 drafter (trained, checkpointed).
    pub fn has_eagle(self) -> bool {
        matches!(self, Self::Hybrid | Self::Eagle2)
    }

    /// Its name in configs and in the bandit's arms (`hybrid`, `eagle2`, `suffix`, `ngram`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Hybrid => "hybrid",
            Self::Eagle2 => "eagle2",
            Self::Suffix => "suffix",
            Self::Ngram => "ngram",
        }
    }
}

/// When the online drafter trains.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum DrafterSchedule {
    /// In the background during the rollout's long tail (running batch `<= tail_batch`), on finished requests'
    /// hidden states, paused when the rollout ends (TLT's idle-worker training). Timing-dependent.
    #[default]
    Tail,
    /// `steps` synchronous steps after each rollout (deterministic: for tests and bit-exact resume; with several
    /// ranks, taken by all of them together at the step's end, on the features in rank order).
    Fixed {
        /// Drafter steps per RL step.
        steps: u64,
    },
    /// Never (the drafter keeps its initial weights).
    Off,
}

/// Speculative decoding of TLT rollouts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SdConfig {
    /// When SD turns on and off.
    pub gate: GateConfig,
    /// The plan bandit.
    pub mab: MabConfig,
    /// The drafter.
    pub drafter: DrafterChoice,
    /// Several drafter kinds for the bandit to choose between per batch bucket (issue: "BEG-MAB arms that
    /// include the drafter kind"); every kind sees every commit, the chosen one drafts. Non-empty, it replaces
    /// [`Self::drafter`] and fills `mab.drafters` with the kinds' names (in this order). Default empty.
    pub drafters: Vec<DrafterChoice>,
    /// Group drafting settings ([`DrafterChoice::Suffix`] and [`DrafterChoice::Hybrid`]).
    pub suffix: SuffixConfig,
    /// Drafter optimisation (EAGLE-2).
    pub drafter_train: TrainConfig,
    /// The online sample buffer.
    pub buffer: BufferConfig,
    /// When the drafter trains.
    pub schedule: DrafterSchedule,
    /// [`DrafterSchedule::Tail`]: train while at most this many requests are running. Default 4.
    pub tail_batch: usize,
    /// Publish new drafter weights every this many drafter steps (`>= 1`). Default 5.
    pub publish_every: u64,
    /// Seed of the drafter's initial weights. Default 1.
    pub drafter_seed: u64,
    /// Warming the EAGLE drafter up on the policy's own answers before the first RL step (off by default).
    pub warmup: WarmupConfig,
    /// Hot vocabulary of the EAGLE-2 drafter (FR-Spec; SGLang's `speculative_token_map`): with a warm-up, the
    /// drafter drafts over, and trains its loss on, only the `hot_vocab` target tokens most frequent in the
    /// warm-up's answers (end-of-sequence tokens always included), so a draft step reads that many rows of the
    /// LM head instead of the whole vocabulary. Verification is unchanged, so decoding stays lossless; a token
    /// outside the hot vocabulary is simply never drafted. 0 (the default), or no warm-up: the whole vocabulary.
    pub hot_vocab: usize,
}

impl SdConfig {
    /// The drafter kinds of TLT rollouts: [`Self::drafters`], or the one [`Self::drafter`].
    pub fn kinds(&self) -> Vec<DrafterChoice> {
        if self.drafters.is_empty() {
            vec![self.drafter]
        } else {
            self.drafters.clone()
        }
    }

    /// Whether any kind has the online EAGLE-2 drafter.
    pub fn has_eagle(&self) -> bool {
        self.kinds().iter().any(|d| d.has_eagle())
    }

    /// The bandit's config: `mab` with `mab.drafters` naming [`Self::drafters`] when several kinds are set.
    pub fn bandit(&self) -> MabConfig {
        let mut mab = self.mab.clone();
        if !self.drafters.is_empty() {
            mab.drafters = self.drafters.iter().map(|d| d.name().to_string()).collect();
        }
        mab
    }
}

impl Default for SdConfig {
    fn default() -> Self {
        Self {
            gate: GateConfig::default(),
            mab: MabConfig::default(),
            drafter: DrafterChoice::default(),
            drafters: Vec::new(),
            suffix: SuffixConfig::default(),
            drafter_train: TrainConfig { schedule: LrSchedule::constant(3e-4), ..TrainConfig::default() },
            buffer: BufferConfig::default(),
            schedule: DrafterSchedule::default(),
            tail_batch: 4,
            publish_every: 5,
            drafter_seed: 1,
            warmup: WarmupConfig::default(),
            hot_vocab: 0,
        }
    }
}

/// AdamW and gradient clipping of the policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Learning rate over updates (warmup + cosine by default).
    pub schedule: LrSchedule,
    /// AdamW `(beta1, beta2)`. Default `[0.9, 0.999]` (verl, TRL).
    pub betas: [f64; 2],
    /// AdamW epsilon. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay. Default 0.01 (verl).
    pub weight_decay: f64,
    /// Clip gradients to this global L2 norm (`None`: no clipping). Default 1.0.
    pub max_grad_norm: Option<f64>,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            schedule: LrSchedule::default(),
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: Some(1.0),
        }
    }
}

/// DAPO's dynamic sampling (`[dynamic_sampling]`; verl `algorithm.filter_groups`): groups whose rewards are all
/// equal carry no signal, so they are filtered out and more prompts are drawn and rolled out until the step holds
/// `prompts_per_step` informative groups, at most `max_gen_batches` rollouts of `prompts_per_step` prompts each
/// (verl `max_num_gen_batches`). Informative groups beyond the batch are discarded (as verl does); if the bound is
/// reached first, the step trains on the informative groups it found, says so in the log and counts them in the
/// metrics (`informative_groups`), instead of failing as verl does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamicSampling {
    /// Most rollouts per RL step (`>= 1`). Default 4.
    pub max_gen_batches: usize,
}

impl Default for DynamicSampling {
    fn default() -> Self {
        Self { max_gen_batches: 4 }
    }
}

/// A GRPO run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerConfig {
    /// TLT or plain rollouts.
    pub mode: Mode,
    /// Seed of the rollout sampling streams (step `s` uses a seed derived from `(seed, s)`) and the data order.
    pub seed: u64,
    /// RL steps of a run (the runner's stopping point; the lr schedule has its own horizon). Default 4.
    pub steps: u64,
    /// Prompts per step. Default 8.
    pub prompts_per_step: usize,
    /// Samples per prompt (the GRPO group). Default 4. A group of one is trained as verl does (advantage = reward:
    /// see [`crate::grpo::group_advantages`]).
    pub group_size: usize,
    /// Most new tokens per sample. Default 256.
    pub max_new_tokens: usize,
    /// Most tokens of a prompt (verl `data.max_prompt_length`). With rollouts on a device the KV cache, the
    /// drafter's cache and the update's buffers reserve this many positions per sequence, and a longer prompt is an
    /// error naming this field. Default 1024.
    pub max_prompt_tokens: usize,
    /// Sampling temperature (0: greedy). Default 1.0.
    pub temperature: f64,
    /// Nucleus sampling mass. Default 1.0.
    pub top_p: f64,
    /// The GRPO objective.
    pub grpo: GrpoConfig,
    /// The optimizer.
    pub optim: OptimConfig,
    /// Padded tokens per micro-batch (gradient accumulation splits a mini-batch by this). Default 4096.
    pub micro_batch_tokens: usize,
    /// Prompts per optimizer step (verl `ppo_mini_batch_size`, counted in prompts, each with its group): a step's
    /// batch is shuffled and cut into mini-batches of this many prompts' samples, one AdamW step each; it must
    /// divide `prompts_per_step`, so every mini-batch has the same size (when groups are dropped, the samples left
    /// are cut into as many near-equal mini-batches, sizes differing by at most one sample). `None`: the whole
    /// batch in one step. Default `None`.
    ///
    /// With more than one optimizer step per RL step (here or through [`Self::ppo_epochs`]) the old log-probabilities
    /// come from a forward pass before the first step (verl `compute_log_prob`), so later steps see ratios away
    /// from 1 and PPO clipping acts; with one step the ratio is 1 by construction and that pass is skipped.
    pub ppo_mini_batch_size: Option<usize>,
    /// Passes over each step's batch (verl `ppo_epochs`), reshuffled every pass. Default 1.
    pub ppo_epochs: usize,
    /// Activation checkpointing in the policy update (verl `enable_gradient_checkpointing`): keep each decoder
    /// layer's input only and recompute the layer in the backward, for one more forward of compute. Same
    /// gradients (to rounding). Default true.
    pub activation_checkpointing: bool,
    /// Speculative decoding in TLT mode.
    pub sd: SdConfig,
    /// Continuous batching of rollouts (`[rollout]`): at most `max_running` samples decode at once, and the prompts
    /// admitted in one round plus one token per running sample fit `step_token_budget`; the rest wait in one FIFO
    /// queue (group-major) and enter as others finish. Defaults 512 / 16384 (fastrl's `max_running_requests`).
    pub rollout: AdmissionLimits,
    /// Where rollouts run: `"cpu"` (default) or `"cuda"` / `"cuda:N"` (a build with tlt-rl's `cuda` feature; drafter
    /// training and the model-free drafters stay on the CPU; this version has not run on a GPU). With the update on
    /// the CPU (`update_on_device = false`) a GPU rollout's bf16 log-probabilities meet an f32 update: set
    /// `grpo.tis_cap` (e.g. 2.0) to correct for the mismatch.
    pub device: Device,
    /// With rollouts on a device: the policy update (forwards, backward, AdamW over f32 master weights and moments)
    /// runs there too, on the rollout engine's own weights, updated in place (default true; Llama and Qwen2; the
    /// GRPO loss stays on the host). False: the update runs on the CPU and the weights are copied to the device
    /// before each rollout.
    pub update_on_device: bool,
    /// Scoring answers as they finish, on worker threads, under a deadline (`[trainer.scoring]`).
    pub scoring: super::reward::ScoringConfig,
    /// DAPO dynamic sampling (`[dynamic_sampling]`); absent (the default): every group of the step is trained on.
    pub dynamic_sampling: Option<DynamicSampling>,
    /// Data-parallel runs ([`Trainer::with_comm`](super::Trainer::with_comm)): a rank out of work takes groups
    /// that other ranks have not started (lossless: a request's coins are keyed by its index in the step, and the
    /// gradients stay with the groups' owners). Default true; ignored on one rank.
    pub steal_queued_groups: bool,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            mode: Mode::default(),
            seed: 0,
            steps: 4,
            prompts_per_step: 8,
            group_size: 4,
            max_new_tokens: 256,
            max_prompt_tokens: 1024,
            temperature: 1.0,
            top_p: 1.0,
            grpo: GrpoConfig::default(),
            optim: OptimConfig::default(),
            micro_batch_tokens: 4096,
            ppo_mini_batch_size: None,
            ppo_epochs: 1,
            activation_checkpointing: true,
            sd: SdConfig::default(),
            rollout: AdmissionLimits::default(),
            device: Device::Cpu,
            update_on_device: true,
            scoring: super::reward::ScoringConfig::default(),
            dynamic_sampling: None,
            steal_queued_groups: true,
        }
    }
}

impl TrainerConfig {
    /// Parses a TOML document (unknown keys are errors).
    ///
    /// # Errors
    /// [`Error::Parse`] with TOML's message, or the [`Self::validate`] error.
    pub fn from_toml(text: &str) -> Result<Self> {
        let cfg: Self = toml::from_str(text).map_err(|e| Error::parse("trainer config (TOML)", e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The config as TOML.
    ///
    /// # Errors
    /// [`Error::Parse`] if serialisation fails.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self).map_err(|e| Error::parse("trainer config (TOML)", e.to_string()))
    }

    /// Checks every value and the nested configs.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("prompts_per_step", self.prompts_per_step),
            ("group_size", self.group_size),
            ("max_new_tokens", self.max_new_tokens),
            ("max_prompt_tokens", self.max_prompt_tokens),
            ("micro_batch_tokens", self.micro_batch_tokens),
            ("ppo_epochs", self.ppo_epochs),
            ("ppo_mini_batch_size", self.ppo_mini_batch_size.unwrap_or(1)),
            ("sd.tail_batch", self.sd.tail_batch),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(Error::config(field, "must be at least 1"));
            }
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::config("temperature", format!("{} must be finite and >= 0", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::config("top_p", format!("{} must be in (0, 1]", self.top_p)));
        }
        if let Some(m) = self.ppo_mini_batch_size {
            if !self.prompts_per_step.is_multiple_of(m) {
                return Err(Error::config(
                    "ppo_mini_batch_size",
                    format!(
                        "{m} does not divide prompts_per_step = {}: the last mini-batch would be smaller and still \
                         get a full optimizer step",
                        self.prompts_per_step
                    ),
                ));
            }
        }
        if let Some(d) = &self.dynamic_sampling {
            if d.max_gen_batches == 0 {
                return Err(Error::config("dynamic_sampling.max_gen_batches", "must be at least 1"));
            }
            if self.group_size < 2 {
                return Err(Error::config(
                    "dynamic_sampling",
                    "needs group_size >= 2: a group of one answer has no reward variance to filter on",
                ));
            }
        }
        self.scoring.validate()?;
        if self.grpo.tis_cap.is_some() && self.top_p < 1.0 {
            return Err(Error::config(
                "grpo.tis_cap",
                "truncated importance sampling compares temperature-scaled log-probabilities, which top_p < 1 \
                 changes: set top_p = 1 or turn the correction off (tis_cap unset)",
            ));
        }
        if let Some((i, d)) = self.sd.drafters.iter().enumerate().find(|(i, d)| self.sd.drafters[..*i].contains(d)) {
            return Err(Error::config("sd.drafters", format!("kind {} (entry {i}) is listed twice", d.name())));
        }
        if self.sd.publish_every == 0 {
            return Err(Error::config("sd.publish_every", "must be at least 1"));
        }
        self.adamw().validate().map_err(|e| Error::config("optim", e.to_string()))?;
        if let Some(c) = self.optim.max_grad_norm {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::config("optim.max_grad_norm", format!("{c} must be finite and > 0")));
            }
        }
        self.optim.schedule.validate()?;
        self.grpo.validate()?;
        self.rollout.validate().map_err(|e| Error::config("rollout", e.to_string()))?;
        self.sd.gate.validate()?;
        self.sd.bandit().validate()?;
        self.sd.drafter_train.validate()?;
        self.sd.suffix.validate()?;
        self.sd.buffer.validate()?;
        self.sd.warmup.validate()?;
        Ok(())
    }

    /// The policy's AdamW hyperparameters.
    pub fn adamw(&self) -> tlt_model::optim::AdamWParams {
        let [beta1, beta2] = self.optim.betas;
        tlt_model::optim::AdamWParams { beta1, beta2, eps: self.optim.eps, weight_decay: self.optim.weight_decay }
    }
}

/// Settings of the drafter warm-up ([`crate::trainer::Trainer::warm_up_drafter`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmupConfig {
    /// Prompts the policy answers (0: no warm-up). Default 0.
    pub prompts: usize,
    /// Answers per prompt, sampled at the rollout's temperature. Default 4.
    pub samples_per_prompt: usize,
    /// Most new tokens per answer. Default 256.
    pub max_new_tokens: usize,
    /// Training budget in wall seconds (checked between steps; at least one step runs). Default 60.
    pub seconds: f64,
    /// Training budget in steps instead of `seconds` (`None`: the time budget). A step budget makes the warm
    /// drafter deterministic. Default `None`.
    pub max_steps: Option<u64>,
    /// Directory of cached warm drafters, one subdirectory per key (`None`: no cache). Relative paths are
    /// relative to the working directory. Default `None`.
    pub cache_dir: Option<PathBuf>,
}

impl Default for WarmupConfig {
    fn default() -> Self {
        Self { prompts: 0, samples_per_prompt: 4, max_new_tokens: 256, seconds: 60.0, max_steps: None, cache_dir: None }
    }
}

impl WarmupConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.prompts == 0 {
            return Ok(());
        }
        if self.samples_per_prompt == 0 {
            return Err(Error::config("sd.warmup.samples_per_prompt", "must be at least 1"));
        }
        if self.max_new_tokens == 0 {
            return Err(Error::config("sd.warmup.max_new_tokens", "must be at least 1"));
        }
        if !(self.seconds.is_finite() && self.seconds > 0.0) {
            return Err(Error::config("sd.warmup.seconds", format!("{} must be finite and > 0", self.seconds)));
        }
        if self.max_steps == Some(0) {
            return Err(Error::config("sd.warmup.max_steps", "must be at least 1 (or unset)"));
        }
        Ok(())
    }
}
