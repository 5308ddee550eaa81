//! The policy update of one RL step: micro-batches by token budget, the GRPO loss on response tokens only,
//! gradient accumulation, AdamW.

use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};
use tlt_kernels::SplitMix64;
use tlt_model::optim::AdamW;
use tlt_model::{accumulate_grads, Checkpoints, Llama};

use super::head::ChunkedHead;
use super::types::Sample;
use crate::grpo::{policy_loss, GrpoConfig, LossInputs, LossNorm, LossStats};
use crate::microbatch::plan_micro_batches;
use crate::Result;

/// What one policy update did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateStats {
    /// Loss statistics merged over every micro-batch of every optimizer step taken (token-weighted; `loss` is the
    /// mean of the mini-batch losses, and `tokens` counts each pass); skipped steps are left out.
    pub loss: LossStats,
    /// Mean global gradient norm before clipping over the optimizer steps taken (0 without an update; NaN when every
    /// step was skipped for a non-finite norm).
    pub grad_norm: f64,
    /// Optimizer (AdamW) steps taken.
    #[serde(default)]
    pub optimizer_steps: usize,
    /// Optimizer steps skipped because the gradient norm was not finite (nothing changed; logged as a warning).
    #[serde(default)]
    pub skipped_steps: usize,
    /// Micro-batches run.
    pub micro_batches: usize,
    /// Sequences that took part (zero-variance groups dropped).
    pub sequences: usize,
    /// Seconds spent summing gradients and loss statistics across data-parallel ranks, once every rank's
    /// backward was done (0 for one rank).
    #[serde(default)]
    pub grad_sync_s: f64,
    /// Seconds this rank waited for the slowest rank's backward before the sums (0 for one rank).
    #[serde(default)]
    pub grad_wait_s: f64,
}

/// One training sequence: the sample and its advantage.
pub(crate) struct TrainSeq<'a> {
    pub sample: &'a Sample,
    pub advantage: f64,
}

/// A micro-batch laid out for the forward: right-padded inputs and the response positions.
pub(super) struct Layout {
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
    /// `[b, r]` log-probabilities under the policy before the step's first update (when precomputed).
    old_logp: Option<Tensor>,
    /// `[b]` advantages.
    advantages: Tensor,
}

impl Layout {
    /// `r`: response positions per sequence (the longest response of the micro-batch).
    pub(super) fn response_width(&self) -> Result<usize> {
        Ok(self.mask.dim(1)?)
    }
}

pub(super) fn layout(seqs: &[&TrainSeq], old: Option<&[&[f32]]>, grpo: &GrpoConfig, dev: &Device) -> Result<Layout> {
    let b = seqs.len();
    let t = seqs.iter().map(|s| s.sample.prompt.len() + s.sample.tokens.len() - 1).max().unwrap_or(1);
    let r = seqs.iter().map(|s| s.sample.tokens.len()).max().unwrap_or(1);
    let mut ids = vec![0u32; b * t];
    let mut rows = vec![0u32; b * r];
    let mut targets = vec![0u32; b * r];
    let mut mask = vec![0f32; b * r];
    let mut rollout = vec![0f32; b * r];
    let mut old_logp = vec![0f32; b * r];
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
            if let Some(o) = old {
                old_logp[i * r + j] = o[i].get(j).copied().unwrap_or(0.0);
            }
        }
    }
    let adv: Vec<f32> = seqs.iter().map(|s| s.advantage as f32).collect();
    Ok(Layout {
        ids: Tensor::from_vec(ids, (b, t), dev)?,
        rows: Tensor::from_vec(rows, b * r, dev)?,
        targets: Tensor::from_vec(targets, (b, r), dev)?,
        mask: Tensor::from_vec(mask, (b, r), dev)?,
        rollout_logp: Tensor::from_vec(rollout, (b, r), dev)?,
        old_logp: old.map(|_| Tensor::from_vec(old_logp, (b, r), dev)).transpose()?,
        advantages: Tensor::from_vec(adv, b, dev)?,
    })
}

/// The final-norm states of the response rows (`[b * r, hidden]`, attached to the graph) and, with `checkpoint`,
/// the layer inputs a backward must finish with ([`Checkpoints::backward`]).
fn response_hidden(model: &Llama, l: &Layout, checkpoint: bool) -> Result<(Tensor, Option<Checkpoints>)> {
    let (h, ck) = if checkpoint {
        let (h, ck) = model.forward_train_hidden_checkpointed(&l.ids)?;
        (h, Some(ck))
    } else {
        (model.forward_train_hidden(&l.ids)?, None)
    };
    let (bb, tt, hidden) = h.dims3()?;
    Ok((h.reshape((bb * tt, hidden))?.index_select(&l.rows, 0)?, ck))
}

/// `[b, r]` log-probabilities of the response tokens under `model`, values only: the checkpointed forward and the
/// chunked head keep no more than one layer's graph or one chunk's logits alive.
fn response_logprobs(model: &Llama, l: &Layout, temperature: f64) -> Result<Tensor> {
    let (h, _) = response_hidden(model, l, true)?;
    Ok(ChunkedHead::new(model, h.detach(), &l.targets, temperature, false)?.logp.as_tensor().detach())
}

/// Everything the update reads besides the data.
pub(crate) struct UpdateContext<'a> {
    pub policy: &'a Llama,
    pub reference: Option<&'a Llama>,
    pub grpo: &'a GrpoConfig,
    pub temperature: f64,
    pub max_new_tokens: usize,
    pub micro_batch_tokens: usize,
    /// Sequences per optimizer step (`usize::MAX`: the whole batch).
    pub mini_batch_seqs: usize,
    /// Passes over the batch.
    pub ppo_epochs: usize,
    /// Seed of the mini-batch shuffles.
    pub shuffle_seed: u64,
    /// Activation checkpointing in the update's backward.
    pub checkpoint: bool,
    pub lr: f64,
    pub max_grad_norm: Option<f64>,
    /// The data-parallel job: gradients are summed over its ranks before each optimizer step.
    pub comm: &'a dyn tlt_comm::Comm,
    /// The groups whose sequences this rank runs forward and backward (every sequence still counts in the
    /// loss's divisors on every rank).
    pub owned: std::ops::Range<usize>,
}

impl UpdateContext<'_> {
    /// The log-probability temperature (greedy rollouts train at 1).
    pub(super) fn temperature(&self) -> f64 {
        if self.temperature > 0.0 {
            self.temperature
        } else {
            1.0
        }
    }
}

impl UpdateContext<'_> {
    /// Whether `s` can contribute to the loss's gradient: a non-zero advantage, or a KL or entropy term (which act
    /// on every token). A sequence that cannot still counts in the loss's divisors ([`LossNorm`]) but needs no
    /// forward or backward: its clipped policy-gradient term is `-0 × ratio`, whatever the ratio.
    pub(super) fn contributes(&self, s: &TrainSeq) -> bool {
        s.advantage != 0.0 || self.grpo.kl.is_some() || self.grpo.entropy_coef > 0.0
    }

    /// Whether this rank computes `s`'s gradient: it [contributes](Self::contributes) and its group is this
    /// rank's.
    pub(super) fn computes(&self, s: &TrainSeq) -> bool {
        self.contributes(s) && self.owned.contains(&s.sample.group)
    }
}

/// Response log-probabilities under the policy before any update (no gradient), trimmed to each response's length,
/// of every sequence this rank [computes](UpdateContext::computes) (empty for the others): the PPO "old" policy
/// when a step takes several optimizer steps.
fn old_logprobs(ctx: &UpdateContext, seqs: &[TrainSeq]) -> Result<Vec<Vec<f32>>> {
    let mut out = vec![Vec::new(); seqs.len()];
    for mb in micro_batches_of(ctx, seqs, 0..seqs.len())? {
        let part: Vec<&TrainSeq> = mb.iter().map(|&i| &seqs[i]).collect();
        let l = layout(&part, None, ctx.grpo, &Device::Cpu)?;
        let logp = response_logprobs(ctx.policy, &l, ctx.temperature())?.to_vec2::<f32>()?;
        for (&i, row) in mb.iter().zip(logp) {
            out[i] = row[..seqs[i].sample.tokens.len()].to_vec();
        }
    }
    Ok(out)
}

/// What one mini-batch's optimizer step did.
pub(super) struct MiniStep {
    pub stats: LossStats,
    pub grad_norm: f64,
    pub micros: usize,
    /// False when the gradient norm was not finite and AdamW skipped the step.
    pub applied: bool,
    /// Seconds waiting for the other ranks, then in the cross-rank sums.
    pub wait_s: f64,
    pub sync_s: f64,
}

/// Where the update's arithmetic runs (the forwards, the backward, the optimizer step): the CPU ([`HostUpdate`]) or
/// a device (`super::update_device::DeviceUpdate`). The loss, the batching, the shuffles and the statistics are
/// [`policy_update`]'s, shared.
pub(crate) trait UpdateBackend {
    /// Response log-probabilities under the policy before any update (no gradient), trimmed to each response's
    /// length, of every sequence this rank [computes](UpdateContext::computes) (empty for the others).
    fn old_logprobs(&mut self, ctx: &UpdateContext, seqs: &[TrainSeq]) -> Result<Vec<Vec<f32>>>;

    /// One optimizer step over the sequences `mb` of `seqs` ([`StepPlan`]); `None` when the mini-batch trains no
    /// token.
    fn mini_batch_step(
        &mut self,
        ctx: &UpdateContext,
        seqs: &[TrainSeq],
        mb: &[usize],
        old: Option<&[Vec<f32>]>,
    ) -> Result<Option<MiniStep>>;
}

/// The update on the CPU: candle autograd and the host AdamW.
pub(crate) struct HostUpdate<'a> {
    pub opt: &'a mut AdamW,
}

impl UpdateBackend for HostUpdate<'_> {
    fn old_logprobs(&mut self, ctx: &UpdateContext, seqs: &[TrainSeq]) -> Result<Vec<Vec<f32>>> {
        old_logprobs(ctx, seqs)
    }

    fn mini_batch_step(
        &mut self,
        ctx: &UpdateContext,
        seqs: &[TrainSeq],
        mb: &[usize],
        old: Option<&[Vec<f32>]>,
    ) -> Result<Option<MiniStep>> {
        mini_batch_step(ctx, self.opt, seqs, mb, old)
    }
}

/// The micro-batches (indices into `seqs`, by the update's token budget) of the sequences of `among` this rank
/// [computes](UpdateContext::computes).
pub(super) fn micro_batches_of(
    ctx: &UpdateContext,
    seqs: &[TrainSeq],
    among: impl Iterator<Item = usize>,
) -> Result<Vec<Vec<usize>>> {
    let run: Vec<usize> = among.filter(|&i| ctx.computes(&seqs[i])).collect();
    let lengths: Vec<usize> =
        run.iter().map(|&i| seqs[i].sample.prompt.len() + seqs[i].sample.tokens.len() - 1).collect();
    Ok(plan_micro_batches(&lengths, ctx.micro_batch_tokens)?
        .into_iter()
        .map(|m| m.iter().map(|&j| run[j]).collect())
        .collect())
}

/// What one mini-batch's step runs: the loss's divisors over the whole mini-batch, and the micro-batches (indices
/// into `seqs`) of the sequences this rank computes.
pub(super) struct StepPlan {
    pub norm: LossNorm,
    pub micros: Vec<Vec<usize>>,
}

impl StepPlan {
    /// The plan of mini-batch `mb` of `seqs`; `None` when it trains no token.
    ///
    /// Only the sequences that [contribute](UpdateContext::contributes) run forward and backward; the others (a zero
    /// advantage and no KL or entropy term: every answer of a group whose rewards are all equal) count in the
    /// divisors as verl counts them, at no compute.
    pub(super) fn new(ctx: &UpdateContext, seqs: &[TrainSeq], mb: &[usize]) -> Result<Option<Self>> {
        let trained = |s: &TrainSeq| if ctx.grpo.trains_on(s.sample.truncated) { s.sample.tokens.len() } else { 0 };
        let total_tokens: usize = mb.iter().map(|&i| trained(&seqs[i])).sum();
        if total_tokens == 0 {
            return Ok(None);
        }
        let total_seqs = mb.iter().filter(|&&i| trained(&seqs[i]) > 0).count();
        let norm = LossNorm { total_tokens, total_seqs, max_response_len: ctx.max_new_tokens };
        let micros = micro_batches_of(ctx, seqs, mb.iter().copied().filter(|&i| trained(&seqs[i]) > 0))?;
        Ok(Some(Self { norm, micros }))
    }
}

#[cfg(test)]
thread_local! {
    /// Test hook: the update fails (an injected error) before its optimizer step number `n` (0-based).
    pub(crate) static FAIL_BEFORE_STEP: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// One optimizer step over the sequences `mb` of `seqs`: micro-batches by token budget, the loss normalised over
/// the mini-batch, gradients accumulated, AdamW. `None` when the mini-batch trains no token.
///
/// Only the sequences that [contribute](UpdateContext::contributes) run forward and backward; the others (a zero
/// advantage and no KL or entropy term: every answer of a group whose rewards are all equal) count in the divisors
/// as verl counts them, at no compute. A mini-batch where none contributes still takes its optimizer step, with
/// zero gradients, as verl's would (AdamW's moments and weight decay still act).
fn mini_batch_step(
    ctx: &UpdateContext,
    opt: &mut AdamW,
    seqs: &[TrainSeq],
    mb: &[usize],
    old: Option<&[Vec<f32>]>,
) -> Result<Option<MiniStep>> {
    let Some(plan) = StepPlan::new(ctx, seqs, mb)? else { return Ok(None) };
    let norm = plan.norm;
    let dev = Device::Cpu;
    let temperature = ctx.temperature();
    let (mut acc, mut stats, mut micros) = (None, LossStats::default(), 0);
    for micro in &plan.micros {
        let part: Vec<&TrainSeq> = micro.iter().map(|&i| &seqs[i]).collect();
        let part_old: Option<Vec<&[f32]>> = old.map(|o| micro.iter().map(|&i| o[i].as_slice()).collect());
        let l = layout(&part, part_old.as_deref(), ctx.grpo, &dev)?;
        let (hidden, ck) = response_hidden(ctx.policy, &l, ctx.checkpoint)?;
        let head = ChunkedHead::new(ctx.policy, hidden, &l.targets, temperature, ctx.grpo.entropy_coef > 0.0)?;
        let reference = match (ctx.reference, &ctx.grpo.kl) {
            (Some(m), Some(_)) => Some(response_logprobs(m, &l, temperature)?),
            _ => None,
        };
        let entropy = head.entropy.as_ref().map(Var::as_tensor);
        let (loss, s) = micro_loss(ctx, &l, &norm, head.logp.as_tensor(), entropy, reference.as_ref())?;
        stats.merge(&s);
        let loss_grads = loss.to_dtype(DType::F32)?.backward()?;
        let grads = head.backward(&loss_grads, ctx.policy)?;
        match ck {
            // Layer by layer into the accumulated gradients: no second full set of gradients at any time.
            Some(ck) => ck.backward_into(ctx.policy, grads, &mut acc)?,
            None => accumulate_grads(&mut acc, grads)?,
        }
        micros += 1;
        tlt_model::chaos::kill_point("update.micro");
    }
    let (wait_s, t_sync) = rank_sync(ctx, &mut stats, &mut micros)?;
    let grads = match (ctx.comm.size(), acc) {
        (1, Some(g)) => g,
        (1, None) => zero_grads(opt)?,
        (_, acc) => super::parallel::all_reduce_grads(ctx.comm, opt, acc)?,
    };
    let sync_s = if ctx.comm.size() > 1 { t_sync.elapsed().as_secs_f64() } else { 0.0 };
    let norm = opt.step(&grads, ctx.lr, ctx.max_grad_norm)?;
    tlt_model::chaos::kill_point("update.step");
    if !norm.applied() {
        tracing::warn!(grad_norm = norm.before, "non-finite gradient norm: optimizer step skipped, weights unchanged");
    }
    Ok(Some(MiniStep { stats, grad_norm: norm.before, micros, applied: norm.applied(), wait_s, sync_s }))
}

/// The GRPO loss of the micro-batch laid out as `l` (`[b, r]` tensors): the policy's log-probabilities `logp` (and
/// entropies), the reference's for the KL term, the rollout's for the IS correction (recorded at the rollout
/// temperature: like with like), and the old policy's: `l`'s when precomputed, else `logp`'s values (a step of one
/// optimizer step).
pub(super) fn micro_loss(
    ctx: &UpdateContext,
    l: &Layout,
    norm: &LossNorm,
    logp: &Tensor,
    entropy: Option<&Tensor>,
    reference: Option<&Tensor>,
) -> Result<(Tensor, LossStats)> {
    let old_logp = match &l.old_logp {
        Some(o) => o.clone(),
        None => logp.detach(),
    };
    let inputs = LossInputs {
        logp,
        old_logp: &old_logp,
        rollout_logp: Some(&l.rollout_logp),
        ref_logp: reference,
        entropy,
        advantages: &l.advantages,
        mask: &l.mask,
    };
    policy_loss(&inputs, norm, ctx.grpo)
}

/// Waits for every rank's backward (timed), then merges the loss statistics and micro-batch counts over the ranks;
/// returns the seconds waited and when the cross-rank sums began (the caller's gradient sum comes next). Nothing
/// for one rank.
pub(super) fn rank_sync(
    ctx: &UpdateContext,
    stats: &mut LossStats,
    micros: &mut usize,
) -> Result<(f64, std::time::Instant)> {
    if ctx.comm.size() == 1 {
        return Ok((0.0, std::time::Instant::now()));
    }
    let t_wait = std::time::Instant::now();
    ctx.comm.barrier()?;
    let wait_s = t_wait.elapsed().as_secs_f64();
    let t_sync = std::time::Instant::now();
    (*stats, *micros) = super::parallel::merge_stats(ctx.comm, *stats, *micros)?;
    Ok((wait_s, t_sync))
}

/// Zero gradients for every parameter of `opt` (an optimizer step whose loss has no gradient). Inserted directly:
/// candle's backward drops a `× 0` from the graph, so no loss yields them.
fn zero_grads(opt: &AdamW) -> Result<candle_core::backprop::GradStore> {
    let mut store = Var::new(0f32, &Device::Cpu)?.as_tensor().backward()?;
    for (_, v) in opt.params() {
        store.insert(v.as_tensor(), v.as_tensor().zeros_like()?);
    }
    Ok(store)
}

/// `order` cut into `ceil(len / chunk)` mini-batches of near-equal size (sizes differ by at most one), so no
/// small remainder gets a full optimizer step of its own.
fn mini_batches(order: &[usize], chunk: usize) -> Vec<&[usize]> {
    let k = order.len().div_ceil(chunk.max(1)).max(1);
    let (base, extra) = (order.len() / k, order.len() % k);
    let mut out = Vec::with_capacity(k);
    let mut start = 0;
    for j in 0..k {
        let len = base + usize::from(j < extra);
        out.push(&order[start..start + len]);
        start += len;
    }
    out
}

/// The GRPO update of one RL step over `seqs` (already filtered): `ppo_epochs` passes, each cutting the shuffled
/// batch into near-equal mini-batches of about `mini_batch_seqs` ([`mini_batches`]), one AdamW step per
/// mini-batch. An empty batch or one without trained tokens changes nothing.
///
/// `stats` holds what was done so far even when an error ends the update half-way (`optimizer_steps` then says
/// whether the weights moved).
pub(crate) fn policy_update(
    ctx: &UpdateContext,
    backend: &mut dyn UpdateBackend,
    seqs: &[TrainSeq],
    stats: &mut UpdateStats,
) -> Result<()> {
    *stats = UpdateStats { sequences: seqs.len(), ..UpdateStats::default() };
    if seqs.is_empty() {
        return Ok(());
    }
    let k = seqs.len().div_ceil(ctx.mini_batch_seqs.clamp(1, seqs.len()));
    let several = ctx.ppo_epochs * k > 1;
    let old = if several { Some(backend.old_logprobs(ctx, seqs)?) } else { None };
    let mut rng = SplitMix64::new(ctx.shuffle_seed);
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    let (mut grad_norm_sum, mut passes) = (0.0, 0usize);
    for _ in 0..ctx.ppo_epochs {
        if several {
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
        }
        for mb in mini_batches(&order, ctx.mini_batch_seqs) {
            #[cfg(test)]
            if FAIL_BEFORE_STEP.with(std::cell::Cell::get) == Some(stats.optimizer_steps + stats.skipped_steps) {
                return Err(crate::Error::InvalidArgument("injected update failure".into()));
            }
            let Some(m) = backend.mini_batch_step(ctx, seqs, mb, old.as_deref())? else { continue };
            stats.micro_batches += m.micros;
            stats.grad_sync_s += m.sync_s;
            stats.grad_wait_s += m.wait_s;
            if m.applied {
                // Only applied steps enter the loss statistics: a skipped one's loss is what made its gradient
                // non-finite (NaN or infinite), which would poison the step's mean.
                stats.loss.merge(&m.stats);
                passes += 1;
                grad_norm_sum += m.grad_norm;
                stats.optimizer_steps += 1;
            } else {
                stats.skipped_steps += 1;
            }
        }
    }
    if passes > 0 {
        stats.loss.loss /= passes as f64;
    }
    if stats.optimizer_steps > 0 {
        stats.grad_norm = grad_norm_sum / stats.optimizer_steps as f64;
    } else if stats.skipped_steps > 0 {
        // Every step was skipped for a non-finite norm: say so (0 would read as a converged update).
        stats.grad_norm = f64::NAN;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::mini_batches;

    #[test]
    fn mini_batches_are_near_equal_and_cover_the_order() {
        let order: Vec<usize> = (0..10).collect();
        let sizes = |chunk| mini_batches(&order, chunk).iter().map(|m| m.len()).collect::<Vec<_>>();
        assert_eq!(sizes(4), [4, 3, 3], "not [4, 4, 2]: no small remainder gets a full step");
        assert_eq!(sizes(5), [5, 5]);
        assert_eq!(sizes(10), [10]);
        assert_eq!(sizes(100), [10]);
        assert_eq!(sizes(1), [1; 10]);
        assert_eq!(sizes(3), [3, 3, 2, 2]);
        let flat: Vec<usize> = mini_batches(&order, 3).concat();
        assert_eq!(flat, order);
        assert_eq!(mini_batches(&[], 3).concat(), Vec::<usize>::new());
    }
}
