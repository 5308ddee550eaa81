//! `cargo xtask roofline [--copy-bandwidth TB/s]`: the predicted time of the device decoder's step, kernel by
//! kernel, at the benchmark shapes, on an H100 and an H200 (nominal bandwidths) and on an H200 at a measured copy
//! bandwidth (`tlt_model::device_step::roofline`: the very program `CudaLlama` runs, with a counting executor).
//! Shapes: SmolLM2-135M, Qwen2.5-1.5B, Qwen3-8B and Llama-3-8B, decode at batch 1, 8, 64 and 256 and verify-8 at
//! batch 1, over contexts of 512, 4,096, 16,384 and 32,768 keys, where the weights and the KV cache fit in the
//! device's memory. A prediction to read GPU runs against, not a measurement (`gpu-bench` prints measured /
//! predicted). Writes `target/bench/roofline.json` and `.md`.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use tlt_model::device_step::roofline::{self, memory_bytes, Hardware, StepCost, LAUNCH_FLOOR_S};
use tlt_model::LlamaConfig;

/// Copy bandwidth (read + write) measured on the H200 of 2026-11-27 (`../shared/gpu-runs/2026-11-27-h200`: 4.04 and
/// 4.18 TB/s in two processes; their mean).
pub const H200_MEASURED_COPY: f64 = 4.11e12;

/// Contexts of the sweep.
pub const CONTEXTS: [usize; 4] = [512, 4096, 16_384, 32_768];

/// A model of `config.json`'s shapes (random weights; what the roofline and the memory plan need).
#[allow(clippy::too_many_arguments)]
pub fn hf_shape(
    h: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    head_dim: usize,
    vocab: usize,
    tied: bool,
    model_type: &str,
) -> LlamaConfig {
    let mut c = LlamaConfig::tiny(vocab, h, layers);
    c.model_type = model_type.into();
    c.intermediate_size = inter;
    c.num_attention_heads = heads;
    c.num_key_value_heads = Some(kv);
    c.head_dim = Some(head_dim);
    c.tie_word_embeddings = tied;
    c
}

/// The models of the benchmark shapes (their config.json's shapes; `gpu-bench --arch` builds the same).
pub fn models() -> Vec<(&'static str, LlamaConfig)> {
    let cfg = hf_shape;
    vec![
        ("SmolLM2-135M", cfg(576, 1536, 30, 9, 3, 64, 49_152, true, "llama")),
        ("Qwen2.5-1.5B", cfg(1536, 8960, 28, 12, 2, 128, 151_936, true, "qwen2")),
        ("Qwen3-8B", cfg(4096, 12_288, 36, 32, 8, 128, 151_936, false, "qwen3")),
        ("Llama-3-8B", cfg(4096, 14_336, 32, 32, 8, 128, 128_256, false, "llama")),
    ]
}

/// One hardware's predictions.
#[derive(Debug, Serialize)]
pub struct Table {
    /// The hardware.
    pub hardware: Hardware,
    /// Every shape that fits.
    pub steps: Vec<StepCost>,
}

/// Every benchmark shape on `hw` that fits in its memory.
pub fn all(hw: Hardware) -> Result<Vec<StepCost>> {
    let mut out = Vec::new();
    for (name, cfg) in models() {
        for context in CONTEXTS {
            for (batch, n_max) in [(1, 1), (8, 1), (64, 1), (256, 1), (1, 8)] {
                if memory_bytes(&cfg, batch, context + n_max) > 0.9 * hw.memory {
                    continue;
                }
                out.push(roofline::step(name, &cfg, hw, batch, n_max, context)?);
            }
        }
    }
    Ok(out)
}

fn write_table(md: &mut String, t: &Table) {
    let hw = t.hardware;
    let _ = writeln!(
        md,
        "\n## {} at {:.2} TB/s\n\n| model | batch | new tokens | context | launches | GB moved | predicted step (us) | \
         GEMMs / attention / other (us) | verify-8 / decode-1 |\n|---|---:|---:|---:|---:|---:|---:|---|---:|",
        hw.name,
        hw.bytes_per_s / 1e12
    );
    for s in &t.steps {
        let ratio = if s.n_max == 8 {
            t.steps
                .iter()
                .find(|d| (d.model.as_str(), d.batch, d.n_max, d.context) == (s.model.as_str(), 1, 1, s.context))
                .map_or(String::new(), |d| format!("{:.3}", s.seconds / d.seconds))
        } else {
            String::new()
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {:.3} | {:.1} | {:.1} / {:.1} / {:.1} | {ratio} |",
            s.model,
            s.batch,
            s.n_max,
            s.context,
            s.launches,
            s.bytes / 1e9,
            s.seconds * 1e6,
            s.split[0] * 1e6,
            s.split[1] * 1e6,
            s.split[2] * 1e6
        );
    }
}

/// Runs the suite: JSON and markdown under `dir`; `copy` the measured copy bandwidth of the third table (bytes/s).
pub fn run(dir: &Path, copy: f64) -> Result<Vec<Table>> {
    let hws = [
        Hardware::H100,
        Hardware::H200,
        Hardware { name: "H200 (measured copy bandwidth)", ..Hardware::H200 }.at_bandwidth(copy),
    ];
    let tables: Vec<Table> =
        hws.into_iter().map(|hw| Ok(Table { hardware: hw, steps: all(hw)? })).collect::<Result<_>>()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Roofline of the device decode step (predicted, not measured)\n\nFrom the program `CudaLlama` runs (`cargo \
         xtask roofline`, `tlt_model::device_step::roofline`): per op, bytes and FLOPs from its shapes, time = \
         max(bytes / bandwidth, FLOPs / {:.0} TFLOP/s, {:.0} us launch floor), summed. Attention reads each \
         sequence's K and V once per layer (the tensor-core kernel's row tiles share them); GEMMs read their weights \
         once per call (no reuse across layers). Shapes whose weights and KV cache exceed 90% of the device's memory \
         are left out.",
        Hardware::H100.flops / 1e12,
        LAUNCH_FLOOR_S * 1e6,
    );
    for t in &tables {
        write_table(&mut md, t);
    }
    let h200 = &tables[1];
    for (model, batch, n_max, context) in [("SmolLM2-135M", 1, 1, 512), ("Llama-3-8B", 64, 1, 4096)] {
        let Some(s) = h200
            .steps
            .iter()
            .find(|s| (s.model.as_str(), s.batch, s.n_max, s.context) == (model, batch, n_max, context))
        else {
            continue;
        };
        let _ = writeln!(
            md,
            "\n## {model}, batch {batch}, context {context} on the H200: the ops of the first layer and the head\n"
        );
        md.push_str("| op | bytes | FLOPs | time (us) | bound |\n|---|---:|---:|---:|---|\n");
        let layers = models().into_iter().find(|m| m.0 == model).map_or(1, |m| m.1.num_hidden_layers.max(1));
        let per_layer = (s.ops.len() - 3) / layers;
        for o in s.ops.iter().take(2 + per_layer).chain(s.ops.last()) {
            let _ =
                writeln!(md, "| {} | {:.3e} | {:.3e} | {:.2} | {} |", o.op, o.bytes, o.flops, o.seconds * 1e6, o.bound);
        }
    }
    let json: Vec<serde_json::Value> = tables
        .iter()
        .map(|t| {
            let steps: Vec<StepCost> = t.steps.iter().map(|s| StepCost { ops: Vec::new(), ..s.clone() }).collect();
            serde_json::json!({ "hardware": t.hardware, "steps": steps })
        })
        .collect();
    std::fs::write(dir.join("roofline.json"), serde_json::to_string_pretty(&json)?)?;
    std::fs::write(dir.join("roofline.md"), &md)?;
    println!("{md}");
    Ok(tables)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_that_fits_has_a_cost_and_the_h200_is_faster() {
        let h100 = all(Hardware::H100).unwrap();
        let h200 = all(Hardware::H200).unwrap();
        assert!(h200.len() > h100.len(), "the H200 holds more shapes");
        for s in &h200 {
            assert!(s.seconds > 0.0 && s.bytes > 0.0 && s.ops.iter().all(|o| o.seconds >= LAUNCH_FLOOR_S));
            let twin = h100
                .iter()
                .find(|o| (&o.model, o.batch, o.n_max, o.context) == (&s.model, s.batch, s.n_max, s.context));
            if let Some(o) = twin {
                assert!(o.seconds >= s.seconds, "{} b{} ctx {}", s.model, s.batch, s.context);
            }
        }
        // Verify-8 at 32K keys on the 8B shapes: within 10% of decode (the KV is read once for the 8 nodes).
        for model in ["Llama-3-8B", "Qwen3-8B"] {
            let get = |n| h200.iter().find(|s| s.model == model && s.batch == 1 && s.n_max == n && s.context == 32_768);
            let (d, v) = (get(1).unwrap(), get(8).unwrap());
            assert!(v.seconds / d.seconds <= 1.1, "{model}: {}", v.seconds / d.seconds);
        }
    }
}
