//! BEG-MAB: batch-size-bucketed ε-greedy choice of the speculation plan.
//!
//! The arms are [`Plan`]s. Arms are grouped by tree size (`verify_tokens`); the distinct tree sizes, largest
//! first, are paired with the ascending batch-size `thresholds`, so a small batch gets a big tree and a big batch
//! a small one (fastrl defaults: batch 1 → 48 tokens, 2–4 → 32, 5–20 → 16, ≥ 21 → 8). Inside the bucket a batch
//! falls in, the bandit picks ε-greedily on the **median** reward of each arm over the bucket's sliding window of
//! recent steps; an arm with no sample in that window is tried first.
//!
//! The reward of a step is the tokens it committed per second, `accept_len × batch / step_seconds`
//! ([`step_reward`]).
//!
//! Differences from fastrl's `eagle_mab.py`, on purpose:
//! - the window is the bucket's last `window` *steps* (not each arm's last `window` pulls), so a stale median
//!   ages out after one window even for an arm that is rarely pulled, and that arm is then re-tried as unseen:
//!   the bandit adapts within one window when the arms' rewards change;
//! - the reward uses the step's measured accept length, not a cross-group median recomputed at random;
//! - one bandit per tree-size bucket, not one per fine batch-size group (the reward scales with the batch, so
//!   arms are compared on the batches their bucket serves).
//!
//! - [`MabStatistic::Throughput`] (the default) scores an arm by its **throughput per running request** over
//!   the window, `Σ accept_len / Σ step_seconds` of its steps ([`BegMab::record_step`]), instead of the median
//!   of per-step tokens per second. With a plain arm and small batches the two disagree: one speculative step
//!   commits 1 to `steps + 1` tokens per request, a skewed distribution whose median sits below its mean, so the
//!   median prefers plain rounds even where speculation commits more tokens per second in total (measured on
//!   SmolLM2 at batch 1: the median bandit ran 85% of tail rounds plain). Per request, because a bucket serves
//!   several batch sizes and the tail's batch only shrinks: rewards proportional to the batch would favour
//!   whichever arm was tried at the larger batches. `MabStatistic::Median` keeps fastrl's rule.
//!
//! The price of adapting within one window: every arm of a bucket is re-tried at least once per window, so
//! besides ε a bucket with `k` arms spends up to `(k - 1) / window` of its steps on non-greedy arms.
//!
//! With the defaults every bucket holds one arm and BEG is the fixed table above; exploration starts once two
//! arms share a tree size (e.g. `6_4_16` next to `8_4_16`).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use tlt_spec_decode::Plan;

use crate::bucket::group_of;
use crate::error::{invalid, Error, Result};
use tlt_kernels::SplitMix64;

/// Tokens committed per second by a step: `accept_len × batch / step_seconds`, where `accept_len` is the mean
/// number of tokens committed per request in the step (accepted drafts + the bonus/correction token).
pub fn step_reward(accept_len: f64, batch: usize, step_seconds: f64) -> f64 {
    accept_len * batch as f64 / step_seconds
}

/// [`BegMab`] settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MabConfig {
    /// The arms. Default: fastrl's `8_4_48` (default arm) plus `mab_configs` `8_4_32`, `8_4_16`, `8_4_8`.
    pub arms: Vec<Plan>,
    /// Ascending batch-size lower bounds, one per distinct tree size. Default `[1, 2, 5, 21]`.
    pub thresholds: Vec<usize>,
    /// Exploration probability inside a bucket, in `[0, 1]`. Default 0.1.
    pub epsilon: f64,
    /// Sliding window, in steps of one bucket (`>= 1`). Default 300 (`speculative_mab_window_size`).
    pub window: usize,
    /// Seed of the exploration coin. Default 0.
    pub seed: u64,
    /// Add a "plain" arm to every bucket: a round without drafts, rewarded like the others, so the bandit can learn
    /// that speculation does not pay at some batch size (the choice has [`Choice::plain`] set). Default false
    /// (fastrl's arms only).
    pub plain_arm: bool,
    /// How an arm's steps in the window are summarised. Default [`MabStatistic::Throughput`].
    pub statistic: MabStatistic,

    /// Names of the drafter kinds the bandit chooses between (e.g. `["suffix", "eagle", "hybrid"]`); every plan
    /// is an arm once per kind, so the bandit learns per bucket which drafter pays. Empty (the default): one
    /// unnamed kind, the drafter the decoder is given.
    pub drafters: Vec<String>,
}

impl Default for MabConfig {
    fn default() -> Self {
        let arm = |verify_tokens| Plan { steps: 8, top_k: 4, verify_tokens };
        Self {
            arms: vec![arm(48), arm(32), arm(16), arm(8)],
            thresholds: vec![1, 2, 5, 21],
            epsilon: 0.1,
            window: 300,
            seed: 0,
            plain_arm: false,
            statistic: MabStatistic::default(),
            drafters: Vec::new(),
        }
    }
}

/// How [`BegMab`] summarises an arm's rewards in its bucket's window (see the [module docs](self)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MabStatistic {
    /// fastrl's: the median of the per-step rewards ([`step_reward`]: tokens per second of the whole batch).
    Median,
    /// Per-request throughput: `Σ accept_len / Σ step_seconds` over the arm's steps in the window (the
    /// time-weighted mean of `accept_len / step_seconds`). Rewards given to [`BegMab::record`] without their
    /// time count with weight 1.
    #[default]
    Throughput,
}

impl MabConfig {
    /// Checks: at least one arm, every arm a valid plan, no duplicate arm; thresholds strictly ascending,
    /// starting at `>= 1`, as many as distinct tree sizes; `epsilon` in `[0, 1]`; `window >= 1`.
    ///
    /// # Errors
    /// [`Error::InvalidArm`] or [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.arms.is_empty() {
            return Err(invalid("mab.arms", "at least one arm is needed"));
        }
        for (index, a) in self.arms.iter().enumerate() {
            a.validate().map_err(|source| Error::InvalidArm { index, source })?;
            if self.arms[..index].contains(a) {
                return Err(invalid("mab.arms", format!("arm {index} ({a:?}) is a duplicate")));
            }
        }
        if self.thresholds.first().is_none_or(|&t| t == 0) {
            return Err(invalid("mab.thresholds", "must be non-empty and start at >= 1"));
        }
        if self.thresholds.windows(2).any(|w| w[0] >= w[1]) {
            return Err(invalid("mab.thresholds", "must be strictly ascending"));
        }
        let sizes = self.tree_sizes();
        if sizes.len() != self.thresholds.len() {
            return Err(invalid(
                "mab.thresholds",
                format!("{} thresholds for {} distinct tree sizes {:?}", self.thresholds.len(), sizes.len(), sizes),
            ));
        }
        for (i, d) in self.drafters.iter().enumerate() {
            if d.is_empty() || self.drafters[..i].contains(d) {
                return Err(invalid("mab.drafters", format!("drafter name {d:?} is empty or a duplicate")));
            }
        }
        if !(0.0..=1.0).contains(&self.epsilon) {
            return Err(invalid("mab.epsilon", format!("{} is not in [0, 1]", self.epsilon)));
        }
        if self.window == 0 {
            return Err(invalid("mab.window", "must be at least 1"));
        }
        Ok(())
    }

    /// Number of drafter kinds (at least 1).
    pub fn kinds(&self) -> usize {
        self.drafters.len().max(1)
    }

    /// Number of (drafter kind, plan) arms, the plain arm not counted: `kinds() × arms.len()`.
    pub fn num_arms(&self) -> usize {
        self.kinds() * self.arms.len()
    }

    /// The distinct `verify_tokens` of the arms, largest first (bucket `i` uses `tree_sizes()[i]`).
    pub fn tree_sizes(&self) -> Vec<usize> {
        let mut s: Vec<usize> = self.arms.iter().map(|a| a.verify_tokens).collect();
        s.sort_unstable_by(|a, b| b.cmp(a));
        s.dedup();
        s
    }
}

/// Why an arm was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ChoiceReason {
    /// The arm had no sample in its bucket's window.
    Unseen,
    /// The ε coin came up: uniform among the bucket's arms.
    Explore,
    /// The best score ([`MabStatistic`]) in the window.
    Exploit,
}

/// One decision of the bandit; hand it back to [`BegMab::record`] with the step's reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The arm: `drafter × arms.len() + i` for plan `MabConfig::arms[i]`; [`MabConfig::num_arms`] for the
    /// plain arm.
    pub arm: usize,
    /// The drafter kind (index into [`MabConfig::drafters`]; 0 with one kind or for the plain arm).
    pub drafter: usize,
    /// The arm's plan.
    pub plan: Plan,
    /// The batch-size bucket (index into [`MabConfig::thresholds`]).
    pub bucket: usize,
    /// Why this arm.
    pub reason: ChoiceReason,
    /// The plain arm ([`MabConfig::plain_arm`]): run the round without drafts (`plan` is then unused).
    pub plain: bool,
}

#[derive(Debug, Clone)]
struct Bucket {
    arms: Vec<usize>,
    /// `(arm, reward, weight)` of the bucket's recent steps.
    window: VecDeque<(usize, f64, f64)>,
    /// Samples of each arm (indexed like `arms`) in `window`.
    counts: Vec<usize>,
}

/// The BEG multi-armed bandit; see the [module docs](self).
///
/// ```
/// use tlt_scheduler::{step_reward, BegMab, MabConfig};
/// let mut mab = BegMab::new(MabConfig::default()).unwrap();
/// assert_eq!(mab.select(1).plan.verify_tokens, 48);
/// assert_eq!(mab.select(3).plan.verify_tokens, 32);
/// let c = mab.select(8);
/// assert_eq!(c.plan.verify_tokens, 16);
/// mab.record(&c, step_reward(3.5, 8, 0.020)).unwrap();
/// assert_eq!(mab.select(40).plan.verify_tokens, 8);
/// ```
#[derive(Debug, Clone)]
pub struct BegMab {
    cfg: MabConfig,
    buckets: Vec<Bucket>,
    arm_bucket: Vec<usize>,
    rng: SplitMix64,
}

impl BegMab {
    /// A bandit with empty windows.
    ///
    /// # Errors
    /// If `cfg` does not [validate](MabConfig::validate).
    pub fn new(cfg: MabConfig) -> Result<Self> {
        cfg.validate()?;
        let sizes = cfg.tree_sizes();
        let arm_bucket: Vec<usize> = (0..cfg.num_arms())
            .map(|a| sizes.iter().position(|&s| s == cfg.arms[a % cfg.arms.len()].verify_tokens).unwrap_or_default())
            .collect();
        let plain = cfg.plain_arm.then_some(cfg.num_arms());
        let buckets = (0..sizes.len())
            .map(|b| Bucket {
                arms: (0..cfg.num_arms()).filter(|&a| arm_bucket[a] == b).chain(plain).collect(),
                // The window fills as rounds are observed: a huge configured window (a run config may say
                // 2^63 - 1) costs nothing up front instead of aborting on the allocation.
                window: VecDeque::with_capacity(cfg.window.min(1024)),
                counts: Vec::new(),
            })
            .map(|mut b: Bucket| {
                b.counts = vec![0; b.arms.len()];
                b
            })
            .collect();
        let rng = SplitMix64::new(cfg.seed);
        Ok(Self { cfg, buckets, arm_bucket, rng })
    }

    /// The bucket a batch of `batch` running requests falls in.
    pub fn bucket_of(&self, batch: usize) -> usize {
        group_of(batch, &self.cfg.thresholds)
    }

    /// Picks the plan for a speculative step over `batch` running requests.
    pub fn select(&mut self, batch: usize) -> Choice {
        let bucket = self.bucket_of(batch);
        let b = &self.buckets[bucket];
        let n = self.cfg.num_arms();
        let p = self.cfg.arms.len();
        let plan_of = |arm: usize| if arm < n { self.cfg.arms[arm % p] } else { Plan::chain(1) };
        let pick = |arm: usize, reason| Choice {
            arm,
            drafter: if arm < n { arm / p } else { 0 },
            plan: plan_of(arm),
            bucket,
            reason,
            plain: arm == n,
        };
        if let Some(i) = b.counts.iter().position(|&c| c == 0) {
            return pick(b.arms[i], ChoiceReason::Unseen);
        }
        if b.arms.len() == 1 {
            return pick(b.arms[0], ChoiceReason::Exploit);
        }
        if self.rng.next_f64() < self.cfg.epsilon {
            let arm = b.arms[self.rng.below(b.arms.len())];
            return pick(arm, ChoiceReason::Explore);
        }
        let mut best = (b.arms[0], f64::NEG_INFINITY);
        for &a in &b.arms {
            let m = summary(self.cfg.statistic, &b.window, a).unwrap_or(f64::INFINITY);
            if m > best.1 {
                best = (a, m);
            }
        }
        pick(best.0, ChoiceReason::Exploit)
    }

    /// Records the reward (tokens/s, see [`step_reward`]) of the step that ran `choice`. The sample enters the
    /// window of the arm's bucket, evicting the oldest once the window is full.
    ///
    /// # Errors
    /// [`Error::InvalidOutcome`] for an unknown arm or a reward that is negative or not finite (it is dropped).
    pub fn record(&mut self, choice: &Choice, reward: f64) -> Result<()> {
        self.push(choice, reward, 1.0)
    }

    /// Records a step that ran `choice` over `batch` running requests, committed `accept_len` tokens per
    /// request on average and took `seconds`: its reward under the configured [`MabStatistic`] (the whole
    /// batch's tokens per second for the median, the per-request rate weighted by the step's time for the
    /// throughput).
    ///
    /// # Errors
    /// As [`Self::record`]; also for `seconds` that is not finite and positive.
    pub fn record_step(&mut self, choice: &Choice, accept_len: f64, batch: usize, seconds: f64) -> Result<()> {
        if !(seconds.is_finite() && seconds > 0.0) {
            return Err(Error::InvalidOutcome(format!("step time {seconds} is not a finite positive number")));
        }
        match self.cfg.statistic {
            MabStatistic::Median => self.record(choice, step_reward(accept_len, batch, seconds)),
            MabStatistic::Throughput => self.push(choice, accept_len / seconds, seconds),
        }
    }

    fn push(&mut self, choice: &Choice, reward: f64, weight: f64) -> Result<()> {
        let plain = self.cfg.plain_arm && choice.arm == self.cfg.num_arms() && choice.bucket < self.buckets.len();
        let bucket = match self.arm_bucket.get(choice.arm) {
            Some(&b) => b,
            None if plain => choice.bucket,
            None => return Err(Error::InvalidOutcome(format!("unknown arm {}", choice.arm))),
        };
        if !reward.is_finite() || reward < 0.0 {
            return Err(Error::InvalidOutcome(format!("reward {reward} is not a finite non-negative number")));
        }
        let b = &mut self.buckets[bucket];
        let slot = |arms: &[usize], arm| arms.iter().position(|&a| a == arm).unwrap_or_default();
        if b.window.len() == self.cfg.window {
            if let Some((old, _, _)) = b.window.pop_front() {
                b.counts[slot(&b.arms, old)] -= 1;
            }
        }
        b.window.push_back((choice.arm, reward, weight));
        b.counts[slot(&b.arms, choice.arm)] += 1;
        Ok(())
    }

    /// The plain arm's score in `bucket`'s window ([`Self::score`]; `None` without the plain arm or samples).
    pub fn plain_score(&self, bucket: usize) -> Option<f64> {
        if !self.cfg.plain_arm {
            return None;
        }
        summary(self.cfg.statistic, &self.buckets.get(bucket)?.window, self.cfg.num_arms())
    }

    /// The score the bandit ranks `arm` by in its bucket's window ([`MabConfig::statistic`]; `None` without a
    /// sample there).
    pub fn score(&self, arm: usize) -> Option<f64> {
        let bucket = *self.arm_bucket.get(arm)?;
        summary(self.cfg.statistic, &self.buckets[bucket].window, arm)
    }

    /// The arm the bandit would exploit in `bucket` now (the first best score among the arms with a sample in the
    /// bucket's window, as [`Self::select`] ranks them) and its score; `None` for an unknown bucket or an empty
    /// window.
    pub fn leader(&self, bucket: usize) -> Option<(usize, f64)> {
        let b = self.buckets.get(bucket)?;
        let mut best: Option<(usize, f64)> = None;
        for &a in &b.arms {
            if let Some(s) = summary(self.cfg.statistic, &b.window, a) {
                if best.is_none_or(|(_, top)| s > top) {
                    best = Some((a, s));
                }
            }
        }
        best
    }

    /// The arms of `bucket` (as in [`Choice::arm`]; the plain arm last when configured).
    pub fn bucket_arms(&self, bucket: usize) -> &[usize] {
        self.buckets.get(bucket).map_or(&[], |b| b.arms.as_slice())
    }

    /// An arm's name: `plain`, or `steps:top_k:verify_tokens` after its drafter kind's name and a slash when
    /// kinds are named (the names of [`DecodeTrace::arms`](crate::DecodeTrace)).
    pub fn arm_name(&self, arm: usize) -> String {
        let n = self.cfg.num_arms();
        if arm >= n {
            return "plain".into();
        }
        let p = self.cfg.arms[arm % self.cfg.arms.len()];
        let kind = self.cfg.drafters.get(arm / self.cfg.arms.len()).map(|d| format!("{d}/")).unwrap_or_default();
        format!("{kind}{}:{}:{}", p.steps, p.top_k, p.verify_tokens)
    }

    /// The configuration.
    pub fn config(&self) -> &MabConfig {
        &self.cfg
    }

    /// What the bandit has learned (its windows and its exploration coin), for a checkpoint.
    pub fn state(&self) -> MabState {
        let windows = self
            .buckets
            .iter()
            .map(|b| b.window.iter().map(|&(arm, r, w)| (arm, r.to_bits(), w.to_bits())).collect())
            .collect();
        MabState { rng: self.rng.state(), windows }
    }

    /// Continues from `state` (a checkpoint of a bandit with this configuration): the next choices are those the
    /// checkpointed bandit would have made.
    ///
    /// # Errors
    /// [`Error::InvalidOutcome`] when `state` does not fit this configuration (bucket count, an arm outside its
    /// bucket, a window longer than configured, a negative or non-finite reward or weight); the bandit is then
    /// unchanged.
    pub fn restore(&mut self, state: &MabState) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidOutcome(format!("bandit state: {what}")));
        if state.windows.len() != self.buckets.len() {
            return bad(format!("{} buckets, expected {}", state.windows.len(), self.buckets.len()));
        }
        let mut buckets = self.buckets.clone();
        for (i, (b, w)) in buckets.iter_mut().zip(&state.windows).enumerate() {
            if w.len() > self.cfg.window {
                return bad(format!("bucket {i} holds {} steps, the window is {}", w.len(), self.cfg.window));
            }
            b.window.clear();
            b.counts.iter_mut().for_each(|c| *c = 0);
            for &(arm, r, wt) in w {
                let (r, wt) = (f64::from_bits(r), f64::from_bits(wt));
                let Some(slot) = b.arms.iter().position(|&a| a == arm) else {
                    return bad(format!("arm {arm} is not in bucket {i}"));
                };
                if !(r.is_finite() && r >= 0.0 && wt.is_finite() && wt >= 0.0) {
                    return bad(format!("bucket {i}: reward {r} or weight {wt} is not finite and >= 0"));
                }
                b.window.push_back((arm, r, wt));
                b.counts[slot] += 1;
            }
        }
        self.buckets = buckets;
        self.rng = SplitMix64::new(state.rng);
        Ok(())
    }
}

/// A [`BegMab`]'s learned state ([`BegMab::state`]): per bucket its window of `(arm, reward, weight)`, oldest
/// first, and the exploration coin's state. Rewards and weights are IEEE-754 bit patterns, so a JSON checkpoint
/// restores them exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MabState {
    /// The exploration coin ([`SplitMix64::state`]).
    pub rng: u64,
    /// Per bucket, its window: `(arm, reward bits, weight bits)`.
    pub windows: Vec<Vec<(usize, u64, u64)>>,
}

fn summary(statistic: MabStatistic, window: &VecDeque<(usize, f64, f64)>, arm: usize) -> Option<f64> {
    match statistic {
        MabStatistic::Median => window_median(window, arm),
        MabStatistic::Throughput => {
            let (num, den) =
                window.iter().filter(|&&(a, _, _)| a == arm).fold((0.0, 0.0), |(n, d), &(_, r, w)| (n + r * w, d + w));
            (den > 0.0).then(|| num / den)
        }
    }
}

fn window_median(window: &VecDeque<(usize, f64, f64)>, arm: usize) -> Option<f64> {
    let mut v: Vec<f64> = window.iter().filter(|&&(a, _, _)| a == arm).map(|&(_, r, _)| r).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn default_table_matches_fastrl() {
        let mut mab = BegMab::new(MabConfig::default()).unwrap();
        assert_eq!(MabConfig::default().tree_sizes(), [48, 32, 16, 8]);
        for (b, want) in [(1, 48), (2, 32), (4, 32), (5, 16), (20, 16), (21, 8), (512, 8), (0, 48)] {
            for _ in 0..3 {
                let c = mab.select(b);
                assert_eq!(c.plan.verify_tokens, want, "batch {b}");
                mab.record(&c, 1.0).unwrap();
            }
        }
        let cfg: MabConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(cfg, MabConfig::default());
        let json = serde_json::to_string(&MabConfig::default()).unwrap();
        assert_eq!(serde_json::from_str::<MabConfig>(&json).unwrap(), MabConfig::default());
    }

    /// A restored bandit makes the choices the original makes from the same point on (exploration coin and windows
    /// included); a state that does not fit the configuration is refused and changes nothing.
    #[test]
    fn state_round_trips_and_continues_identically() {
        let cfg = MabConfig {
            arms: vec![Plan { steps: 4, top_k: 2, verify_tokens: 8 }, Plan { steps: 6, top_k: 2, verify_tokens: 8 }],
            thresholds: vec![1],
            epsilon: 0.3,
            window: 5,
            plain_arm: true,
            ..MabConfig::default()
        };
        let mut a = BegMab::new(cfg.clone()).unwrap();
        let mut reward = 0.37f64;
        for _ in 0..9 {
            let c = a.select(2);
            reward = (reward * 7.1).fract();
            a.record_step(&c, 1.0 + reward, 2, 0.01 + reward / 100.0).unwrap();
        }
        let json = serde_json::to_string(&a.state()).unwrap();
        let mut b = BegMab::new(cfg.clone()).unwrap();
        b.restore(&serde_json::from_str(&json).unwrap()).unwrap();
        assert_eq!(b.state(), a.state());
        let mut fresh = BegMab::new(cfg.clone()).unwrap();
        let (mut same, mut differs) = (true, false);
        for i in 0..40 {
            let (ca, cb, cf) = (a.select(2), b.select(2), fresh.select(2));
            same &= ca == cb;
            differs |= ca.arm != cf.arm;
            let r = 1.0 + (i as f64 * 0.13).fract();
            for (m, c) in [(&mut a, ca), (&mut b, cb), (&mut fresh, cf)] {
                m.record_step(&c, r, 2, 0.01).unwrap();
            }
        }
        assert!(same, "the restored bandit chose differently");
        assert!(differs, "negative control: a fresh bandit should choose differently at least once");
        let before = b.state();
        let mut wrong = before.clone();
        wrong.windows.push(Vec::new());
        assert!(b.restore(&wrong).is_err());
        let mut wrong = before.clone();
        wrong.windows[0].push((99, 1f64.to_bits(), 1f64.to_bits()));
        assert!(b.restore(&wrong).is_err());
        let mut wrong = before.clone();
        wrong.windows[0][0].1 = f64::NAN.to_bits();
        assert!(b.restore(&wrong).is_err());
        assert_eq!(b.state(), before, "a refused state changed the bandit");
    }

    #[test]
    fn a_huge_window_allocates_nothing_up_front() {
        // Found by fuzzing run configs: `window = 9223372036854775807` passed validation, then the bandit's
        // `VecDeque::with_capacity(window)` aborted. The window now fills as rounds are recorded.
        let mut mab = BegMab::new(MabConfig { window: i64::MAX as usize, ..MabConfig::default() }).unwrap();
        for _ in 0..5 {
            let c = mab.select(3);
            mab.record(&c, 2.0).unwrap();
        }
    }

    #[test]
    fn validation() {
        let ok = MabConfig::default();
        assert!(MabConfig { arms: vec![], ..ok.clone() }.validate().is_err());
        assert!(MabConfig { thresholds: vec![1, 2, 5], ..ok.clone() }.validate().is_err());
        assert!(MabConfig { thresholds: vec![0, 2, 5, 21], ..ok.clone() }.validate().is_err());
        assert!(MabConfig { thresholds: vec![1, 5, 5, 21], ..ok.clone() }.validate().is_err());
        assert!(MabConfig { epsilon: 1.5, ..ok.clone() }.validate().is_err());
        assert!(MabConfig { epsilon: f64::NAN, ..ok.clone() }.validate().is_err());
        assert!(MabConfig { window: 0, ..ok.clone() }.validate().is_err());
        let mut dup = ok.clone();
        dup.arms.push(dup.arms[0]);
        dup.thresholds.push(40);
        assert!(dup.validate().is_err());
        let bad_plan =
            MabConfig { arms: vec![Plan { steps: 1, top_k: 1, verify_tokens: 9 }], thresholds: vec![1], ..ok };
        assert!(matches!(bad_plan.validate(), Err(Error::InvalidArm { index: 0, .. })));
    }

    #[test]
    fn unseen_first_then_median_and_bad_rewards_rejected() {
        let arms = vec![Plan { steps: 8, top_k: 4, verify_tokens: 16 }, Plan { steps: 6, top_k: 4, verify_tokens: 16 }];
        let mut mab = BegMab::new(MabConfig {
            arms,
            thresholds: vec![1],
            epsilon: 0.0,
            window: 10,
            seed: 1,
            plain_arm: false,
            statistic: MabStatistic::Median,
            drafters: Vec::new(),
        })
        .unwrap();
        let a = mab.select(4);
        assert_eq!((a.arm, a.reason), (0, ChoiceReason::Unseen));
        mab.record(&a, 10.0).unwrap();
        let b = mab.select(4);
        assert_eq!((b.arm, b.reason), (1, ChoiceReason::Unseen));
        mab.record(&b, 20.0).unwrap();
        // One outlier does not move the median of arm 1 below arm 0.
        for r in [1000.0, 0.0, 25.0] {
            let c = mab.select(4);
            mab.record(&c, r).unwrap();
        }
        assert_eq!(mab.select(4).reason, ChoiceReason::Exploit);
        assert!(mab.record(&a, f64::NAN).is_err());
        assert!(mab.record(&a, -1.0).is_err());
        assert!(mab.record(&Choice { arm: 9, ..a }, 1.0).is_err());
        assert_eq!(step_reward(2.0, 4, 0.5), 16.0);
    }

    /// `k` arms sharing one tree size; the best has a mean reward at least 30% above every other; rewards get
    /// ±10% multiplicative noise.
    fn bandit() -> impl Strategy<Value = (Vec<f64>, usize, f64, usize, u64)> {
        // Re-trying each other arm once per window costs (k-1)/window of the steps: keep that under 2%.
        (2usize..6, 0.0f64..0.015, 0usize..200, any::<u64>()).prop_flat_map(|(k, eps, extra, seed)| {
            let window = 60 * (k - 1) + extra;
            (proptest::collection::vec(1.0f64..100.0, k), 0..k, Just(eps), Just(window), Just(seed)).prop_map(
                |(mut means, best, eps, window, seed)| {
                    let top = means.iter().cloned().fold(0.0, f64::max) * 1.3;
                    means[best] = top;
                    (means, best, eps, window, seed)
                },
            )
        })
    }

    fn arms(k: usize) -> Vec<Plan> {
        (0..k).map(|i| Plan { steps: 4 + i, top_k: 4, verify_tokens: 16 }).collect()
    }

    fn pull(mab: &mut BegMab, means: &[f64], noise: &mut SplitMix64) -> usize {
        let c = mab.select(8);
        let r = means[c.arm] * (0.9 + 0.2 * noise.next_f64());
        mab.record(&c, r).unwrap();
        c.arm
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn picks_best_arm_95_percent_after_warmup((means, best, eps, window, seed) in bandit()) {
            let cfg = MabConfig { arms: arms(means.len()), thresholds: vec![1], epsilon: eps, window, seed, plain_arm: false, statistic: MabStatistic::Median, drafters: Vec::new() };
            let mut mab = BegMab::new(cfg).unwrap();
            let mut noise = SplitMix64::new(seed ^ 0xABCD);
            for _ in 0..window + means.len() {
                pull(&mut mab, &means, &mut noise);
            }
            let n = 4000;
            let hits = (0..n).filter(|_| pull(&mut mab, &means, &mut noise) == best).count();
            prop_assert!(hits as f64 >= 0.95 * n as f64, "best picked {} / {}", hits, n);
        }

        #[test]
        fn adapts_within_one_window((means, best, eps, window, seed) in bandit(), shift in 1usize..6) {
            let k = means.len();
            let cfg = MabConfig { arms: arms(k), thresholds: vec![1], epsilon: eps, window, seed, plain_arm: false, statistic: MabStatistic::Median, drafters: Vec::new() };
            let mut mab = BegMab::new(cfg).unwrap();
            let mut noise = SplitMix64::new(seed ^ 0x1234);
            for _ in 0..window * 2 {
                pull(&mut mab, &means, &mut noise);
            }
            // The arms change: rotate the means so another arm is best.
            let mut changed = means.clone();
            changed.rotate_left(shift % k);
            if shift % k == 0 {
                changed.swap(best, (best + 1) % k);
            }
            let new_best = changed.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
            prop_assert_ne!(new_best, best);
            for _ in 0..window + k {
                pull(&mut mab, &changed, &mut noise);
            }
            let n = 4000;
            let hits = (0..n).filter(|_| pull(&mut mab, &changed, &mut noise) == new_best).count();
            prop_assert!(hits as f64 >= 0.95 * n as f64, "new best picked {} / {}", hits, n);
        }
    }

    #[test]
    fn the_plain_arm_wins_where_speculation_does_not_pay() {
        let cfg = MabConfig { plain_arm: true, epsilon: 0.05, window: 40, ..MabConfig::default() };
        let mut mab = BegMab::new(cfg).unwrap();
        let (mut plain, mut total) = (0, 0);
        for i in 0..400 {
            let c = mab.select(40);
            // Plain rounds commit 40 tokens in 10 ms; speculative ones 60 tokens in 30 ms.
            let reward = if c.plain { step_reward(1.0, 40, 0.010) } else { step_reward(1.5, 40, 0.030) };
            mab.record(&c, reward).unwrap();
            if i >= 100 {
                total += 1;
                plain += usize::from(c.plain);
            }
        }
        assert!(plain as f64 / total as f64 > 0.9, "plain chosen {plain}/{total}");
        assert!(mab.plain_score(mab.bucket_of(40)).is_some());
        // Without the option no choice is plain.
        let mut mab = BegMab::new(MabConfig::default()).unwrap();
        assert!((0..50).all(|_| !mab.select(3).plain));
    }

    #[test]
    fn drafter_kinds_are_arms_and_the_better_kind_wins() {
        let cfg = MabConfig {
            arms: vec![Plan::chain(2), Plan::chain(4)],
            thresholds: vec![1, 2],
            drafters: vec!["suffix".into(), "eagle".into()],
            plain_arm: true,
            epsilon: 0.05,
            window: 200,
            ..MabConfig::default()
        };
        assert_eq!(cfg.num_arms(), 4);
        let mut mab = BegMab::new(cfg.clone()).unwrap();
        let mut picks = [0usize; 2];
        for i in 0..400 {
            let c = mab.select(1);
            assert_eq!(c.plan, if c.plain { Plan::chain(1) } else { cfg.arms[c.arm % 2] });
            // Kind 1 ("eagle") pays twice as much as kind 0; the plain arm least.
            let reward = if c.plain { 1.0 } else { 2.0 + 2.0 * c.drafter as f64 };
            mab.record(&c, reward).unwrap();
            if i >= 200 && !c.plain {
                picks[c.drafter] += 1;
            }
        }
        assert!(picks[1] > 9 * picks[0], "picks {picks:?}");
        let dup = MabConfig { drafters: vec!["a".into(), "a".into()], ..cfg };
        assert!(dup.validate().is_err());
    }

    /// A speculative step at batch 1 commits 1 token with probability 0.55, else 4 (mean 2.35) in 40 ms; a plain
    /// step commits 1 in 22 ms. Speculation is faster (58.8 vs 45.5 tokens/s) but its median step (1 token in
    /// 40 ms, 25 tokens/s) is slower: the median bandit runs plain, the throughput bandit speculates.
    #[test]
    fn throughput_sees_a_skewed_speculative_step_the_median_misses() {
        let run = |statistic| {
            let cfg = MabConfig {
                arms: vec![Plan::chain(4)],
                thresholds: vec![1],
                plain_arm: true,
                epsilon: 0.05,
                window: 100,
                statistic,
                ..MabConfig::default()
            };
            let mut mab = BegMab::new(cfg).unwrap();
            let mut coin = SplitMix64::new(7);
            let (mut tokens, mut seconds, mut plain) = (0.0, 0.0, 0usize);
            for _ in 0..2000 {
                let c = mab.select(1);
                let (accept, secs) =
                    if c.plain { (1.0, 0.022) } else { (if coin.next_f64() < 0.55 { 1.0 } else { 4.0 }, 0.040) };
                mab.record_step(&c, accept, 1, secs).unwrap();
                tokens += accept;
                seconds += secs;
                plain += usize::from(c.plain);
            }
            (plain as f64 / 2000.0, tokens / seconds)
        };
        let (plain_median, tput_median) = run(MabStatistic::Median);
        let (plain_tput, tput_tput) = run(MabStatistic::Throughput);
        assert!(plain_median > 0.8, "the median bandit ran {plain_median} of its steps plain");
        assert!(plain_tput < 0.2, "the throughput bandit ran {plain_tput} of its steps plain");
        assert!(tput_tput > 1.1 * tput_median, "{tput_tput} vs {tput_median} tokens/s");
        let mut mab = BegMab::new(MabConfig::default()).unwrap();
        let c = mab.select(1);
        assert!(mab.record_step(&c, 1.0, 1, 0.0).is_err());
        assert!(mab.record_step(&c, 1.0, 1, f64::NAN).is_err());
    }

    #[test]
    fn throughput_is_the_time_weighted_mean_per_request() {
        let cfg = MabConfig { arms: vec![Plan::chain(2)], thresholds: vec![1], ..MabConfig::default() };
        let mut mab = BegMab::new(cfg).unwrap();
        let c = mab.select(4);
        // Two steps at batch 4: 2 tokens per request in 0.1 s, then 1 in 0.3 s: (2 + 1) / 0.4 per request.
        mab.record_step(&c, 2.0, 4, 0.1).unwrap();
        mab.record_step(&c, 1.0, 4, 0.3).unwrap();
        assert!((mab.score(c.arm).unwrap() - 7.5).abs() < 1e-12);
        // An untimed reward counts with weight 1.
        mab.record(&c, 10.0).unwrap();
        assert!((mab.score(c.arm).unwrap() - (2.0 + 1.0 + 10.0) / 1.4).abs() < 1e-12);
    }
}
