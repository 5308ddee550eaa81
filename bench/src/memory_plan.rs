//! `cargo xtask memory`: the device memory plan of GRPO runs at the paper's shapes, from the trainer's own
//! arithmetic (`tlt_rl::trainer::DeviceMemoryPlan::new`, the plan a `Trainer` checks before its first rollout, and
//! `DeviceMemoryPlan::with_lora`; the update's part is `tlt_model::cuda::train::train_memory` or `lora_memory`,
//! which CI checks against the bytes the trainers allocate on the simulated device). Full fine-tuning and LoRA (rank
//! 32, every linear) with the policy update on the device, the baseline's rollouts (TLT adds its EAGLE drafter, a
//! fraction of one decoder layer: not counted here), for Qwen2.5-1.5B, Qwen2.5-7B and Llama-3.1-8B: fixed shapes
//! and the most new tokens that fit an 80 GB and a 141 GB device. A plan, not a measurement. Writes
//! `target/bench/memory.json` and `.md`.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use tlt_model::cuda::train::LoraConfig;
use tlt_model::device_step::roofline::Hardware;
use tlt_model::LlamaConfig;
use tlt_rl::trainer::{update_options, weight_count, DeviceMemoryPlan, TrainerConfig};

use crate::roofline::hf_shape;

/// The models of the plan (their config.json's shapes).
fn models() -> Vec<(&'static str, LlamaConfig)> {
    vec![
        ("Qwen2.5-1.5B", hf_shape(1536, 8960, 28, 12, 2, 128, 151_936, true, "qwen2")),
        ("Qwen2.5-7B", hf_shape(3584, 18_944, 28, 28, 4, 128, 152_064, false, "qwen2")),
        ("Llama-3.1-8B", hf_shape(4096, 14_336, 32, 32, 8, 128, 128_256, false, "llama")),
    ]
}

/// One run's plan.
#[derive(Debug, Serialize)]
pub struct Row {
    /// The model.
    pub model: String,
    /// `full` or `LoRA r=<rank>`.
    pub mode: String,
    /// Its weights.
    pub weights: u64,
    /// Samples per step (prompts x group size), all decoding at once.
    pub samples: usize,
    /// Most new tokens per sample.
    pub max_new_tokens: usize,
    /// Most prompt tokens.
    pub max_prompt_tokens: usize,
    /// Activation checkpointing in the update.
    pub checkpoint: bool,
    /// Rows (tokens) of the update's largest micro-batch.
    pub update_rows: usize,
    /// The plan, part by part.
    pub plan: DeviceMemoryPlan,
    /// Whether it fits an 80 GB device (H100) and a 141 GB one (H200).
    pub fits_80gb: bool,
    /// As above, 141 GB.
    pub fits_141gb: bool,
}

fn run_config(samples: usize, max_new_tokens: usize, checkpoint: bool) -> TrainerConfig {
    TrainerConfig {
        prompts_per_step: samples / 4,
        group_size: 4,
        max_new_tokens,
        activation_checkpointing: checkpoint,
        ..TrainerConfig::default()
    }
}

/// LoRA's shape in the plan: rank 32, alpha 64, every linear.
const LORA: LoraConfig = LoraConfig { rank: 32, alpha: 64.0 };

fn plan_of(cfg: &LlamaConfig, weights: u64, run: &TrainerConfig, lora: Option<&LoraConfig>) -> DeviceMemoryPlan {
    match lora {
        Some(l) => DeviceMemoryPlan::with_lora(cfg, weights, run, l, 0),
        None => DeviceMemoryPlan::new(cfg, weights, run, 0),
    }
}

fn row(name: &str, cfg: &LlamaConfig, run: &TrainerConfig, lora: Option<&LoraConfig>) -> Result<Row> {
    let weights = weight_count(cfg)?;
    let plan = plan_of(cfg, weights, run, lora);
    Ok(Row {
        model: name.into(),
        mode: lora.map_or_else(|| "full".into(), |l| format!("LoRA r={}", l.rank)),
        weights,
        samples: run.prompts_per_step * run.group_size,
        max_new_tokens: run.max_new_tokens,
        max_prompt_tokens: run.max_prompt_tokens,
        checkpoint: run.activation_checkpointing,
        update_rows: update_options(run).max_rows,
        fits_80gb: plan.total() as f64 <= Hardware::H100.memory,
        fits_141gb: plan.total() as f64 <= Hardware::H200.memory,
        plan,
    })
}

/// The most new tokens (a multiple of 512) a run of `samples` samples fits in `memory` bytes; 0 when none does.
fn most_new_tokens(
    cfg: &LlamaConfig,
    samples: usize,
    lora: Option<&LoraConfig>,
    checkpoint: bool,
    memory: f64,
) -> Result<usize> {
    let weights = weight_count(cfg)?;
    let fits = |n: usize| plan_of(cfg, weights, &run_config(samples, n, checkpoint), lora).total() as f64 <= memory;
    let (mut lo, mut hi) = (0usize, 1usize << 10);
    while fits(hi * 512) && hi < 1 << 12 {
        (lo, hi) = (hi, hi * 2);
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid * 512) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo * 512)
}

/// Every row, and the most new tokens per model, samples and checkpointing on 80 GB and 141 GB.
pub fn run(dir: &Path) -> Result<()> {
    let mut rows = Vec::new();
    let mut most = Vec::new();
    for (name, cfg) in models() {
        for checkpoint in [false, true] {
            rows.push(row(name, &cfg, &run_config(32, 8192, checkpoint), None)?);
        }
        rows.push(row(name, &cfg, &run_config(32, 32_768, true), None)?);
        rows.push(row(name, &cfg, &run_config(64, 8192, true), Some(&LORA))?);
        for (lora, checkpoint) in [(None, false), (None, true), (Some(&LORA), true)] {
            for samples in [32, 64] {
                let n80 = most_new_tokens(&cfg, samples, lora, checkpoint, Hardware::H100.memory)?;
                let n141 = most_new_tokens(&cfg, samples, lora, checkpoint, Hardware::H200.memory)?;
                most.push(serde_json::json!({
                    "model": name, "mode": lora.map_or("full", |_| "LoRA r=32"), "samples": samples,
                    "checkpoint": checkpoint, "most_new_tokens_80gb": n80, "most_new_tokens_141gb": n141,
                }));
            }
        }
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let mut md = String::from(
        "# Device memory plan of GRPO runs (planned, not measured)\n\n`cargo xtask memory`: \
         `DeviceMemoryPlan::new`, the plan a trainer checks before its first rollout. Policy update on the device \
         (bf16 weights, f32 master weights, AdamW moments and gradients), the rollout's KV cache for every sample at \
         the prompt room plus answer, the graph pool's budget, no KL reference, the LM head in chunks of 256 rows; \
         the EAGLE drafter of TLT runs is not counted. LoRA: rank 32 on every linear, rollouts on the merged weights; \
         its state is the frozen base's bf16 copy plus the adapters' f32 master, moments, gradients and bf16 copy. \
         80 GB and 141 GB are 80e9 and 141e9 bytes.\n\n\
         | model | mode | samples x new tokens | checkpointing | update rows | weights GiB | state GiB | KV GiB (positions) | activations GiB | total GiB | 80 GB | 141 GB |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in &rows {
        let p = &r.plan;
        let _ = writeln!(
            md,
            "| {} | {} | {} x {} | {} | {} | {:.1} | {:.1} | {:.1} ({}) | {:.1} | {:.1} | {} | {} |",
            r.model,
            r.mode,
            r.samples,
            r.max_new_tokens,
            if r.checkpoint { "on" } else { "off" },
            r.update_rows,
            gib(p.policy_weights),
            gib(p.optimizer),
            gib(p.kv_cache),
            p.kv_positions,
            gib(p.activations),
            gib(p.total()),
            if r.fits_80gb { "fits" } else { "no" },
            if r.fits_141gb { "fits" } else { "no" },
        );
    }
    md.push_str(
        "\n## Most new tokens that fit (multiples of 512; 0: none)\n\n| model | mode | samples | checkpointing | 80 GB \
         | 141 GB |\n|---|---|---|---|---|---|\n",
    );
    for m in &most {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            m["model"].as_str().unwrap_or(""),
            m["mode"].as_str().unwrap_or(""),
            m["samples"],
            if m["checkpoint"].as_bool().unwrap_or(false) { "on" } else { "off" },
            m["most_new_tokens_80gb"],
            m["most_new_tokens_141gb"]
        );
    }
    print!("{md}");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = serde_json::json!({ "rows": rows, "most_new_tokens": most });
    std::fs::write(dir.join("memory.json"), serde_json::to_vec_pretty(&json)?)?;
    std::fs::write(dir.join("memory.md"), md)?;
    Ok(())
}
