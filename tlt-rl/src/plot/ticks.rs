//! "Nice" axis ticks (1, 2 or 5 × 10^k) and their labels.

/// Evenly spaced "nice" tick positions (step 1, 2 or 5 × 10^k) that cover `[lo, hi]`.
///
/// Aims at about `target` intervals (`target` is clamped to `2..=10`) and returns between 2 and 10 strictly
/// increasing ticks; the first tick is `<= lo` and the last `>= hi`, so they double as the axis range. The bounds
/// may come in either order. A degenerate range (`lo == hi`) is widened around the value; non-finite bounds are
/// ignored (both non-finite gives `[0, 1]`). Ranges too wide for `f64` arithmetic fall back to `[lo, hi]`.
pub fn nice_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let target = target.clamp(2, 10);
    let (mut lo, mut hi) = match (lo.is_finite(), hi.is_finite()) {
        (true, true) => (lo.min(hi), lo.max(hi)),
        (true, false) => (lo, lo),
        (false, true) => (hi, hi),
        (false, false) => (0.0, 1.0),
    };
    let magnitude = lo.abs().max(hi.abs());
    if hi - lo <= magnitude * 1e-9 {
        let pad = if magnitude > 0.0 { magnitude * 0.1 } else { 1.0 };
        lo -= pad;
        hi += pad;
    }
    let span = hi - lo;
    if !span.is_finite() || !lo.is_finite() || !hi.is_finite() {
        return fallback(lo, hi);
    }
    let mut step = nice_step(span / target as f64);
    for _ in 0..4 {
        if let Some(ticks) = ticks_with_step(lo, hi, step) {
            return ticks;
        }
        step = step.next();
    }
    fallback(lo, hi)
}

/// A tick step `m × 10^e` with `m` in {1, 2, 5}.
#[derive(Debug, Clone, Copy)]
struct Step {
    m: f64,
    e: i32,
}

impl Step {
    /// The next larger nice step (1 → 2 → 5 → 1 × 10).
    fn next(self) -> Self {
        if self.m < 1.5 {
            Self { m: 2.0, ..self }
        } else if self.m < 3.0 {
            Self { m: 5.0, ..self }
        } else {
            Self { m: 1.0, e: self.e + 1 }
        }
    }

    fn value(self) -> f64 {
        self.times(1.0)
    }

    /// `k × step`, dividing by an exact power of ten for negative exponents so that e.g. `3 × 0.2` is `0.6`.
    fn times(self, k: f64) -> f64 {
        if (-22..0).contains(&self.e) {
            k * self.m / 10f64.powi(-self.e)
        } else {
            k * self.m * 10f64.powi(self.e)
        }
    }
}

/// The multiples of `step` covering `[lo, hi]`, if there are at most 10 and they are finite and increasing.
fn ticks_with_step(lo: f64, hi: f64, step: Step) -> Option<Vec<f64>> {
    let (k, step) = (step, step.value());
    let mut k0 = (lo / step).floor();
    let mut k1 = (hi / step).ceil();
    // Rounding in the divisions can leave the end ticks a hair inside the range.
    if k0 * step > lo {
        k0 -= 1.0;
    }
    if k1 * step < hi {
        k1 += 1.0;
    }
    let n = k1 - k0;
    if !(1.0..=9.0).contains(&n) {
        return None;
    }
    let ticks: Vec<f64> = (0..=n as usize)
        .map(|i| {
            let t = k.times(k0 + i as f64);
            if t.abs() < step * 1e-9 {
                0.0
            } else {
                t
            }
        })
        .collect();
    let ok = ticks.iter().all(|t| t.is_finite())
        && ticks.windows(2).all(|w| w[0] < w[1])
        && ticks[0] <= lo
        && ticks[ticks.len() - 1] >= hi;
    ok.then_some(ticks)
}

fn fallback(lo: f64, hi: f64) -> Vec<f64> {
    let (lo, hi) = (lo.max(-f64::MAX), hi.min(f64::MAX));
    if lo < hi {
        vec![lo, hi]
    } else {
        vec![0.0, 1.0]
    }
}

/// The 1, 2, 5 or 10 × 10^k nearest (geometrically) to `raw`.
fn nice_step(raw: f64) -> Step {
    let e = raw.log10().floor();
    let norm = raw / 10f64.powf(e);
    let m = if norm >= 50f64.sqrt() {
        10.0
    } else if norm >= 10f64.sqrt() {
        5.0
    } else if norm >= 2f64.sqrt() {
        2.0
    } else {
        1.0
    };
    if m == 10.0 {
        Step { m: 1.0, e: e as i32 + 1 }
    } else {
        Step { m, e: e as i32 }
    }
}

/// Labels for ticks from [`nice_ticks`]: plain decimals with just enough digits for the step, or scientific
/// notation for very large or very small values.
pub(crate) fn tick_labels(ticks: &[f64]) -> Vec<String> {
    let step = if ticks.len() >= 2 { (ticks[1] - ticks[0]).abs() } else { 1.0 };
    let step = if step > 0.0 && step.is_finite() { step } else { 1.0 };
    let biggest = ticks.iter().fold(0.0f64, |a, t| a.max(t.abs()));
    let k = (step.log10() + 1e-9).floor();
    let scientific = biggest >= 1e6 || (step < 1e-3 && biggest > 0.0);
    ticks
        .iter()
        .map(|&t| {
            if t == 0.0 {
                "0".to_string()
            } else if scientific {
                let digits = ((t.abs().log10().floor() - k).clamp(0.0, 6.0)) as usize;
                format!("{t:.digits$e}")
            } else {
                let decimals = (-k).clamp(0.0, 12.0) as usize;
                format!("{t:.decimals$}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plot_ticks_hand_cases() {
        assert_eq!(nice_ticks(0.0, 100.0, 5), vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(nice_ticks(3.0, 97.0, 5), vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(nice_ticks(0.0, 10.0, 2), vec![0.0, 5.0, 10.0]);
        assert_eq!(nice_ticks(-1.0, 1.0, 4), vec![-1.0, -0.5, 0.0, 0.5, 1.0]);
        assert_eq!(nice_ticks(5.0, 5.0, 5), vec![4.4, 4.6, 4.8, 5.0, 5.2, 5.4, 5.6]);
        assert_eq!(nice_ticks(0.0, 1.0, 5), vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0]);
        assert_eq!(nice_ticks(0.1, 0.3, 4), vec![0.1, 0.15, 0.2, 0.25, 0.3]);
        assert_eq!(nice_ticks(10.0, 196.0, 6), vec![0.0, 50.0, 100.0, 150.0, 200.0]);
        assert_eq!(nice_ticks(0.0, 0.0, 5), vec![-1.0, -0.5, 0.0, 0.5, 1.0]);
    }

    #[test]
    fn plot_ticks_labels() {
        assert_eq!(tick_labels(&nice_ticks(0.0, 100.0, 5)), ["0", "20", "40", "60", "80", "100"]);
        assert_eq!(tick_labels(&nice_ticks(0.0, 1.0, 5)), ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
        assert_eq!(tick_labels(&[0.0, 2e6, 4e6]), ["0", "2e6", "4e6"]);
        assert_eq!(tick_labels(&[1.5e6, 2.0e6]), ["1.5e6", "2.0e6"]);
    }

    #[test]
    fn plot_ticks_degenerate() {
        for (lo, hi) in
            [(0.0, 0.0), (5.0, 5.0), (-3.0, -3.0), (f64::NAN, f64::NAN), (f64::NAN, 2.0), (1.0, f64::INFINITY)]
        {
            let t = nice_ticks(lo, hi, 5);
            assert!(t.len() >= 2, "{lo} {hi} {t:?}");
            assert!(t.windows(2).all(|w| w[0] < w[1]), "{lo} {hi} {t:?}");
        }
        let t = nice_ticks(-f64::MAX, f64::MAX, 5);
        assert_eq!(t.len(), 2);
        let t = nice_ticks(1e300, 1e300, 5);
        assert!(t.windows(2).all(|w| w[0] < w[1]));
        // Reversed bounds.
        assert_eq!(nice_ticks(10.0, 0.0, 5), nice_ticks(0.0, 10.0, 5));
    }

    proptest! {
        #[test]
        fn plot_ticks_cover_and_increase(a in -1e9f64..1e9, w in 0f64..1e9, target in 0usize..=12) {
            let (lo, hi) = (a, a + w);
            let t = nice_ticks(lo, hi, target);
            prop_assert!((2..=10).contains(&t.len()), "{t:?}");
            prop_assert!(t[0] <= lo && *t.last().unwrap() >= hi, "{lo} {hi} {t:?}");
            prop_assert!(t.windows(2).all(|p| p[0] < p[1]), "{t:?}");
            // Never the `[lo, hi]` fallback for ordinary ranges.
            prop_assert!(t.len() >= 3, "{lo} {hi} {target} {t:?}");
        }

        #[test]
        fn plot_ticks_small_ranges(a in -1e-3f64..1e-3, w in 1e-12f64..1e-3) {
            let t = nice_ticks(a, a + w, 5);
            prop_assert!((2..=10).contains(&t.len()));
            prop_assert!(t[0] <= a && *t.last().unwrap() >= a + w);
            prop_assert!(t.windows(2).all(|p| p[0] < p[1]));
        }
    }
}
