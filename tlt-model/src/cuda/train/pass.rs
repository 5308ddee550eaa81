//! The training pass on the device: a full-sequence forward over a packed [`TrainBatch`] that keeps what its
//! backward reads (every layer's activations: [`TrainLayer`]), the LM head's log-probabilities of the targets, and
//! the backward from the caller's gradients of those log-probabilities to every weight's gradient.
//!
//! Precision: the decoder's own mixed precision (bf16 weights, activations and GEMM inputs, f32 residual stream and
//! accumulation, f32 logits); gradients flow in f32 between kernels and in bf16 into the GEMMs, and accumulate in f32.
//! Every reduction has a fixed order (no atomics): the same batch gives the same bits.

use half::bf16;
use tlt_kernels::cuda::plan::{self, Buf, GemmY};
use tlt_kernels::cuda::{gpu, DeviceBuf, Gpu};

use super::batch::TrainBatch;
use super::layer::{head, LayerDims, LayerGrads, LayerScratch, PackedRows, TrainLayer, TrainLayerBufs};
use crate::config::LlamaConfig;
use crate::device_step::WeightBufs;
use crate::{Error, Result};

/// Widths of the model's activations.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub layer: LayerDims,
    pub vocab: usize,
    pub layers: usize,
}

impl Dims {
    pub fn new(cfg: &LlamaConfig) -> Self {
        Self { layer: LayerDims::new(cfg), vocab: cfg.vocab_size, layers: cfg.num_hidden_layers }
    }

    /// Bytes of every activation buffer per row, for the memory report.
    pub fn bytes_per_row(&self) -> usize {
        let (l, h) = (&self.layer, self.layer.h);
        self.layers * l.acts_bytes_per_row()
            + l.scratch_bytes_per_row()
            + 4 * h * 2
            + 2 * h
            + 4 * self.vocab
            + 2 * self.vocab
            + 40
    }
}

/// Every buffer of a training pass, for up to `cap` rows.
#[derive(Debug)]
pub(super) struct Acts {
    pub cap: usize,
    layers: Vec<TrainLayer>,
    scratch: LayerScratch,
    x_fin: DeviceBuf<f32>,
    xf: DeviceBuf<bf16>,
    logits: DeviceBuf<f32>,
    dlogits: DeviceBuf<bf16>,
    ids: DeviceBuf<i32>,
    pos: DeviceBuf<i32>,
    seq_start: DeviceBuf<i32>,
    targets: DeviceBuf<i32>,
    order: DeviceBuf<i32>,
    seg_start: DeviceBuf<i32>,
    seg_token: DeviceBuf<i32>,
    logp: DeviceBuf<f32>,
    lse_head: DeviceBuf<f32>,
    entropy: DeviceBuf<f32>,
    g_logp: DeviceBuf<f32>,
    g_ent: DeviceBuf<f32>,
    dx: DeviceBuf<f32>,
    /// Rows, segments, inverse temperature and entropy of the last forward (what its backward reads).
    last: Option<Last>,
}

/// What the last forward left for its backward.
#[derive(Debug, Clone, Copy)]
struct Last {
    rows: usize,
    segments: usize,
    inv_temp: f32,
    entropy: bool,
}

impl Acts {
    /// Buffers for `cap` rows of a model of dims `d`.
    pub fn new(g: &dyn Gpu, d: &Dims, cap: usize) -> Result<Self> {
        let z32 = |n: usize| DeviceBuf::<f32>::zeros(g, cap * n);
        let z16 = |n: usize| DeviceBuf::<bf16>::zeros(g, cap * n);
        let zi = |n: usize| DeviceBuf::<i32>::zeros(g, n);
        let h = d.layer.h;
        let layers = (0..d.layers).map(|_| TrainLayer::new(g, d.layer, cap)).collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cap,
            layers,
            scratch: LayerScratch::new(g, &d.layer, cap)?,
            x_fin: z32(h)?,
            xf: z16(h)?,
            logits: z32(d.vocab)?,
            dlogits: z16(d.vocab)?,
            ids: zi(cap)?,
            pos: zi(cap)?,
            seq_start: zi(cap)?,
            targets: zi(cap)?,
            order: zi(cap)?,
            seg_start: zi(cap + 1)?,
            seg_token: zi(cap)?,
            logp: z32(1)?,
            lse_head: z32(1)?,
            entropy: z32(1)?,
            g_logp: z32(1)?,
            g_ent: z32(1)?,
            dx: z32(h)?,
            last: None,
        })
    }

    fn rows(&self, t: usize, inv_freq: Buf<f64>) -> Result<PackedRows> {
        Ok(PackedRows { rows: t, pos: head(&self.pos, t)?, seq_start: head(&self.seq_start, t)?, inv_freq })
    }
}

/// Where each weight's gradient lives in the gradient arena (the same enumeration as the weights).
#[derive(Debug, Clone)]
pub(super) struct GradBufs {
    pub embed: Buf<f32>,
    pub head: Option<Buf<f32>>,
    pub norm: Buf<f32>,
    pub layers: Vec<LayerGrads>,
}

/// Runs the forward of `batch` through weights `w` (bf16, the decoder's) into `a`, and returns the log-probability
/// of every row's target at inverse temperature `inv_temp` (0 for unscored rows) and, with `entropy`, each row's
/// entropy.
pub(super) fn forward(
    g: &dyn Gpu,
    d: &Dims,
    w: &WeightBufs,
    a: &mut Acts,
    batch: &TrainBatch,
    inv_temp: f32,
    entropy: bool,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    let t = batch.rows();
    if t > a.cap {
        return Err(Error::InvalidInput(format!("{t} rows in buffers for {}", a.cap)));
    }
    a.last = None;
    let segments = batch.seg_token.len();
    a.ids.write(g, 0, &batch.ids)?;
    a.pos.write(g, 0, &batch.pos)?;
    a.seq_start.write(g, 0, &batch.seq_start)?;
    a.targets.write(g, 0, &batch.targets)?;
    a.order.write(g, 0, &batch.order)?;
    a.seg_start.write(g, 0, &batch.seg_start)?;
    a.seg_token.write(g, 0, &batch.seg_token)?;
    let (h, eps) = (d.layer.h, d.layer.eps);
    let rows = a.rows(t, w.inv_freq)?;
    let x_fin = head(&a.x_fin, t * h)?;
    let first_x = match a.layers.first() {
        Some(l) => l.input(t)?,
        None => x_fin,
    };
    g.launch(&plan::embed_rows(t, h, w.embed, head(&a.ids, t)?, first_x)?)?;
    for li in 0..a.layers.len() {
        let out = match a.layers.get(li + 1) {
            Some(next) => next.input(t)?,
            None => x_fin,
        };
        let lw = TrainLayerBufs::from(&w.layers[li]);
        a.layers[li].forward(g, &rows, &lw, &a.scratch, out)?;
    }
    g.launch(&plan::rms_norm(t, h, eps, x_fin, w.norm, head(&a.xf, t * h)?)?)?;
    let lm = w.head.unwrap_or(w.embed);
    let logits = head(&a.logits, t * d.vocab)?;
    g.gemm(&plan::gemm(t, d.vocab, h, head(&a.xf, t * h)?, lm, GemmY::F32(logits))?)?;
    let ent = if entropy { Some(head(&a.entropy, t)?) } else { None };
    let (targets, logp, lse) = (head(&a.targets, t)?, head(&a.logp, t)?, head(&a.lse_head, t)?);
    g.launch(&plan::token_logprobs(t, d.vocab, inv_temp, logits, targets, logp, lse, ent)?)?;
    let logp = gpu::read(g, logp)?;
    let ent = ent.map(|e| gpu::read(g, e)).transpose()?;
    a.last = Some(Last { rows: t, segments, inv_temp, entropy });
    Ok((logp, ent))
}

/// The backward of the last [`forward`] from `g_logp` (and `g_ent`, the gradients of each row's entropy), adding
/// every weight's gradient into `grads`.
pub(super) fn backward(
    g: &dyn Gpu,
    d: &Dims,
    w: &WeightBufs,
    a: &mut Acts,
    grads: &GradBufs,
    g_logp: &[f32],
    g_ent: Option<&[f32]>,
) -> Result<()> {
    let last = a.last.take().ok_or_else(|| Error::InvalidInput("a backward needs a forward before it".into()))?;
    let t = last.rows;
    if g_logp.len() != t || g_ent.is_some_and(|e| e.len() != t) {
        return Err(Error::InvalidInput(format!("gradients of {} rows for a forward of {t}", g_logp.len())));
    }
    if g_ent.is_some() && !last.entropy {
        return Err(Error::InvalidInput("an entropy gradient for a forward that computed no entropy".into()));
    }
    let h = d.layer.h;
    a.g_logp.write(g, 0, g_logp)?;
    let g_ent_buf = match g_ent {
        Some(e) => {
            a.g_ent.write(g, 0, e)?;
            Some(head(&a.g_ent, t)?)
        }
        None => None,
    };
    let ent = if last.entropy { Some(head(&a.entropy, t)?) } else { None };
    let dlogits = head(&a.dlogits, t * d.vocab)?;
    let logits = head(&a.logits, t * d.vocab)?;
    g.launch(&plan::token_logprobs_back(
        t,
        d.vocab,
        last.inv_temp,
        logits,
        head(&a.targets, t)?,
        head(&a.lse_head, t)?,
        ent,
        head(&a.g_logp, t)?,
        g_ent_buf,
        dlogits,
    )?)?;
    let (dx, dxn) = (head(&a.dx, t * h)?, head(&a.scratch.dxn, t * h)?);
    let lm = w.head.unwrap_or(w.embed);
    let lm_grad = grads.head.unwrap_or(grads.embed);
    g.gemm(&plan::gemm_dx(t, d.vocab, h, dlogits, lm, GemmY::F32(dxn))?)?;
    g.gemm(&plan::gemm_dw(t, d.vocab, h, dlogits, head(&a.xf, t * h)?, lm_grad, true)?)?;
    gpu::zero(g, dx)?;
    a.scratch.norm_back(g, &d.layer, t, head(&a.x_fin, t * h)?, w.norm, grads.norm, dx)?;
    let rows = a.rows(t, w.inv_freq)?;
    for li in (0..a.layers.len()).rev() {
        let lw = TrainLayerBufs::from(&w.layers[li]);
        a.layers[li].backward(g, &rows, &lw, &a.scratch, &grads.layers[li], dx)?;
    }
    let s = last.segments;
    g.launch(&plan::embed_back(
        h,
        head(&a.order, t)?,
        head(&a.seg_start, s + 1)?,
        head(&a.seg_token, s)?,
        dx,
        grads.embed,
    )?)?;
    Ok(())
}
