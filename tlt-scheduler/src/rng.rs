//! A tiny seeded generator (SplitMix64): stable across platforms and crate versions, so seeded tests and
//! simulations reproduce bit for bit.

/// SplitMix64 (Steele, Lea, Flood 2014): 64-bit state, full period, passes BigCrush when used as here.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed` (every seed is fine, including 0).
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n >= 1`; returns 0 for `n == 0`). Lemire's multiply-shift, bias below 2^-64 * n.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// A standard normal sample (Box-Muller, one of the pair).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A derived, independent-looking generator for sub-stream `k` (workers, modes...).
    pub fn fork(&self, k: u64) -> Self {
        let mut g = Self::new(self.state ^ k.wrapping_mul(0xD1B5_4A32_D192_ED03));
        g.next_u64();
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_and_normal_moments() {
        let mut r = SplitMix64::new(7);
        let n = 200_000;
        let (mut s, mut s2, mut u) = (0.0, 0.0, 0.0);
        for _ in 0..n {
            let z = r.normal();
            s += z;
            s2 += z * z;
            u += r.next_f64();
        }
        let n = n as f64;
        assert!((s / n).abs() < 0.01);
        assert!((s2 / n - 1.0).abs() < 0.02);
        assert!((u / n - 0.5).abs() < 0.01);
        let mut counts = [0usize; 3];
        for _ in 0..30_000 {
            counts[r.below(3)] += 1;
        }
        assert!(counts.iter().all(|&c| (9_000..11_000).contains(&c)), "{counts:?}");
        assert_eq!(SplitMix64::new(1).next_u64(), SplitMix64::new(1).next_u64());
    }
}
