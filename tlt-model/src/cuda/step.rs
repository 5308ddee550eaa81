//! One device forward over preallocated buffers: the metadata the host writes before a step, the activations, and
//! the device that runs the step program ([`crate::device_step::StepProgram`]) eagerly or while capturing it once
//! into a graph per (batch, nodes) shape, replayed after (nothing in the program allocates, synchronises or copies
//! from the host).

use half::bf16;
use tlt_kernels::cuda::plan::{Buf, Chunks, GemmEx, Launch, SplitParts};
use tlt_kernels::cuda::{gpu, DeviceBuf, Elem, Gpu, SharedGpu, Staged, TreeDims};
use tlt_kernels::AttnShape;

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
    x: DeviceBuf<f32>,
    pub(crate) xn: DeviceBuf<bf16>,
    qkv: DeviceBuf<bf16>,
    q: DeviceBuf<bf16>,
    attn: DeviceBuf<bf16>,
    part_o: DeviceBuf<f32>,
    part_ml: DeviceBuf<f32>,
    /// Split attention's arrival counters: zeroed here, left zero by every launch.
    arrivals: DeviceBuf<i32>,
    o: DeviceBuf<bf16>,
    gate_up: DeviceBuf<bf16>,
    act: DeviceBuf<bf16>,
    pub(crate) logits: DeviceBuf<f32>,
    /// The residual stream entering the tapped layers (`[rows, hidden]` f32 each), in tap order.
    pub(crate) taps: Vec<DeviceBuf<f32>>,
}

fn zeros<T: Elem>(g: &SharedGpu, n: usize) -> Result<DeviceBuf<T>> {
    Ok(DeviceBuf::zeros(g.as_ref(), n.max(1))?)
}

impl StepBuffers {
    /// Allocates the buffers of `batch` sequences of up to `n_max` nodes (with ancestor masks when `tree`), with
    /// split attention's partial buffers for `chunks`. `layer_taps`: how many residual-stream taps to keep.
    pub(crate) fn new(
        s: &SharedGpu,
        cfg: &LlamaConfig,
        batch: usize,
        n_max: usize,
        tree: bool,
        layer_taps: usize,
        chunks: Chunks,
    ) -> Result<Self> {
        let rows = batch * n_max;
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let attn = AttnShape::new(cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let [po, pml, pa] = chunks.part_lens(TreeDims { batch, n_max }, attn);
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
            arrivals: zeros(s, pa)?,
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
        let taps: usize = self.taps.iter().map(DeviceBuf::len).sum();
        let f32s = self.x.len() + self.logits.len() + taps + self.part_o.len() + self.part_ml.len();
        (b2.iter().sum::<usize>() + f32s * 4 + self.meta.bytes()) as u64
    }

    /// Writes a step's metadata (its shape must be this buffer's: `layout.n_max == n_max` and at most `batch`
    /// sequences; the rest is padding that every kernel skips) into the pinned staging buffer and sends it in one
    /// asynchronous copy. Outside any capture. Waits first for the previous copy from the staging buffer.
    pub(crate) fn write(&mut self, l: &StepLayout) -> Result<()> {
        let meta = &self.meta_layout;
        self.meta.send(meta.bytes(), |host| {
            meta.write(l, host).map_err(|e| tlt_kernels::Error::InvalidArgument(e.to_string()))
        })?;
        Ok(())
    }
}

/// A device as the executor of a step program.
pub(crate) struct GpuOps<'a>(pub(crate) &'a dyn Gpu);

impl DeviceOps for GpuOps<'_> {
    fn launch(&mut self, launch: &Launch) -> Result<()> {
        Ok(self.0.launch(launch)?)
    }

    fn gemm(&mut self, gemm: &GemmEx) -> Result<()> {
        Ok(self.0.gemm(gemm)?)
    }

    fn copy_f32(&mut self, src: Buf<f32>, dst: Buf<f32>) -> Result<()> {
        Ok(gpu::copy(self.0, src, dst)?)
    }
}

impl StepBuffers {
    /// The buffers as a step program sees them.
    pub(crate) fn bufs(&self) -> Result<StepBufs> {
        Ok(StepBufs {
            batch: self.batch,
            n_max: self.n_max,
            meta: self.meta_layout.bufs(self.meta.buf())?,
            x: self.x.buf(),
            xn: self.xn.buf(),
            qkv: self.qkv.buf(),
            q: self.q.buf(),
            attn: self.attn.buf(),
            parts: SplitParts { o: self.part_o.buf(), ml: self.part_ml.buf(), arrivals: self.arrivals.buf() },
            o: self.o.buf(),
            gate_up: self.gate_up.buf(),
            act: self.act.buf(),
            logits: self.logits.buf(),
            taps: self.taps.iter().map(DeviceBuf::buf).collect(),
        })
    }
}
