//! Training a [`CudaLlama`] on its device: the forward and backward of a packed batch ([`TrainBatch`]) in the
//! decoder's mixed precision, gradients accumulated in f32, and AdamW over f32 master weights and moments that
//! writes the bf16 weights the decoder runs on **in place**: after [`CudaTrainer::step`] the next decode uses the
//! new weights with no host round trip, and captured CUDA graphs stay valid (same buffers).
//!
//! The loss is the caller's: [`CudaTrainer::forward`] returns each row's log-probability of its target (and its
//! entropy), the caller computes its loss and the loss's gradient with respect to those (the GRPO loss on the host,
//! on a few floats per token), and [`CudaTrainer::backward`] carries that gradient through the model. So every loss
//! formula exists once, on the host, for the CPU and the device paths alike.
//!
//! One decoder layer's forward and backward are reusable units ([`TrainLayer`], with [`LayerScratch`],
//! [`TrainLayerBufs`], [`LayerGrads`], [`PackedRows`]): `tlt-drafter`'s device trainer runs EAGLE-2's layer with them.
//!
//! Written on the device seam ([`tlt_kernels::cuda::Gpu`]): it runs on a CUDA device and, in CI, on the
//! simulated device, every kernel included. Not supported yet: Qwen3's q/k head norms and biases on other projections
//! than q/k/v (an error at [`CudaTrainer::new`]).

mod adapter;
mod batch;
mod common;
mod layer;
mod lora;
mod pass;

use half::bf16;
use tlt_kernels::cuda::plan::{self, Buf, SUM_SQUARES_BLOCKS};
use tlt_kernels::cuda::{gpu, DeviceBuf, SharedGpu};

pub use self::adapter::{LayerLora, LinearLora, LoraSlot};
pub use self::batch::TrainBatch;
use self::common::{check_config, checked_forward};
pub use self::common::{check_trainable, clipped_adamw_step, grad_norm, Arena};
pub use self::layer::{LayerDims, LayerGrads, LayerScratch, PackedRows, TrainLayer, TrainLayerBufs};
pub use self::lora::{lora_memory, lora_params, CudaLoraTrainer, LoraConfig, LoraParam, PeftTensor};
pub use self::pass::TrainOptions;
use self::pass::{Acts, Dims, GradBufs};
use super::CudaLlama;
use crate::config::LlamaConfig;
use crate::device_step::WeightBufs;
use crate::optim::{AdamWParams, GradNorm};
use crate::{Error, Result};

/// One trained weight: its name and its elements in the trainer's arenas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainParam {
    /// `embed`, `head`, `norm`, `layers.{l}.{in_norm,post_norm,qkv,qkv_bias,o,gate_up,down}`: the decoder's
    /// buffers (q/k/v and gate/up stacked as the decoder stacks them).
    pub name: String,
    /// Its elements in the arenas.
    pub range: std::ops::Range<usize>,
}

/// The decoder's weights in the trainer's order, with their names.
fn weight_list(w: &WeightBufs) -> Vec<(String, Buf<bf16>)> {
    let mut out = vec![("embed".to_string(), w.embed)];
    if let Some(h) = w.head {
        out.push(("head".into(), h));
    }
    out.push(("norm".into(), w.norm));
    for (l, lw) in w.layers.iter().enumerate() {
        out.push((format!("layers.{l}.in_norm"), lw.in_norm));
        out.push((format!("layers.{l}.post_norm"), lw.post_norm));
        out.push((format!("layers.{l}.qkv"), lw.qkv.w));
        if let Some(b) = lw.qkv.b {
            out.push((format!("layers.{l}.qkv_bias"), b));
        }
        out.push((format!("layers.{l}.o"), lw.o.w));
        out.push((format!("layers.{l}.gate_up"), lw.gate_up.w));
        out.push((format!("layers.{l}.down"), lw.down.w));
    }
    out
}

/// Every HF-named tensor's elements in the arenas: the stacked q/k/v and gate/up split back into their projections
/// (rows of a stacked weight are consecutive, so each projection is one range).
fn hf_ranges(params: &[TrainParam], d: &Dims) -> Result<Vec<(String, std::ops::Range<usize>)>> {
    let d = &d.layer;
    let kv = (d.qkv - d.q) / 2;
    let mut out = Vec::new();
    for p in params {
        let at = p.range.start;
        let parts = p.name.split('.').collect::<Vec<_>>();
        let (names, sizes): (Vec<String>, Vec<usize>) = match parts.as_slice() {
            ["embed"] => (vec!["model.embed_tokens.weight".into()], vec![p.range.len()]),
            ["head"] => (vec!["lm_head.weight".into()], vec![p.range.len()]),
            ["norm"] => (vec!["model.norm.weight".into()], vec![p.range.len()]),
            ["layers", l, what] => {
                let (ns, rows, width): (&[&str], Vec<usize>, usize) = match *what {
                    "in_norm" => (&["input_layernorm.weight"], vec![1], d.h),
                    "post_norm" => (&["post_attention_layernorm.weight"], vec![1], d.h),
                    "qkv" => (
                        &["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                        vec![d.q, kv, kv],
                        d.h,
                    ),
                    "qkv_bias" => (
                        &["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
                        vec![d.q, kv, kv],
                        1,
                    ),
                    "o" => (&["self_attn.o_proj.weight"], vec![1], p.range.len()),
                    "gate_up" => (&["mlp.gate_proj.weight", "mlp.up_proj.weight"], vec![d.inter, d.inter], d.h),
                    "down" => (&["mlp.down_proj.weight"], vec![1], p.range.len()),
                    _ => return Err(Error::InvalidInput(format!("unknown trained weight `{}`", p.name))),
                };
                (ns.iter().map(|n| format!("model.layers.{l}.{n}")).collect(), rows.iter().map(|r| r * width).collect())
            }
            _ => return Err(Error::InvalidInput(format!("unknown trained weight `{}`", p.name))),
        };
        if sizes.iter().sum::<usize>() != p.range.len() {
            return Err(Error::InvalidInput(format!("`{}` does not split into its projections", p.name)));
        }
        let mut start = at;
        for (n, len) in names.into_iter().zip(sizes) {
            out.push((n, start..start + len));
            start += len;
        }
    }
    Ok(out)
}

/// `model`'s token embedding and LM head on its device (`[vocab, hidden]` bf16 each; the head is the embedding when
/// tied): what a drafter trained beside the policy reads (`tlt-drafter`'s device trainer copies them, device to
/// device, after each policy update). Valid while `model` lives and keeps its weights' buffers.
#[must_use]
pub fn embedding_and_head(model: &CudaLlama) -> (Buf<bf16>, Buf<bf16>) {
    let w = model.w.bufs();
    (w.embed, w.head.unwrap_or(w.embed))
}

/// The device memory a trainer of `cfg` over `weights` weights holds with `opts`, in bytes: master weights, moments
/// and gradients (f32, 16 bytes per weight), the gradient norm's partial sums and the training pass's buffers
/// (every allocation [`CudaTrainer::with_options`] makes).
#[must_use]
pub fn train_memory(cfg: &LlamaConfig, weights: usize, opts: &TrainOptions) -> usize {
    16 * weights + 8 * SUM_SQUARES_BLOCKS + Dims::new(cfg).bytes(opts)
}

/// Each weight's gradient in the gradient arena `grad` (laid out as `params`), by the decoder's structure.
fn grad_bufs(params: &[TrainParam], grad: &DeviceBuf<f32>, layers: usize) -> Result<GradBufs> {
    let by_name = |name: &str| -> Result<Buf<f32>> {
        let p = params
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| Error::InvalidInput(format!("no trained weight `{name}`")))?;
        Ok(grad.buf().slice(p.range.clone())?)
    };
    let has = |name: &str| params.iter().any(|p| p.name == name);
    Ok(GradBufs {
        embed: Some(by_name("embed")?),
        head: has("head").then(|| by_name("head")).transpose()?,
        norm: Some(by_name("norm")?),
        layers: (0..layers)
            .map(|l| {
                let n = |s: &str| format!("layers.{l}.{s}");
                Ok(LayerGrads::full(
                    Some(by_name(&n("in_norm"))?),
                    by_name(&n("post_norm"))?,
                    by_name(&n("qkv"))?,
                    has(&n("qkv_bias")).then(|| by_name(&n("qkv_bias"))).transpose()?,
                    [by_name(&n("o"))?, by_name(&n("gate_up"))?, by_name(&n("down"))?],
                ))
            })
            .collect::<Result<Vec<_>>>()?,
    })
}

/// AdamW on the device over f32 master weights of a [`CudaLlama`], with the training pass's buffers.
#[derive(Debug)]
pub struct CudaTrainer {
    gpu: SharedGpu,
    cfg: LlamaConfig,
    dims: Dims,
    params: Vec<TrainParam>,
    /// HF-named tensors' ranges in the arenas.
    hf: Vec<(String, std::ops::Range<usize>)>,
    master: DeviceBuf<f32>,
    m: DeviceBuf<f32>,
    v: DeviceBuf<f32>,
    grad: DeviceBuf<f32>,
    /// Each weight's gradient in `grad`.
    grads: GradBufs,
    partials: DeviceBuf<f64>,
    acts: Acts,
    opts: TrainOptions,
    hp: AdamWParams,
    steps: u64,
}

impl CudaTrainer {
    /// A trainer of `model`'s weights (master copies made from its bf16 weights, zero moments) with buffers for
    /// batches of up to `max_rows` rows, checkpointed, the head in chunks ([`TrainOptions::new`]).
    ///
    /// # Errors
    /// As [`Self::with_options`].
    pub fn new(model: &CudaLlama, hp: AdamWParams, max_rows: usize) -> Result<Self> {
        Self::with_options(model, hp, &TrainOptions::new(max_rows))
    }

    /// A trainer of `model`'s weights with the training pass's buffers as `opts` plans them
    /// ([`train_memory`] counts them).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an architecture the training pass does not cover (Qwen3's head norms, biases
    /// outside q/k/v), invalid `hp` or `opts`; [`Error::Kernel`] when the device fails (out of memory).
    pub fn with_options(model: &CudaLlama, hp: AdamWParams, opts: &TrainOptions) -> Result<Self> {
        hp.validate()?;
        opts.validate()?;
        check_trainable(model.config())?;
        let w = model.w.bufs();
        if w.layers.iter().any(|l| l.qk_norm.is_some()) {
            return Err(Error::InvalidInput("device training of q/k head norms (Qwen3) is not implemented".into()));
        }
        if w.layers.iter().any(|l| l.o.b.is_some() || l.gate_up.b.is_some() || l.down.b.is_some()) {
            return Err(Error::InvalidInput("device training supports biases on q/k/v only".into()));
        }
        let gpu = model.gpu().clone();
        let g = gpu.as_ref();
        let mut params = Vec::new();
        let mut at = 0;
        for (name, b) in weight_list(&w) {
            params.push(TrainParam { name, range: at..at + b.len() });
            at += b.len();
        }
        let master = DeviceBuf::<f32>::zeros(g, at)?;
        for ((_, b), p) in weight_list(&w).iter().zip(&params) {
            g.launch(&plan::add_to_residual(master.buf().slice(p.range.clone())?, *b)?)?;
        }
        let cfg = model.config().clone();
        let dims = Dims::new(&cfg);
        let hf = hf_ranges(&params, &dims)?;
        let grad = DeviceBuf::zeros(g, at)?;
        let grads = grad_bufs(&params, &grad, dims.layers)?;
        Ok(Self {
            hf,
            m: DeviceBuf::zeros(g, at)?,
            v: DeviceBuf::zeros(g, at)?,
            grad,
            grads,
            partials: DeviceBuf::zeros(g, SUM_SQUARES_BLOCKS)?,
            acts: Acts::new(g, &dims, opts)?,
            opts: *opts,
            master,
            gpu,
            cfg,
            dims,
            params,
            hp,
            steps: 0,
        })
    }

    /// The trained weights, in arena order.
    #[must_use]
    pub fn params(&self) -> &[TrainParam] {
        &self.params
    }

    /// Optimizer steps taken.
    #[must_use]
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The most rows a batch may have.
    #[must_use]
    pub fn max_rows(&self) -> usize {
        self.acts.cap
    }

    /// How the training pass's buffers were planned.
    #[must_use]
    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }

    fn check_model(&self, model: &CudaLlama) -> Result<()> {
        check_config(&self.cfg, model)
    }

    /// The forward of `batch` through `model` (the policy this trainer trains, or a frozen reference of the same
    /// configuration): every row's log-probability of its target at `temperature` (0 for unscored rows) and, with
    /// `entropy`, each row's entropy. Its activations stay for a [`Self::backward`] (valid for `model` only).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for another configuration, a batch larger than [`Self::max_rows`] or a
    /// non-positive temperature; [`Error::Kernel`] when the device fails.
    pub fn forward(
        &mut self,
        model: &CudaLlama,
        batch: &TrainBatch,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        checked_forward(self.gpu.as_ref(), &self.cfg, &self.dims, &mut self.acts, model, batch, temperature, entropy)
    }

    /// Adds the gradient of the caller's loss to the accumulated gradients, given the loss's gradient with respect
    /// to each row's log-probability (`g_logp`) and entropy (`g_ent`), through the last [`Self::forward`], which must
    /// have run on `model`, the trained policy.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] without a forward before it or for gradients of another length;
    /// [`Error::Kernel`] when the device fails.
    pub fn backward(&mut self, model: &CudaLlama, g_logp: &[f32], g_ent: Option<&[f32]>) -> Result<()> {
        self.check_model(model)?;
        let w = model.w.bufs();
        pass::backward(self.gpu.as_ref(), &self.dims, &w, &mut self.acts, &self.grads, g_logp, g_ent)
    }

    /// Sets the accumulated gradients to zero (before a mini-batch's first backward).
    ///
    /// # Errors
    /// [`Error::Kernel`] when the device fails.
    pub fn zero_grad(&mut self) -> Result<()> {
        Ok(gpu::zero(self.gpu.as_ref(), self.grad.buf())?)
    }

    /// The arena `a` on the host, in [`Self::params`] order.
    ///
    /// # Errors
    /// [`Error::Kernel`] when the device fails.
    pub fn arena_to_host(&self, a: Arena) -> Result<Vec<f32>> {
        Ok(self.arena(a).to_host(self.gpu.as_ref())?)
    }

    /// Overwrites arena `a` with `values` (in [`Self::params`] order; e.g. gradients summed over ranks on the host).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for another length; [`Error::Kernel`] when the device fails.
    pub fn arena_from_host(&mut self, a: Arena, values: &[f32]) -> Result<()> {
        let buf = self.arena(a);
        if values.len() != buf.len() {
            return Err(Error::InvalidInput(format!("{} values for an arena of {}", values.len(), buf.len())));
        }
        Ok(buf.write(self.gpu.as_ref(), 0, values)?)
    }

    fn arena(&self, a: Arena) -> &DeviceBuf<f32> {
        match a {
            Arena::Master => &self.master,
            Arena::ExpAvg => &self.m,
            Arena::ExpAvgSq => &self.v,
            Arena::Grad => &self.grad,
        }
    }

    /// `values` (an arena's contents in [`Self::params`] order: [`Self::arena_to_host`]) as HF-named tensors
    /// (`model.layers.0.self_attn.q_proj.weight`...: the stacked q/k/v and gate/up split back into their
    /// projections), in arena order; each a flat row-major `Vec`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for `values` of another length.
    pub fn hf_named(&self, values: &[f32]) -> Result<Vec<(String, Vec<f32>)>> {
        let total = self.params.last().map_or(0, |p| p.range.end);
        if values.len() != total {
            return Err(Error::InvalidInput(format!("{} values for arenas of {total}", values.len())));
        }
        Ok(self.hf.iter().map(|(n, r)| (n.clone(), values[r.clone()].to_vec())).collect())
    }

    /// Writes HF-named tensors (every one of the model's, each flat row-major) into arena `a`: a resumed run's
    /// f32 weights ([`Arena::Master`], then [`Self::write_decoder`]) or optimizer moments.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an unknown or missing name or a tensor of the wrong size; [`Error::Kernel`] when
    /// the device fails.
    pub fn load_hf(&mut self, a: Arena, named: &[(String, Vec<f32>)]) -> Result<()> {
        for (name, r) in &self.hf {
            let v = &named
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| Error::InvalidInput(format!("no values for trained weight `{name}`")))?
                .1;
            if v.len() != r.len() {
                return Err(Error::InvalidInput(format!("`{name}`: {} values, {} expected", v.len(), r.len())));
            }
        }
        if let Some((n, _)) = named.iter().find(|(n, _)| !self.hf.iter().any(|(h, _)| h == n)) {
            return Err(Error::InvalidInput(format!("`{n}` is not a trained weight")));
        }
        for (name, v) in named {
            if let Some((_, r)) = self.hf.iter().find(|(h, _)| h == name) {
                self.arena(a).write(self.gpu.as_ref(), r.start, v)?;
            }
        }
        Ok(())
    }

    /// Sets the optimizer steps taken (bias correction) of a resumed run.
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Writes the master weights, rounded to bf16, into `model`'s buffers (after [`Self::load_hf`] of the master
    /// weights; [`Self::step`] does it itself).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for another model configuration; [`Error::Kernel`] when the device fails.
    pub fn write_decoder(&self, model: &mut CudaLlama) -> Result<()> {
        self.check_model(model)?;
        let w = model.w.bufs();
        for ((_, out), p) in weight_list(&w).iter().zip(&self.params) {
            self.gpu.launch(&plan::cast_bf16(self.master.buf().slice(p.range.clone())?, *out)?)?;
        }
        Ok(())
    }

    /// The global L2 norm of the accumulated gradients ([`grad_norm`]).
    ///
    /// # Errors
    /// [`Error::Kernel`] when the device fails.
    pub fn grad_norm(&self) -> Result<f64> {
        grad_norm(self.gpu.as_ref(), self.grad.buf(), &self.partials)
    }

    /// One AdamW step at learning rate `lr` from the accumulated gradients, clipped to a global norm of
    /// `max_grad_norm`, with the host optimizer's arithmetic ([`crate::optim::AdamW::step`]: f64, f32 moments); the
    /// new weights are written, rounded to bf16, into `model`'s own buffers. A non-finite norm skips the step and
    /// changes nothing ([`GradNorm::applied`]).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for another model configuration or a non-finite `lr`; [`Error::Kernel`] when the
    /// device fails.
    pub fn step(&mut self, model: &mut CudaLlama, lr: f64, max_grad_norm: Option<f64>) -> Result<GradNorm> {
        self.check_model(model)?;
        let g = self.gpu.as_ref();
        let (norm, step) =
            clipped_adamw_step(g, self.grad.buf(), &self.partials, &self.hp, self.steps, lr, max_grad_norm)?;
        let Some(s) = step else { return Ok(norm) };
        self.steps = s.step;
        let w = model.w.bufs();
        for ((_, out), p) in weight_list(&w).iter().zip(&self.params) {
            let r = p.range.clone();
            let arena = |b: &DeviceBuf<f32>| b.buf().slice(r.clone());
            g.launch(&plan::adamw(
                &s,
                arena(&self.master)?,
                arena(&self.m)?,
                arena(&self.v)?,
                arena(&self.grad)?,
                *out,
            )?)?;
        }
        Ok(norm)
    }
}
