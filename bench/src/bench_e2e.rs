//! `cargo xtask bench e2e`: the reference trainer end to end, TLT against the baseline with the same config and
//! seeds in one run (the `train` example's `--mode compare`), reported per step: total and rollout seconds,
//! speedups, accept length, idle fraction, SD on-fraction, reward.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use tlt_rl::metrics::StepMetrics;
use tlt_rl::runner::Comparison;

use crate::report::{self, Header};

/// Options of the `e2e` suite.
#[derive(Debug, Clone, Args)]
pub struct E2eArgs {
    /// A run config (default: the embedded demo config of the `train` example).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override the number of RL steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Where the rollouts run: `cpu`, or `cuda[:N]` (the `train` example built with `--features cuda`, NVRTC from
    /// the pinned wheel).
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// One step of both runs side by side.
#[derive(Debug, Clone, Serialize)]
pub struct StepRow {
    /// RL step.
    pub step: u64,
    /// TLT step seconds.
    pub tlt_step_s: f64,
    /// Baseline step seconds.
    pub baseline_step_s: f64,
    /// TLT rollout seconds.
    pub tlt_rollout_s: f64,
    /// Baseline rollout seconds.
    pub baseline_rollout_s: f64,
    /// Baseline / TLT rollout seconds.
    pub rollout_speedup: f64,
    /// Baseline / TLT step seconds.
    pub step_speedup: f64,
    /// TLT mean accept length over speculative rounds.
    pub accept_len: f64,
    /// TLT fraction of speculative rounds.
    pub sd_on_fraction: f64,
    /// Idle fraction (TLT, baseline).
    pub idle_fraction: [f64; 2],
    /// Mean reward (TLT, baseline).
    pub reward: [f64; 2],
    /// Drafter weights version at the end of the TLT step.
    pub drafter_version: u64,
}

/// `target/bench/e2e.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Suite, schema, time, commit, command line, machine.
    #[serde(flatten)]
    pub header: Header,
    /// Baseline / TLT rollout seconds over all steps.
    pub rollout_speedup: f64,
    /// Baseline / TLT step seconds over all steps.
    pub e2e_speedup: f64,
    /// The end-to-end speed-up Amdahl's law allows from the baseline's rollout share and the measured rollout
    /// speed-up, `1 / ((1 - R) + R / S)`.
    pub amdahl_bound: f64,
    /// Per step.
    pub steps: Vec<StepRow>,
    /// Both runs in full.
    pub comparison: Comparison,
}

fn row(t: &StepMetrics, b: &StepMetrics) -> StepRow {
    StepRow {
        step: t.step,
        tlt_step_s: t.step_s,
        baseline_step_s: b.step_s,
        tlt_rollout_s: t.rollout_s,
        baseline_rollout_s: b.rollout_s,
        rollout_speedup: b.rollout_s / t.rollout_s.max(1e-9),
        step_speedup: b.step_s / t.step_s.max(1e-9),
        accept_len: t.accept_len,
        sd_on_fraction: t.sd_on_fraction,
        idle_fraction: [t.idle_fraction, b.idle_fraction],
        reward: [t.reward_mean, b.reward_mean],
        drafter_version: t.drafter_version,
    }
}

/// Runs the suite.
pub fn run(args: &E2eArgs) -> Result<()> {
    let gguf = crate::env::smollm2_gguf()?;
    let out = crate::env::workspace_root().join("target").join("bench").join("e2e-run");
    let cuda = crate::bench_gpu::is_cuda(&args.device)?;
    let mut cmd = crate::env::cargo();
    cmd.args(["run", "--release", "-p", "tlt-examples", "--bin", "train"]);
    if cuda {
        // NVRTC: on the library path `cargo xtask` gives us for a CUDA device.
        cmd.args(["--features", "cuda"]);
    }
    cmd.args(["--", "--mode", "compare", "--device", &args.device, "--model"])
        .arg(&gguf)
        .arg("--out")
        .arg(&out)
        .current_dir(crate::env::workspace_root());
    if let Some(c) = &args.config {
        cmd.arg("--config").arg(c);
    }
    if let Some(s) = args.steps {
        cmd.arg("--steps").arg(s.to_string());
    }
    let _ = std::fs::remove_dir_all(&out);
    let status = crate::env::run(cmd)?;
    anyhow::ensure!(status.success(), "the train example failed: {status}");
    let summary = out.join("summary.json");
    let text = std::fs::read_to_string(&summary).with_context(|| format!("reading {}", summary.display()))?;
    let comparison: Comparison = serde_json::from_str(&text)?;
    let steps = comparison.tlt.metrics.iter().zip(&comparison.baseline.metrics).map(|(t, b)| row(t, b)).collect();
    let machine = crate::sysinfo::MachineInfo::collect();
    let timestamp = crate::sysinfo::utc_timestamp();
    let report = Report {
        header: Header::new("e2e", 1, timestamp, machine),
        rollout_speedup: comparison.rollout_speedup,
        e2e_speedup: comparison.e2e_speedup,
        amdahl_bound: comparison.amdahl_bound,
        steps,
        comparison,
    };
    report::write_outputs("e2e", &report, &markdown(&report))
}

fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# e2e: GRPO with TLT rollouts vs plain rollouts (SmolLM2-135M, CPU)\n\n{} ({} threads); commit {}; {}\n\n\
         **Rollout speedup {:.2}x, end-to-end {:.2}x** (baseline seconds / TLT seconds over all steps; Amdahl's \
         bound from the measured split {:.2}x).\n\n{}\n\
         | step | TLT step s | baseline step s | TLT rollout s | baseline rollout s | rollout x | step x | accept len | SD on | idle TLT/base | reward TLT/base | drafter v |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        r.header.machine.cpu_model,
        r.header.machine.candle_threads,
        r.header.git_commit,
        r.header.timestamp,
        r.rollout_speedup,
        r.e2e_speedup,
        r.amdahl_bound,
        r.comparison.report().replace('\n', "\n\n"),
    );
    for x in &r.steps {
        s.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}/{:.2} | {:.3}/{:.3} | {} |\n",
            x.step,
            x.tlt_step_s,
            x.baseline_step_s,
            x.tlt_rollout_s,
            x.baseline_rollout_s,
            x.rollout_speedup,
            x.step_speedup,
            x.accept_len,
            x.sd_on_fraction,
            x.idle_fraction[0],
            x.idle_fraction[1],
            x.reward[0],
            x.reward[1],
            x.drafter_version,
        ));
    }
    s
}
