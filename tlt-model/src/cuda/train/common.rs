//! What the device trainers share: the configuration checks, the checked training forward, the arenas' names, and
//! the clipped AdamW step's decision (the gradient norm on the device, then the host optimizer's arithmetic).

use tlt_kernels::cuda::plan::{self, AdamWStep, Buf};
use tlt_kernels::cuda::{DeviceBuf, Gpu};

use super::batch::TrainBatch;
use super::pass::{self, Acts, Dims};
use crate::config::LlamaConfig;
use crate::cuda::CudaLlama;
use crate::optim::{AdamWParams, GradNorm};
use crate::{Error, Result};

/// The global L2 norm of the gradients `grad` on the device: f64 partial sums of a fixed grid (`sum_squares` into
/// `partials`, [`plan::SUM_SQUARES_BLOCKS`] of them), summed in order on the host.
///
/// # Errors
/// [`Error::Kernel`] when the device fails.
pub fn grad_norm(g: &dyn Gpu, grad: Buf<f32>, partials: &DeviceBuf<f64>) -> Result<f64> {
    g.launch(&plan::sum_squares(grad, partials.buf())?)?;
    Ok(partials.to_host(g)?.iter().sum::<f64>().sqrt())
}

/// What one clipped AdamW step of a device optimizer (built on the `adamw` kernel) does, decided as the host
/// optimizer decides it ([`crate::optim::AdamW::step`]): the global norm of `grad` ([`grad_norm`]), and for a
/// finite one the arguments of its `adamw` launches (step `steps + 1`, the clip factor of `max_grad_norm`); `None`
/// for a non-finite norm, a skipped step that changes nothing.
///
/// # Errors
/// [`Error::InvalidConfig`] for a negative or non-finite `lr`; [`Error::Kernel`] when the device fails.
pub fn clipped_adamw_step(
    g: &dyn Gpu,
    grad: Buf<f32>,
    partials: &DeviceBuf<f64>,
    hp: &AdamWParams,
    steps: u64,
    lr: f64,
    max_grad_norm: Option<f64>,
) -> Result<(GradNorm, Option<AdamWStep>)> {
    if !(lr.is_finite() && lr >= 0.0) {
        return Err(Error::config("lr", lr, "must be finite and >= 0"));
    }
    let before = grad_norm(g, grad, partials)?;
    if !before.is_finite() {
        return Ok((GradNorm { before, after: before }, None));
    }
    let coef = crate::optim::clip_coef(before, max_grad_norm);
    let AdamWParams { beta1, beta2, eps, weight_decay } = *hp;
    let step = AdamWStep { lr, beta1, beta2, eps, weight_decay, step: steps + 1, coef };
    Ok((GradNorm { before, after: if coef < 1.0 { before * coef } else { before } }, Some(step)))
}

/// The trainer's f32 arenas, each in [`super::CudaTrainer::params`] order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arena {
    /// The master weights.
    Master,
    /// AdamW's first moments.
    ExpAvg,
    /// AdamW's second moments.
    ExpAvgSq,
    /// The accumulated gradients.
    Grad,
}

/// Whether the device training pass covers models of `cfg`, checked from the config alone (before any weight is
/// loaded or any rollout runs).
///
/// # Errors
/// [`Error::InvalidInput`] naming what is not covered: Qwen3's q/k head norms, a bias on the attention output.
pub fn check_trainable(cfg: &LlamaConfig) -> Result<()> {
    if cfg.qk_norm() {
        return Err(Error::InvalidInput(format!(
            "device training of `{}` models is not implemented (the backward of their q/k head norms); train on \
             the CPU (update_on_device = false)",
            cfg.model_type
        )));
    }
    if cfg.attention_bias()?.o {
        return Err(Error::InvalidInput(
            "device training supports biases on q/k/v only, not the attention output's (attention_bias)".into(),
        ));
    }
    Ok(())
}

/// A trainer of models of `cfg` runs `model` only if it has that configuration.
pub(super) fn check_config(cfg: &LlamaConfig, model: &CudaLlama) -> Result<()> {
    if model.config() != cfg {
        return Err(Error::InvalidInput("a trainer runs the model of its own configuration".into()));
    }
    Ok(())
}

/// The training forward of `batch` through `model` into `acts` at `temperature` (a trainer's, of models of `cfg`):
/// the checks and the pass [`CudaTrainer::forward`] and the LoRA trainer share.
#[allow(clippy::too_many_arguments)]
pub(super) fn checked_forward(
    g: &dyn Gpu,
    cfg: &LlamaConfig,
    dims: &Dims,
    acts: &mut Acts,
    model: &CudaLlama,
    batch: &TrainBatch,
    temperature: f64,
    entropy: bool,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    check_config(cfg, model)?;
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(Error::InvalidInput(format!("temperature {temperature} must be finite and > 0")));
    }
    pass::forward(g, dims, &model.w.bufs(), acts, batch, (1.0 / temperature) as f32, entropy)
}
