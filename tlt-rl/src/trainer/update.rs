//! The policy update of one RL step: micro-batches by token budget, the GRPO loss on response tokens only,
//! gradient accumulation, AdamW.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use tlt_drafter::train::AdamW;
use tlt_model::Llama;

use super::rollout::Sample;
use crate::grpo::{logprobs_and_entropy, policy_loss, GrpoConfig, LossInputs, LossNorm, LossStats};
use crate::microbatch::plan_micro_batches;
use crate::Result;

/// What one policy update did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateStats {
    /// Loss statistics merged over micro-batches (`loss` is the full-batch loss).
    pub loss: LossStats,
    /// Global gradient norm before clipping (0 without an update).
    pub grad_norm: f64,
    /// Micro-batches run.
    pub micro_batches: usize,
    /// Sequences that took part (zero-variance groups dropped).
    pub sequences: usize,
}

/// One training sequence: the sample and its advantage.
pub(crate) struct TrainSeq<'a> {
    pub sample: &'a Sample,
    pub advantage: f64,
}

/// A micro-batch laid out for the forward: right-padded inputs and the response positions.
struct Layout {
    /// `[b, t]` input ids (the sequence minus its last token).
    ids: Tensor,
    /// `[b * r]` flat indices into `[b * t]` rows of the response positions (padding points at row 0).
    rows: Tensor,
    /// `[b, r]` targets (the response tokens).
    targets: Tensor,
    /// `[b, r]` 1 for a trained token.
    mask: Tensor,
    /// `[b, r]` rollout log-probabilities.
    rollout_logp: Tensor,
    /// `[b]` advantages.
    advantages: Tensor,
    b: usize,
    r: usize,
}

fn layout(seqs: &[&TrainSeq], grpo: &GrpoConfig, dev: &Device) -> Result<Layout> {
    let b = seqs.len();
    let t = seqs.iter().map(|s| s.sample.prompt.len() + s.sample.tokens.len() - 1).max().unwrap_or(1);
    let r = seqs.iter().map(|s| s.sample.tokens.len()).max().unwrap_or(1);
    let mut ids = vec![0u32; b * t];
    let mut rows = vec![0u32; b * r];
    let mut targets = vec![0u32; b * r];
    let mut mask = vec![0f32; b * r];
    let mut rollout = vec![0f32; b * r];
    for (i, s) in seqs.iter().enumerate() {
        let (p, n) = (s.sample.prompt.len(), s.sample.tokens.len());
        let full: Vec<u32> = s.sample.prompt.iter().chain(&s.sample.tokens).copied().collect();
        ids[i * t..i * t + p + n - 1].copy_from_slice(&full[..p + n - 1]);
        let on = if grpo.trains_on(s.sample.truncated) { 1.0 } else { 0.0 };
        for j in 0..n {
            rows[i * r + j] = (i * t + p - 1 + j) as u32;
            targets[i * r + j] = s.sample.tokens[j];
            mask[i * r + j] = on;
            rollout[i * r + j] = s.sample.logprobs.get(j).copied().unwrap_or(0.0);
        }
    }
    let adv: Vec<f32> = seqs.iter().map(|s| s.advantage as f32).collect();
    Ok(Layout {
        ids: Tensor::from_vec(ids, (b, t), dev)?,
        rows: Tensor::from_vec(rows, b * r, dev)?,
        targets: Tensor::from_vec(targets, (b, r), dev)?,
        mask: Tensor::from_vec(mask, (b, r), dev)?,
        rollout_logp: Tensor::from_vec(rollout, (b, r), dev)?,
        advantages: Tensor::from_vec(adv, b, dev)?,
        b,
        r,
    })
}

/// Log-probabilities (and entropies) of the response tokens under `model`: `[b, r]` each.
fn response_logprobs(model: &Llama, l: &Layout, temperature: f64, entropy: bool) -> Result<(Tensor, Option<Tensor>)> {
    let h = model.forward_train_hidden(&l.ids)?;
    let (bb, tt, hidden) = h.dims3()?;
    let picked = h.reshape((bb * tt, hidden))?.index_select(&l.rows, 0)?;
    let logits = picked.matmul(&model.weights().lm_head().t()?)?.reshape((l.b, l.r, ()))?;
    logprobs_and_entropy(&logits, &l.targets, temperature, entropy)
}

/// Adds `g` into `acc` for every tensor of `vars`.
fn accumulate(acc: &mut Option<GradStore>, g: GradStore, vars: &[Tensor]) -> Result<()> {
    match acc {
        None => *acc = Some(g),
        Some(a) => {
            for v in vars {
                if let Some(new) = g.get(v) {
                    let sum = match a.get(v) {
                        Some(old) => (old + new)?,
                        None => new.clone(),
                    };
                    a.insert(v, sum);
                }
            }
        }
    }
    Ok(())
}

/// Everything the update reads besides the data.
pub(crate) struct UpdateContext<'a> {
    pub policy: &'a Llama,
    pub reference: Option<&'a Llama>,
    pub grpo: &'a GrpoConfig,
    pub temperature: f64,
    pub max_new_tokens: usize,
    pub micro_batch_tokens: usize,
    pub lr: f64,
    pub max_grad_norm: Option<f64>,
}

/// One GRPO update over `seqs` (already filtered). An empty batch or one without trained tokens changes nothing.
pub(crate) fn policy_update(ctx: &UpdateContext, opt: &mut AdamW, seqs: &[TrainSeq]) -> Result<UpdateStats> {
    let trained = |s: &TrainSeq| if ctx.grpo.trains_on(s.sample.truncated) { s.sample.tokens.len() } else { 0 };
    let total_tokens: usize = seqs.iter().map(trained).sum();
    let mut stats = UpdateStats { sequences: seqs.len(), ..UpdateStats::default() };
    if total_tokens == 0 {
        return Ok(stats);
    }
    let total_seqs = seqs.iter().filter(|s| trained(s) > 0).count();
    let norm = LossNorm { total_tokens, total_seqs, max_response_len: ctx.max_new_tokens };
    let lengths: Vec<usize> = seqs.iter().map(|s| s.sample.prompt.len() + s.sample.tokens.len() - 1).collect();
    let plan = plan_micro_batches(&lengths, ctx.micro_batch_tokens)?;
    let vars: Vec<Tensor> = opt.params().iter().map(|(_, v)| v.as_tensor().clone()).collect();
    let dev = Device::Cpu;
    let temperature = if ctx.temperature > 0.0 { ctx.temperature } else { 1.0 };
    let mut acc = None;
    for mb in &plan {
        let part: Vec<&TrainSeq> = mb.iter().map(|&i| &seqs[i]).collect();
        let l = layout(&part, ctx.grpo, &dev)?;
        let (logp, entropy) = response_logprobs(ctx.policy, &l, temperature, ctx.grpo.entropy_coef > 0.0)?;
        let old = logp.detach();
        let reference = match (ctx.reference, &ctx.grpo.kl) {
            (Some(m), Some(_)) => Some(response_logprobs(m, &l, temperature, false)?.0.detach()),
            _ => None,
        };
        // The engine records temperature-1 log-probabilities: the IS correction compares like with like only there.
        let rollout = (temperature == 1.0).then_some(&l.rollout_logp);
        let inputs = LossInputs {
            logp: &logp,
            old_logp: &old,
            rollout_logp: rollout,
            ref_logp: reference.as_ref(),
            entropy: entropy.as_ref(),
            advantages: &l.advantages,
            mask: &l.mask,
        };
        let (loss, s) = policy_loss(&inputs, &norm, ctx.grpo)?;
        stats.loss.merge(&s);
        accumulate(&mut acc, loss.to_dtype(DType::F32)?.backward()?, &vars)?;
        stats.micro_batches += 1;
    }
    if let Some(grads) = acc {
        stats.grad_norm = opt.step(&grads, ctx.lr, ctx.max_grad_norm)?.before;
    }
    Ok(stats)
}
