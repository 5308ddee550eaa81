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

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use tracing::{info, warn};

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

/// Whether `device` names a CUDA device (`cuda` or `cuda:N`); an error for anything but those and `cpu`. The
/// names `tlt_model::Device` parses, which `tlt-bench` checks again; this crate does not link `tlt-model`.
pub(crate) fn is_cuda(device: &str) -> Result<bool> {
    match device.split_once(':') {
        None if device == "cpu" => Ok(false),
        None if device == "cuda" => Ok(true),
        Some(("cuda", n)) if n.parse::<usize>().is_ok() => Ok(true),
        _ => bail!("device must be cpu, cuda or cuda:N, got {device:?}"),
    }
}

/// The workspace root (the parent of this crate's directory).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The cargo that runs us (`$CARGO`), or `cargo` from `PATH`.
pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Runs `cmd`, returning its exit status.
fn run(mut cmd: Command) -> Result<ExitStatus> {
    info!(command = ?cmd, "running");
    cmd.status().with_context(|| format!("starting {:?}", cmd.get_program()))
}

/// Maps a child's exit status to ours (a signal becomes 1).
fn exit_code(status: ExitStatus) -> ExitCode {
    match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    }
}

fn test(gpu: bool, no_lint: bool, args: &[String]) -> Result<ExitCode> {
    let all = all_features();
    if !no_lint {
        // Formatting and clippy first: both are fast next to the release build, and CI should fail on them.
        let mut fmt = cargo();
        fmt.args(["fmt", "--all", "--check"]);
        let code = run(fmt)?;
        if !code.success() {
            return Ok(exit_code(code));
        }
        // Clippy once as the workspace builds and once with the CUDA and MPI code its features leave off (the
        // code under `cfg(not(feature))` and under `cfg(feature)`); rustdoc's link checks (broken and private
        // intra-doc links) once, with every feature: it documents a superset. The whole workspace is selected each
        // time, so the dependencies resolve (and build) alike.
        // The second pass adds `tlt-bench/candle-ref` (the decode and llama.cpp suites), which the tests leave out.
        let lint_all = format!("{all},tlt-bench/candle-ref");
        for features in [None, Some(lint_all.as_str())] {
            let mut clippy = cargo();
            clippy.args(["clippy", "--workspace", "--all-targets"]);
            if let Some(f) = features {
                clippy.args(["--features", f]);
            }
            clippy.args(["--", "-D", "warnings"]);
            let code = run(clippy)?;
            if !code.success() {
                return Ok(exit_code(code));
            }
        }
        let mut doc = cargo();
        doc.env("RUSTDOCFLAGS", "-D warnings").args(["doc", "--no-deps", "--workspace", "--features", &all]);
        let code = run(doc)?;
        if !code.success() {
            return Ok(exit_code(code));
        }
        graph::check(cargo)?;
        package::check(cargo)?;
    }
    let gguf = assets::fetch_assets()?;
    // Every release build below uses the same features (CUDA and MPI on), so the workspace compiles once: the
    // CUDA code runs against the simulated device (no driver here) and NVRTC compiles the kernels; the MPI tests
    // run under `mpirun`.
    let nvrtc = assets::nvrtc_library_path()?;
    let env = |cmd: &mut Command| {
        cmd.env("TLT_SMOLLM2_GGUF", &gguf).env("LD_LIBRARY_PATH", &nvrtc).env("TLT_REQUIRE_NVRTC", "1");
        // The runners run one test (or rank) per core: one kernel thread each (tlt-kernels' spinning team, rayon's
        // pool under candle), else two teams of all the cores spin on the same cores waiting for each other's
        // descheduled helpers. Tests that exercise several threads set their count explicitly.
        cmd.env("TLT_NUM_THREADS", "1").env("RAYON_NUM_THREADS", "1");
        if gpu {
            cmd.env("TLT_REQUIRE_GPU", "1");
        }
    };
    // Doc tests first (nextest does not run them), so the runner's summary of all other tests comes last.
    let mut doc = cargo();
    doc.args(["test", "--release", "--workspace", "--features", &all, "--doc"]);
    env(&mut doc);
    let code = run(doc)?;
    if !code.success() {
        return Ok(exit_code(code));
    }
    let nextest = cargo().args(["nextest", "--version"]).output().is_ok_and(|o| o.status.success());
    let mut cmd = cargo();
    if nextest {
        // The MPI tests run below under `cargo test` (one is a custom harness nextest cannot list).
        cmd.args(["nextest", "run", "--release", "--workspace", "--features", &all]);
        cmd.args(["-E", "not (binary(mpi) | binary(data_parallel) | binary(nccl) | binary(chaos))"]);
    } else {
        warn!("cargo-nextest is not installed; falling back to `cargo test`");
        cmd.args(["test", "--release", "--workspace", "--features", &all]);
        cmd.args(["--lib", "--bins", "--tests", "--exclude", "tlt-comm"]);
    }
    cmd.args(args);
    env(&mut cmd);
    // The EAGLE export check runs in Python; with its packages installed, a skip would hide a failure.
    match assets::python_check_deps() {
        Ok(dir) => {
            let mut paths = vec![dir];
            paths.extend(
                std::env::var_os("PYTHONPATH")
                    .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
                    .unwrap_or_default(),
            );
            cmd.env("PYTHONPATH", std::env::join_paths(paths)?).env("TLT_REQUIRE_PYTHON_CHECK", "1");
        }
        Err(e) => warn!("the Python EAGLE export check will be skipped: {e:#}"),
    }
    let code = run(cmd)?;
    if !code.success() {
        return Ok(exit_code(code));
    }
    // The export parity check needs torch, transformers and speculators (~6 GB): run only when installed.
    match assets::python_export_deps(false)? {
        Some(_) => {
            let out = workspace_root().join("target").join("export-check-tiny");
            let mut args = vec!["check-export".to_string(), "--tiny".into(), "--new-tokens".into(), "16".into()];
            args.extend(["--out".to_string(), out.display().to_string()]);
            let code = bench::run(&args)?;
            if !code.success() {
                eprintln!("error: export parity check: `tlt-bench check-export --tiny` failed ({code})");
                return Ok(ExitCode::FAILURE);
            }
        }
        None => println!(
            "SKIP export parity check (scripts/check_export_parity.py: transformers/speculators loading of exported \
             policies and drafters): its Python packages are not installed; fetch them with `{}`",
            assets::EXPORT_CHECK_FETCH
        ),
    }
    // The MPI engine across processes (`mpirun -np 2` and 3), data-parallel GRPO on 2 ranks against one (a missing
    // MPI runtime fails here rather than skipping), NCCL's error without a driver, and the chaos harness at its
    // default size (it kills ranks of 2-rank jobs): the build above, linked.
    let mut mpi = cargo();
    mpi.args(["test", "--release", "--workspace", "--features", &all]);
    mpi.args(["--test", "mpi", "--test", "data_parallel", "--test", "nccl", "--test", "chaos", "--", "--nocapture"]);
    mpi.env("TLT_REQUIRE_MPI", "1");
    env(&mut mpi);
    let code = run(mpi)?;
    if !code.success() {
        return Ok(exit_code(code));
    }
    // The GPU plan's calls, with their GPU steps stubbed (gpu-bench on the simulated device, as the release tests
    // above built it): the device tool's file and output rules and the plan's budgets hold.
    let (bench, train) =
        (workspace_root().join("target/release/gpu-bench"), workspace_root().join("target/release/train"));
    if let Err(e) = gpu_bundle::dry_run(&workspace_root(), &bench, &train, &gguf) {
        eprintln!("error: gpu-bundle dry run: {e:#}");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// `chaos`: the chaos harness (`examples/tests/chaos.rs`) at the asked size, with every feature (`train` has its
/// kill points), MPI required; the tally goes to `target/chaos/report.json`.
fn chaos(kills: usize, rank_kills: usize, seed: u64) -> Result<ExitCode> {
    let report = workspace_root().join("target").join("chaos").join("report.json");
    let mut cmd = cargo();
    cmd.args(["test", "--release", "--workspace", "--features", &all_features(), "--test", "chaos"]);
    cmd.args(["--", "--nocapture", "--test-threads", "1"]);
    cmd.env("TLT_CHAOS_KILLS", kills.to_string()).env("TLT_CHAOS_RANK_KILLS", rank_kills.to_string());
    cmd.env("TLT_CHAOS_SEED", seed.to_string()).env("TLT_CHAOS_REPORT", &report).env("TLT_REQUIRE_MPI", "1");
    let code = run(cmd)?;
    if code.success() {
        println!("chaos report: {}", report.display());
    }
    Ok(exit_code(code))
}

/// `test-cuda`: the CUDA path's tests alone, with the CUDA features: NVRTC compiles of our kernels for sm_80 and
/// sm_90 with no spills, and the device tests of every package on the CUDA device when a driver loads (with `gpu`,
/// a missing driver fails them), else on the simulated device.
fn cuda_tests(gpu: bool) -> Result<ExitCode> {
    let lib_path = assets::nvrtc_library_path()?;
    let mut cuda = cargo();
    cuda.args(["test", "--release"])
        .args(cuda_package_args())
        .args(["--features", CUDA_FEATURES])
        .args(CUDA_TEST_TARGETS.iter().flat_map(|t| ["--test", t]))
        .args(["--", "--nocapture"])
        .env("LD_LIBRARY_PATH", lib_path)
        .env("TLT_REQUIRE_NVRTC", "1");
    if gpu {
        cuda.env("TLT_REQUIRE_GPU", "1");
    }
    Ok(exit_code(run(cuda)?))
}

/// Every feature of the workspace's optional code: CUDA (with `tlt-examples`') and MPI/NCCL.
fn all_features() -> String {
    format!("{CUDA_FEATURES},tlt-examples/cuda,{MPI_FEATURES},tlt-examples/failpoints")
}

/// The test targets of the CUDA path: the NVRTC and GPU-kernel tests (`cuda`), and the device tests of the host
/// code (`device`, `gpu`), which run on the CUDA device when a driver loads, else on the simulated one.
pub(crate) const CUDA_TEST_TARGETS: [&str; 3] = ["cuda", "device", "gpu"];

/// The features that turn the CUDA code on, for the packages that have it.
pub(crate) const CUDA_FEATURES: &str =
    "tlt-kernels/cuda,tlt-cudagraph/cuda,tlt-model/cuda,tlt-spec-decode/cuda,tlt-drafter/cuda,tlt-rl/cuda";

/// The features that turn the MPI and NCCL engines on, and data-parallel training with them.
pub(crate) const MPI_FEATURES: &str = "tlt-comm/mpi,tlt-comm/nccl,tlt-rl/mpi,tlt-examples/mpi";

/// The packages with CUDA code (each has a `cuda` test target).
pub(crate) const CUDA_PACKAGES: [&str; 6] =
    ["tlt-kernels", "tlt-cudagraph", "tlt-model", "tlt-spec-decode", "tlt-drafter", "tlt-rl"];

/// `-p P` for every package of [`CUDA_PACKAGES`].
pub(crate) fn cuda_package_args() -> Vec<&'static str> {
    CUDA_PACKAGES.iter().flat_map(|p| ["-p", p]).collect()
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
        Cmd::Test { gpu, no_lint, args } => test(gpu, no_lint, &args),
        Cmd::TestCuda { gpu } => cuda_tests(gpu),
        Cmd::GpuBundle { dry_run: true, .. } => {
            // gpu-bench and train with the features the release tests build them with, so that a dry run after them
            // rebuilds nothing.
            let status = cargo()
                .args(["build", "--release", "--workspace", "--bin", "gpu-bench", "--bin", "train"])
                .args(["--features", &all_features()])
                .status()
                .context("cargo build gpu-bench and train")?;
            if !status.success() {
                bail!("building gpu-bench and train failed");
            }
            let (root, gguf) = (workspace_root(), assets::fetch_assets()?);
            let (bench, train) = (root.join("target/release/gpu-bench"), root.join("target/release/train"));
            gpu_bundle::dry_run(&root, &bench, &train, &gguf)?;
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
        Cmd::Chaos { kills, rank_kills, seed } => chaos(kills, rank_kills, seed),
        Cmd::Roofline { args } => bench::forward("roofline", args),
        Cmd::Bench { args } => bench::forward("bench", args),
        Cmd::Graph { dot } => graph::print(dot).map(|()| ExitCode::SUCCESS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        assert!(!is_cuda("cpu").unwrap());
        assert!(is_cuda("cuda").unwrap());
        assert!(is_cuda("cuda:1").unwrap());
        assert!(is_cuda("cuda:x").is_err());
        assert!(is_cuda("gpu").is_err());
        assert!(is_cuda("cpu:0").is_err());
    }
}
