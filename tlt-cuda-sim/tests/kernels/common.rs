//! Helpers of the simulated-kernel tests: seeded data, bf16 conversions, the two interleavings, comparisons.
#![allow(dead_code, clippy::unwrap_used)] // Each test module uses a subset; a panic is the failure report.

use half::bf16;
use tlt_cuda_sim::SimDevice;
use tlt_kernels::SplitMix64;

/// A seeded generator.
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.0.next_f64() as f32
    }

    /// `n` uniform values in `[lo, hi)`.
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0.below(n)
    }

    /// Uniform in `[0, 1)`.
    pub fn coin(&mut self) -> f64 {
        self.0.next_f64()
    }
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// `v` rounded through bf16 (what a bf16 buffer holds).
pub fn round_bf16(v: &[f32]) -> Vec<f32> {
    to_f32(&to_bf16(v))
}

/// `dev` and its reversed interleaving, sharing buffers and the launch record: every kernel must give the same
/// results under both.
pub fn variants(dev: &SimDevice) -> [(&'static str, SimDevice); 2] {
    [("forward", dev.clone()), ("reverse", dev.reversed())]
}

/// The largest `|got - want|` relative to `scale(want)`, with its index; `(0, 0)` for empty slices.
pub fn worst(got: &[f32], want: &[f32], scale: impl Fn(usize, f32) -> f32) -> (f32, usize) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let mut w = (0f32, 0usize);
    for (i, (&g, &x)) in got.iter().zip(want).enumerate() {
        let e = if g == x { 0.0 } else { (g - x).abs() / scale(i, x) };
        let e = if e.is_nan() { f32::INFINITY } else { e };
        if e > w.0 {
            w = (e, i);
        }
    }
    w
}

/// One bf16 unit in the last place at the magnitude of `x` (2^-7 relative, at least that of `floor`).
pub fn bf16_ulp(x: f32, floor: f32) -> f32 {
    x.abs().max(floor) * 2f32.powi(-7)
}
