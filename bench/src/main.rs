//! The commands of the TLT workspace that need its model crates, run by `cargo xtask` (which builds this binary
//! with the test build's features, fetches the assets and passes their paths in the environment, see `env`):
//!
//! - `bench <suite>`: benchmark suites (`decode`, `kernels`, `spec`, `drafter`, `rollout`, `e2e`, `group`,
//!   `llamacpp`, `ranks`, `serve`) writing `target/bench/<suite>.json` and `.md`;
//! - `roofline`: the predicted device decode step on an H100 and an H200, op by op;
//! - `fuzz`: structure-aware fuzzing of the loaders (and its worker process, `fuzz-worker`);
//! - `check-export`: exported policies and drafters against transformers and speculators.
//!
//! See `bench/README.md` for every field of the benchmark reports, `xtask/README.md` for the options.

#[cfg(feature = "candle-ref")]
mod bench_decode;
#[cfg(feature = "candle-ref")]
mod bench_decode_md;
mod bench_drafter;
mod bench_e2e;
mod bench_gpu;
mod bench_group;
mod bench_kernels;
#[cfg(feature = "candle-ref")]
mod bench_llamacpp;
mod bench_ranks;
mod bench_rollout;
mod bench_serve;
mod bench_spec;
#[cfg(feature = "candle-ref")]
mod candle_ref;
mod drafter_data;
mod drift;
mod env;
mod export_check;
mod fuzz;
mod memory_plan;
mod report;
mod roofline;
mod sysinfo;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};

/// Command line of `tlt-bench`, as `cargo xtask` forwards it (the same words after `cargo xtask`).
#[derive(Debug, Parser)]
#[command(
    name = "tlt-bench",
    bin_name = "cargo xtask",
    about = "TLT benchmarks, roofline, fuzzing and the export check (run through `cargo xtask`)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Compare exported policies and drafters with Hugging Face transformers and the `speculators` package (the
    /// format vLLM reads): greedy tokens, final hidden states, draft logits. Needs `fetch-assets --python-checks`.
    CheckExport(export_check::CheckExportArgs),
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
    /// The device memory plan of GRPO full fine-tuning at the paper's shapes (Qwen2.5-1.5B, Qwen2.5-7B,
    /// Llama-3.1-8B) and the most new tokens that fit 80 GB and 141 GB; `target/bench/memory.json` and `.md`.
    Memory,
    /// Run a benchmark suite; results go to `target/bench/<suite>.json` and `.md`.
    Bench {
        #[command(subcommand)]
        suite: Suite,
    },
}

#[derive(Debug, Subcommand)]
enum Suite {
    /// Batched greedy decode of SmolLM2-135M (f32): tlt-model vs candle-transformers' Llama, side by side.
    #[cfg(feature = "candle-ref")]
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
    #[cfg(feature = "candle-ref")]
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
        Cmd::CheckExport(args) => export_check::run(&args)?,
        Cmd::Fuzz { target, minutes, seed, hang_s } => {
            let summary = fuzz::run(target, minutes, seed, hang_s, &env::smollm2_gguf()?)?;
            if !summary.findings.is_empty() {
                return Ok(ExitCode::FAILURE);
            }
        }
        Cmd::FuzzWorker { target, seed, from, gguf } => fuzz::worker(target, seed, from, &gguf)?,
        Cmd::Roofline { copy_bandwidth } => {
            roofline::run(&env::workspace_root().join("target").join("bench"), copy_bandwidth * 1e12)?;
        }
        Cmd::Memory => memory_plan::run(&env::workspace_root().join("target").join("bench"))?,
        Cmd::Bench { suite } => bench(suite)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn bench(suite: Suite) -> Result<()> {
    match suite {
        #[cfg(feature = "candle-ref")]
        Suite::Decode(args) => bench_decode::run(&args),
        #[cfg(feature = "candle-ref")]
        Suite::Llamacpp(args) => {
            cpu_only("llamacpp", &args.device)?;
            bench_llamacpp::run(&args)
        }
        Suite::Serve(args) => bench_serve::run(&args),
        Suite::Group(args) => {
            cpu_only("group", &args.device)?;
            bench_group::run(&args)
        }
        Suite::E2e(args) => bench_e2e::run(&args),
        Suite::Drafter(args) => {
            cpu_only("drafter", &args.device)?;
            bench_drafter::run(&args)
        }
        Suite::Rollout(args) => {
            cpu_only("rollout", &args.device)?;
            bench_rollout::run(&args)
        }
        Suite::Spec(args) => bench_spec::run(&args),
        Suite::Ranks(args) => bench_ranks::run(&args),
        Suite::Kernels(args) => {
            cpu_only("kernels", &args.device)?;
            bench_kernels::run(&args)
        }
    }
}
