//! Learning-rate schedules: linear warmup, then constant, linear or cosine decay to a floor (verl `lr_scheduler`,
//! OpenRLHF `cosine_with_min_lr`).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Shape of the schedule after warmup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Half-cosine from `lr` down to `min_lr_ratio * lr` at `total_steps`. Default.
    #[default]
    Cosine,
    /// `lr` after warmup.
    Constant,
    /// Straight line from `lr` down to `min_lr_ratio * lr` at `total_steps`.
    Linear,
}

/// Learning rate as a function of the 0-based update number.
///
/// Defaults: `lr` 1e-6, no warmup, `total_steps` 0 (constant after warmup), `min_lr_ratio` 0, cosine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LrSchedule {
    /// Peak learning rate. Default 1e-6.
    pub lr: f64,
    /// Updates of linear warmup from 0: update `s < warmup_steps` uses `lr * s / warmup_steps` (verl's and
    /// transformers' `get_*_schedule_with_warmup`: the first update runs at 0). Default 0.
    pub warmup_steps: u64,
    /// Update at which the decay reaches its floor; 0 keeps `lr` after warmup. Otherwise must exceed
    /// `warmup_steps`. Default 0.
    pub total_steps: u64,
    /// Floor of the decay as a fraction of `lr`, in `[0, 1]`. Default 0.
    pub min_lr_ratio: f64,
    /// Decay shape. Default [`ScheduleKind::Cosine`].
    pub kind: ScheduleKind,
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self { lr: 1e-6, warmup_steps: 0, total_steps: 0, min_lr_ratio: 0.0, kind: ScheduleKind::Cosine }
    }
}

impl LrSchedule {
    /// A constant schedule at `lr`.
    pub fn constant(lr: f64) -> Self {
        Self { lr, kind: ScheduleKind::Constant, ..Self::default() }
    }

    /// Checks `lr` (finite, >= 0), `min_lr_ratio` (in `[0, 1]`) and `total_steps` (0 or > `warmup_steps`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(Error::config("schedule.lr", self.lr, "must be finite and >= 0"));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(Error::config("schedule.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]"));
        }
        if self.total_steps != 0 && self.total_steps <= self.warmup_steps {
            return Err(Error::config("schedule.total_steps", self.total_steps, "must be 0 or > warmup_steps"));
        }
        Ok(())
    }

    /// The learning rate of update `step` (0-based).
    ///
    /// Warmup ramps linearly from 0 at step 0 to `lr * (warmup_steps - 1) / warmup_steps` at step
    /// `warmup_steps - 1` (verl: `current_step / max(1, num_warmup_steps)`), reaching `lr` at `warmup_steps`. After it,
    /// [`ScheduleKind::Constant`] (or `total_steps == 0`) gives `lr`; the decays go from `lr` at `warmup_steps` to
    /// `min_lr_ratio * lr` at `total_steps` and stay there. Never negative for a valid schedule; an invalid
    /// `total_steps <= warmup_steps` is treated as constant.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * step as f64 / self.warmup_steps as f64;
        }
        if self.kind == ScheduleKind::Constant || self.total_steps <= self.warmup_steps {
            return self.lr;
        }
        let span = (self.total_steps - self.warmup_steps) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        let floor = self.min_lr_ratio.clamp(0.0, 1.0) * self.lr;
        let frac = match self.kind {
            ScheduleKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            ScheduleKind::Linear | ScheduleKind::Constant => 1.0 - progress,
        };
        (floor + (self.lr - floor) * frac).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sched(kind: ScheduleKind) -> LrSchedule {
        LrSchedule { lr: 1e-3, warmup_steps: 10, total_steps: 110, min_lr_ratio: 0.1, kind }
    }

    #[test]
    fn schedule_warmup_then_decay() {
        for kind in [ScheduleKind::Cosine, ScheduleKind::Linear, ScheduleKind::Constant] {
            let s = sched(kind);
            s.validate().unwrap();
            // verl's warmup from 0: s / W at update s.
            assert_eq!(s.lr_at(0), 0.0);
            assert!((s.lr_at(1) - 1e-4).abs() < 1e-15);
            for i in 0..10 {
                assert!(s.lr_at(i) < s.lr_at(i + 1), "{kind:?} warmup not increasing at {i}");
            }
            assert!((s.lr_at(9) - 9e-4).abs() < 1e-15);
            assert_eq!(s.lr_at(10), 1e-3);
            let end = if kind == ScheduleKind::Constant { 1e-3 } else { 1e-4 };
            assert!((s.lr_at(110) - end).abs() < 1e-15, "{kind:?}");
            assert!((s.lr_at(10_000) - end).abs() < 1e-15, "{kind:?}");
        }
        let cos = sched(ScheduleKind::Cosine);
        assert!((cos.lr_at(60) - 5.5e-4).abs() < 1e-15);
        let lin = sched(ScheduleKind::Linear);
        assert!((lin.lr_at(35) - (1e-3 - 0.9e-3 * 0.25)).abs() < 1e-15);
    }

    #[test]
    fn schedule_defaults_and_validation() {
        let d = LrSchedule::default();
        d.validate().unwrap();
        assert_eq!(d.lr_at(0), 1e-6);
        assert_eq!(d.lr_at(1_000_000), 1e-6);
        assert_eq!(LrSchedule::constant(0.5).lr_at(7), 0.5);
        let bad = [
            LrSchedule { lr: -1.0, ..d.clone() },
            LrSchedule { lr: f64::NAN, ..d.clone() },
            LrSchedule { min_lr_ratio: 1.5, ..d.clone() },
            LrSchedule { warmup_steps: 5, total_steps: 5, ..d.clone() },
        ];
        for s in bad {
            assert!(matches!(s.validate(), Err(Error::InvalidConfig { .. })), "{s:?}");
        }
        let json = r#"{"lr": 0.01, "kind": "linear", "total_steps": 3}"#;
        let s: LrSchedule = serde_json::from_str(json).unwrap();
        assert_eq!(s, LrSchedule { lr: 0.01, total_steps: 3, kind: ScheduleKind::Linear, ..d });
        assert!(serde_json::from_str::<LrSchedule>(r#"{"warmup": 3}"#).is_err());
    }

    proptest! {
        #[test]
        fn schedule_within_bounds_and_monotone_after_warmup(
            lr in 0.0f64..1.0,
            warmup in 0u64..50,
            extra in 1u64..200,
            constant_tail in any::<bool>(),
            ratio in 0.0f64..=1.0,
            kind in 0usize..3,
            step in 0u64..400,
        ) {
            let kind = [ScheduleKind::Cosine, ScheduleKind::Constant, ScheduleKind::Linear][kind];
            let total = if constant_tail { 0 } else { warmup + extra };
            let s = LrSchedule { lr, warmup_steps: warmup, total_steps: total, min_lr_ratio: ratio, kind };
            s.validate().unwrap();
            let v = s.lr_at(step);
            prop_assert!(v >= 0.0 && v <= lr * (1.0 + 1e-12));
            if step >= warmup {
                prop_assert!(v >= ratio * lr * (1.0 - 1e-12));
                prop_assert!(s.lr_at(step + 1) <= v * (1.0 + 1e-12));
            } else {
                prop_assert!(s.lr_at(step + 1) >= v);
            }
        }
    }
}
