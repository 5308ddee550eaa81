//! One device forward over preallocated buffers: the metadata the host writes before a step, the activations, and
//! the CUDA stream that runs the step program ([`crate::device_step::StepProgram`]) eagerly or while capturing it
//! once into a CUDA graph per (batch, nodes) shape, replayed after (nothing in the program allocates, synchronises
//! or copies from the host).

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use tlt_kernels::cuda::plan::{Buf, Chunks, GemmEx, Launch};
use tlt_kernels::cuda::{run_gemm, CudaKernels, TreeDims};

use super::cuda_err;
use crate::config::LlamaConfig;
use crate::device_step::{DeviceOps, StepBufs, StepLayout};
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
    qkv: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    o: CudaSlice<bf16>,
    gate_up: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    pub(crate) logits: CudaSlice<f32>,
    /// The residual stream entering the tapped layers (`[rows, hidden]` f32 each), in tap order.
    pub(crate) taps: Vec<CudaSlice<f32>>,
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>> {
    s.alloc_zeros::<T>(n.max(1)).map_err(cuda_err("alloc"))
}

impl StepBuffers {
    /// Allocates the buffers of `batch` sequences of up to `n_max` nodes (with ancestor masks when `tree`), with
    /// split attention's partial buffers for `chunks`. `layer_taps`: how many residual-stream taps to keep.
    pub(crate) fn new(
        s: &Arc<CudaStream>,
        cfg: &LlamaConfig,
        batch: usize,
        n_max: usize,
        tree: bool,
        layer_taps: usize,
        chunks: Chunks,
    ) -> Result<Self> {
        let rows = batch * n_max;
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (po, pml) = chunks.part_lens(TreeDims { batch, n_max }, cfg.num_attention_heads, cfg.head_dim());
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
            qkv: zeros(s, rows * (cfg.q_dim() + 2 * cfg.kv_dim()))?,
            q: zeros(s, rows * cfg.q_dim())?,
            attn: zeros(s, rows * cfg.q_dim())?,
            part_o: zeros(s, po)?,
            part_ml: zeros(s, pml)?,
            o: zeros(s, rows * h)?,
            gate_up: zeros(s, rows * 2 * i)?,
            act: zeros(s, rows * i)?,
            logits: zeros(s, rows * cfg.vocab_size)?,
            taps: (0..layer_taps).map(|_| zeros(s, rows * h)).collect::<Result<_>>()?,
        })
    }

    /// Bytes of device memory the buffers hold.
    pub(crate) fn bytes(&self) -> u64 {
        let b2 = [&self.xn, &self.qkv, &self.q, &self.attn, &self.o, &self.gate_up, &self.act].map(|b| b.len() * 2);
        let taps: usize = self.taps.iter().map(CudaSlice::len).sum();
        let f32s = self.x.len() + self.logits.len() + taps + self.part_o.len() + self.part_ml.len();
        let b4 = f32s * 4 + self.tokens.len() * 16 + self.seq_slot.len() * 12;
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

/// A CUDA stream as the executor of a step program (event tracking is off for the model's context: every buffer
/// lives on this one stream, so stream order alone keeps it correct).
pub(crate) struct CudaOps<'a> {
    pub(crate) kernels: &'a CudaKernels,
    pub(crate) blas: &'a CudaBlas,
    pub(crate) stream: &'a Arc<CudaStream>,
}

impl DeviceOps for CudaOps<'_> {
    fn launch(&mut self, launch: &Launch) -> Result<()> {
        Ok(self.kernels.run(self.stream, launch)?)
    }

    fn gemm(&mut self, gemm: &GemmEx) -> Result<()> {
        Ok(run_gemm(self.blas, gemm)?)
    }

    fn copy_f32(&mut self, src: Buf<f32>, dst: Buf<f32>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(crate::Error::InvalidInput(format!("copy of {} elements into {}", src.len(), dst.len())));
        }
        // SAFETY: both are live device buffers of this model on this stream, of the same length (checked).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst.addr(), src.addr(), src.len() * 4, self.stream.cu_stream())
        }
        .map_err(cuda_err("tap copy"))
    }
}

/// `s` as a step program's buffer (its device address; no guard: event tracking is off for the model).
pub(crate) fn dbuf<T>(s: &CudaSlice<T>, stream: &CudaStream) -> Buf<T> {
    let (ptr, _) = s.device_ptr(stream);
    Buf::new(ptr, s.len())
}

impl StepBuffers {
    /// The buffers as a step program sees them.
    pub(crate) fn bufs(&self, s: &CudaStream) -> StepBufs {
        StepBufs {
            batch: self.batch,
            n_max: self.n_max,
            tokens: dbuf(&self.tokens, s),
            row_slot: dbuf(&self.row_slot, s),
            row_pos: dbuf(&self.row_pos, s),
            row_dst: dbuf(&self.row_dst, s),
            seq_slot: dbuf(&self.seq_slot, s),
            seq_prefix: dbuf(&self.seq_prefix, s),
            seq_nodes: dbuf(&self.seq_nodes, s),
            anc: self.anc.as_ref().map(|a| dbuf(a, s)),
            x: dbuf(&self.x, s),
            xn: dbuf(&self.xn, s),
            qkv: dbuf(&self.qkv, s),
            q: dbuf(&self.q, s),
            attn: dbuf(&self.attn, s),
            parts: (dbuf(&self.part_o, s), dbuf(&self.part_ml, s)),
            o: dbuf(&self.o, s),
            gate_up: dbuf(&self.gate_up, s),
            act: dbuf(&self.act, s),
            logits: dbuf(&self.logits, s),
            taps: self.taps.iter().map(|t| dbuf(t, s)).collect(),
        }
    }
}
