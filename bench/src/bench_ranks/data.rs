//! The records of `cargo xtask bench ranks`: the measured runs, the fits, the comparisons and the predictions that
//! `ranks.json` holds, shared by the suite and its markdown (a module of its own so that neither imports the
//! other).

use serde::Serialize;
use tlt_scheduler::sim::{CostModel, Linear};

use crate::report::Header;

/// One RL step of the trainer's metrics, the fields used.
#[derive(Debug, Clone, Serialize)]
pub struct StepLine {
    /// RL step.
    pub step: u64,
    /// Whole step, seconds.
    pub step_s: f64,
    /// Rollout, slowest rank, seconds.
    pub rollout_s: f64,
    /// Policy update, seconds.
    pub train_s: f64,
    /// Each rank's rollout seconds (one rank: `[rollout_s]`).
    pub rank_rollout_s: Vec<f64>,
    /// Each rank's wait for the slowest (one rank: `[0]`).
    pub rank_idle_s: Vec<f64>,
    /// Every sample's length, group-major.
    #[serde(skip)]
    pub lengths: Vec<usize>,
    /// Per engine round of the logging rank: running requests, seconds, tokens.
    #[serde(skip)]
    pub rounds: Vec<(usize, f64, usize)>,
}

/// One measured run (one JSONL file).
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// File name.
    pub name: String,
    /// The set it belongs to: the name without its `repN` part (repeats of one setup share it).
    pub set: String,
    /// Ranks.
    pub ranks: usize,
    /// Samples per group: samples over (informative + zero-variance groups) of the first step.
    pub group_size: usize,
    /// The batch cap it ran under as far as it mattered: the most requests the logging rank ran at once.
    pub max_running: usize,
    /// `None`: the plain runs; `Some(on)`: a stealing run.
    pub steal: Option<bool>,
    /// The rank whose rounds were logged (the one whose shard's tokens match them).
    pub logging_rank: usize,
    /// Groups stolen per RL step, as the trainer logged them (`stolen_groups`; 0 when absent).
    pub stolen_groups: Vec<u64>,
    /// Per RL step.
    pub steps: Vec<StepLine>,
}

/// A cost model for this CPU fitted on measured rounds.
#[derive(Debug, Clone, Serialize)]
pub struct RoundFit {
    /// What it was fitted on.
    pub label: String,
    /// Files read.
    pub files: Vec<String>,
    /// Rounds fitted.
    pub rounds: usize,
    /// `seconds = fixed_s + per_token_s x running requests`.
    pub line: Linear,
    /// Coefficient of determination of the line over the rounds.
    pub r2: f64,
    /// Root-mean-square error of a round (s).
    pub rmse_s: f64,
    /// Mean round (s).
    pub mean_round_s: f64,
    /// Tokens committed per request-round over the rounds at batch <= the gate threshold (SD on or about to be).
    pub tail_tokens_per_request_round: f64,
    /// Mean of `rollout - sum(round_seconds)` of the logging rank per step (s): prefill and setup.
    pub overhead_s: f64,
}

/// One step of one measured run beside the simulator.
#[derive(Debug, Clone, Serialize)]
pub struct Compared {
    /// The run's file.
    pub run: String,
    /// Its set (repeats of one setup).
    pub set: String,
    /// Ranks.
    pub ranks: usize,
    /// Stealing (`null`: the plain runs).
    pub steal: Option<bool>,
    /// The calibration simulated with.
    pub calibration: String,
    /// RL step.
    pub step: u64,
    /// Measured whole step (s).
    pub measured_step_s: f64,
    /// Measured rollout makespan (s).
    pub measured_rollout_s: f64,
    /// Measured update (s).
    pub measured_train_s: f64,
    /// Measured per-rank rollout (s).
    pub measured_rank_rollout_s: Vec<f64>,
    /// Measured per-rank idle (s).
    pub measured_rank_idle_s: Vec<f64>,
    /// Simulated makespan + overhead (s).
    pub sim_rollout_s: f64,
    /// Simulated per-rank rollout (finish + overhead, s).
    pub sim_rank_rollout_s: Vec<f64>,
    /// Simulated per-rank idle (s).
    pub sim_rank_idle_s: Vec<f64>,
    /// `sim_rollout_s / measured_rollout_s`.
    pub makespan_ratio: f64,
    /// Measured idle over ranks x makespan.
    pub measured_idle_fraction: f64,
    /// Simulated idle over ranks x makespan.
    pub sim_idle_fraction: f64,
    /// Groups the simulator moved by stealing.
    pub sim_stolen_groups: u64,
    /// Groups the trainer logged as stolen.
    pub measured_stolen_groups: u64,
}

/// Idle seconds over ranks x makespan (0 for an empty makespan).
pub fn idle_fraction(idle: &[f64], makespan: f64) -> f64 {
    if makespan > 0.0 {
        idle.iter().sum::<f64>() / (idle.len() as f64 * makespan)
    } else {
        0.0
    }
}

/// The GPU cost model and the roofline points it was fitted on.
#[derive(Debug, Clone, Serialize)]
pub struct GpuCost {
    /// Where the numbers come from.
    pub source: String,
    /// `(batch, predicted decode step s)` at the context.
    pub decode_points: Vec<(f64, f64)>,
    /// `(batch x tree tokens, predicted verify s)`.
    pub verify_points: Vec<(f64, f64)>,
    /// `(batch x top_k, predicted one-layer draft forward s)`.
    pub draft_points: Vec<(f64, f64)>,
    /// The cost model simulated (prefill per token = the verify line's slope).
    pub cost: CostModel,
    /// Largest relative error of each line over its points: decode, verify, draft.
    pub max_rel_err: [f64; 3],
}

/// One PREDICTION row: a cluster size, batch cap, stealing and mode.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    /// Always `"PREDICTION"`: nothing here was measured.
    pub label: &'static str,
    /// GPUs (one simulated worker each).
    pub gpus: usize,
    /// Per-GPU batch cap.
    pub max_running: usize,
    /// Work stealing.
    pub steal: bool,
    /// `Baseline`, `AdaptiveSd` or `AdaptiveSdOnlineDrafter`.
    pub mode: String,
    /// Mean rollout makespan per RL step (s).
    pub makespan_s: f64,
    /// Mean idle fraction.
    pub idle_fraction: f64,
    /// Baseline makespan (same GPUs, cap, stealing) over this one.
    pub speedup_over_baseline: f64,
    /// This mode's makespan without stealing over this one (same GPUs, cap).
    pub speedup_from_stealing: f64,
    /// Group moves by stealing per RL step (a group moved twice counts twice).
    pub stolen_groups: f64,
}

/// The whole `ranks.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Suite, schema version, time, commit, command line and machine.
    #[serde(flatten)]
    pub header: Header,
    /// The measured runs read.
    pub runs: Vec<Run>,
    /// The CPU cost models: 1 rank (2 threads), and 1 thread per rank of 2.
    pub calibrations: Vec<RoundFit>,
    /// Measured beside simulated, per run and RL step.
    pub compared: Vec<Compared>,
    /// The GPU cost model of the predictions.
    pub gpu: GpuCost,
    /// What every prediction shares beyond the cost model.
    pub prediction_settings: String,
    /// PREDICTIONS for GPU clusters.
    pub predictions: Vec<Prediction>,
}
