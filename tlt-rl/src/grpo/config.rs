//! [`GrpoConfig`] and its closed choices.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Level at which the advantage baseline (and the std, with [`GrpoConfig::std_norm`]) is computed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MeanLevel {
    /// Per group of `group_size` answers to one prompt (GRPO; verl `adv_estimator=grpo`). Default.
    #[default]
    Group,
    /// Over the whole batch (AReaL `mean_level=batch`); zero-variance groups then keep non-zero advantages.
    Batch,
}

/// How per-token losses are reduced to the scalar loss (verl `loss_agg_mode`).
///
/// Every mode divides by constants of the whole mini-batch ([`super::LossNorm`]), so micro-batch losses add up to the
/// full-batch loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossAgg {
    /// Sum of masked token losses / total tokens (DAPO, verl `token-mean`, TRL `dapo`). Default.
    #[default]
    #[serde(alias = "token-mean")]
    TokenMean,
    /// Mean over sequences of each sequence's token mean (original GRPO, verl `seq-mean-token-mean`).
    #[serde(alias = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Mean over sequences of each sequence's token sum (verl `seq-mean-token-sum`).
    #[serde(alias = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Mean over sequences of each token sum divided by the constant `max_response_len` (Dr. GRPO, verl
    /// `seq-mean-token-sum-norm` up to a constant factor).
    #[serde(alias = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

/// Estimator of KL(policy ‖ reference) from per-token log-probabilities (Schulman's "Approximating KL
/// divergence"; verl `kl_penalty`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `logp - ref_logp` (unbiased, high variance, can be negative).
    K1,
    /// `0.5 * (logp - ref_logp)^2` (verl `mse`).
    K2,
    /// `exp(ref - logp) - (ref - logp) - 1` (unbiased, non-negative; verl `low_var_kl`). Default.
    #[default]
    K3,
}

/// KL-to-reference loss term; its presence means a reference model is needed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KlConfig {
    /// Coefficient of the per-token KL estimate in the loss (verl `kl_loss_coef`). Default 0.001.
    pub coef: f64,
    /// Which estimator. Default [`KlEstimator::K3`].
    pub estimator: KlEstimator,
}

impl Default for KlConfig {
    fn default() -> Self {
        Self { coef: 0.001, estimator: KlEstimator::K3 }
    }
}

/// What to do with answers cut off at the maximum response length.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    /// Train on them like any other answer. Default.
    #[default]
    Keep,
    /// Give truncated answers a zero loss mask (TRL `mask_truncated_completions`).
    Mask,
    /// DAPO soft overlong punishment added to the reward; see [`super::overlong_penalty`].
    Penalty {
        /// Length of the linear penalty zone before the maximum length (verl `overlong_buffer.len`).
        buffer_len: usize,
        /// Penalty at (and beyond) the maximum length (verl `overlong_buffer.penalty_factor`).
        factor: f64,
    },
}

/// GRPO knobs, with verl/TRL names in the field docs.
///
/// Defaults: `std_norm` true, `mean_level` group, `adv_eps` 1e-6, `loss_agg` token-mean, `clip_low` 0.2,
/// `clip_high` 0.2 (verl's; DAPO's clip-higher is 0.28, opt-in), no dual clip (verl caps at 3: `tlt-rl/README.md`), no KL (no reference model), `entropy_coef` 0, zero-variance groups kept (verl),
/// truncation kept, no TIS (the rollout and the update share weights and precision: see [`Self::tis_cap`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoConfig {
    /// Divide advantages by the (unbiased) std; false is Dr. GRPO (verl `norm_adv_by_std_in_grpo`). Default true.
    pub std_norm: bool,
    /// Level of the baseline and the std. Default [`MeanLevel::Group`].
    pub mean_level: MeanLevel,
    /// Added to the std before dividing (verl `epsilon`). Default 1e-6.
    pub adv_eps: f64,
    /// Loss aggregation. Default [`LossAgg::TokenMean`].
    pub loss_agg: LossAgg,
    /// Lower clip: the ratio is clipped at `1 - clip_low` (verl `clip_ratio_low`). In `[0, 1)`. Default 0.2.
    pub clip_low: f64,
    /// Upper clip: the ratio is clipped at `1 + clip_high` (verl `clip_ratio_high`; DAPO's clip-higher sets 0.28).
    /// Default 0.2, verl's.
    pub clip_high: f64,
    /// Dual-clip bound `c > 1` for negative advantages: the token loss is capped at `-A * c` (verl `clip_ratio_c`,
    /// e.g. 3.0). Default `None`.
    pub dual_clip: Option<f64>,
    /// KL-to-reference loss (verl `use_kl_loss`); `None` loads no reference model. Default `None`.
    pub kl: Option<KlConfig>,
    /// Entropy bonus coefficient (verl `entropy_coeff`); the loss gets `- entropy_coef * entropy`. Default 0.
    pub entropy_coef: f64,
    /// Give zero loss weight to groups whose rewards are all equal (their advantages are 0 anyway; dropping them
    /// changes the token-mean divisor and the KL and entropy terms from step to step). Default false, as verl; to
    /// train on a batch full of informative groups, use dynamic sampling (`TrainerConfig::dynamic_sampling`).
    pub drop_zero_variance_groups: bool,
    /// Handling of answers that hit the length limit. Default [`Truncation::Keep`].
    pub truncation: Truncation,
    /// Truncated importance sampling cap for the rollout/trainer mismatch: each token's loss is multiplied by the
    /// detached `min(exp(old_logp - rollout_logp), cap)` (verl rollout correction, token level; TRL
    /// `vllm_importance_sampling_correction`). `None` disables it. Default `None`.
    ///
    /// Needed when the rollout computes its log-probabilities differently from the update: another precision
    /// (bf16 rollouts on a GPU, `device = "cuda"`) or another engine. When both run the same f32 weights on the
    /// CPU, as by default, the only difference is rounding between the engine's forward shapes (a speculative
    /// round's verify rows against plain decoding's rows: |Δ log p| at most 5.4e-6 on the tests' tiny model), and the correction
    /// would feed that rounding into the loss, so TLT's updates would no longer equal the baseline's bit for bit.
    pub tis_cap: Option<f64>,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        Self {
            std_norm: true,
            mean_level: MeanLevel::Group,
            adv_eps: 1e-6,
            loss_agg: LossAgg::TokenMean,
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: None,
            kl: None,
            entropy_coef: 0.0,
            drop_zero_variance_groups: false,
            truncation: Truncation::Keep,
            tis_cap: None,
        }
    }
}

/// Checks that `v` is finite and `>= 0`.
fn non_negative(field: &str, v: f64) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(Error::config(field, format!("must be finite and >= 0, got {v}")))
    }
}

impl GrpoConfig {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<()> {
        non_negative("grpo.adv_eps", self.adv_eps)?;
        if !(self.clip_low.is_finite() && (0.0..1.0).contains(&self.clip_low)) {
            return Err(Error::config("grpo.clip_low", format!("must be in [0, 1), got {}", self.clip_low)));
        }
        non_negative("grpo.clip_high", self.clip_high)?;
        if let Some(c) = self.dual_clip {
            if !(c.is_finite() && c > 1.0) {
                return Err(Error::config("grpo.dual_clip", format!("must be finite and > 1, got {c}")));
            }
        }
        if let Some(kl) = &self.kl {
            non_negative("grpo.kl.coef", kl.coef)?;
        }
        non_negative("grpo.entropy_coef", self.entropy_coef)?;
        if let Truncation::Penalty { buffer_len, factor } = self.truncation {
            if buffer_len == 0 {
                return Err(Error::config("grpo.truncation.penalty.buffer_len", "must be > 0"));
            }
            non_negative("grpo.truncation.penalty.factor", factor)?;
        }
        if let Some(cap) = self.tis_cap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(Error::config("grpo.tis_cap", format!("must be finite and > 0, got {cap}")));
            }
        }
        Ok(())
    }

    /// The reward after truncation shaping: adds [`super::overlong_penalty`] under [`Truncation::Penalty`],
    /// unchanged otherwise.
    pub fn shaped_reward(&self, reward: f64, response_len: usize, max_response_len: usize) -> f64 {
        match self.truncation {
            Truncation::Penalty { buffer_len, factor } => {
                reward + overlong_penalty(response_len, max_response_len, buffer_len, factor)
            }
            Truncation::Keep | Truncation::Mask => reward,
        }
    }

    /// Whether an answer's tokens get loss weight: false only for truncated answers under [`Truncation::Mask`].
    pub fn trains_on(&self, truncated: bool) -> bool {
        !(truncated && self.truncation == Truncation::Mask)
    }
}

/// DAPO soft overlong punishment for a response of `len` tokens with limit `max_len`: 0 up to
/// `max_len - buffer_len`, then linear down to `-factor` at `max_len`, and `-factor` beyond.
///
/// With `buffer_len == 0` it is 0 up to `max_len` and `-factor` beyond.
pub fn overlong_penalty(len: usize, max_len: usize, buffer_len: usize, factor: f64) -> f64 {
    let expected = max_len.saturating_sub(buffer_len);
    if len <= expected {
        0.0
    } else if len <= max_len && buffer_len > 0 {
        (expected as f64 - len as f64) / buffer_len as f64 * factor
    } else {
        -factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// verl's defaults, copied from volcengine/verl @ 03d67c629a31 (`verl/trainer/config/actor/actor.yaml`:
    /// `clip_ratio_low: 0.2`, `clip_ratio_high: 0.2`, `loss_agg_mode: token-mean`, `entropy_coeff: 0`,
    /// `use_kl_loss: false`) and @ 945104debb7a (`verl/utils/reward_score/gsm8k.py`: `compute_score(...,
    /// format_score=0., score=1.)`); `norm_adv_by_std_in_grpo` defaults to true in verl's GRPO. The one default
    /// that differs, the dual clip (`clip_ratio_c: 3.0`, applied by verl's vanilla loss), is listed with its reason
    /// in `tlt-rl/README.md`.
    #[test]
    fn grpo_and_reward_defaults_are_verls() {
        let (clip_ratio_low, clip_ratio_high, entropy_coeff, use_kl_loss) = (0.2, 0.2, 0.0, false);
        let (format_score, score) = (0.0, 1.0);
        let g = GrpoConfig::default();
        assert_eq!((g.clip_low, g.clip_high, g.entropy_coef), (clip_ratio_low, clip_ratio_high, entropy_coeff));
        assert_eq!(g.kl.is_some(), use_kl_loss);
        assert_eq!(g.loss_agg, LossAgg::TokenMean);
        assert!(g.std_norm);
        assert_eq!(g.dual_clip, None, "the listed difference: verl caps at 3");
        let r = crate::task::RewardConfig::default();
        assert_eq!((r.correct_reward, r.format_reward), (score, format_score));
        assert!(!r.flexible, "verl's GSM8K method defaults to strict");
    }

    #[test]
    fn grpo_config_defaults_validate_and_roundtrip() {
        let cfg = GrpoConfig::default();
        cfg.validate().unwrap();
        let json = serde_json::to_string(&cfg).unwrap();
        assert_eq!(serde_json::from_str::<GrpoConfig>(&json).unwrap(), cfg);
        let partial: GrpoConfig =
            serde_json::from_str(r#"{"loss_agg": "seq-mean-token-sum-norm", "kl": {"estimator": "k2"}}"#).unwrap();
        assert_eq!(partial.loss_agg, LossAgg::SeqMeanTokenSumNorm);
        assert_eq!(partial.kl, Some(KlConfig { coef: 0.001, estimator: KlEstimator::K2 }));
        let pen: GrpoConfig =
            serde_json::from_str(r#"{"truncation": {"penalty": {"buffer_len": 4, "factor": 1.0}}}"#).unwrap();
        assert_eq!(pen.truncation, Truncation::Penalty { buffer_len: 4, factor: 1.0 });
        assert!(serde_json::from_str::<GrpoConfig>(r#"{"clip": 0.2}"#).is_err());
    }

    #[test]
    fn grpo_config_rejects_bad_values() {
        let bad = [
            GrpoConfig { clip_low: 1.0, ..GrpoConfig::default() },
            GrpoConfig { clip_low: -0.1, ..GrpoConfig::default() },
            GrpoConfig { clip_high: f64::NAN, ..GrpoConfig::default() },
            GrpoConfig { dual_clip: Some(1.0), ..GrpoConfig::default() },
            GrpoConfig { adv_eps: -1.0, ..GrpoConfig::default() },
            GrpoConfig { entropy_coef: f64::INFINITY, ..GrpoConfig::default() },
            GrpoConfig { kl: Some(KlConfig { coef: -0.1, ..KlConfig::default() }), ..GrpoConfig::default() },
            GrpoConfig { truncation: Truncation::Penalty { buffer_len: 0, factor: 1.0 }, ..GrpoConfig::default() },
            GrpoConfig { tis_cap: Some(0.0), ..GrpoConfig::default() },
        ];
        for cfg in bad {
            let err = cfg.validate().unwrap_err();
            assert!(matches!(err, Error::InvalidConfig { .. }), "{cfg:?}: {err}");
        }
    }

    #[test]
    fn grpo_config_truncation_helpers() {
        let pen = GrpoConfig { truncation: Truncation::Penalty { buffer_len: 4, factor: 1.0 }, ..Default::default() };
        assert_eq!(pen.shaped_reward(1.0, 10, 10), 0.0);
        assert_eq!(pen.shaped_reward(1.0, 6, 10), 1.0);
        assert!(pen.trains_on(true));
        let mask = GrpoConfig { truncation: Truncation::Mask, ..Default::default() };
        assert!(!mask.trains_on(true));
        assert!(mask.trains_on(false));
        assert_eq!(mask.shaped_reward(0.5, 100, 10), 0.5);
    }

    #[test]
    fn grpo_overlong_penalty_zones() {
        assert_eq!(overlong_penalty(10, 20, 4, 1.0), 0.0);
        assert_eq!(overlong_penalty(16, 20, 4, 1.0), 0.0);
        assert!((overlong_penalty(17, 20, 4, 1.0) + 0.25).abs() < 1e-12);
        assert!((overlong_penalty(18, 20, 4, 2.0) + 1.0).abs() < 1e-12);
        assert_eq!(overlong_penalty(20, 20, 4, 1.0), -1.0);
        assert_eq!(overlong_penalty(25, 20, 4, 1.0), -1.0);
        assert_eq!(overlong_penalty(20, 20, 0, 1.0), 0.0);
        assert_eq!(overlong_penalty(21, 20, 0, 1.0), -1.0);
        assert!((overlong_penalty(1, 3, 10, 1.0) + 0.1).abs() < 1e-12);
    }
}
