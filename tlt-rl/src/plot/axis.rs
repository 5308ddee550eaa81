//! Axis ranges, ticks and tick labels: a plotters [`Ranged`] coordinate over `f64` whose ticks come from
//! plotters' own key-point algorithms, its integer one for integer data (RL steps, decode steps, counts), so
//! such an axis never shows a `1.5` tick.

use std::ops::Range;

use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::coord::types::{RangedCoordf64, RangedCoordi64};

/// Most ticks on an axis.
pub(crate) const MAX_TICKS: usize = 10;

/// Data are clamped to `±LIMIT`, so that every span stays finite.
const LIMIT: f64 = f64::MAX / 4.0;

/// Below this magnitude integer ticks are computed in `i64`; above it every `f64` is an integer anyway.
const EXACT_INT: f64 = 9.0e15;

/// What values an axis shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scale {
    /// Any real value: ticks at 1, 2 or 5 × 10^k.
    Real,
    /// Integer data: ticks are integers only.
    Integer,
}

/// One axis: its range, its ticks and how to label them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Axis {
    lo: f64,
    hi: f64,
    scale: Scale,
    ticks: Vec<f64>,
}

impl Axis {
    /// An axis covering the finite `values` (non-finite ones are ignored; none gives `[0, 1]`).
    ///
    /// `margin` widens the range by that fraction of its span at each end, except at an end that is exactly
    /// 0 (counts start at 0); `from_zero` stretches the range to include 0. A range of a single value `v` is
    /// widened by 10% of `v` each way (at least 1 on an integer axis); all zeros give `[0, 1]` with `from_zero`,
    /// else `[-1, 1]`.
    pub(crate) fn fit(values: impl IntoIterator<Item = f64>, scale: Scale, margin: f64, from_zero: bool) -> Self {
        let (lo, hi) = finite_bounds(values).unwrap_or((0.0, 1.0));
        let (mut lo, mut hi) = if from_zero { (lo.min(0.0), hi.max(0.0)) } else { (lo, hi) };
        let magnitude = lo.abs().max(hi.abs());
        if hi - lo <= magnitude * 1e-9 {
            if magnitude == 0.0 {
                (lo, hi) = (if from_zero { 0.0 } else { -1.0 }, 1.0);
            } else {
                let pad = magnitude * 0.1;
                let pad = if scale == Scale::Integer { pad.max(1.0) } else { pad };
                (lo, hi) = (lo - pad, hi + pad);
            }
        }
        let span = hi - lo;
        if margin > 0.0 && margin.is_finite() {
            if lo != 0.0 {
                lo -= span * margin;
            }
            if hi != 0.0 {
                hi += span * margin;
            }
        }
        Self::new(lo, hi, scale)
    }

    /// An axis over exactly `[lo, hi]` (put in order, clamped to finite values, widened when empty).
    pub(crate) fn new(lo: f64, hi: f64, scale: Scale) -> Self {
        let (lo, hi) = finite_bounds([lo, hi]).unwrap_or((0.0, 1.0));
        let (lo, hi) = if hi > lo { (lo, hi) } else { (lo - 1.0, hi + 1.0) };
        Self { lo, hi, scale, ticks: ticks(lo, hi, scale, MAX_TICKS) }
    }

    /// The tick positions.
    pub(crate) fn ticks(&self) -> &[f64] {
        &self.ticks
    }

    /// The label of the tick at `v`: digits enough for the tick spacing, scientific notation for very large or
    /// very small values, and no decimals on an integer axis.
    pub(crate) fn label(&self, v: f64) -> String {
        let step = match self.ticks.as_slice() {
            [a, b, ..] => b - a,
            _ => self.hi - self.lo,
        };
        if !v.is_finite() || v.abs() <= step.abs() * 1e-9 {
            return "0".into();
        }
        let k = (step.abs().log10() + 1e-9).floor();
        let biggest = self.ticks.iter().fold(v.abs(), |a, t| a.max(t.abs()));
        if biggest >= 1e6 || step.abs() < 1e-3 {
            let digits = (v.abs().log10().floor() - k).clamp(0.0, 6.0) as usize;
            format!("{v:.digits$e}")
        } else if self.scale == Scale::Integer {
            format!("{v:.0}")
        } else {
            let decimals = (-k).clamp(0.0, 12.0) as usize;
            format!("{v:.decimals$}")
        }
    }
}

/// The smallest and largest finite value, each clamped to `±LIMIT`.
fn finite_bounds(values: impl IntoIterator<Item = f64>) -> Option<(f64, f64)> {
    values.into_iter().filter(|v| v.is_finite()).map(|v| v.clamp(-LIMIT, LIMIT)).fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((v.min(lo), v.max(hi))),
    })
}

/// At most `max` tick positions inside `[lo, hi]` (finite, `lo < hi`), chosen by plotters: its `i64` key points
/// for an integer axis (so never a fractional tick), its `f64` ones (1, 2 or 5 × 10^k) otherwise.
pub(crate) fn ticks(lo: f64, hi: f64, scale: Scale, max: usize) -> Vec<f64> {
    let max = max.max(3);
    if !(lo.is_finite() && hi.is_finite() && lo < hi) {
        return Vec::new();
    }
    if scale == Scale::Integer && lo.abs().max(hi.abs()) < EXACT_INT {
        let (a, b) = (lo.ceil() as i64, hi.floor() as i64);
        if a > b {
            return Vec::new();
        }
        // Plotters' integer algorithm may return one point more than asked for.
        return RangedCoordi64::from(a..b).key_points(max - 1).into_iter().map(|v| v as f64).collect();
    }
    RangedCoordf64::from(lo..hi).key_points(max)
}

impl Ranged for Axis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        RangedCoordf64::from(self.lo..self.hi).map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        // The ticks are the bold grid lines; no light ones in between.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.lo..self.hi
    }
}

impl ValueFormatter<f64> for Axis {
    fn format(value: &f64) -> String {
        format!("{value}")
    }

    fn format_ext(&self, value: &f64) -> String {
        self.label(*value)
    }
}
