//! `cargo xtask roofline`: the predicted H100 time of the device decoder's step, kernel by kernel, from the very
//! program `CudaLlama` runs ([`StepProgram::record`] with a counting executor): bytes moved and FLOPs of every
//! launch and GEMM at the benchmark shapes, the time each implies at 3.35 TB/s and 800 dense bf16 TFLOP/s (the
//! larger of the two, and at least a launch floor), and their sum. A prediction to read the first GPU run against,
//! not a measurement. Writes `target/bench/roofline.json` and `.md`.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use half::bf16;
use serde::Serialize;
use tlt_kernels::cuda::plan::{Buf, GemmEx, Launch};
use tlt_kernels::cuda::{CacheDims, TreeDims};
use tlt_kernels::AttnShape;
use tlt_model::device_step::{DeviceOps, LayerBufs, LinearBufs, StepBufs, StepMeta, StepProgram, WeightBufs};
use tlt_model::LlamaConfig;

/// H100 SXM: HBM3 bandwidth (bytes/s).
pub const H100_BYTES_PER_S: f64 = 3.35e12;
/// H100 SXM: dense bf16 tensor-core throughput (FLOP/s).
pub const H100_FLOPS: f64 = 800e12;
/// The shortest time a launch takes in a replayed graph, assumed (a kernel's launch and ramp; stated, not measured).
pub const LAUNCH_FLOOR_S: f64 = 2e-6;
/// Multiprocessors of an H100 SXM (split attention aims for twice as many blocks).
const H100_SMS: usize = 132;

/// One launch or GEMM of a step and its roofline.
#[derive(Debug, Clone, Serialize)]
pub struct OpCost {
    /// The kernel, or `gemm m x n x k`.
    pub op: String,
    /// Bytes read and written.
    pub bytes: f64,
    /// Floating-point operations.
    pub flops: f64,
    /// `max(bytes / bandwidth, flops / peak, floor)`.
    pub seconds: f64,
    /// `memory`, `compute` or `launch` (which term set the time).
    pub bound: &'static str,
}

/// One step shape's prediction.
#[derive(Debug, Clone, Serialize)]
pub struct StepCost {
    /// The model.
    pub model: String,
    /// Sequences.
    pub batch: usize,
    /// New tokens per sequence (1: decode; 8: a verify of 8 nodes).
    pub n_max: usize,
    /// Keys each sequence attends to.
    pub context: usize,
    /// Launches and GEMMs.
    pub launches: usize,
    /// Bytes of the whole step.
    pub bytes: f64,
    /// FLOPs of the whole step.
    pub flops: f64,
    /// Predicted seconds: the sum of the ops' roofline times.
    pub seconds: f64,
    /// The part of `seconds` in GEMMs (weights), attention (KV cache) and everything else.
    pub split: [f64; 3],
    /// Every op (only kept for the shapes shown per kernel).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<OpCost>,
}

/// The models of the benchmark shapes.
pub fn models() -> Vec<(&'static str, LlamaConfig)> {
    let cfg = |name: &str, h, i, l, heads, kv, hd, vocab, tied: bool, model_type: &str| {
        let mut c = LlamaConfig::tiny(vocab, h, l);
        c.model_type = model_type.into();
        c.intermediate_size = i;
        c.num_attention_heads = heads;
        c.num_key_value_heads = Some(kv);
        c.head_dim = Some(hd);
        c.tie_word_embeddings = tied;
        (name.to_string(), c)
    };
    [
        cfg("SmolLM2-135M", 576, 1536, 30, 9, 3, 64, 49_152, true, "llama"),
        cfg("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 128, 151_936, true, "qwen2"),
        cfg("Llama-3-8B", 4096, 14_336, 32, 32, 8, 128, 128_256, false, "llama"),
    ]
    .into_iter()
    .map(|(n, c)| (Box::leak(n.into_boxed_str()) as &'static str, c))
    .collect()
}

/// A counting executor: every op's bytes and FLOPs from the shapes (and the context it assumes).
struct Counter<'a> {
    cfg: &'a LlamaConfig,
    rows: usize,
    batch: usize,
    n_max: usize,
    context: usize,
    n_splits: usize,
    ops: Vec<OpCost>,
}

fn cost(op: String, bytes: f64, flops: f64) -> OpCost {
    let (tb, tf) = (bytes / H100_BYTES_PER_S, flops / H100_FLOPS);
    let seconds = tb.max(tf).max(LAUNCH_FLOOR_S);
    let bound = if seconds == LAUNCH_FLOOR_S {
        "launch"
    } else if tb >= tf {
        "memory"
    } else {
        "compute"
    };
    OpCost { op, bytes, flops, seconds, bound }
}

impl DeviceOps for Counter<'_> {
    fn launch(&mut self, l: &Launch) -> tlt_model::Result<()> {
        let c = self.cfg;
        let (rows, h, i) = (self.rows as f64, c.hidden_size as f64, c.intermediate_size as f64);
        let (qd, kvd, heads, hd) =
            (c.q_dim() as f64, c.kv_dim() as f64, c.num_attention_heads as f64, c.head_dim() as f64);
        let nodes = self.batch as f64 * self.n_max as f64;
        let keys = self.context as f64;
        let (bytes, flops) = match l.kernel {
            "embed_rows_bf16" => (rows * h * 6.0, 0.0),
            "rms_norm_bf16" => (rows * h * 6.0 + h * 2.0, rows * h * 4.0),
            "add_rms_norm_bf16" => (rows * h * 12.0 + h * 2.0, rows * h * 5.0),
            "qkv_rope_kv_write_bf16" => {
                (rows * (qd + 2.0 * kvd) * 2.0 + rows * (qd + 2.0 * kvd) * 2.0, rows * (qd + kvd) * 6.0)
            }
            // Each node reads its sequence's K and V rows (shared by a tree's nodes through the cache and L2: counted
            // once per sequence), its q, and writes its output or its chunks' partials.
            "attention_split_bf16" | "tree_attention_bf16" => {
                let kv = self.batch as f64 * keys * kvd * 2.0 * 2.0;
                let parts = if self.n_splits > 1 {
                    nodes * heads * self.n_splits as f64 * (hd + 2.0) * 4.0
                } else {
                    nodes * heads * hd * 2.0
                };
                (kv + nodes * qd * 2.0 + parts, nodes * heads * keys * hd * 4.0)
            }
            "attention_combine_bf16" => (
                nodes * heads * self.n_splits as f64 * (hd + 2.0) * 4.0 + nodes * qd * 2.0,
                nodes * heads * self.n_splits as f64 * hd * 3.0,
            ),
            "silu_mul_packed_bf16" => (rows * i * 6.0, rows * i * 5.0),
            "bias_add_bf16" | "add_bf16_to_f32" | "silu_mul_bf16" | "head_rms_norm_bf16" | "rope_kv_write_bf16" => {
                (rows * h * 6.0, rows * h)
            }
            other => return Err(tlt_model::Error::InvalidInput(format!("roofline: no cost model for `{other}`"))),
        };
        self.ops.push(cost(l.kernel.to_string(), bytes, flops));
        Ok(())
    }

    fn gemm(&mut self, g: &GemmEx) -> tlt_model::Result<()> {
        let (m, n, k) = (g.m as f64, g.n as f64, g.k as f64);
        let out = if g.c_f32 { 4.0 } else { 2.0 };
        let bytes = (m * k + k * n) * 2.0 + m * n * out;
        // cuBLAS's m is the output features, n the rows (column-major yᵀ = op(w) · xᵀ).
        self.ops.push(cost(format!("gemm {} x {} x {}", g.n, g.m, g.k), bytes, 2.0 * m * n * k));
        Ok(())
    }

    fn copy_f32(&mut self, src: Buf<f32>, _dst: Buf<f32>) -> tlt_model::Result<()> {
        self.ops.push(cost("copy".into(), src.len() as f64 * 8.0, 0.0));
        Ok(())
    }
}

/// Descriptors of the right lengths at made-up addresses: the plans check lengths only.
fn fake<T>(n: usize) -> Buf<T> {
    Buf::new(0x1000_0000, n)
}

fn linear(out: usize, inp: usize, bias: bool) -> LinearBufs {
    LinearBufs { w: fake::<bf16>(out * inp), b: bias.then(|| fake(out)), out, inp }
}

/// The predicted step of `cfg` for `batch` sequences of `n_max` new tokens over `context` keys.
pub(crate) fn step(name: &str, cfg: &LlamaConfig, batch: usize, n_max: usize, context: usize) -> Result<StepCost> {
    let (h, i, qd, kvd) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim());
    let bias = cfg.attention_bias()?.qkv;
    let layer = LayerBufs {
        in_norm: fake(h),
        post_norm: fake(h),
        qkv: linear(qd + 2 * kvd, h, bias),
        o: linear(h, qd, false),
        gate_up: linear(2 * i, h, false),
        down: linear(h, i, false),
        qk_norm: None,
    };
    let w = WeightBufs {
        embed: fake(cfg.vocab_size * h),
        head: (!cfg.tie_word_embeddings).then(|| fake(cfg.vocab_size * h)),
        norm: fake(h),
        layers: vec![layer; cfg.num_hidden_layers],
        inv_freq: fake(cfg.head_dim() / 2),
    };
    let attn = AttnShape::new(cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
    let max_len = context + n_max;
    let cache = CacheDims { layers: cfg.num_hidden_layers, slots: batch, max_len, attn };
    let program = StepProgram {
        cfg,
        cache,
        k_cache: fake(cache.len()),
        v_cache: fake(cache.len()),
        w: &w,
        layer_taps: &[],
        target_blocks: 2 * H100_SMS,
    };
    let rows = batch * n_max;
    let tree = TreeDims { batch, n_max };
    let chunks = program.chunks(batch, n_max);
    let (po, pml) = chunks.part_lens(tree, cfg.num_attention_heads, cfg.head_dim());
    let b = StepBufs {
        batch,
        n_max,
        meta: {
            let meta = StepMeta::new(batch, n_max, n_max > 1);
            meta.bufs(fake(meta.bytes())).map_err(|e| anyhow::anyhow!("{e}"))?
        },
        x: fake(rows * h),
        xn: fake(rows * h),
        qkv: fake(rows * (qd + 2 * kvd)),
        q: fake(rows * qd),
        attn: fake(rows * qd),
        parts: (fake(po), fake(pml)),
        o: fake(rows * h),
        gate_up: fake(rows * 2 * i),
        act: fake(rows * i),
        logits: fake(rows * cfg.vocab_size),
        taps: Vec::new(),
    };
    let mut counter = Counter { cfg, rows, batch, n_max, context, n_splits: chunks.n_splits, ops: Vec::new() };
    program.record(&mut counter, &b).map_err(|e| anyhow::anyhow!("{e}"))?;
    let ops = counter.ops;
    let sum = |f: &dyn Fn(&OpCost) -> bool| ops.iter().filter(|o| f(o)).map(|o| o.seconds).sum::<f64>();
    let gemm = sum(&|o| o.op.starts_with("gemm"));
    let attn_s = sum(&|o| o.op.starts_with("attention") || o.op.starts_with("tree_attention"));
    let seconds = sum(&|_| true);
    Ok(StepCost {
        model: name.to_string(),
        batch,
        n_max,
        context,
        launches: ops.len(),
        bytes: ops.iter().map(|o| o.bytes).sum(),
        flops: ops.iter().map(|o| o.flops).sum(),
        seconds,
        split: [gemm, attn_s, seconds - gemm - attn_s],
        ops,
    })
}

/// Every benchmark shape: 3 models x batch 1, 8, 64, 256 x context 512, 4,096 (decode), and batch-1 verifies of 8
/// nodes.
pub fn all() -> Result<Vec<StepCost>> {
    let mut out = Vec::new();
    for (name, cfg) in models() {
        for context in [512, 4096] {
            for batch in [1, 8, 64, 256] {
                out.push(step(name, &cfg, batch, 1, context)?);
            }
            out.push(step(name, &cfg, 1, 8, context)?);
        }
    }
    Ok(out)
}

fn gb(x: f64) -> String {
    format!("{:.3}", x / 1e9)
}

/// Runs the suite: JSON and markdown under `dir`.
pub fn run(dir: &Path) -> Result<Vec<StepCost>> {
    let steps = all()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Roofline of the device decode step on an H100 (predicted, not measured)\n\nFrom the program `CudaLlama` runs \
         (`cargo xtask roofline`): per op, bytes and FLOPs from its shapes, time = max(bytes / {:.2} TB/s, FLOPs / {:.0} \
         TFLOP/s, {:.0} us launch floor), summed. Attention reads each sequence's K and V once per layer; GEMMs read \
         their weights once per call (no reuse across layers). Split attention aims for {} blocks.\n",
        H100_BYTES_PER_S / 1e12,
        H100_FLOPS / 1e12,
        LAUNCH_FLOOR_S * 1e6,
        2 * H100_SMS
    );
    md.push_str("| model | batch | new tokens | context | launches | GB moved | GFLOP | predicted step (us) | GEMMs / attention / other (us) |\n|---|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for s in &steps {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} / {:.1} / {:.1} |",
            s.model,
            s.batch,
            s.n_max,
            s.context,
            s.launches,
            gb(s.bytes),
            s.flops / 1e9,
            s.seconds * 1e6,
            s.split[0] * 1e6,
            s.split[1] * 1e6,
            s.split[2] * 1e6
        );
    }
    for (model, batch, n_max, context) in
        [("SmolLM2-135M", 1, 1, 512), ("SmolLM2-135M", 1, 1, 4096), ("Llama-3-8B", 64, 1, 4096)]
    {
        let Some(s) =
            steps.iter().find(|s| (s.model.as_str(), s.batch, s.n_max, s.context) == (model, batch, n_max, context))
        else {
            continue;
        };
        let _ =
            writeln!(md, "\n## {model}, batch {batch}, context {context}: the ops of the first layer and the head\n");
        md.push_str("| op | bytes | FLOPs | time (us) | bound |\n|---|---:|---:|---:|---|\n");
        let layers = models().into_iter().find(|m| m.0 == model).map_or(1, |m| m.1.num_hidden_layers.max(1));
        let per_layer = (s.ops.len() - 3) / layers;
        for o in s.ops.iter().take(2 + per_layer).chain(s.ops.last()) {
            let _ =
                writeln!(md, "| {} | {:.3e} | {:.3e} | {:.2} | {} |", o.op, o.bytes, o.flops, o.seconds * 1e6, o.bound);
        }
    }
    let json: Vec<StepCost> = steps.iter().map(|s| StepCost { ops: Vec::new(), ..s.clone() }).collect();
    std::fs::write(dir.join("roofline.json"), serde_json::to_string_pretty(&json)?)?;
    std::fs::write(dir.join("roofline.md"), &md)?;
    println!("{md}");
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_of_every_shape_has_a_cost_and_decode_is_memory_bound() {
        let steps = all().unwrap();
        assert_eq!(steps.len(), 3 * 2 * 5);
        for s in &steps {
            assert!(s.seconds > 0.0 && s.bytes > 0.0 && s.ops.iter().all(|o| o.seconds >= LAUNCH_FLOOR_S));
        }
        // Batch-1 decode of the 8B model reads its ~16 GB of weights: about 4.8 ms at 3.35 TB/s.
        let s =
            steps.iter().find(|s| s.model == "Llama-3-8B" && s.batch == 1 && s.n_max == 1 && s.context == 512).unwrap();
        assert!((s.bytes / 1e9 - 16.0).abs() < 1.0, "{} GB", s.bytes / 1e9);
        assert!(s.split[0] > s.split[1] + s.split[2]);
    }
}
