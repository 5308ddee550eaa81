//! The drafter on a CUDA device: [`CudaDrafter`] is a [`DraftExecutor`] that keeps the drafter's weights (bf16), its
//! one layer's KV cache (bf16, one slot per sequence) and the target's embedding on the device, runs the GEMMs with
//! cuBLAS and the rest with `tlt_kernels::cuda`'s NVRTC kernels, and picks each row's top-k draft tokens there: per
//! level only the layer outputs (`[rows, H]` f32, the features of the next level) and `k` candidates per row cross
//! to the host, never the draft vocabulary's logits. Built on the device seam (`tlt_kernels::cuda::Gpu`): CI runs it
//! on the simulated device against the host executor; a CUDA device comes from `tlt_kernels::cuda::CudaGpu`
//! (feature `cuda`).
//!
//! The tree growth above it is [`EagleProposer`](crate::EagleProposer)'s, unchanged: a level's rows attend to the
//! sequence's committed positions and to their ancestors among the tentative rows of earlier levels, which stay in
//! the cache right after the committed positions (the device tree attention sees them as the level's first nodes;
//! their queries are padding and their outputs are dropped).
//!
//! Limits: at most [`MAX_TREE_NODES`] tentative rows per sequence and top-k at most [`MAX_TOP_K`]; a forward's rows
//! share one feature width (the proposer never mixes them: committed positions in a catch-up, drafted ones in a
//! level). The target's features arrive from the host (the engine's recorded hidden states) and are uploaded.
//!
//! Training: [`CudaDrafterTrainer`] runs an EAGLE-2 drafter's training step on the device.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use half::bf16;
use tlt_kernels::cuda::packing::Packing;
use tlt_kernels::cuda::plan::{self, Buf, Chunks, GemmY, Launch, RowBuf, RowBufs, SeqBufs, SplitParts};
use tlt_kernels::cuda::{
    gpu, CacheDims, DeviceBuf, DeviceLinear, Elem, Fetched, Recycler, Scratch, SharedGpu, Staged, TreeDims, MAX_TOP_K,
    MAX_TREE_NODES,
};
use tlt_model::device_step::{StepLayout, StepMeta};

pub use crate::cuda_online::CudaOnlineTrainer;
pub use crate::cuda_train::{CudaDrafterTrainer, DeviceLoss, DraftArena};

use crate::config::{DrafterConfig, DrafterKind};
use crate::exec::{DraftExecutor, Forward};
use crate::runtime::{Attend, DraftRuntime, ExportedLinear, Group, Row};
use crate::{Error, Result};

fn kern(e: tlt_kernels::Error) -> Error {
    Error::Model(tlt_model::Error::Kernel(e))
}

/// How many sequences a [`CudaDrafter`]'s cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaDraftOptions {
    /// Sequences drafted for at once (cache slots).
    pub slots: usize,
    /// Positions per sequence, tentative tree rows included.
    pub max_len: usize,
}

impl Default for CudaDraftOptions {
    fn default() -> Self {
        Self { slots: 256, max_len: 4096 + MAX_TREE_NODES }
    }
}

/// A cache slot lent to one sequence, given back to its drafter when dropped.
#[derive(Debug)]
struct SlotLease {
    slot: usize,
    free: Arc<Mutex<Vec<usize>>>,
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if let Ok(mut free) = self.free.lock() {
            free.push(self.slot);
        }
    }
}

/// A sequence's drafter cache on the device: a slot of the [`CudaDrafter`]'s cache (taken at its first forward,
/// given back when dropped), its committed positions and the tentative rows after them.
#[derive(Debug, Default)]
pub struct DeviceDraftCache {
    lease: Option<SlotLease>,
    len: usize,
    tentative: usize,
}

#[derive(Debug)]
struct DevWeights {
    version: u64,
    kind: DrafterKind,
    hidden: usize,
    eps: f32,
    fc: DeviceLinear,
    /// q, k, v, o, gate, up, down.
    proj: [DeviceLinear; 7],
    input_norm: Option<DeviceBuf<bf16>>,
    hidden_norm: Option<DeviceBuf<bf16>>,
    post_norm: DeviceBuf<bf16>,
    final_norm: Option<DeviceBuf<bf16>>,
    embed: DeviceBuf<bf16>,
    head: DeviceLinear,
    inv_freq: DeviceBuf<f64>,
}

/// The drafter's cache: keys and values of its one layer.
#[derive(Debug)]
struct DevCache {
    dims: CacheDims,
    k: DeviceBuf<bf16>,
    v: DeviceBuf<bf16>,
}

/// Idle activation bytes the device drafter keeps for its next forwards (a few shapes' worth at SmolLM2 to 8B
/// widths; beyond it a buffer handed back is freed).
const SCRATCH_IDLE_BYTES: usize = 512 << 20;

/// A [`DraftExecutor`] on a CUDA device. Build it once ([`CudaDrafter::new`]) and hand it to
/// [`EagleProposer::with_executor`](crate::EagleProposer::with_executor); the weights are uploaded at the first
/// round and again whenever the proposer's slot publishes a new version.
#[derive(Debug)]
pub struct CudaDrafter {
    // Fields drop in declaration order: buffers first, then the device.
    w: Option<DevWeights>,
    cache: Option<DevCache>,
    /// A forward's packed metadata and its features, each sent in one copy from pinned memory.
    meta: Staged,
    features: Staged,
    /// A forward's layer outputs and top-k, read back in one copy into pinned memory (grown on demand).
    results: Fetched,
    /// Activations, recycled across forwards (one stream).
    scratch: Recycler,
    gpu: SharedGpu,
    opts: CudaDraftOptions,
    free: Arc<Mutex<Vec<usize>>>,
    /// Blocks of split attention resident on the device at once (`GpuInfo::target_blocks`), which sizes its chunks.
    target_blocks: usize,
    /// Weight versions uploaded so far.
    uploads: u64,
}

/// A forward's padded `[batch, n_max]` layout, per group, as the target's device step lays out its metadata
/// ([`StepMeta`] packs it), and the padded row of every input row.
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    step: StepLayout,
    /// Padded row of every input row.
    row_of: Vec<usize>,
}

/// One group as [`layout`] reads it: slot, committed length, tentative rows kept, rows, parents of a tree.
#[derive(Debug, Clone)]
struct GroupPlan<'p> {
    slot: usize,
    len: usize,
    prior: usize,
    rows: Range<usize>,
    parents: Option<&'p [Option<usize>]>,
}

/// `v` as bytes.
fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern of it is a valid u8; the length is the slice's in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} = {v} exceeds i32")))
}

/// Lays a forward out for the device kernels: group `b`'s node `i` is padded row `b * n_max + i`; its first
/// `prior` nodes are the tentative rows already in the cache (no query of theirs is used, nothing is written for
/// them), then its new rows, written at cache position `len + i`. Masks: a tree node sees its ancestors (and
/// itself); a causal group's rows see the rows before them.
fn layout(rows: &[Row<'_>], groups: &[GroupPlan<'_>], max_len: usize) -> Result<Layout> {
    let n_max = groups.iter().map(|g| g.prior + g.rows.len()).max().unwrap_or(0);
    if groups.is_empty() || n_max == 0 {
        return Err(Error::InvalidArgument("a device draft forward needs rows".into()));
    }
    let tree = groups.iter().any(|g| g.parents.is_some());
    if tree && n_max > MAX_TREE_NODES {
        return Err(Error::InvalidArgument(format!(
            "{n_max} tree rows for one sequence; the device drafter handles at most {MAX_TREE_NODES}"
        )));
    }
    let mut row_of = vec![usize::MAX; rows.len()];
    let mut l = StepLayout::padding(groups.len(), n_max, tree);
    for (b, g) in groups.iter().enumerate() {
        let nodes = g.prior + g.rows.len();
        if g.len + nodes > max_len {
            return Err(Error::InvalidArgument(format!(
                "{} committed + {nodes} draft rows exceed the device drafter's {max_len} positions",
                g.len
            )));
        }
        if g.rows.end > rows.len() {
            return Err(Error::batch("groups", format!("rows {:?} of {}", g.rows, rows.len())));
        }
        l.seq_slot.push(i32_of("slot", g.slot)?);
        l.seq_prefix.push(i32_of("prefix", g.len)?);
        l.seq_nodes.push(i32_of("nodes", nodes)?);
        if let Some(anc) = l.anc.as_mut() {
            let masks = &mut anc[b * n_max..b * n_max + nodes];
            for i in 0..nodes {
                let parent = match g.parents {
                    Some(p) => *p.get(i).ok_or_else(|| Error::batch("tree", "fewer parents than rows"))?,
                    None => i.checked_sub(1),
                };
                let up = match parent {
                    Some(p) if p < i => masks[p],
                    Some(p) => return Err(Error::batch("tree", format!("row {i}: parent {p} must precede it"))),
                    None => 0,
                };
                masks[i] = up | (1u64 << i);
            }
        }
        for (k, j) in g.rows.clone().enumerate() {
            let r = b * n_max + g.prior + k;
            l.tokens[r] = i32::try_from(rows[j].token).map_err(|_| Error::batch("token", "id exceeds i32"))?;
            l.row_slot[r] = i32_of("slot", g.slot)?;
            l.row_pos[r] = i32_of("position", rows[j].pos)?;
            l.row_dst[r] = i32_of("position", g.len + g.prior + k)?;
            row_of[j] = r;
        }
    }
    if row_of.contains(&usize::MAX) {
        return Err(Error::batch("groups", "every row must belong to exactly one group"));
    }
    Ok(Layout { step: l, row_of })
}

impl CudaDrafter {
    /// A drafter on `gpu` (the target's device, or another).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero slots or positions; the device's error when an allocation fails.
    pub fn new(gpu: SharedGpu, opts: CudaDraftOptions) -> Result<Self> {
        if opts.slots == 0 || opts.max_len == 0 {
            return Err(Error::InvalidArgument(format!("device drafter needs slots and positions: {opts:?}")));
        }
        let target_blocks = gpu.info().target_blocks();
        let (meta, features) = (Staged::new(&gpu, 4096).map_err(kern)?, Staged::new(&gpu, 1 << 16).map_err(kern)?);
        let results = Fetched::new(&gpu, 1 << 16).map_err(kern)?;
        let free = Arc::new(Mutex::new((0..opts.slots).rev().collect()));
        let scratch = Recycler::new(SCRATCH_IDLE_BYTES);
        Ok(Self { w: None, cache: None, meta, features, results, scratch, gpu, opts, free, target_blocks, uploads: 0 })
    }

    /// The device memory a drafter of `cfg` takes at most with `opts`, in bytes: two versions of its weights in bf16
    /// (the one drafting and the next, uploaded beside it), each with its copy of the target's embedding and LM head;
    /// its cache (keys and values of its layer for every slot); the idle activations it keeps.
    pub fn memory(cfg: &DrafterConfig, opts: CudaDraftOptions) -> usize {
        let shapes = match cfg.kind {
            DrafterKind::Eagle2 => crate::Eagle2Weights::expected_shapes(cfg),
            DrafterKind::Eagle3 => crate::Eagle3Weights::expected_shapes(cfg),
        };
        let layer: usize = shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        let weights = 2 * (layer + 2 * cfg.vocab_size() * cfg.hidden_size());
        let cache = opts.slots * opts.max_len * 2 * cfg.llama.kv_dim() * 2;
        2 * weights + cache + SCRATCH_IDLE_BYTES
    }

    /// Weight versions uploaded to the device so far: the first round's, then one per version the proposer's slot
    /// published and a later round drafted with.
    pub fn uploads(&self) -> u64 {
        self.uploads
    }

    /// Cache slots not lent to a sequence.
    pub fn free_slots(&self) -> usize {
        self.free.lock().map_or(0, |f| f.len())
    }

    fn zeros<T: Elem>(&self, n: usize) -> Result<DeviceBuf<T>> {
        DeviceBuf::zeros(self.gpu.as_ref(), n.max(1)).map_err(kern)
    }

    /// Queues a planned launch.
    fn run(&self, launch: tlt_kernels::Result<Launch>) -> Result<()> {
        self.gpu.launch(&launch.map_err(kern)?).map_err(kern)
    }

    /// A scratch buffer of `n` elements: recycled from an earlier forward of the same shape when one is idle (its
    /// contents are then stale: every user below writes all its rows, or zeroes it first).
    fn scratch<T: Elem>(&self, n: usize) -> Result<Scratch<T>> {
        self.scratch.take(self.gpu.as_ref(), n).map_err(kern)
    }

    /// A zeroed scratch buffer of `n` elements.
    fn scratch_zeroed<T: Elem>(&self, n: usize) -> Result<Scratch<T>> {
        let b = self.scratch(n)?;
        gpu::zero(self.gpu.as_ref(), b.buf()).map_err(kern)?;
        Ok(b)
    }

    fn upload_bf16(&self, v: &[f32]) -> Result<DeviceBuf<bf16>> {
        let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        DeviceBuf::from_host(self.gpu.as_ref(), &h).map_err(kern)
    }

    fn linear(&self, l: &ExportedLinear) -> Result<DeviceLinear> {
        DeviceLinear::upload(self.gpu.as_ref(), &l.w, l.bias.as_deref(), l.out, l.inp).map_err(kern)
    }

    /// `y = x · wᵀ (+ b)` for `rows` rows, bf16 out.
    fn apply(&self, lin: &DeviceLinear, rows: usize, x: &DeviceBuf<bf16>) -> Result<Scratch<bf16>> {
        let y = self.scratch::<bf16>(rows * lin.out)?;
        lin.forward(self.gpu.as_ref(), rows, x.buf(), y.buf()).map_err(kern)?;
        Ok(y)
    }

    fn weights(&self) -> Result<&DevWeights> {
        self.w.as_ref().ok_or_else(|| Error::InvalidArgument("the device drafter has no weights loaded".into()))
    }

    /// `[rows, H]` f32 from a zeroed buffer plus `x` (bf16): the residual stream's start.
    fn residual_from(&self, x: &DeviceBuf<bf16>) -> Result<Scratch<f32>> {
        let r = self.scratch_zeroed::<f32>(x.len())?;
        self.run(plan::add_to_residual(r.buf(), x.buf()))?;
        Ok(r)
    }

    /// Reads back, in one copy, the layer outputs `resid` (`[rows, H]` f32 on the device; `None`: not wanted)
    /// and, for `k > 0`, each row's top `k` draft tokens after the final norm (EAGLE-3) and the draft head: (layer
    /// outputs, draft ids, log-probs), the last two `[rows, k]`.
    fn read_back(
        &mut self,
        rows: usize,
        resid: &DeviceBuf<f32>,
        want_out: bool,
        k: usize,
    ) -> Result<(Vec<f32>, Vec<i32>, Vec<f32>)> {
        let h = self.weights()?.hidden;
        let out_len = if want_out { rows * h } else { 0 };
        let pack = Packing::new(&[out_len * 4, rows * k * 4, rows * k * 4]);
        if pack.bytes() > self.results.bytes() {
            self.results = Fetched::new(&self.gpu, pack.bytes().max(2 * self.results.bytes())).map_err(kern)?;
        }
        let base = self.results.buf();
        if want_out {
            gpu::copy(self.gpu.as_ref(), resid.buf(), pack.buf(base, 0).map_err(kern)?).map_err(kern)?;
        }
        if k > 0 {
            let w = self.weights()?;
            let x = self.scratch::<bf16>(rows * h)?;
            match &w.final_norm {
                Some(n) => self.run(plan::rms_norm(rows, h, w.eps, resid.buf(), n.buf(), x.buf()))?,
                None => self.run(plan::concat_rows(rows, RowBuf::F32(resid.buf(), h), None, x.buf()))?,
            }
            let dv = w.head.out;
            let logits = self.scratch::<f32>(rows * dv)?;
            let gemm = plan::gemm(rows, dv, h, x.buf(), w.head.w.buf(), GemmY::F32(logits.buf())).map_err(kern)?;
            self.gpu.gemm(&gemm).map_err(kern)?;
            let (idx, lp) = (pack.buf(base, 1).map_err(kern)?, pack.buf(base, 2).map_err(kern)?);
            self.run(plan::top_k_rows(rows, dv, k, logits.buf(), idx, lp))?;
        }
        let host = self.results.fetch(pack.bytes()).map_err(kern)?;
        Ok((
            pack.get::<f32>(host, 0).map_err(kern)?,
            pack.get::<i32>(host, 1).map_err(kern)?,
            pack.get::<f32>(host, 2).map_err(kern)?,
        ))
    }

    /// The candidates of rows `which` (padded row indices) from a `[rows, k]` top-k.
    fn candidates(rt: &DraftRuntime, idx: &[i32], lp: &[f32], k: usize, which: &[usize]) -> Vec<Vec<(u32, f32)>> {
        which
            .iter()
            .map(|&r| {
                (r * k..(r + 1) * k).map(|e| (rt.target_id(usize::try_from(idx[e]).unwrap_or(0)), lp[e])).collect()
            })
            .collect()
    }

    fn clamp_k(&self, rt: &DraftRuntime, k: usize) -> Result<usize> {
        let k = k.min(rt.draft_vocab());
        if k > MAX_TOP_K {
            return Err(Error::InvalidArgument(format!("top-{k} drafting; the device drafter handles {MAX_TOP_K}")));
        }
        Ok(k)
    }

    /// The layer input (`[R, qkv_in]` bf16) and the residual stream (`[R, H]` f32) of the padded rows (`tokens`:
    /// the packed metadata's token segment).
    fn inputs(&mut self, rows: &[Row<'_>], l: &Layout, tokens: Buf<i32>) -> Result<(Scratch<bf16>, Scratch<f32>)> {
        let (h, total) = (self.weights()?.hidden, l.step.tokens.len());
        let fw = rows.first().map_or(h, |r| r.feature.len());
        if let Some(r) = rows.iter().find(|r| r.feature.len() != fw) {
            return Err(Error::batch("feature", format!("widths {fw} and {} in one device forward", r.feature.len())));
        }
        // The features, padded rows zero, in one copy from pinned memory.
        let pack = Packing::new(&[total * fw * 4]);
        let base = self
            .features
            .send(pack.bytes(), |host| {
                host.fill(0);
                for (r, &p) in rows.iter().zip(&l.row_of) {
                    host[p * fw * 4..(p + 1) * fw * 4].copy_from_slice(bytemuck_f32(r.feature));
                }
                Ok(())
            })
            .map_err(kern)?;
        let feat: Buf<f32> = pack.buf(base, 0).map_err(kern)?;
        let w = self.weights()?;
        let emb = self.scratch::<f32>(total * h)?;
        self.run(plan::embed_rows(total, h, w.embed.buf(), tokens, emb.buf()))?;
        let concat = |a: RowBuf, b: Option<RowBuf>, out: &DeviceBuf<bf16>| -> Result<()> {
            self.run(plan::concat_rows(total, a, b, out.buf()))
        };
        match w.kind {
            DrafterKind::Eagle2 => {
                if fw != h || w.fc.inp != 2 * h {
                    return Err(Error::batch("feature", format!("width {fw}, EAGLE-2 reads {h}")));
                }
                let cat = self.scratch::<bf16>(total * 2 * h)?;
                concat(RowBuf::F32(emb.buf(), h), Some(RowBuf::F32(feat, h)), &cat)?;
                let x = self.apply(&w.fc, total, &cat)?;
                let resid = self.residual_from(&x)?;
                Ok((x, resid))
            }
            DrafterKind::Eagle3 => {
                let resid = if fw == w.fc.inp {
                    let f16 = self.scratch::<bf16>(total * fw)?;
                    concat(RowBuf::F32(feat, fw), None, &f16)?;
                    self.residual_from(&*self.apply(&w.fc, total, &f16)?)?
                } else if fw == h {
                    let r = self.scratch::<f32>(total * h)?;
                    gpu::copy(self.gpu.as_ref(), feat, r.buf()).map_err(kern)?;
                    r
                } else {
                    return Err(Error::batch("feature", format!("width {fw}, EAGLE-3 reads {} or {h}", w.fc.inp)));
                };
                let (Some(inorm), Some(hnorm)) = (&w.input_norm, &w.hidden_norm) else {
                    return Err(Error::config("midlayer", "no input/hidden norm", "EAGLE-3 needs both"));
                };
                let (en, gn) = (self.scratch::<bf16>(total * h)?, self.scratch::<bf16>(total * h)?);
                self.run(plan::rms_norm(total, h, w.eps, emb.buf(), inorm.buf(), en.buf()))?;
                self.run(plan::rms_norm(total, h, w.eps, resid.buf(), hnorm.buf(), gn.buf()))?;
                let x = self.scratch::<bf16>(total * 2 * h)?;
                concat(RowBuf::Bf16(en.buf(), h), Some(RowBuf::Bf16(gn.buf(), h)), &x)?;
                Ok((x, resid))
            }
        }
    }

    /// The layer over the padded rows: attention over the cache (writing the new rows' keys and values; split
    /// over key chunks like the target's), MLP. Returns the residual stream after the layer (`[R, H]` f32, on the
    /// device). The rows' metadata goes out in one copy from pinned memory.
    fn layer(&mut self, rows: &[Row<'_>], l: &Layout) -> Result<Scratch<f32>> {
        let step = &l.step;
        let packing = StepMeta::new(step.seq_slot.len(), step.n_max, step.anc.is_some());
        let base = self
            .meta
            .send(packing.bytes(), |host| {
                packing.write(step, host).map_err(|e| tlt_kernels::Error::InvalidArgument(e.to_string()))
            })
            .map_err(kern)?;
        let meta = packing.bufs(base).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let (x_in, resid) = self.inputs(rows, l, meta.tokens)?;
        let total = l.step.tokens.len();
        let w = self.weights()?;
        let (h, eps) = (w.hidden, w.eps);
        let [q, k, v, ..] = &w.proj;
        let (qx, kx, vx) = (self.apply(q, total, &x_in)?, self.apply(k, total, &x_in)?, self.apply(v, total, &x_in)?);
        let c = self.cache.as_ref().ok_or_else(|| Error::InvalidArgument("the device drafter has no cache".into()))?;
        let (kc, vc) = (c.k.buf(), c.v.buf());
        let rows_meta = RowBufs { slot: meta.row_slot, pos: meta.row_pos, dst: meta.row_dst };
        let inv = w.inv_freq.buf();
        let (qb, kb, vb) = (qx.buf(), kx.buf(), vx.buf());
        self.run(plan::rope_kv_write(c.dims, 0, total, qb, kb, vb, kc, vc, rows_meta, inv))?;
        // Zeroed: rows of padding are never written by attention (their stale values would be harmless, zeros are
        // tidier).
        let attn = self.scratch_zeroed::<bf16>(qx.len())?;
        let tree = TreeDims { batch: step.seq_slot.len(), n_max: step.n_max };
        let a = c.dims.attn;
        let chunks = Chunks::for_cache(a, c.dims.max_len, self.target_blocks);
        let [po, pml, pa] = chunks.part_lens(tree, a);
        let parts = if chunks.n_splits > 1 {
            // The arrival counters must start at zero (scratch is recycled); the kernel leaves them zero.
            Some((self.scratch::<f32>(po)?, self.scratch::<f32>(pml)?, self.scratch_zeroed::<i32>(pa)?))
        } else {
            None
        };
        let seq = SeqBufs { slot: meta.seq_slot, prefix_len: meta.seq_prefix, n_nodes: meta.seq_nodes };
        let part_bufs = parts.as_ref().map(|(o, ml, n)| SplitParts { o: o.buf(), ml: ml.buf(), arrivals: n.buf() });
        for launch in
            plan::attention(c.dims, 0, tree, chunks, qb, kc, vc, attn.buf(), seq, meta.anc, part_bufs).map_err(kern)?
        {
            self.run(Ok(launch))?;
        }
        let [_, _, _, o, gate, up, down] = &w.proj;
        self.run(plan::add_to_residual(resid.buf(), self.apply(o, total, &attn)?.buf()))?;
        let normed = self.scratch::<bf16>(total * h)?;
        self.run(plan::rms_norm(total, h, eps, resid.buf(), w.post_norm.buf(), normed.buf()))?;
        let g = self.apply(gate, total, &normed)?;
        self.run(plan::silu_mul(g.buf(), self.apply(up, total, &normed)?.buf()))?;
        self.run(plan::add_to_residual(resid.buf(), self.apply(down, total, &g)?.buf()))?;
        Ok(resid)
    }

    /// Plans the groups (taking slots for caches that have none) and checks them against the cache.
    fn plan<'p>(&self, groups: &mut [Group<'_, 'p, DeviceDraftCache>]) -> Result<Vec<GroupPlan<'p>>> {
        let mut plans = Vec::with_capacity(groups.len());
        for (cache, range, attend) in groups.iter_mut() {
            if cache.lease.is_none() {
                let slot = self.free.lock().ok().and_then(|mut f| f.pop()).ok_or_else(|| {
                    Error::InvalidArgument(format!("all {} device draft slots are in use", self.opts.slots))
                })?;
                cache.lease = Some(SlotLease { slot, free: self.free.clone() });
            }
            let slot = cache.lease.as_ref().map_or(0, |l| l.slot);
            let (prior, parents) = match *attend {
                Attend::Causal => (0, None),
                Attend::Tree(p) => {
                    if p.len() != cache.tentative + range.len() {
                        return Err(Error::batch(
                            "tree",
                            format!("{} parents for {} + {} rows", p.len(), cache.tentative, range.len()),
                        ));
                    }
                    (cache.tentative, Some(p))
                }
            };
            plans.push(GroupPlan { slot, len: cache.len, prior, rows: range.clone(), parents });
        }
        Ok(plans)
    }
}

impl DraftExecutor for CudaDrafter {
    type Cache = DeviceDraftCache;

    fn load(&mut self, rt: &DraftRuntime, version: u64) -> Result<()> {
        if self.w.as_ref().is_some_and(|w| w.version == version) {
            return Ok(());
        }
        let e = rt.export()?;
        let (eps, inv_freq) = rt.norm_eps_and_rope();
        let up_opt = |v: &Option<Vec<f32>>| v.as_deref().map(|v| self.upload_bf16(v)).transpose();
        let [q, k, v, o, gate, up, down] = &e.proj;
        let w = DevWeights {
            version,
            kind: rt.kind(),
            hidden: rt.hidden_size(),
            eps,
            fc: self.linear(&e.fc)?,
            proj: [
                self.linear(q)?,
                self.linear(k)?,
                self.linear(v)?,
                self.linear(o)?,
                self.linear(gate)?,
                self.linear(up)?,
                self.linear(down)?,
            ],
            input_norm: up_opt(&e.input_norm)?,
            hidden_norm: up_opt(&e.hidden_norm)?,
            post_norm: self.upload_bf16(&e.post_norm)?,
            final_norm: up_opt(&e.final_norm)?,
            embed: self.upload_bf16(&e.embed)?,
            head: self.linear(&e.head)?,
            inv_freq: DeviceBuf::from_host(self.gpu.as_ref(), inv_freq).map_err(kern)?,
        };
        let dims = CacheDims { layers: 1, slots: self.opts.slots, max_len: self.opts.max_len, attn: rt.attn_shape() };
        dims.check().map_err(kern)?;
        if self.cache.as_ref().is_none_or(|c| c.dims != dims) {
            let (k, v) = (self.zeros::<bf16>(dims.len())?, self.zeros::<bf16>(dims.len())?);
            self.cache = Some(DevCache { dims, k, v });
        }
        self.w = Some(w);
        self.uploads += 1;
        Ok(())
    }

    fn forward(
        &mut self,
        rt: &DraftRuntime,
        rows: &[Row<'_>],
        groups: &mut [Group<'_, '_, DeviceDraftCache>],
        top_k: usize,
    ) -> Result<Forward> {
        if rows.is_empty() {
            return Ok(Forward::default());
        }
        let k = self.clamp_k(rt, top_k)?;
        let plans = self.plan(groups)?;
        let l = layout(rows, &plans, self.opts.max_len)?;
        let resid = self.layer(rows, &l)?;
        for ((cache, range, attend), g) in groups.iter_mut().zip(&plans) {
            cache.tentative = match attend {
                Attend::Causal => range.len(),
                Attend::Tree(_) => g.prior + range.len(),
            };
        }
        let h = self.weights()?.hidden;
        let (all, idx, lp) = self.read_back(l.step.tokens.len(), &resid, true, k)?;
        let mut out = Vec::with_capacity(rows.len() * h);
        for &r in &l.row_of {
            out.extend_from_slice(&all[r * h..(r + 1) * h]);
        }
        let candidates = if k > 0 { Self::candidates(rt, &idx, &lp, k, &l.row_of) } else { Vec::new() };
        Ok(Forward { out, candidates })
    }

    fn top_k(&mut self, rt: &DraftRuntime, a: &[f32], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        let h = self.weights()?.hidden;
        let k = self.clamp_k(rt, k)?;
        if !a.len().is_multiple_of(h) {
            return Err(Error::batch("layer outputs", format!("{} values for width {h}", a.len())));
        }
        if a.is_empty() || k == 0 {
            return Ok(vec![Vec::new(); a.len() / h]);
        }
        let rows = a.len() / h;
        let resid = DeviceBuf::from_host(self.gpu.as_ref(), a).map_err(kern)?;
        let (_, idx, lp) = self.read_back(rows, &resid, false, k)?;
        Ok(Self::candidates(rt, &idx, &lp, k, &(0..rows).collect::<Vec<_>>()))
    }

    fn committed(cache: &DeviceDraftCache) -> usize {
        cache.len
    }

    fn commit(cache: &mut DeviceDraftCache, n: usize) {
        cache.len += n;
        cache.tentative = cache.tentative.saturating_sub(n);
    }

    fn truncate_tentative(&mut self, _rt: &DraftRuntime, cache: &mut DeviceDraftCache) {
        cache.tentative = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(token: u32, pos: usize) -> Row<'static> {
        Row { token, feature: &[], pos }
    }

    #[test]
    fn causal_and_tree_groups_are_laid_out_with_their_tentative_rows() {
        // Group 0: a causal catch-up of 3 rows at committed length 5 (slot 2). Group 1: a tree level of 2 new rows
        // after 2 tentative rows (parents: row 0 and 1 on the committed prefix, row 2 under 0, row 3 under 2).
        let rows = [row(7, 5), row(8, 6), row(9, 7), row(10, 11), row(11, 12)];
        let parents = [None, None, Some(0), Some(2)];
        let groups = [
            GroupPlan { slot: 2, len: 5, prior: 0, rows: 0..3, parents: None },
            GroupPlan { slot: 0, len: 10, prior: 2, rows: 3..5, parents: Some(&parents) },
        ];
        let l = layout(&rows, &groups, 64).unwrap();
        assert_eq!(l.step.n_max, 4);
        assert_eq!(l.row_of, vec![0, 1, 2, 6, 7]);
        assert_eq!(l.step.tokens, vec![7, 8, 9, 0, 0, 0, 10, 11]);
        assert_eq!(l.step.row_slot, vec![2, 2, 2, -1, -1, -1, 0, 0], "padding and kept rows write nothing");
        assert_eq!(l.step.row_dst[..3], [5, 6, 7]);
        assert_eq!(l.step.row_dst[6..], [12, 13], "new tree rows land after the 2 tentative ones");
        assert_eq!(l.step.row_pos[6..], [11, 12]);
        assert_eq!((l.step.seq_slot, l.step.seq_prefix, l.step.seq_nodes), (vec![2, 0], vec![5, 10], vec![3, 4]));
        let anc = l.step.anc.unwrap();
        assert_eq!(anc[..3], [0b1, 0b11, 0b111], "a causal group in a tree forward: chain masks");
        assert_eq!(anc[4..], [0b1, 0b10, 0b101, 0b1101]);
    }

    #[test]
    fn bad_layouts_are_errors() {
        let rows = [row(1, 0), row(2, 1)];
        let g = |len, rows: Range<usize>| GroupPlan { slot: 0, len, prior: 0, rows, parents: None };
        assert!(layout(&rows, &[g(63, 0..2)], 64).is_err(), "beyond max_len");
        assert!(layout(&rows, &[g(0, 0..1)], 64).is_err(), "a row in no group");
        assert!(layout(&rows, &[g(0, 0..3)], 64).is_err(), "rows outside the forward");
        let back = [None, Some(1)];
        let tree = GroupPlan { slot: 0, len: 0, prior: 0, rows: 0..2, parents: Some(&back) };
        assert!(layout(&rows, &[tree], 64).is_err(), "a parent after its child");
        let many: Vec<Row<'_>> = (0..65).map(|i| row(1, i)).collect();
        let chain: Vec<Option<usize>> = (0..65).map(|i: usize| i.checked_sub(1)).collect();
        let big = GroupPlan { slot: 0, len: 0, prior: 0, rows: 0..65, parents: Some(&chain) };
        assert!(layout(&many, &[big], 1024).is_err(), "more than 64 tree rows");
        assert!(layout(&[], &[], 64).is_err());
    }
}
