//! One device forward over preallocated buffers: the metadata the host writes before a step, the activations, and
//! the CUDA stream that runs the step program ([`crate::device_step::StepProgram`]) eagerly or while capturing it
//! once into a CUDA graph per (batch, nodes) shape, replayed after (nothing in the program allocates, synchronises
//! or copies from the host).

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use tlt_kernels::cuda::plan::{Buf, Chunks, GemmEx, Launch};
use tlt_kernels::cuda::{buf_of, run_gemm, CudaKernels, Staged, TreeDims};

use super::cuda_err;
use crate::config::LlamaConfig;
use crate::device_step::{DeviceOps, StepBufs, StepLayout, StepMeta};
use crate::Result;

/// Buffers of one `(batch, n_max, tree)` shape.
#[derive(Debug)]
pub(crate) struct StepBuffers {
    pub(crate) batch: usize,
    pub(crate) n_max: usize,
    /// The packing of the step's metadata, its pinned host staging buffer (written by the host, sent in one copy)
    /// and the device buffer it lands in.
    meta_layout: StepMeta,
    meta: Staged,
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
        let meta_layout = StepMeta::new(batch, n_max, tree);
        Ok(Self {
            batch,
            n_max,
            meta: Staged::new(s, meta_layout.bytes())?,
            meta_layout,
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
        (b2.iter().sum::<usize>() + f32s * 4 + self.meta.bytes()) as u64
    }

    /// Writes a step's metadata (its shape must be this buffer's: `layout.n_max == n_max` and at most `batch`
    /// sequences; the rest is padding that every kernel skips) into the pinned staging buffer and sends it in one
    /// asynchronous copy. Outside any capture. Waits first for the previous copy from the staging buffer.
    pub(crate) fn write(&mut self, s: &Arc<CudaStream>, l: &StepLayout) -> Result<()> {
        let meta = &self.meta_layout;
        self.meta.send(s, meta.bytes(), |host| {
            meta.write(l, host).map_err(|e| tlt_kernels::Error::InvalidArgument(e.to_string()))
        })?;
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

impl StepBuffers {
    /// The buffers as a step program sees them.
    pub(crate) fn bufs(&self, s: &CudaStream) -> Result<StepBufs> {
        Ok(StepBufs {
            batch: self.batch,
            n_max: self.n_max,
            meta: self.meta_layout.bufs(self.meta.buf(s))?,
            x: buf_of(&self.x, s),
            xn: buf_of(&self.xn, s),
            qkv: buf_of(&self.qkv, s),
            q: buf_of(&self.q, s),
            attn: buf_of(&self.attn, s),
            parts: (buf_of(&self.part_o, s), buf_of(&self.part_ml, s)),
            o: buf_of(&self.o, s),
            gate_up: buf_of(&self.gate_up, s),
            act: buf_of(&self.act, s),
            logits: buf_of(&self.logits, s),
            taps: self.taps.iter().map(|t| buf_of(t, s)).collect(),
        })
    }
}
