//! A discrete-event simulator of `W` rollout workers decoding a long-tailed length distribution, to compare
//! plain decoding, adaptive SD, and adaptive SD with a drafter trained online on idle workers, at cluster scale
//! without the cluster.
//!
//! Each worker runs the real scheduling logic ([`Rollout`]: continuous batching, [`SdGate`](crate::SdGate),
//! [`BegMab`](crate::BegMab)) on its shard; step times and accept lengths come from a [`CostModel`] and an
//! [`AcceptModel`] (both plain serde structs, meant to be calibrated from measured bench JSON). Events (step
//! completions) are processed in global time order; a worker that finishes is idle until the rollout's
//! makespan, and in the online-drafter mode that idle time trains the drafter, which is fresher for the next RL
//! step (weights are synced at the next rollout, as in fastrl).
//!
//! ```
//! use tlt_scheduler::sim::{simulate, LengthDist, SimConfig};
//! let cfg = SimConfig {
//!     workers: 4,
//!     requests_per_worker: 16,
//!     lengths: LengthDist::LogNormal { median: 200.0, sigma: 1.0, max: 4000 },
//!     rl_steps: 2,
//!     ..SimConfig::default()
//! };
//! let report = simulate(&cfg).unwrap();
//! assert_eq!(report.modes.len(), 3);
//! assert!(report.makespan_ratio_baseline_over_adaptive > 1.0);
//! ```

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use serde::{Deserialize, Serialize};
use tlt_spec_decode::Plan;

use crate::error::{invalid, Error, Result};
use crate::gate::GateConfig;
use crate::rollout::{RequestId, RequestOutcome, Rollout, RolloutConfig, StepOutcome};
use tlt_cudagraph::BucketPolicy;
use tlt_kernels::SplitMix64;

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
    fn validate(&self) -> Result<()> {
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

    fn sample(&self, rng: &mut SplitMix64, i: usize, offset: usize) -> usize {
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
    fn at(&self, tokens: usize) -> f64 {
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
    fn validate(&self) -> Result<()> {
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
    fn validate(&self) -> Result<()> {
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

/// What is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Mode {
    /// Plain decoding throughout.
    Baseline,
    /// SD gate + BEG-MAB, drafter never retrained (it goes stale).
    AdaptiveSd,
    /// SD gate + BEG-MAB, drafter trained on idle workers.
    AdaptiveSdOnlineDrafter,
}

/// Simulator settings; every field has a documented default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimConfig {
    /// Rollout workers (GPUs or DP groups, `>= 1`). Default 8.
    pub workers: usize,
    /// Requests each worker decodes per RL step (`>= 1`). Default 64.
    pub requests_per_worker: usize,
    /// Samples per prompt (GRPO group size, `>= 1`); a worker's requests are submitted as groups. Default 8.
    pub group_size: usize,
    /// Prompt length (tokens). Default 256.
    pub prompt_tokens: usize,
    /// Response lengths. Default lognormal, median 1000, sigma 1.0, max 32768.
    pub lengths: LengthDist,
    /// RL steps simulated (`>= 1`); the drafter's staleness evolves across them. Default 4.
    pub rl_steps: usize,
    /// Each worker's scheduler (batching limits, gate, bandit). Baseline replaces the gate with
    /// [`GateConfig::never`].
    pub rollout: RolloutConfig,
    /// Step times.
    pub cost: CostModel,
    /// Accept lengths.
    pub accept: AcceptModel,
    /// Most idle workers training the drafter at once (`>= 1`). Default `usize::MAX`.
    pub max_trainers: usize,
    /// Seed of lengths, step noise, accept sampling and the bandits. Default 0.
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            requests_per_worker: 64,
            group_size: 8,
            prompt_tokens: 256,
            lengths: LengthDist::LogNormal { median: 1000.0, sigma: 1.0, max: 32768 },
            rl_steps: 4,
            rollout: RolloutConfig::default(),
            cost: CostModel::default(),
            accept: AcceptModel::default(),
            max_trainers: usize::MAX,
            seed: 0,
        }
    }
}

impl SimConfig {
    /// Checks every field and nested config.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] / [`Error::InvalidArm`] naming the field.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("sim.workers", self.workers),
            ("sim.requests_per_worker", self.requests_per_worker),
            ("sim.group_size", self.group_size),
            ("sim.rl_steps", self.rl_steps),
            ("sim.max_trainers", self.max_trainers),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if self.prompt_tokens > self.rollout.step_token_budget {
            return Err(Error::PromptOverBudget {
                prompt_tokens: self.prompt_tokens,
                budget: self.rollout.step_token_budget,
            });
        }
        self.lengths.validate()?;
        self.rollout.validate()?;
        self.cost.validate()?;
        self.accept.validate()
    }
}

/// One RL step's rollout in one mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RlStepReport {
    /// Time until the last worker finished (s).
    pub makespan_s: f64,
    /// Idle worker-time over total worker-time until the makespan.
    pub idle_fraction: f64,
    /// Worker-seconds of drafter training harvested (online mode; 0 otherwise).
    pub harvested_train_s: f64,
    /// Drafter staleness during this step (RL steps).
    pub staleness: f64,
    /// Decode steps summed over workers.
    pub steps: u64,
    /// Of which speculative.
    pub speculative_steps: u64,
    /// Mean tokens committed per request per speculative step (0 without any).
    pub mean_accept_len: f64,
    /// Tokens generated.
    pub tokens: u64,
    /// Finish time of each worker (s).
    pub worker_finish_s: Vec<f64>,
}

/// One mode over all RL steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModeReport {
    /// The mode.
    pub mode: Mode,
    /// Per RL step.
    pub rl_steps: Vec<RlStepReport>,
    /// Sum of makespans (s).
    pub total_makespan_s: f64,
    /// Mean idle fraction.
    pub mean_idle_fraction: f64,
    /// Total harvested drafter-training worker-seconds.
    pub harvested_train_s: f64,
}

/// The comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Workers simulated.
    pub workers: usize,
    /// Requests per RL step, all workers.
    pub requests_per_step: usize,
    /// Baseline, adaptive SD, adaptive SD + online drafter, in that order.
    pub modes: Vec<ModeReport>,
    /// Baseline total makespan / adaptive SD's.
    pub makespan_ratio_baseline_over_adaptive: f64,
    /// Baseline total makespan / adaptive SD + online drafter's.
    pub makespan_ratio_baseline_over_online: f64,
}

/// Runs the three modes on the same length draws and reports them.
///
/// # Errors
/// If `cfg` does not [validate](SimConfig::validate).
pub fn simulate(cfg: &SimConfig) -> Result<SimReport> {
    cfg.validate()?;
    let modes: Vec<ModeReport> = [Mode::Baseline, Mode::AdaptiveSd, Mode::AdaptiveSdOnlineDrafter]
        .into_iter()
        .map(|m| simulate_mode(cfg, m))
        .collect::<Result<_>>()?;
    let ratio = |i: usize| modes[0].total_makespan_s / modes[i].total_makespan_s;
    Ok(SimReport {
        workers: cfg.workers,
        requests_per_step: cfg.workers * cfg.requests_per_worker,
        makespan_ratio_baseline_over_adaptive: ratio(1),
        makespan_ratio_baseline_over_online: ratio(2),
        modes,
    })
}

/// A step completion, ordered so that `BinaryHeap` pops the earliest (ties: lowest worker).
#[derive(Debug, PartialEq)]
struct Ev {
    t: f64,
    worker: usize,
}

impl Eq for Ev {}

impl PartialOrd for Ev {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Ev {
    fn cmp(&self, other: &Self) -> Ordering {
        other.t.total_cmp(&self.t).then_with(|| other.worker.cmp(&self.worker))
    }
}

struct Worker {
    rollout: Rollout,
    target: HashMap<RequestId, usize>,
    generated: HashMap<RequestId, usize>,
    pending: Option<StepOutcome>,
    rng: SplitMix64,
}

fn simulate_mode(cfg: &SimConfig, mode: Mode) -> Result<ModeReport> {
    let root = SplitMix64::new(cfg.seed);
    let mut staleness = cfg.accept.initial_staleness;
    let mut reports = Vec::with_capacity(cfg.rl_steps);
    for step in 0..cfg.rl_steps {
        let r = simulate_rollout(cfg, mode, &root.fork(step as u64), step, staleness)?;
        staleness = match mode {
            Mode::Baseline => staleness,
            Mode::AdaptiveSd => staleness + 1.0,
            Mode::AdaptiveSdOnlineDrafter => {
                (staleness + 1.0 - r.harvested_train_s / cfg.accept.refresh_train_s).max(0.0)
            }
        };
        reports.push(r);
    }
    let total_makespan_s = reports.iter().map(|r| r.makespan_s).sum();
    let mean_idle_fraction = reports.iter().map(|r| r.idle_fraction).sum::<f64>() / reports.len() as f64;
    let harvested_train_s = reports.iter().map(|r| r.harvested_train_s).sum();
    Ok(ModeReport { mode, rl_steps: reports, total_makespan_s, mean_idle_fraction, harvested_train_s })
}

fn simulate_rollout(
    cfg: &SimConfig,
    mode: Mode,
    rng: &SplitMix64,
    step: usize,
    staleness: f64,
) -> Result<RlStepReport> {
    let mut rollout_cfg = cfg.rollout.clone();
    if mode == Mode::Baseline {
        rollout_cfg.gate = GateConfig::never();
    }
    // Same lengths in every mode: the length stream depends on the seed and the RL step only.
    let mut len_rng = rng.fork(1);
    let offset = step * cfg.workers * cfg.requests_per_worker;
    let mut workers = Vec::with_capacity(cfg.workers);
    for w in 0..cfg.workers {
        let mut rc = rollout_cfg.clone();
        rc.mab.seed ^= rng.fork(100 + w as u64).next_u64();
        let mut rollout = Rollout::new(rc)?;
        let mut target = HashMap::new();
        let mut left = cfg.requests_per_worker;
        let mut i = 0;
        while left > 0 {
            let n = left.min(cfg.group_size);
            let lens: Vec<usize> =
                (0..n).map(|k| cfg.lengths.sample(&mut len_rng, w * cfg.requests_per_worker + i + k, offset)).collect();
            let max = lens.iter().copied().max().unwrap_or(1);
            let (_, ids) = rollout.submit_group(cfg.prompt_tokens, n, max)?;
            target.extend(ids.into_iter().zip(lens));
            left -= n;
            i += n;
        }
        workers.push(Worker {
            rollout,
            target,
            generated: HashMap::new(),
            pending: None,
            rng: rng.fork(1000 + w as u64),
        });
    }

    let mut heap = BinaryHeap::new();
    let mut finish = vec![0.0f64; cfg.workers];
    let (mut steps, mut spec_steps, mut spec_tokens, mut spec_reqs, mut tokens) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for (w, wk) in workers.iter_mut().enumerate() {
        if let Some(dt) = plan_step(cfg, wk, staleness)? {
            heap.push(Ev { t: dt, worker: w });
        }
    }
    while let Some(Ev { t, worker }) = heap.pop() {
        let wk = &mut workers[worker];
        let Some(out) = wk.pending.take() else { return Err(Error::Protocol("simulated step without an outcome")) };
        let speculative = wk.rollout.stats().speculative_steps;
        wk.rollout.complete(&out)?;
        let committed: u64 = out.requests.iter().map(|r| r.committed as u64).sum();
        steps += 1;
        tokens += committed;
        if wk.rollout.stats().speculative_steps > speculative {
            spec_steps += 1;
            spec_tokens += committed;
            spec_reqs += out.requests.len() as u64;
        }
        match plan_step(cfg, wk, staleness)? {
            Some(dt) => heap.push(Ev { t: t + dt, worker }),
            None => finish[worker] = t,
        }
    }
    let makespan = finish.iter().copied().fold(0.0, f64::max);
    let idle: f64 = finish.iter().map(|f| makespan - f).sum();
    let idle_fraction = if makespan > 0.0 { idle / (cfg.workers as f64 * makespan) } else { 0.0 };
    let harvested =
        if mode == Mode::AdaptiveSdOnlineDrafter { harvest(&finish, makespan, cfg.max_trainers) } else { 0.0 };
    Ok(RlStepReport {
        makespan_s: makespan,
        idle_fraction,
        harvested_train_s: harvested,
        staleness,
        steps,
        speculative_steps: spec_steps,
        mean_accept_len: if spec_reqs > 0 { spec_tokens as f64 / spec_reqs as f64 } else { 0.0 },
        tokens,
        worker_finish_s: finish,
    })
}

/// Worker-seconds of training: the integral over `[0, makespan]` of `min(finished workers, max_trainers)`.
fn harvest(finish: &[f64], makespan: f64, max_trainers: usize) -> f64 {
    let mut f = finish.to_vec();
    f.sort_by(f64::total_cmp);
    let mut total = 0.0;
    for (i, &t) in f.iter().enumerate() {
        let next = f.get(i + 1).copied().unwrap_or(makespan);
        total += (i + 1).min(max_trainers) as f64 * (next - t);
    }
    total
}

/// Asks the worker's scheduler for its next step, decides what each request commits, and returns the step's
/// duration (`None` when the worker is done).
fn plan_step(cfg: &SimConfig, wk: &mut Worker, staleness: f64) -> Result<Option<f64>> {
    let Some(step) = wk.rollout.next_step()? else { return Ok(None) };
    let plan = step.plan();
    let b = step.running.len();
    let mut dt = cfg.cost.step_seconds(b, plan.as_ref());
    dt += cfg.prompt_tokens as f64 * step.admitted.len() as f64 * cfg.cost.prefill_per_token_s;
    dt *= 1.0 + cfg.cost.noise * (2.0 * wk.rng.next_f64() - 1.0);
    let accept = plan.map(|p| (cfg.accept.accept_len(&p, staleness), p.steps + 1));
    let requests = step
        .running
        .iter()
        .map(|&id| {
            let committed = match accept {
                None => 1,
                Some((a, cap)) => {
                    let base = a.floor();
                    let extra = usize::from(wk.rng.next_f64() < a - base);
                    (base as usize + extra).clamp(1, cap)
                }
            };
            let g = wk.generated.entry(id).or_insert(0);
            let want = wk.target.get(&id).copied().unwrap_or(1);
            let take = committed.min(want - *g);
            *g += take;
            RequestOutcome { id, committed: take.max(1), stopped: *g >= want }
        })
        .collect();
    wk.pending = Some(StepOutcome { seconds: dt.max(f64::MIN_POSITIVE), requests });
    Ok(Some(dt))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SimConfig {
        SimConfig {
            workers: 4,
            requests_per_worker: 16,
            group_size: 4,
            lengths: LengthDist::LogNormal { median: 150.0, sigma: 1.0, max: 3000 },
            rl_steps: 3,
            ..SimConfig::default()
        }
    }

    #[test]
    fn defaults_validate_and_roundtrip() {
        let cfg = SimConfig::default();
        cfg.validate().unwrap();
        let json = serde_json::to_string(&cfg).unwrap();
        assert_eq!(serde_json::from_str::<SimConfig>(&json).unwrap(), cfg);
        assert_eq!(serde_json::from_str::<SimConfig>("{}").unwrap(), cfg);
        let bad = [
            SimConfig { workers: 0, ..small() },
            SimConfig { lengths: LengthDist::Replay { lengths: vec![3, 0] }, ..small() },
            SimConfig { lengths: LengthDist::LogNormal { median: 0.5, sigma: 1.0, max: 9 }, ..small() },
            SimConfig { cost: CostModel { noise: 1.0, ..CostModel::default() }, ..small() },
            SimConfig { accept: AcceptModel { staleness_decay: 0.0, ..AcceptModel::default() }, ..small() },
            SimConfig { prompt_tokens: 1 << 20, ..small() },
        ];
        for b in bad {
            assert!(simulate(&b).is_err(), "{b:?}");
        }
    }

    #[test]
    fn accept_model_interpolates_decays_and_caps() {
        let m = AcceptModel::default();
        let p = |verify_tokens| Plan { steps: 8, top_k: 4, verify_tokens };
        assert!((m.accept_len(&p(8), 0.0) - 2.4).abs() < 1e-12);
        assert!((m.accept_len(&p(24), 0.0) - 3.1).abs() < 1e-12);
        assert!((m.accept_len(&p(100), 0.0) - 3.5).abs() < 1e-12);
        assert!((m.accept_len(&p(4), 0.0) - 2.4).abs() < 1e-12);
        assert!((m.accept_len(&p(48), 2.0) - (1.0 + 2.5 * 0.85 * 0.85)).abs() < 1e-12);
        assert_eq!(m.accept_len(&Plan::chain(1), 0.0), 2.0);
    }

    #[test]
    fn harvest_integrates_idle_workers() {
        assert_eq!(harvest(&[1.0, 2.0, 4.0], 4.0, usize::MAX), 1.0 + 2.0 * 2.0);
        assert_eq!(harvest(&[1.0, 2.0, 4.0], 4.0, 1), 3.0);
        assert_eq!(harvest(&[4.0], 4.0, 1), 0.0);
    }

    #[test]
    fn deterministic_paired_and_sensible() {
        let cfg = small();
        let a = simulate(&cfg).unwrap();
        assert_eq!(a, simulate(&cfg).unwrap(), "seeded runs repeat exactly");
        let [base, sd, online] = [&a.modes[0], &a.modes[1], &a.modes[2]];
        // Same work in every mode.
        for i in 0..cfg.rl_steps {
            assert_eq!(base.rl_steps[i].tokens, sd.rl_steps[i].tokens);
            assert_eq!(base.rl_steps[i].tokens, online.rl_steps[i].tokens);
            assert_eq!(base.rl_steps[i].speculative_steps, 0);
            assert!(sd.rl_steps[i].speculative_steps > 0);
        }
        assert!(a.makespan_ratio_baseline_over_adaptive > 1.0, "{a:#?}");
        // A stale drafter accepts less; the online one stays fresher and is at least as fast.
        assert!(sd.rl_steps[2].mean_accept_len < sd.rl_steps[0].mean_accept_len);
        assert!(online.rl_steps[2].staleness < sd.rl_steps[2].staleness);
        assert!(online.harvested_train_s > 0.0 && sd.harvested_train_s == 0.0);
        assert!(a.makespan_ratio_baseline_over_online >= a.makespan_ratio_baseline_over_adaptive);
        for m in &a.modes {
            for r in &m.rl_steps {
                assert!((0.0..1.0).contains(&r.idle_fraction));
                assert!(r.worker_finish_s.iter().all(|&f| f <= r.makespan_s));
            }
        }
    }

    #[test]
    fn replayed_lengths_are_used_exactly() {
        let cfg = SimConfig {
            workers: 2,
            requests_per_worker: 3,
            group_size: 2,
            lengths: LengthDist::Replay { lengths: vec![5, 10, 100] },
            rl_steps: 1,
            ..SimConfig::default()
        };
        let r = simulate(&cfg).unwrap();
        assert_eq!(r.modes[0].rl_steps[0].tokens, 2 * (5 + 10 + 100));
        // Plain decoding: one step per token of the longest request (100) on each worker.
        assert_eq!(r.modes[0].rl_steps[0].steps, 100 + 100);
    }
}
