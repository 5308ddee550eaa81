//! GRPO math: group-relative advantages, token log-probabilities, KL estimators and the clipped policy loss.
//!
//! The knobs follow verl / TRL / DAPO / Dr. GRPO (see [`GrpoConfig`]). Advantages are plain `f64` slices
//! ([`group_advantages`]); the loss works on candle tensors and is differentiable w.r.t. the policy's
//! log-probabilities ([`policy_loss`]). Losses are normalised by whole-mini-batch sizes ([`LossNorm`]), so gradient
//! accumulation over micro-batches reproduces the full-batch gradient exactly.

mod advantages;
mod config;
mod logprobs;
mod loss;
#[cfg(test)]
mod loss_tests;

pub(crate) use advantages::all_equal;
pub use advantages::{group_advantages, Advantages};
pub use config::{overlong_penalty, GrpoConfig, KlConfig, KlEstimator, LossAgg, MeanLevel, Truncation};
pub use logprobs::{kl_estimate, logprobs_and_entropy};
pub use loss::{policy_loss, LossInputs, LossNorm, LossStats};
