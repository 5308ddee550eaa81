//! One device forward over preallocated buffers: the metadata the host writes before a step, the activations, and
//! the recording of every launch on one stream, which runs eagerly or is captured once into a CUDA graph per
//! (batch, nodes) shape and replayed after (nothing in the recording allocates, synchronises or copies from the host).

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use tlt_kernels::cuda::{gemm_bf16, CacheDims, CudaKernels, DeviceLinear, RowMeta, SeqMeta, TreeDims};

use super::layout::StepLayout;
use super::{cuda_err, DevWeights};
use crate::config::LlamaConfig;
use crate::Result;

/// Buffers of one `(batch, n_max, tree)` shape.
#[derive(Debug)]
pub(crate) struct StepBuffers {
    pub(crate) batch: usize,
    pub(crate) n_max: usize,
    tokens: CudaSlice<i32>,
    row_slot: CudaSlice<i32>,
    row_pos: CudaSlice<i32>,
    row_dst: CudaSlice<i32>,
    seq_slot: CudaSlice<i32>,
    seq_prefix: CudaSlice<i32>,
    seq_nodes: CudaSlice<i32>,
    anc: Option<CudaSlice<u64>>,
    x: CudaSlice<f32>,
    pub(crate) xn: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    o: CudaSlice<bf16>,
    gate: CudaSlice<bf16>,
    up: CudaSlice<bf16>,
    pub(crate) logits: CudaSlice<f32>,
    /// The residual stream entering the tapped layers (`[rows, hidden]` f32 each), in tap order.
    pub(crate) taps: Vec<CudaSlice<f32>>,
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>> {
    s.alloc_zeros::<T>(n.max(1)).map_err(cuda_err("alloc"))
}

impl StepBuffers {
    /// Allocates the buffers of `batch` sequences of up to `n_max` nodes (with ancestor masks when `tree`).
    /// `layer_taps`: how many residual-stream taps to keep.
    pub(crate) fn new(
        s: &Arc<CudaStream>,
        cfg: &LlamaConfig,
        batch: usize,
        n_max: usize,
        tree: bool,
        layer_taps: usize,
    ) -> Result<Self> {
        let rows = batch * n_max;
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            batch,
            n_max,
            tokens: zeros(s, rows)?,
            row_slot: zeros(s, rows)?,
            row_pos: zeros(s, rows)?,
            row_dst: zeros(s, rows)?,
            seq_slot: zeros(s, batch)?,
            seq_prefix: zeros(s, batch)?,
            seq_nodes: zeros(s, batch)?,
            anc: if tree { Some(zeros(s, rows)?) } else { None },
            x: zeros(s, rows * h)?,
            xn: zeros(s, rows * h)?,
            q: zeros(s, rows * cfg.q_dim())?,
            k: zeros(s, rows * cfg.kv_dim())?,
            v: zeros(s, rows * cfg.kv_dim())?,
            attn: zeros(s, rows * cfg.q_dim())?,
            o: zeros(s, rows * h)?,
            gate: zeros(s, rows * i)?,
            up: zeros(s, rows * i)?,
            logits: zeros(s, rows * cfg.vocab_size)?,
            taps: (0..layer_taps).map(|_| zeros(s, rows * h)).collect::<Result<_>>()?,
        })
    }

    /// Bytes of device memory the buffers hold.
    pub(crate) fn bytes(&self) -> u64 {
        let b2 = [&self.xn, &self.q, &self.k, &self.v, &self.attn, &self.o, &self.gate, &self.up].map(|b| b.len() * 2);
        let taps: usize = self.taps.iter().map(CudaSlice::len).sum();
        let b4 = (self.x.len() + self.logits.len() + taps) * 4 + self.tokens.len() * 16 + self.seq_slot.len() * 12;
        (b2.iter().sum::<usize>() + b4 + self.anc.as_ref().map_or(0, |a| a.len() * 8)) as u64
    }

    /// Writes a step's metadata (its shape must be this buffer's: `layout.n_max == n_max` and `batch` sequences,
    /// padded with empty sequences in slot-less rows). Outside any capture.
    pub(crate) fn write(&mut self, s: &Arc<CudaStream>, l: &StepLayout) -> Result<()> {
        let pad = |v: &[i32], n: usize, fill: i32| -> Vec<i32> {
            let mut v = v.to_vec();
            v.resize(n, fill);
            v
        };
        let rows = self.batch * self.n_max;
        let up = |dst: &mut CudaSlice<i32>, v: Vec<i32>| s.memcpy_htod(&v, dst).map_err(cuda_err("upload"));
        up(&mut self.tokens, pad(&l.tokens, rows, 0))?;
        up(&mut self.row_slot, pad(&l.row_slot, rows, -1))?;
        up(&mut self.row_pos, pad(&l.row_pos, rows, 0))?;
        up(&mut self.row_dst, pad(&l.row_dst, rows, 0))?;
        // Padded sequences: slot 0, no committed keys, no nodes (every kernel skips them).
        up(&mut self.seq_slot, pad(&l.seq_slot, self.batch, 0))?;
        up(&mut self.seq_prefix, pad(&l.seq_prefix, self.batch, 0))?;
        up(&mut self.seq_nodes, pad(&l.seq_nodes, self.batch, 0))?;
        if let (Some(dst), Some(a)) = (self.anc.as_mut(), l.anc.as_ref()) {
            let mut v = a.clone();
            v.resize(rows, 0);
            s.memcpy_htod(&v, dst).map_err(cuda_err("upload"))?;
        }
        Ok(())
    }
}

/// Everything a recorded forward reads besides its buffers.
pub(crate) struct Model<'a> {
    pub(crate) cfg: &'a LlamaConfig,
    pub(crate) kernels: &'a CudaKernels,
    pub(crate) blas: &'a CudaBlas,
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) cache: CacheDims,
    pub(crate) w: &'a DevWeights,
    /// The layers whose input residual stream is copied into [`StepBuffers::taps`] (`num_layers`: the last
    /// layer's output), in tap order.
    pub(crate) layer_taps: &'a [usize],
}

impl Model<'_> {
    fn linear(&self, rows: usize, x: &CudaSlice<bf16>, l: &DeviceLinear, y: &mut CudaSlice<bf16>) -> Result<()> {
        Ok(l.forward(self.kernels, self.blas, self.stream, rows, x, y)?)
    }

    /// Copies the residual stream into every tap of layer input `layer` (a device copy, capturable).
    fn tap(&self, b: &mut StepBuffers, layer: usize) -> Result<()> {
        for (j, _) in self.layer_taps.iter().enumerate().filter(|(_, &l)| l == layer) {
            let dst =
                b.taps.get_mut(j).ok_or_else(|| crate::Error::InvalidInput(format!("tap buffer {j} is missing")))?;
            self.stream.memcpy_dtod(&b.x, dst).map_err(cuda_err("tap copy"))?;
        }
        Ok(())
    }

    /// Issues the whole forward on the stream: embedding, every layer (RoPE + cache write, attention, MLP) and the
    /// LM head into `b.logits`. Launches only.
    pub(crate) fn record(
        &self,
        b: &mut StepBuffers,
        k_cache: &mut CudaSlice<bf16>,
        v_cache: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (cfg, k, s, w) = (self.cfg, self.kernels, self.stream, self.w);
        let rows = b.batch * b.n_max;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let tree = TreeDims { batch: b.batch, n_max: b.n_max };
        k.embed_rows(s, rows, h, &w.embed, &b.tokens, &mut b.x)?;
        for (li, lw) in w.layers.iter().enumerate() {
            self.tap(b, li)?;
            k.rms_norm(s, rows, h, eps, &b.x, &lw.in_norm, &mut b.xn)?;
            self.linear(rows, &b.xn, &lw.q, &mut b.q)?;
            self.linear(rows, &b.xn, &lw.k, &mut b.k)?;
            self.linear(rows, &b.xn, &lw.v, &mut b.v)?;
            if let Some((qn, kn)) = &lw.qk_norm {
                // Qwen3: every head's query and key vector normalised before RoPE.
                k.head_rms_norm(s, cfg.head_dim(), eps, &mut b.q, qn)?;
                k.head_rms_norm(s, cfg.head_dim(), eps, &mut b.k, kn)?;
            }
            let meta = RowMeta { slot: &b.row_slot, pos: &b.row_pos, dst: &b.row_dst };
            k.rope_kv_write(s, self.cache, li, rows, &mut b.q, &b.k, &b.v, k_cache, v_cache, meta, &w.inv_freq)?;
            let seq = SeqMeta { slot: &b.seq_slot, prefix_len: &b.seq_prefix, n_nodes: &b.seq_nodes };
            k.tree_attention(s, self.cache, li, tree, &b.q, k_cache, v_cache, &mut b.attn, seq, b.anc.as_ref())?;
            self.linear(rows, &b.attn, &lw.o, &mut b.o)?;
            k.add_to_residual(s, &mut b.x, &b.o)?;
            k.rms_norm(s, rows, h, eps, &b.x, &lw.post_norm, &mut b.xn)?;
            self.linear(rows, &b.xn, &lw.gate, &mut b.gate)?;
            self.linear(rows, &b.xn, &lw.up, &mut b.up)?;
            k.silu_mul(s, &mut b.gate, &b.up)?;
            self.linear(rows, &b.gate, &lw.down, &mut b.o)?;
            k.add_to_residual(s, &mut b.x, &b.o)?;
        }
        self.tap(b, w.layers.len())?;
        k.rms_norm(s, rows, h, eps, &b.x, &w.norm, &mut b.xn)?;
        let head = w.head.as_ref().unwrap_or(&w.embed);
        gemm_bf16(self.blas, s, rows, cfg.vocab_size, h, &b.xn, head, &mut b.logits)?;
        Ok(())
    }
}
