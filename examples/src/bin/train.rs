//! The reference TLT trainer: GRPO on a reasoning task with adaptive speculative rollouts and an online
//! drafter, configured by TOML (the embedded `configs/demo.toml` by default) and this CLI.
//!
//! ```text
//! cargo run --release -p tlt-examples --bin train -- --mode compare --out target/demo
//! cargo run --release -p tlt-examples --bin train -- --config my.toml --mode tlt --out runs/a --resume
//! ```
//!
//! Each run directory gets `metrics.jsonl` (one line per step), `run.json` (the task's data and scoring, which a
//! resume must match unless `--allow-changed-task`), `checkpoint/` (crash-consistent: a kill at any point leaves
//! the previous or the new checkpoint, recovered at `--resume`; `--resume` continues from it bit for bit and is an
//! error without one unless `--allow-fresh`), `plots/` (PNG + SVG) and `export/`: the RL-trained policy as a Hugging Face directory
//! (`policy/`) and its drafter in the EAGLE format SGLang and vLLM serve (`drafter/`), with `SERVE.md` giving
//! both engines' command lines (`--export-at-checkpoints` adds `exports/step-<n>/` at every checkpoint). `--mode compare` runs TLT and the baseline with the same seeds,
//! both in this process, step by step (a drift of the machine falls on both), or with `--sequential` one after
//! the other, each in a fresh process of this binary (both pay the same first-update warm-up of a new process, and
//! only one trainer's memory is resident at a time), and prints the report `cargo xtask demo` shows (reward
//! before/after, step-time split, TLT speed-up, peak memory), the per-step summary of `tlt_examples::compare`
//! (also in `<out>/summary.txt`) and the two runs' response-length test (`tlt_examples::lengths`); the same on one
//! page, `<out>/report.html`, with the charts of `<out>/plots/`. Progress shows as one bar per run on a terminal
//! (`--progress`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use tlt_examples::default_model;
use tlt_examples::progress::{rss_gb, Progress, ProgressMode};
use tlt_examples::report::Schedule;
use tlt_rl::runner::{run, run_interleaved, text_env, Comparison, RunConfig, RunDir, RunOutcome};
use tlt_rl::trainer::{Mode, TextEnv, Trainer, TrainerConfig, SERVE_FILE};

/// The ranks' wait limits of this process (`--rank-wait-s`, `--rank-silence-s`), set once from the command line.
static DEADLINES: std::sync::OnceLock<tlt_comm::Deadlines> = std::sync::OnceLock::new();

/// The embedded default configuration.
const DEMO_CONFIG: &str = include_str!("../../configs/demo.toml");

/// Where a single-mode run leaves its [`RunOutcome`] (JSON) for `--mode compare`.
const OUTCOME_FILE: &str = "outcome.json";

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RunMode {
    /// TLT rollouts (SD gate + bandit + online drafter).
    Tlt,
    /// Plain rollouts.
    Baseline,
    /// TLT and the baseline with the same seeds (step by step in this process; `--sequential`: one after the
    /// other, each in its own process), and the comparison report.
    Compare,
}

/// Command-line arguments (they override the config file).
#[derive(Debug, Parser)]
#[command(about = "GRPO training with TLT rollouts (adaptive speculative decoding + online drafter)")]
struct Args {
    /// A TOML run config (default: the embedded `configs/demo.toml`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// A `.gguf` file or an HF checkpoint directory (default: the cached SmolLM2-135M-Instruct GGUF).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Output directory (one subdirectory per mode).
    #[arg(long, default_value = "target/tlt-train")]
    out: PathBuf,
    /// Which run(s).
    #[arg(long, value_enum, default_value_t = RunMode::Tlt)]
    mode: RunMode,
    /// Override the number of RL steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Where rollouts run (config: `[trainer] device`): `cpu`, or `cuda[:N]` in a build with `--features cuda`
    /// (the engine, the EAGLE drafter's forward and the policy update on the GPU; drafter training on the CPU; this
    /// version has not run on a GPU: the first GPU run's rollouts failed, fixed since on the simulated device).
    #[arg(long)]
    device: Option<tlt_model::Device>,
    /// Continue from `<out>/<mode>/checkpoint` (after recovering it from an interrupted write); an error where there
    /// is none, unless `--allow-fresh`.
    #[arg(long)]
    resume: bool,
    /// With `--resume`: start a fresh run where no checkpoint exists.
    #[arg(long, requires = "resume")]
    allow_fresh: bool,
    /// With `--resume`: resume even though the task's data or scoring (`run.json`: task, seed, JSONL file and its
    /// bytes, held-out split, rewards, evaluation prompts) changed since the run started (default: an error listing
    /// the changes).
    #[arg(long, requires = "resume")]
    allow_changed_task: bool,
    /// Also export the policy and drafter at every checkpoint (`<out>/<mode>/exports/step-<n>`), not only at the
    /// end (config: `[export] at_checkpoints = true`).
    #[arg(long)]
    export_at_checkpoints: bool,
    /// Write no export (config: `[export] at_end = false`).
    #[arg(long, conflicts_with = "export_at_checkpoints")]
    no_export: bool,
    /// Print the effective config as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// One drafter kind for TLT's rollouts (`hybrid`, `eagle2`, `suffix`, `ngram`), replacing the config's
    /// `[trainer.sd] drafter` and `drafters`.
    #[arg(long)]
    drafter: Option<String>,
    /// Data-parallel ranks: runs this program again as that many MPI processes (`mpirun -np N`; needs a build
    /// with `--features mpi`). Launching it with `mpirun -np N` directly does the same.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// With several ranks: the longest a rank waits for the others in one operation (a collective, a message, the
    /// end of their rollouts) before the job ends with an error naming them, seconds.
    #[arg(long, default_value_t = 1800.0)]
    rank_wait_s: f64,
    /// With several ranks: a rank that leaves a liveness check unanswered this long (stopped, dead or hung) ends
    /// the job with an error naming it, seconds.
    #[arg(long, default_value_t = 60.0)]
    rank_silence_s: f64,
    /// `--mode compare` only, and its default with one rank (the flag is kept for older command lines): both
    /// trainers in this process, their steps interleaved (the order alternating from step to step): a drift of
    /// the machine over time biases neither run. Both trainers are resident at once (about twice the memory).
    #[arg(long)]
    interleave: bool,
    /// `--mode compare` only: TLT's run, then the baseline's, each in a fresh process of this binary (one trainer
    /// resident at a time; the default with several ranks).
    #[arg(long, conflicts_with = "interleave")]
    sequential: bool,
    /// Progress: `bars` (one per run, with the phase, elapsed time and time left), `plain` (log lines only), or
    /// `auto`: bars when stderr is a terminal.
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    progress: ProgressMode,
}

fn load_config(args: &Args) -> Result<RunConfig> {
    let text = match &args.config {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        None => DEMO_CONFIG.to_string(),
    };
    let mut cfg = RunConfig::from_toml(&text)?;
    if let Some(device) = args.device {
        cfg.trainer.device = device;
    }
    if let Some(steps) = args.steps {
        cfg.trainer.steps = steps;
    }
    if args.export_at_checkpoints {
        cfg.export.at_checkpoints = true;
    }
    if let Some(kind) = &args.drafter {
        cfg.trainer.sd.drafter = toml::Value::String(kind.clone())
            .try_into()
            .with_context(|| format!("--drafter {kind}: expected hybrid, eagle2, suffix or ngram"))?;
        cfg.trainer.sd.drafters.clear();
    }
    if args.no_export {
        cfg.export.at_end = false;
        cfg.export.at_checkpoints = false;
    }
    cfg.trainer.validate()?;
    Ok(cfg)
}

/// What `--resume` (and `--allow-fresh`) ask of a run directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resume {
    /// A fresh run.
    No,
    /// Continue from the checkpoint; none is an error.
    Required,
    /// Continue from the checkpoint, or start fresh where there is none.
    OrFresh,
}

impl Resume {
    fn of(args: &Args) -> Self {
        match (args.resume, args.allow_fresh) {
            (false, _) => Self::No,
            (true, false) => Self::Required,
            (true, true) => Self::OrFresh,
        }
    }

    /// The flags that ask for it (a child process's command line).
    fn flags(self) -> &'static [&'static str] {
        match self {
            Self::No => &[],
            Self::Required => &["--resume"],
            Self::OrFresh => &["--resume", "--allow-fresh"],
        }
    }

    /// Whether `dir` resumes: its checkpoint recovered from an interrupted write first; an error when `--resume`
    /// finds none without `--allow-fresh` (a fresh run there would truncate its metrics).
    fn resumes(self, dir: &RunDir) -> Result<bool> {
        Ok(match self {
            Self::No => false,
            _ if dir.recover_checkpoint()? => true,
            Self::OrFresh => false,
            Self::Required => anyhow::bail!(
                "--resume: no checkpoint in {} (pass --allow-fresh to start a fresh run there)",
                dir.checkpoint().display()
            ),
        })
    }
}

/// A trainer for `mode` in `dir` (resumed from its checkpoint when asked), one rank of this process's job.
fn trainer(model_path: &Path, cfg: &RunConfig, mode: Mode, dir: &RunDir, resume: Resume) -> Result<Trainer<TextEnv>> {
    // Before anything is loaded: `--resume` without a checkpoint fails at once.
    let resuming = resume.resumes(dir)?;
    let comm = tlt_examples::ranks::communicator(DEADLINES.get().copied().unwrap_or_default())?;
    let loaded = tlt_model::load(model_path).with_context(|| format!("loading {}", model_path.display()))?;
    let tokenizer = loaded.tokenizer.context("the checkpoint carries no tokenizer")?;
    let env = text_env(&cfg.task, tokenizer, loaded.chat_template.as_deref())?;
    let tcfg = TrainerConfig { mode, ..cfg.trainer.clone() };
    let t = if resuming {
        tracing::info!(checkpoint = %dir.checkpoint().display(), "resuming");
        Trainer::resume(&dir.checkpoint(), loaded.model, env, tcfg)?
    } else {
        Trainer::new(loaded.model, env, tcfg)?
    };
    if let Some(plan) = t.device_memory_plan() {
        // Checked against the device before the first rollout; printed here, before anything is allocated.
        eprintln!("{} device memory plan ({}):\n{plan}", label(mode), t.config().device);
    }
    Ok(t.with_comm(comm)?)
}

fn label(mode: Mode) -> &'static str {
    if mode == Mode::Tlt {
        "TLT"
    } else {
        "baseline"
    }
}

/// Stops the trainer's workers and writes its plots.
fn finish(t: Trainer<TextEnv>, out: &RunOutcome, dir: &RunDir) -> Result<()> {
    let mode = t.config().mode;
    let rank = t.rank();
    t.shutdown()?;
    if rank > 0 {
        return Ok(());
    }
    let plots = tlt_rl::plot::training_plots(&out.metrics, None, &dir.plots())?;
    tracing::info!(run = label(mode), plots = plots.len(), dir = %dir.0.display(), "run finished");
    if let Some(e) = &out.export {
        println!("{} export (policy + drafter, how to serve them): {}", label(mode), e.join(SERVE_FILE).display());
    }
    Ok(())
}

/// One run in `dir`; its outcome, with this process's peak memory, also goes to `<dir>/outcome.json`.
fn run_mode(
    model_path: &Path,
    cfg: &RunConfig,
    mode: Mode,
    dir: &Path,
    resume: Resume,
    progress: ProgressMode,
) -> Result<RunOutcome> {
    let dir = RunDir(dir.to_path_buf());
    let mut t = trainer(model_path, cfg, mode, &dir, resume)?;
    let rank = t.rank();
    // One bar per job: the other ranks log only.
    let progress = if rank == 0 { progress } else { ProgressMode::Plain };
    let mut bar = Progress::new(label(mode), cfg.trainer.steps, progress);
    let mut out = run(&mut t, cfg, &dir, &mut bar)?;
    drop(bar);
    finish(t, &out, &dir)?;
    out.peak_rss_gb = peak_rss_gb();
    if rank == 0 {
        std::fs::write(dir.0.join(OUTCOME_FILE), serde_json::to_string_pretty(&out)?)?;
    }
    Ok(out)
}

/// TLT, then the baseline, each in a fresh process of this binary with the same (effective) config: the runs see
/// the same process warm-up (allocator growth and page faults made the first update of a process 27-89% slower
/// than later ones on the 2-vCPU VM), and one trainer is resident at a time.
fn compare(
    model_path: &Path,
    cfg: &RunConfig,
    out: &Path,
    resume: Resume,
    ranks: usize,
    drafter: Option<&str>,
    progress: ProgressMode,
) -> Result<Comparison> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let config = out.join("config.toml");
    std::fs::write(&config, toml::to_string_pretty(cfg)?)?;
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut outcomes = Vec::with_capacity(2);
    for mode in ["tlt", "baseline"] {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["--mode", mode, "--config"]).arg(&config).arg("--model").arg(model_path).arg("--out").arg(out);
        cmd.args(resume.flags());
        if cfg.allow_changed_task {
            cmd.arg("--allow-changed-task");
        }
        cmd.args(["--ranks", &ranks.to_string()]);
        // Decided here, where stderr is the user's: the child's stderr is the same, but say it explicitly.
        cmd.args(["--progress", if progress.bars() { "bars" } else { "plain" }]);
        if let Some(d) = DEADLINES.get() {
            cmd.args(["--rank-wait-s", &d.wait.as_secs_f64().to_string()]);
            cmd.args(["--rank-silence-s", &d.silence.as_secs_f64().to_string()]);
        }
        if let Some(kind) = drafter {
            cmd.args(["--drafter", kind]);
        }
        let status = cmd.status().with_context(|| format!("starting the {mode} run"))?;
        if !status.success() {
            bail!("the {mode} run failed ({status})");
        }
        let path = out.join(mode).join(OUTCOME_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        outcomes
            .push(serde_json::from_str::<RunOutcome>(&text).with_context(|| format!("parsing {}", path.display()))?);
    }
    let baseline = outcomes.pop().context("no baseline outcome")?;
    let tlt = outcomes.pop().context("no TLT outcome")?;
    Ok(Comparison::new(tlt, baseline))
}

/// TLT and the baseline in this process with the same (effective) config, step by step
/// ([`run_interleaved`]: the order alternates, TLT first on even steps). Each run's outcome also goes to
/// `<out>/<mode>/outcome.json`; both carry this process's peak memory (both trainers together).
fn compare_interleaved(
    model_path: &Path,
    cfg: &RunConfig,
    out: &Path,
    resume: Resume,
    progress: ProgressMode,
) -> Result<Comparison> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("config.toml"), toml::to_string_pretty(cfg)?)?;
    let (dt, db) = (RunDir(out.join("tlt")), RunDir(out.join("baseline")));
    let mut tt = trainer(model_path, cfg, Mode::Tlt, &dt, resume)?;
    let mut tb = trainer(model_path, cfg, Mode::Baseline, &db, resume)?;
    let steps = cfg.trainer.steps;
    let (mut pt, mut pb) =
        (Progress::new(label(Mode::Tlt), steps, progress), Progress::new(label(Mode::Baseline), steps, progress));
    let (mut ot, mut ob) = run_interleaved((&mut tt, &dt, &mut pt), (&mut tb, &db, &mut pb), cfg)?;
    drop((pt, pb));
    finish(tt, &ot, &dt)?;
    finish(tb, &ob, &db)?;
    for (o, d) in [(&mut ot, &dt), (&mut ob, &db)] {
        o.peak_rss_gb = peak_rss_gb();
        std::fs::write(d.0.join(OUTCOME_FILE), serde_json::to_string_pretty(o)?)?;
    }
    Ok(Comparison::new(ot, ob))
}

/// This process's peak resident set (VmHWM) in GB, where `/proc` has it (Linux).
fn peak_rss_gb() -> Option<f64> {
    rss_gb("VmHWM:")
}

fn main() -> Result<()> {
    let result = run_main();
    if let (Err(e), Some((rank, size))) = (&result, tlt_examples::ranks::launched()) {
        if size > 1 {
            // Leave without finalising MPI (the other ranks may wait in a collective for this one): the launcher
            // sees the failure and stops the job.
            eprintln!("error (rank {rank} of {size}): {e:#}");
            std::process::exit(1);
        }
    }
    result
}

fn run_main() -> Result<()> {
    tlt_examples::ranks::share_cores();
    tlt_examples::init_logging();
    // The chaos harness's kill points (`FAILPOINTS`), on every rank or only on `TLT_CHAOS_RANK`.
    let rank = tlt_examples::ranks::launched().map_or(0, |(r, _)| r);
    if std::env::var("TLT_CHAOS_RANK").map_or(true, |r| r == rank.to_string()) {
        tlt_model::chaos::arm_from_env()?;
    }
    let args = Args::parse();
    let secs = |s: f64, flag: &str| {
        std::time::Duration::try_from_secs_f64(s).ok().filter(|d| !d.is_zero()).with_context(|| format!("{flag} {s}"))
    };
    let deadlines = tlt_comm::Deadlines {
        wait: secs(args.rank_wait_s, "--rank-wait-s")?,
        silence: secs(args.rank_silence_s, "--rank-silence-s")?,
    };
    let _ = DEADLINES.set(deadlines);
    if args.mode != RunMode::Compare {
        if let Some(status) = tlt_examples::ranks::relaunch(args.ranks)? {
            std::process::exit(status.code().unwrap_or(1));
        }
    }
    if args.interleave && (args.mode != RunMode::Compare || args.ranks > 1) {
        bail!("--interleave runs TLT and the baseline in one process: it needs --mode compare and one rank");
    }
    if args.sequential && args.mode != RunMode::Compare {
        bail!("--sequential orders the two runs of --mode compare");
    }
    let mut cfg = load_config(&args)?;
    cfg.allow_changed_task = args.allow_changed_task;
    if args.print_config {
        print!("{}", toml::to_string_pretty(&cfg)?);
        return Ok(());
    }
    let model = args.model.clone().unwrap_or_else(default_model);
    match args.mode {
        RunMode::Tlt => {
            run_mode(&model, &cfg, Mode::Tlt, &args.out.join("tlt"), Resume::of(&args), args.progress)?;
        }
        RunMode::Baseline => {
            run_mode(&model, &cfg, Mode::Baseline, &args.out.join("baseline"), Resume::of(&args), args.progress)?;
        }
        RunMode::Compare => {
            // Interleaved unless asked otherwise; several ranks run each mode as its own MPI job.
            let schedule = if args.sequential || args.ranks > 1 { Schedule::Sequential } else { Schedule::Interleaved };
            let resume = Resume::of(&args);
            let cmp = match schedule {
                Schedule::Interleaved => compare_interleaved(&model, &cfg, &args.out, resume, args.progress)?,
                Schedule::Sequential => {
                    compare(&model, &cfg, &args.out, resume, args.ranks, args.drafter.as_deref(), args.progress)?
                }
            };
            let plots_dir = args.out.join("plots");
            let (tm, bm) = (&cmp.tlt.metrics, &cmp.baseline.metrics);
            let mut plots = tlt_rl::plot::training_plots(tm, Some(bm), &plots_dir)?;
            plots.extend(tlt_rl::plot::comparison_plots(tm, bm, &plots_dir)?);
            let lengths = tlt_examples::lengths::LengthComparison::new(tm, bm);
            let summary = args.out.join("summary.json");
            std::fs::write(&summary, serde_json::to_string_pretty(&cmp)?)?;
            println!("\n{}", cmp.report());
            println!(
                "metrics, checkpoints and plots: {} ({} comparison plots); summary: {}",
                args.out.display(),
                plots.len(),
                summary.display()
            );
            // Last, so that a caller that keeps only the output's tail (the GPU plan's `e2e` call) keeps it.
            let (text, path) = tlt_examples::compare::write_summary(&cmp, &args.out)?;
            let page = tlt_examples::report::write_html(&cmp, &lengths, schedule, &text, &args.out)?;
            print!("\nsummary ({}):\n{text}", path.display());
            println!("runs: {}", schedule.describe());
            println!("report page: {}", page.display());
            println!("{}", lengths.verdict());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_config_parses_and_validates() {
        let cfg = RunConfig::from_toml(DEMO_CONFIG).unwrap();
        assert_eq!(cfg.task.name, "arithmetic");
        assert!(cfg.trainer.steps > 0);
        assert!(cfg.export.at_end && !cfg.export.at_checkpoints, "exports at the end only by default");
    }
}
