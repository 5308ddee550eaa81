//! `gpu-bench`'s command line, read by every section.

use clap::Parser;

/// The command line.
#[derive(Parser, Debug)]
#[command(about = "Decode, verify-k and speculative decoding timings of an architecture on a device")]
pub struct Args {
    /// smollm2-135m, qwen2.5-1.5b, qwen2.5-7b, llama3-8b, qwen3-0.6b, qwen3-8b, or tiny (a 2-layer model for the
    /// simulated device).
    #[arg(long, default_value = "smollm2-135m")]
    pub arch: String,
    /// `cuda`, `cuda:N` or `sim` (the simulated device).
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Batch sizes of the decode sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128,256")]
    pub batches: Vec<usize>,
    /// Committed tokens per sequence before the timed steps.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// Timed steps per measurement (the median is reported).
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Verify widths measured at batch 1 (tokens per verify forward).
    #[arg(long, value_delimiter = ',', default_value = "2,4,6,8")]
    pub verify: Vec<usize>,
    /// Mean tokens per round of the oracle speculative decoding (a perfect oracle drafting `tau - 1` tokens per
    /// round, verified on the device through the engine).
    #[arg(long, value_delimiter = ',', default_value = "2,4,6")]
    pub tau: Vec<usize>,
    /// Batches of the engine's speculative decoding (oracle and EAGLE-2).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    pub sd_batches: Vec<usize>,
    /// Tokens generated per request in the engine's runs.
    #[arg(long, default_value_t = 256)]
    pub sd_tokens: usize,
    /// Rows per sequence of the timed EAGLE drafter level (its top-k, the draft tree's width).
    #[arg(long, default_value_t = 4)]
    pub drafter_top_k: usize,
    /// Batches of the EAGLE drafter level.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    pub drafter_batches: Vec<usize>,
    /// Skip the EAGLE-2 sections (SD and the draft level): their drafter of the target's shape holds a copy of the
    /// embedding and LM head, built on the CPU first (seconds for an 8B shape's vocabulary).
    #[arg(long)]
    pub no_eagle: bool,
    /// Contexts of the sweep (decode at `--sweep-batches` and verify-`--sweep-verify` at batch 1, each beside the
    /// roofline's prediction); none: no sweep.
    #[arg(long, value_delimiter = ',')]
    pub contexts: Vec<usize>,
    /// Batches of the context sweep (those that fit in 3/4 of the device's memory).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    pub sweep_batches: Vec<usize>,
    /// Nodes of the sweep's verify (a chain, batch 1).
    #[arg(long, default_value_t = 8)]
    pub sweep_verify: usize,
    /// Only the copy bandwidth and the context sweep.
    #[arg(long)]
    pub sweep_only: bool,
    /// JSON output.
    #[arg(long, default_value = "target/bench/gpu-decode.json")]
    pub out: std::path::PathBuf,
}
