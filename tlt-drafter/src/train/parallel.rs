//! Data-parallel drafter training: trainers that start from the same state, each take the loss on their share of
//! a batch, and sum their gradients through the caller's all-reduce, so that all apply the same update, the one a
//! single trainer would apply to the whole batch (up to float summation order). Each share is packed within
//! [`TrainConfig::tokens_per_step`](crate::TrainConfig::tokens_per_step) on its own, so for a batch beyond that
//! budget the trainers together train on more tokens than one trainer would.

use std::sync::Arc;
use std::time::Instant;

use tlt_model::optim::ParamState;

use super::{DrafterTrainer, StepStats, Totals};
use crate::online::FeatureSample;
use crate::{Error, Result};

impl DrafterTrainer {
    /// One optimizer step as one of several data-parallel trainers. This trainer's loss on `samples` (its share of
    /// the batch; empty is allowed) gives its gradient, weighted by its training positions; `reduce` sums the
    /// buffer elementwise across the trainers (an all-reduce: every trainer calls `step_with` once per step, with
    /// the same step count); the sum, divided by the positions of all shares, is clipped and applied as
    /// [`Self::step`] applies its gradient. The input noise is seeded from the step, as in [`Self::step`]. Trainers
    /// that hold the same weights, optimizer moments and step ([`Self::join`]) end with the same weights.
    ///
    /// Returns this share's loss and the update's norm; `None` for an empty share (which still took part).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when any trainer's loss failed or was not finite, or no share had a training
    /// position: every trainer then returns it and none updates. `reduce`'s failure as [`Error::Reduce`] (the
    /// other trainers may then be left waiting in theirs: a job should end on it).
    pub fn step_with<E: std::fmt::Display>(
        &mut self,
        samples: &[Arc<FeatureSample>],
        reduce: impl FnOnce(&mut [f32]) -> std::result::Result<(), E>,
    ) -> Result<Option<StepStats>> {
        let t0 = Instant::now();
        let lr = self.cfg.lr_at(self.step);
        let noise_seed = self.cfg.noise_seed(self.step);
        let sizes: Vec<usize> = self.opt.params().iter().map(|(_, v)| v.elem_count()).collect();
        // [gradient × positions of every parameter..., whether each has a gradient..., positions, failures]
        let total: usize = sizes.iter().sum();
        let mut buf = vec![0f32; total + sizes.len() + 2];
        let n = buf.len();
        let mut local = None;
        let mut failure = None;
        if !samples.is_empty() {
            match self.loss(samples, Some(noise_seed)) {
                Ok((_, eval)) if !eval.loss.is_finite() => {
                    failure = Some(format!("non-finite loss {} at step {}", eval.loss, self.step));
                }
                Ok((loss, eval)) => {
                    let grads = loss.backward()?;
                    let w = eval.targets as f32;
                    let mut at = 0;
                    for (i, ((_, v), &len)) in self.opt.params().iter().zip(&sizes).enumerate() {
                        if let Some(g) = grads.get(v.as_tensor()) {
                            let g = g.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
                            for (b, x) in buf[at..at + len].iter_mut().zip(g) {
                                *b = x * w;
                            }
                            buf[total + i] = 1.0;
                        }
                        at += len;
                    }
                    buf[n - 2] = w;
                    local = Some((grads, eval));
                }
                Err(e) => failure = Some(e.to_string()),
            }
        }
        buf[n - 1] = f32::from(failure.is_some());
        reduce(&mut buf).map_err(|e| Error::Reduce(e.to_string()))?;
        let (positions, failed) = (buf[n - 2], buf[n - 1]);
        if failed > 0.0 || positions <= 0.0 {
            return Err(Error::InvalidArgument(match failure {
                Some(e) => format!("data-parallel drafter step {}: {e}", self.step),
                None if failed > 0.0 => {
                    format!("data-parallel drafter step {}: {failed} other trainer(s) failed", self.step)
                }
                None => format!("data-parallel drafter step {}: no share has a training position", self.step),
            }));
        }
        // The summed gradients, divided by all positions, into a gradient store the optimizer reads (a parameter no
        // trainer has a gradient for is left out, so the optimizer leaves it alone as in `step`).
        let (mut grads, eval) = match local {
            Some((grads, eval)) => (grads, Some(eval)),
            // An empty share has no store of its own, and candle's `GradStore` has no public constructor: the
            // backward pass of a constant gives one, holding only that constant's entry (no parameter's).
            None => {
                (candle_core::Tensor::zeros((), candle_core::DType::F32, &candle_core::Device::Cpu)?.backward()?, None)
            }
        };
        let mut at = 0;
        for (i, ((_, v), &len)) in self.opt.params().iter().zip(&sizes).enumerate() {
            if buf[total + i] > 0.0 {
                let g: Vec<f32> = buf[at..at + len].iter().map(|&x| x / positions).collect();
                let t = candle_core::Tensor::from_vec(g, v.shape(), v.device())?.to_dtype(v.dtype())?;
                grads.insert(v.as_tensor(), t);
            } else {
                grads.remove(v.as_tensor());
            }
            at += len;
        }
        let grad_norm = self.opt.step(&grads, lr, self.cfg.grad_clip)?;
        self.step += 1;
        Ok(eval.map(|eval| self.record(eval, grad_norm, lr, t0)))
    }

    /// Joins another trainer's run: its step count, totals and AdamW moments (in [`Self::optimizer`]'s parameter
    /// order); the weights are set through [`TrainableDrafter::vars`](crate::TrainableDrafter::vars). With the same
    /// weights, the next [`Self::step_with`] of both applies the same update.
    ///
    /// # Errors
    /// [`Error::Model`] when the moments do not match the parameters.
    pub fn join(&mut self, step: u64, totals: Totals, moments: Vec<ParamState>) -> Result<()> {
        self.opt.set_state(moments)?;
        self.step = step;
        self.totals = totals;
        Ok(())
    }
}
