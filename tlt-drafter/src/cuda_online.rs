//! TLT's online drafter trained on the device: [`CudaOnlineTrainer`] steps a [`CudaDrafterTrainer`] on samples drawn
//! from an [`OnlineBuffer`] exactly as the host's [`DrafterTrainer`] draws them (the same `(seed, step)` streams for
//! the draw and the input noise), and keeps a host [`DrafterTrainer`] as its record: the configuration, the runtimes
//! published to the proposers and the checkpoints, in the host trainer's format. The record's weights are brought up
//! to date from the device's f32 masters when a runtime is made, its AdamW moments when a checkpoint is written; a
//! trainer resumed from such a checkpoint continues on the device with the same bits.
//!
//! Only what the device trainer covers: an EAGLE-2 drafter over the full vocabulary, without an output-projection
//! bias ([`CudaDrafterTrainer::new`]'s errors).

use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use tlt_kernels::cuda::SharedGpu;
use tlt_model::optim::ParamState;
use tlt_model::Llama;

use crate::config::DrafterConfig;
use crate::cuda_train::{CudaDrafterTrainer, DraftArena};
use crate::frozen::FrozenTarget;
use crate::online::{FeatureSample, OnlineBuffer};
use crate::runtime::{DraftRuntime, RuntimeOptions};
use crate::train::{DrafterTrainer, StepStats, Totals, TrainConfig, TrainableDrafter};
use crate::{Error, Result};

/// An online EAGLE-2 drafter trainer on the device, with a host record for runtimes and checkpoints (see the module
/// docs).
#[derive(Debug)]
pub struct CudaOnlineTrainer {
    dev: CudaDrafterTrainer,
    /// The host record: its weights are the device's as of `host_at`, its moments as of the last checkpoint.
    host: DrafterTrainer,
    totals: Totals,
    /// The device step whose weights the host record holds.
    host_at: u64,
}

impl CudaOnlineTrainer {
    /// Moves `host` (a fresh trainer, or one resumed from a checkpoint) to `gpu`: its weights, AdamW moments, step
    /// and totals; batches of up to [`TrainConfig::max_positions`] positions.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a drafter the device trainer does not cover (EAGLE-3, a hot vocabulary, an
    /// output-projection bias) or a resumed state whose parameters took different step counts; the device's error
    /// (e.g. out of memory).
    pub fn new(gpu: SharedGpu, host: DrafterTrainer) -> Result<Self> {
        let TrainableDrafter::Eagle2(d) = host.drafter() else {
            return Err(Error::config("drafter", "eagle3", "the device trainer trains EAGLE-2 drafters"));
        };
        let cfg = host.config().clone();
        let mut dev = CudaDrafterTrainer::new(gpu, d, cfg.clone(), cfg.max_positions())?;
        let opt = host.optimizer();
        let steps = host.steps_done();
        let mut moments = Vec::with_capacity(opt.params().len());
        for ((name, _), st) in opt.params().iter().zip(opt.state()) {
            if st.steps != steps && st.steps != 0 {
                return Err(Error::config(
                    name,
                    st.steps,
                    "the device trainer takes one step count for all parameters",
                ));
            }
            moments.push((name.clone(), st.exp_avg.clone(), st.exp_avg_sq.clone()));
        }
        dev.set_optimizer_state(steps, &moments)?;
        Ok(Self { dev, totals: host.totals(), host_at: steps, host })
    }

    /// The device memory a trainer of `drafter` trained as `train` says takes, in bytes
    /// ([`CudaDrafterTrainer::memory`] at [`TrainConfig::max_positions`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a drafter the device trainer does not cover.
    pub fn memory(drafter: &DrafterConfig, train: &TrainConfig) -> Result<usize> {
        CudaDrafterTrainer::memory(drafter, train.max_positions())
    }

    /// Optimizer steps taken (a resumed trainer's included).
    pub fn steps_done(&self) -> u64 {
        self.dev.steps()
    }

    /// The training configuration.
    pub fn config(&self) -> &TrainConfig {
        self.host.config()
    }

    /// One step on the samples [`TrainConfig::draw_from_buffer`] draws at this step, with the input noise
    /// [`DrafterTrainer::step`] would use; `None` when the buffer holds nothing to train on.
    ///
    /// # Errors
    /// As [`CudaDrafterTrainer::step`] (a non-finite loss changes nothing).
    pub fn step_from_buffer(&mut self, buffer: &OnlineBuffer) -> Result<Option<StepStats>> {
        let step = self.dev.steps();
        let cfg = self.host.config();
        let samples: Vec<Arc<FeatureSample>> = cfg.draw_from_buffer(step, buffer).into_iter().map(|(_, s)| s).collect();
        if samples.is_empty() {
            return Ok(None);
        }
        let noise = cfg.noise_seed(step);
        let stats = self.dev.step(&samples, Some(noise))?;
        self.totals.samples += stats.eval.batch.samples as u64;
        self.totals.tokens += stats.eval.batch.tokens as u64;
        self.totals.targets += stats.eval.targets;
        Ok(Some(stats))
    }

    /// Points the drafter at `model`'s embedding and LM head (the policy changed): on the device and in the record.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a model of another shape; the device's error.
    pub fn set_target(&mut self, model: &Llama) -> Result<()> {
        let target = FrozenTarget::new(model);
        self.dev.set_target(&target)?;
        self.host.set_target(target)
    }

    /// An inference snapshot of the weights now (downloaded from the device's masters).
    ///
    /// # Errors
    /// The device's error; as [`DrafterTrainer::runtime`].
    pub fn runtime(&mut self, opts: &RuntimeOptions) -> Result<DraftRuntime> {
        self.sync_weights()?;
        self.host.runtime(opts)
    }

    /// Writes a checkpoint of the host trainer's format to `dir` (atomically; [`DrafterTrainer::resume`] reads it):
    /// the device's weights, moments, step and totals.
    ///
    /// # Errors
    /// The device's error; as [`DrafterTrainer::save_checkpoint`].
    pub fn save_checkpoint(&mut self, dir: &Path) -> Result<()> {
        self.sync_weights()?;
        let (m, v) = (self.dev.named(DraftArena::ExpAvg)?, self.dev.named(DraftArena::ExpAvgSq)?);
        let steps = self.dev.steps();
        let mut state = Vec::with_capacity(m.len());
        for (name, _) in self.host.optimizer().params() {
            let find = |arena: &[(String, Vec<f32>)]| arena.iter().find(|(n, _)| n == name).map(|(_, x)| x.clone());
            let (Some(exp_avg), Some(exp_avg_sq)) = (find(&m), find(&v)) else {
                return Err(Error::InvalidArgument(format!("the device trainer has no moments of {name}")));
            };
            state.push(ParamState { exp_avg, exp_avg_sq, steps });
        }
        self.host.join(steps, self.totals, state)?;
        self.host.save_checkpoint(dir)
    }

    /// The host record's weights set to the device's masters, unless they are already this step's.
    fn sync_weights(&mut self) -> Result<()> {
        if self.host_at == self.dev.steps() {
            return Ok(());
        }
        let master = self.dev.named(DraftArena::Master)?;
        for (name, var) in self.host.optimizer().params() {
            let values = master.iter().find(|(n, _)| n == name).map(|(_, x)| x.as_slice());
            let values = values.ok_or_else(|| Error::InvalidArgument(format!("the device trains no {name}")))?;
            let t = Tensor::from_slice(values, var.shape(), &Device::Cpu)?.to_dtype(var.dtype())?;
            var.set(&t)?;
        }
        self.host_at = self.dev.steps();
        Ok(())
    }
}
