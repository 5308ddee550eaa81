//! One decoder layer's training forward and backward on packed rows, as reusable units: [`TrainLayer`] holds the
//! activations its backward reads, [`LayerScratch`] the buffers its backward only passes through (shared by every
//! layer of a model), [`TrainLayerBufs`] and [`LayerGrads`] the weights it reads and the gradients it adds to.
//! [`super::CudaTrainer`] stacks them into the decoder; `tlt-drafter`'s device trainer runs one of them as EAGLE-2's
//! layer, without an input norm.
//!
//! Precision: the decoder's own mixed precision (bf16 weights, activations and GEMM inputs, f32 residual stream and
//! accumulation); gradients flow in f32 between kernels and in bf16 into the GEMMs, and accumulate in f32. Every
//! reduction has a fixed order (no atomics): the same rows give the same bits.

use half::bf16;
use tlt_kernels::cuda::plan::{self, Buf, GemmY, TrainAttnDims};
use tlt_kernels::cuda::{gpu, DeviceBuf, Elem, Gpu};

use super::adapter::{LayerLora, LinearLora};
use crate::config::LlamaConfig;
use crate::device_step::{LayerBufs, LinearBufs};
use crate::{Error, Result};

/// Widths of one decoder layer's activations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerDims {
    /// Hidden size (the residual stream's width).
    pub h: usize,
    /// Query width (`heads * head_dim`).
    pub q: usize,
    /// The fused q/k/v projection's width (`q + 2 * kv_heads * head_dim`).
    pub qkv: usize,
    /// MLP intermediate size.
    pub inter: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// The RMSNorms' epsilon.
    pub eps: f32,
}

impl LayerDims {
    /// The widths of a layer of `cfg`.
    #[must_use]
    pub fn new(cfg: &LlamaConfig) -> Self {
        Self {
            h: cfg.hidden_size,
            q: cfg.q_dim(),
            qkv: cfg.q_dim() + 2 * cfg.kv_dim(),
            inter: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            eps: cfg.rms_norm_eps as f32,
        }
    }

    /// Bytes of one [`TrainLayer`]'s saved activations per row.
    #[must_use]
    pub fn acts_bytes_per_row(&self) -> usize {
        4 * self.h * 2 + 2 * self.h * 2 + 2 * self.qkv + 2 * self.q + 4 * self.heads + 2 * 3 * self.inter
    }

    /// Bytes of a [`LayerScratch`] per row.
    #[must_use]
    pub fn scratch_bytes_per_row(&self) -> usize {
        2 * self.h * 2
            + 4 * self.h * 2
            + 4 * self.inter
            + 2 * 2 * self.inter
            + 2 * self.q
            + 4 * self.heads
            + 6 * self.qkv
    }

    fn attn(&self, rows: usize) -> TrainAttnDims {
        TrainAttnDims {
            rows,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }
}

/// The packed rows a layer runs on: `rows` tokens of several sequences one after the other; row `r` is at RoPE
/// position `pos[r]` and attends to rows `seq_start[r]..=r`.
#[derive(Debug, Clone, Copy)]
pub struct PackedRows {
    /// Rows.
    pub rows: usize,
    /// `[rows]` RoPE positions.
    pub pos: Buf<i32>,
    /// `[rows]` the first row of each row's sequence.
    pub seq_start: Buf<i32>,
    /// `[head_dim / 2]` RoPE inverse frequencies.
    pub inv_freq: Buf<f64>,
}

/// One layer's weights as the training pass reads them (bf16).
#[derive(Debug, Clone, Copy)]
pub struct TrainLayerBufs {
    /// The attention's input norm; `None`: the identity (EAGLE's drafter layer).
    pub in_norm: Option<Buf<bf16>>,
    /// The MLP's input norm.
    pub post_norm: Buf<bf16>,
    /// q, k and v stacked (`[qkv, h]`), with their stacked bias when the model has one.
    pub qkv: LinearBufs,
    /// The attention output projection (`[h, q]`, no bias).
    pub o: LinearBufs,
    /// Gate and up stacked (`[2 inter, h]`, no bias).
    pub gate_up: LinearBufs,
    /// The down projection (`[h, inter]`, no bias).
    pub down: LinearBufs,
}

impl From<&LayerBufs> for TrainLayerBufs {
    fn from(l: &LayerBufs) -> Self {
        Self { in_norm: Some(l.in_norm), post_norm: l.post_norm, qkv: l.qkv, o: l.o, gate_up: l.gate_up, down: l.down }
    }
}

/// Where one layer's gradients accumulate (f32, each the shape of its weight); `None`: the weight is frozen (no
/// gradient computed).
#[derive(Debug, Clone, Copy)]
pub struct LayerGrads {
    /// The input norm's (only for a layer with one).
    pub in_norm: Option<Buf<f32>>,
    /// The post-attention norm's.
    pub post_norm: Option<Buf<f32>>,
    /// The stacked q/k/v weight's.
    pub qkv: Option<Buf<f32>>,
    /// The stacked q/k/v bias's (only for a layer with one).
    pub qkv_b: Option<Buf<f32>>,
    /// The output projection's.
    pub o: Option<Buf<f32>>,
    /// The stacked gate/up weight's.
    pub gate_up: Option<Buf<f32>>,
    /// The down projection's.
    pub down: Option<Buf<f32>>,
    /// Low-rank adapters on the linears (LoRA), whose gradients are added too.
    pub lora: Option<LayerLora>,
}

impl LayerGrads {
    /// Every weight of a layer trained, at these gradient buffers.
    #[must_use]
    pub fn full(
        in_norm: Option<Buf<f32>>,
        post_norm: Buf<f32>,
        qkv: Buf<f32>,
        qkv_b: Option<Buf<f32>>,
        [o, gate_up, down]: [Buf<f32>; 3],
    ) -> Self {
        Self {
            in_norm,
            post_norm: Some(post_norm),
            qkv: Some(qkv),
            qkv_b,
            o: Some(o),
            gate_up: Some(gate_up),
            down: Some(down),
            lora: None,
        }
    }
}

/// Adds the weight gradients of the linear `y[t, out] = x[t, inp] · wᵀ` from its output gradient `dy`: the full
/// weight's into `full`, and its adapters' (`lora`).
#[allow(clippy::too_many_arguments)]
fn weight_grads(
    g: &dyn Gpu,
    t: usize,
    out: usize,
    inp: usize,
    dy: Buf<bf16>,
    x: Buf<bf16>,
    full: Option<Buf<f32>>,
    lora: Option<&LinearLora>,
) -> Result<()> {
    if let Some(dw) = full {
        g.gemm(&plan::gemm_dw(t, out, inp, dy, x, dw, true)?)?;
    }
    if let Some(l) = lora {
        l.grads(g, t, out, inp, dy, x)?;
    }
    Ok(())
}

/// The first `n` elements of `b`.
pub(super) fn head<T: Elem>(b: &DeviceBuf<T>, n: usize) -> Result<Buf<T>> {
    Ok(b.buf().slice(0..n)?)
}

/// `y = x · wᵀ` over `rows` rows, plus the bias when the linear has one.
pub(super) fn linear(g: &dyn Gpu, rows: usize, x: Buf<bf16>, l: &LinearBufs, y: Buf<bf16>) -> Result<()> {
    g.gemm(&plan::gemm(rows, l.out, l.inp, x, l.w, GemmY::Bf16(y))?)?;
    if let Some(b) = l.b {
        g.launch(&plan::bias_add(rows, y, b)?)?;
    }
    Ok(())
}

/// The buffers a layer's backward passes its gradients through (none of them outlives a layer's backward), for up
/// to `cap` rows; one serves every layer of a model.
#[derive(Debug)]
pub struct LayerScratch {
    cap: usize,
    /// A projection's output (forward).
    proj: DeviceBuf<bf16>,
    dxb: DeviceBuf<bf16>,
    /// The gradient of a norm's output (f32, `[rows, h]`).
    pub(super) dxn: DeviceBuf<f32>,
    /// A norm's per-row weight gradients.
    pub(super) dw_rows: DeviceBuf<f32>,
    d_act: DeviceBuf<f32>,
    d_gu: DeviceBuf<bf16>,
    d_o: DeviceBuf<bf16>,
    delta: DeviceBuf<f32>,
    d_qkv: DeviceBuf<f32>,
    d_qkvb: DeviceBuf<bf16>,
}

impl LayerScratch {
    /// Scratch for `cap` rows of layers of dims `d`.
    ///
    /// # Errors
    /// [`Error::Kernel`] when the device fails (out of memory).
    pub fn new(g: &dyn Gpu, d: &LayerDims, cap: usize) -> Result<Self> {
        let z32 = |n: usize| DeviceBuf::<f32>::zeros(g, cap * n);
        let z16 = |n: usize| DeviceBuf::<bf16>::zeros(g, cap * n);
        Ok(Self {
            cap,
            proj: z16(d.h)?,
            dxb: z16(d.h)?,
            dxn: z32(d.h)?,
            dw_rows: z32(d.h)?,
            d_act: z32(d.inter)?,
            d_gu: z16(2 * d.inter)?,
            d_o: z16(d.q)?,
            delta: z32(d.heads)?,
            d_qkv: z32(d.qkv)?,
            d_qkvb: z16(d.qkv)?,
        })
    }

    /// Adds the input gradient of the RMSNorm `y = norm(x) * nw` into `dx`, from the output gradient in `dxn`, and
    /// the weight's gradient into `dw` (none for a frozen norm).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_back(
        &self,
        g: &dyn Gpu,
        d: &LayerDims,
        rows: usize,
        x: Buf<f32>,
        nw: Buf<bf16>,
        dw: Option<Buf<f32>>,
        dx: Buf<f32>,
    ) -> Result<()> {
        let (dxn, dw_rows) = (head(&self.dxn, rows * d.h)?, head(&self.dw_rows, rows * d.h)?);
        g.launch(&plan::rms_norm_back(rows, d.h, d.eps, x, nw, dxn, dx, dw_rows)?)?;
        if let Some(dw) = dw {
            g.launch(&plan::col_sum(rows, d.h, dw_rows, dw, true)?)?;
        }
        Ok(())
    }
}

/// One decoder layer's training pass over packed rows, with the activations its backward reads: the layer's input
/// (f32, written by the caller before [`Self::forward`]: [`Self::input`]), its normalised input, rotated q/k/v,
/// attention output and log-sum-exp, the residual stream after the attention, the MLP's normalised input,
/// pre-activations and activation.
#[derive(Debug)]
pub struct TrainLayer {
    d: LayerDims,
    cap: usize,
    /// The residual stream entering the layer (f32).
    x_in: DeviceBuf<f32>,
    /// Its input norm (bf16; the input rounded to bf16 without one).
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
    /// Rows of the last forward (what its backward reads); `None` before one.
    last: Option<usize>,
}

impl TrainLayer {
    /// A layer of dims `d` with activations for up to `cap` rows.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for `cap == 0`; [`Error::Kernel`] when the device fails (out of memory).
    pub fn new(g: &dyn Gpu, d: LayerDims, cap: usize) -> Result<Self> {
        if cap == 0 {
            return Err(Error::InvalidInput("a training layer needs room for at least one row".into()));
        }
        let z32 = |n: usize| DeviceBuf::<f32>::zeros(g, cap * n);
        let z16 = |n: usize| DeviceBuf::<bf16>::zeros(g, cap * n);
        Ok(Self {
            x_in: z32(d.h)?,
            xn1: z16(d.h)?,
            qkv: z16(d.qkv)?,
            o: z16(d.q)?,
            lse: z32(d.heads)?,
            x_mid: z32(d.h)?,
            xn2: z16(d.h)?,
            gu: z16(2 * d.inter)?,
            act: z16(d.inter)?,
            d,
            cap,
            last: None,
        })
    }

    /// The layer's dims.
    #[must_use]
    pub fn dims(&self) -> &LayerDims {
        &self.d
    }

    /// The most rows a forward may have.
    #[must_use]
    pub fn max_rows(&self) -> usize {
        self.cap
    }

    /// The layer's input for `rows` rows (`[rows, h]` f32): where the caller writes it before [`Self::forward`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for more rows than the layer holds.
    pub fn input(&self, rows: usize) -> Result<Buf<f32>> {
        self.check_rows(rows)?;
        head(&self.x_in, rows * self.d.h)
    }

    fn check_rows(&self, rows: usize) -> Result<()> {
        if rows == 0 || rows > self.cap {
            return Err(Error::InvalidInput(format!("{rows} rows for a training layer of {}", self.cap)));
        }
        Ok(())
    }

    /// Checks the weights, gradients and scratch against the layer: biases on q/k/v only, an input-norm gradient
    /// exactly when there is an input norm, a q/k/v bias gradient exactly when there is a bias.
    fn check(&self, w: &TrainLayerBufs, s: &LayerScratch, grads: Option<&LayerGrads>) -> Result<()> {
        if w.o.b.is_some() || w.gate_up.b.is_some() || w.down.b.is_some() {
            return Err(Error::InvalidInput("device training supports biases on q/k/v only".into()));
        }
        let d = &self.d;
        let shapes = [(&w.qkv, d.qkv, d.h), (&w.o, d.h, d.q), (&w.gate_up, 2 * d.inter, d.h), (&w.down, d.h, d.inter)];
        if shapes.iter().any(|(l, out, inp)| (l.out, l.inp) != (*out, *inp)) {
            return Err(Error::InvalidInput(format!("layer weights of other shapes than the dims {d:?}")));
        }
        if s.cap < self.cap {
            return Err(Error::InvalidInput(format!("scratch for {} rows, a layer of {}", s.cap, self.cap)));
        }
        if let Some(gr) = grads {
            if (gr.in_norm.is_some() && w.in_norm.is_none()) || (gr.qkv_b.is_some() && w.qkv.b.is_none()) {
                return Err(Error::InvalidInput("layer gradients do not match its weights (norm, bias)".into()));
            }
        }
        Ok(())
    }

    /// The forward of `rows` through weights `w` from [`Self::input`], keeping its activations: `out` (`[rows, h]`
    /// f32, not the input) gets the layer's output, `x + attn(norm(x))` then `+ mlp(post_norm(.))`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for more rows than the layer holds, weights of other shapes, biases outside q/k/v or
    /// a smaller scratch; [`Error::Kernel`] when the device fails.
    pub fn forward(
        &mut self,
        g: &dyn Gpu,
        rows: &PackedRows,
        w: &TrainLayerBufs,
        s: &LayerScratch,
        out: Buf<f32>,
    ) -> Result<()> {
        let t = rows.rows;
        self.check_rows(t)?;
        self.check(w, s, None)?;
        self.last = None;
        let d = self.d;
        let (h, eps) = (d.h, d.eps);
        let (x_in, xn1) = (head(&self.x_in, t * h)?, head(&self.xn1, t * h)?);
        match w.in_norm {
            Some(n) => g.launch(&plan::rms_norm(t, h, eps, x_in, n, xn1)?)?,
            None => g.launch(&plan::cast_bf16(x_in, xn1)?)?,
        }
        let qkv = head(&self.qkv, t * d.qkv)?;
        linear(g, t, xn1, &w.qkv, qkv)?;
        g.launch(&plan::rope_rows(t, d.qkv, 0, d.heads, d.head_dim, rows.pos, rows.inv_freq, qkv)?)?;
        g.launch(&plan::rope_rows(t, d.qkv, d.q, d.kv_heads, d.head_dim, rows.pos, rows.inv_freq, qkv)?)?;
        let o = head(&self.o, t * d.q)?;
        g.launch(&plan::causal_attention(&d.attn(t), qkv, rows.seq_start, o, head(&self.lse, t * d.heads)?)?)?;
        let proj = head(&s.proj, t * h)?;
        linear(g, t, o, &w.o, proj)?;
        let x_mid = head(&self.x_mid, t * h)?;
        gpu::copy(g, x_in, x_mid)?;
        g.launch(&plan::add_rms_norm(t, h, eps, x_mid, proj, w.post_norm, head(&self.xn2, t * h)?)?)?;
        let gu = head(&self.gu, t * 2 * d.inter)?;
        linear(g, t, head(&self.xn2, t * h)?, &w.gate_up, gu)?;
        let act = head(&self.act, t * d.inter)?;
        g.launch(&plan::silu_mul_packed(t, d.inter, gu, act)?)?;
        linear(g, t, act, &w.down, proj)?;
        gpu::copy(g, x_mid, out)?;
        g.launch(&plan::add_to_residual(out, proj)?)?;
        self.last = Some(t);
        Ok(())
    }

    /// The backward of the last [`Self::forward`] (which must have run on the same `rows` and `w`): `dx` (`[rows,
    /// h]` f32) holds the gradient of the layer's output and gets that of its input; every weight's gradient is
    /// added into `grads`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] without a forward before it, for other rows than it ran on, or gradients that do not
    /// match the weights; [`Error::Kernel`] when the device fails.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &mut self,
        g: &dyn Gpu,
        rows: &PackedRows,
        w: &TrainLayerBufs,
        s: &LayerScratch,
        grads: &LayerGrads,
        dx: Buf<f32>,
    ) -> Result<()> {
        let t = self.last.take().ok_or_else(|| Error::InvalidInput("a backward needs a forward before it".into()))?;
        if rows.rows != t {
            return Err(Error::InvalidInput(format!("a backward of {} rows after a forward of {t}", rows.rows)));
        }
        self.check(w, s, Some(grads))?;
        let d = self.d;
        let h = d.h;
        let dxb = head(&s.dxb, t * h)?;
        let dxn = head(&s.dxn, t * h)?;
        // MLP: the layer's output is x_mid + down(act); `dx` is its gradient.
        g.launch(&plan::cast_bf16(dx, dxb)?)?;
        let (act, d_act) = (head(&self.act, t * d.inter)?, head(&s.d_act, t * d.inter)?);
        g.gemm(&plan::gemm_dx(t, h, d.inter, dxb, w.down.w, GemmY::F32(d_act))?)?;
        let lora = grads.lora.as_ref();
        weight_grads(g, t, h, d.inter, dxb, act, grads.down, lora.map(|l| &l.down))?;
        let (gu, d_gu) = (head(&self.gu, t * 2 * d.inter)?, head(&s.d_gu, t * 2 * d.inter)?);
        g.launch(&plan::silu_mul_back(t, d.inter, gu, d_act, d_gu)?)?;
        g.gemm(&plan::gemm_dx(t, 2 * d.inter, h, d_gu, w.gate_up.w, GemmY::F32(dxn))?)?;
        let xn2 = head(&self.xn2, t * h)?;
        weight_grads(g, t, 2 * d.inter, h, d_gu, xn2, grads.gate_up, lora.map(|l| &l.gate_up))?;
        s.norm_back(g, &d, t, head(&self.x_mid, t * h)?, w.post_norm, grads.post_norm, dx)?;
        // Attention: x_mid = x_in + o_proj(attention(rope(qkv(norm(x_in))))).
        g.launch(&plan::cast_bf16(dx, dxb)?)?;
        let (o, d_o) = (head(&self.o, t * d.q)?, head(&s.d_o, t * d.q)?);
        g.gemm(&plan::gemm_dx(t, h, d.q, dxb, w.o.w, GemmY::Bf16(d_o))?)?;
        weight_grads(g, t, h, d.q, dxb, o, grads.o, lora.map(|l| &l.o))?;
        let (qkv, lse) = (head(&self.qkv, t * d.qkv)?, head(&self.lse, t * d.heads)?);
        let (delta, d_qkv) = (head(&s.delta, t * d.heads)?, head(&s.d_qkv, t * d.qkv)?);
        let (attn, starts) = (d.attn(t), rows.seq_start);
        g.launch(&plan::causal_attention_back_dq(&attn, qkv, starts, o, d_o, lse, delta, d_qkv)?)?;
        g.launch(&plan::causal_attention_back_dkv(&attn, qkv, starts, d_o, lse, delta, d_qkv)?)?;
        g.launch(&plan::rope_rows_back(t, d.qkv, 0, d.heads, d.head_dim, rows.pos, rows.inv_freq, d_qkv)?)?;
        g.launch(&plan::rope_rows_back(t, d.qkv, d.q, d.kv_heads, d.head_dim, rows.pos, rows.inv_freq, d_qkv)?)?;
        if let Some(db) = grads.qkv_b {
            g.launch(&plan::col_sum(t, d.qkv, d_qkv, db, true)?)?;
        }
        let d_qkvb = head(&s.d_qkvb, t * d.qkv)?;
        g.launch(&plan::cast_bf16(d_qkv, d_qkvb)?)?;
        g.gemm(&plan::gemm_dx(t, d.qkv, h, d_qkvb, w.qkv.w, GemmY::F32(dxn))?)?;
        let xn1 = head(&self.xn1, t * h)?;
        weight_grads(g, t, d.qkv, h, d_qkvb, xn1, grads.qkv, lora.map(|l| &l.qkv))?;
        match w.in_norm {
            Some(nw) => s.norm_back(g, &d, t, head(&self.x_in, t * h)?, nw, grads.in_norm, dx)?,
            // No input norm: the attention read the input itself (rounded to bf16: a straight-through gradient).
            None => g.launch(&plan::add_f32(dx, dxn)?)?,
        }
        Ok(())
    }
}
