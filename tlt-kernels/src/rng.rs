//! The workspace's seeded generators, stable across platforms and crate versions so seeded tests, task
//! generators and simulations reproduce bit for bit: [`SplitMix64`] (tiny, for task data, bandits and
//! simulators) and [`SeededRng`] (xoshiro256**, seeded through SplitMix64, with per-sequence streams, for
//! sampling).

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
        splitmix64(&mut self.state)
    }

    /// The whole state: `SplitMix64::new(g.state())` continues exactly where `g` is (checkpoints).
    pub fn state(&self) -> u64 {
        self.state
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

/// A small, fast, deterministic RNG: xoshiro256** seeded through SplitMix64. Not cryptographic.
///
/// ```
/// use tlt_kernels::SeededRng;
///
/// let root = SeededRng::new(42);
/// let (mut a, mut b) = (root.fork(0), root.fork(1));
/// assert_ne!(a.next_u64(), b.next_u64());
/// let u = SeededRng::new(7).uniform();
/// assert!((0.0..1.0).contains(&u));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeededRng {
    s: [u64; 4],
}

/// One SplitMix64 step: advances `state` and returns a well-mixed output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SeededRng {
    /// A generator whose whole stream is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut s = [0u64; 4];
        for w in &mut s {
            *w = splitmix64(&mut sm);
        }
        if s == [0; 4] {
            s[0] = 1; // The all-zero state is a fixed point of xoshiro.
        }
        Self { s }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// A uniform f64 in `[0, 1)` with 53 random bits.
    #[inline]
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// `n` values uniform in `[low, high)` (test data, random initialisation).
    pub fn uniform_vec(&mut self, n: usize, low: f32, high: f32) -> Vec<f32> {
        (0..n).map(|_| low + (high - low) * self.uniform() as f32).collect()
    }

    /// An independent generator for sub-stream `stream` (e.g. a sequence id), derived from the current state
    /// without advancing it: the same parent state and stream always give the same child.
    pub fn fork(&self, stream: u64) -> SeededRng {
        let mut sm = stream ^ 0xD1B5_4A32_D192_ED03;
        let salt = splitmix64(&mut sm);
        let mix = self.s[0] ^ self.s[1].rotate_left(16) ^ self.s[2].rotate_left(32) ^ self.s[3].rotate_left(48);
        let mut seed = mix ^ salt;
        let mut s = [0u64; 4];
        for (w, own) in s.iter_mut().zip(self.s) {
            *w = splitmix64(&mut seed) ^ own.rotate_left(23);
        }
        if s == [0; 4] {
            s[0] = 1;
        }
        SeededRng { s }
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
