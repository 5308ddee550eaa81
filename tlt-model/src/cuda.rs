//! The same Llama/Qwen2 decoder on a CUDA device (feature `cuda`): bf16 weights and KV cache on the GPU, cuBLAS for
//! the linear layers, `tlt_kernels::cuda` for everything else, one forward for prefill chunks, batched decode and
//! draft-tree verification. **Compiled and CPU-tested for its host-side checks; not yet run on a GPU.**
//!
//! The model definition is shared with the CPU path ([`LlamaConfig`], [`Llama`]'s weights, RoPE frequencies): a
//! [`CudaLlama`] is made from a loaded [`Llama`], so every format the CPU path reads (HF safetensors, GGUF) runs here.
//! The layer loop mirrors [`Llama::forward`]'s op for op; the residual stream is kept in f32.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use tlt_kernels::cuda::{ancestor_masks, gemm_bf16, CacheDims, CudaKernels, RowMeta, SeqMeta, TreeDims};
use tlt_kernels::AttnShape;

use crate::config::LlamaConfig;
use crate::model::Llama;
use crate::{Error, Result};

fn cuda_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Kernel(tlt_kernels::Error::Cuda { op, message: e.to_string() })
}

/// A linear layer on the device: `w` `[out, inp]` bf16, optional bias.
#[derive(Debug)]
struct DevLinear {
    w: CudaSlice<bf16>,
    b: Option<CudaSlice<bf16>>,
    out: usize,
    inp: usize,
}

#[derive(Debug)]
struct DevLayer {
    in_norm: CudaSlice<bf16>,
    post_norm: CudaSlice<bf16>,
    q: DevLinear,
    k: DevLinear,
    v: DevLinear,
    o: DevLinear,
    gate: DevLinear,
    up: DevLinear,
    down: DevLinear,
}

/// Which weight a constructor asks its source for.
#[derive(Debug, Clone, Copy)]
enum Weight {
    Embed,
    Head,
    Norm,
    InNorm(usize),
    PostNorm(usize),
    /// Layer, projection (q, k, v, o, gate, up, down), bias?
    Proj(usize, usize, bool),
}

/// One sequence's new tokens in a device forward.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSeq<'a> {
    /// Its cache slot (`< slots`).
    pub slot: usize,
    /// Its committed positions; the new tokens' K/V go to `prefix_len..prefix_len + tokens.len()`.
    pub prefix_len: usize,
    /// The new tokens.
    pub tokens: &'a [u32],
    /// `None`: a causal append (prefill chunk, decode). `Some(parents)`: a draft tree whose node 0 is the root
    /// (`parents[0] < 0`) and whose other nodes' parents precede them (at most 64 nodes). Node `i` sits at position
    /// `prefix_len + depth(i)`.
    pub parents: Option<&'a [i32]>,
}

/// The logits of a device forward: `[batch * n_max, vocab]` f32 on the device; node `j` of sequence `b` is row
/// `b * n_max + j` (rows past a sequence's tokens are padding).
#[derive(Debug)]
pub struct DeviceLogits {
    /// The logits.
    pub logits: CudaSlice<f32>,
    /// Sequences.
    pub batch: usize,
    /// Rows per sequence.
    pub n_max: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

/// A Llama-family decoder resident on one CUDA device, with a KV cache of `slots` sequences of `max_len` positions.
#[derive(Debug)]
pub struct CudaLlama {
    cfg: LlamaConfig,
    kernels: CudaKernels,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    embed: CudaSlice<bf16>,
    head: Option<CudaSlice<bf16>>,
    norm: CudaSlice<bf16>,
    layers: Vec<DevLayer>,
    inv_freq: CudaSlice<f64>,
    cache: CacheDims,
    k_cache: CudaSlice<bf16>,
    v_cache: CudaSlice<bf16>,
}

/// The host-side layout of one forward: padded tokens and the device metadata, validated.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct StepLayout {
    pub(crate) n_max: usize,
    pub(crate) tokens: Vec<i32>,
    pub(crate) row_slot: Vec<i32>,
    pub(crate) row_pos: Vec<i32>,
    pub(crate) row_dst: Vec<i32>,
    pub(crate) seq_slot: Vec<i32>,
    pub(crate) seq_prefix: Vec<i32>,
    pub(crate) seq_nodes: Vec<i32>,
    /// Ancestor masks `[batch * n_max]` when any sequence is a tree (causal ones get chain masks).
    pub(crate) anc: Option<Vec<u64>>,
}

/// Lays out and checks a batch: slots in range and distinct, tokens in the vocabulary, positions within `max_len`.
pub(crate) fn layout(seqs: &[DeviceSeq<'_>], vocab: usize, slots: usize, max_len: usize) -> Result<StepLayout> {
    let bad = |m: String| Err(Error::InvalidInput(m));
    if seqs.is_empty() {
        return bad("a device forward needs at least one sequence".into());
    }
    let n_max = seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    let any_tree = seqs.iter().any(|s| s.parents.is_some());
    let rows = seqs.len() * n_max;
    let mut l = StepLayout {
        n_max,
        tokens: vec![0; rows],
        row_slot: vec![-1; rows],
        row_pos: vec![0; rows],
        row_dst: vec![0; rows],
        seq_slot: Vec::with_capacity(seqs.len()),
        seq_prefix: Vec::with_capacity(seqs.len()),
        seq_nodes: Vec::with_capacity(seqs.len()),
        anc: any_tree.then(|| vec![0u64; rows]),
    };
    for (b, s) in seqs.iter().enumerate() {
        let n = s.tokens.len();
        if n == 0 {
            return bad(format!("sequence {b} has no tokens"));
        }
        if s.slot >= slots || seqs[..b].iter().any(|o| o.slot == s.slot) {
            return bad(format!("sequence {b}: slot {} is out of range ({slots}) or used twice", s.slot));
        }
        if s.prefix_len + n > max_len {
            return bad(format!("sequence {b}: {} + {n} positions exceed the cache's {max_len}", s.prefix_len));
        }
        if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("sequence {b}: token id {t} >= vocab size {vocab}"));
        }
        let depth: Vec<usize> = match s.parents {
            None => (0..n).collect(),
            Some(p) => {
                if p.len() != n {
                    return bad(format!("sequence {b}: {} parents for {n} tokens", p.len()));
                }
                let masks = ancestor_masks(p)?;
                if let Some(anc) = l.anc.as_mut() {
                    anc[b * n_max..b * n_max + n].copy_from_slice(&masks);
                }
                masks.iter().map(|m| m.count_ones() as usize - 1).collect()
            }
        };
        if s.parents.is_none() {
            if let Some(anc) = l.anc.as_mut() {
                if n > tlt_kernels::cuda::MAX_TREE_NODES {
                    return bad(format!("sequence {b}: a causal chunk of {n} tokens cannot share a batch with trees"));
                }
                for j in 0..n {
                    anc[b * n_max + j] = if j == 63 { u64::MAX } else { (1u64 << (j + 1)) - 1 };
                }
            }
        }
        for (j, (&tok, &d)) in s.tokens.iter().zip(&depth).enumerate() {
            let r = b * n_max + j;
            l.tokens[r] = tok as i32;
            l.row_slot[r] = s.slot as i32;
            l.row_pos[r] = (s.prefix_len + d) as i32;
            l.row_dst[r] = (s.prefix_len + j) as i32;
        }
        l.seq_slot.push(s.slot as i32);
        l.seq_prefix.push(s.prefix_len as i32);
        l.seq_nodes.push(n as i32);
    }
    Ok(l)
}

impl CudaLlama {
    /// Uploads `model`'s weights to device `ordinal` as bf16 and allocates a KV cache of `slots` sequences of
    /// `max_len` positions.
    ///
    /// # Errors
    /// [`tlt_kernels::Error::CudaUnavailable`] (as [`Error::Kernel`]) without a driver or NVRTC, never a panic;
    /// [`Error::InvalidInput`] for heads the device attention does not handle or a zero-sized cache.
    pub fn new(model: &Llama, ordinal: usize, slots: usize, max_len: usize) -> Result<Self> {
        let w = model.weights();
        Self::build(model.config().clone(), ordinal, slots, max_len, |stream, _, which| {
            let t = match which {
                Weight::Embed => &w.embed_tokens,
                Weight::Head => match &w.lm_head {
                    Some(h) => h,
                    None => return Ok(None),
                },
                Weight::Norm => &w.norm,
                Weight::InNorm(l) => &w.layers[l].input_layernorm,
                Weight::PostNorm(l) => &w.layers[l].post_attention_layernorm,
                Weight::Proj(l, p, bias) => {
                    let lin = w.layers[l].proj.all()[p];
                    match (bias, &lin.bias) {
                        (false, _) => &lin.weight,
                        (true, Some(b)) => b,
                        (true, None) => return Ok(None),
                    }
                }
            };
            let v: Vec<bf16> = t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(bf16::from_f32).collect();
            Ok(Some(stream.clone_htod(&v).map_err(cuda_err("upload"))?))
        })
    }

    /// A model of `cfg`'s shapes with seeded uniform weights generated on the device (nothing uploaded): for speed
    /// measurements of architectures whose weights cannot be shipped (norms 1, matrices in `±1/sqrt(fan_in)`,
    /// embeddings in `±0.05`). Biases exist where the architecture has them.
    ///
    /// # Errors
    /// As [`CudaLlama::new`], and [`Error::InvalidConfig`] for an invalid `cfg`.
    pub fn synthetic(cfg: LlamaConfig, seed: u64, ordinal: usize, slots: usize, max_len: usize) -> Result<Self> {
        cfg.validate()?;
        let qkv_bias = cfg.architecture()?.qkv_bias();
        let (h, i, q, kv, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim(), cfg.vocab_size);
        let tied = cfg.tie_word_embeddings;
        Self::build(cfg, ordinal, slots, max_len, |stream, kernels, which| {
            // (elements, fan-in scale; 0 = constant 1); projections in Projections::all order.
            let (len, scale) = match which {
                Weight::Embed => (v * h, 0.05),
                Weight::Head if tied => return Ok(None),
                Weight::Head => (v * h, 1.0 / (h as f32).sqrt()),
                Weight::Norm | Weight::InNorm(_) | Weight::PostNorm(_) => (h, 0.0),
                Weight::Proj(_, p, bias) => {
                    let (out, inp) = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)][p];
                    match bias {
                        false => (out * inp, 1.0 / (inp as f32).sqrt()),
                        true if qkv_bias && p < 3 => (out, 0.02),
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
        let stream = kernels.context().default_stream();
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| Error::Kernel(tlt_kernels::Error::Cuda { op: "cublasCreate", message: format!("{e:?}") }))?;
        let mut get = |w: Weight| source(&stream, &kernels, w);
        let need = |w: Weight, got: Option<CudaSlice<bf16>>| {
            got.ok_or_else(|| Error::InvalidInput(format!("weight {w:?} is missing")))
        };
        let (h, i, q, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim());
        let shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)];
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let mut lin = Vec::with_capacity(7);
            for (p, &(out, inp)) in shapes.iter().enumerate() {
                let w = need(Weight::Proj(l, p, false), get(Weight::Proj(l, p, false))?)?;
                let b = get(Weight::Proj(l, p, true))?;
                lin.push(DevLinear { w, b, out, inp });
            }
            let mut it = lin.into_iter();
            let mut next = || it.next().ok_or_else(|| Error::InvalidInput("projection missing".into()));
            layers.push(DevLayer {
                in_norm: need(Weight::InNorm(l), get(Weight::InNorm(l))?)?,
                post_norm: need(Weight::PostNorm(l), get(Weight::PostNorm(l))?)?,
                q: next()?,
                k: next()?,
                v: next()?,
                o: next()?,
                gate: next()?,
                up: next()?,
                down: next()?,
            });
        }
        let embed = need(Weight::Embed, get(Weight::Embed)?)?;
        let norm = need(Weight::Norm, get(Weight::Norm)?)?;
        let head = get(Weight::Head)?;
        let inv_freq = stream.clone_htod(&cfg.rope_inv_freq()).map_err(cuda_err("upload"))?;
        let k_cache = stream.alloc_zeros::<bf16>(cache.len()).map_err(cuda_err("alloc k cache"))?;
        let v_cache = stream.alloc_zeros::<bf16>(cache.len()).map_err(cuda_err("alloc v cache"))?;
        Ok(Self { cfg, kernels, stream, blas, embed, head, norm, layers, inv_freq, cache, k_cache, v_cache })
    }

    /// Bytes of weights one forward streams (every linear, the LM head, the norms), for bandwidth figures.
    pub fn weight_bytes(&self) -> usize {
        let lin = |l: &DevLinear| l.w.len() + l.b.as_ref().map_or(0, CudaSlice::len);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].into_iter().map(lin).sum::<usize>()
                    + 2 * l.in_norm.len()
            })
            .sum();
        2 * (layers + self.head.as_ref().unwrap_or(&self.embed).len() + self.norm.len())
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

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(cuda_err("alloc"))
    }

    fn upload<T: DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(cuda_err("upload"))
    }

    fn linear(&self, rows: usize, x: &CudaSlice<bf16>, l: &DevLinear) -> Result<CudaSlice<bf16>> {
        let mut y = self.zeros::<bf16>(rows * l.out)?;
        gemm_bf16(&self.blas, &self.stream, rows, l.out, l.inp, x, &l.w, &mut y)?;
        if let Some(b) = &l.b {
            self.kernels.bias_add(&self.stream, rows, &mut y, b)?;
        }
        Ok(y)
    }

    /// One forward over `seqs`: writes their new tokens' K/V into the cache (tree nodes stay behind the prefix
    /// until [`CudaLlama::commit`] moves the accepted ones) and returns the logits of every new token.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad batch (see [`DeviceSeq`]), [`Error::Kernel`] when a launch fails.
    pub fn forward(&mut self, seqs: &[DeviceSeq<'_>]) -> Result<DeviceLogits> {
        let cfg = &self.cfg;
        let l = layout(seqs, cfg.vocab_size, self.cache.slots, self.cache.max_len)?;
        let (batch, n_max) = (seqs.len(), l.n_max);
        let rows = batch * n_max;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let s = self.stream.clone();
        let k = &self.kernels;
        let tokens = self.upload(&l.tokens)?;
        let (row_slot, row_pos, row_dst) =
            (self.upload(&l.row_slot)?, self.upload(&l.row_pos)?, self.upload(&l.row_dst)?);
        let (seq_slot, seq_prefix, seq_nodes) =
            (self.upload(&l.seq_slot)?, self.upload(&l.seq_prefix)?, self.upload(&l.seq_nodes)?);
        let anc = l.anc.as_deref().map(|a| self.upload(a)).transpose()?;
        let tree = TreeDims { batch, n_max };
        let mut x = self.zeros::<f32>(rows * h)?;
        k.embed_rows(&s, rows, h, &self.embed, &tokens, &mut x)?;
        let mut xn = self.zeros::<bf16>(rows * h)?;
        let mut attn = self.zeros::<bf16>(rows * cfg.q_dim())?;
        for (li, lw) in self.layers.iter().enumerate() {
            k.rms_norm(&s, rows, h, eps, &x, &lw.in_norm, &mut xn)?;
            let mut q = self.linear(rows, &xn, &lw.q)?;
            let kk = self.linear(rows, &xn, &lw.k)?;
            let v = self.linear(rows, &xn, &lw.v)?;
            let meta = RowMeta { slot: &row_slot, pos: &row_pos, dst: &row_dst };
            k.rope_kv_write(
                &s,
                self.cache,
                li,
                rows,
                &mut q,
                &kk,
                &v,
                &mut self.k_cache,
                &mut self.v_cache,
                meta,
                &self.inv_freq,
            )?;
            let seq = SeqMeta { slot: &seq_slot, prefix_len: &seq_prefix, n_nodes: &seq_nodes };
            k.tree_attention(&s, self.cache, li, tree, &q, &self.k_cache, &self.v_cache, &mut attn, seq, anc.as_ref())?;
            let o = self.linear(rows, &attn, &lw.o)?;
            k.add_to_residual(&s, &mut x, &o)?;
            k.rms_norm(&s, rows, h, eps, &x, &lw.post_norm, &mut xn)?;
            let mut gate = self.linear(rows, &xn, &lw.gate)?;
            let up = self.linear(rows, &xn, &lw.up)?;
            k.silu_mul(&s, &mut gate, &up)?;
            let down = self.linear(rows, &gate, &lw.down)?;
            k.add_to_residual(&s, &mut x, &down)?;
        }
        k.rms_norm(&s, rows, h, eps, &x, &self.norm, &mut xn)?;
        let mut logits = self.zeros::<f32>(rows * cfg.vocab_size)?;
        let head = self.head.as_ref().unwrap_or(&self.embed);
        gemm_bf16(&self.blas, &s, rows, cfg.vocab_size, h, &xn, head, &mut logits)?;
        Ok(DeviceLogits { logits, batch, n_max, vocab: cfg.vocab_size })
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
        let (slot, prefix, n_acc, path) =
            (self.upload(&slot)?, self.upload(&prefix)?, self.upload(&n_acc)?, self.upload(&flat)?);
        let seq = SeqMeta { slot: &slot, prefix_len: &prefix, n_nodes: &n_acc };
        let s = self.stream.clone();
        self.kernels.commit_path(
            &s,
            self.cache,
            seqs.len(),
            max_path,
            &mut self.k_cache,
            &mut self.v_cache,
            seq,
            &path,
            &n_acc,
        )?;
        Ok(())
    }

    /// Copies logits to the host (`[batch * n_max, vocab]`).
    ///
    /// # Errors
    /// [`Error::Kernel`] when the copy fails.
    pub fn to_host(&self, logits: &DeviceLogits) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(&logits.logits).map_err(cuda_err("download"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_pads_rows_and_places_tree_nodes_by_depth() {
        let (a, t) = ([5u32, 6, 7], [1u32, 2, 3, 4]);
        let parents = [-1, 0, 0, 1];
        let seqs = [
            DeviceSeq { slot: 2, prefix_len: 10, tokens: &a, parents: None },
            DeviceSeq { slot: 0, prefix_len: 4, tokens: &t, parents: Some(&parents) },
        ];
        let l = layout(&seqs, 100, 3, 64).unwrap();
        assert_eq!(l.n_max, 4);
        assert_eq!(l.tokens, vec![5, 6, 7, 0, 1, 2, 3, 4]);
        assert_eq!(l.row_slot, vec![2, 2, 2, -1, 0, 0, 0, 0]);
        assert_eq!(l.row_pos, vec![10, 11, 12, 0, 4, 5, 5, 6]);
        assert_eq!(l.row_dst, vec![10, 11, 12, 0, 4, 5, 6, 7]);
        assert_eq!((l.seq_slot, l.seq_prefix, l.seq_nodes), (vec![2, 0], vec![10, 4], vec![3, 4]));
        assert_eq!(l.anc.unwrap(), vec![0b1, 0b11, 0b111, 0, 0b1, 0b11, 0b101, 0b1011]);
    }

    #[test]
    fn layout_rejects_bad_batches() {
        let t = [1u32, 2];
        let ok = DeviceSeq { slot: 0, prefix_len: 0, tokens: &t, parents: None };
        assert!(layout(&[], 10, 1, 8).is_err());
        assert!(layout(&[DeviceSeq { slot: 1, ..ok }], 10, 1, 8).is_err(), "slot out of range");
        assert!(layout(&[ok, ok], 10, 2, 8).is_err(), "slot twice");
        assert!(layout(&[DeviceSeq { prefix_len: 7, ..ok }], 10, 1, 8).is_err(), "past max_len");
        assert!(layout(&[DeviceSeq { tokens: &[10], ..ok }], 10, 1, 8).is_err(), "token id");
        assert!(layout(&[DeviceSeq { parents: Some(&[-1]), ..ok }], 10, 1, 8).is_err(), "parents length");
        assert!(layout(&[DeviceSeq { parents: Some(&[0, 0]), ..ok }], 10, 1, 8).is_err(), "root with a parent");
        let long = vec![1u32; 65];
        let tree = DeviceSeq { slot: 1, prefix_len: 0, tokens: &t, parents: Some(&[-1, 0]) };
        assert!(layout(&[DeviceSeq { tokens: &long, ..ok }, tree], 10, 2, 128).is_err(), "long chunk beside a tree");
        assert!(layout(&[DeviceSeq { tokens: &long, ..ok }], 10, 2, 128).is_ok(), "a long causal chunk alone");
    }
}
