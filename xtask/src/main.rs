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
//! See `xtask/README.md` for every option and every field of the benchmark reports.

mod assets;
mod bench_decode;
mod bench_decode_md;
mod bench_drafter;
mod bench_e2e;
mod bench_gpu;
mod bench_group;
mod bench_kernels;
mod bench_llamacpp;
mod bench_ranks;
mod bench_rollout;
mod bench_serve;
mod bench_spec;
mod candle_ref;
mod drafter_data;
mod drift;
mod export_check;
mod fuzz;
mod gpu_bundle;
mod graph;
mod report;
mod roofline;
mod sysinfo;

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
    CheckExport(export_check::CheckExportArgs),
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
    Demo(DemoArgs),
    /// Fuzz a loader with structure-aware mutations of real files for `--minutes`; findings (panics, aborts,
    /// oversized allocations, hangs) go to `target/fuzz/<target>/findings/`, the summary to `summary.json`.
    Fuzz {
        /// The loader.
        #[arg(value_enum)]
        target: fuzz::Target,
        /// How long to fuzz.
        #[arg(long, default_value_t = 1.0)]
        minutes: f64,
        /// The run's seed (input `i` is a function of it and `i`).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Seconds without progress that count as a hang.
        #[arg(long, default_value_t = 10)]
        hang_s: u64,
    },
    /// The worker process of `fuzz` (internal).
    #[command(hide = true)]
    FuzzWorker {
        #[arg(value_enum)]
        target: fuzz::Target,
        #[arg(long)]
        seed: u64,
        #[arg(long)]
        from: u64,
        #[arg(long)]
        gguf: PathBuf,
    },
    /// The predicted time of the device decode step on an H100 and an H200, op by op, at the benchmark shapes (a
    /// roofline of the program `CudaLlama` runs); `target/bench/roofline.json` and `.md`.
    Roofline {
        /// The measured copy bandwidth (TB/s, read + write) of the third table; default: the H200 run's of
        /// 2026-11-27.
        #[arg(long, default_value_t = roofline::H200_MEASURED_COPY / 1e12)]
        copy_bandwidth: f64,
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
    /// Run a benchmark suite; results go to `target/bench/<suite>.json` and `.md`.
    Bench {
        #[command(subcommand)]
        suite: Suite,
    },
    /// Each crate's file import graph (`--dot`: DOT) and the check that no files import each other in a circle.
    Graph {
        /// Print DOT instead of an indented list.
        #[arg(long)]
        dot: bool,
    },
}

/// Options of `demo`.
#[derive(Debug, clap::Args)]
struct DemoArgs {
    /// Override the number of RL steps of each run.
    #[arg(long)]
    steps: Option<u64>,
    /// A run config instead of the embedded demo config.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Data-parallel ranks (MPI processes, `mpirun -np N`; the `train` binary is then built with `--features
    /// mpi`).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Where rollouts and the policy update run: `cpu`, or `cuda[:N]` (the `train` binary built with `--features
    /// cuda`, NVRTC from the pinned wheel on the library path; cuBLAS 13 and a driver from the GPU machine).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The policy: a `.gguf` file or a Hugging Face checkpoint directory (Llama, Qwen2.5, Qwen3) instead of the
    /// fetched SmolLM2-135M-Instruct GGUF.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Both runs in one process, their steps interleaved (the order alternating), instead of one after the other
    /// in fresh processes; both trainers resident at once (one rank only).
    #[arg(long)]
    interleave: bool,
}

#[derive(Debug, Subcommand)]
enum Suite {
    /// Batched greedy decode of SmolLM2-135M (f32): tlt-model vs candle-transformers' Llama, side by side.
    Decode(bench_decode::DecodeArgs),
    /// Skinny GEMM per weight shape, format and row count, weights from DRAM; f32 vs candle-core's matmul.
    Kernels(bench_kernels::KernelArgs),
    /// Speculative vs plain decoding of SmolLM2-135M through one engine: oracle and n-gram drafters, side by side.
    Spec(bench_spec::SpecArgs),
    /// EAGLE-2/EAGLE-3 drafters trained offline on SmolLM2's own responses: tau and speedup at batch 1.
    Drafter(bench_drafter::DrafterArgs),
    /// Long-tailed rollouts: the cluster simulator calibrated from `spec.json`, and a real SmolLM2 run of the
    /// SD gate + bandit driving the engine against plain decoding.
    Rollout(bench_rollout::RolloutArgs),
    /// GRPO end to end on SmolLM2: TLT vs baseline with the same config and seeds, per-step times and speedups.
    E2e(bench_e2e::E2eArgs),
    /// Group drafting on SmolLM2 GRPO rollouts: plain, n-gram, suffix over the group (with and without history)
    /// and the adaptive rollout; tokens per step beside the argmax-chain ceiling, by running batch; prefill sharing.
    Group(bench_group::GroupArgs),
    /// Batch-1 decode against llama.cpp's `llama-bench` (built beside the project) on the same weights
    /// (f32 and Q8_0 GGUFs written from the model's), threads and context, interleaved.
    Llamacpp(bench_llamacpp::LlamaCppArgs),
    /// Data-parallel ranks measured beside the cluster simulator calibrated on them, and its labelled predictions
    /// for GPU clusters (`target/bench/ranks.json` and `.md`).
    Ranks(bench_ranks::RanksArgs),
    /// The rollout server (`tlt-serve`) against the same rollout in process: a slime-like workload over HTTP,
    /// throughput ratio, SD on/off, latency percentiles, and many requests at once.
    Serve(bench_serve::ServeArgs),
}

/// The suites that measure CPU code in this process take `--device` too, so that every suite reads the same
/// flag; on a CUDA device they stop with what to run instead.
fn cpu_only(suite: &str, device: &str) -> Result<()> {
    if bench_gpu::is_cuda(device)? {
        bail!(
            "`bench {suite}` measures the CPU path in this process; on a GPU run `bench decode|spec --device {device}` \
             (gpu-bench: decode, verify, oracle SD) or `bench e2e --device {device}` (trainer rollouts on the device)"
        );
    }
    Ok(())
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
        for features in [None, Some(all.as_str())] {
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
    }
    let gguf = assets::fetch_assets()?;
    // Every release build below uses the same features (CUDA and MPI on), so the workspace compiles once: the
    // CUDA code runs against the simulated device (no driver here) and NVRTC compiles the kernels; the MPI tests
    // run under `mpirun`.
    let nvrtc = assets::nvrtc_library_path()?;
    let env = |cmd: &mut Command| {
        cmd.env("TLT_SMOLLM2_GGUF", &gguf).env("LD_LIBRARY_PATH", &nvrtc).env("TLT_REQUIRE_NVRTC", "1");
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
            let args = export_check::CheckExportArgs {
                policy: None,
                drafter: None,
                target: None,
                tiny: true,
                new_tokens: 16,
                out: workspace_root().join("target").join("export-check-tiny"),
            };
            if let Err(e) = export_check::run(&args) {
                eprintln!("error: export parity check: {e:#}");
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

/// `demo`: the `train` example's `--mode compare` (built with the features `args` need) into `target/demo`.
fn demo(args: &DemoArgs) -> Result<ExitCode> {
    let cuda = bench_gpu::is_cuda(&args.device)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => assets::fetch_assets()?,
    };
    let out = workspace_root().join("target").join("demo");
    let mut cmd = cargo();
    cmd.args(["run", "--release", "-p", "tlt-examples", "--bin", "train"]);
    let features: Vec<&str> =
        [(args.ranks > 1, "mpi"), (cuda, "cuda")].into_iter().filter(|f| f.0).map(|f| f.1).collect();
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    if cuda {
        cmd.env("LD_LIBRARY_PATH", assets::nvrtc_library_path()?);
    }
    cmd.args(["--", "--mode", "compare", "--ranks", &args.ranks.to_string(), "--device", &args.device]);
    cmd.arg("--model").arg(&model).arg("--out").arg(&out).current_dir(workspace_root());
    if args.model.is_none() {
        cmd.env("TLT_SMOLLM2_GGUF", &model);
    }
    if let Some(s) = args.steps {
        cmd.arg("--steps").arg(s.to_string());
    }
    if let Some(c) = &args.config {
        cmd.arg("--config").arg(c);
    }
    if args.interleave {
        cmd.arg("--interleave");
    }
    let _ = std::fs::remove_dir_all(&out);
    Ok(exit_code(run(cmd)?))
}

/// Caps single allocations while a fuzz worker feeds a loader (no cap otherwise).
#[global_allocator]
static ALLOC: fuzz::alloc::Capped = fuzz::alloc::Capped;

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
        Cmd::CheckExport(args) => {
            export_check::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
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
        Cmd::Fuzz { target, minutes, seed, hang_s } => {
            let gguf = assets::fetch_assets()?;
            let summary = fuzz::run(target, minutes, seed, hang_s, &gguf)?;
            Ok(if summary.findings.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Cmd::FuzzWorker { target, seed, from, gguf } => {
            fuzz::worker(target, seed, from, &gguf)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Demo(args) => demo(&args),
        Cmd::Chaos { kills, rank_kills, seed } => chaos(kills, rank_kills, seed),
        Cmd::Roofline { copy_bandwidth } => {
            roofline::run(&workspace_root().join("target").join("bench"), copy_bandwidth * 1e12)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Decode(args) } => {
            bench_decode::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Llamacpp(args) } => {
            cpu_only("llamacpp", &args.device)?;
            bench_llamacpp::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Serve(args) } => {
            cpu_only("serve", &args.device)?;
            bench_serve::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Group(args) } => {
            cpu_only("group", &args.device)?;
            bench_group::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::E2e(args) } => {
            bench_e2e::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Drafter(args) } => {
            cpu_only("drafter", &args.device)?;
            bench_drafter::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Rollout(args) } => {
            cpu_only("rollout", &args.device)?;
            bench_rollout::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Spec(args) } => {
            bench_spec::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Ranks(args) } => {
            bench_ranks::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { suite: Suite::Kernels(args) } => {
            cpu_only("kernels", &args.device)?;
            bench_kernels::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Graph { dot } => graph::print(dot).map(|()| ExitCode::SUCCESS),
    }
}
