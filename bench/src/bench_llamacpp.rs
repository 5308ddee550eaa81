//! `cargo xtask bench llamacpp`: batch-1 greedy decode of tlt-model against llama.cpp's `llama-bench` on the
//! same weights, threads and context, interleaved run by run so drift favours neither side.
//!
//! The weights: the model's GGUF is dequantized and written again as an f32 GGUF and a Q8_0 GGUF
//! ([`requantize_gguf`], llama.cpp's reference rounding); tlt-model runs the f32 tensors it loads from the
//! model's GGUF (the same values) or its Q8_0 pack of them. llama.cpp is not built by this command (its code is
//! never vendored here): build it beside the project and pass `--llama-bench`; `bench/README.md` gives the
//! commands used for the recorded runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use candle_core::quantized::GgmlDType;
use indicatif::ProgressBar;
use serde::Serialize;
use tlt_model::WeightDType;
use tracing::info;

use crate::bench_decode::{make_prompts, run_ours, summarize};
use crate::bench_decode_md::ImplResult;
use crate::candle_ref::{requant_path, requantize_gguf};
use crate::report::{self, median, Header};
use crate::sysinfo::{self, MachineInfo, Probe};

/// Options of `cargo xtask bench llamacpp`.
#[derive(Debug, clap::Args)]
pub struct LlamaCppArgs {
    /// llama.cpp's `llama-bench` binary (built with the CPU backend for this machine).
    #[arg(long)]
    llama_bench: PathBuf,
    /// Weight formats to compare (`f32`, `q8_0`).
    #[arg(long, value_delimiter = ',', default_value = "f32,q8_0")]
    dtypes: Vec<String>,
    /// Committed context before the timed steps (our prefill; llama-bench's `-d`).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Timed decode steps per run (llama-bench's `-n`).
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Runs per implementation and format, interleaved; medians are reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Size of the read-bandwidth probe buffer in MiB (at least 512).
    #[arg(long, default_value_t = 512)]
    probe_mib: usize,
    /// The GGUF to load (default: the cached SmolLM2-135M-Instruct, fetched if missing).
    #[arg(long)]
    model: Option<PathBuf>,
    /// `cpu` (the default): this suite measures the CPU path; a CUDA device is refused with what to run instead.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

/// One weight format, both implementations.
#[derive(Debug, Clone, Serialize)]
pub struct FormatResult {
    /// `f32` or `q8_0`.
    pub weights: String,
    /// The GGUF llama.cpp loads.
    pub gguf: String,
    /// Bytes of weights one decode step of ours streams (linear layers and LM head).
    pub weight_bytes_per_step: u64,
    /// tlt-model's figures (`bw_fraction` against `weight_bytes_per_step` and the probe).
    pub ours: ImplResult,
    /// llama-bench's tokens per second, one per run, in run order.
    pub llama_cpp_tokens_per_s_runs: Vec<f64>,
    /// Median of `llama_cpp_tokens_per_s_runs`.
    pub llama_cpp_tokens_per_s: f64,
    /// `weight_bytes_per_step * llama_cpp_tokens_per_s`, GB/s (the same byte count as ours).
    pub llama_cpp_gbs: f64,
    /// `ours.tokens_per_s / llama_cpp_tokens_per_s`.
    pub ratio_vs_llama_cpp: f64,
}

/// The whole `llamacpp.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Suite, schema version, time, commit, command line and machine.
    #[serde(flatten)]
    pub header: Header,
    /// The model's GGUF.
    pub model_path: String,
    /// Threads both sides use (ours: `tlt_kernels::default_threads`; llama-bench `-t`).
    pub threads: usize,
    /// Committed context before the timed steps.
    pub prompt_tokens: usize,
    /// Timed decode steps per run.
    pub new_tokens: usize,
    /// Runs per implementation and format.
    pub repeats: usize,
    /// Read bandwidth with `threads` threads, GB/s.
    pub read_bandwidth_gbs: f64,
    /// How it was measured.
    pub read_bandwidth_probe: Probe,
    /// llama-bench's `build_commit` and `build_number`, as it reports them.
    pub llama_cpp_build: String,
    /// llama-bench's `cpu_info`.
    pub llama_cpp_cpu_info: String,
    /// One entry per format.
    pub results: Vec<FormatResult>,
}

fn parse_dtype(s: &str) -> Result<(WeightDType, GgmlDType)> {
    match s.to_ascii_lowercase().as_str() {
        "f32" => Ok((WeightDType::F32, GgmlDType::F32)),
        "q8_0" => Ok((WeightDType::Q8_0, GgmlDType::Q8_0)),
        other => bail!("--dtypes: unknown format {other:?} (f32, q8_0)"),
    }
}

/// What one `llama-bench` run reported.
struct LlamaRun {
    tokens_per_s: f64,
    build: String,
    cpu_info: String,
}

/// One `llama-bench` run: `-r 1` (after its own warm-up) of `new_tokens` steps at depth `depth`.
fn llama_bench(bin: &Path, gguf: &Path, threads: usize, depth: usize, new_tokens: usize) -> Result<LlamaRun> {
    let out = Command::new(bin)
        .args(["-m", &gguf.display().to_string()])
        .args(["-p", "0", "-n", &new_tokens.to_string(), "-d", &depth.to_string()])
        .args(["-t", &threads.to_string(), "-r", "1", "-o", "json"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("{} failed ({}): {}", bin.display(), out.status, String::from_utf8_lossy(&out.stderr));
    }
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("parsing llama-bench's JSON: {}", String::from_utf8_lossy(&out.stdout)))?;
    let row = rows
        .iter()
        .find(|r| r["n_gen"].as_u64() == Some(new_tokens as u64))
        .context("llama-bench reported no generation test")?;
    let tokens_per_s = row["avg_ts"].as_f64().context("llama-bench's row has no avg_ts")?;
    let text = |k: &str| row[k].as_str().map(str::to_owned).unwrap_or_else(|| row[k].to_string());
    Ok(LlamaRun {
        tokens_per_s,
        build: format!("{} (build {})", text("build_commit"), text("build_number")),
        cpu_info: text("cpu_info"),
    })
}

/// Runs the suite and writes `target/bench/llamacpp.{json,md}`.
pub fn run(args: &LlamaCppArgs) -> Result<()> {
    if args.new_tokens == 0 || args.prompt_tokens == 0 || args.repeats == 0 {
        bail!("--new-tokens, --prompt-tokens and --repeats must be positive");
    }
    if !args.llama_bench.is_file() {
        bail!("--llama-bench {} is not a file", args.llama_bench.display());
    }
    let formats =
        args.dtypes.iter().map(|d| Ok((d.to_ascii_lowercase(), parse_dtype(d)?))).collect::<Result<Vec<_>>>()?;
    let timestamp = sysinfo::utc_timestamp();
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::env::smollm2_gguf()?,
    };
    let loaded = tlt_model::load_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = loaded.tokenizer.with_context(|| format!("{} carries no tokenizer", path.display()))?;
    let prompt = make_prompts(&tokenizer, 1, args.prompt_tokens)?;
    let threads = tlt_kernels::default_threads();
    let machine = MachineInfo::collect();
    let (bw_gbs, probe) = Probe::run(args.probe_mib, threads);
    info!(gb_per_s = format!("{bw_gbs:.2}"), threads, "read bandwidth");

    let hidden = ProgressBar::hidden();
    let (mut build, mut cpu_info) = (String::new(), String::new());
    let mut results = Vec::new();
    for (name, (ours_dtype, ggml)) in formats {
        let gguf = requant_path(&path, &name)?;
        requantize_gguf(&path, &gguf, ggml)?;
        let mut model = loaded.model.clone();
        model.pack_for_inference(ours_dtype)?;
        let bytes = model.weight_bytes_per_token() as u64;
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for r in 0..args.repeats {
            for ours_turn in if r % 2 == 0 { [true, false] } else { [false, true] } {
                if ours_turn {
                    ours.push(run_ours(&model, &prompt, args.new_tokens, &hidden)?);
                } else {
                    let run = llama_bench(&args.llama_bench, &gguf, threads, args.prompt_tokens, args.new_tokens)?;
                    (build, cpu_info) = (run.build, run.cpu_info);
                    theirs.push(run.tokens_per_s);
                }
            }
        }
        let ours = summarize(&ours, 1, args.new_tokens, bytes, bw_gbs);
        let llama = median(&theirs);
        info!(weights = %name, ours_tok_s = format!("{:.1}", ours.tokens_per_s), llama_cpp_tok_s = format!("{llama:.1}"),
              ratio = format!("{:.3}", ours.tokens_per_s / llama), "format done");
        results.push(FormatResult {
            weights: name,
            gguf: gguf.display().to_string(),
            weight_bytes_per_step: bytes,
            ratio_vs_llama_cpp: ours.tokens_per_s / llama,
            ours,
            llama_cpp_tokens_per_s_runs: theirs,
            llama_cpp_tokens_per_s: llama,
            llama_cpp_gbs: bytes as f64 * llama / 1e9,
        });
    }
    let report = Report {
        header: Header::new("llamacpp", 1, timestamp, machine),
        model_path: path.display().to_string(),
        threads,
        prompt_tokens: args.prompt_tokens,
        new_tokens: args.new_tokens,
        repeats: args.repeats,
        read_bandwidth_gbs: bw_gbs,
        read_bandwidth_probe: probe,
        llama_cpp_build: build,
        llama_cpp_cpu_info: cpu_info,
        results,
    };
    let table = markdown(&report);
    report::write_outputs("llamacpp", &report, &table)?;
    println!("{table}");
    Ok(())
}

fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# llamacpp: batch-1 greedy decode, tlt-model vs llama.cpp (`llama-bench`)\n\n\
         {} ({} threads both sides); read bandwidth {:.2} GB/s; context {} then {} timed steps; median of {} \
         interleaved runs; llama.cpp {} ({}); commit {}; {}\n\n\
         | weights | MB per step | ours tok/s | ours GB/s | ours bw | llama.cpp tok/s | llama.cpp GB/s | ours / llama.cpp |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
        r.header.machine.cpu_model,
        r.threads,
        r.read_bandwidth_gbs,
        r.prompt_tokens,
        r.new_tokens,
        r.repeats,
        r.llama_cpp_build,
        r.llama_cpp_cpu_info,
        r.header.git_commit,
        r.header.timestamp,
    );
    for f in &r.results {
        s += &format!(
            "| {} | {:.1} | {:.1} | {:.2} | {:.3} | {:.1} | {:.2} | {:.3} |\n",
            f.weights,
            f.weight_bytes_per_step as f64 / 1e6,
            f.ours.tokens_per_s,
            f.ours.achieved_gbs,
            f.ours.bw_fraction,
            f.llama_cpp_tokens_per_s,
            f.llama_cpp_gbs,
            f.ratio_vs_llama_cpp,
        );
    }
    s
}
