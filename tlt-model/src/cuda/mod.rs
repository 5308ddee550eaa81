//! The same Llama/Qwen2/Qwen3 decoder on a CUDA device (feature `cuda`): bf16 weights and KV cache on the GPU,
//! cuBLAS for the linear layers, `tlt_kernels::cuda` for everything else (Qwen3's q/k head norms included), one
//! forward for prefill chunks, batched decode and draft-tree verification. **Compiled and CPU-tested for its
//! host-side checks; not yet run on a GPU.**
//!
//! The model definition is shared with the CPU path ([`LlamaConfig`], [`Llama`]'s weights, RoPE frequencies): a
//! [`CudaLlama`] is made from a loaded [`Llama`], so every format the CPU path reads (HF safetensors, GGUF) runs here.
//! The layer loop mirrors [`Llama::forward`]'s op for op; the residual stream is kept in f32.

mod step;

use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph, CudaSlice, CudaStream};
use half::bf16;
use tlt_cudagraph::{BucketPolicy, FallbackReason, ShapeCache, ShapeEntry, ShapePlan, ShapeStats};
use tlt_kernels::cuda::packing::Packing;
use tlt_kernels::cuda::plan::{self, Chunks, SeqBufs};
use tlt_kernels::cuda::{buf_of, Blas, CacheDims, CudaKernels, DeviceLinear, Staged, TreeDims};
use tlt_kernels::AttnShape;

use self::step::{CudaOps, StepBuffers};
use crate::config::LlamaConfig;
pub use crate::device_step::DeviceSeq;
use crate::device_step::{layout, tree_rows_bucket, LayerBufs, LinearBufs, StepLayout, StepProgram, WeightBufs};
use crate::model::{Llama, Tap};
use crate::weights::{ProjectionShape, Projections};
use crate::{Error, Result};

pub(crate) fn cuda_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Kernel(tlt_kernels::Error::Cuda { op, message: e.to_string() })
}

/// One decoder layer on the device, with the projections that read the same input stacked into one GEMM each.
#[derive(Debug)]
struct DevLayer {
    in_norm: CudaSlice<bf16>,
    post_norm: CudaSlice<bf16>,
    /// q, k and v stacked `[q_dim + 2 kv_dim, hidden]` (biases stacked likewise).
    qkv: DeviceLinear,
    o: DeviceLinear,
    /// gate and up stacked `[2 intermediate, hidden]`.
    gate_up: DeviceLinear,
    down: DeviceLinear,
    /// Qwen3: the q and k head norms (`[head_dim]` each).
    qk_norm: Option<(CudaSlice<bf16>, CudaSlice<bf16>)>,
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
    embed: CudaSlice<bf16>,
    head: Option<CudaSlice<bf16>>,
    norm: CudaSlice<bf16>,
    layers: Vec<DevLayer>,
    inv_freq: CudaSlice<f64>,
}

impl DevWeights {
    /// The weights as a step program sees them.
    fn bufs(&self, s: &CudaStream) -> WeightBufs {
        let lin = |l: &DeviceLinear| LinearBufs {
            w: buf_of(&l.w, s),
            b: l.b.as_ref().map(|b| buf_of(b, s)),
            out: l.out,
            inp: l.inp,
        };
        WeightBufs {
            embed: buf_of(&self.embed, s),
            head: self.head.as_ref().map(|h| buf_of(h, s)),
            norm: buf_of(&self.norm, s),
            layers: self
                .layers
                .iter()
                .map(|l| LayerBufs {
                    in_norm: buf_of(&l.in_norm, s),
                    post_norm: buf_of(&l.post_norm, s),
                    qkv: lin(&l.qkv),
                    o: lin(&l.o),
                    gate_up: lin(&l.gate_up),
                    down: lin(&l.down),
                    qk_norm: l.qk_norm.as_ref().map(|(q, k)| (buf_of(q, s), buf_of(k, s))),
                })
                .collect(),
            inv_freq: buf_of(&self.inv_freq, s),
        }
    }
}

/// `parts` one after the other in a new buffer of `total` elements (their lengths' sum).
fn concat(stream: &Arc<CudaStream>, parts: &[&CudaSlice<bf16>], total: usize) -> Result<CudaSlice<bf16>> {
    if parts.iter().map(|p| p.len()).sum::<usize>() != total {
        return Err(Error::InvalidInput(format!("stacked weights of {total} elements from parts of other sizes")));
    }
    let mut out = stream.alloc_zeros::<bf16>(total).map_err(cuda_err("alloc"))?;
    let mut at = 0;
    for part in parts {
        stream.memcpy_dtod(*part, &mut out.slice_mut(at..at + part.len())).map_err(cuda_err("stack weights"))?;
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
    fn slot_mut(
        &mut self,
        which: Weight,
        shapes: &[ProjectionShape; 7],
    ) -> Option<(&mut CudaSlice<bf16>, std::ops::Range<usize>)> {
        fn whole(b: &mut CudaSlice<bf16>) -> (&mut CudaSlice<bf16>, std::ops::Range<usize>) {
            let n = b.len();
            (b, 0..n)
        }
        match which {
            Weight::Embed => Some(whole(&mut self.embed)),
            Weight::Head => self.head.as_mut().map(whole),
            Weight::Norm => Some(whole(&mut self.norm)),
            Weight::InNorm(l) => Some(whole(&mut self.layers.get_mut(l)?.in_norm)),
            Weight::PostNorm(l) => Some(whole(&mut self.layers.get_mut(l)?.post_norm)),
            Weight::QNorm(l) => self.layers.get_mut(l)?.qk_norm.as_mut().map(|n| whole(&mut n.0)),
            Weight::KNorm(l) => self.layers.get_mut(l)?.qk_norm.as_mut().map(|n| whole(&mut n.1)),
            Weight::Proj(l, p, bias) => {
                let layer = self.layers.get_mut(l)?;
                let (group, rows) = stacked(shapes, p);
                let lin = [&mut layer.qkv, &mut layer.o, &mut layer.gate_up, &mut layer.down].into_iter().nth(group)?;
                if bias {
                    lin.b.as_mut().map(|b| (b, rows))
                } else {
                    let inp = lin.inp;
                    Some((&mut lin.w, rows.start * inp..rows.end * inp))
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
    // Fields drop in declaration order: the graphs first, then the buffers they read and write, then the cuBLAS
    // handle and the kernels' modules they launch.
    /// Per-shape buffers and graphs.
    shapes: ShapeCache<StepShape, StepBuffers, CudaGraph>,
    /// The batch sizes graphs are captured for (`None`: graphs off).
    graph_batches: Option<BucketPolicy>,
    /// The packed metadata of commits (one copy from pinned memory).
    commit_staging: Staged,
    k_cache: CudaSlice<bf16>,
    v_cache: CudaSlice<bf16>,
    w: DevWeights,
    blas: Blas,
    kernels: CudaKernels,
    stream: Arc<CudaStream>,
    cfg: LlamaConfig,
    cache: CacheDims,
    /// The hidden features a forward keeps (default: the final norm).
    taps: Vec<Tap>,
    /// Blocks split attention aims for: twice the device's multiprocessors.
    target_blocks: usize,
}

impl CudaLlama {
    /// Uploads `model`'s weights to device `ordinal` as bf16 and allocates a KV cache of `slots` sequences of
    /// `max_len` positions.
    ///
    /// # Errors
    /// [`tlt_kernels::Error::CudaUnavailable`] (as [`Error::Kernel`]) without a driver or NVRTC, never a panic;
    /// [`Error::InvalidInput`] for heads the device attention does not handle or a zero-sized cache.
    pub fn new(model: &Llama, ordinal: usize, slots: usize, max_len: usize) -> Result<Self> {
        Self::build(model.config().clone(), ordinal, slots, max_len, |stream, _, which| {
            llama_weight(model, which)?.map(|v| stream.clone_htod(&v).map_err(cuda_err("upload"))).transpose()
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
        if model.config() != &self.cfg {
            return Err(Error::InvalidInput("update_weights needs a model of the same configuration".into()));
        }
        let mut which = vec![Weight::Embed, Weight::Head, Weight::Norm];
        for l in 0..self.cfg.num_hidden_layers {
            which.extend([Weight::InNorm(l), Weight::PostNorm(l), Weight::QNorm(l), Weight::KNorm(l)]);
            which.extend((0..7).flat_map(|p| [Weight::Proj(l, p, false), Weight::Proj(l, p, true)]));
        }
        let shapes = proj_shapes(&self.cfg)?;
        for w in which {
            let host = llama_weight(model, w)?;
            match (self.w.slot_mut(w, &shapes), host) {
                (Some((dst, range)), Some(v)) if range.len() == v.len() => {
                    self.stream.memcpy_htod(&v, &mut dst.slice_mut(range)).map_err(cuda_err("upload"))?;
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
    pub fn synthetic(cfg: LlamaConfig, seed: u64, ordinal: usize, slots: usize, max_len: usize) -> Result<Self> {
        cfg.validate()?;
        let shapes = proj_shapes(&cfg)?;
        let (h, v, hd) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim());
        let (tied, qk_norm) = (cfg.tie_word_embeddings, cfg.qk_norm());
        Self::build(cfg, ordinal, slots, max_len, |stream, kernels, which| {
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
            let mut buf = stream.alloc_zeros::<bf16>(len).map_err(cuda_err("alloc"))?;
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
            kernels.fill_uniform(stream, &mut buf, seed.wrapping_mul(0x9e37_79b9).wrapping_add(salt << 20), lo, hi)?;
            Ok(Some(buf))
        })
    }

    /// The common construction: `source` yields every weight on the device (`None`: absent, e.g. a tied head or a
    /// bias the architecture does not have).
    fn build(
        cfg: LlamaConfig,
        ordinal: usize,
        slots: usize,
        max_len: usize,
        mut source: impl FnMut(&Arc<CudaStream>, &CudaKernels, Weight) -> Result<Option<CudaSlice<bf16>>>,
    ) -> Result<Self> {
        let attn = AttnShape::new(cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let cache = CacheDims { layers: cfg.num_hidden_layers, slots, max_len, attn };
        cache.check()?;
        let kernels = CudaKernels::new(ordinal)?;
        // SAFETY: every buffer of this model is used on its one stream only, so stream order alone keeps it
        // correct, and graph capture cannot tolerate cudarc's cross-stream events.
        unsafe { kernels.context().disable_event_tracking() };
        // Not the legacy default stream, which cannot be captured.
        let stream = kernels.context().new_stream().map_err(cuda_err("new_stream"))?;
        let sms = kernels
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("multiprocessor count"))?;
        let target_blocks = 2 * usize::try_from(sms).unwrap_or(1).max(1);
        let blas = Blas::new(&stream)?;
        let mut get = |w: Weight| source(&stream, &kernels, w);
        let need = |w: Weight, got: Option<CudaSlice<bf16>>| {
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
                let parts: Vec<&CudaSlice<bf16>> = ps.clone().map(|p| &w[p]).collect();
                let w_all = concat(&stream, &parts, out * inp)?;
                let biases: Option<Vec<&CudaSlice<bf16>>> = ps.clone().map(|p| b[p].as_ref()).collect();
                let any_bias = ps.clone().any(|p| b[p].is_some());
                let b_all = match biases {
                    Some(bs) => Some(concat(&stream, &bs, out)?),
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
        let inv_freq = stream.clone_htod(&cfg.rope_inv_freq()).map_err(cuda_err("upload"))?;
        let k_cache = stream.alloc_zeros::<bf16>(cache.len()).map_err(cuda_err("alloc k cache"))?;
        let v_cache = stream.alloc_zeros::<bf16>(cache.len()).map_err(cuda_err("alloc v cache"))?;
        let w = DevWeights { embed, head, norm, layers, inv_freq };
        let commit_staging = Staged::new(&stream, 4096)?;
        // Step buffers may take half of what is left after weights and cache (graphs on: the budget given).
        let (free, _) = cudarc::driver::result::mem_get_info().map_err(cuda_err("memory info"))?;
        Ok(Self {
            shapes: ShapeCache::new(free as u64 / 2),
            graph_batches: None,
            commit_staging,
            k_cache,
            v_cache,
            w,
            blas,
            kernels,
            stream,
            cfg,
            cache,
            taps: vec![Tap::FinalNorm],
            target_blocks,
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

    /// The kernels (for sampling and acceptance on the same device).
    pub fn kernels(&self) -> &CudaKernels {
        &self.kernels
    }

    /// The stream every operation of this model runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
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
                Tap::FinalNorm => {
                    self.stream.clone_dtoh(&b.xn).map_err(cuda_err("download"))?.iter().map(|x| x.to_f32()).collect()
                }
                Tap::LayerInput(_) => {
                    let v = self.stream.clone_dtoh(&b.taps[layer]).map_err(cuda_err("download"))?;
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
        let (stream, cfg, taps) = (&self.stream, &self.cfg, self.layer_taps().len());
        let chunks = Chunks::for_shape(
            TreeDims { batch, n_max },
            self.cache.attn.n_kv_heads,
            self.cache.max_len,
            self.target_blocks,
        );
        let (mut entry, plan) = self.shapes.checkout(shape, graph_batch.is_some(), || {
            let b = StepBuffers::new(stream, cfg, batch, n_max, tree, taps, chunks)?;
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
        entry: &mut ShapeEntry<StepBuffers, CudaGraph>,
        l: &StepLayout,
        plan: &ShapePlan,
    ) -> Result<StepMode> {
        entry.bufs.write(&self.stream, l)?;
        if let (ShapePlan::Replay, Some(graph)) = (plan, entry.graph.as_ref()) {
            graph.launch().map_err(cuda_err("graph launch"))?;
            return Ok(StepMode::Replayed);
        }
        let layer_taps = self.layer_taps();
        let s = &self.stream;
        let weights = self.w.bufs(s);
        let program = StepProgram {
            cfg: &self.cfg,
            cache: self.cache,
            k_cache: buf_of(&self.k_cache, s),
            v_cache: buf_of(&self.v_cache, s),
            w: &weights,
            layer_taps: &layer_taps,
            target_blocks: self.target_blocks,
        };
        let step = entry.bufs.bufs(s)?;
        let mut ops = CudaOps { kernels: &self.kernels, blas: self.blas.cublas(), stream: s };
        program.record(&mut ops, &step)?;
        if *plan != ShapePlan::Capture {
            return Ok(StepMode::Eager);
        }
        // The eager run above produced this step's results (and warmed cuBLAS up); capture the same launches. A
        // failed capture leaves the stream usable (the capture is always ended) and the shape eager from now on.
        let captured = (|| -> std::result::Result<CudaGraph, String> {
            s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| format!("begin_capture: {e}"))?;
            let recorded = program.record(&mut ops, &step);
            let ended = s.end_capture(sys::CUgraphInstantiate_flags(0));
            recorded.map_err(|e| format!("recording: {e}"))?;
            let graph = ended.map_err(|e| format!("end_capture: {e}"))?.ok_or("the capture recorded nothing")?;
            graph.upload().map_err(|e| format!("graph upload: {e}"))?;
            Ok(graph)
        })();
        Ok(match captured {
            Ok(graph) => {
                entry.graph = Some(graph);
                StepMode::Captured
            }
            Err(message) => {
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
    pub fn logits(&self, out: &StepOutput) -> Result<&CudaSlice<f32>> {
        self.buffers(out).map(|b| &b.logits)
    }

    /// The final-norm hidden states of `out` (`[batch * n_max, hidden_size]` bf16, the LM head's input), valid until
    /// the next forward.
    ///
    /// # Errors
    /// As [`CudaLlama::logits`].
    pub fn hidden(&self, out: &StepOutput) -> Result<&CudaSlice<bf16>> {
        self.buffers(out).map(|b| &b.xn)
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
            for cache in [&mut self.k_cache, &mut self.v_cache] {
                // The two ranges are disjoint: split the buffer between them.
                let (mut lo, mut hi) = cache.split_at_mut(a.max(b));
                let (from, mut to) = if a < b {
                    (lo.slice(a..a + n), hi.slice_mut(0..n))
                } else {
                    (hi.slice(0..n), lo.slice_mut(b..b + n))
                };
                self.stream.memcpy_dtod(&from, &mut to).map_err(cuda_err("fork copy"))?;
            }
        }
        Ok(())
    }

    /// Copies the logits of `out` to the host (`[batch * n_max, vocab]`).
    ///
    /// # Errors
    /// As [`CudaLlama::logits`], and [`Error::Kernel`] when the copy fails.
    pub fn logits_to_host(&self, out: &StepOutput) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(self.logits(out)?).map_err(cuda_err("download"))
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
        let base = self.commit_staging.send(&self.stream, pack.bytes(), |host| {
            pack.put(host, 0, &slot, 0)?;
            pack.put(host, 1, &prefix, 0)?;
            pack.put(host, 2, &n_acc, 0)?;
            pack.put(host, 3, &flat, 0)
        })?;
        let seq = SeqBufs { slot: pack.buf(base, 0)?, prefix_len: pack.buf(base, 1)?, n_nodes: pack.buf(base, 2)? };
        let s = &self.stream;
        let (k, v) = (buf_of(&self.k_cache, s), buf_of(&self.v_cache, s));
        let launch = plan::commit_path(self.cache, batch, max_path, k, v, seq, pack.buf(base, 3)?, seq.n_nodes)?;
        self.kernels.run(s, &launch)?;
        Ok(())
    }
}
