//! # tlt-drafter
//!
//! EAGLE-2 and EAGLE-3 draft models for a `tlt-model` target: configuration, parameters, differentiable
//! training forwards and losses, EAGLE-3's reduced draft vocabulary, and checkpoints SGLang and vLLM load.
//!
//! - [`DrafterConfig`]: the drafter's one decoder layer as an HF [`tlt_model::LlamaConfig`] plus what ties it
//!   to the target (hidden size, fc bias, draft vocabulary, tapped layers); built from a target config with
//!   [`DrafterConfig::eagle2_from_target`] / [`DrafterConfig::eagle3_from_target`].
//! - [`Eagle2Drafter`] (TLT's RL path): `fc([embed(x_{t+1}); h_t])` + one decoder layer without input norm,
//!   trained with `1.0 * SmoothL1 + 0.1 * soft-CE` ([`Eagle2Drafter::loss`]).
//! - [`Eagle3Drafter`]: three tapped layers fused by `fc`, a `2H`-input layer, final norm, own LM head over a
//!   [`VocabMap`]; trained with the 7-step training-time-test unroll ([`Eagle3Drafter::loss`]).
//! - Trainable weights are candle [`Var`](candle_core::Var)s (`vars()` for `candle_nn::AdamW`); the target's
//!   embedding and LM head are shared read-only through [`FrozenTarget`] and never trained.
//! - [`checkpoint`]: EAGLE-3 export/import in the SGLang/vLLM format (`midlayer.*`, `d2t` int64, `t2d` bool,
//!   `LlamaForCausalLMEagle3`), EAGLE-2 in the fastrl/TLT layout (`model.fc.weight`, `model.layers.0.*`).
//!
//! ```
//! use candle_nn::{AdamW, Optimizer, ParamsAdamW};
//! use candle_core::{DType, Device, Tensor};
//! use tlt_drafter::{DrafterConfig, Eagle2Batch, Eagle2Drafter, Eagle2LossConfig, FrozenTarget};
//! use tlt_model::{Llama, LlamaConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let target = Llama::random(LlamaConfig::tiny(32, 16, 2), 0)?;
//! let cfg = DrafterConfig::eagle2_from_target(target.config(), false);
//! let drafter = Eagle2Drafter::random(cfg, FrozenTarget::new(&target), 1)?;
//! let batch = Eagle2Batch {
//!     input_ids: Tensor::new(&[[1u32, 5, 9, 2, 7]], &Device::Cpu)?,
//!     hidden: Tensor::randn(0f32, 1.0, (1, 5, 16), &Device::Cpu)?, // target final-norm hidden states
//!     loss_mask: Tensor::ones((1, 5), DType::F32, &Device::Cpu)?,
//!     segments: None,
//! };
//! let vars = drafter.vars()?.into_iter().map(|(_, v)| v).collect();
//! let mut opt = AdamW::new(vars, ParamsAdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, ..Default::default() })?;
//! let loss = drafter.loss(&batch, &Eagle2LossConfig::default())?;
//! opt.backward_step(&loss.total)?;
//! # Ok(()) }
//! ```
//!
//! - [`online`]: the [`OnlineBuffer`](online::OnlineBuffer) of rollout samples (tokens + the engine's recorded
//!   hidden states), versioned weight publication ([`WeightsSlot`](online::WeightsSlot) /
//!   [`WeightsReader`](online::WeightsReader)) and the preemptible [`BackgroundTrainer`](online::BackgroundTrainer).
//!
//! - [`train`]: drafter training from rollout samples. [`DrafterTrainer`] (EAGLE-2 or EAGLE-3) packs windows
//!   of [`FeatureSample`](online::FeatureSample)s (tokens + the engine's recorded hidden states; `4H` rows from
//!   `TappedLlama` with `Tap::eagle3` serve both kinds) into segment-packed batches, steps its own AdamW
//!   (visible moments, global-norm clipping, warmup + constant/cosine schedule), draws batches
//!   deterministically from `(seed, step)`, and saves/resumes atomic checkpoints bit-exactly.
//!   [`train::train_offline`] loops under a step or time budget; [`train::online_step_fn`] is the
//!   micro-step a [`BackgroundTrainer`](online::BackgroundTrainer) runs, publishing
//!   [`DraftRuntime`] snapshots to a [`WeightsSlot`](online::WeightsSlot).
//!
//! ```no_run
//! use std::sync::Arc;
//! use tlt_drafter::online::FeatureSample;
//! use tlt_drafter::train::{train_offline, Budget};
//! use tlt_drafter::{DrafterConfig, DrafterTrainer, Eagle2Drafter, FrozenTarget, RuntimeOptions, TrainConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let target = tlt_model::Llama::random(tlt_model::LlamaConfig::tiny(32, 16, 2), 0)?;
//! # let samples: Vec<Arc<FeatureSample>> = Vec::new(); // FeatureSample::from_finished(&engine_output, rl_step)
//! let cfg = DrafterConfig::eagle2_from_target(target.config(), false);
//! let drafter = Eagle2Drafter::random(cfg, FrozenTarget::new(&target), 1)?;
//! let schedule = tlt_model::optim::LrSchedule::constant(1e-4);
//! let mut trainer = DrafterTrainer::new(drafter, TrainConfig { schedule, ..TrainConfig::default() })?;
//! let report = train_offline(&mut trainer, &samples, Budget::Steps(100), |s| println!("{}", s.eval.loss))?;
//! trainer.save_checkpoint(std::path::Path::new("ckpt"))?; // resume: DrafterTrainer::resume(dir, &target)
//! let runtime = trainer.runtime(&RuntimeOptions::default())?; // for EagleProposer / WeightsSlot::publish
//! # let _ = (report, runtime); Ok(()) }
//! ```
//!
//! The inference path ([`DraftRuntime`], [`EagleProposer`]) runs the drafter with its own KV cache and grows
//! EAGLE-2 dynamic trees for `tlt_spec_decode::Engine`.
//!
//! # Features
//! Default: CPU, any float dtype the target uses (tests run f32 and, for gradient checks, f64).
//! `cuda::CudaDrafter`, a [`DraftExecutor`] running the drafter's forward and top-k on a device behind the seam
//! (`tlt_kernels::cuda::Gpu`), is always built: CI runs it on the simulated device; `cuda` adds the CUDA device
//! (`tlt_kernels::cuda::CudaGpu`). `cuda::CudaDrafterTrainer` trains an EAGLE-2 drafter on such a device (forward,
//! loss, backward and AdamW there), from the batches the CPU trainer builds.

mod batch;
pub mod checkpoint;
mod config;
pub mod cuda;
mod cuda_online;
mod cuda_train;
mod eagle2;
mod eagle3;
mod error;
mod exec;
mod frozen;
mod layer;
pub mod online;
mod propose;
mod runtime;
pub mod train;
mod vocab;

pub use checkpoint::SaveDType;
pub use config::{default_aux_layers, DrafterConfig, DrafterKind, Eagle2LossConfig, Eagle3LossConfig, UniformNoise};
pub use eagle2::{Eagle2Batch, Eagle2Drafter, Eagle2Loss, Eagle2Weights};
pub use eagle3::{Eagle3Batch, Eagle3Drafter, Eagle3Loss, Eagle3Weights, Teacher};
pub use error::{Error, Result};
pub use exec::{DraftExecutor, Forward, HostExecutor};
pub use frozen::FrozenTarget;
pub use layer::DraftLayer;
pub use propose::EagleProposer;
pub use runtime::{Attend, DraftCache, DraftRuntime, Group, Row, RuntimeOptions};
pub use train::{DrafterTrainer, StepStats, TrainConfig, TrainableDrafter};
pub use vocab::VocabMap;

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
