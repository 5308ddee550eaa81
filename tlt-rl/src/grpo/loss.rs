//! The GRPO policy loss: PPO-clip with asymmetric and dual clipping, truncated importance sampling, KL and entropy
//! terms, aggregated so that micro-batches add up to the full mini-batch loss.

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::{kl_estimate, GrpoConfig, LossAgg};
use crate::{Error, Result};

/// Bound on `|logp - old_logp|` before `exp` (verl clamps the log-ratio to `[-20, 20]`).
const LOG_RATIO_BOUND: f64 = 20.0;

/// Per-token inputs of [`policy_loss`] for one micro-batch of `b` sequences padded to `t` tokens.
///
/// Everything except `logp` (and `entropy`, whose bonus should move the policy) is treated as a constant: it is
/// detached and cast to `logp`'s dtype.
#[derive(Debug, Clone, Copy)]
pub struct LossInputs<'a> {
    /// `[b, t]` log-probabilities of the sampled tokens under the policy being trained (differentiable).
    pub logp: &'a Tensor,
    /// `[b, t]` log-probabilities under the policy that the PPO ratio is taken against (before this update).
    pub old_logp: &'a Tensor,
    /// `[b, t]` log-probabilities recorded by the rollout engine; with [`GrpoConfig::tis_cap`] they give the
    /// truncated importance weights. `None` skips the correction.
    pub rollout_logp: Option<&'a Tensor>,
    /// `[b, t]` log-probabilities under the reference model; required when [`GrpoConfig::kl`] is set.
    pub ref_logp: Option<&'a Tensor>,
    /// `[b, t]` per-token entropies of the policy (differentiable); required when [`GrpoConfig::entropy_coef`] > 0,
    /// and reported in [`LossStats::entropy`] whenever given.
    pub entropy: Option<&'a Tensor>,
    /// `[b]` per-sequence advantages.
    pub advantages: &'a Tensor,
    /// `[b, t]` loss mask, 1 for trained tokens and 0 for padding or masked answers.
    pub mask: &'a Tensor,
}

/// Sizes of the whole mini-batch (all its micro-batches) that the loss is normalised by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LossNorm {
    /// Sum of the loss mask over the mini-batch ([`LossAgg::TokenMean`]).
    pub total_tokens: usize,
    /// Sequences in the mini-batch ([`LossAgg::SeqMeanTokenMean`] and the other seq-mean modes).
    pub total_seqs: usize,
    /// The constant token-sum divisor of [`LossAgg::SeqMeanTokenSumNorm`], normally the generation limit.
    pub max_response_len: usize,
}

impl LossNorm {
    /// The norm of a mini-batch given as one `[b, t]` mask: its token sum, `b` sequences, and `max_response_len`.
    pub fn from_mask(mask: &Tensor, max_response_len: usize) -> Result<Self> {
        let (b, _t) = mask.dims2()?;
        let total = mask.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        Ok(Self { total_tokens: total.round() as usize, total_seqs: b, max_response_len })
    }
}

/// Diagnostics of [`policy_loss`]: masked token means over the micro-batch, except `loss` (its contribution to the
/// mini-batch loss) and `tokens` (its mask sum).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LossStats {
    /// This micro-batch's contribution to the mini-batch loss (summed by [`LossStats::merge`]).
    pub loss: f64,
    /// Mean clipped policy-gradient token loss (after the TIS weight).
    pub pg_loss: f64,
    /// Mean KL estimate to the reference (0 without KL).
    pub kl: f64,
    /// Mean policy entropy (0 when no entropy is given).
    pub entropy: f64,
    /// Fraction of tokens whose ratio was clipped below `1 - clip_low` (negative advantages).
    pub clip_frac_low: f64,
    /// Fraction of tokens whose ratio was clipped above `1 + clip_high` (positive advantages).
    pub clip_frac_high: f64,
    /// Mean importance ratio `exp(logp - old_logp)`.
    pub ratio_mean: f64,
    /// Mean truncated importance weight (1 when the correction is off).
    pub tis_weight_mean: f64,
    /// Fraction of tokens whose loss the dual clip capped (negative advantages, `-A r` above `-A c`; verl
    /// `pg_clipfrac_lower`); 0 without a dual clip.
    #[serde(default)]
    pub dual_clip_frac: f64,
    /// Mean `old_logp - logp`: the approximate KL of the policy from the one that sampled the batch (verl
    /// `ppo_kl`; 0 on a step's first pass).
    #[serde(default)]
    pub ppo_kl: f64,
    /// Trained tokens (mask sum).
    pub tokens: usize,
}

impl LossStats {
    /// Folds `other` in: token-weighted means, `loss` and `tokens` summed.
    pub fn merge(&mut self, other: &LossStats) {
        let (a, b) = (self.tokens as f64, other.tokens as f64);
        let mix = |x: f64, y: f64| if a + b > 0.0 { (x * a + y * b) / (a + b) } else { 0.0 };
        self.pg_loss = mix(self.pg_loss, other.pg_loss);
        self.kl = mix(self.kl, other.kl);
        self.entropy = mix(self.entropy, other.entropy);
        self.clip_frac_low = mix(self.clip_frac_low, other.clip_frac_low);
        self.clip_frac_high = mix(self.clip_frac_high, other.clip_frac_high);
        self.ratio_mean = mix(self.ratio_mean, other.ratio_mean);
        self.tis_weight_mean = mix(self.tis_weight_mean, other.tis_weight_mean);
        self.dual_clip_frac = mix(self.dual_clip_frac, other.dual_clip_frac);
        self.ppo_kl = mix(self.ppo_kl, other.ppo_kl);
        self.loss += other.loss;
        self.tokens += other.tokens;
    }
}

/// Checks that `x` is `[b, t]`, naming it `what`, and casts it to `dtype`.
fn same_shape(x: &Tensor, what: &str, b: usize, t: usize, dtype: DType) -> Result<Tensor> {
    if x.dims() != [b, t] {
        return Err(Error::InvalidArgument(format!("policy_loss: {what} is {:?}, expected [{b}, {t}]", x.dims())));
    }
    Ok(x.to_dtype(dtype)?)
}

/// Reduces `[b, t]` token losses to the scalar loss of this micro-batch under `agg` and the mini-batch `norm`.
fn aggregate(tok: &Tensor, mask: &Tensor, norm: &LossNorm, agg: LossAgg) -> Result<Tensor> {
    let masked = (tok * mask)?;
    let denom = |n: usize| n.max(1) as f64;
    let loss = match agg {
        LossAgg::TokenMean => (masked.sum_all()? / denom(norm.total_tokens))?,
        LossAgg::SeqMeanTokenMean => {
            let per_seq = masked.sum(1)?.div(&mask.sum(1)?.maximum(1.0)?)?;
            (per_seq.sum_all()? / denom(norm.total_seqs))?
        }
        LossAgg::SeqMeanTokenSum => (masked.sum_all()? / denom(norm.total_seqs))?,
        LossAgg::SeqMeanTokenSumNorm => (masked.sum_all()? / (denom(norm.total_seqs) * denom(norm.max_response_len)))?,
    };
    Ok(loss)
}

/// The GRPO loss of one micro-batch and its diagnostics.
///
/// Per token, with `r = exp(logp - old_logp)` (log-ratio clamped to ±20) and the sequence's advantage `A`:
/// `pg = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high))`, capped at `-A * dual_clip` for `A < 0`; times the
/// detached TIS weight `min(exp(old_logp - rollout_logp), tis_cap)` when `rollout_logp` is given and `tis_cap` is
/// set; plus `kl.coef * kl_estimate(logp, ref_logp)` when [`GrpoConfig::kl`] is set; minus
/// `entropy_coef * entropy`. Token losses are masked and reduced by [`GrpoConfig::loss_agg`] with the mini-batch
/// sizes in `norm` (`TokenMean`: `sum / total_tokens`; `SeqMeanTokenMean`: sum of per-sequence token means
/// `/ total_seqs`; `SeqMeanTokenSum`: `sum / total_seqs`; `SeqMeanTokenSumNorm`: `sum / (total_seqs *
/// max_response_len)`), so the losses of a mini-batch's micro-batches add up to its full-batch loss. A zero divisor
/// counts as 1.
///
/// Errors on mismatched shapes, a missing `ref_logp` (KL on) or `entropy` (`entropy_coef > 0`), and a `norm`
/// smaller than this micro-batch (more masked tokens than `total_tokens` under token-mean, more non-empty sequences
/// than `total_seqs` or `max_response_len == 0` under the seq-mean modes).
pub fn policy_loss(inp: &LossInputs, norm: &LossNorm, cfg: &GrpoConfig) -> Result<(Tensor, LossStats)> {
    let logp = inp.logp;
    let (b, t) = logp.dims2()?;
    let dtype = logp.dtype();
    if !dtype.is_float() {
        return Err(Error::InvalidArgument(format!("policy_loss: logp must be a float tensor, got {dtype:?}")));
    }
    let old = same_shape(inp.old_logp, "old_logp", b, t, dtype)?.detach();
    let mask = same_shape(inp.mask, "mask", b, t, dtype)?.detach();
    if inp.advantages.elem_count() != b || inp.advantages.rank() > 2 {
        return Err(Error::InvalidArgument(format!(
            "policy_loss: advantages are {:?}, expected [{b}]",
            inp.advantages.dims()
        )));
    }
    let adv = inp.advantages.to_dtype(dtype)?.detach().reshape((b, 1))?.broadcast_as((b, t))?;
    let zero = Tensor::zeros((), dtype, logp.device())?;

    // PPO-clip with asymmetric bounds, and the dual clip for negative advantages.
    let ratio = (logp - &old)?.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)?.exp()?;
    let neg_adv = adv.neg()?;
    let unclipped = (&neg_adv * &ratio)?;
    let clipped = (&neg_adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)?)?;
    let mut pg = unclipped.maximum(&clipped)?;
    let negative = adv.lt(0.0)?;
    let mut dual = None;
    if let Some(c) = cfg.dual_clip {
        let cap = (&neg_adv * c)?;
        dual = Some((pg.gt(&cap)?.to_dtype(dtype)? * negative.to_dtype(dtype)?)?);
        pg = negative.where_cond(&pg.minimum(&cap)?, &pg)?;
    }
    let tis = match (cfg.tis_cap, inp.rollout_logp) {
        (Some(cap), Some(rollout)) => {
            let rollout = same_shape(rollout, "rollout_logp", b, t, dtype)?.detach();
            let w = (&old - &rollout)?.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)?.exp()?.minimum(cap)?.detach();
            pg = (pg * &w)?;
            Some(w)
        }
        _ => None,
    };
    let mut tok = pg.clone();

    let kl = match &cfg.kl {
        Some(kc) => {
            let r = inp
                .ref_logp
                .ok_or_else(|| Error::InvalidArgument("policy_loss: KL is on but ref_logp is missing".into()))?;
            let kl = kl_estimate(logp, &same_shape(r, "ref_logp", b, t, dtype)?, kc.estimator)?;
            if kc.coef > 0.0 {
                tok = (tok + (&kl * kc.coef)?)?;
            }
            Some(kl)
        }
        None => None,
    };
    let entropy = match inp.entropy {
        Some(e) => Some(same_shape(e, "entropy", b, t, dtype)?),
        None if cfg.entropy_coef > 0.0 => {
            return Err(Error::InvalidArgument("policy_loss: entropy_coef > 0 but entropy is missing".into()))
        }
        None => None,
    };
    if let (Some(e), true) = (&entropy, cfg.entropy_coef > 0.0) {
        tok = (tok - (e * cfg.entropy_coef)?)?;
    }
    let loss = aggregate(&tok, &mask, norm, cfg.loss_agg)?;

    // Diagnostics: masked sums gathered into one tensor, one device sync.
    let msum = |x: &Tensor| -> Result<Tensor> { Ok((x.detach() * &mask)?.sum_all()?) };
    let flag = |x: Tensor| -> Result<Tensor> { Ok(x.to_dtype(dtype)?) };
    let high = (flag(ratio.gt(1.0 + cfg.clip_high)?)? * flag(adv.gt(0.0)?)?)?;
    let low = (flag(ratio.lt(1.0 - cfg.clip_low)?)? * flag(negative)?)?;
    let tokens = mask.sum_all()?;
    let parts = [
        tokens.clone(),
        flag(mask.sum(1)?.gt(0.0)?)?.sum_all()?,
        msum(&pg)?,
        kl.as_ref().map_or(Ok(zero.clone()), msum)?,
        entropy.as_ref().map_or(Ok(zero.clone()), msum)?,
        msum(&low)?,
        msum(&high)?,
        msum(&ratio)?,
        tis.as_ref().map_or(Ok(tokens), msum)?,
        loss.detach(),
        dual.as_ref().map_or(Ok(zero.clone()), msum)?,
        msum(&(&old - logp)?)?,
    ];
    let v = Tensor::stack(&parts, 0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let (n, nonempty) = (v[0], v[1].round() as usize);
    let mean = |s: f64| if n > 0.0 { s / n } else { 0.0 };
    let stats = LossStats {
        loss: v[9],
        pg_loss: mean(v[2]),
        kl: mean(v[3]),
        entropy: mean(v[4]),
        clip_frac_low: mean(v[5]),
        clip_frac_high: mean(v[6]),
        ratio_mean: mean(v[7]),
        tis_weight_mean: mean(v[8]),
        dual_clip_frac: mean(v[10]),
        ppo_kl: mean(v[11]),
        tokens: n.round() as usize,
    };
    check_norm(norm, cfg.loss_agg, stats.tokens, nonempty)?;
    Ok((loss, stats))
}

/// Rejects a `norm` that cannot describe a mini-batch containing this micro-batch.
fn check_norm(norm: &LossNorm, agg: LossAgg, tokens: usize, nonempty: usize) -> Result<()> {
    let bad = |what: String| Err(Error::InvalidArgument(format!("policy_loss: LossNorm {norm:?} {what}")));
    match agg {
        LossAgg::TokenMean if tokens > norm.total_tokens => {
            bad(format!("counts fewer tokens than this micro-batch's {tokens}"))
        }
        LossAgg::SeqMeanTokenMean | LossAgg::SeqMeanTokenSum | LossAgg::SeqMeanTokenSumNorm
            if nonempty > norm.total_seqs =>
        {
            bad(format!("counts fewer sequences than this micro-batch's {nonempty} trained ones"))
        }
        LossAgg::SeqMeanTokenSumNorm if norm.max_response_len == 0 && tokens > 0 => {
            bad("has max_response_len 0".to_string())
        }
        _ => Ok(()),
    }
}
