//! The simulator's models of the world: response lengths ([`LengthDist`]), step times ([`CostModel`]) and accept
//! lengths ([`AcceptModel`]), plain serde structs meant to be calibrated from measured bench JSON.

use serde::{Deserialize, Serialize};
use tlt_cudagraph::BucketPolicy;
use tlt_kernels::SplitMix64;
use tlt_spec_decode::Plan;

use crate::error::{invalid, Result};

/// Where response lengths come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum LengthDist {
    /// `round(median × exp(sigma × z))`, `z ~ N(0, 1)`, clamped to `1..=max`.
    LogNormal {
        /// Median length (tokens, `>= 1`).
        median: f64,
        /// Log-space standard deviation (`>= 0`); 1.0 puts the 99th percentile near 10x the median.
        sigma: f64,
        /// Clamp (tokens, `>= 1`): the rollout's max response length.
        max: usize,
    },
    /// Lengths replayed from a real rollout, request `i` of a step gets `lengths[(offset + i) % len]`, the
    /// offset moving each RL step.
    Replay {
        /// Recorded lengths (each `>= 1`).
        lengths: Vec<usize>,
    },
}

impl LengthDist {
    pub(super) fn validate(&self) -> Result<()> {
        match self {
            Self::LogNormal { median, sigma, max } => {
                if !(median.is_finite() && *median >= 1.0) {
                    return Err(invalid("sim.lengths.median", format!("{median} is not a finite number >= 1")));
                }
                if !(sigma.is_finite() && *sigma >= 0.0) {
                    return Err(invalid("sim.lengths.sigma", format!("{sigma} is not a finite number >= 0")));
                }
                if *max == 0 {
                    return Err(invalid("sim.lengths.max", "must be at least 1"));
                }
            }
            Self::Replay { lengths } => {
                if lengths.is_empty() || lengths.contains(&0) {
                    return Err(invalid("sim.lengths.lengths", "must be non-empty with every length >= 1"));
                }
            }
        }
        Ok(())
    }

    pub(super) fn sample(&self, rng: &mut SplitMix64, i: usize, offset: usize) -> usize {
        match self {
            Self::LogNormal { median, sigma, max } => {
                let x = (median * (sigma * rng.normal()).exp()).round();
                (x.max(1.0) as usize).min(*max)
            }
            Self::Replay { lengths } => lengths[(offset + i) % lengths.len()],
        }
    }
}

/// `fixed_s + per_token_s × tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Linear {
    /// Seconds per call whatever its size (launch, weights read once).
    pub fixed_s: f64,
    /// Seconds per token processed.
    pub per_token_s: f64,
}

impl Linear {
    /// Seconds of a call over `tokens` tokens.
    pub fn at(&self, tokens: usize) -> f64 {
        self.fixed_s + self.per_token_s * tokens as f64
    }

    fn validate(&self, field: &'static str) -> Result<()> {
        if !(self.fixed_s.is_finite() && self.per_token_s.is_finite() && self.fixed_s >= 0.0 && self.per_token_s >= 0.0)
        {
            return Err(invalid(field, format!("{self:?} must be finite and non-negative")));
        }
        Ok(())
    }
}

/// Step time as a function of batch size and plan. Defaults are illustrative (a memory-bound 7B-class target on
/// one GPU), not measurements: calibrate them from the `decode`, `spec` and `drafter` bench JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    /// Plain decode forward over `b` tokens. Default 20 ms + 0.1 ms/token.
    pub decode: Linear,
    /// Target verify forward over `b × verify_tokens` tokens. Default 22 ms + 0.05 ms/token.
    pub verify: Linear,
    /// One drafter forward over `b × top_k` tokens; an SD round runs `steps` of them (the `steps - 1` tree
    /// levels plus the draft extend over the accepted tokens). Default 2 ms + 0.01 ms/token.
    pub draft: Linear,
    /// Prefill seconds per prompt token admitted in a step. Default 0.02 ms.
    pub prefill_per_token_s: f64,
    /// Captured graph batch sizes: a step's batch is padded up to the next one (larger batches run unpadded),
    /// as the graph pool pads it. Default: SGLang's ladder to 32. Empty: no padding.
    pub graphs: BucketPolicy,
    /// Relative uniform noise on each step time, in `[0, 1)`. Default 0.05.
    pub noise: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            decode: Linear { fixed_s: 0.020, per_token_s: 1e-4 },
            verify: Linear { fixed_s: 0.022, per_token_s: 5e-5 },
            draft: Linear { fixed_s: 0.002, per_token_s: 1e-5 },
            prefill_per_token_s: 2e-5,
            graphs: BucketPolicy::ladder(32),
            noise: 0.05,
        }
    }
}

impl CostModel {
    pub(super) fn validate(&self) -> Result<()> {
        self.decode.validate("sim.cost.decode")?;
        self.verify.validate("sim.cost.verify")?;
        self.draft.validate("sim.cost.draft")?;
        if self.decode.at(1) <= 0.0 || self.verify.at(1) <= 0.0 {
            return Err(invalid("sim.cost", "a decode or verify step must take some time"));
        }
        if !(self.prefill_per_token_s.is_finite() && self.prefill_per_token_s >= 0.0) {
            return Err(invalid("sim.cost.prefill_per_token_s", "must be finite and non-negative"));
        }
        if !self.graphs.batch_sizes.is_empty() && self.graphs.validate().is_err() {
            return Err(invalid("sim.cost.graphs.batch_sizes", "must be strictly ascending sizes >= 1"));
        }
        if !(0.0..1.0).contains(&self.noise) {
            return Err(invalid("sim.cost.noise", format!("{} is not in [0, 1)", self.noise)));
        }
        Ok(())
    }

    /// Seconds of a step over `batch` requests: plain decode, or an SD round under `plan`.
    pub fn step_seconds(&self, batch: usize, plan: Option<&Plan>) -> f64 {
        let b = self.graphs.pad(batch).unwrap_or(batch);
        match plan {
            None => self.decode.at(b),
            Some(p) => p.steps as f64 * self.draft.at(b * p.top_k) + self.verify.at(b * p.verify_tokens),
        }
    }
}

/// One calibration point: the mean tokens committed per request per round with a fresh drafter.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcceptPoint {
    /// Tree size.
    pub verify_tokens: usize,
    /// Accepted drafts + 1 (`>= 1`).
    pub accept_len: f64,
}

/// Accept length as a function of tree size and drafter freshness.
///
/// `accept(T, s) = 1 + (fresh(T) - 1) × staleness_decay^s`, capped at `steps + 1`, where `fresh(T)` is
/// interpolated linearly between the calibration points (clamped outside them) and `s` is the drafter's
/// staleness in RL steps. Without online training `s` grows by one per RL step; with it, the training
/// harvested on idle workers in a step lowers it by `harvested / refresh_train_s` (not below 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AcceptModel {
    /// Fresh-drafter accept lengths, by ascending tree size. Default 8→2.4, 16→2.9, 32→3.3, 48→3.5
    /// (illustrative; calibrate from the `spec` bench).
    pub fresh: Vec<AcceptPoint>,
    /// Per-RL-step decay of the accept gain of a stale drafter, in `(0, 1]`. Default 0.85.
    pub staleness_decay: f64,
    /// Worker-seconds of drafter training that undo one RL step of staleness (`> 0`). Default 30.
    pub refresh_train_s: f64,
    /// Staleness at the first simulated RL step (`>= 0`). Default 0 (just warmed up).
    pub initial_staleness: f64,
}

impl Default for AcceptModel {
    fn default() -> Self {
        let p = |verify_tokens, accept_len| AcceptPoint { verify_tokens, accept_len };
        Self {
            fresh: vec![p(8, 2.4), p(16, 2.9), p(32, 3.3), p(48, 3.5)],
            staleness_decay: 0.85,
            refresh_train_s: 30.0,
            initial_staleness: 0.0,
        }
    }
}

impl AcceptModel {
    pub(super) fn validate(&self) -> Result<()> {
        if self.fresh.is_empty()
            || self.fresh.iter().any(|p| !(p.accept_len.is_finite() && p.accept_len >= 1.0))
            || self.fresh.windows(2).any(|w| w[0].verify_tokens >= w[1].verify_tokens)
        {
            return Err(invalid("sim.accept.fresh", "needs ascending tree sizes with accept_len >= 1"));
        }
        if !(self.staleness_decay > 0.0 && self.staleness_decay <= 1.0) {
            return Err(invalid("sim.accept.staleness_decay", "must be in (0, 1]"));
        }
        if !(self.refresh_train_s.is_finite() && self.refresh_train_s > 0.0) {
            return Err(invalid("sim.accept.refresh_train_s", "must be finite and > 0"));
        }
        if !(self.initial_staleness.is_finite() && self.initial_staleness >= 0.0) {
            return Err(invalid("sim.accept.initial_staleness", "must be finite and >= 0"));
        }
        Ok(())
    }

    /// Mean tokens committed per request per round under `plan` with a drafter `staleness` RL steps old.
    pub fn accept_len(&self, plan: &Plan, staleness: f64) -> f64 {
        let t = plan.verify_tokens;
        let pts = &self.fresh;
        let fresh = match pts.iter().position(|p| p.verify_tokens >= t) {
            None => pts[pts.len() - 1].accept_len,
            Some(0) => pts[0].accept_len,
            Some(i) => {
                let (a, b) = (pts[i - 1], pts[i]);
                let f = (t - a.verify_tokens) as f64 / (b.verify_tokens - a.verify_tokens) as f64;
                a.accept_len + f * (b.accept_len - a.accept_len)
            }
        };
        let gain = (fresh - 1.0) * self.staleness_decay.powf(staleness);
        (1.0 + gain).min(plan.steps as f64 + 1.0)
    }
}
