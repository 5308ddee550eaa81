//! The training pass on the device: a full-sequence forward over a packed [`TrainBatch`] that keeps what its
//! backward reads (each layer's residual inputs, normalised rows, rotated q/k/v, attention output and log-sum-exp,
//! MLP pre-activations and activation), the LM head's log-probabilities of the targets, and the backward from the
//! caller's gradients of those log-probabilities to every weight's gradient.
//!
//! Precision: the decoder's own mixed precision (bf16 weights, activations and GEMM inputs, f32 residual stream and
//! accumulation, f32 logits); gradients flow in f32 between kernels and in bf16 into the GEMMs, and accumulate in f32.
//! Every reduction has a fixed order (no atomics): the same batch gives the same bits.

use half::bf16;
use tlt_kernels::cuda::plan::{self, Buf, GemmY, TrainAttnDims};
use tlt_kernels::cuda::{gpu, DeviceBuf, Elem, Gpu};

use super::batch::TrainBatch;
use crate::config::LlamaConfig;
use crate::device_step::{LinearBufs, WeightBufs};
use crate::{Error, Result};

/// Widths of the model's activations.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub h: usize,
    pub q: usize,
    pub qkv: usize,
    pub inter: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub layers: usize,
    pub eps: f32,
}

impl Dims {
    pub fn new(cfg: &LlamaConfig) -> Self {
        Self {
            h: cfg.hidden_size,
            q: cfg.q_dim(),
            qkv: cfg.q_dim() + 2 * cfg.kv_dim(),
            inter: cfg.intermediate_size,
            vocab: cfg.vocab_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            layers: cfg.num_hidden_layers,
            eps: cfg.rms_norm_eps as f32,
        }
    }

    /// Elements of every activation buffer per row, for the memory report.
    pub fn bytes_per_row(&self) -> usize {
        let per_layer =
            4 * self.h * 2 + 2 * self.h * 2 + 2 * self.qkv + 2 * self.q + 4 * self.heads + 2 * 3 * self.inter;
        let scratch = 4 * self.h * 3 + 2 * self.h + 4 * self.inter + 2 * 2 * self.inter + 2 * self.q + 4 * self.heads;
        self.layers * per_layer
            + 4 * self.h
            + 2 * self.h
            + 4 * self.vocab
            + 2 * self.vocab
            + 6 * self.qkv
            + scratch
            + 40
    }
}

/// One layer's saved activations.
#[derive(Debug)]
struct LayerActs {
    /// The residual stream entering the layer (f32).
    x_in: DeviceBuf<f32>,
    /// Its input norm (bf16).
    xn1: DeviceBuf<bf16>,
    /// q, k (rotated) and v.
    qkv: DeviceBuf<bf16>,
    /// The attention output (before the output projection).
    o: DeviceBuf<bf16>,
    /// `[rows, heads]` log-sum-exp of the attention scores.
    lse: DeviceBuf<f32>,
    /// The residual stream after the attention block (f32).
    x_mid: DeviceBuf<f32>,
    /// Its post-attention norm.
    xn2: DeviceBuf<bf16>,
    /// Gate and up projections, packed.
    gu: DeviceBuf<bf16>,
    /// `silu(gate) * up`.
    act: DeviceBuf<bf16>,
}

/// Every buffer of a training pass, for up to `cap` rows.
#[derive(Debug)]
pub(super) struct Acts {
    pub cap: usize,
    layers: Vec<LayerActs>,
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
    proj: DeviceBuf<bf16>,
    dx: DeviceBuf<f32>,
    dxb: DeviceBuf<bf16>,
    dxn: DeviceBuf<f32>,
    dw_rows: DeviceBuf<f32>,
    d_act: DeviceBuf<f32>,
    d_gu: DeviceBuf<bf16>,
    d_o: DeviceBuf<bf16>,
    delta: DeviceBuf<f32>,
    d_qkv: DeviceBuf<f32>,
    d_qkvb: DeviceBuf<bf16>,
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

/// The first `n` elements of `b`.
fn head<T: Elem>(b: &DeviceBuf<T>, n: usize) -> Result<Buf<T>> {
    Ok(b.buf().slice(0..n)?)
}

impl Acts {
    /// Buffers for `cap` rows of a model of dims `d`.
    pub fn new(g: &dyn Gpu, d: &Dims, cap: usize) -> Result<Self> {
        let z32 = |n: usize| DeviceBuf::<f32>::zeros(g, cap * n);
        let z16 = |n: usize| DeviceBuf::<bf16>::zeros(g, cap * n);
        let zi = |n: usize| DeviceBuf::<i32>::zeros(g, n);
        let layers = (0..d.layers)
            .map(|_| {
                Ok(LayerActs {
                    x_in: z32(d.h)?,
                    xn1: z16(d.h)?,
                    qkv: z16(d.qkv)?,
                    o: z16(d.q)?,
                    lse: z32(d.heads)?,
                    x_mid: z32(d.h)?,
                    xn2: z16(d.h)?,
                    gu: z16(2 * d.inter)?,
                    act: z16(d.inter)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cap,
            layers,
            x_fin: z32(d.h)?,
            xf: z16(d.h)?,
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
            proj: z16(d.h)?,
            dx: z32(d.h)?,
            dxb: z16(d.h)?,
            dxn: z32(d.h)?,
            dw_rows: z32(d.h)?,
            d_act: z32(d.inter)?,
            d_gu: z16(2 * d.inter)?,
            d_o: z16(d.q)?,
            delta: z32(d.heads)?,
            d_qkv: z32(d.qkv)?,
            d_qkvb: z16(d.qkv)?,
            last: None,
        })
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

/// One layer's gradients.
#[derive(Debug, Clone)]
pub(super) struct LayerGrads {
    pub in_norm: Buf<f32>,
    pub post_norm: Buf<f32>,
    pub qkv: Buf<f32>,
    pub qkv_b: Option<Buf<f32>>,
    pub o: Buf<f32>,
    pub gate_up: Buf<f32>,
    pub down: Buf<f32>,
}

/// `y = x · wᵀ` over `rows` rows, plus the bias when the linear has one.
fn linear(g: &dyn Gpu, rows: usize, x: Buf<bf16>, l: &LinearBufs, y: Buf<bf16>) -> Result<()> {
    g.gemm(&plan::gemm(rows, l.out, l.inp, x, l.w, GemmY::Bf16(y))?)?;
    if let Some(b) = l.b {
        g.launch(&plan::bias_add(rows, y, b)?)?;
    }
    Ok(())
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
    let (h, eps) = (d.h, d.eps);
    let (pos, starts) = (head(&a.pos, t)?, head(&a.seq_start, t)?);
    let attn = TrainAttnDims {
        rows: t,
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        scale: 1.0 / (d.head_dim as f32).sqrt(),
    };
    let first_x = a.layers.first().map_or(&a.x_fin, |l| &l.x_in);
    g.launch(&plan::embed_rows(t, h, w.embed, head(&a.ids, t)?, head(first_x, t * h)?)?)?;
    let first_norm = w.layers.first().map_or(w.norm, |l| l.in_norm);
    let first_xn = a.layers.first().map_or(&a.xf, |l| &l.xn1);
    g.launch(&plan::rms_norm(t, h, eps, head(first_x, t * h)?, first_norm, head(first_xn, t * h)?)?)?;
    let proj = head(&a.proj, t * h)?;
    for (li, lw) in w.layers.iter().enumerate() {
        let la = &a.layers[li];
        let qkv = head(&la.qkv, t * d.qkv)?;
        linear(g, t, head(&la.xn1, t * h)?, &lw.qkv, qkv)?;
        g.launch(&plan::rope_rows(t, d.qkv, 0, d.heads, d.head_dim, pos, w.inv_freq, qkv)?)?;
        g.launch(&plan::rope_rows(t, d.qkv, d.q, d.kv_heads, d.head_dim, pos, w.inv_freq, qkv)?)?;
        let o = head(&la.o, t * d.q)?;
        g.launch(&plan::causal_attention(&attn, qkv, starts, o, head(&la.lse, t * d.heads)?)?)?;
        linear(g, t, o, &lw.o, proj)?;
        let x_mid = head(&la.x_mid, t * h)?;
        gpu::copy(g, head(&la.x_in, t * h)?, x_mid)?;
        g.launch(&plan::add_rms_norm(t, h, eps, x_mid, proj, lw.post_norm, head(&la.xn2, t * h)?)?)?;
        let gu = head(&la.gu, t * 2 * d.inter)?;
        linear(g, t, head(&la.xn2, t * h)?, &lw.gate_up, gu)?;
        let act = head(&la.act, t * d.inter)?;
        g.launch(&plan::silu_mul_packed(t, d.inter, gu, act)?)?;
        linear(g, t, act, &lw.down, proj)?;
        let (next_x, next_xn, next_norm) = match (a.layers.get(li + 1), w.layers.get(li + 1)) {
            (Some(nl), Some(nw)) => (&nl.x_in, &nl.xn1, nw.in_norm),
            _ => (&a.x_fin, &a.xf, w.norm),
        };
        let next_x = head(next_x, t * h)?;
        gpu::copy(g, x_mid, next_x)?;
        g.launch(&plan::add_rms_norm(t, h, eps, next_x, proj, next_norm, head(next_xn, t * h)?)?)?;
    }
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
    let (h, eps) = (d.h, d.eps);
    a.g_logp.write(g, 0, g_logp)?;
    let g_ent_buf = match g_ent {
        Some(e) => {
            a.g_ent.write(g, 0, e)?;
            Some(head(&a.g_ent, t)?)
        }
        None => None,
    };
    let ent = if last.entropy { Some(head(&a.entropy, t)?) } else { None };
    let (pos, starts) = (head(&a.pos, t)?, head(&a.seq_start, t)?);
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
    let (dx, dxb, dxn, dw_rows) =
        (head(&a.dx, t * h)?, head(&a.dxb, t * h)?, head(&a.dxn, t * h)?, head(&a.dw_rows, t * h)?);
    let lm = w.head.unwrap_or(w.embed);
    let lm_grad = grads.head.unwrap_or(grads.embed);
    g.gemm(&plan::gemm_dx(t, d.vocab, h, dlogits, lm, GemmY::F32(dxn))?)?;
    g.gemm(&plan::gemm_dw(t, d.vocab, h, dlogits, head(&a.xf, t * h)?, lm_grad, true)?)?;
    gpu::zero(g, dx)?;
    // Adds a norm's input gradient into `dx` and its weight's gradient into `dw`.
    let norm_back = |x: Buf<f32>, nw: Buf<bf16>, dw: Buf<f32>| -> Result<()> {
        g.launch(&plan::rms_norm_back(t, h, eps, x, nw, dxn, dx, dw_rows)?)?;
        g.launch(&plan::col_sum(t, h, dw_rows, dw, true)?)?;
        Ok(())
    };
    norm_back(head(&a.x_fin, t * h)?, w.norm, grads.norm)?;
    let attn = TrainAttnDims {
        rows: t,
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        scale: 1.0 / (d.head_dim as f32).sqrt(),
    };
    for (li, lw) in w.layers.iter().enumerate().rev() {
        let (la, lg) = (&a.layers[li], &grads.layers[li]);
        // MLP: the layer's output is x_mid + down(act); `dx` is its gradient.
        g.launch(&plan::cast_bf16(dx, dxb)?)?;
        let (act, d_act) = (head(&la.act, t * d.inter)?, head(&a.d_act, t * d.inter)?);
        g.gemm(&plan::gemm_dx(t, h, d.inter, dxb, lw.down.w, GemmY::F32(d_act))?)?;
        g.gemm(&plan::gemm_dw(t, h, d.inter, dxb, act, lg.down, true)?)?;
        let (gu, d_gu) = (head(&la.gu, t * 2 * d.inter)?, head(&a.d_gu, t * 2 * d.inter)?);
        g.launch(&plan::silu_mul_back(t, d.inter, gu, d_act, d_gu)?)?;
        g.gemm(&plan::gemm_dx(t, 2 * d.inter, h, d_gu, lw.gate_up.w, GemmY::F32(dxn))?)?;
        g.gemm(&plan::gemm_dw(t, 2 * d.inter, h, d_gu, head(&la.xn2, t * h)?, lg.gate_up, true)?)?;
        norm_back(head(&la.x_mid, t * h)?, lw.post_norm, lg.post_norm)?;
        // Attention: x_mid = x_in + o_proj(attention(rope(qkv(norm(x_in))))).
        g.launch(&plan::cast_bf16(dx, dxb)?)?;
        let (o, d_o) = (head(&la.o, t * d.q)?, head(&a.d_o, t * d.q)?);
        g.gemm(&plan::gemm_dx(t, h, d.q, dxb, lw.o.w, GemmY::Bf16(d_o))?)?;
        g.gemm(&plan::gemm_dw(t, h, d.q, dxb, o, lg.o, true)?)?;
        let (qkv, lse) = (head(&la.qkv, t * d.qkv)?, head(&la.lse, t * d.heads)?);
        let (delta, d_qkv) = (head(&a.delta, t * d.heads)?, head(&a.d_qkv, t * d.qkv)?);
        g.launch(&plan::causal_attention_back_dq(&attn, qkv, starts, o, d_o, lse, delta, d_qkv)?)?;
        g.launch(&plan::causal_attention_back_dkv(&attn, qkv, starts, d_o, lse, delta, d_qkv)?)?;
        g.launch(&plan::rope_rows_back(t, d.qkv, 0, d.heads, d.head_dim, pos, w.inv_freq, d_qkv)?)?;
        g.launch(&plan::rope_rows_back(t, d.qkv, d.q, d.kv_heads, d.head_dim, pos, w.inv_freq, d_qkv)?)?;
        if let Some(db) = lg.qkv_b {
            g.launch(&plan::col_sum(t, d.qkv, d_qkv, db, true)?)?;
        }
        let d_qkvb = head(&a.d_qkvb, t * d.qkv)?;
        g.launch(&plan::cast_bf16(d_qkv, d_qkvb)?)?;
        g.gemm(&plan::gemm_dx(t, d.qkv, h, d_qkvb, lw.qkv.w, GemmY::F32(dxn))?)?;
        g.gemm(&plan::gemm_dw(t, d.qkv, h, d_qkvb, head(&la.xn1, t * h)?, lg.qkv, true)?)?;
        norm_back(head(&la.x_in, t * h)?, lw.in_norm, lg.in_norm)?;
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
