//! Group-relative advantages and the DAPO overlong penalty, on plain `f64` slices.

use candle_core::{Device, Tensor};

use super::{GrpoConfig, MeanLevel};
use crate::{Error, Result};

/// Per-sequence advantages of a batch laid out as consecutive groups of `group_size` answers.
#[derive(Debug, Clone, PartialEq)]
pub struct Advantages {
    /// One advantage per sequence, in input order.
    pub values: Vec<f64>,
    /// Per group: all its rewards are equal (see [`group_advantages`]).
    pub zero_variance_group: Vec<bool>,
    /// Answers per group.
    pub group_size: usize,
    /// Whether [`Advantages::keep`] drops zero-variance groups ([`GrpoConfig::drop_zero_variance_groups`]).
    pub drop_zero_variance: bool,
}

impl Advantages {
    /// Whether sequence `seq` is trained on: false for sequences of a zero-variance group when dropping is on, and
    /// for an out-of-range index.
    pub fn keep(&self, seq: usize) -> bool {
        if seq >= self.values.len() || self.group_size == 0 {
            return false;
        }
        !(self.drop_zero_variance && self.zero_variance_group[seq / self.group_size])
    }

    /// [`Advantages::keep`] for every sequence.
    pub fn keep_mask(&self) -> Vec<bool> {
        (0..self.values.len()).map(|i| self.keep(i)).collect()
    }

    /// Fraction of groups with zero reward variance (TRL `frac_reward_zero_std`); 0 for no groups.
    pub fn frac_zero_variance(&self) -> f64 {
        let n = self.zero_variance_group.len();
        if n == 0 {
            return 0.0;
        }
        self.zero_variance_group.iter().filter(|&&z| z).count() as f64 / n as f64
    }

    /// The advantages as an `f32` tensor of shape `[len]`.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        let v: Vec<f32> = self.values.iter().map(|&a| a as f32).collect();
        Ok(Tensor::from_vec(v, self.values.len(), device)?)
    }
}

/// Mean and unbiased (n - 1) std of `xs`; the std is 0 for fewer than two values.
fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// Whether all of `xs` are equal up to `1e-9 * max(1, max |x|)`.
pub(crate) fn all_equal(xs: &[f64]) -> bool {
    let (lo, hi, big) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY, 1.0f64), |(lo, hi, big), &x| (lo.min(x), hi.max(x), big.max(x.abs())));
    hi - lo <= 1e-9 * big
}

/// Group-relative advantages (GRPO; verl `compute_grpo_outcome_advantage`).
///
/// `rewards` holds consecutive groups of `group_size` answers to the same prompt. With [`MeanLevel::Group`] each
/// advantage is `r - mean(group)`, divided by `std(group) + adv_eps` when `std_norm`; with [`MeanLevel::Batch`] the
/// mean and std are taken over the whole batch. The std is the unbiased one (`n - 1`, `torch.std`, as verl).
///
/// A group is zero-variance when all its rewards are equal (up to `1e-9 * max(1, max |r|)`). At group level its
/// advantages are exactly 0; at batch level they keep their batch-relative value (a batch whose rewards are all
/// equal gets zeros). Either way the group is flagged, and [`Advantages::keep`] drops it when
/// [`GrpoConfig::drop_zero_variance_groups`] is set.
///
/// Groups of one answer (`group_size == 1`) at group level follow verl: mean 0 and std 1, so the advantage is the
/// reward itself (`r / (1 + adv_eps)` with `std_norm`), REINFORCE without a baseline; they are never flagged
/// zero-variance (one answer says nothing about the prompt's variance). At batch level they are ordinary members of
/// the batch.
///
/// Errors on empty input, `group_size == 0`, a length that is not a multiple of `group_size`, or a non-finite reward.
pub fn group_advantages(rewards: &[f64], group_size: usize, cfg: &GrpoConfig) -> Result<Advantages> {
    if rewards.is_empty() {
        return Err(Error::InvalidArgument("group_advantages: no rewards".into()));
    }
    if group_size == 0 {
        return Err(Error::InvalidArgument("group_advantages: group_size is 0".into()));
    }
    if !rewards.len().is_multiple_of(group_size) {
        return Err(Error::InvalidArgument(format!(
            "group_advantages: {} rewards is not a multiple of group_size {group_size}",
            rewards.len()
        )));
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(Error::InvalidArgument(format!("group_advantages: reward {i} is {}", rewards[i])));
    }
    let singles = group_size == 1 && cfg.mean_level == MeanLevel::Group;
    let zero_variance_group: Vec<bool> = rewards.chunks(group_size).map(|g| !singles && all_equal(g)).collect();
    let scale = |r: f64, mean: f64, std: f64| {
        let centred = r - mean;
        if cfg.std_norm {
            centred / (std + cfg.adv_eps)
        } else {
            centred
        }
    };
    let values = match cfg.mean_level {
        MeanLevel::Group => rewards
            .chunks(group_size)
            .zip(&zero_variance_group)
            .flat_map(|(g, &zero)| {
                let (mean, std) = if singles { (0.0, 1.0) } else { mean_std(g) };
                g.iter().map(move |&r| if zero { 0.0 } else { scale(r, mean, std) })
            })
            .collect(),
        MeanLevel::Batch => {
            if all_equal(rewards) {
                vec![0.0; rewards.len()]
            } else {
                let (mean, std) = mean_std(rewards);
                rewards.iter().map(|&r| scale(r, mean, std)).collect()
            }
        }
    };
    Ok(Advantages { values, zero_variance_group, group_size, drop_zero_variance: cfg.drop_zero_variance_groups })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(std_norm: bool, level: MeanLevel) -> GrpoConfig {
        GrpoConfig { std_norm, mean_level: level, ..GrpoConfig::default() }
    }

    #[test]
    fn grpo_advantages_hand_computed() {
        // Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3).
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], 4, &GrpoConfig::default()).unwrap();
        let s = (1.0f64 / 3.0).sqrt() + 1e-6;
        let want = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0, 0.0, 0.0];
        for (x, y) in a.values.iter().zip(want) {
            assert!((x - y).abs() < 1e-12, "{x} vs {y}");
        }
        assert_eq!(a.zero_variance_group, vec![false, true]);
        // Kept by default (verl); dropped on request.
        assert!(a.keep_mask().iter().all(|&k| k));
        let drop = GrpoConfig { drop_zero_variance_groups: true, ..GrpoConfig::default() };
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], 4, &drop).unwrap();
        assert_eq!(a.keep_mask(), vec![true, true, true, true, false, false, false, false]);
        assert!(!a.keep(8));
        assert_eq!(a.frac_zero_variance(), 0.5);
        let t = a.to_tensor(&Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[8]);

        let dr = group_advantages(&[1.0, 0.0, 0.0, 1.0], 4, &cfg(false, MeanLevel::Group)).unwrap();
        assert_eq!(dr.values, vec![0.5, -0.5, -0.5, 0.5]);
        let keep_all = GrpoConfig { drop_zero_variance_groups: false, ..GrpoConfig::default() };
        assert!(group_advantages(&[1.0, 1.0], 2, &keep_all).unwrap().keep(0));
    }

    #[test]
    fn grpo_advantages_batch_level_keeps_identical_groups_signal() {
        let a = group_advantages(&[1.0, 1.0, 0.0, 0.0], 2, &cfg(false, MeanLevel::Batch)).unwrap();
        assert_eq!(a.values, vec![0.5, 0.5, -0.5, -0.5]);
        assert_eq!(a.zero_variance_group, vec![true, true]);
        let flat = group_advantages(&[2.0; 6], 3, &cfg(true, MeanLevel::Batch)).unwrap();
        assert_eq!(flat.values, vec![0.0; 6]);
    }

    #[test]
    fn grpo_advantages_errors() {
        let c = GrpoConfig::default();
        assert!(group_advantages(&[], 2, &c).is_err());
        assert!(group_advantages(&[1.0, 2.0], 0, &c).is_err());
        assert!(group_advantages(&[1.0, 2.0, 3.0], 2, &c).is_err());
        assert!(group_advantages(&[1.0, f64::NAN], 2, &c).is_err());
        assert!(group_advantages(&[1.0, f64::INFINITY], 2, &c).is_err());
    }

    /// `group_size = 1`: verl's mean 0 and std 1, so the advantage is the reward (it was 0, and the trainer silently
    /// never updated); never flagged zero-variance, so dropping keeps it.
    #[test]
    fn grpo_advantages_of_single_answer_groups_follow_verl() {
        let drop = GrpoConfig { drop_zero_variance_groups: true, ..GrpoConfig::default() };
        let single = group_advantages(&[3.0, 0.0, -1.5], 1, &drop).unwrap();
        let eps = drop.adv_eps;
        assert_eq!(single.values, vec![3.0 / (1.0 + eps), 0.0, -1.5 / (1.0 + eps)]);
        assert_eq!(single.zero_variance_group, vec![false; 3]);
        assert!(single.keep_mask().iter().all(|&k| k));
        let dr = group_advantages(&[3.0, 0.0], 1, &cfg(false, MeanLevel::Group)).unwrap();
        assert_eq!(dr.values, vec![3.0, 0.0]);
        // At batch level a group of one is an ordinary member of the batch.
        let batch = group_advantages(&[1.0, 0.0], 1, &cfg(false, MeanLevel::Batch)).unwrap();
        assert_eq!(batch.values, vec![0.5, -0.5]);
    }

    /// Groups of rewards with at least two distinct values each.
    fn varied_groups() -> impl Strategy<Value = (Vec<f64>, usize)> {
        (2usize..6, 1usize..5).prop_flat_map(|(g, n)| {
            (prop::collection::vec(-10.0f64..10.0, g * n), Just(g)).prop_map(|(mut r, g)| {
                for grp in r.chunks_mut(g) {
                    grp[0] = grp[1] + 1.0;
                }
                (r, g)
            })
        })
    }

    proptest! {
        #[test]
        fn grpo_advantages_zero_mean_and_unit_std_per_group((r, g) in varied_groups(), norm in any::<bool>()) {
            let a = group_advantages(&r, g, &cfg(norm, MeanLevel::Group)).unwrap();
            for (grp, rew) in a.values.chunks(g).zip(r.chunks(g)) {
                let (mean, std) = mean_std(grp);
                prop_assert!(mean.abs() < 1e-9);
                if norm {
                    let (_, rstd) = mean_std(rew);
                    prop_assert!((std - rstd / (rstd + 1e-6)).abs() < 1e-9);
                    prop_assert!((std - 1.0).abs() < 1e-5);
                }
            }
            prop_assert!(a.zero_variance_group.iter().all(|&z| !z));
        }

        #[test]
        fn grpo_advantages_batch_level_zero_mean((r, g) in varied_groups(), norm in any::<bool>()) {
            let a = group_advantages(&r, g, &cfg(norm, MeanLevel::Batch)).unwrap();
            let (mean, std) = mean_std(&a.values);
            prop_assert!(mean.abs() < 1e-9);
            if norm {
                prop_assert!((std - 1.0).abs() < 1e-5);
            }
        }

        #[test]
        fn grpo_advantages_shift_invariant(
            (r, g) in varied_groups(),
            shift in -100.0f64..100.0,
            norm in any::<bool>(),
            batch in any::<bool>(),
        ) {
            let c = cfg(norm, if batch { MeanLevel::Batch } else { MeanLevel::Group });
            let a = group_advantages(&r, g, &c).unwrap();
            let shifted: Vec<f64> = r.iter().map(|x| x + shift).collect();
            let b = group_advantages(&shifted, g, &c).unwrap();
            for (x, y) in a.values.iter().zip(&b.values) {
                prop_assert!((x - y).abs() < 1e-9);
            }
        }

        #[test]
        fn grpo_advantages_zero_variance_groups_are_zero(
            (r, g) in varied_groups(),
            flat in prop::collection::vec(any::<bool>(), 4),
            level in -5.0f64..5.0,
        ) {
            let mut r = r;
            let n = r.len() / g;
            for (i, grp) in r.chunks_mut(g).enumerate() {
                if flat[i % 4] {
                    grp.iter_mut().for_each(|x| *x = level);
                }
            }
            let drop = GrpoConfig { drop_zero_variance_groups: true, ..GrpoConfig::default() };
            let a = group_advantages(&r, g, &drop).unwrap();
            for i in 0..n {
                prop_assert_eq!(a.zero_variance_group[i], flat[i % 4]);
                if flat[i % 4] {
                    prop_assert!(a.values[i * g..(i + 1) * g].iter().all(|&v| v == 0.0));
                    prop_assert!(!a.keep(i * g));
                }
            }
        }
    }
}
