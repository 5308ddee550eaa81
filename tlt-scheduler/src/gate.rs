//! The SD gate: when to speculate at all.
//!
//! Speculation pays off only when the running batch is small (the long tail): with a large batch the target's
//! forward is compute-bound and verifying trees wastes it. The gate turns SD **on** once the running batch has
//! stayed `<= threshold` for `on_after` consecutive decode steps, and **off** once it has stayed
//! `> off_threshold` for `off_after` consecutive steps. `off_threshold >= threshold` is the hysteresis band: a
//! batch that wanders around `threshold` (requests finishing, a few being admitted) never flips the phase back
//! and forth.
//!
//! Unlike fastrl (which keeps SD on until the cache is flushed and re-prefills every running request when it
//! switches), this gate can switch off again, and switching is free: the engine changes plan between rounds
//! without re-prefill.

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Result};

/// Whether a decode step speculates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// Plain (one token per request per step) decoding.
    Plain,
    /// Speculative decoding with a plan chosen by the bandit.
    Speculative,
}

/// [`SdGate`] settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GateConfig {
    /// SD may start once the running batch is `<= threshold`. Default 32 (fastrl's `bs_threshold`).
    pub threshold: usize,
    /// Consecutive qualifying steps before SD turns on (`>= 1`). Default 10 (fastrl's
    /// `adaptive_spec_warmup_checks`).
    pub on_after: usize,
    /// SD stops once the running batch is `> off_threshold` (`>= threshold`). Default 48 (= 1.5 x threshold).
    pub off_threshold: usize,
    /// Consecutive steps above `off_threshold` before SD turns off (`>= 1`). Default 2.
    pub off_after: usize,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self { threshold: 32, on_after: 10, off_threshold: 48, off_after: 2 }
    }
}

impl GateConfig {
    /// A gate that never speculates (every batch is above a threshold of 0... except an empty one, which never
    /// steps). Used for the plain-decoding baseline.
    pub fn never() -> Self {
        Self { threshold: 0, on_after: usize::MAX, off_threshold: 0, off_after: 1 }
    }

    /// Checks `on_after >= 1`, `off_after >= 1` and `off_threshold >= threshold`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.on_after == 0 {
            return Err(invalid("gate.on_after", "must be at least 1"));
        }
        if self.off_after == 0 {
            return Err(invalid("gate.off_after", "must be at least 1"));
        }
        if self.off_threshold < self.threshold {
            return Err(invalid(
                "gate.off_threshold",
                format!("{} is below threshold {} (no hysteresis band)", self.off_threshold, self.threshold),
            ));
        }
        Ok(())
    }
}

/// The gate's answer for one decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateDecision {
    /// The phase this step runs in.
    pub phase: Phase,
    /// `true` when this step is the first in `phase` (a transition happened at this step).
    pub switched: bool,
}

/// Decides, step by step, whether to speculate; see the [module docs](self).
///
/// ```
/// use tlt_scheduler::{GateConfig, Phase, SdGate};
/// let mut gate = SdGate::new(GateConfig { threshold: 4, on_after: 3, off_threshold: 6, off_after: 2 }).unwrap();
/// let phases: Vec<Phase> = [8, 4, 3, 4, 5, 6, 7, 7, 2].iter().map(|&b| gate.observe(b).phase).collect();
/// use Phase::{Plain as P, Speculative as S};
/// assert_eq!(phases, [P, P, P, S, S, S, S, P, P]);
/// ```
#[derive(Debug, Clone)]
pub struct SdGate {
    cfg: GateConfig,
    phase: Phase,
    streak: usize,
    transitions: u64,
}

impl SdGate {
    /// A gate in the [`Phase::Plain`] phase.
    ///
    /// # Errors
    /// If `cfg` does not [validate](GateConfig::validate).
    pub fn new(cfg: GateConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg, phase: Phase::Plain, streak: 0, transitions: 0 })
    }

    /// Feeds the running batch size of the next decode step and returns the phase that step runs in.
    pub fn observe(&mut self, batch: usize) -> GateDecision {
        let toward_other = match self.phase {
            Phase::Plain => batch <= self.cfg.threshold,
            Phase::Speculative => batch > self.cfg.off_threshold,
        };
        self.streak = if toward_other { self.streak.saturating_add(1) } else { 0 };
        let needed = match self.phase {
            Phase::Plain => self.cfg.on_after,
            Phase::Speculative => self.cfg.off_after,
        };
        let switched = toward_other && self.streak >= needed;
        if switched {
            self.phase = match self.phase {
                Phase::Plain => Phase::Speculative,
                Phase::Speculative => Phase::Plain,
            };
            self.streak = 0;
            self.transitions += 1;
        }
        GateDecision { phase: self.phase, switched }
    }

    /// The current phase (the phase of the last observed step).
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Transitions so far.
    pub fn transitions(&self) -> u64 {
        self.transitions
    }

    /// Back to [`Phase::Plain`] with no streak (a new rollout).
    pub fn reset(&mut self) {
        self.phase = Phase::Plain;
        self.streak = 0;
    }

    /// The configuration.
    pub fn config(&self) -> &GateConfig {
        &self.cfg
    }

    /// The gate's state, for a checkpoint.
    pub fn state(&self) -> GateState {
        GateState { phase: self.phase, streak: self.streak, transitions: self.transitions }
    }

    /// Continues from `state` (a checkpoint's).
    pub fn restore(&mut self, state: GateState) {
        self.phase = state.phase;
        self.streak = state.streak;
        self.transitions = state.transitions;
    }
}

/// An [`SdGate`]'s state ([`SdGate::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateState {
    /// The phase of the last observed step.
    pub phase: Phase,
    /// Consecutive steps toward the other phase.
    pub streak: usize,
    /// Transitions so far.
    pub transitions: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> impl Strategy<Value = GateConfig> {
        (1usize..64, 1usize..20, 0usize..32, 1usize..20).prop_map(|(threshold, on_after, band, off_after)| GateConfig {
            threshold,
            on_after,
            off_threshold: threshold + band,
            off_after,
        })
    }

    #[test]
    fn defaults_validate_and_bad_configs_fail() {
        assert!(GateConfig::default().validate().is_ok());
        assert!(GateConfig::never().validate().is_ok());
        assert!(GateConfig { on_after: 0, ..Default::default() }.validate().is_err());
        assert!(GateConfig { off_after: 0, ..Default::default() }.validate().is_err());
        assert!(GateConfig { off_threshold: 31, ..Default::default() }.validate().is_err());
        let back: GateConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(back, GateConfig::default());
        assert!(serde_json::from_str::<GateConfig>(r#"{"threshhold": 3}"#).is_err());
    }

    #[test]
    fn never_gate_never_speculates() {
        let mut g = SdGate::new(GateConfig::never()).unwrap();
        for b in [1, 1, 1, 5, 1000, 1].iter().cycle().take(10_000) {
            assert_eq!(g.observe(*b).phase, Phase::Plain);
        }
    }

    proptest! {
        /// Noise around the threshold that never exceeds the off threshold: once on, SD stays on; at most one
        /// transition in the whole run.
        #[test]
        fn never_flaps_inside_the_band(c in cfg(), noise in proptest::collection::vec(0usize..1000, 1..400)) {
            let lo = c.threshold.saturating_sub(3).max(1);
            let mut g = SdGate::new(c.clone()).unwrap();
            let mut switches = 0;
            for n in noise {
                let b = lo + n % (c.off_threshold - lo + 1); // in [lo, off_threshold]
                switches += usize::from(g.observe(b).switched);
            }
            prop_assert!(switches <= 1);
        }

        /// Noise strictly above the threshold never turns SD on.
        #[test]
        fn stays_off_above_threshold(c in cfg(), noise in proptest::collection::vec(1usize..50, 1..400)) {
            let mut g = SdGate::new(c.clone()).unwrap();
            for n in noise {
                prop_assert_eq!(g.observe(c.threshold + n).phase, Phase::Plain);
            }
        }

        /// Under any sequence, two transitions are at least min(on_after, off_after) steps apart, SD is on
        /// after `on_after` qualifying steps and off after `off_after` steps above the band.
        #[test]
        fn dwell_and_liveness(c in cfg(), seq in proptest::collection::vec(0usize..100, 1..600)) {
            let mut g = SdGate::new(c.clone()).unwrap();
            let dwell = c.on_after.min(c.off_after);
            let mut last_switch: Option<usize> = None;
            let (mut low, mut high) = (0usize, 0usize);
            for (i, &b) in seq.iter().enumerate() {
                let d = g.observe(b);
                if d.switched {
                    if let Some(l) = last_switch {
                        prop_assert!(i - l >= dwell, "switches at {} and {}", l, i);
                    }
                    last_switch = Some(i);
                }
                low = if b <= c.threshold { low + 1 } else { 0 };
                high = if b > c.off_threshold { high + 1 } else { 0 };
                if low >= c.on_after && !d.switched {
                    // Either already on for a while, or switched earlier in this run of low steps.
                    prop_assert_eq!(d.phase, Phase::Speculative);
                }
                if high >= c.off_after {
                    prop_assert_eq!(d.phase, Phase::Plain);
                }
            }
        }
    }
}
