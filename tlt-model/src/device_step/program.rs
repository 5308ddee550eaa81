//! The decoder forward as a program ([`StepProgram::record`]).

use half::bf16;
use tlt_kernels::cuda::plan::{self, Buf, GemmEx, GemmY, Launch, RowBufs, SeqBufs};
use tlt_kernels::cuda::{CacheDims, TreeDims};

use crate::config::LlamaConfig;
use crate::{Error, Result};

/// What executes a step program: a CUDA stream, or the simulated device in tests.
pub trait DeviceOps {
    /// Runs one kernel launch.
    ///
    /// # Errors
    /// The executor's.
    fn launch(&mut self, launch: &Launch) -> Result<()>;

    /// Runs one GEMM (a `cublasGemmEx` call).
    ///
    /// # Errors
    /// The executor's.
    fn gemm(&mut self, gemm: &GemmEx) -> Result<()>;

    /// Copies `src` into `dst` (same length), device to device.
    ///
    /// # Errors
    /// The executor's.
    fn copy_f32(&mut self, src: Buf<f32>, dst: Buf<f32>) -> Result<()>;
}

/// A linear layer's buffers: `w` `[out, inp]` bf16 and an optional bias `[out]`.
#[derive(Debug, Clone, Copy)]
pub struct LinearBufs {
    /// Weights.
    pub w: Buf<bf16>,
    /// Bias.
    pub b: Option<Buf<bf16>>,
    /// Output features.
    pub out: usize,
    /// Input features.
    pub inp: usize,
}

/// One decoder layer's weights.
#[derive(Debug, Clone)]
pub struct LayerBufs {
    /// The attention input norm.
    pub in_norm: Buf<bf16>,
    /// The MLP input norm.
    pub post_norm: Buf<bf16>,
    /// Query projection.
    pub q: LinearBufs,
    /// Key projection.
    pub k: LinearBufs,
    /// Value projection.
    pub v: LinearBufs,
    /// Attention output projection.
    pub o: LinearBufs,
    /// MLP gate projection.
    pub gate: LinearBufs,
    /// MLP up projection.
    pub up: LinearBufs,
    /// MLP down projection.
    pub down: LinearBufs,
    /// Qwen3's per-head q and k norms.
    pub qk_norm: Option<(Buf<bf16>, Buf<bf16>)>,
}

/// The model's weights on the device.
#[derive(Debug, Clone)]
pub struct WeightBufs {
    /// The embedding `[vocab, hidden]`.
    pub embed: Buf<bf16>,
    /// The LM head (`None`: tied to the embedding).
    pub head: Option<Buf<bf16>>,
    /// The final norm.
    pub norm: Buf<bf16>,
    /// The decoder layers.
    pub layers: Vec<LayerBufs>,
    /// RoPE inverse frequencies `[head_dim / 2]` f64.
    pub inv_freq: Buf<f64>,
}

/// The buffers of one step shape: the metadata the host writes ([`super::StepLayout`], padded) and the
/// activations.
#[derive(Debug, Clone)]
pub struct StepBufs {
    /// Sequences (padded).
    pub batch: usize,
    /// Rows per sequence.
    pub n_max: usize,
    /// `[rows]` tokens.
    pub tokens: Buf<i32>,
    /// `[rows]` cache slots (-1: padding).
    pub row_slot: Buf<i32>,
    /// `[rows]` RoPE positions.
    pub row_pos: Buf<i32>,
    /// `[rows]` cache positions.
    pub row_dst: Buf<i32>,
    /// `[batch]` cache slots.
    pub seq_slot: Buf<i32>,
    /// `[batch]` committed positions.
    pub seq_prefix: Buf<i32>,
    /// `[batch]` new tokens.
    pub seq_nodes: Buf<i32>,
    /// `[rows]` ancestor masks (tree shapes).
    pub anc: Option<Buf<u64>>,
    /// `[rows, hidden]` f32: the residual stream.
    pub x: Buf<f32>,
    /// `[rows, hidden]`: normalised rows (the final ones are the LM head's input).
    pub xn: Buf<bf16>,
    /// `[rows, q_dim]`.
    pub q: Buf<bf16>,
    /// `[rows, kv_dim]`.
    pub k: Buf<bf16>,
    /// `[rows, kv_dim]`.
    pub v: Buf<bf16>,
    /// `[rows, q_dim]`: attention outputs.
    pub attn: Buf<bf16>,
    /// `[rows, hidden]`: a layer's output projections.
    pub o: Buf<bf16>,
    /// `[rows, intermediate]`.
    pub gate: Buf<bf16>,
    /// `[rows, intermediate]`.
    pub up: Buf<bf16>,
    /// `[rows, vocab]` f32.
    pub logits: Buf<f32>,
    /// `[rows, hidden]` f32 each: the residual stream entering the tapped layers.
    pub taps: Vec<Buf<f32>>,
}

/// Everything a forward reads besides its step buffers.
#[derive(Debug, Clone, Copy)]
pub struct StepProgram<'a> {
    /// The model.
    pub cfg: &'a LlamaConfig,
    /// The KV cache's shape.
    pub cache: CacheDims,
    /// The K cache `[layers, slots, max_len, kv_dim]`.
    pub k_cache: Buf<bf16>,
    /// The V cache, shaped as the K cache.
    pub v_cache: Buf<bf16>,
    /// The weights.
    pub w: &'a WeightBufs,
    /// The layers whose input residual stream is copied into [`StepBufs::taps`] (`num_layers`: the last layer's
    /// output), in tap order.
    pub layer_taps: &'a [usize],
}

impl StepProgram<'_> {
    fn linear(&self, ops: &mut dyn DeviceOps, rows: usize, x: Buf<bf16>, l: &LinearBufs, y: Buf<bf16>) -> Result<()> {
        ops.gemm(&plan::gemm(rows, l.out, l.inp, x, l.w, GemmY::Bf16(y))?)?;
        if let Some(b) = l.b {
            ops.launch(&plan::bias_add(rows, y, b)?)?;
        }
        Ok(())
    }

    /// Copies the residual stream into every tap of layer input `layer`.
    fn tap(&self, ops: &mut dyn DeviceOps, b: &StepBufs, layer: usize) -> Result<()> {
        for (j, _) in self.layer_taps.iter().enumerate().filter(|(_, &l)| l == layer) {
            let dst = *b.taps.get(j).ok_or_else(|| Error::InvalidInput(format!("tap buffer {j} is missing")))?;
            ops.copy_f32(b.x, dst)?;
        }
        Ok(())
    }

    /// Issues the whole forward: embedding, every layer (RoPE + cache write, attention, MLP) and the LM head into
    /// `b.logits`. Launches, GEMMs and device copies only: nothing allocates, synchronises or reads the host, so a
    /// CUDA stream can capture it into a graph.
    ///
    /// # Errors
    /// A plan's shape check, or the executor's error.
    pub fn record(&self, ops: &mut dyn DeviceOps, b: &StepBufs) -> Result<()> {
        let cfg = self.cfg;
        let w = self.w;
        let rows = b.batch * b.n_max;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let tree = TreeDims { batch: b.batch, n_max: b.n_max };
        ops.launch(&plan::embed_rows(rows, h, w.embed, b.tokens, b.x)?)?;
        for (li, lw) in w.layers.iter().enumerate() {
            self.tap(ops, b, li)?;
            ops.launch(&plan::rms_norm(rows, h, eps, b.x, lw.in_norm, b.xn)?)?;
            self.linear(ops, rows, b.xn, &lw.q, b.q)?;
            self.linear(ops, rows, b.xn, &lw.k, b.k)?;
            self.linear(ops, rows, b.xn, &lw.v, b.v)?;
            if let Some((qn, kn)) = lw.qk_norm {
                // Qwen3: every head's query and key vector normalised before RoPE.
                for (x, n) in [(b.q, qn), (b.k, kn)] {
                    if let Some(l) = plan::head_rms_norm(cfg.head_dim(), eps, x, n)? {
                        ops.launch(&l)?;
                    }
                }
            }
            let meta = RowBufs { slot: b.row_slot, pos: b.row_pos, dst: b.row_dst };
            let (kc, vc) = (self.k_cache, self.v_cache);
            ops.launch(&plan::rope_kv_write(self.cache, li, rows, b.q, b.k, b.v, kc, vc, meta, w.inv_freq)?)?;
            let seq = SeqBufs { slot: b.seq_slot, prefix_len: b.seq_prefix, n_nodes: b.seq_nodes };
            ops.launch(&plan::tree_attention(self.cache, li, tree, b.q, kc, vc, b.attn, seq, b.anc)?)?;
            self.linear(ops, rows, b.attn, &lw.o, b.o)?;
            ops.launch(&plan::add_to_residual(b.x, b.o)?)?;
            ops.launch(&plan::rms_norm(rows, h, eps, b.x, lw.post_norm, b.xn)?)?;
            self.linear(ops, rows, b.xn, &lw.gate, b.gate)?;
            self.linear(ops, rows, b.xn, &lw.up, b.up)?;
            ops.launch(&plan::silu_mul(b.gate, b.up)?)?;
            self.linear(ops, rows, b.gate, &lw.down, b.o)?;
            ops.launch(&plan::add_to_residual(b.x, b.o)?)?;
        }
        self.tap(ops, b, w.layers.len())?;
        ops.launch(&plan::rms_norm(rows, h, eps, b.x, w.norm, b.xn)?)?;
        let head = w.head.unwrap_or(w.embed);
        ops.gemm(&plan::gemm(rows, cfg.vocab_size, h, b.xn, head, GemmY::F32(b.logits))?)?;
        Ok(())
    }
}
