//! The training pass on the device: a full-sequence forward over a packed [`TrainBatch`] that keeps what its
//! backward reads (every layer's activations: [`TrainLayer`]), the LM head's log-probabilities of the targets, and
//! the backward from the caller's gradients of those log-probabilities to every weight's gradient.
//!
//! Precision: the decoder's own mixed precision (bf16 weights, activations and GEMM inputs, f32 residual stream and
//! accumulation, f32 logits); gradients flow in f32 between kernels and in bf16 into the GEMMs, and accumulate in f32.
//! Every reduction has a fixed order (no atomics): the same batch gives the same bits.

use std::ops::Range;

use half::bf16;
use tlt_kernels::cuda::plan::{self, Buf, GemmY};
use tlt_kernels::cuda::{gpu, DeviceBuf, Elem, Gpu};

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

    /// Bytes of every buffer [`Acts::new`] allocates for `opts`.
    pub fn bytes(&self, opts: &TrainOptions) -> usize {
        let (l, h, cap) = (&self.layer, self.layer.h, opts.max_rows);
        let layers = if opts.checkpoint {
            self.layers * 4 * h + usize::from(self.layers > 0) * l.acts_bytes_per_row()
        } else {
            self.layers * l.acts_bytes_per_row()
        };
        // x_fin and dx (f32), xf (bf16); seven i32 index buffers (seg_start one longer) and five f32 per row.
        let per_row = layers + l.scratch_bytes_per_row() + 4 * h * 2 + 2 * h + 7 * 4 + 5 * 4;
        cap * per_row + 4 + opts.head_cap() * self.vocab * (4 + 2)
    }
}

/// How a training pass spends device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainOptions {
    /// The most rows (tokens, packed) of one batch.
    pub max_rows: usize,
    /// Activation checkpointing: keep each layer's input only (f32, `4 * hidden` bytes per row) and recompute the
    /// layer's forward in the backward (one more forward of every layer but the last). The same bits as without.
    pub checkpoint: bool,
    /// Rows of the LM head's f32 logits (and bf16 logit gradients) held at once, `[head_rows, vocab]`; a batch of
    /// more rows runs the head in chunks of this many rows, and its backward recomputes each chunk's logits.
    pub head_rows: usize,
}

impl TrainOptions {
    /// The default chunk of the LM head: 256 rows, as the CPU update's (152K-token vocabularies: 233 MB).
    pub const HEAD_ROWS: usize = 256;

    /// Room for `max_rows` rows, checkpointed, the head in chunks of [`Self::HEAD_ROWS`].
    #[must_use]
    pub fn new(max_rows: usize) -> Self {
        Self { max_rows, checkpoint: true, head_rows: Self::HEAD_ROWS }
    }

    /// Rows of the head's buffers: a chunk, or the whole batch when smaller.
    #[must_use]
    pub fn head_cap(&self) -> usize {
        self.head_rows.min(self.max_rows)
    }

    /// # Errors
    /// [`Error::InvalidInput`] for no room for a row or a chunk of no rows.
    pub fn validate(&self) -> Result<()> {
        if self.max_rows == 0 {
            return Err(Error::InvalidInput("a trainer needs room for at least one row".into()));
        }
        if self.head_rows == 0 {
            return Err(Error::InvalidInput("the LM head's chunk needs at least one row".into()));
        }
        Ok(())
    }
}

/// The chunks of `t` rows the LM head runs in, `rows` at a time.
fn head_chunks(t: usize, rows: usize) -> impl Iterator<Item = Range<usize>> {
    (0..t).step_by(rows.max(1)).map(move |s| s..(s + rows).min(t))
}

/// The layer that runs layer `li` on `t` rows, its input in place: its own (`layers[li]`), or with checkpointing
/// (`inputs` not empty) the one kept layer with the saved input `inputs[li]` copied in.
fn layer_at<'a>(
    g: &dyn Gpu,
    layers: &'a mut [TrainLayer],
    inputs: &[DeviceBuf<f32>],
    li: usize,
    t: usize,
) -> Result<&'a mut TrainLayer> {
    let Some(x) = inputs.get(li) else { return Ok(&mut layers[li]) };
    let work = &mut layers[0];
    gpu::copy(g, head(x, t * work.dims().h)?, work.input(t)?)?;
    Ok(work)
}

/// Rows `c` of `b`, `width` elements each.
fn rows_of<T: Elem>(b: &DeviceBuf<T>, c: &Range<usize>, width: usize) -> Result<Buf<T>> {
    Ok(b.buf().slice(c.start * width..c.end * width)?)
}

/// Every buffer of a training pass, for up to `cap` rows.
#[derive(Debug)]
pub(super) struct Acts {
    pub cap: usize,
    /// Rows of the head's buffers.
    head_cap: usize,
    /// Every layer's activations; with checkpointing one layer's, the layer being run.
    layers: Vec<TrainLayer>,
    /// With checkpointing, each layer's input (f32 `[cap, h]`); empty without.
    inputs: Vec<DeviceBuf<f32>>,
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
    /// Buffers of a model of dims `d` as `opts` plans them.
    pub fn new(g: &dyn Gpu, d: &Dims, opts: &TrainOptions) -> Result<Self> {
        opts.validate()?;
        let (cap, head_cap) = (opts.max_rows, opts.head_cap());
        let z32 = |n: usize| DeviceBuf::<f32>::zeros(g, cap * n);
        let z16 = |n: usize| DeviceBuf::<bf16>::zeros(g, cap * n);
        let zi = |n: usize| DeviceBuf::<i32>::zeros(g, n);
        let h = d.layer.h;
        let kept = if opts.checkpoint { d.layers.min(1) } else { d.layers };
        let layers = (0..kept).map(|_| TrainLayer::new(g, d.layer, cap)).collect::<Result<Vec<_>>>()?;
        let saved = if opts.checkpoint { d.layers } else { 0 };
        Ok(Self {
            cap,
            head_cap,
            inputs: (0..saved).map(|_| z32(h)).collect::<std::result::Result<Vec<_>, _>>()?,
            layers,
            scratch: LayerScratch::new(g, &d.layer, cap)?,
            x_fin: z32(h)?,
            xf: z16(h)?,
            logits: DeviceBuf::zeros(g, head_cap * d.vocab)?,
            dlogits: DeviceBuf::zeros(g, head_cap * d.vocab)?,
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

    fn checkpointed(&self) -> bool {
        !self.inputs.is_empty()
    }

    /// Where layer `li`'s input of `t` rows is kept: its saved input with checkpointing, else its own buffer.
    fn input(&self, li: usize, t: usize) -> Result<Buf<f32>> {
        match self.inputs.get(li) {
            Some(x) => head(x, t * (x.len() / self.cap)),
            None => self.layers[li].input(t),
        }
    }

    /// `logits[..c.len()]` = the head over rows `c` of the final norm's output.
    fn head_logits(&self, g: &dyn Gpu, d: &Dims, lm: Buf<bf16>, c: &Range<usize>) -> Result<Buf<f32>> {
        let (n, h) = (c.len(), d.layer.h);
        let logits = head(&self.logits, n * d.vocab)?;
        g.gemm(&plan::gemm(n, d.vocab, h, rows_of(&self.xf, c, h)?, lm, GemmY::F32(logits))?)?;
        Ok(logits)
    }
}

/// Where each weight's gradient lives in the gradient arena (the same enumeration as the weights); `None`: frozen
/// (with a tied head, `head` is `None` and the embedding's gradient takes the head's too).
#[derive(Debug, Clone)]
pub(super) struct GradBufs {
    pub embed: Option<Buf<f32>>,
    pub head: Option<Buf<f32>>,
    pub norm: Option<Buf<f32>>,
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
    let first_x = if d.layers > 0 { a.input(0, t)? } else { x_fin };
    g.launch(&plan::embed_rows(t, h, w.embed, head(&a.ids, t)?, first_x)?)?;
    for li in 0..d.layers {
        let out = if li + 1 < d.layers { a.input(li + 1, t)? } else { x_fin };
        let lw = TrainLayerBufs::from(&w.layers[li]);
        layer_at(g, &mut a.layers, &a.inputs, li, t)?.forward(g, &rows, &lw, &a.scratch, out)?;
    }
    g.launch(&plan::rms_norm(t, h, eps, x_fin, w.norm, head(&a.xf, t * h)?)?)?;
    let lm = w.head.unwrap_or(w.embed);
    for c in head_chunks(t, a.head_cap) {
        let logits = a.head_logits(g, d, lm, &c)?;
        let ent = if entropy { Some(rows_of(&a.entropy, &c, 1)?) } else { None };
        let (targets, logp, lse) =
            (rows_of(&a.targets, &c, 1)?, rows_of(&a.logp, &c, 1)?, rows_of(&a.lse_head, &c, 1)?);
        g.launch(&plan::token_logprobs(c.len(), d.vocab, inv_temp, logits, targets, logp, lse, ent)?)?;
    }
    let (logp, ent) = (head(&a.logp, t)?, if entropy { Some(head(&a.entropy, t)?) } else { None });
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
    if let Some(e) = g_ent {
        a.g_ent.write(g, 0, e)?;
    }
    let lm = w.head.unwrap_or(w.embed);
    let lm_grad = if w.head.is_some() { grads.head } else { grads.embed };
    let chunks = head_chunks(t, a.head_cap).collect::<Vec<_>>();
    for c in &chunks {
        let n = c.len();
        // One chunk: the forward's logits are still there; more: each chunk's again (the same bits).
        let logits = if chunks.len() > 1 { a.head_logits(g, d, lm, c)? } else { head(&a.logits, n * d.vocab)? };
        let dlogits = head(&a.dlogits, n * d.vocab)?;
        let ent = if last.entropy { Some(rows_of(&a.entropy, c, 1)?) } else { None };
        let g_ent = if g_ent.is_some() { Some(rows_of(&a.g_ent, c, 1)?) } else { None };
        g.launch(&plan::token_logprobs_back(
            n,
            d.vocab,
            last.inv_temp,
            logits,
            rows_of(&a.targets, c, 1)?,
            rows_of(&a.lse_head, c, 1)?,
            ent,
            rows_of(&a.g_logp, c, 1)?,
            g_ent,
            dlogits,
        )?)?;
        g.gemm(&plan::gemm_dx(n, d.vocab, h, dlogits, lm, GemmY::F32(rows_of(&a.scratch.dxn, c, h)?))?)?;
        if let Some(dw) = lm_grad {
            g.gemm(&plan::gemm_dw(n, d.vocab, h, dlogits, rows_of(&a.xf, c, h)?, dw, true)?)?;
        }
    }
    let (dx, x_fin) = (head(&a.dx, t * h)?, head(&a.x_fin, t * h)?);
    gpu::zero(g, dx)?;
    a.scratch.norm_back(g, &d.layer, t, x_fin, w.norm, grads.norm, dx)?;
    let rows = a.rows(t, w.inv_freq)?;
    for li in (0..d.layers).rev() {
        let lw = TrainLayerBufs::from(&w.layers[li]);
        let layer = if a.checkpointed() && li + 1 == d.layers {
            // The kept layer still holds the last layer's activations from the forward.
            &mut a.layers[0]
        } else {
            let layer = layer_at(g, &mut a.layers, &a.inputs, li, t)?;
            if !a.inputs.is_empty() {
                // Recompute from the saved input; the output goes to `x_fin`, which nothing reads any more.
                layer.forward(g, &rows, &lw, &a.scratch, x_fin)?;
            }
            layer
        };
        layer.backward(g, &rows, &lw, &a.scratch, &grads.layers[li], dx)?;
    }
    let Some(embed) = grads.embed else { return Ok(()) };
    let s = last.segments;
    g.launch(&plan::embed_back(h, head(&a.order, t)?, head(&a.seg_start, s + 1)?, head(&a.seg_token, s)?, dx, embed)?)?;
    Ok(())
}
