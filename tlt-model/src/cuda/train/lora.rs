//! LoRA on the device ([`CudaLoraTrainer`]): low-rank adapters on every linear layer of a [`CudaLlama`] (q, k, v,
//! o, gate, up, down; PEFT's `target_modules="all-linear"` minus the LM head), `W' = W + (alpha / r) · B · A` with
//! `A [r, in]` and `B [out, r]`, trained with AdamW in f32 on the device while the base weights stay frozen in bf16.
//!
//! **Rollouts on the merged weights.** After every step the decoder's own bf16 buffers get `bf16(W + s · B · A)`
//! (a device-side merge from a frozen bf16 copy of the base), so decoding, CUDA graphs, batch invariance and the
//! training forward stay exactly those of the plain decoder: no adapter GEMMs in the decode path. The price is the
//! bf16 rounding of the merged weight, the same rounding the full fine-tuning path's decoder weights have (its f32
//! masters are rounded to bf16 likewise); PEFT's unmerged forward adds the delta in the activations instead. The
//! gradients are exact for the merged forward: `dB = s · dYᵀ · (X · Aᵀ)`, `dA = s · (dY · B)ᵀ · X` from each
//! linear's own input and output gradient in the backward ([`LinearLora::grads`]), with no full-size weight
//! gradient anywhere.
//!
//! Memory: the base copy (2 bytes per base weight) and, per adapter weight, f32 master, moments and gradient and a
//! bf16 copy (18 bytes), the merge's f32 scratch of the largest linear, and the training pass's buffers
//! ([`lora_memory`]).

use half::bf16;
use tlt_kernels::cuda::plan::{self, GemmY, SUM_SQUARES_BLOCKS};
use tlt_kernels::cuda::{gpu, DeviceBuf, SharedGpu};
use tlt_kernels::SplitMix64;

use super::adapter::{LayerLora, LinearLora, LoraSlot};
use super::batch::TrainBatch;
use super::common::{check_config, check_trainable, checked_forward, clipped_adamw_step, Arena};
use super::layer::LayerGrads;
use super::pass::{self, Acts, Dims, GradBufs, TrainOptions};
use crate::config::LlamaConfig;
use crate::cuda::CudaLlama;
use crate::device_step::LinearBufs;
use crate::optim::{AdamWParams, GradNorm};
use crate::{Error, Result};

/// LoRA's shape: rank and scale (`alpha / rank`, PEFT's `lora_alpha`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraConfig {
    /// The adapters' rank `r`.
    pub rank: usize,
    /// `lora_alpha`: the delta is scaled by `alpha / rank`.
    pub alpha: f64,
}

impl LoraConfig {
    /// The delta's scale `alpha / rank`.
    #[must_use]
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// # Errors
    /// [`Error::InvalidInput`] for rank 0 or a non-finite or non-positive alpha.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::InvalidInput("a LoRA rank of 0".into()));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(Error::InvalidInput(format!("lora_alpha {} must be finite and > 0", self.alpha)));
        }
        Ok(())
    }
}

/// An adapter tensor as PEFT names it: its name, `[rows, cols]` and values (row-major).
pub type PeftTensor = (String, [usize; 2], Vec<f32>);

/// One adapter tensor in the arenas: its PEFT name and elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraParam {
    /// PEFT's name, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
    pub name: String,
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    /// Its elements in the arenas.
    pub range: std::ops::Range<usize>,
}

/// One projection of a layer: which of the four stacked linears (0 q/k/v, 1 o, 2 gate/up, 3 down), its HF module,
/// its first output row in that linear, its output rows and its inputs.
struct Projection {
    linear: usize,
    module: &'static str,
    lo: usize,
    rows: usize,
    inp: usize,
}

fn projections(cfg: &LlamaConfig) -> [Projection; 7] {
    let (h, q, kv, i) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
    let p = |linear, module, lo, rows, inp| Projection { linear, module, lo, rows, inp };
    [
        p(0, "self_attn.q_proj", 0, q, h),
        p(0, "self_attn.k_proj", q, kv, h),
        p(0, "self_attn.v_proj", q + kv, kv, h),
        p(1, "self_attn.o_proj", 0, h, q),
        p(2, "mlp.gate_proj", 0, i, h),
        p(2, "mlp.up_proj", i, i, h),
        p(3, "mlp.down_proj", 0, h, i),
    ]
}

/// Every adapter tensor of a model of `cfg` at rank `r`, in arena order (per layer, per projection, `A` then `B`).
#[must_use]
pub fn lora_params(cfg: &LlamaConfig, r: usize) -> Vec<LoraParam> {
    let mut out = Vec::new();
    let mut at = 0;
    for l in 0..cfg.num_hidden_layers {
        for p in projections(cfg) {
            for (which, shape) in [("lora_A", [r, p.inp]), ("lora_B", [p.rows, r])] {
                let n = shape[0] * shape[1];
                let name = format!("base_model.model.model.layers.{l}.{}.{which}.weight", p.module);
                out.push(LoraParam { name, shape, range: at..at + n });
                at += n;
            }
        }
    }
    out
}

/// The four stacked linears of a layer's weights, in [`Projection::linear`] order.
fn linears(l: &crate::device_step::LayerBufs) -> [LinearBufs; 4] {
    [l.qkv, l.o, l.gate_up, l.down]
}

/// Elements of the largest linear of `cfg` (the merge's scratch).
fn largest_linear(cfg: &LlamaConfig) -> usize {
    let (h, q, kv, i) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
    [(q + 2 * kv) * h, h * q, 2 * i * h, h * i].into_iter().max().unwrap_or(0)
}

/// The device memory a [`CudaLoraTrainer`] of `cfg` holds with `lora` and `opts`, in bytes (every allocation it
/// makes): the frozen bf16 copy of every linear's base weight, f32 master, moments and gradient and a bf16 copy of
/// each adapter weight (18 bytes each), the merge's f32 scratch, the adapters' two `[rows, rank]` bf16 scratches,
/// the gradient norm's partial sums and the training pass's buffers.
#[must_use]
pub fn lora_memory(cfg: &LlamaConfig, lora: &LoraConfig, opts: &TrainOptions) -> usize {
    let adapters: usize = lora_params(cfg, lora.rank).iter().map(|p| p.range.len()).sum();
    let base: usize = projections(cfg).iter().map(|p| p.rows * p.inp).sum::<usize>() * cfg.num_hidden_layers;
    2 * base
        + 18 * adapters
        + 4 * largest_linear(cfg)
        + 2 * 2 * opts.max_rows * lora.rank
        + 8 * SUM_SQUARES_BLOCKS
        + Dims::new(cfg).bytes(opts)
}

/// LoRA on the device over a [`CudaLlama`]: adapters on every linear, AdamW over their f32 master weights, the base
/// frozen, the merged weights written into the decoder's own buffers after each step (module docs).
#[derive(Debug)]
pub struct CudaLoraTrainer {
    gpu: SharedGpu,
    cfg: LlamaConfig,
    dims: Dims,
    lora: LoraConfig,
    opts: TrainOptions,
    params: Vec<LoraParam>,
    master: DeviceBuf<f32>,
    m: DeviceBuf<f32>,
    v: DeviceBuf<f32>,
    grad: DeviceBuf<f32>,
    /// The adapters rounded to bf16 (what the GEMMs read), in arena order.
    copy: DeviceBuf<bf16>,
    /// Each layer's four linears' frozen base weights.
    base: Vec<[DeviceBuf<bf16>; 4]>,
    /// `B · A` of one linear (f32), the merge's scratch.
    delta: DeviceBuf<f32>,
    /// The adapters' `X · Aᵀ` and `dY · B` scratch ([`LinearLora::u`], [`LinearLora::v`] point into it).
    _scratch: [DeviceBuf<bf16>; 2],
    grads: GradBufs,
    partials: DeviceBuf<f64>,
    acts: Acts,
    hp: AdamWParams,
    steps: u64,
}

impl CudaLoraTrainer {
    /// Adapters of `lora` on every linear of `model` (`A` uniform in `±1/sqrt(in)` from `seed`, PEFT's Kaiming
    /// init, `B` zero: the model unchanged at first), the training pass's buffers as `opts` plans them; the base
    /// weights are copied (device to device) before anything changes them.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an architecture the training pass does not cover, invalid `lora`, `hp` or
    /// `opts`; [`Error::Kernel`] when the device fails (out of memory).
    pub fn new(model: &CudaLlama, lora: LoraConfig, hp: AdamWParams, opts: &TrainOptions, seed: u64) -> Result<Self> {
        lora.validate()?;
        hp.validate()?;
        opts.validate()?;
        check_trainable(model.config())?;
        let gpu = model.gpu().clone();
        let g = gpu.as_ref();
        let cfg = model.config().clone();
        let dims = Dims::new(&cfg);
        let w = model.w.bufs();
        let base = w
            .layers
            .iter()
            .map(|l| {
                let copy = |b: &LinearBufs| -> Result<DeviceBuf<bf16>> {
                    let d = DeviceBuf::<bf16>::zeros(g, b.w.len())?;
                    gpu::copy(g, b.w, d.buf())?;
                    Ok(d)
                };
                let [a, b, c, e] = linears(l);
                Ok([copy(&a)?, copy(&b)?, copy(&c)?, copy(&e)?])
            })
            .collect::<Result<Vec<_>>>()?;
        let params = lora_params(&cfg, lora.rank);
        let total = params.last().map_or(0, |p| p.range.end);
        let mut init = vec![0f32; total];
        let mut rng = SplitMix64::new(seed);
        for p in params.iter().filter(|p| p.name.ends_with("lora_A.weight")) {
            let bound = 1.0 / (p.shape[1] as f64).sqrt();
            for x in &mut init[p.range.clone()] {
                *x = (rng.next_f64() * 2.0 * bound - bound) as f32;
            }
        }
        let master = DeviceBuf::from_host(g, &init)?;
        let copy = DeviceBuf::<bf16>::zeros(g, total)?;
        g.launch(&plan::cast_bf16(master.buf(), copy.buf())?)?;
        let u = DeviceBuf::<bf16>::zeros(g, opts.max_rows * lora.rank)?;
        let v_scratch = DeviceBuf::<bf16>::zeros(g, opts.max_rows * lora.rank)?;
        let grad = DeviceBuf::<f32>::zeros(g, total)?;
        let layers = layer_loras(&cfg, &params, lora.rank, &copy, &grad, &u, &v_scratch)?;
        let grads = GradBufs {
            embed: None,
            head: None,
            norm: None,
            layers: layers
                .into_iter()
                .map(|l| LayerGrads {
                    in_norm: None,
                    post_norm: None,
                    qkv: None,
                    qkv_b: None,
                    o: None,
                    gate_up: None,
                    down: None,
                    lora: Some(l),
                })
                .collect(),
        };
        Ok(Self {
            m: DeviceBuf::zeros(g, total)?,
            v: DeviceBuf::zeros(g, total)?,
            delta: DeviceBuf::zeros(g, largest_linear(&cfg))?,
            partials: DeviceBuf::zeros(g, SUM_SQUARES_BLOCKS)?,
            acts: Acts::new(g, &dims, opts)?,
            grad,
            master,
            copy,
            base,
            _scratch: [u, v_scratch],
            grads,
            params,
            gpu,
            cfg,
            dims,
            lora,
            opts: *opts,
            hp,
            steps: 0,
        })
    }

    /// The adapter tensors, in arena order.
    #[must_use]
    pub fn params(&self) -> &[LoraParam] {
        &self.params
    }

    /// LoRA's rank and alpha.
    #[must_use]
    pub fn lora(&self) -> &LoraConfig {
        &self.lora
    }

    /// How the training pass's buffers were planned.
    #[must_use]
    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }

    /// Optimizer steps taken.
    #[must_use]
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Sets the optimizer steps taken (bias correction) of a resumed run.
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    fn check_model(&self, model: &CudaLlama) -> Result<()> {
        check_config(&self.cfg, model)
    }

    /// The forward of `batch` through `model` (its merged weights), as [`super::CudaTrainer::forward`].
    ///
    /// # Errors
    /// As [`super::CudaTrainer::forward`].
    pub fn forward(
        &mut self,
        model: &CudaLlama,
        batch: &TrainBatch,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        checked_forward(self.gpu.as_ref(), &self.cfg, &self.dims, &mut self.acts, model, batch, temperature, entropy)
    }

    /// Adds the adapters' gradients of the caller's loss (as [`super::CudaTrainer::backward`]; the base, norms,
    /// embedding and head get none).
    ///
    /// # Errors
    /// As [`super::CudaTrainer::backward`].
    pub fn backward(&mut self, model: &CudaLlama, g_logp: &[f32], g_ent: Option<&[f32]>) -> Result<()> {
        self.check_model(model)?;
        let w = model.w.bufs();
        pass::backward(self.gpu.as_ref(), &self.dims, &w, &mut self.acts, &self.grads, g_logp, g_ent)
    }

    /// Sets the accumulated gradients to zero.
    ///
    /// # Errors
    /// [`Error::Kernel`] when the device fails.
    pub fn zero_grad(&mut self) -> Result<()> {
        Ok(gpu::zero(self.gpu.as_ref(), self.grad.buf())?)
    }

    /// One AdamW step of the adapters at learning rate `lr` (their gradients scaled by `alpha / rank`, then clipped
    /// to a global norm of `max_grad_norm`), then the merged weights written into `model`'s buffers. A non-finite
    /// norm skips the step and changes nothing.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for another model configuration; as [`super::clipped_adamw_step`].
    pub fn step(&mut self, model: &mut CudaLlama, lr: f64, max_grad_norm: Option<f64>) -> Result<GradNorm> {
        self.check_model(model)?;
        let g = self.gpu.as_ref();
        g.launch(&plan::scale_f32(self.grad.buf(), self.lora.scale() as f32)?)?;
        let (norm, step) =
            clipped_adamw_step(g, self.grad.buf(), &self.partials, &self.hp, self.steps, lr, max_grad_norm)?;
        let Some(s) = step else { return Ok(norm) };
        self.steps = s.step;
        let (w, m, v, gr) = (self.master.buf(), self.m.buf(), self.v.buf(), self.grad.buf());
        g.launch(&plan::adamw(&s, w, m, v, gr, self.copy.buf())?)?;
        self.merge(model)?;
        Ok(norm)
    }

    /// Writes `bf16(W + s · B · A)` into every linear of `model` from the frozen base and the adapters' bf16 copies
    /// ([`Self::step`] does it; after [`Self::load_peft`] the caller does).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for another model configuration; [`Error::Kernel`] when the device fails.
    pub fn merge(&self, model: &mut CudaLlama) -> Result<()> {
        self.check_model(model)?;
        let g = self.gpu.as_ref();
        let w = model.w.bufs();
        let r = self.lora.rank;
        let per_layer = 2 * projections(&self.cfg).len();
        for (l, lw) in w.layers.iter().enumerate() {
            let outs = linears(lw);
            for (k, out) in outs.iter().enumerate() {
                let n = out.out * out.inp;
                let delta = self.delta.buf().slice(0..n)?;
                for (j, p) in projections(&self.cfg).iter().enumerate().filter(|(_, p)| p.linear == k) {
                    let (a, b) = (&self.params[l * per_layer + 2 * j], &self.params[l * per_layer + 2 * j + 1]);
                    let rows = delta.slice(p.lo * p.inp..(p.lo + p.rows) * p.inp)?;
                    let (a16, b16) = (self.copy.buf().slice(a.range.clone())?, self.copy.buf().slice(b.range.clone())?);
                    g.gemm(&plan::gemm_dx(p.rows, r, p.inp, b16, a16, GemmY::F32(rows))?)?;
                }
                let s = self.lora.scale() as f32;
                g.launch(&plan::lora_merge(self.base[l][k].buf(), delta, s, out.w)?)?;
            }
        }
        Ok(())
    }

    /// The arena `a` on the host, in [`Self::params`] order.
    ///
    /// # Errors
    /// [`Error::Kernel`] when the device fails.
    pub fn arena_to_host(&self, a: Arena) -> Result<Vec<f32>> {
        Ok(self.arena(a).to_host(self.gpu.as_ref())?)
    }

    fn arena(&self, a: Arena) -> &DeviceBuf<f32> {
        match a {
            Arena::Master => &self.master,
            Arena::ExpAvg => &self.m,
            Arena::ExpAvgSq => &self.v,
            Arena::Grad => &self.grad,
        }
    }

    /// `values` (an arena in [`Self::params`] order) as PEFT-named tensors with their shapes, in arena order.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for `values` of another length.
    pub fn peft_named(&self, values: &[f32]) -> Result<Vec<PeftTensor>> {
        let total = self.params.last().map_or(0, |p| p.range.end);
        if values.len() != total {
            return Err(Error::InvalidInput(format!("{} values for arenas of {total}", values.len())));
        }
        Ok(self.params.iter().map(|p| (p.name.clone(), p.shape, values[p.range.clone()].to_vec())).collect())
    }

    /// Writes PEFT-named tensors (every adapter's, each flat row-major) into arena `a` (a resumed run's master
    /// weights, then [`Self::merge`], or its moments). The bf16 copies follow the master weights.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an unknown or missing name or a tensor of the wrong size; [`Error::Kernel`] when
    /// the device fails.
    pub fn load_peft(&mut self, a: Arena, named: &[(String, Vec<f32>)]) -> Result<()> {
        for p in &self.params {
            let v = &named
                .iter()
                .find(|(n, _)| *n == p.name)
                .ok_or_else(|| Error::InvalidInput(format!("no values for adapter `{}`", p.name)))?
                .1;
            if v.len() != p.range.len() {
                return Err(Error::InvalidInput(format!(
                    "`{}`: {} values, {} expected",
                    p.name,
                    v.len(),
                    p.range.len()
                )));
            }
        }
        if let Some((n, _)) = named.iter().find(|(n, _)| !self.params.iter().any(|p| p.name == *n)) {
            return Err(Error::InvalidInput(format!("`{n}` is not an adapter of this model")));
        }
        let g = self.gpu.as_ref();
        for p in &self.params {
            if let Some((_, v)) = named.iter().find(|(n, _)| *n == p.name) {
                self.arena(a).write(g, p.range.start, v)?;
            }
        }
        if a == Arena::Master {
            g.launch(&plan::cast_bf16(self.master.buf(), self.copy.buf())?)?;
        }
        Ok(())
    }
}

/// Each layer's adapters over the arenas: the bf16 copies the GEMMs read and the gradients.
fn layer_loras(
    cfg: &LlamaConfig,
    params: &[LoraParam],
    rank: usize,
    copy: &DeviceBuf<bf16>,
    grad: &DeviceBuf<f32>,
    u: &DeviceBuf<bf16>,
    v: &DeviceBuf<bf16>,
) -> Result<Vec<LayerLora>> {
    let per_layer = 2 * projections(cfg).len();
    let empty = LinearLora { rank, slots: [None; 3], u: u.buf(), v: v.buf() };
    (0..cfg.num_hidden_layers)
        .map(|l| {
            let mut lin = [empty; 4];
            for (j, p) in projections(cfg).iter().enumerate() {
                let (a, b) = (&params[l * per_layer + 2 * j], &params[l * per_layer + 2 * j + 1]);
                let slot = LoraSlot {
                    lo: p.lo,
                    rows: p.rows,
                    a: copy.buf().slice(a.range.clone())?,
                    b: copy.buf().slice(b.range.clone())?,
                    da: grad.buf().slice(a.range.clone())?,
                    db: grad.buf().slice(b.range.clone())?,
                };
                let free = lin[p.linear].slots.iter().position(Option::is_none).unwrap_or(2);
                lin[p.linear].slots[free] = Some(slot);
            }
            let [qkv, o, gate_up, down] = lin;
            Ok(LayerLora { qkv, o, gate_up, down })
        })
        .collect()
}
