//! The response lengths of TLT's run against the baseline's: with the same seeds they must be the same answers,
//! so every length should match; where they do not, a two-sample Kolmogorov-Smirnov test says how different
//! the two distributions are ([`ks_2samp`], pooled over all steps and per step).

use tlt_rl::metrics::StepMetrics;

/// Above this product of the two sample sizes the p-value is the asymptotic one (the exact one's lattice walk
/// costs `n * m` steps).
const EXACT_MAX_CELLS: usize = 4_000_000;

/// A two-sample Kolmogorov-Smirnov test's result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KsTest {
    /// The statistic: the largest distance between the two empirical CDFs.
    pub d: f64,
    /// The two-sided p-value under the null hypothesis that both samples come from one continuous distribution.
    pub p: f64,
    /// The sizes of the two samples.
    pub n: (usize, usize),
    /// Whether `p` is exact (the lattice-path count) rather than asymptotic (Kolmogorov's limit distribution).
    pub exact: bool,
}

/// The two-sample Kolmogorov-Smirnov test of `a` against `b`, as scipy's `ks_2samp` (two-sided): exact p-value
/// when `len(a) * len(b)` is at most a few million, asymptotic above. The exact p-value counts, as scipy does,
/// the monotone lattice paths from `(0, 0)` to `(n, m)` that leave the band `|i/n - j/m| < D`, which assumes no
/// ties; with ties (integer lengths) the test is conservative. `None` when a sample is empty.
pub fn ks_2samp(a: &[f64], b: &[f64]) -> Option<KsTest> {
    let (n, m) = (a.len(), b.len());
    if n == 0 || m == 0 {
        return None;
    }
    let (mut x, mut y) = (a.to_vec(), b.to_vec());
    x.sort_by(f64::total_cmp);
    y.sort_by(f64::total_cmp);
    // The statistic in integer units of 1/(n m): |i m - j n| at every distinct value, after all of its copies.
    let (mut i, mut j, mut dnm) = (0usize, 0usize, 0u128);
    while i < n || j < m {
        let v = match (x.get(i), y.get(j)) {
            (Some(&u), Some(&w)) => u.min(w),
            (Some(&u), None) => u,
            (None, Some(&w)) => w,
            (None, None) => break,
        };
        while x.get(i).is_some_and(|&u| u <= v) {
            i += 1;
        }
        while y.get(j).is_some_and(|&w| w <= v) {
            j += 1;
        }
        dnm = dnm.max(((i * m) as i128 - (j * n) as i128).unsigned_abs());
    }
    let d = dnm as f64 / (n * m) as f64;
    let exact = n.saturating_mul(m) <= EXACT_MAX_CELLS;
    let p = if exact { exact_p(n, m, dnm) } else { kolmogorov_sf(d * ((n * m) as f64 / (n + m) as f64).sqrt()) };
    Some(KsTest { d, p: p.clamp(0.0, 1.0), n: (n, m), exact })
}

/// `P(D >= dnm / (n m))` under the null: one minus the probability that a uniformly random monotone path from
/// `(0, 0)` to `(n, m)` stays strictly inside `|i m - j n| < dnm`. The walk carries probabilities, not counts
/// (the counts overflow past a few hundred samples): from `(i, j)` the next sample is from the first set with
/// probability `(n - i) / (n - i + m - j)`.
fn exact_p(n: usize, m: usize, dnm: u128) -> f64 {
    if dnm == 0 {
        return 1.0;
    }
    let inside = |i: usize, j: usize| ((i * m) as i128 - (j * n) as i128).unsigned_abs() < dnm;
    // row[j]: the probability of reaching (i, j) without leaving the band.
    let mut row = vec![0.0f64; m + 1];
    for i in 0..=n {
        for j in 0..=m {
            let here = if i == 0 && j == 0 {
                1.0
            } else {
                let mut p = 0.0;
                if i > 0 {
                    // `row[j]` still holds (i - 1, j).
                    p += row[j] * (n - (i - 1)) as f64 / ((n - (i - 1)) + (m - j)) as f64;
                }
                if j > 0 {
                    p += row[j - 1] * (m - (j - 1)) as f64 / ((n - i) + (m - (j - 1))) as f64;
                }
                p
            };
            row[j] = if inside(i, j) || (i == n && j == m) { here } else { 0.0 };
        }
    }
    1.0 - row[m]
}

/// Kolmogorov's limit distribution's survival function `P(K > z)` (scipy's `kstwobign.sf`): the alternating
/// series `2 Σ (-1)^(k-1) exp(-2 k² z²)` where it converges fast (z >= 1), the Jacobi-theta form
/// `1 - √(2π)/z Σ exp(-(2k-1)² π² / (8 z²))` below.
pub fn kolmogorov_sf(z: f64) -> f64 {
    if z <= 0.0 {
        return 1.0;
    }
    if z < 1.0 {
        let c = -std::f64::consts::PI * std::f64::consts::PI / (8.0 * z * z);
        let s: f64 = (1..=20).map(|k| ((2 * k - 1) as f64).powi(2)).map(|q| (c * q).exp()).sum();
        return 1.0 - (2.0 * std::f64::consts::PI).sqrt() / z * s;
    }
    let s: f64 = (1..=100)
        .map(|k| {
            let sign = if k % 2 == 1 { 1.0 } else { -1.0 };
            sign * (-2.0 * (k * k) as f64 * z * z).exp()
        })
        .sum();
    (2.0 * s).clamp(0.0, 1.0)
}

/// The comparison of the two runs' response lengths.
#[derive(Debug, Clone, PartialEq)]
pub struct LengthComparison {
    /// Answers compared (the smaller run's count, when they differ).
    pub answers: usize,
    /// Steps compared.
    pub steps: usize,
    /// Whether every answer of every step has the same length in both runs (and both runs have as many).
    pub identical: bool,
    /// Steps where some length differs.
    pub differing_steps: Vec<u64>,
    /// The test over all steps pooled (`None` when identical or a run has no answers).
    pub pooled: Option<KsTest>,
    /// The test at each step: `(step, test)` for the steps that differ.
    pub per_step: Vec<(u64, KsTest)>,
}

impl LengthComparison {
    /// Compares the lengths of `tlt`'s answers with `baseline`'s, step by step, in sample order.
    pub fn new(tlt: &[StepMetrics], baseline: &[StepMetrics]) -> Self {
        let as_f64 = |v: &[usize]| v.iter().map(|&l| l as f64).collect::<Vec<_>>();
        let steps = tlt.len().min(baseline.len());
        let mut differing_steps = Vec::new();
        let mut per_step = Vec::new();
        for (t, b) in tlt.iter().zip(baseline) {
            if t.response_lengths != b.response_lengths {
                differing_steps.push(t.step);
                if let Some(k) = ks_2samp(&as_f64(&t.response_lengths), &as_f64(&b.response_lengths)) {
                    per_step.push((t.step, k));
                }
            }
        }
        let (lt, lb) = (tlt_rl::plot::pooled_lengths(tlt), tlt_rl::plot::pooled_lengths(baseline));
        let identical = differing_steps.is_empty() && tlt.len() == baseline.len() && !lt.is_empty();
        let pooled = if identical { None } else { ks_2samp(&as_f64(&lt), &as_f64(&lb)) };
        Self { answers: lt.len().min(lb.len()), steps, identical, differing_steps, pooled, per_step }
    }

    /// One line for the console and the report.
    pub fn verdict(&self) -> String {
        if self.identical {
            return format!(
                "response lengths: identical ({} answers over {} steps, every length equal in TLT's run and the \
                 baseline's)",
                self.answers, self.steps
            );
        }
        let test = self.pooled.map_or("no answers to test".to_string(), |k| {
            format!(
                "two-sample Kolmogorov-Smirnov over all steps: D = {:.4}, p = {:.4} ({}), n = {} TLT / {} baseline",
                k.d,
                k.p,
                if k.exact { "exact" } else { "asymptotic" },
                k.n.0,
                k.n.1
            )
        });
        format!(
            "response lengths: DIFFER between TLT's run and the baseline's at {} of {} steps; {test}",
            self.differing_steps.len(),
            self.steps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded uniform stream in [0, 1) (splitmix64), so the controls are the same every run.
    fn uniform(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) as f64 / 2f64.powi(64)
            })
            .collect()
    }

    #[test]
    fn exact_p_values_worked_out_by_hand() {
        // Disjoint samples of 3 and 3: D = 1, and only the 2 of the C(6, 3) = 20 orderings that put one sample
        // wholly first reach it (scipy: ks_2samp([1,2,3],[4,5,6]) = (1.0, 0.1)).
        let k = ks_2samp(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]).unwrap();
        assert_eq!((k.d, k.n, k.exact), (1.0, (3, 3), true));
        assert!((k.p - 0.1).abs() < 1e-12, "{k:?}");
        // 4 and 4: 2 / C(8, 4) = 2 / 70 (scipy: 0.028571...).
        let k = ks_2samp(&[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]).unwrap();
        assert!((k.p - 2.0 / 70.0).abs() < 1e-12, "{k:?}");
        // x x y x y y: the CDF gap peaks at 2/3; the orderings that keep every prefix within one of even are the
        // 2^3 = 8 of pairs (xy|yx)^3, so p = 1 - 8/20 = 0.6 (scipy: ks_2samp([.1,.2,.3],[.25,.35,.45]) = (0.667, 0.6)).
        let k = ks_2samp(&[0.1, 0.2, 0.3], &[0.25, 0.35, 0.45]).unwrap();
        assert!((k.d - 2.0 / 3.0).abs() < 1e-12 && (k.p - 0.6).abs() < 1e-12, "{k:?}");
        // Unequal sizes, 1 and 2: D = 1 only when the single x is first or last, 2 of the 3 orderings.
        let k = ks_2samp(&[0.0], &[1.0, 2.0]).unwrap();
        assert!((k.d - 1.0).abs() < 1e-12 && (k.p - 2.0 / 3.0).abs() < 1e-12, "{k:?}");
        // Equal samples: D = 0, p = 1.
        let k = ks_2samp(&[1.0, 2.0], &[2.0, 1.0]).unwrap();
        assert_eq!((k.d, k.p), (0.0, 1.0));
        assert!(ks_2samp(&[], &[1.0]).is_none());
    }

    #[test]
    fn the_exact_walk_matches_brute_force_enumeration() {
        // Every assignment of 7 ranks to two samples of 3 and 4: the share whose D is at least the observed one.
        let (n, m) = (3usize, 4usize);
        let all: Vec<Vec<bool>> = (0u32..1 << (n + m))
            .filter(|b| b.count_ones() as usize == n)
            .map(|b| (0..n + m).map(|k| b >> k & 1 == 1).collect())
            .collect();
        let split = |mask: &[bool]| {
            let a: Vec<f64> = (0..n + m).filter(|&k| mask[k]).map(|k| k as f64).collect();
            let b: Vec<f64> = (0..n + m).filter(|&k| !mask[k]).map(|k| k as f64).collect();
            (a, b)
        };
        for mask in &all {
            let (a, b) = split(mask);
            let k = ks_2samp(&a, &b).unwrap();
            let extreme = all
                .iter()
                .filter(|o| {
                    let (a, b) = split(o);
                    ks_2samp(&a, &b).unwrap().d >= k.d - 1e-12
                })
                .count();
            assert!((k.p - extreme as f64 / all.len() as f64).abs() < 1e-12, "{mask:?}: {k:?}");
        }
    }

    #[test]
    fn the_asymptotic_distribution_at_known_points() {
        // scipy.stats.kstwobign.sf: 0.5 -> 0.963945, 1.0 -> 0.270000, 1.36 -> 0.049486.
        for (z, want) in [(0.5, 0.963_945_2), (1.0, 0.269_999_7), (1.36, 0.049_485_9)] {
            assert!((kolmogorov_sf(z) - want).abs() < 1e-6, "{z}: {}", kolmogorov_sf(z));
        }
        // Both series agree where they meet.
        assert!((kolmogorov_sf(0.999_999) - kolmogorov_sf(1.0)).abs() < 1e-5);
        // Large samples take the asymptotic path; it stays close to the exact one just below the switch.
        let (a, b) = (uniform(1, 3000), uniform(2, 3000));
        assert!(!ks_2samp(&a, &b).unwrap().exact);
        let (a, b) = (uniform(1, 1000), uniform(2, 1000));
        let k = ks_2samp(&a, &b).unwrap();
        assert!(k.exact);
        let asymp = kolmogorov_sf(k.d * (500.0f64).sqrt());
        assert!((k.p - asymp).abs() < 0.02, "{k:?} vs {asymp}");
    }

    #[test]
    fn different_distributions_are_told_apart_and_one_distribution_is_not() {
        let shifted: Vec<f64> = uniform(4, 200).iter().map(|x| x + 0.3).collect();
        let k = ks_2samp(&uniform(3, 200), &shifted).unwrap();
        assert!(k.p < 0.01, "{k:?}");
        let k = ks_2samp(&uniform(3, 200), &uniform(4, 200)).unwrap();
        assert!(k.p > 0.05, "{k:?}");
        // Integer lengths with ties, as the runs' are.
        let lens = |seed, add: f64| uniform(seed, 300).iter().map(|x| (x * 40.0 + add).floor()).collect::<Vec<_>>();
        assert!(ks_2samp(&lens(5, 0.0), &lens(6, 15.0)).unwrap().p < 0.01);
        assert!(ks_2samp(&lens(5, 0.0), &lens(6, 0.0)).unwrap().p > 0.05);
    }

    #[test]
    fn identical_runs_say_so_and_differing_ones_are_tested() {
        let step = |k: u64, lens: Vec<usize>| StepMetrics { step: k, response_lengths: lens, ..StepMetrics::default() };
        let a = vec![step(0, vec![3, 4, 5]), step(1, vec![6, 7])];
        let same = LengthComparison::new(&a, &a.clone());
        assert!(same.identical && same.pooled.is_none() && same.answers == 5);
        assert!(same.verdict().contains("identical (5 answers over 2 steps"), "{}", same.verdict());
        let b = vec![step(0, vec![3, 4, 5]), step(1, vec![60, 70])];
        let diff = LengthComparison::new(&a, &b);
        assert!(!diff.identical && diff.differing_steps == [1] && diff.per_step.len() == 1);
        let v = diff.verdict();
        assert!(v.contains("DIFFER") && v.contains("at 1 of 2 steps") && v.contains("D = 0.4000"), "{v}");
    }
}
