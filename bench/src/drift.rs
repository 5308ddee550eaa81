//! The drift test of `cargo xtask bench drafter --drift-sft-steps N`: change the target with a few supervised
//! fine-tuning steps on different data, measure the trained EAGLE-2 drafter stale (new target, old drafter
//! weights), then after training it on the new target's own rollouts, against its pre-drift tau.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use tlt_drafter::online::FeatureSample;
use tlt_drafter::train::{train_offline, Budget};
use tlt_drafter::{DrafterTrainer, FrozenTarget, RuntimeOptions};
use tlt_model::optim::{AdamW, AdamWParams, LrSchedule, ScheduleKind};
use tlt_model::{Llama, WeightDType};
use tlt_spec_decode::Plan;
use tokenizers::Tokenizer;
use tracing::info;

use crate::drafter_data::{chat, eval_batch1, rollout_samples};

/// What the drift test measured.
#[derive(Debug, Clone, Serialize)]
pub struct DriftReport {
    /// SFT steps applied to the target, their batch size and learning rate.
    pub sft_steps: usize,
    /// Sequences per SFT step.
    pub sft_batch: usize,
    /// SFT learning rate (AdamW).
    pub sft_lr: f64,
    /// SFT loss (mean token NLL) of the first and last step.
    pub sft_loss: [f64; 2],
    /// Fraction of held-out greedy tokens that changed from the old target's.
    pub changed_token_fraction: f64,
    /// Tau of the drafter on the old target (before the drift).
    pub tau_pre: f64,
    /// Tau of the same drafter weights on the new target (its embedding and head follow the target).
    pub tau_stale: f64,
    /// Tau after training on the new target's rollouts.
    pub tau_recovered: f64,
    /// `tau_recovered / tau_pre` (target >= 0.9).
    pub recovered_ratio: f64,
    /// Response tokens of the new target's rollouts used for the recovery.
    pub recovery_tokens: usize,
    /// Seconds generating them.
    pub recovery_rollout_s: f64,
    /// Drafter steps and seconds of the recovery training.
    pub recovery_steps: u64,
    /// Seconds of recovery training.
    pub recovery_train_s: f64,
    /// Learning rate of the recovery training (constant: the online trainer's).
    pub recovery_lr: f64,
    /// The plan every tau of the test is measured with.
    pub plan: Plan,
    /// SD speedup over plain decoding on the new target: stale, recovered.
    pub speedup: [f64; 2],
    /// Speculative output equals plain output on the new target (both runs).
    pub lossless: bool,
}

/// Settings of the drift test.
pub struct DriftSettings<'a> {
    /// SFT steps.
    pub sft_steps: usize,
    /// SFT learning rate.
    pub sft_lr: f64,
    /// Minutes of recovery training.
    pub minutes: f64,
    /// Prompts whose rollouts the recovery trains on.
    pub prompts: &'a [Vec<u32>],
    /// Held-out prompts.
    pub eval: &'a [Vec<u32>],
    /// Tokens per rollout and per evaluation.
    pub rollout_tokens: usize,
    /// Tokens per evaluation.
    pub eval_tokens: usize,
    /// The draft plan.
    pub plan: &'a Plan,
    /// Runtime packing (hot vocabulary).
    pub opts: &'a RuntimeOptions,
}

/// Chat-formatted arithmetic drills with terse boxed answers: data unlike the drafter's training prompts.
fn sft_texts(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let (a, b) = (3 + (i * 7) % 89, 2 + (i * 13) % 47);
            format!(
                "{}{a} plus {b} equals {}. Final answer: \\boxed{{{}}}<|im_end|>",
                chat(&format!("Add {a} and {b}.")),
                a + b,
                a + b
            )
        })
        .collect()
}

/// A few AdamW steps of next-token cross-entropy on `texts`; returns the new target (packed for inference) and
/// the first and last loss.
fn sft(target: &Llama, tok: &Tokenizer, steps: usize, batch: usize, lr: f64) -> Result<(Llama, [f64; 2])> {
    let mut m = target.deep_copy()?;
    let vars = m.make_trainable()?;
    let mut opt = AdamW::new(vars, AdamWParams::default())?;
    let texts = sft_texts(steps * batch);
    let ids: Vec<Vec<u32>> = texts.iter().map(|t| tlt_model::encode(tok, t)).collect::<Result<_, _>>()?;
    let mut losses = [f64::NAN; 2];
    for s in 0..steps {
        let part = &ids[s * batch..(s + 1) * batch];
        let t = part.iter().map(Vec::len).max().unwrap_or(2) - 1;
        let (mut inp, mut tgt, mut mask) = (vec![0u32; batch * t], vec![0u32; batch * t], vec![0f32; batch * t]);
        for (i, seq) in part.iter().enumerate() {
            for j in 0..seq.len() - 1 {
                inp[i * t + j] = seq[j];
                tgt[i * t + j] = seq[j + 1];
                mask[i * t + j] = 1.0;
            }
        }
        let dev = Device::Cpu;
        let lp =
            m.token_logprobs(&Tensor::from_vec(inp, (batch, t), &dev)?, &Tensor::from_vec(tgt, (batch, t), &dev)?)?;
        let mask = Tensor::from_vec(mask, (batch, t), &dev)?;
        let loss = ((lp * &mask)?.sum_all()?.neg()? / mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?)?;
        let l = loss.to_scalar::<f32>()? as f64;
        losses[if s == 0 { 0 } else { 1 }] = l;
        opt.step(&loss.backward()?, lr, Some(1.0))?;
        info!(step = s, loss = format!("{l:.3}"), "drift: SFT step");
    }
    let mut out = m.deep_copy()?;
    out.pack_for_inference(WeightDType::F32)?;
    Ok((out, losses))
}

/// Runs the drift test on `trainer` (an EAGLE-2 drafter trained on `target`, measured at `tau_pre`).
pub fn run(
    target: &Llama,
    tok: &Tokenizer,
    trainer: &mut DrafterTrainer,
    tau_pre: f64,
    s: &DriftSettings,
) -> Result<DriftReport> {
    let old_plain = eval_batch1(target, s.eval, s.eval_tokens, None, s.plan)?;
    let batch = 8;
    let (new_target, sft_loss) = sft(target, tok, s.sft_steps, batch, s.sft_lr)?;
    let plain = eval_batch1(&new_target, s.eval, s.eval_tokens, None, s.plan)?;
    let (mut changed, mut total) = (0usize, 0usize);
    for (a, b) in old_plain.tokens.iter().zip(&plain.tokens) {
        total += a.len().max(b.len());
        changed += a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    }
    trainer.set_target(FrozenTarget::new(&new_target))?;
    let stale = eval_batch1(&new_target, s.eval, s.eval_tokens, Some(&trainer.runtime(s.opts)?), s.plan)?;
    info!(tau = format!("{:.2}", stale.counters.mean_accept_len()), "drift: stale drafter on the new target");

    let t = Instant::now();
    let samples: Vec<Arc<FeatureSample>> =
        rollout_samples(&new_target, s.prompts, s.rollout_tokens, 16)?.into_iter().map(Arc::new).collect();
    let recovery_rollout_s = t.elapsed().as_secs_f64();
    let recovery_tokens = samples.iter().map(|x| x.tokens.len() - x.response_start).sum();
    // Online training runs at a constant rate, the peak one (as TLT's online trainer): an offline cosine
    // schedule would leave the recovery at its floor.
    trainer.set_lr_schedule(LrSchedule { kind: ScheduleKind::Constant, ..trainer.config().schedule.clone() })?;
    let rep = train_offline(trainer, &samples, Budget::Time(Duration::from_secs_f64(s.minutes * 60.0)), |_| {})?;
    let recovered = eval_batch1(&new_target, s.eval, s.eval_tokens, Some(&trainer.runtime(s.opts)?), s.plan)?;
    let tau_recovered = recovered.counters.mean_accept_len();
    info!(tau = format!("{tau_recovered:.2}"), steps = rep.steps, "drift: drafter after training on the new target");
    Ok(DriftReport {
        sft_steps: s.sft_steps,
        sft_batch: batch,
        sft_lr: s.sft_lr,
        sft_loss,
        changed_token_fraction: changed as f64 / total.max(1) as f64,
        tau_pre,
        tau_stale: stale.counters.mean_accept_len(),
        tau_recovered,
        recovered_ratio: tau_recovered / tau_pre,
        recovery_tokens,
        recovery_rollout_s,
        recovery_steps: rep.steps,
        recovery_lr: trainer.config().schedule.lr,
        plan: *s.plan,
        recovery_train_s: rep.seconds,
        speedup: [plain.decode_s / stale.decode_s, plain.decode_s / recovered.decode_s],
        lossless: stale.tokens == plain.tokens && recovered.tokens == plain.tokens,
    })
}
