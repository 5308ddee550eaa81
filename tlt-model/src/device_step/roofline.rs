//! The roofline of the device decoder's step, op by op, from the very program `CudaLlama` runs
//! ([`StepProgram::record`] with a counting executor): bytes moved and FLOPs of every launch and GEMM at a shape, the
//! time each implies on a [`Hardware`] (the larger of bytes / bandwidth and FLOPs / peak, and at least a launch
//! floor), and their sum. `cargo xtask roofline` tabulates it for an H100 and an H200; `gpu-bench` prints each
//! measurement over its prediction at the bandwidth it measured in the same process, so a GPU run shows at once where
//! this model of the hardware is wrong. A prediction, never a measurement.

use half::bf16;
use serde::Serialize;
use tlt_kernels::cuda::plan::{
    row_tiles, splits_attention, Buf, GemmEx, Launch, SkinnyShape, SplitParts, ATTENTION_BLOCKS_PER_SM, MMA_ROWS,
};
use tlt_kernels::cuda::{CacheDims, TreeDims};
use tlt_kernels::AttnShape;

use super::{DeviceOps, LayerBufs, LinearBufs, StepBufs, StepMeta, StepProgram, WeightBufs};
use crate::{Error, LlamaConfig, Result};

/// The shortest time a launch takes in a replayed graph, assumed (a kernel's launch and ramp; stated, not measured).
pub const LAUNCH_FLOOR_S: f64 = 2e-6;

/// What the roofline knows of a device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Hardware {
    /// The device.
    pub name: &'static str,
    /// Memory bandwidth (bytes/s): the nominal figure, or the copy bandwidth measured on the device.
    pub bytes_per_s: f64,
    /// Dense bf16 tensor-core throughput (FLOP/s).
    pub flops: f64,
    /// Streaming multiprocessors (split attention aims for twice as many blocks).
    pub sms: usize,
    /// Device memory (bytes): shapes whose weights and KV cache exceed it are not predicted.
    pub memory: f64,
}

impl Hardware {
    /// H100 SXM: 3.35 TB/s HBM3, 800 TFLOP/s of dense bf16 (of 989 nominal), 132 SMs, 80 GB.
    pub const H100: Self = Self { name: "H100 SXM", bytes_per_s: 3.35e12, flops: 800e12, sms: 132, memory: 80e9 };
    /// H200: 4.8 TB/s HBM3e, the H100's compute (the same GH100 die), 141 GB.
    pub const H200: Self = Self { name: "H200", bytes_per_s: 4.8e12, flops: 800e12, sms: 132, memory: 141e9 };

    /// This hardware at another bandwidth (a copy bandwidth measured on the device).
    #[must_use]
    pub fn at_bandwidth(self, bytes_per_s: f64) -> Self {
        Self { bytes_per_s, ..self }
    }

    /// The hardware `gpu-bench` runs on: an H100's or H200's figures by name (an H100's for any other device), its
    /// multiprocessors and memory as reported, at the copy bandwidth measured in the same process.
    #[must_use]
    pub fn measured(name: &str, sms: usize, memory: usize, copy_bytes_per_s: f64) -> Self {
        let base = if name.contains("H200") { Self::H200 } else { Self::H100 };
        Self { sms: sms.max(1), memory: memory as f64, ..base.at_bandwidth(copy_bytes_per_s) }
    }
}

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
    /// Every op.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<OpCost>,
}

/// A counting executor: every op's bytes and FLOPs from the shapes (and the context it assumes).
struct Counter<'a> {
    cfg: &'a LlamaConfig,
    hw: Hardware,
    rows: usize,
    batch: usize,
    n_max: usize,
    context: usize,
    /// Chunks of split attention a row tile's keys span at this context (not the grid's: blocks past them return
    /// at once).
    n_splits: usize,
    ops: Vec<OpCost>,
}

impl Counter<'_> {
    fn push(&mut self, op: String, bytes: f64, flops: f64) {
        let (tb, tf) = (bytes / self.hw.bytes_per_s, flops / self.hw.flops);
        let seconds = tb.max(tf).max(LAUNCH_FLOOR_S);
        let bound = if seconds == LAUNCH_FLOOR_S {
            "launch"
        } else if tb >= tf {
            "memory"
        } else {
            "compute"
        };
        self.ops.push(OpCost { op, bytes, flops, seconds, bound });
    }
}

impl DeviceOps for Counter<'_> {
    fn launch(&mut self, l: &Launch) -> Result<()> {
        if let Some(g) = SkinnyShape::of(l) {
            // Named as a GEMM: the weights' part of the step's split.
            self.push(format!("gemm skinny {} x {} x {}", g.m, g.n, g.k), g.bytes(), g.flops());
            return Ok(());
        }
        let c = self.cfg;
        let (rows, h, i) = (self.rows as f64, c.hidden_size as f64, c.intermediate_size as f64);
        let (qd, kvd, heads, hd) =
            (c.q_dim() as f64, c.kv_dim() as f64, c.num_attention_heads as f64, c.head_dim() as f64);
        let nodes = self.batch as f64 * self.n_max as f64;
        let keys = (self.context + self.n_max) as f64;
        let parts = nodes * heads * self.n_splits as f64 * (hd + 2.0) * 4.0;
        let (bytes, flops) = match l.kernel {
            "embed_rows_bf16" => (rows * h * 6.0, 0.0),
            "rms_norm_bf16" => (rows * h * 6.0 + h * 2.0, rows * h * 4.0),
            "add_rms_norm_bf16" => (rows * h * 12.0 + h * 2.0, rows * h * 5.0),
            "qkv_rope_kv_write_bf16" => {
                (rows * (qd + 2.0 * kvd) * 2.0 + rows * (qd + 2.0 * kvd) * 2.0, rows * (qd + kvd) * 6.0)
            }
            // Every row tile of a sequence reads its K and V (counted once per sequence: a chunk's row tiles run
            // side by side and share it through L2), its q, and writes its output or its chunks' partials. FLOPs:
            // the tensor-core products of 16-row tiles, Q K^T once and P V three times (P in three bf16 parts).
            // The 16-key tiles past the prefix (the one holding its end, and the nodes') run once per node of a
            // row tile (a node's keys gathered by logical position, for batch invariance): their keys are read
            // per node and their products repeated per node.
            "attention_split_bf16" => {
                let group = c.num_attention_heads / c.kv_heads().max(1);
                let per_tile = (MMA_ROWS / group.clamp(1, MMA_ROWS)).min(self.n_max).max(1) as f64;
                let tail = ((self.context % 16 + self.n_max).div_ceil(16) * 16) as f64;
                let kv = self.batch as f64 * ((keys - tail).max(0.0) + tail * self.n_max as f64) * kvd * 2.0 * 2.0;
                let tiles = (self.batch * c.kv_heads() * row_tiles(self.n_max, group)) as f64;
                // With several chunks the partials are written, then read back by each tile's last block.
                let out = if self.n_splits > 1 { 2.0 * parts } else { 0.0 } + nodes * heads * hd * 2.0;
                let key_tiles = (keys - tail).max(0.0) + tail * per_tile;
                (kv + nodes * qd * 2.0 + out, tiles * MMA_ROWS as f64 * key_tiles * hd * 2.0 * 4.0)
            }
            // One block per (KV head, node): the K and V are read once per node (L2 shares them).
            "tree_attention_bf16" => {
                let kv = self.batch as f64 * keys * kvd * 2.0 * 2.0;
                (kv + nodes * qd * 4.0, nodes * heads * keys * hd * 4.0)
            }
            "silu_mul_packed_bf16" => (rows * i * 6.0, rows * i * 5.0),
            "bias_add_bf16" | "add_bf16_to_f32" | "silu_mul_bf16" | "head_rms_norm_bf16" | "rope_kv_write_bf16" => {
                (rows * h * 6.0, rows * h)
            }
            other => return Err(Error::InvalidInput(format!("roofline: no cost model for `{other}`"))),
        };
        self.push(l.kernel.to_string(), bytes, flops);
        Ok(())
    }

    fn gemm(&mut self, g: &GemmEx) -> Result<()> {
        let (m, n, k) = (g.m as f64, g.n as f64, g.k as f64);
        let out = if g.c_f32 { 4.0 } else { 2.0 };
        let bytes = (m * k + k * n) * 2.0 + m * n * out;
        // cuBLAS's m is the output features, n the rows (column-major yᵀ = op(w) · xᵀ).
        self.push(format!("gemm {} x {} x {}", g.n, g.m, g.k), bytes, 2.0 * m * n * k);
        Ok(())
    }

    fn copy_f32(&mut self, src: Buf<f32>, _dst: Buf<f32>) -> Result<()> {
        self.push("copy".into(), src.len() as f64 * 8.0, 0.0);
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

/// Bytes of `cfg`'s bf16 weights and of a KV cache of `batch` sequences of `len` positions.
#[must_use]
pub fn memory_bytes(cfg: &LlamaConfig, batch: usize, len: usize) -> f64 {
    let (h, i, qd, kvd, l) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim(), cfg.num_hidden_layers);
    let layer = h * (qd + 2 * kvd) + qd * h + 3 * h * i;
    let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
    let weights = 2.0 * (l * layer + heads * cfg.vocab_size * h) as f64;
    weights + (batch * len * kvd * 2 * 2 * l) as f64
}

/// The predicted step of `cfg` (named `name`) on `hw` for `batch` sequences of `n_max` new tokens over `context`
/// committed keys.
///
/// # Errors
/// When the program does not record at this shape (a configuration the device decoder refuses).
pub fn step(
    name: &str,
    cfg: &LlamaConfig,
    hw: Hardware,
    batch: usize,
    n_max: usize,
    context: usize,
) -> Result<StepCost> {
    let (h, i, qd, kvd) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim());
    let bias = cfg.attention_bias()?.qkv;
    let hd = cfg.head_dim();
    let layer = LayerBufs {
        in_norm: fake(h),
        post_norm: fake(h),
        qkv: linear(qd + 2 * kvd, h, bias),
        o: linear(h, qd, false),
        gate_up: linear(2 * i, h, false),
        down: linear(h, i, false),
        qk_norm: (cfg.model_type == "qwen3").then(|| (fake(hd), fake(hd))),
    };
    let w = WeightBufs {
        embed: fake(cfg.vocab_size * h),
        head: (!cfg.tie_word_embeddings).then(|| fake(cfg.vocab_size * h)),
        norm: fake(h),
        layers: vec![layer; cfg.num_hidden_layers],
        inv_freq: fake(hd / 2),
    };
    let attn = AttnShape::new(cfg.num_attention_heads, cfg.kv_heads(), hd);
    let max_len = context + n_max;
    let cache = CacheDims { layers: cfg.num_hidden_layers, slots: batch, max_len, attn };
    let program = StepProgram {
        cfg,
        cache,
        k_cache: fake(cache.len()),
        v_cache: fake(cache.len()),
        w: &w,
        layer_taps: &[],
        target_blocks: hw.sms * ATTENTION_BLOCKS_PER_SM,
        split_by_rows: false,
    };
    let rows = batch * n_max;
    let tree = TreeDims { batch, n_max };
    let chunks = program.chunks(batch, n_max);
    // Fixed-size chunks: the context decides how many have keys.
    let n_splits =
        if splits_attention(attn) { (context + n_max).div_ceil(chunks.chunk_len).min(chunks.n_splits) } else { 1 };
    let [po, pml, pa] = chunks.part_lens(tree, attn);
    let meta = StepMeta::new(batch, n_max, n_max > 1);
    let b = StepBufs {
        batch,
        n_max,
        meta: meta.bufs(fake(meta.bytes()))?,
        x: fake(rows * h),
        xn: fake(rows * h),
        qkv: fake(rows * (qd + 2 * kvd)),
        q: fake(rows * qd),
        attn: fake(rows * qd),
        parts: SplitParts { o: fake(po), ml: fake(pml), arrivals: fake(pa) },
        o: fake(rows * h),
        gate_up: fake(rows * 2 * i),
        act: fake(rows * i),
        logits: fake(rows * cfg.vocab_size),
        taps: Vec::new(),
    };
    let mut counter = Counter { cfg, hw, rows, batch, n_max, context, n_splits, ops: Vec::new() };
    program.record(&mut counter, &b)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn llama8b() -> LlamaConfig {
        let mut c = LlamaConfig::tiny(128_256, 4096, 32);
        c.intermediate_size = 14_336;
        c.num_attention_heads = 32;
        c.num_key_value_heads = Some(8);
        c
    }

    #[test]
    fn decode_of_an_8b_model_is_its_weights_over_the_bandwidth() {
        let c = llama8b();
        let s = step("Llama-3-8B", &c, Hardware::H100, 1, 1, 512).unwrap();
        // Batch-1 decode reads the ~16 GB of weights: about 4.8 ms at 3.35 TB/s, 3.4 ms at 4.8 TB/s.
        assert!((s.bytes / 1e9 - 16.0).abs() < 1.0, "{} GB", s.bytes / 1e9);
        assert!((memory_bytes(&c, 0, 0) - 16.06e9).abs() < 0.1e9, "{}", memory_bytes(&c, 0, 0));
        assert!(s.split[0] > s.split[1] + s.split[2]);
        let h200 = step("Llama-3-8B", &c, Hardware::H200, 1, 1, 512).unwrap();
        assert!((s.seconds / h200.seconds - 4.8 / 3.35).abs() < 0.1, "{} vs {}", s.seconds, h200.seconds);
        // Verify-8 reads the KV cache once: at 32K keys it costs the decode step plus its extra FLOPs only.
        let d = step("Llama-3-8B", &c, Hardware::H200, 1, 1, 32_768).unwrap();
        let v = step("Llama-3-8B", &c, Hardware::H200, 1, 8, 32_768).unwrap();
        assert!(v.seconds / d.seconds < 1.1, "verify-8 / decode-1 {}", v.seconds / d.seconds);
        assert!(d.split[1] > 0.15 * d.seconds, "attention at 32K is a fifth of the step: {:?}", d.split);
    }
}
