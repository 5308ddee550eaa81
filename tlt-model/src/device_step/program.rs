//! The decoder forward as a program ([`StepProgram::record`]).

use half::bf16;
use tlt_kernels::cuda::plan::{
    self, Buf, Chunks, GemmEx, GemmY, Launch, RowBufs, SeqBufs, SkinnyIn, SkinnyOut, SplitParts,
};
use tlt_kernels::cuda::{CacheDims, TreeDims, MAX_TREE_NODES};

use super::MetaBufs;
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

/// One decoder layer's weights, with the projections that read the same input concatenated (one GEMM each).
#[derive(Debug, Clone)]
pub struct LayerBufs {
    /// The attention input norm.
    pub in_norm: Buf<bf16>,
    /// The MLP input norm.
    pub post_norm: Buf<bf16>,
    /// q, k and v projections stacked: `[q_dim + 2 kv_dim, hidden]`, with their biases stacked likewise (Qwen2).
    pub qkv: LinearBufs,
    /// Attention output projection.
    pub o: LinearBufs,
    /// MLP gate and up projections stacked: `[2 intermediate, hidden]`.
    pub gate_up: LinearBufs,
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
    /// The metadata the host writes ([`super::StepMeta`]).
    pub meta: MetaBufs,
    /// `[rows, hidden]` f32: the residual stream.
    pub x: Buf<f32>,
    /// `[rows, hidden]`: normalised rows (the final ones are the LM head's input).
    pub xn: Buf<bf16>,
    /// `[rows, q_dim + 2 kv_dim]`: the fused q/k/v projection's output.
    pub qkv: Buf<bf16>,
    /// `[rows, q_dim]`: the rotated queries.
    pub q: Buf<bf16>,
    /// `[rows, q_dim]`: attention outputs.
    pub attn: Buf<bf16>,
    /// Split attention's partial outputs, (max, sum) per chunk and arrival counters (zeroed once)
    /// ([`tlt_kernels::cuda::plan::Chunks::part_lens`]; empty with one chunk).
    pub parts: SplitParts,
    /// `[rows, hidden]`: a layer's output projections.
    pub o: Buf<bf16>,
    /// `[rows, 2 intermediate]`: the fused gate/up projection's output.
    pub gate_up: Buf<bf16>,
    /// `[rows, intermediate]`: the MLP's activation.
    pub act: Buf<bf16>,
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
    /// Blocks of split attention resident at once on the device (`GpuInfo::target_blocks`; [`Chunks::for_cache`]).
    pub target_blocks: usize,
    /// The negative control of the batch-invariance tests, never set in production: the batch-invariant GEMM's K
    /// split chosen from the row count (8 warps for one row, 1 for more), which must break the tests.
    pub split_by_rows: bool,
}

impl StepProgram<'_> {
    /// `y = x · wᵀ`, with the bias added when `bias` (else the caller's epilogue adds it).
    fn linear(
        &self,
        ops: &mut dyn DeviceOps,
        rows: usize,
        x: Buf<bf16>,
        l: &LinearBufs,
        y: Buf<bf16>,
        bias: bool,
    ) -> Result<()> {
        ops.gemm(&plan::gemm(rows, l.out, l.inp, x, l.w, GemmY::Bf16(y))?)?;
        if let (Some(b), true) = (l.b, bias) {
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

    /// The attention chunking of step shape (`_batch`, `_n_max`): the cache's ([`Chunks::for_cache`]), the same for
    /// every batch and tree, so a row's attention bits do not depend on the rows beside it.
    #[must_use]
    pub fn chunks(&self, _batch: usize, _n_max: usize) -> Chunks {
        Chunks::for_cache(self.cache.attn, self.cache.max_len, self.target_blocks)
    }

    /// Whether a step of `n_max` nodes per sequence runs on the batch-invariant GEMM ([`plan::skinny_gemm`]): the
    /// decode and verify shapes (at most [`MAX_TREE_NODES`] nodes) of a model whose inner dimensions the kernel
    /// takes and whose output, gate/up and down projections have no bias. Longer steps (prefill) run cuBLAS.
    #[must_use]
    pub fn batch_invariant(&self, n_max: usize) -> bool {
        let cfg = self.cfg;
        let dims = [cfg.hidden_size, cfg.intermediate_size, cfg.q_dim()];
        let unbiased = self.w.layers.iter().all(|l| l.o.b.is_none() && l.gate_up.b.is_none() && l.down.b.is_none());
        n_max <= MAX_TREE_NODES && dims.into_iter().all(plan::skinny_takes) && unbiased
    }

    /// Issues the whole forward: embedding, every layer and the LM head into `b.logits` (and the final norm's rows
    /// into `b.xn`). Launches, GEMMs and device copies only: nothing allocates, synchronises or reads the host, so a
    /// CUDA stream can capture it into a graph.
    ///
    /// Decode and verify shapes ([`Self::batch_invariant`]) run 6 launches per layer, each row's bits independent of
    /// the rows beside it: the q/k/v GEMM with the input norm in its prologue, its epilogue kernel (bias, Qwen3 head
    /// norms, RoPE, cache write), split attention (its chunks combined by their last block), the output GEMM adding
    /// into the residual stream, the gate/up GEMM with the MLP's norm in its prologue and SwiGLU in its epilogue, the
    /// down GEMM adding into the residual stream; the LM head is one more with the final norm in its prologue.
    /// Other shapes run cuBLAS: 9 launches per layer ([`Self::record_cublas`]).
    ///
    /// # Errors
    /// A plan's shape check, or the executor's error.
    pub fn record(&self, ops: &mut dyn DeviceOps, b: &StepBufs) -> Result<()> {
        if !self.batch_invariant(b.n_max) {
            return self.record_cublas(ops, b);
        }
        let cfg = self.cfg;
        let w = self.w;
        let rows = b.batch * b.n_max;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let norm = |weight| SkinnyIn::Norm { x: b.x, weight, eps, out: None };
        let groups = if self.split_by_rows && rows > 1 { 1 } else { plan::SKINNY_K_GROUPS };
        let gemm = |n, k, input, w, out| plan::skinny_gemm_split(rows, n, k, input, w, out, groups);
        ops.launch(&plan::embed_rows(rows, h, w.embed, b.meta.tokens, b.x)?)?;
        self.tap(ops, b, 0)?;
        for (li, lw) in w.layers.iter().enumerate() {
            let qkv = SkinnyOut::Bf16 { y: b.qkv, bias: None };
            ops.launch(&gemm(lw.qkv.out, h, norm(lw.in_norm), lw.qkv.w, qkv)?)?;
            self.attention(ops, b, li, lw)?;
            let (o, gu, down) = (&lw.o, &lw.gate_up, &lw.down);
            ops.launch(&gemm(o.out, o.inp, SkinnyIn::Bf16(b.attn), o.w, SkinnyOut::AddF32(b.x))?)?;
            ops.launch(&gemm(gu.out, h, norm(lw.post_norm), gu.w, SkinnyOut::SwiGlu(b.act))?)?;
            ops.launch(&gemm(down.out, down.inp, SkinnyIn::Bf16(b.act), down.w, SkinnyOut::AddF32(b.x))?)?;
            self.tap(ops, b, li + 1)?;
        }
        let head = w.head.unwrap_or(w.embed);
        let last = SkinnyIn::Norm { x: b.x, weight: w.norm, eps, out: Some(b.xn) };
        ops.launch(&gemm(cfg.vocab_size, h, last, head, SkinnyOut::F32(b.logits))?)?;
        Ok(())
    }

    /// A layer's q/k/v epilogue and attention: from `b.qkv` to `b.attn`.
    fn attention(&self, ops: &mut dyn DeviceOps, b: &StepBufs, li: usize, lw: &LayerBufs) -> Result<()> {
        let rows = b.batch * b.n_max;
        let tree = TreeDims { batch: b.batch, n_max: b.n_max };
        let chunks = self.chunks(b.batch, b.n_max);
        let parts = (chunks.n_splits > 1).then_some(b.parts);
        let (kc, vc) = (self.k_cache, self.v_cache);
        let m = &b.meta;
        let meta = RowBufs { slot: m.row_slot, pos: m.row_pos, dst: m.row_dst };
        let (inv, bias, eps) = (self.w.inv_freq, lw.qkv.b, self.cfg.rms_norm_eps as f32);
        ops.launch(&plan::qkv_rope_kv_write(
            self.cache, li, rows, b.qkv, bias, lw.qk_norm, b.q, kc, vc, meta, inv, eps,
        )?)?;
        let seq = SeqBufs { slot: m.seq_slot, prefix_len: m.seq_prefix, n_nodes: m.seq_nodes };
        for l in plan::attention(self.cache, li, tree, chunks, b.q, kc, vc, b.attn, seq, m.anc, parts)? {
            ops.launch(&l)?;
        }
        Ok(())
    }

    /// The forward on cuBLAS (prefill shapes): per layer 9 launches: the fused q/k/v GEMM, its epilogue, split
    /// attention, the output GEMM, the residual add fused with the MLP's norm, the fused gate/up GEMM, the
    /// activation, the down GEMM, and the residual add fused with the next layer's norm (or the final one).
    ///
    /// # Errors
    /// As [`Self::record`].
    pub fn record_cublas(&self, ops: &mut dyn DeviceOps, b: &StepBufs) -> Result<()> {
        let cfg = self.cfg;
        let w = self.w;
        let rows = b.batch * b.n_max;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        ops.launch(&plan::embed_rows(rows, h, w.embed, b.meta.tokens, b.x)?)?;
        self.tap(ops, b, 0)?;
        let first = w.layers.first().map_or(w.norm, |l| l.in_norm);
        ops.launch(&plan::rms_norm(rows, h, eps, b.x, first, b.xn)?)?;
        for (li, lw) in w.layers.iter().enumerate() {
            self.linear(ops, rows, b.xn, &lw.qkv, b.qkv, false)?;
            self.attention(ops, b, li, lw)?;
            self.linear(ops, rows, b.attn, &lw.o, b.o, true)?;
            ops.launch(&plan::add_rms_norm(rows, h, eps, b.x, b.o, lw.post_norm, b.xn)?)?;
            self.linear(ops, rows, b.xn, &lw.gate_up, b.gate_up, true)?;
            ops.launch(&plan::silu_mul_packed(rows, cfg.intermediate_size, b.gate_up, b.act)?)?;
            self.linear(ops, rows, b.act, &lw.down, b.o, true)?;
            let next = w.layers.get(li + 1).map_or(w.norm, |l| l.in_norm);
            ops.launch(&plan::add_rms_norm(rows, h, eps, b.x, b.o, next, b.xn)?)?;
            self.tap(ops, b, li + 1)?;
        }
        let head = w.head.unwrap_or(w.embed);
        ops.gemm(&plan::gemm(rows, cfg.vocab_size, h, b.xn, head, GemmY::F32(b.logits))?)?;
        Ok(())
    }
}
