//! Online calibration of the suffix drafter's empirical probabilities against measured acceptance.
//!
//! A node's empirical probability (the share of a match's occurrences that continue with its path) overstates
//! how often the target accepts it when the siblings were sampled at a high temperature, and a rejected node
//! still costs a verify row. The drafter therefore records, for every node it proposed, whether the engine
//! committed it, binned by the empirical probability, and drafts a node only when the measured acceptance of
//! its bin (shrunk toward the empirical probability while there are few observations) reaches
//! [`SuffixConfig::min_accept`](super::SuffixConfig::min_accept). Outcomes of past rounds decide only which
//! deterministic draft is proposed, never how it is verified, so drafting stays lossless.

use serde::{Deserialize, Serialize};

/// Probability bins of width `1 / BINS`.
const BINS: usize = 10;
/// Pseudo-observations at the empirical probability itself: the estimate moves off it as evidence comes.
const PRIOR: f64 = 20.0;

/// Measured acceptance of proposed nodes per empirical-probability bin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Calibration {
    /// Nodes proposed, per bin `[i / 10, (i + 1) / 10)` (the last bin includes 1).
    pub proposed: [u64; BINS],
    /// Of those, nodes the engine committed.
    pub accepted: [u64; BINS],
}

impl Calibration {
    fn bin(p: f32) -> usize {
        ((p.clamp(0.0, 1.0) * BINS as f32) as usize).min(BINS - 1)
    }

    /// Estimated probability that a node of empirical probability `p` is committed.
    pub fn estimate(&self, p: f32) -> f32 {
        let b = Self::bin(p);
        ((self.accepted[b] as f64 + PRIOR * f64::from(p)) / (self.proposed[b] as f64 + PRIOR)) as f32
    }

    /// Records one proposed node's outcome.
    pub fn record(&mut self, p: f32, accepted: bool) {
        let b = Self::bin(p);
        self.proposed[b] += 1;
        self.accepted[b] += u64::from(accepted);
    }

    /// Overall acceptance of proposed nodes (0 before any).
    pub fn acceptance(&self) -> f64 {
        let p: u64 = self.proposed.iter().sum();
        self.accepted.iter().sum::<u64>() as f64 / p.max(1) as f64
    }
}

/// A proposal awaiting its outcome: per drafted node (tree order, node `i + 1`), its parent node, token and
/// empirical probability.
#[derive(Debug, Clone, Default)]
pub(crate) struct Pending {
    pub(crate) nodes: Vec<(usize, u32, f32)>,
}

impl Pending {
    /// Records into `cal` which nodes `committed` (the tokens the engine committed after this proposal) took.
    pub(crate) fn settle(&self, committed: &[u32], cal: &mut Calibration) {
        let mut on_path = vec![false; self.nodes.len() + 1];
        let mut cur = 0;
        for &tok in committed {
            let Some(i) = self.nodes.iter().position(|&(p, t, _)| p == cur && t == tok) else { break };
            cur = i + 1;
            on_path[cur] = true;
        }
        for (i, &(_, _, p)) in self.nodes.iter().enumerate() {
            cal.record(p, on_path[i + 1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_start_at_the_empirical_probability_and_follow_the_evidence() {
        let mut c = Calibration::default();
        assert!((c.estimate(0.55) - 0.55).abs() < 1e-6);
        for i in 0..200 {
            c.record(0.55, i % 5 == 0); // 20% accepted
        }
        let e = c.estimate(0.55);
        assert!((e - 0.2).abs() < 0.05, "{e}");
        assert!((c.estimate(0.95) - 0.95).abs() < 1e-6, "other bins are untouched");
        assert!((c.acceptance() - 0.2).abs() < 1e-9);
    }

    #[test]
    fn settle_marks_the_committed_path() {
        // root -> a(0.8) -> b(0.6); root -> c(0.2)
        let p = Pending { nodes: vec![(0, 10, 0.8), (1, 11, 0.6), (0, 12, 0.2)] };
        let mut c = Calibration::default();
        p.settle(&[10, 99], &mut c); // a accepted, b rejected (bonus 99), c not taken
        assert_eq!(c.accepted.iter().sum::<u64>(), 1);
        assert_eq!(c.proposed.iter().sum::<u64>(), 3);
        assert_eq!(c.accepted[8], 1);
        let mut c = Calibration::default();
        p.settle(&[12, 5], &mut c);
        assert_eq!(c.accepted[2], 1);
        assert_eq!(c.accepted.iter().sum::<u64>(), 1);
    }
}
