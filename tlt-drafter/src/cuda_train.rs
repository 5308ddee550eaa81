//! EAGLE-2 drafter training on the device: [`CudaDrafterTrainer`] keeps the drafter's trainable weights (`fc` and
//! its decoder layer; never the target's embedding or LM head) as f32 master weights with AdamW moments and
//! gradients on the device, and runs a whole step there: the forward of a packed batch in the decoder's mixed
//! precision (bf16 weights and activations, f32 residual stream), the loss (SmoothL1 feature regression and the soft
//! cross-entropy against the target's next-token distribution, per row on the device, reduced on the host in f64),
//! the backward, global-norm clipping and AdamW, which writes the bf16 weights the next forward runs on.
//!
//! It reads the batches the CPU [`DrafterTrainer`](crate::DrafterTrainer) builds ([`build_eagle2_batch`]: the same
//! packing, shifts, loss weights and `denom`) and computes the CPU's [`Eagle2Drafter::loss`] with the same formulas,
//! so the two trainers take the same steps up to bf16 rounding (tests/device/train.rs measures it). The decoder
//! layer's forward and backward are `tlt_model::cuda::train`'s [`TrainLayer`] without an input norm; the loss
//! kernels are `tlt_kernels`' `draft_train.cu`.
//!
//! Input noise ([`Eagle2LossConfig::noise`]) is drawn on the host by the CPU's own function and uploaded, so a given
//! noise config perturbs both trainers identically (the parity tests run without noise). Not supported: a hot
//! vocabulary restriction of the soft cross-entropy ([`Eagle2Drafter::with_loss_vocab`]: an error at
//! [`CudaDrafterTrainer::new`]), EAGLE-3, biases on the output projection.
//!
//! Written on the device seam ([`Gpu`]): it runs on a CUDA device and, in CI, on the simulated device.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use half::bf16;
use tlt_kernels::cuda::plan::{self, Buf, GemmY, RowBuf, SoftCeBufs, SUM_SQUARES_BLOCKS};
use tlt_kernels::cuda::{gpu, DeviceBuf, Elem, Gpu, SharedGpu};
use tlt_model::cuda::train::{
    clipped_adamw_step, embedding_and_head, grad_norm, LayerDims, LayerGrads, LayerScratch, PackedRows, TrainLayer,
    TrainLayerBufs,
};
use tlt_model::cuda::CudaLlama;
use tlt_model::device_step::LinearBufs;
use tlt_model::optim::GradNorm;

use crate::batch::{add_noise, Layout};
use crate::config::{DrafterConfig, Eagle2LossConfig};
use crate::eagle2::{Eagle2Batch, Eagle2Drafter, Eagle2Weights};
use crate::frozen::FrozenTarget;
use crate::online::FeatureSample;
use crate::train::{build_eagle2_batch, DraftEvaluation, LossParts, StepStats, TrainConfig};
use crate::{Error, Result};

fn kern(e: tlt_kernels::Error) -> Error {
    Error::Model(tlt_model::Error::Kernel(e))
}

/// The trainer's f32 arenas, each in [`CudaDrafterTrainer::named`] order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftArena {
    /// The master weights.
    Master,
    /// AdamW's first moments.
    ExpAvg,
    /// AdamW's second moments.
    ExpAvgSq,
    /// The accumulated gradients.
    Grad,
}

/// The loss of one device forward, reduced on the host in f64 (as [`crate::Eagle2Loss`], as numbers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceLoss {
    /// `vloss_weight * vloss + ploss_weight * ploss`.
    pub total: f64,
    /// SmoothL1 between predicted and target features, mean over H, weighted mean over the positions.
    pub vloss: f64,
    /// The soft cross-entropy, weighted mean over the positions (0 when `ploss_weight` is 0).
    pub ploss: f64,
    /// Sum of the loss weights.
    pub tokens: f64,
    /// Weighted fraction of positions where the draft's argmax is the target's (NaN when `ploss_weight` is 0).
    pub accuracy: f64,
}

/// A checkpoint-named tensor's place in the arenas.
#[derive(Debug, Clone)]
struct Named {
    name: String,
    range: Range<usize>,
    shape: Vec<usize>,
}

/// The trained groups, each one range of the arenas (the projections read from one input stacked, as the training
/// layer reads them).
#[derive(Debug, Clone)]
struct Groups {
    fc: Range<usize>,
    fc_bias: Option<Range<usize>>,
    qkv: Range<usize>,
    qkv_bias: Option<Range<usize>>,
    o: Range<usize>,
    gate_up: Range<usize>,
    down: Range<usize>,
    post_norm: Range<usize>,
    total: usize,
}

/// The arena layout of `cfg`'s trainable weights: the groups and every checkpoint name in arena order.
fn layout_of(cfg: &DrafterConfig) -> Result<(Groups, Vec<Named>)> {
    let (h, l) = (cfg.hidden_size(), &cfg.llama);
    let (q, kv, inter) = (l.q_dim(), l.kv_dim(), l.intermediate_size);
    let bias = cfg.attention_bias();
    if bias.o {
        return Err(Error::config("attention_bias", "o_proj", "device drafter training supports q/k/v biases only"));
    }
    let mut named = Vec::new();
    let mut at = 0;
    let mut group = |parts: &[(&str, Vec<usize>)]| -> Range<usize> {
        let start = at;
        for (name, shape) in parts {
            let n: usize = shape.iter().product();
            named.push(Named { name: (*name).to_string(), range: at..at + n, shape: shape.clone() });
            at += n;
        }
        start..at
    };
    let p = |s: &str| format!("model.layers.0.{s}");
    let fc = group(&[("model.fc.weight", vec![h, 2 * h])]);
    let fc_bias = cfg.fc_bias.then(|| group(&[("model.fc.bias", vec![h])]));
    let (qw, kw, vw) = (p("self_attn.q_proj.weight"), p("self_attn.k_proj.weight"), p("self_attn.v_proj.weight"));
    let qkv = group(&[(&qw, vec![q, h]), (&kw, vec![kv, h]), (&vw, vec![kv, h])]);
    let (qb, kb, vb) = (p("self_attn.q_proj.bias"), p("self_attn.k_proj.bias"), p("self_attn.v_proj.bias"));
    let qkv_bias = bias.qkv.then(|| group(&[(&qb, vec![q]), (&kb, vec![kv]), (&vb, vec![kv])]));
    let o = group(&[(&p("self_attn.o_proj.weight"), vec![h, q])]);
    let gate_up = group(&[(&p("mlp.gate_proj.weight"), vec![inter, h]), (&p("mlp.up_proj.weight"), vec![inter, h])]);
    let down = group(&[(&p("mlp.down_proj.weight"), vec![h, inter])]);
    let post_norm = group(&[(&p("post_attention_layernorm.weight"), vec![h])]);
    let total = at;
    // Exactly the drafter's parameters.
    let mut want = Eagle2Weights::expected_shapes(cfg);
    let mut have: Vec<(String, Vec<usize>)> = named.iter().map(|n| (n.name.clone(), n.shape.clone())).collect();
    want.sort();
    have.sort();
    if want != have {
        return Err(Error::config("drafter", "layer", "its parameters are not the device trainer's EAGLE-2 layer"));
    }
    Ok((Groups { fc, fc_bias, qkv, qkv_bias, o, gate_up, down, post_norm, total }, named))
}

/// The activation buffers of a step outside the layer, for up to `cap` rows.
#[derive(Debug)]
struct Acts {
    cap: usize,
    ids: DeviceBuf<i32>,
    pos: DeviceBuf<i32>,
    starts: DeviceBuf<i32>,
    /// The input features (noised when configured) and the regression targets (`[rows, H]` f32).
    hidden: DeviceBuf<f32>,
    target: DeviceBuf<f32>,
    emb: DeviceBuf<f32>,
    /// `[rows, 2H]`: `[embed(x_{t+1}); h_t]`, fc's input.
    cat: DeviceBuf<bf16>,
    /// `[rows, H]` bf16 scratch: fc's output, then the LM head's inputs, then gradients into GEMMs.
    xb: DeviceBuf<bf16>,
    pred: DeviceBuf<f32>,
    dx: DeviceBuf<f32>,
    dxn: DeviceBuf<f32>,
    logits_t: DeviceBuf<f32>,
    logits_d: DeviceBuf<f32>,
    dlogits: DeviceBuf<bf16>,
    w_v: DeviceBuf<f32>,
    w_p: DeviceBuf<f32>,
    vl: DeviceBuf<f32>,
    pl: DeviceBuf<f32>,
    lse_t: DeviceBuf<f32>,
    lse_d: DeviceBuf<f32>,
    arg_t: DeviceBuf<i32>,
    arg_d: DeviceBuf<i32>,
}

impl Acts {
    fn new(g: &dyn Gpu, h: usize, vocab: usize, cap: usize) -> Result<Self> {
        let z = |n: usize| DeviceBuf::<f32>::zeros(g, cap * n).map_err(kern);
        let zb = |n: usize| DeviceBuf::<bf16>::zeros(g, cap * n).map_err(kern);
        let zi = || DeviceBuf::<i32>::zeros(g, cap).map_err(kern);
        Ok(Self {
            cap,
            ids: zi()?,
            pos: zi()?,
            starts: zi()?,
            hidden: z(h)?,
            target: z(h)?,
            emb: z(h)?,
            cat: zb(2 * h)?,
            xb: zb(h)?,
            pred: z(h)?,
            dx: z(h)?,
            dxn: z(h)?,
            logits_t: z(vocab)?,
            logits_d: z(vocab)?,
            dlogits: zb(vocab)?,
            w_v: z(1)?,
            w_p: z(1)?,
            vl: z(1)?,
            pl: z(1)?,
            lse_t: z(1)?,
            lse_d: z(1)?,
            arg_t: zi()?,
            arg_d: zi()?,
        })
    }
}

/// What the last forward left for its backward.
#[derive(Debug, Clone, Copy)]
struct Last {
    rows: usize,
    ploss: bool,
}

/// The first `n` elements of `b`.
fn head<T: Elem>(b: &DeviceBuf<T>, n: usize) -> Result<Buf<T>> {
    b.buf().slice(0..n).map_err(kern)
}

/// Elements `r` of `b`.
fn part<T: Elem>(b: &DeviceBuf<T>, r: &Range<usize>) -> Result<Buf<T>> {
    b.buf().slice(r.clone()).map_err(kern)
}

/// A tensor's elements as f32 on the host.
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Trains an EAGLE-2 drafter on the device (see the module docs): AdamW over f32 master weights on the device, the
/// bf16 weights its forward runs on written in place by each step.
#[derive(Debug)]
pub struct CudaDrafterTrainer {
    // Fields drop in declaration order: buffers first, then the device.
    master: DeviceBuf<f32>,
    m: DeviceBuf<f32>,
    v: DeviceBuf<f32>,
    grad: DeviceBuf<f32>,
    /// The bf16 weights, in arena order.
    weights: DeviceBuf<bf16>,
    embed: DeviceBuf<bf16>,
    lm_head: DeviceBuf<bf16>,
    inv_freq: DeviceBuf<f64>,
    partials: DeviceBuf<f64>,
    layer: TrainLayer,
    scratch: LayerScratch,
    a: Acts,
    gpu: SharedGpu,
    cfg: DrafterConfig,
    train: TrainConfig,
    dims: LayerDims,
    groups: Groups,
    named: Vec<Named>,
    steps: u64,
    last: Option<Last>,
}

impl CudaDrafterTrainer {
    /// A trainer on `gpu` of `drafter`'s weights (master copies of its weights, zero moments) and its target's
    /// embedding and LM head (bf16 copies: [`Self::set_target`] replaces them), stepping as `train` says (AdamW
    /// hyperparameters, learning-rate schedule, clipping, loss weights, packing), with buffers for batches of up to
    /// `max_rows` positions (`rows * row_len` of a packed batch).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid `train`, a drafter with a hot vocabulary or biases the trainer does not
    /// cover; [`Error::InvalidArgument`] for `max_rows == 0`; the device's error when an allocation fails.
    pub fn new(gpu: SharedGpu, drafter: &Eagle2Drafter, train: TrainConfig, max_rows: usize) -> Result<Self> {
        train.validate()?;
        if drafter.loss_vocab()?.is_some() {
            return Err(Error::config("loss_vocab", "set", "device drafter training covers the full vocabulary only"));
        }
        if max_rows == 0 {
            return Err(Error::InvalidArgument("a device drafter trainer needs room for at least one row".into()));
        }
        let cfg = drafter.config().clone();
        let (groups, named) = layout_of(&cfg)?;
        let mut host = vec![0f32; groups.total];
        for (name, t) in drafter.weights().named_tensors() {
            let n = named.iter().find(|n| n.name == name).ok_or_else(|| Error::config(&name, "?", "not trained"))?;
            host[n.range.clone()].copy_from_slice(&host_f32(&t)?);
        }
        let g = gpu.as_ref();
        let dims = LayerDims::new(&cfg.llama);
        let (h, vocab) = (cfg.hidden_size(), cfg.vocab_size());
        let zeros = |n: usize| DeviceBuf::<f32>::zeros(g, n).map_err(kern);
        let master = DeviceBuf::from_host(g, &host).map_err(kern)?;
        let weights = DeviceBuf::<bf16>::zeros(g, groups.total).map_err(kern)?;
        g.launch(&plan::cast_bf16(master.buf(), weights.buf()).map_err(kern)?).map_err(kern)?;
        let (embed, lm_head) = Self::upload_target(g, drafter.target())?;
        let layer = TrainLayer::new(g, dims, max_rows)?;
        Ok(Self {
            m: zeros(groups.total)?,
            v: zeros(groups.total)?,
            grad: zeros(groups.total)?,
            master,
            weights,
            embed,
            lm_head,
            inv_freq: DeviceBuf::from_host(g, &cfg.llama.rope_inv_freq()).map_err(kern)?,
            partials: DeviceBuf::zeros(g, SUM_SQUARES_BLOCKS).map_err(kern)?,
            layer,
            scratch: LayerScratch::new(g, &dims, max_rows)?,
            a: Acts::new(g, h, vocab, max_rows)?,
            gpu,
            cfg,
            train,
            dims,
            groups,
            named,
            steps: 0,
            last: None,
        })
    }

    /// The device memory a trainer of `cfg` holds for batches of `max_rows` positions, in bytes: master weights,
    /// moments and gradients (f32, 16 bytes per weight), the bf16 weights, the target's embedding and LM head (bf16)
    /// and the activations (both `[rows, vocab]` f32 logits and their bf16 gradient dominate at large vocabularies).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a drafter the trainer does not cover.
    pub fn memory(cfg: &DrafterConfig, max_rows: usize) -> Result<usize> {
        let (groups, _) = layout_of(cfg)?;
        let d = LayerDims::new(&cfg.llama);
        let (h, vocab) = (cfg.hidden_size(), cfg.vocab_size());
        let per_row = 12 + 6 * 4 * h + 2 * 2 * h + 2 * h + 2 * 4 * vocab + 2 * vocab + 6 * 4 + 8;
        let per_row = per_row + d.acts_bytes_per_row() + d.scratch_bytes_per_row();
        Ok(18 * groups.total + 2 * 2 * vocab * h + max_rows * per_row + 8 * SUM_SQUARES_BLOCKS)
    }

    fn upload_target(g: &dyn Gpu, t: &FrozenTarget) -> Result<(DeviceBuf<bf16>, DeviceBuf<bf16>)> {
        let up = |x: &Tensor| -> Result<DeviceBuf<bf16>> {
            let v: Vec<bf16> = host_f32(x)?.into_iter().map(bf16::from_f32).collect();
            DeviceBuf::from_host(g, &v).map_err(kern)
        };
        Ok((up(t.embed_tokens())?, up(t.lm_head())?))
    }

    /// Replaces the target's embedding and LM head the trainer reads (the policy changed), keeping the drafter's
    /// weights and optimizer state.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a target of another shape; the device's error.
    pub fn set_target(&mut self, target: &FrozenTarget) -> Result<()> {
        if target.vocab_size() != self.cfg.vocab_size() || target.hidden_size() != self.cfg.hidden_size() {
            return Err(Error::config("target", target.vocab_size(), "a replacement target must keep the shape"));
        }
        let (e, l) = Self::upload_target(self.gpu.as_ref(), target)?;
        self.embed = e;
        self.lm_head = l;
        Ok(())
    }

    /// Copies the policy's embedding and LM head from its device decoder (device to device, no host round trip):
    /// [`Self::set_target`] after a policy update on the device.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a model on another device; [`Error::InvalidConfig`] for another vocabulary or
    /// hidden size; the device's error.
    pub fn copy_target_from(&mut self, model: &CudaLlama) -> Result<()> {
        if !Arc::ptr_eq(model.gpu(), &self.gpu) {
            return Err(Error::InvalidArgument("the policy is on another device than the drafter trainer".into()));
        }
        let c = model.config();
        if c.vocab_size != self.cfg.vocab_size() || c.hidden_size != self.cfg.hidden_size() {
            return Err(Error::config("target", c.vocab_size, "a replacement target must keep the shape"));
        }
        let (e, h) = embedding_and_head(model);
        let g = self.gpu.as_ref();
        gpu::copy(g, e, self.embed.buf()).map_err(kern)?;
        gpu::copy(g, h, self.lm_head.buf()).map_err(kern)
    }

    /// The drafter's configuration.
    pub fn config(&self) -> &DrafterConfig {
        &self.cfg
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The most positions a batch may have.
    pub fn max_rows(&self) -> usize {
        self.a.cap
    }

    /// The layer's weights (bf16 slices of the weight arena).
    fn layer_bufs(&self) -> Result<TrainLayerBufs> {
        let (d, gr, w) = (&self.dims, &self.groups, &self.weights);
        let lin = |r: &Range<usize>, b: Option<&Range<usize>>, out: usize, inp: usize| -> Result<LinearBufs> {
            Ok(LinearBufs { w: part(w, r)?, b: b.map(|b| part(w, b)).transpose()?, out, inp })
        };
        Ok(TrainLayerBufs {
            in_norm: None,
            post_norm: part(w, &gr.post_norm)?,
            qkv: lin(&gr.qkv, gr.qkv_bias.as_ref(), d.qkv, d.h)?,
            o: lin(&gr.o, None, d.h, d.q)?,
            gate_up: lin(&gr.gate_up, None, 2 * d.inter, d.h)?,
            down: lin(&gr.down, None, d.h, d.inter)?,
        })
    }

    /// Where the layer's gradients accumulate (slices of the gradient arena).
    fn layer_grads(&self) -> Result<LayerGrads> {
        let (gr, a) = (&self.groups, &self.grad);
        Ok(LayerGrads::full(
            None,
            part(a, &gr.post_norm)?,
            part(a, &gr.qkv)?,
            gr.qkv_bias.as_ref().map(|r| part(a, r)).transpose()?,
            [part(a, &gr.o)?, part(a, &gr.gate_up)?, part(a, &gr.down)?],
        ))
    }

    fn rows(&self, t: usize) -> Result<PackedRows> {
        Ok(PackedRows {
            rows: t,
            pos: head(&self.a.pos, t)?,
            seq_start: head(&self.a.starts, t)?,
            inv_freq: self.inv_freq.buf(),
        })
    }

    /// The forward and loss of `batch` under `loss` (the CPU's [`Eagle2Drafter::loss`] on the device), keeping what
    /// [`Self::backward`] reads.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] for a batch of the wrong shape or more positions than [`Self::max_rows`];
    /// [`Error::InvalidConfig`] for an invalid `loss`; the device's error.
    pub fn forward(&mut self, batch: &Eagle2Batch, loss: &Eagle2LossConfig) -> Result<DeviceLoss> {
        loss.validate()?;
        self.last = None;
        let (h, vocab) = (self.cfg.hidden_size(), self.cfg.vocab_size());
        let lay = Layout::new(&batch.input_ids, &batch.loss_mask, batch.segments.as_ref(), vocab)?;
        if batch.hidden.dims() != [lay.b, lay.t, h] {
            return Err(Error::batch(
                "hidden",
                format!("shape {:?}, expected [{}, {}, {h}]", batch.hidden.dims(), lay.b, lay.t),
            ));
        }
        let (t, rows) = (lay.t, lay.b * lay.t);
        if rows > self.a.cap {
            return Err(Error::batch("input_ids", format!("{rows} positions for a trainer of {}", self.a.cap)));
        }
        // The host side of the CPU's loss: inputs (noised), shifted targets, ids, positions, weights and denom.
        let clean = host_f32(&batch.hidden)?;
        let input = match &loss.noise {
            Some(n) => host_f32(&add_noise(&batch.hidden.to_dtype(DType::F32)?, Some(n))?)?,
            None => clean.clone(),
        };
        let mut target = vec![0f32; rows * h];
        for k in 0..rows {
            if (k % t) + 1 < t {
                target[k * h..(k + 1) * h].copy_from_slice(&clean[(k + 1) * h..(k + 2) * h]);
            }
        }
        let int = |v: usize| i32::try_from(v).map_err(|_| Error::batch("input_ids", "index exceeds i32"));
        let ids = lay.shifted_ids(1).into_iter().map(|i| int(i as usize)).collect::<Result<Vec<_>>>()?;
        let pos = lay.positions().iter().map(|&p| int(p)).collect::<Result<Vec<_>>>()?;
        let starts = lay.positions().iter().enumerate().map(|(k, &p)| int(k - p)).collect::<Result<Vec<_>>>()?;
        let w = lay.weights(1);
        let tokens: f64 = w.iter().sum();
        let denom = tokens.max(1.0);
        let w_v: Vec<f32> = w.iter().map(|x| (x * loss.vloss_weight / denom) as f32).collect();
        let w_p: Vec<f32> = w.iter().map(|x| (x * loss.ploss_weight / denom) as f32).collect();
        let g = self.gpu.as_ref();
        let a = &self.a;
        for (buf, data) in [(&a.ids, &ids), (&a.pos, &pos), (&a.starts, &starts)] {
            buf.write(g, 0, data).map_err(kern)?;
        }
        for (buf, data) in [(&a.hidden, &input), (&a.target, &target), (&a.w_v, &w_v), (&a.w_p, &w_p)] {
            buf.write(g, 0, data).map_err(kern)?;
        }
        let run = |l: tlt_kernels::Result<plan::Launch>| g.launch(&l.map_err(kern)?).map_err(kern);
        let (emb, hid, cat, xb) =
            (head(&a.emb, rows * h)?, head(&a.hidden, rows * h)?, head(&a.cat, rows * 2 * h)?, head(&a.xb, rows * h)?);
        run(plan::embed_rows(rows, h, self.embed.buf(), head(&a.ids, rows)?, emb))?;
        run(plan::concat_rows(rows, RowBuf::F32(emb, h), Some(RowBuf::F32(hid, h)), cat))?;
        g.gemm(&plan::gemm(rows, h, 2 * h, cat, part(&self.weights, &self.groups.fc)?, GemmY::Bf16(xb)).map_err(kern)?)
            .map_err(kern)?;
        if let Some(b) = &self.groups.fc_bias {
            run(plan::bias_add(rows, xb, part(&self.weights, b)?))?;
        }
        let x_in = self.layer.input(rows)?;
        gpu::zero(g, x_in).map_err(kern)?;
        run(plan::add_to_residual(x_in, xb))?;
        let (lw, prow) = (self.layer_bufs()?, self.rows(rows)?);
        let pred = head(&a.pred, rows * h)?;
        self.layer.forward(g, &prow, &lw, &self.scratch, pred)?;
        let a = &self.a;
        let (tgt, vl) = (head(&a.target, rows * h)?, head(&a.vl, rows)?);
        run(plan::smooth_l1(rows, h, pred, tgt, vl))?;
        let ploss = loss.ploss_weight != 0.0;
        let out = SoftCeBufs {
            loss: head(&a.pl, rows)?,
            lse_t: head(&a.lse_t, rows)?,
            lse_d: head(&a.lse_d, rows)?,
            arg_t: head(&a.arg_t, rows)?,
            arg_d: head(&a.arg_d, rows)?,
        };
        if ploss {
            let (lt, ld) = (head(&a.logits_t, rows * vocab)?, head(&a.logits_d, rows * vocab)?);
            let lm = self.lm_head.buf();
            run(plan::cast_bf16(pred, xb))?;
            g.gemm(&plan::gemm(rows, vocab, h, xb, lm, GemmY::F32(ld)).map_err(kern)?).map_err(kern)?;
            run(plan::cast_bf16(tgt, xb))?;
            g.gemm(&plan::gemm(rows, vocab, h, xb, lm, GemmY::F32(lt)).map_err(kern)?).map_err(kern)?;
            run(plan::soft_ce(rows, vocab, lt, ld, &out))?;
        }
        let read = |b: Buf<f32>| gpu::read(g, b).map_err(kern);
        let wsum = |per: &[f32]| w.iter().zip(per).map(|(w, &l)| w * f64::from(l)).sum::<f64>() / denom;
        let vloss = wsum(&read(vl)?);
        let (ploss_v, accuracy) = if ploss {
            let (at, ad) = (gpu::read(g, out.arg_t).map_err(kern)?, gpu::read(g, out.arg_d).map_err(kern)?);
            let hits: f64 = w.iter().zip(at.iter().zip(&ad)).filter(|(_, (x, y))| x == y).map(|(w, _)| w).sum();
            (wsum(&read(out.loss)?), hits / denom)
        } else {
            (0.0, f64::NAN)
        };
        let total = loss.vloss_weight * vloss + loss.ploss_weight * ploss_v;
        self.last = Some(Last { rows, ploss });
        Ok(DeviceLoss { total, vloss, ploss: ploss_v, tokens, accuracy })
    }

    /// Adds the gradient of the last [`Self::forward`]'s total loss with respect to every trainable weight to the
    /// accumulated gradients.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] without a forward before it; the device's error.
    pub fn backward(&mut self) -> Result<()> {
        let last =
            self.last.take().ok_or_else(|| Error::InvalidArgument("a backward needs a forward before it".into()))?;
        let (rows, h, vocab) = (last.rows, self.cfg.hidden_size(), self.cfg.vocab_size());
        let g = self.gpu.as_ref();
        let a = &self.a;
        let run = |l: tlt_kernels::Result<plan::Launch>| g.launch(&l.map_err(kern)?).map_err(kern);
        let (pred, tgt, dx) = (head(&a.pred, rows * h)?, head(&a.target, rows * h)?, head(&a.dx, rows * h)?);
        run(plan::smooth_l1_back(rows, h, pred, tgt, head(&a.w_v, rows)?, dx))?;
        if last.ploss {
            let (lt, ld, dl) =
                (head(&a.logits_t, rows * vocab)?, head(&a.logits_d, rows * vocab)?, head(&a.dlogits, rows * vocab)?);
            let (lse_t, lse_d) = (head(&a.lse_t, rows)?, head(&a.lse_d, rows)?);
            run(plan::soft_ce_back(rows, vocab, lt, ld, lse_t, lse_d, head(&a.w_p, rows)?, dl))?;
            let dxn = head(&a.dxn, rows * h)?;
            g.gemm(&plan::gemm_dx(rows, vocab, h, dl, self.lm_head.buf(), GemmY::F32(dxn)).map_err(kern)?)
                .map_err(kern)?;
            run(plan::add_f32(dx, dxn))?;
        }
        let (lw, lg, prow) = (self.layer_bufs()?, self.layer_grads()?, self.rows(rows)?);
        self.layer.backward(g, &prow, &lw, &self.scratch, &lg, dx)?;
        // fc: x = fc([emb; h]); its input is frozen (no gradient flows further).
        let a = &self.a;
        let (xb, cat) = (head(&a.xb, rows * h)?, head(&a.cat, rows * 2 * h)?);
        run(plan::cast_bf16(dx, xb))?;
        let gfc = part(&self.grad, &self.groups.fc)?;
        g.gemm(&plan::gemm_dw(rows, h, 2 * h, xb, cat, gfc, true).map_err(kern)?).map_err(kern)?;
        if let Some(b) = &self.groups.fc_bias {
            run(plan::col_sum(rows, h, dx, part(&self.grad, b)?, true))?;
        }
        Ok(())
    }

    /// Sets the accumulated gradients to zero.
    ///
    /// # Errors
    /// The device's error.
    pub fn zero_grad(&mut self) -> Result<()> {
        gpu::zero(self.gpu.as_ref(), self.grad.buf()).map_err(kern)
    }

    /// The global L2 norm of the accumulated gradients (f64 partial sums of a fixed grid, summed in order).
    ///
    /// # Errors
    /// The device's error.
    pub fn grad_norm(&self) -> Result<f64> {
        Ok(grad_norm(self.gpu.as_ref(), self.grad.buf(), &self.partials)?)
    }

    /// One AdamW step at `lr` from the accumulated gradients, clipped to a global norm of `max_grad_norm`, with the
    /// host optimizer's arithmetic (`tlt_model::optim::AdamW`); the bf16 weights are rewritten from the new masters.
    /// A non-finite norm skips the step and changes nothing ([`GradNorm::applied`]).
    ///
    /// # Errors
    /// [`Error::Model`] (an invalid config) for a negative or non-finite `lr`; the device's error.
    pub fn apply(&mut self, lr: f64, max_grad_norm: Option<f64>) -> Result<GradNorm> {
        let hp = self.train.adamw();
        let (norm, step) =
            clipped_adamw_step(self.gpu.as_ref(), self.grad.buf(), &self.partials, &hp, self.steps, lr, max_grad_norm)?;
        let Some(s) = step else { return Ok(norm) };
        let l = plan::adamw(&s, self.master.buf(), self.m.buf(), self.v.buf(), self.grad.buf(), self.weights.buf());
        self.gpu.launch(&l.map_err(kern)?).map_err(kern)?;
        self.steps = s.step;
        Ok(norm)
    }

    /// One training step on `samples`, as [`DrafterTrainer::step`](crate::DrafterTrainer::step) takes it: the batch
    /// [`build_eagle2_batch`] packs, the loss of the trainer's [`TrainConfig::eagle2_loss`] (its noise, if any,
    /// seeded with `seed ^ noise_seed`, none without `noise_seed`), backward, clipping and AdamW at
    /// [`TrainConfig::lr_at`]`(steps)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when no sample has a training position or the loss is not finite (nothing is
    /// updated); as [`Self::forward`].
    pub fn step(&mut self, samples: &[Arc<FeatureSample>], noise_seed: Option<u64>) -> Result<StepStats> {
        let t0 = Instant::now();
        let lr = self.train.lr_at(self.steps);
        let (batch, info) = build_eagle2_batch(samples, self.cfg.hidden_size(), &self.train)?;
        let mut lc = self.train.eagle2_loss;
        match (lc.noise.as_mut(), noise_seed) {
            (Some(n), Some(s)) => n.seed ^= s,
            (Some(_), None) => lc.noise = None,
            _ => {}
        }
        self.zero_grad()?;
        let l = self.forward(&batch, &lc)?;
        if !l.total.is_finite() {
            self.last = None;
            return Err(Error::InvalidArgument(format!("non-finite loss {} at step {}", l.total, self.steps)));
        }
        self.backward()?;
        let grad_norm = self.apply(lr, self.train.grad_clip)?;
        let eval = DraftEvaluation {
            loss: l.total,
            parts: LossParts::Eagle2 { vloss: l.vloss, ploss: l.ploss },
            accuracy: l.accuracy,
            targets: l.tokens,
            batch: info,
        };
        Ok(StepStats { step: self.steps, eval, grad_norm, lr, seconds: t0.elapsed().as_secs_f64() })
    }

    /// Sets the optimizer's state: `steps` updates applied, and each parameter's AdamW moments by checkpoint name
    /// (`(name, exp_avg, exp_avg_sq)`, every trained parameter once), e.g. a resumed host trainer's.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a missing, unknown, repeated or wrongly sized parameter (nothing is changed);
    /// the device's error.
    pub fn set_optimizer_state(&mut self, steps: u64, moments: &[(String, Vec<f32>, Vec<f32>)]) -> Result<()> {
        let (mut m, mut v) = (vec![0f32; self.groups.total], vec![0f32; self.groups.total]);
        let mut seen = vec![false; self.named.len()];
        for (name, a, b) in moments {
            let i = self.named.iter().position(|n| &n.name == name);
            let i = i.ok_or_else(|| Error::InvalidArgument(format!("optimizer state for an unknown {name}")))?;
            let r = self.named[i].range.clone();
            if seen[i] || a.len() != r.len() || b.len() != r.len() {
                return Err(Error::InvalidArgument(format!(
                    "optimizer state for {name}: repeated, or {} and {} values for {}",
                    a.len(),
                    b.len(),
                    r.len()
                )));
            }
            seen[i] = true;
            m[r.clone()].copy_from_slice(a);
            v[r].copy_from_slice(b);
        }
        if let Some(i) = seen.iter().position(|s| !s) {
            return Err(Error::InvalidArgument(format!("no optimizer state for {}", self.named[i].name)));
        }
        let g = self.gpu.as_ref();
        self.m = DeviceBuf::from_host(g, &m).map_err(kern)?;
        self.v = DeviceBuf::from_host(g, &v).map_err(kern)?;
        self.steps = steps;
        Ok(())
    }

    /// Arena `arena` on the host by checkpoint name (`model.fc.weight`, `model.layers.0.self_attn.q_proj.weight`,
    /// ...: [`Eagle2Weights::named_tensors`]' names), each flat row-major, in arena order.
    ///
    /// # Errors
    /// The device's error.
    pub fn named(&self, arena: DraftArena) -> Result<Vec<(String, Vec<f32>)>> {
        let buf = match arena {
            DraftArena::Master => &self.master,
            DraftArena::ExpAvg => &self.m,
            DraftArena::ExpAvgSq => &self.v,
            DraftArena::Grad => &self.grad,
        };
        let all = buf.to_host(self.gpu.as_ref()).map_err(kern)?;
        Ok(self.named.iter().map(|n| (n.name.clone(), all[n.range.clone()].to_vec())).collect())
    }

    /// The drafter's weights now (the f32 masters) as host weights, e.g. to publish a runtime or save a checkpoint.
    ///
    /// # Errors
    /// The device's error.
    pub fn weights(&self) -> Result<Eagle2Weights> {
        let all = self.master.to_host(self.gpu.as_ref()).map_err(kern)?;
        let mut get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let n =
                self.named.iter().find(|n| n.name == name).ok_or_else(|| Error::config(name, "?", "not trained"))?;
            Ok(Tensor::from_slice(&all[n.range.clone()], shape, &Device::Cpu)?)
        };
        Eagle2Weights::from_source(&self.cfg, "model.", &mut get)
    }

    /// The last forward's draft logits (`[positions, vocab]` f32, row-major as the batch's `[b, t]`), when its loss
    /// computed them (`ploss_weight > 0`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] without such a forward; the device's error.
    pub fn draft_logits(&self) -> Result<Vec<f32>> {
        match self.last {
            Some(Last { rows, ploss: true }) => {
                gpu::read(self.gpu.as_ref(), head(&self.a.logits_d, rows * self.cfg.vocab_size())?).map_err(kern)
            }
            _ => Err(Error::InvalidArgument("no forward with draft logits to read".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tlt_model::LlamaConfig;

    #[test]
    fn the_arena_holds_exactly_the_drafters_parameters() {
        let mut target = LlamaConfig::tiny(24, 16, 2);
        for (model_type, fc_bias, n) in [("llama", true, 10), ("qwen2", false, 12)] {
            target.model_type = model_type.into();
            let cfg = DrafterConfig::eagle2_from_target(&target, fc_bias);
            let (g, named) = layout_of(&cfg).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(named.len(), n, "{model_type}");
            assert_eq!((g.fc.start, g.post_norm.end, g.total), (0, g.total, named.last().map_or(0, |n| n.range.end)));
            assert_eq!(g.qkv_bias.is_some(), model_type == "qwen2");
            assert!(named.windows(2).all(|w| w[0].range.end == w[1].range.start), "{model_type}: contiguous");
            assert!(CudaDrafterTrainer::memory(&cfg, 64).unwrap_or(0) > 16 * g.total);
        }
        // Llama with `attention_bias`: an o_proj bias, which the device layer does not train.
        target.model_type = "llama".into();
        target.attention_bias = true;
        assert!(layout_of(&DrafterConfig::eagle2_from_target(&target, false)).is_err());
    }
}
