//! The policy update on the rollouts' device: the forwards, the backward and AdamW run there
//! (`tlt_model::cuda::train::CudaTrainer`), on the very weights the rollout engine decodes with, updated in place;
//! the GRPO loss stays on the host, on the log-probabilities the device returns (a few floats per token), so the CPU
//! and device updates share every formula. Between steps the host policy mirrors the device's f32 master weights
//! (the drafter's frozen target, the rollout's snapshot and evaluation on the CPU read them); the moments stay on the
//! device until a checkpoint reads them.

use candle_core::{Device, Tensor, Var};
use tlt_model::cuda::train::{Arena, CudaTrainer, TrainBatch, TrainOptions};
use tlt_model::cuda::CudaLlama;
use tlt_model::optim::{AdamW, ParamState};
use tlt_model::Llama;

use super::update::{
    layout, micro_batches_of, micro_loss, rank_sync, MiniStep, StepPlan, TrainSeq, UpdateBackend, UpdateContext,
};
use crate::grpo::LossStats;
use crate::{Error, Result};

/// The device side of the update: the trainer (master weights, moments, gradients, the training pass's buffers)
/// and a frozen reference on the device for the KL term.
#[derive(Debug)]
pub(crate) struct DeviceTrain {
    trainer: CudaTrainer,
    reference: Option<CudaLlama>,
}

impl DeviceTrain {
    /// A device trainer of `policy` (the rollout engine's model) whose master weights, moments and step count are
    /// the host optimizer's (`opt`: a fresh run's or a resumed checkpoint's), with the training pass's buffers as
    /// `opts` plans them; `reference` is uploaded for the KL term.
    pub(crate) fn new(
        policy: &mut CudaLlama,
        opt: &AdamW,
        reference: Option<&Llama>,
        opts: &TrainOptions,
    ) -> Result<Self> {
        let mut trainer = CudaTrainer::with_options(policy, *opt.hyper(), opts)?;
        let named = |f: &dyn Fn(usize, &Var) -> Result<Vec<f32>>| -> Result<Vec<(String, Vec<f32>)>> {
            opt.params().iter().enumerate().map(|(i, (n, v))| Ok((n.clone(), f(i, v)?))).collect()
        };
        let master = named(&|_, v| Ok(v.as_tensor().flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?))?;
        trainer.load_hf(Arena::Master, &master)?;
        trainer.load_hf(Arena::ExpAvg, &named(&|i, _| Ok(opt.state()[i].exp_avg.clone()))?)?;
        trainer.load_hf(Arena::ExpAvgSq, &named(&|i, _| Ok(opt.state()[i].exp_avg_sq.clone()))?)?;
        trainer.set_steps(opt.state().iter().map(|s| s.steps).max().unwrap_or(0));
        trainer.write_decoder(policy)?;
        let reference = reference.map(|r| CudaLlama::new(r, policy.gpu().clone(), 1, 16)).transpose()?;
        let t = &trainer;
        let bytes = tlt_model::cuda::train::train_memory(
            policy.config(),
            t.params().last().map_or(0, |p| p.range.end),
            t.options(),
        );
        tracing::info!(
            train_bytes = bytes,
            weights_bytes = policy.weight_bytes(),
            reference_bytes = reference.as_ref().map_or(0, CudaLlama::weight_bytes),
            max_rows = t.max_rows(),
            checkpoint = t.options().checkpoint,
            head_rows = t.options().head_rows,
            "policy update on the device: f32 master weights, moments and gradients, and the training pass's buffers"
        );
        Ok(Self { trainer, reference })
    }

    /// Copies the device's master weights into the host policy's variables (what the host reads between steps:
    /// the rollout's snapshot, evaluation, the drafter's frozen target): 4 bytes per weight. The moments stay on the
    /// device until a checkpoint asks for them ([`Self::optimizer_state`]).
    pub(crate) fn mirror_weights_to_host(&self, opt: &AdamW) -> Result<()> {
        let t = &self.trainer;
        let w = t.hf_named(&t.arena_to_host(Arena::Master)?)?;
        for (name, var) in opt.params() {
            let values = find(&w, name)?;
            var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu)?.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }

    /// The optimizer's state as the device holds it (moments, steps), in `opt`'s parameter order: what a checkpoint
    /// saves.
    pub(crate) fn optimizer_state(&self, opt: &AdamW) -> Result<Vec<ParamState>> {
        let t = &self.trainer;
        let get = |a: Arena| -> Result<Vec<(String, Vec<f32>)>> { Ok(t.hf_named(&t.arena_to_host(a)?)?) };
        let (m, v) = (get(Arena::ExpAvg)?, get(Arena::ExpAvgSq)?);
        opt.params()
            .iter()
            .map(|(name, _)| Ok(ParamState { exp_avg: find(&m, name)?, exp_avg_sq: find(&v, name)?, steps: t.steps() }))
            .collect()
    }
}

/// The values of `name` in `set` (HF-named tensors of the device trainer).
fn find(set: &[(String, Vec<f32>)], name: &str) -> Result<Vec<f32>> {
    set.iter()
        .find(|(n, _)| n == name)
        .map(|(_, x)| x.clone())
        .ok_or_else(|| Error::InvalidArgument(format!("the device trainer has no `{name}`")))
}

/// The update's backend on the device, for one step: the trainer and the rollout engine's model.
pub(crate) struct DeviceUpdate<'a> {
    pub train: &'a mut DeviceTrain,
    pub policy: &'a mut CudaLlama,
}

/// The prompt/response pairs of `part`.
fn pairs<'s>(part: &[&'s TrainSeq]) -> Vec<(&'s [u32], &'s [u32])> {
    part.iter().map(|s| (s.sample.prompt.as_slice(), s.sample.tokens.as_slice())).collect()
}

/// Each sequence's response rows of `rows` (one value per batch row), in order: `part`'s responses are the batch's
/// scored rows, sequence by sequence.
fn per_seq(part: &[&TrainSeq], batch: &TrainBatch, rows: &[f32]) -> Vec<Vec<f32>> {
    let mut scored = batch.scored_rows();
    part.iter().map(|s| (0..s.sample.tokens.len()).filter_map(|_| scored.next().map(|r| rows[r])).collect()).collect()
}

/// `[b, r]`: each sequence's values right-padded with zeros.
fn padded(seqs: &[Vec<f32>], r: usize) -> Result<Tensor> {
    let b = seqs.len();
    let mut flat = vec![0f32; b * r];
    for (i, s) in seqs.iter().enumerate() {
        flat[i * r..i * r + s.len()].copy_from_slice(s);
    }
    Ok(Tensor::from_vec(flat, (b, r), &Device::Cpu)?)
}

/// A `[b, r]` gradient back on the batch's rows (zero on unscored rows).
fn unpadded(part: &[&TrainSeq], batch: &TrainBatch, g: &Tensor) -> Result<Vec<f32>> {
    let g = g.to_vec2::<f32>()?;
    let mut out = vec![0f32; batch.rows()];
    let mut scored = batch.scored_rows();
    for (s, row) in part.iter().zip(g) {
        for &v in row.iter().take(s.sample.tokens.len()) {
            let r = scored.next().ok_or_else(|| Error::InvalidArgument("fewer scored rows than tokens".into()))?;
            out[r] = v;
        }
    }
    Ok(out)
}

impl DeviceUpdate<'_> {
    fn batch(&self, part: &[&TrainSeq]) -> Result<TrainBatch> {
        Ok(TrainBatch::responses(&pairs(part), self.policy.config().vocab_size)?)
    }
}

impl UpdateBackend for DeviceUpdate<'_> {
    fn old_logprobs(&mut self, ctx: &UpdateContext, seqs: &[TrainSeq]) -> Result<Vec<Vec<f32>>> {
        let mut out = vec![Vec::new(); seqs.len()];
        for micro in &micro_batches_of(ctx, seqs, 0..seqs.len())? {
            let part: Vec<&TrainSeq> = micro.iter().map(|&i| &seqs[i]).collect();
            let batch = self.batch(&part)?;
            let (logp, _) = self.train.trainer.forward(self.policy, &batch, ctx.temperature(), false)?;
            for (&i, lp) in micro.iter().zip(per_seq(&part, &batch, &logp)) {
                out[i] = lp;
            }
        }
        Ok(out)
    }

    fn mini_batch_step(
        &mut self,
        ctx: &UpdateContext,
        seqs: &[TrainSeq],
        mb: &[usize],
        old: Option<&[Vec<f32>]>,
    ) -> Result<Option<MiniStep>> {
        let Some(plan) = StepPlan::new(ctx, seqs, mb)? else { return Ok(None) };
        let temperature = ctx.temperature();
        let entropy = ctx.grpo.entropy_coef > 0.0;
        let (mut stats, mut micros) = (LossStats::default(), 0);
        self.train.trainer.zero_grad()?;
        for micro in &plan.micros {
            let part: Vec<&TrainSeq> = micro.iter().map(|&i| &seqs[i]).collect();
            let part_old: Option<Vec<&[f32]>> = old.map(|o| micro.iter().map(|&i| o[i].as_slice()).collect());
            let l = layout(&part, part_old.as_deref(), ctx.grpo, &Device::Cpu)?;
            let r = l.response_width()?;
            let batch = self.batch(&part)?;
            // The reference first: the policy's forward must be the last before its backward.
            let reference = match (&self.train.reference, &ctx.grpo.kl) {
                (Some(m), Some(_)) => {
                    let (lp, _) = self.train.trainer.forward(m, &batch, temperature, false)?;
                    Some(padded(&per_seq(&part, &batch, &lp), r)?)
                }
                _ => None,
            };
            let (lp, ent) = self.train.trainer.forward(self.policy, &batch, temperature, entropy)?;
            let logp = Var::from_tensor(&padded(&per_seq(&part, &batch, &lp), r)?)?;
            let ent = ent
                .map(|e| padded(&per_seq(&part, &batch, &e), r).and_then(|t| Ok(Var::from_tensor(&t)?)))
                .transpose()?;
            let entropy = ent.as_ref().map(Var::as_tensor);
            let (loss, s) = micro_loss(ctx, &l, &plan.norm, logp.as_tensor(), entropy, reference.as_ref())?;
            stats.merge(&s);
            let grads = loss.to_dtype(candle_core::DType::F32)?.backward()?;
            let zeros = || Tensor::zeros(logp.shape(), candle_core::DType::F32, &Device::Cpu);
            let g_logp = match grads.get(logp.as_tensor()) {
                Some(g) => unpadded(&part, &batch, g)?,
                None => unpadded(&part, &batch, &zeros()?)?,
            };
            let g_ent = match &ent {
                Some(e) => Some(match grads.get(e.as_tensor()) {
                    Some(g) => unpadded(&part, &batch, g)?,
                    None => vec![0.0; batch.rows()],
                }),
                None => None,
            };
            self.train.trainer.backward(self.policy, &g_logp, g_ent.as_deref())?;
            micros += 1;
        }
        let (wait_s, t_sync) = rank_sync(ctx, &mut stats, &mut micros)?;
        let sync_s = if ctx.comm.size() > 1 {
            // Ranks that share a device (or have no NCCL) sum the gradients on the host, over MPI.
            let t = &mut self.train.trainer;
            let mut g = t.arena_to_host(Arena::Grad)?;
            ctx.comm.all_reduce_sum_f32(&mut g)?;
            t.arena_from_host(Arena::Grad, &g)?;
            t_sync.elapsed().as_secs_f64()
        } else {
            0.0
        };
        let norm = self.train.trainer.step(self.policy, ctx.lr, ctx.max_grad_norm)?;
        if !norm.applied() {
            tracing::warn!(
                grad_norm = norm.before,
                "non-finite gradient norm: optimizer step skipped, weights unchanged"
            );
        }
        Ok(Some(MiniStep { stats, grad_norm: norm.before, micros, applied: norm.applied(), wait_s, sync_s }))
    }
}
