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
//! With [`SimConfig::steal`] a worker's groups enter its scheduler only as it has room for them (a group is
//! *started* once one of its requests is admitted), and a worker left with nothing to decode asks the other workers
//! one at a time, from the next one on, and the first that has unstarted groups gives it the back half of them
//! (rounded up), as the data-parallel trainer does (`tlt-rl`'s `ask_for_work` and `answer_steals`). The grant is instant here (the trainer answers between rounds), a stolen
//! group's prompt is prefilled by the thief, and a stolen group stays with its thief (the trainer decodes what it
//! stole without granting any of it again).
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
use std::collections::{BinaryHeap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Error, Result};
use crate::gate::GateConfig;
use crate::rollout::{RequestId, RequestOutcome, Rollout, RolloutConfig, StepOutcome};
use tlt_kernels::SplitMix64;

mod model;
#[cfg(test)]
mod tests;

pub use model::{AcceptModel, AcceptPoint, CostModel, LengthDist, Linear};

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
    /// Work stealing between workers (see the [module docs](self)). Default `false`: every group is submitted
    /// to its worker's scheduler at the start, as before this option existed.
    pub steal: bool,
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
            steal: false,
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
    /// Groups moved by stealing, all thieves (a group moved twice counts twice; 0 without
    /// [`SimConfig::steal`]).
    #[serde(default)]
    pub stolen_groups: u64,
    /// Requests finished, all workers (every submitted request, stolen or not, exactly once).
    #[serde(default)]
    pub requests_finished: u64,
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
    /// Groups (their requests' lengths) not yet submitted to `rollout` (only with stealing).
    held: VecDeque<Vec<usize>>,
    /// Groups it stole and has not yet submitted: never granted again.
    stolen: VecDeque<Vec<usize>>,
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
        let mut held = VecDeque::new();
        let mut left = cfg.requests_per_worker;
        let mut i = 0;
        while left > 0 {
            let n = left.min(cfg.group_size);
            let lens: Vec<usize> =
                (0..n).map(|k| cfg.lengths.sample(&mut len_rng, w * cfg.requests_per_worker + i + k, offset)).collect();
            if cfg.steal {
                held.push_back(lens);
            } else {
                submit(&mut rollout, &mut target, cfg.prompt_tokens, lens)?;
            }
            left -= n;
            i += n;
        }
        workers.push(Worker {
            rollout,
            held,
            stolen: VecDeque::new(),
            target,
            generated: HashMap::new(),
            pending: None,
            rng: rng.fork(1000 + w as u64),
        });
    }

    let mut heap = BinaryHeap::new();
    let mut finish = vec![0.0f64; cfg.workers];
    let (mut steps, mut spec_steps, mut spec_tokens, mut spec_reqs, mut tokens) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut stolen = 0u64;
    for w in 0..cfg.workers {
        if let Some(dt) = next_or_steal(cfg, &mut workers, w, staleness, &mut stolen)? {
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
        match next_or_steal(cfg, &mut workers, worker, staleness, &mut stolen)? {
            Some(dt) => heap.push(Ev { t: t + dt, worker }),
            None => finish[worker] = t,
        }
    }
    let requests_finished = workers.iter().map(|w| w.rollout.stats().finished).sum();
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
        stolen_groups: stolen,
        requests_finished,
    })
}

/// Queues a group of requests with lengths `lens` on a worker's scheduler.
fn submit(
    rollout: &mut Rollout,
    target: &mut HashMap<RequestId, usize>,
    prompt: usize,
    lens: Vec<usize>,
) -> Result<()> {
    let max = lens.iter().copied().max().unwrap_or(1);
    let (_, ids) = rollout.submit_group(prompt, lens.len(), max)?;
    target.extend(ids.into_iter().zip(lens));
    Ok(())
}

/// The worker's next step; a worker with nothing left first steals (with [`SimConfig::steal`]): the first other
/// worker from the next one on that has unstarted groups gives it the back half of them, rounded up. `None`: nothing
/// to decode or steal.
fn next_or_steal(
    cfg: &SimConfig,
    workers: &mut [Worker],
    w: usize,
    staleness: f64,
    stolen: &mut u64,
) -> Result<Option<f64>> {
    if let Some(dt) = plan_step(cfg, &mut workers[w], staleness)? {
        return Ok(Some(dt));
    }
    if !cfg.steal {
        return Ok(None);
    }
    let n = workers.len();
    let Some(v) = (1..n).map(|k| (w + k) % n).find(|&v| !workers[v].held.is_empty()) else {
        return Ok(None);
    };
    let victim = &mut workers[v].held;
    let granted = victim.split_off(victim.len() - victim.len().div_ceil(2));
    *stolen += granted.len() as u64;
    workers[w].stolen = granted;
    plan_step(cfg, &mut workers[w], staleness)
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
    // Held groups enter as the scheduler has room: then it admits exactly what it would with all of them queued.
    while wk.rollout.waiting() + wk.rollout.running().len() < cfg.rollout.max_running {
        let Some(lens) = wk.held.pop_front().or_else(|| wk.stolen.pop_front()) else { break };
        submit(&mut wk.rollout, &mut wk.target, cfg.prompt_tokens, lens)?;
    }
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
