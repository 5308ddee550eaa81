//! Project automation for the TLT workspace, run as `cargo xtask <command>` (an alias in `.cargo/config.toml`).
//!
//! - `fetch-assets`: download and verify the offline assets (the SmolLM2-135M-Instruct GGUF) into the cache;
//!   `--python-checks` also installs the export check's Python packages (torch, transformers, speculators; ~6 GB);
//! - `check-export`: compare exported policies and drafters with transformers and speculators
//!   (`scripts/check_export_parity.py`);
//! - `test`: `fetch-assets`, then the doc tests (`cargo test --release --workspace --doc`) and every other test of
//!   the workspace (`cargo nextest run --release --workspace`, or `cargo test` without nextest) with `TLT_SMOLLM2_GGUF` pointing at the GGUF,
//!   then the export parity check on a tiny fixture when its Python packages are installed (a SKIP line otherwise);
//! - `demo`: `fetch-assets`, then the main job: GRPO training of SmolLM2 with TLT rollouts against the baseline
//!   (the `train` example's `--mode compare` on its embedded config), printing the report; `--device cuda` on a GPU;
//! - `bench <suite>`: benchmark suites (`decode`, `kernels`, `spec`, `drafter`, `rollout`, `e2e`, `group`, `serve`, ...) writing `target/bench/<suite>.json` and `.md`.
//!
//! `bench`, `roofline`, `fuzz` and `check-export` need the model crates: they are commands of `tlt-bench`
//! (`bench/`), which this binary builds and runs with the same arguments (see `bench.rs`), so that this one
//! depends on light crates only and builds in seconds.
//!
//! See `xtask/README.md` for every option, `bench/README.md` for every field of the benchmark reports.

mod assets;
mod bench;
mod demo;
mod gpu_bundle;
mod graph;
mod package;
mod testing;
mod workspace;

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use workspace::{all_features, cargo, workspace_root};

/// Command line of `cargo xtask`.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "TLT project automation: assets, tests, demo, benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Download and verify the offline assets (SmolLM2-135M-Instruct GGUF) into `$TLT_CACHE` or `<workspace>/.cache`.
    FetchAssets {
        /// Also install the export parity check's Python packages (torch, transformers, speculators) into
        /// `<cache>/pyexport`: about 6 GB, since PyPI's torch is the CUDA build.
        #[arg(long)]
        python_checks: bool,
    },
    /// Compare exported policies and drafters with Hugging Face transformers and the `speculators` package (the
    /// format vLLM reads): greedy tokens, final hidden states, draft logits. Needs `fetch-assets --python-checks`.
    #[command(disable_help_flag = true)]
    CheckExport {
        /// The arguments of `tlt-bench check-export` (`cargo xtask check-export --help` lists them).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Lints (`cargo fmt --check`, `cargo clippy -D warnings`, `cargo doc` with warnings denied), then fetch assets and run all tests of the
    /// workspace (cargo nextest, or cargo test without it).
    Test {
        /// Require a CUDA driver for the CUDA tests (the packages with a `cuda` feature), which then run the kernels,
        /// graphs, model and engine on the GPU; without it they check NVRTC compiles and the no-driver errors.
        #[arg(long)]
        gpu: bool,
        /// Skip the lints (rustfmt, clippy and the dependency-graph check).
        #[arg(long)]
        no_lint: bool,
        /// Extra arguments for the test runner, after `--`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Only the CUDA path's tests (also the last part of `test`): NVRTC compiles of our kernels for sm_80/sm_90
    /// with no spills, the no-driver errors, and with `--gpu` the kernels and graphs on a GPU.
    TestCuda {
        /// Require a CUDA driver and run the device tests.
        #[arg(long)]
        gpu: bool,
    },
    /// Build the CUDA tests and `gpu-bench` here, stripped, with `run.sh` for a GPU machine without Rust
    /// (`target/gpu-bundle`; see `xtask/src/gpu_bundle.rs`).
    GpuBundle {
        /// Also split SmolLM2's GGUF into parts under `target/gpu-weights/` (one upload each: the lent machine
        /// takes 64 MiB per call); `run.sh` reassembles them and runs the real-weights parity test.
        #[arg(long)]
        weights: bool,
        /// Run every call of the plan here with the GPU steps stubbed and check the device tool's rules (files under
        /// `$OUT`, the summary printed last); builds nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Fetch assets, then the main job: GRPO on SmolLM2-135M-Instruct with TLT rollouts and the baseline with
    /// the same seeds (one run after the other, each in a fresh process; `--interleave`: step by step in one), and a
    /// report (reward before/after, step-time split, TLT speedup, the tail and the bounds) ending with a per-step
    /// summary. Output in `target/demo`.
    Demo(demo::DemoArgs),
    /// Fuzz a loader with structure-aware mutations of real files for `--minutes`; findings (panics, aborts,
    /// oversized allocations, hangs) go to `target/fuzz/<target>/findings/`, the summary to `summary.json`.
    #[command(disable_help_flag = true)]
    Fuzz {
        /// The arguments of `tlt-bench fuzz` (`cargo xtask fuzz --help` lists them).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The predicted time of the device decode step on an H100 and an H200, op by op, at the benchmark shapes (a
    /// roofline of the program `CudaLlama` runs); `target/bench/roofline.json` and `.md`.
    #[command(disable_help_flag = true)]
    Roofline {
        /// The arguments of `tlt-bench roofline` (`cargo xtask roofline --help` lists them).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The device memory plan of GRPO runs at the paper's shapes (the trainer's own arithmetic) and the most new
    /// tokens that fit 80 GB and 141 GB; `target/bench/memory.json` and `.md`.
    #[command(disable_help_flag = true)]
    Memory {
        /// The arguments of `tlt-bench memory`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Fault injection: `train` on a tiny model killed by SIGKILL at seeded points (rollout rounds, optimizer
    /// steps, drafter steps, checkpoint writes, metrics appends; one rank of a 2-rank MPI job), resumed until done
    /// and compared bit for bit with an uninterrupted run, plus the two-rename negative control (the
    /// `tlt-examples` `chaos` test, larger than in `test`); the kills' tally in `target/chaos/report.json`.
    Chaos {
        /// Landed kills on one rank.
        #[arg(long, default_value_t = 200)]
        kills: usize,
        /// Landed kills on a 2-rank job (needs `mpirun`).
        #[arg(long, default_value_t = 40)]
        rank_kills: usize,
        /// Seed of the kills' choice.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Run a benchmark suite; results go to `target/bench/<suite>.json` and `.md` (`cargo xtask bench --help`
    /// lists the suites).
    #[command(disable_help_flag = true)]
    Bench {
        /// The suite and its arguments, for `tlt-bench bench`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Each crate's file import graph (`--dot`: DOT) and the check that no files import each other in a circle.
    Graph {
        /// Print DOT instead of an indented list.
        #[arg(long)]
        dot: bool,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match dispatch(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Cmd::FetchAssets { python_checks } => {
            let gguf = assets::fetch_assets()?;
            println!("{}", gguf.display());
            if python_checks {
                if let Some(dir) = assets::python_export_deps(true)? {
                    println!("{}", dir.display());
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::CheckExport { args } => bench::forward("check-export", args),
        Cmd::Test { gpu, no_lint, args } => testing::test(gpu, no_lint, &args),
        Cmd::TestCuda { gpu } => testing::cuda_tests(gpu),
        Cmd::GpuBundle { dry_run: true, .. } => {
            // gpu-bench, train and tlt-bench with the features the release tests build them with, so that a dry run
            // after them rebuilds nothing.
            let status = cargo()
                .args([
                    "build",
                    "--release",
                    "--workspace",
                    "--bin",
                    "gpu-bench",
                    "--bin",
                    "train",
                    "--bin",
                    "tlt-bench",
                ])
                .args(["--features", &all_features()])
                .status()
                .context("cargo build gpu-bench and train")?;
            if !status.success() {
                bail!("building gpu-bench, train and tlt-bench failed");
            }
            let (root, gguf) = (workspace_root(), assets::fetch_assets()?);
            let (bench, train) = (root.join("target/release/gpu-bench"), root.join("target/release/train"));
            gpu_bundle::dry_run(&root, &bench, &train, &root.join("target/release/tlt-bench"), &gguf)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::GpuBundle { weights, dry_run: false } => {
            let root = workspace_root();
            println!("{}", gpu_bundle::build(&root, cargo)?.display());
            if weights {
                for part in gpu_bundle::split_weights(&root, &assets::fetch_assets()?)? {
                    println!("{}", part.display());
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Fuzz { args } => bench::forward("fuzz", args),
        Cmd::Demo(args) => demo::demo(&args),
        Cmd::Chaos { kills, rank_kills, seed } => testing::chaos(kills, rank_kills, seed),
        Cmd::Roofline { args } => bench::forward("roofline", args),
        Cmd::Memory { args } => bench::forward("memory", args),
        Cmd::Bench { args } => bench::forward("bench", args),
        Cmd::Graph { dot } => graph::print(dot).map(|()| ExitCode::SUCCESS),
    }
}
