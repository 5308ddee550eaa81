//! The same Llama/Qwen2/Qwen3 decoder on a CUDA device: bf16 weights and KV cache on the device, cuBLAS for the
//! linear layers, `tlt_kernels::cuda` for everything else (Qwen3's q/k head norms included), one forward for prefill
//! chunks, batched decode and draft-tree verification. Written on the device seam ([`Gpu`]): it runs on a CUDA device
//! (`tlt_kernels::cuda::CudaGpu`, feature `cuda`; matched the CPU decoder on an H200, 2026-11-27) and, in CI, on the
//! simulated device (`tlt-cuda-sim`'s `SimGpu`), through this very code.
//!
//! The model definition is shared with the CPU path ([`LlamaConfig`], [`Llama`]'s weights, RoPE frequencies): a
//! [`CudaLlama`] is made from a loaded [`Llama`], so every format the CPU path reads (HF safetensors, GGUF) runs here.
//! The layer loop mirrors [`Llama::forward`]'s op for op; the residual stream is kept in f32.

mod step;
pub mod train;

use half::bf16;
use tlt_cudagraph::{BucketPolicy, FallbackReason, ShapeCache, ShapeEntry, ShapePlan, ShapeStats};
use tlt_kernels::cuda::packing::Packing;
use tlt_kernels::cuda::plan::{self, Buf, Chunks, SeqBufs};
use tlt_kernels::cuda::{gpu, CacheDims, DeviceBuf, DeviceLinear, Gpu, GpuGraph, SharedGpu, Staged};
use tlt_kernels::AttnShape;

use self::step::{GpuOps, StepBuffers};
use crate::config::LlamaConfig;
pub use crate::device_step::DeviceSeq;
use crate::device_step::{layout, tree_rows_bucket, LayerBufs, LinearBufs, StepLayout, StepProgram, WeightBufs};
use crate::model::{Llama, Tap};
use crate::weights::{ProjectionShape, Projections};
use crate::{Error, Result};

/// One decoder layer on the device, with the projections that read the same input stacked into one GEMM each.
#[derive(Debug)]
struct DevLayer {
    in_norm: DeviceBuf<bf16>,
    post_norm: DeviceBuf<bf16>,
    /// q, k and v stacked `[q_dim + 2 kv_dim, hidden]` (biases stacked likewise).
    qkv: DeviceLinear,
    o: DeviceLinear,
    /// gate and up stacked `[2 intermediate, hidden]`.
    gate_up: DeviceLinear,
    down: DeviceLinear,
    /// Qwen3: the q and k head norms (`[head_dim]` each).
    qk_norm: Option<(DeviceBuf<bf16>, DeviceBuf<bf16>)>,
}

/// The seven projections of a block of `cfg`, in [`Projections`] field order (the CPU model's shapes).
fn proj_shapes(cfg: &LlamaConfig) -> Result<[ProjectionShape; 7]> {
    let (h, i, q, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim());
    Ok(Projections::shapes(h, q, kv, i, h, cfg.attention_bias()?))
}

/// Which weight a constructor asks its source for.
#[derive(Debug, Clone, Copy)]
enum Weight {
    Embed,
    Head,
    Norm,
    InNorm(usize),
    PostNorm(usize),
    /// Qwen3's query head norm of a layer.
    QNorm(usize),
    /// Qwen3's key head norm of a layer.
    KNorm(usize),
    /// Layer, projection (q, k, v, o, gate, up, down), bias?
    Proj(usize, usize, bool),
}

/// The weights on the device.
#[derive(Debug)]
pub(crate) struct DevWeights {
    embed: DeviceBuf<bf16>,
    head: Option<DeviceBuf<bf16>>,
    norm: DeviceBuf<bf16>,
    layers: Vec<DevLayer>,
    inv_freq: DeviceBuf<f64>,
}

impl DevWeights {
    /// The weights as a step program sees them.
    fn bufs(&self) -> WeightBufs {
        let lin =
            |l: &DeviceLinear| LinearBufs { w: l.w.buf(), b: l.b.as_ref().map(DeviceBuf::buf), out: l.out, inp: l.inp };
        WeightBufs {
            embed: self.embed.buf(),
            head: self.head.as_ref().map(DeviceBuf::buf),
            norm: self.norm.buf(),
            layers: self
                .layers
                .iter()
                .map(|l| LayerBufs {
                    in_norm: l.in_norm.buf(),
                    post_norm: l.post_norm.buf(),
                    qkv: lin(&l.qkv),
                    o: lin(&l.o),
                    gate_up: lin(&l.gate_up),
                    down: lin(&l.down),
                    qk_norm: l.qk_norm.as_ref().map(|(q, k)| (q.buf(), k.buf())),
                })
                .collect(),
            inv_freq: self.inv_freq.buf(),
        }
    }
}

/// `parts` one after the other in a new buffer of `total` elements (their lengths' sum).
fn concat(g: &dyn Gpu, parts: &[&DeviceBuf<bf16>], total: usize) -> Result<DeviceBuf<bf16>> {
    if parts.iter().map(|p| p.len()).sum::<usize>() != total {
        return Err(Error::InvalidInput(format!("stacked weights of {total} elements from parts of other sizes")));
    }
    let out = DeviceBuf::zeros(g, total)?;
    let mut at = 0;
    for part in parts {
        gpu::copy(g, part.buf(), out.buf().slice(at..at + part.len())?)?;
        at += part.len();
    }
    Ok(out)
}

/// Where projection `p` (q, k, v, o, gate, up, down) of a block of `shapes` lives: its stacked linear (0: qkv, 1: o,
/// 2: gate/up, 3: down) and its rows' range in it.
fn stacked(shapes: &[ProjectionShape; 7], p: usize) -> (usize, std::ops::Range<usize>) {
    let (group, first) = match p {
        0..=2 => (0, 0),
        3 => (1, 3),
        4 | 5 => (2, 4),
        _ => (3, 6),
    };
    let start: usize = shapes[first..p].iter().map(|s| s.out).sum();
    (group, start..start + shapes[p].out)
}

/// `model`'s weight `which` as bf16 on the host (`None`: absent, e.g. a tied head or a bias the architecture does
/// not have).
fn llama_weight(model: &Llama, which: Weight) -> Result<Option<Vec<bf16>>> {
    let w = model.weights();
    let t = match which {
        Weight::Embed => &w.embed_tokens,
        Weight::Head => match &w.lm_head {
            Some(h) => h,
            None => return Ok(None),
        },
        Weight::Norm => &w.norm,
        Weight::InNorm(l) => &w.layers[l].input_layernorm,
        Weight::PostNorm(l) => &w.layers[l].post_attention_layernorm,
        Weight::QNorm(l) | Weight::KNorm(l) => match &w.layers[l].qk_norm {
            Some(n) if matches!(which, Weight::QNorm(_)) => &n.q_norm,
            Some(n) => &n.k_norm,
            None => return Ok(None),
        },
        Weight::Proj(l, p, bias) => {
            let lin = w.layers[l].proj.all()[p];
            match (bias, &lin.bias) {
                (false, _) => &lin.weight,
                (true, Some(b)) => b,
                (true, None) => return Ok(None),
            }
        }
    };
    Ok(Some(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(bf16::from_f32).collect()))
}

impl DevWeights {
    /// The device buffer holding weight `which` and the element range it occupies there, if this model has it.
    fn slot(&self, which: Weight, shapes: &[ProjectionShape; 7]) -> Option<(&DeviceBuf<bf16>, std::ops::Range<usize>)> {
        fn whole(b: &DeviceBuf<bf16>) -> (&DeviceBuf<bf16>, std::ops::Range<usize>) {
            (b, 0..b.len())
        }
        match which {
            Weight::Embed => Some(whole(&self.embed)),
            Weight::Head => self.head.as_ref().map(whole),
            Weight::Norm => Some(whole(&self.norm)),
            Weight::InNorm(l) => Some(whole(&self.layers.get(l)?.in_norm)),
            Weight::PostNorm(l) => Some(whole(&self.layers.get(l)?.post_norm)),
            Weight::QNorm(l) => self.layers.get(l)?.qk_norm.as_ref().map(|n| whole(&n.0)),
            Weight::KNorm(l) => self.layers.get(l)?.qk_norm.as_ref().map(|n| whole(&n.1)),
            Weight::Proj(l, p, bias) => {
                let layer = self.layers.get(l)?;
                let (group, rows) = stacked(shapes, p);
                let lin = [&layer.qkv, &layer.o, &layer.gate_up, &layer.down].into_iter().nth(group)?;
                if bias {
                    lin.b.as_ref().map(|b| (b, rows))
                } else {
                    Some((&lin.w, rows.start * lin.inp..rows.end * lin.inp))
                }
            }
        }
    }
}

/// How a forward ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepMode {
    /// Launch by launch.
    Eager,
    /// Launched eagerly, then captured into a CUDA graph for its shape.
    Captured,
    /// A captured graph replayed.
    Replayed,
}

/// What a forward produced: its logits live in the model's buffers of its [`StepShape`] until the next forward
/// ([`CudaLlama::logits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOutput {
    /// Sequences (after padding to a graph bucket: rows of padded sequences are garbage).
    pub batch: usize,
    /// Rows per sequence (a tree's padded to a power of two): node `j` of sequence `b` is row `b * n_max + j`.
    pub n_max: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// How it ran.
    pub mode: StepMode,
    /// Whether the shape was a tree (its buffers are keyed by that too).
    tree: bool,
}

/// The shape a forward's buffers (and graph) are kept for: sequences (padded to a graph bucket under graphs), rows
/// per sequence (a tree's padded to [`crate::device_step::tree_rows_bucket`]), and whether it is a tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StepShape {
    /// Sequences.
    pub batch: usize,
    /// Rows per sequence.
    pub n_max: usize,
    /// Tree (ancestor masks) or causal.
    pub tree: bool,
}

/// A Llama-family decoder resident on one CUDA device, with a KV cache of `slots` sequences of `max_len` positions.
///
/// Decode steps (one token per sequence) and tree verifications keep their buffers per shape ([`StepShape`]), so
/// with [`CudaLlama::enable_graphs`] each such shape is captured once into a CUDA graph (batches padded to the bucket
/// ladder) and replayed after. Buffers and graphs live under one memory budget ([`ShapeCache`]: least recently used
/// shapes evicted, buffers and graph together); a shape whose capture fails or that cannot fit runs eagerly, with
/// the reason kept ([`CudaLlama::eager_shapes`]). Prefill chunks always run eagerly, on one spare set of buffers.
#[derive(Debug)]
pub struct CudaLlama {
    // Fields drop in declaration order: the graphs first, then the buffers they read and write, then the device.
    /// Per-shape buffers and graphs.
    shapes: ShapeCache<StepShape, StepBuffers, GpuGraph>,
    /// The batch sizes graphs are captured for (`None`: graphs off).
    graph_batches: Option<BucketPolicy>,
    /// The packed metadata of commits (one copy from pinned memory).
    commit_staging: Staged,
    k_cache: DeviceBuf<bf16>,
    v_cache: DeviceBuf<bf16>,
    w: DevWeights,
    gpu: SharedGpu,
    cfg: LlamaConfig,
    cache: CacheDims,
    /// The hidden features a forward keeps (default: the final norm).
    taps: Vec<Tap>,
    /// Blocks of split attention resident on the device at once (`GpuInfo::target_blocks`), which sizes its chunks.
    target_blocks: usize,
    /// The batch-invariance tests' negative control ([`CudaLlama::split_gemms_by_rows`]).
    split_by_rows: bool,
}

impl CudaLlama {
    /// Uploads `model`'s weights to `gpu` as bf16 and allocates a KV cache of `slots` sequences of `max_len`
    /// positions.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for heads the device attention does not handle or a zero-sized cache;
    /// [`Error::Kernel`] when the device fails.
    pub fn new(model: &Llama, gpu: SharedGpu, slots: usize, max_len: usize) -> Result<Self> {
        Self::build(model.config().clone(), gpu, slots, max_len, |g, which| {
            llama_weight(model, which)?.map(|v| Ok(DeviceBuf::from_host(g, &v)?)).transpose()
        })
    }

    /// Copies `model`'s weights (same configuration) into this model's device buffers, in place: captured CUDA
    /// graphs stay valid, and the KV cache is kept (the caller decides whether its entries are still meaningful).
    /// What a trainer does after each policy update.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a model of another configuration or a weight this model lacks (or has and
    /// `model` lacks); [`Error::Kernel`] when a copy fails.
    pub fn update_weights(&mut self, model: &Llama) -> Result<()> {
        if !model.config().same_architecture(&self.cfg) {
            return Err(Error::InvalidInput("update_weights needs a model of the same architecture".into()));
        }
        let mut which = vec![Weight::Embed, Weight::Head, Weight::Norm];
        for l in 0..self.cfg.num_hidden_layers {
            which.extend([Weight::InNorm(l), Weight::PostNorm(l), Weight::QNorm(l), Weight::KNorm(l)]);
            which.extend((0..7).flat_map(|p| [Weight::Proj(l, p, false), Weight::Proj(l, p, true)]));
        }
        let shapes = proj_shapes(&self.cfg)?;
        for w in which {
            let host = llama_weight(model, w)?;
            match (self.w.slot(w, &shapes), host) {
                (Some((dst, range)), Some(v)) if range.len() == v.len() => {
                    dst.write(self.gpu.as_ref(), range.start, &v)?;
                }
                (None, None) => {}
                (dst, v) => {
                    return Err(Error::InvalidInput(format!(
                        "weight {w:?}: {} on the device, {} given",
                        dst.map_or(0, |d| d.1.len()),
                        v.map_or(0, |v| v.len())
                    )))
                }
            }
        }
        Ok(())
    }

    /// A model of `cfg`'s shapes with seeded uniform weights generated on the device (nothing uploaded): for speed
    /// measurements of architectures whose weights cannot be shipped (norms 1, matrices in `±1/sqrt(fan_in)`,
    /// embeddings in `±0.05`). Biases exist where the architecture has them.
    ///
    /// # Errors
    /// As [`CudaLlama::new`], and [`Error::InvalidConfig`] for an invalid `cfg`.
    pub fn synthetic(cfg: LlamaConfig, seed: u64, gpu: SharedGpu, slots: usize, max_len: usize) -> Result<Self> {
        cfg.validate()?;
        let shapes = proj_shapes(&cfg)?;
        let (h, v, hd) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim());
        let (tied, qk_norm) = (cfg.tie_word_embeddings, cfg.qk_norm());
        Self::build(cfg, gpu, slots, max_len, |g, which| {
            // (elements, fan-in scale; 0 = constant 1).
            let (len, scale) = match which {
                Weight::Embed => (v * h, 0.05),
                Weight::Head if tied => return Ok(None),
                Weight::Head => (v * h, 1.0 / (h as f32).sqrt()),
                Weight::Norm | Weight::InNorm(_) | Weight::PostNorm(_) => (h, 0.0),
                Weight::QNorm(_) | Weight::KNorm(_) if qk_norm => (hd, 0.0),
                Weight::QNorm(_) | Weight::KNorm(_) => return Ok(None),
                Weight::Proj(_, p, bias) => {
                    let sh = shapes[p];
                    match bias {
                        false => (sh.out * sh.inp, 1.0 / (sh.inp as f32).sqrt()),
                        true if sh.bias => (sh.out, 0.02),
                        true => return Ok(None),
                    }
                }
            };
            let buf = DeviceBuf::<bf16>::zeros(g, len)?;
            let salt = match which {
                Weight::Embed => 1,
                Weight::Head => 2,
                Weight::Norm => 3,
                Weight::InNorm(l) => 16 + l as u64 * 64,
                Weight::PostNorm(l) => 17 + l as u64 * 64,
                Weight::QNorm(l) => 48 + l as u64 * 64,
                Weight::KNorm(l) => 49 + l as u64 * 64,
                Weight::Proj(l, p, bias) => 18 + l as u64 * 64 + p as u64 * 2 + u64::from(bias),
            };
            let (lo, hi) = if scale == 0.0 { (1.0, 1.0) } else { (-scale, scale) };
            let seed = seed.wrapping_mul(0x9e37_79b9).wrapping_add(salt << 20);
            g.launch(&plan::fill_uniform(buf.buf(), seed, lo, hi)?)?;
            Ok(Some(buf))
        })
    }

    /// The common construction: `source` yields every weight on the device (`None`: absent, e.g. a tied head or a
    /// bias the architecture does not have).
    fn build(
        cfg: LlamaConfig,
        gpu: SharedGpu,
        slots: usize,
        max_len: usize,
        mut source: impl FnMut(&dyn Gpu, Weight) -> Result<Option<DeviceBuf<bf16>>>,
    ) -> Result<Self> {
        let attn = AttnShape::new(cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let cache = CacheDims { layers: cfg.num_hidden_layers, slots, max_len, attn };
        cache.check()?;
        let target_blocks = gpu.info().target_blocks();
        let g = gpu.as_ref();
        let mut get = |w: Weight| source(g, w);
        let need = |w: Weight, got: Option<DeviceBuf<bf16>>| {
            got.ok_or_else(|| Error::InvalidInput(format!("weight {w:?} is missing")))
        };
        let shapes = proj_shapes(&cfg)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let mut w = Vec::with_capacity(7);
            let mut b = Vec::with_capacity(7);
            for p in 0..7 {
                w.push(need(Weight::Proj(l, p, false), get(Weight::Proj(l, p, false))?)?);
                b.push(get(Weight::Proj(l, p, true))?);
            }
            // Stacks projections `ps` (rows of one weight matrix after the other) into one linear.
            let stack = |ps: std::ops::Range<usize>| -> Result<DeviceLinear> {
                let (out, inp) = (ps.clone().map(|p| shapes[p].out).sum::<usize>(), shapes[ps.start].inp);
                let parts: Vec<&DeviceBuf<bf16>> = ps.clone().map(|p| &w[p]).collect();
                let w_all = concat(g, &parts, out * inp)?;
                let biases: Option<Vec<&DeviceBuf<bf16>>> = ps.clone().map(|p| b[p].as_ref()).collect();
                let any_bias = ps.clone().any(|p| b[p].is_some());
                let b_all = match biases {
                    Some(bs) => Some(concat(g, &bs, out)?),
                    None if any_bias => {
                        return Err(Error::InvalidInput(format!(
                            "layer {l}: projections {ps:?} have biases on some only"
                        )))
                    }
                    None => None,
                };
                Ok(DeviceLinear { w: w_all, b: b_all, out, inp })
            };
            let (qkv, o, gate_up, down) = (stack(0..3)?, stack(3..4)?, stack(4..6)?, stack(6..7)?);
            let qk_norm = match (get(Weight::QNorm(l))?, get(Weight::KNorm(l))?) {
                (Some(qn), Some(kn)) if cfg.qk_norm() => Some((qn, kn)),
                (None, None) if !cfg.qk_norm() => None,
                _ => {
                    return Err(Error::InvalidInput(format!(
                        "layer {l}: q/k head norms must be present exactly for a qk-norm architecture ({})",
                        cfg.model_type
                    )))
                }
            };
            layers.push(DevLayer {
                in_norm: need(Weight::InNorm(l), get(Weight::InNorm(l))?)?,
                post_norm: need(Weight::PostNorm(l), get(Weight::PostNorm(l))?)?,
                qkv,
                o,
                gate_up,
                down,
                qk_norm,
            });
        }
        let embed = need(Weight::Embed, get(Weight::Embed)?)?;
        let norm = need(Weight::Norm, get(Weight::Norm)?)?;
        let head = get(Weight::Head)?;
        let inv_freq = DeviceBuf::from_host(g, &cfg.rope_inv_freq())?;
        let k_cache = DeviceBuf::zeros(g, cache.len())?;
        let v_cache = DeviceBuf::zeros(g, cache.len())?;
        let w = DevWeights { embed, head, norm, layers, inv_freq };
        let commit_staging = Staged::new(&gpu, 4096)?;
        // Step buffers may take half of what is left after weights and cache (graphs on: the budget given).
        let (free, _) = gpu.memory()?;
        Ok(Self {
            shapes: ShapeCache::new(free as u64 / 2),
            graph_batches: None,
            commit_staging,
            k_cache,
            v_cache,
            w,
            gpu,
            cfg,
            cache,
            taps: vec![Tap::FinalNorm],
            target_blocks,
            split_by_rows: false,
        })
    }

    /// Bytes of weights one forward streams (every linear, the LM head, the norms), for bandwidth figures.
    pub fn weight_bytes(&self) -> usize {
        let lin = DeviceLinear::elements;
        let w = &self.w;
        let layers: usize = w
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.o, &l.gate_up, &l.down].into_iter().map(lin).sum::<usize>()
                    + 2 * l.in_norm.len()
                    + l.qk_norm.as_ref().map_or(0, |(q, k)| q.len() + k.len())
            })
            .sum();
        2 * (layers + w.head.as_ref().unwrap_or(&w.embed).len() + w.norm.len())
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The device every operation of this model runs on (its one stream).
    pub fn gpu(&self) -> &SharedGpu {
        &self.gpu
    }

    /// The KV cache's shape.
    pub fn cache_dims(&self) -> CacheDims {
        self.cache
    }

    /// Turns on CUDA graphs for decode and verify shapes: batches up to `max_batch` pad to SGLang's bucket ladder,
    /// and the shapes' buffers and graphs live under `budget` bytes together (least recently used evicted; a graph
    /// over static buffers holds little memory of its own, so each shape counts its buffers). Drops the shapes
    /// kept so far.
    pub fn enable_graphs(&mut self, max_batch: usize, budget: u64) {
        self.graph_batches = Some(BucketPolicy::ladder(max_batch.max(1)));
        self.shapes = ShapeCache::new(budget);
    }

    /// Which hidden features forwards keep for [`CudaLlama::hidden_to_host`], in this order (default
    /// `[Tap::FinalNorm]`; `Tap::eagle3` for EAGLE-3 drafters). Drops the per-shape buffers and captured graphs,
    /// which are rebuilt with the taps on the next forward of each shape.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for no taps or a layer past the last.
    pub fn set_taps(&mut self, taps: &[Tap]) -> Result<()> {
        let layers = self.cfg.num_hidden_layers;
        if taps.is_empty() || taps.iter().any(|t| matches!(t, Tap::LayerInput(l) if *l > layers)) {
            return Err(Error::InvalidInput(format!("taps {taps:?} for a model of {layers} layers")));
        }
        self.taps = taps.to_vec();
        self.shapes.clear();
        Ok(())
    }

    /// The hidden features forwards keep.
    pub fn taps(&self) -> &[Tap] {
        &self.taps
    }

    /// Layers of the `LayerInput` taps, in tap order.
    fn layer_taps(&self) -> Vec<usize> {
        self.taps.iter().filter_map(|t| if let Tap::LayerInput(l) = t { Some(*l) } else { None }).collect()
    }

    /// The hidden features of every row of `out` on the host: `[batch * n_max, taps.len() * hidden_size]`, the taps
    /// side by side in [`CudaLlama::taps`] order (the CPU's `TappedLlama` layout).
    ///
    /// # Errors
    /// As [`CudaLlama::logits`], and [`Error::Kernel`] when a copy fails.
    pub fn hidden_to_host(&self, out: &StepOutput) -> Result<Vec<f32>> {
        let b = self.buffers(out)?;
        let h = self.cfg.hidden_size;
        let rows = out.batch * out.n_max;
        let mut parts = Vec::with_capacity(self.taps.len());
        let mut layer = 0;
        for t in &self.taps {
            parts.push(match t {
                Tap::FinalNorm => b.xn.to_host(self.gpu.as_ref())?.iter().map(|x| x.to_f32()).collect(),
                Tap::LayerInput(_) => {
                    let v = b.taps[layer].to_host(self.gpu.as_ref())?;
                    layer += 1;
                    v
                }
            });
        }
        let width = h * parts.len();
        let mut rows_out = vec![0f32; rows * width];
        for (j, p) in parts.iter().enumerate() {
            for r in 0..rows {
                rows_out[r * width + j * h..r * width + (j + 1) * h].copy_from_slice(&p[r * h..(r + 1) * h]);
            }
        }
        Ok(rows_out)
    }

    /// The shape cache's counters, when graphs are on.
    pub fn graph_stats(&self) -> Option<&ShapeStats> {
        self.graph_batches.as_ref().map(|_| self.shapes.stats())
    }

    /// Shapes that run eagerly for a reason (their capture failed, or they cannot fit the budget), with the reason.
    pub fn eager_shapes(&self) -> Vec<(StepShape, FallbackReason)> {
        self.shapes.eager_shapes().map(|(k, r)| (*k, r.clone())).collect()
    }

    /// Runs one step: writes each sequence's new tokens' K/V into its slot at `prefix_len..` (tree nodes stay there
    /// until [`CudaLlama::commit`] moves the accepted ones) and computes the logits of every new token
    /// ([`CudaLlama::logits`]).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad batch (see [`DeviceSeq`]), [`Error::Kernel`] when a launch or a graph
    /// launch fails (a failed capture is not an error: the shape runs eagerly from then on).
    pub fn forward(&mut self, seqs: &[DeviceSeq<'_>]) -> Result<StepOutput> {
        let mut l = layout(seqs, self.cfg.vocab_size, self.cache.slots, self.cache.max_len)?;
        let tree = l.anc.is_some();
        if tree {
            l = l.padded_to(tree_rows_bucket(l.n_max))?;
        }
        let n_max = l.n_max;
        let reusable = tree || n_max == 1;
        let graph_batch = self.graph_batches.as_ref().filter(|_| reusable).and_then(|p| p.pad(seqs.len()));
        let batch = graph_batch.unwrap_or(seqs.len());
        let shape = StepShape { batch, n_max, tree };
        let (gpu, cfg, taps) = (&self.gpu, &self.cfg, self.layer_taps().len());
        let chunks = Chunks::for_cache(self.cache.attn, self.cache.max_len, self.target_blocks);
        let (mut entry, plan) = self.shapes.checkout(shape, graph_batch.is_some(), || {
            let b = StepBuffers::new(gpu, cfg, batch, n_max, tree, taps, chunks)?;
            let bytes = b.bytes();
            Ok::<_, Error>((b, bytes))
        })?;
        let ran = self.run(shape, &mut entry, &l, &plan);
        let bytes = entry.bufs.bytes();
        self.shapes.checkin(shape, entry, bytes, reusable);
        Ok(StepOutput { batch, n_max, vocab: self.cfg.vocab_size, mode: ran?, tree })
    }

    fn run(
        &mut self,
        shape: StepShape,
        entry: &mut ShapeEntry<StepBuffers, GpuGraph>,
        l: &StepLayout,
        plan: &ShapePlan,
    ) -> Result<StepMode> {
        entry.bufs.write(l)?;
        if let (ShapePlan::Replay, Some(graph)) = (plan, entry.graph.as_ref()) {
            self.gpu.replay(graph)?;
            return Ok(StepMode::Replayed);
        }
        let layer_taps = self.layer_taps();
        let weights = self.w.bufs();
        let program = StepProgram {
            cfg: &self.cfg,
            cache: self.cache,
            k_cache: self.k_cache.buf(),
            v_cache: self.v_cache.buf(),
            w: &weights,
            layer_taps: &layer_taps,
            target_blocks: self.target_blocks,
            split_by_rows: self.split_by_rows,
        };
        let step = entry.bufs.bufs()?;
        program.record(&mut GpuOps(self.gpu.as_ref()), &step)?;
        if *plan != ShapePlan::Capture {
            return Ok(StepMode::Eager);
        }
        // The eager run above produced this step's results (and warmed cuBLAS up); capture the same launches. A
        // failed capture leaves the stream usable (the capture is always ended) and the shape eager from now on.
        let captured = tlt_cudagraph::gpu::capture(&self.gpu, &format!("{shape:?}"), || {
            program.record(&mut GpuOps(self.gpu.as_ref()), &step).map_err(Into::into)
        });
        Ok(match captured {
            Ok(c) => {
                entry.graph = Some(c.graph);
                StepMode::Captured
            }
            Err(e) => {
                let message = e.to_string();
                tracing::warn!(?shape, %message, "CUDA graph capture failed; the shape runs eagerly");
                self.shapes.capture_failed(shape, message);
                StepMode::Eager
            }
        })
    }

    fn buffers(&self, out: &StepOutput) -> Result<&StepBuffers> {
        let shape = StepShape { batch: out.batch, n_max: out.n_max, tree: out.tree };
        self.shapes.get(&shape).ok_or_else(|| Error::InvalidInput(format!("no buffers of shape {shape:?}")))
    }

    /// The logits of `out` (`[batch * n_max, vocab]` f32), valid until the next forward (which may evict its shape).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the shape's buffers are gone (evicted, or never run).
    pub fn logits(&self, out: &StepOutput) -> Result<Buf<f32>> {
        self.buffers(out).map(|b| b.logits.buf())
    }

    /// The final-norm hidden states of `out` (`[batch * n_max, hidden_size]` bf16, the LM head's input), valid until
    /// the next forward.
    ///
    /// # Errors
    /// As [`CudaLlama::logits`].
    pub fn hidden(&self, out: &StepOutput) -> Result<Buf<bf16>> {
        self.buffers(out).map(|b| b.xn.buf())
    }

    /// The negative control of the batch-invariance tests, never for production: the decode and verify GEMMs'
    /// K split chosen from the row count ([`StepProgram::split_by_rows`]), so that a row's logits depend on the rows
    /// beside it. Shapes already run keep what they ran (captured graphs replay it).
    pub fn split_gemms_by_rows(&mut self, on: bool) {
        self.split_by_rows = on;
    }

    /// Copies the first `len` committed positions of slot `src` to slot `dst` in every layer (a prompt prefilled once
    /// and shared by a group's samples).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for slots out of range, equal slots or `len > max_len`; [`Error::Kernel`] when a copy
    /// fails.
    pub fn fork_slot(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        let c = self.cache;
        if src >= c.slots || dst >= c.slots || src == dst || len > c.max_len {
            return Err(Error::InvalidInput(format!(
                "fork of {len} positions from slot {src} to {dst} (cache of {} slots x {})",
                c.slots, c.max_len
            )));
        }
        let (span, n) = (c.max_len * c.row(), len * c.row());
        for layer in 0..c.layers {
            let (a, b) = (layer * c.layer_len() + src * span, layer * c.layer_len() + dst * span);
            for cache in [&self.k_cache, &self.v_cache] {
                gpu::copy(self.gpu.as_ref(), cache.buf().slice(a..a + n)?, cache.buf().slice(b..b + n)?)?;
            }
        }
        Ok(())
    }

    /// Copies the logits of `out` to the host (`[batch * n_max, vocab]`).
    ///
    /// # Errors
    /// As [`CudaLlama::logits`], and [`Error::Kernel`] when the copy fails.
    pub fn logits_to_host(&self, out: &StepOutput) -> Result<Vec<f32>> {
        Ok(gpu::read(self.gpu.as_ref(), self.logits(out)?)?)
    }

    /// Moves each sequence's accepted tree nodes (`paths[b]`: node indices from the root, increasing) to the
    /// positions after its prefix, in every layer. The caller then counts `paths[b].len()` more committed positions.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a path that does not start at the root, does not increase, or runs past the
    /// cache; [`Error::Kernel`] when the launch fails.
    pub fn commit(&mut self, seqs: &[(usize, usize)], paths: &[Vec<i32>]) -> Result<()> {
        if seqs.len() != paths.len() || seqs.is_empty() {
            return Err(Error::InvalidInput(format!("{} sequences with {} paths", seqs.len(), paths.len())));
        }
        let max_path = paths.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut flat = vec![0i32; seqs.len() * max_path];
        for (b, (p, &(slot, prefix))) in paths.iter().zip(seqs).enumerate() {
            let increasing = p.windows(2).all(|w| w[0] < w[1]);
            if p.first() != Some(&0) || !increasing || slot >= self.cache.slots {
                return Err(Error::InvalidInput(format!("sequence {b}: path {p:?} (slot {slot}) is not a root path")));
            }
            let last = p.last().map_or(0, |&x| x as usize);
            if prefix + last >= self.cache.max_len {
                return Err(Error::InvalidInput(format!("sequence {b}: path {p:?} runs past the cache")));
            }
            flat[b * max_path..b * max_path + p.len()].copy_from_slice(p);
        }
        let slot: Vec<i32> = seqs.iter().map(|&(s, _)| s as i32).collect();
        let prefix: Vec<i32> = seqs.iter().map(|&(_, p)| p as i32).collect();
        let n_acc: Vec<i32> = paths.iter().map(|p| p.len() as i32).collect();
        // One packed buffer, one copy from the pinned staging buffer.
        let batch = seqs.len();
        let pack = Packing::new(&[batch * 4, batch * 4, batch * 4, flat.len() * 4]);
        let base = self.commit_staging.send(pack.bytes(), |host| {
            pack.put(host, 0, &slot, 0)?;
            pack.put(host, 1, &prefix, 0)?;
            pack.put(host, 2, &n_acc, 0)?;
            pack.put(host, 3, &flat, 0)
        })?;
        let seq = SeqBufs { slot: pack.buf(base, 0)?, prefix_len: pack.buf(base, 1)?, n_nodes: pack.buf(base, 2)? };
        let (k, v) = (self.k_cache.buf(), self.v_cache.buf());
        let launch = plan::commit_path(self.cache, batch, max_path, k, v, seq, pack.buf(base, 3)?, seq.n_nodes)?;
        self.gpu.launch(&launch)?;
        Ok(())
    }
}
