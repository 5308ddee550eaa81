//! The argmax-chain ceiling of a rollout's speculative rounds ([`SdCeiling`]): a plain counter that the rollout
//! fills and the step metrics record. It has a module of its own, below both `trainer` and `metrics`, so that
//! neither imports the other for it.

/// Tokens per verify step of a rollout's speculative rounds beside the **argmax-chain ceiling** of the same
/// rounds: a point-mass draft is accepted with the target's probability of it, so no chain beats drafting the
/// argmax, whose expected tokens per step from a round's first position `t` at depth `k` are
/// `1 + Σ_{i=1..k} Π_{j<i} p_max(t + j)` (read along the committed tokens, from the distribution each was drawn
/// from). A tree of width `w` can beat it by at most the top-`w` mass per node.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SdCeiling {
    /// Speculative request-rounds.
    pub rounds: u64,
    /// Tokens they committed.
    pub tokens: u64,
    /// Sum over those rounds of the ceiling at depth 2, 4 and 6.
    pub ceiling_sums: [f64; 3],
}

/// The depths of [`SdCeiling::ceiling_sums`].
pub const CEILING_DEPTHS: [usize; 3] = [2, 4, 6];

impl SdCeiling {
    /// Adds a finished request's speculative rounds.
    pub fn add(&mut self, p_max: &[f32], sd_rounds: &[(u32, u32)]) {
        for &(start, committed) in sd_rounds {
            self.rounds += 1;
            self.tokens += u64::from(committed);
            for (sum, &k) in self.ceiling_sums.iter_mut().zip(&CEILING_DEPTHS) {
                let (mut prod, mut e) = (1.0f64, 1.0f64);
                for &p in p_max.iter().skip(start as usize).take(k) {
                    prod *= f64::from(p);
                    e += prod;
                }
                *sum += e;
            }
        }
    }

    /// Adds another rollout's rounds.
    pub fn merge(&mut self, other: &SdCeiling) {
        self.rounds += other.rounds;
        self.tokens += other.tokens;
        for (a, b) in self.ceiling_sums.iter_mut().zip(other.ceiling_sums) {
            *a += b;
        }
    }

    /// Committed tokens per speculative request-round (0 without rounds).
    pub fn tokens_per_step(&self) -> f64 {
        self.tokens as f64 / self.rounds.max(1) as f64
    }

    /// The mean ceiling at depth `CEILING_DEPTHS[i]` (0 without rounds).
    pub fn ceiling(&self, i: usize) -> f64 {
        self.ceiling_sums.get(i).map_or(0.0, |s| s / self.rounds.max(1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sd_ceiling_hand_computed() {
        let mut c = SdCeiling::default();
        // Rounds starting at token 1 (committed 2) and token 3 (committed 1).
        c.add(&[0.9, 0.5, 0.8, 0.25, 1.0], &[(1, 2), (3, 1)]);
        assert_eq!((c.rounds, c.tokens), (2, 3));
        assert!((c.tokens_per_step() - 1.5).abs() < 1e-12);
        // Depth 2: 1 + 0.5 + 0.5 * 0.8 = 1.9 and 1 + 0.25 + 0.25 * 1.0 = 1.5.
        assert!((c.ceiling(0) - (1.9 + 1.5) / 2.0).abs() < 1e-6, "{}", c.ceiling(0));
        // Depth 4 runs out of tokens: 1 + 0.5 + 0.4 + 0.1 + 0.1 = 2.1 and 1.5 as above.
        assert!((c.ceiling(1) - (2.1 + 1.5) / 2.0).abs() < 1e-6, "{}", c.ceiling(1));
        let mut d = SdCeiling::default();
        d.merge(&c);
        d.merge(&c);
        assert_eq!((d.rounds, d.tokens), (4, 6));
        assert!((d.ceiling(1) - c.ceiling(1)).abs() < 1e-12);
        assert_eq!(SdCeiling::default().tokens_per_step(), 0.0);
    }
}
