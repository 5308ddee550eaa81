//! Launch plans: for every kernel of ours, the checks, the launch configuration and the argument list the host
//! computes, as plain data ([`Launch`]). A CUDA device ([`super::CudaKernels`], feature `cuda`) and the CPU
//! simulation of CUDA's execution model that runs our kernels in CI (`tlt-cuda-sim`) execute the very same plans,
//! so what the simulation tests is what the device is asked to run.
//!
//! Buffers are [`Buf`]s: an address in the executing device's memory and a length in elements. The plans check
//! every length against the shapes; they never dereference an address.

use std::marker::PhantomData;
use std::ops::Range;

use half::bf16;

use super::shapes::{CacheDims, TreeDims, MAX_TOP_K};
use crate::error::{check_len, Error, Result};

/// A device buffer of `len` elements of `T` at `addr` (a device pointer, or a host pointer in the simulation).
pub struct Buf<T> {
    addr: u64,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Buf<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Buf<T> {}

impl<T> std::fmt::Debug for Buf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buf<{}>({:#x}, {})", std::any::type_name::<T>(), self.addr, self.len)
    }
}

impl<T> PartialEq for Buf<T> {
    fn eq(&self, o: &Self) -> bool {
        (self.addr, self.len) == (o.addr, o.len)
    }
}

impl<T> Buf<T> {
    /// The buffer of `len` elements at `addr`.
    #[must_use]
    pub fn new(addr: u64, len: usize) -> Self {
        Self { addr, len, _t: PhantomData }
    }

    /// Its address.
    #[must_use]
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length in elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `range` of it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the buffer.
    pub fn slice(&self, range: Range<usize>) -> Result<Self> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::InvalidArgument(format!("elements {range:?} of a buffer of {}", self.len)));
        }
        let offset = (range.start * std::mem::size_of::<T>()) as u64;
        Ok(Self::new(self.addr + offset, range.end - range.start))
    }

    fn arg(&self) -> Arg {
        Arg::Ptr(self.addr)
    }
}

/// An absent buffer: a null pointer argument.
fn null() -> Arg {
    Arg::Ptr(0)
}

/// One kernel argument, as the kernel's parameter receives it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A pointer (0: null).
    Ptr(u64),
    /// An `int`.
    I32(i32),
    /// An `unsigned long long`.
    U64(u64),
    /// A `float`.
    F32(f32),
}

/// A kernel launch: the kernel, the grid and block it runs on, dynamic shared memory, and its arguments in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The `extern "C"` kernel.
    pub kernel: &'static str,
    /// Blocks (x, y, z).
    pub grid: [u32; 3],
    /// Threads per block (x, y, z).
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes.
    pub shared_bytes: u32,
    /// The arguments.
    pub args: Vec<Arg>,
}

impl Launch {
    fn new(kernel: &'static str, grid: [u32; 3], block: u32, args: Vec<Arg>) -> Self {
        Self { kernel, grid, block: [block, 1, 1], shared_bytes: 0, args }
    }

    /// Threads the launch starts.
    #[must_use]
    pub fn threads(&self) -> u64 {
        let n = |d: [u32; 3]| d.iter().map(|&x| u64::from(x)).product::<u64>();
        n(self.grid) * n(self.block)
    }
}

/// `v` as a launch dimension.
pub(super) fn dim(what: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} = {v} does not fit a launch dimension")))
}

/// `v` as an `int` argument.
pub(super) fn int(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} = {v} does not fit an i32 kernel argument")))
}

fn i32_arg(what: &'static str, v: usize) -> Result<Arg> {
    int(what, v).map(Arg::I32)
}

/// Blocks for a grid-stride loop over `n` elements (256 threads each, at most 4,096 blocks).
fn stride_grid(n: usize) -> [u32; 3] {
    [n.div_ceil(256).clamp(1, 4096) as u32, 1, 1]
}

/// Per-sequence metadata of a step (`[batch]` i32 each).
#[derive(Debug, Clone, Copy)]
pub struct SeqBufs {
    /// The cache slot of each sequence.
    pub slot: Buf<i32>,
    /// Committed positions of each sequence.
    pub prefix_len: Buf<i32>,
    /// This step's nodes of each sequence.
    pub n_nodes: Buf<i32>,
}

/// Per-row metadata of [`rope_kv_write`] (`[rows]` i32 each).
#[derive(Debug, Clone, Copy)]
pub struct RowBufs {
    /// Cache slot of the row's sequence (negative for a padded row).
    pub slot: Buf<i32>,
    /// RoPE position.
    pub pos: Buf<i32>,
    /// Cache position the row's K/V go to.
    pub dst: Buf<i32>,
}

/// What [`tree_accept`] reads (`[batch, n_max]` each, `n_nodes` `[batch]`).
#[derive(Debug, Clone, Copy)]
pub struct AcceptInBufs {
    /// Parent of every node.
    pub parent: Buf<i32>,
    /// Drafted token of every node.
    pub draft_tok: Buf<i32>,
    /// The target's token at every node.
    pub target_tok: Buf<i32>,
    /// Its log-probability.
    pub target_lp: Buf<f32>,
    /// The largest probability of the node's distribution.
    pub target_pmax: Buf<f32>,
    /// Nodes of each tree.
    pub n_nodes: Buf<i32>,
}

/// What [`tree_accept`] writes (`[batch, n_max]` each, `n_acc` `[batch]`).
#[derive(Debug, Clone, Copy)]
pub struct AcceptOutBufs {
    /// Accepted nodes.
    pub path: Buf<i32>,
    /// Accepted nodes per sequence.
    pub n_acc: Buf<i32>,
    /// Committed tokens.
    pub tokens: Buf<i32>,
    /// Their log-probabilities.
    pub logprobs: Buf<f32>,
    /// The largest probability at each committed position.
    pub pmax: Buf<f32>,
}

/// One source of [`concat_rows`]: `[rows, width]` f32 or bf16.
#[derive(Debug, Clone, Copy)]
pub enum RowBuf {
    /// f32 rows of this width.
    F32(Buf<f32>, usize),
    /// bf16 rows of this width.
    Bf16(Buf<bf16>, usize),
}

impl RowBuf {
    fn width(&self) -> usize {
        match *self {
            Self::F32(_, w) | Self::Bf16(_, w) => w,
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::F32(b, _) => b.len(),
            Self::Bf16(b, _) => b.len(),
        }
    }

    /// The kernel's (f32 pointer, bf16 pointer) pair for this source.
    fn args(src: Option<Self>) -> [Arg; 2] {
        match src {
            Some(Self::F32(b, _)) => [b.arg(), null()],
            Some(Self::Bf16(b, _)) => [null(), b.arg()],
            None => [null(), null()],
        }
    }
}

/// Threads per block of the attention-side kernels.
const ATT_BLOCK: u32 = 128;

/// RoPE at each row's position on `q` (in place) and on `k`, and the write of the rotated `k` and of `v` into
/// layer `layer` of the caches at each row's slot and position (`rope_kv_write_bf16`).
///
/// `q`: `[rows, n_heads, head_dim]`, `k`, `v`: `[rows, n_kv_heads, head_dim]` (bf16 bits); `inv_freq`:
/// `[head_dim / 2]`.
///
/// # Errors
/// [`Error::ShapeMismatch`] / [`Error::InvalidArgument`] for buffers that disagree with the shapes.
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_write(
    cache: CacheDims,
    layer: usize,
    rows: usize,
    q: Buf<bf16>,
    k: Buf<bf16>,
    v: Buf<bf16>,
    k_cache: Buf<bf16>,
    v_cache: Buf<bf16>,
    meta: RowBufs,
    inv_freq: Buf<f64>,
) -> Result<Launch> {
    cache.check()?;
    let a = cache.attn;
    if layer >= cache.layers || rows == 0 {
        return Err(Error::InvalidArgument(format!("layer {layer} of {} with {rows} rows", cache.layers)));
    }
    check_len("q", rows * a.n_heads * a.head_dim, q.len())?;
    check_len("k", rows * cache.row(), k.len())?;
    check_len("v", rows * cache.row(), v.len())?;
    check_len("k_cache", cache.len(), k_cache.len())?;
    check_len("v_cache", cache.len(), v_cache.len())?;
    for (what, m) in [("row slot", meta.slot), ("row pos", meta.pos), ("row dst", meta.dst)] {
        check_len(what, rows, m.len())?;
    }
    check_len("inv_freq", a.head_dim / 2, inv_freq.len())?;
    let span = layer * cache.layer_len()..(layer + 1) * cache.layer_len();
    let args = vec![
        q.arg(),
        k.arg(),
        v.arg(),
        k_cache.slice(span.clone())?.arg(),
        v_cache.slice(span)?.arg(),
        meta.slot.arg(),
        meta.pos.arg(),
        meta.dst.arg(),
        inv_freq.arg(),
        i32_arg("rows", rows)?,
        i32_arg("n_heads", a.n_heads)?,
        i32_arg("n_kv_heads", a.n_kv_heads)?,
        i32_arg("head_dim", a.head_dim)?,
        i32_arg("max_len", cache.max_len)?,
    ];
    Ok(Launch::new("rope_kv_write_bf16", [dim("rows", rows)?, 1, 1], ATT_BLOCK, args))
}

/// The largest `q_dim + kv_dim` of [`qkv_rope_kv_write`] (`QKV_MAX_QK`: the row's q and k staged in 40 KiB of shared
/// memory).
pub const MAX_QK_WIDTH: usize = 10_240;

/// The epilogue of the fused q/k/v projection (`qkv_rope_kv_write_bf16`): for every row of `qkv` (`[rows, q_dim + 2
/// kv_dim]`, one GEMM's output), the bias added (Qwen2), every head's q and k RMS-normalised with `qk_norm` (Qwen3),
/// RoPE at the row's position on q (into `q_out`, `[rows, n_heads, head_dim]`) and on k, and k and v written into
/// layer `layer` of the caches, as [`rope_kv_write`] does.
///
/// # Errors
/// As [`rope_kv_write`]; also for `q_dim + kv_dim` above [`MAX_QK_WIDTH`] or a bias or norm of the wrong length.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_kv_write(
    cache: CacheDims,
    layer: usize,
    rows: usize,
    qkv: Buf<bf16>,
    bias: Option<Buf<bf16>>,
    qk_norm: Option<(Buf<bf16>, Buf<bf16>)>,
    q_out: Buf<bf16>,
    k_cache: Buf<bf16>,
    v_cache: Buf<bf16>,
    meta: RowBufs,
    inv_freq: Buf<f64>,
    eps: f32,
) -> Result<Launch> {
    cache.check()?;
    let a = cache.attn;
    if layer >= cache.layers || rows == 0 {
        return Err(Error::InvalidArgument(format!("layer {layer} of {} with {rows} rows", cache.layers)));
    }
    let (qd, kvd) = (a.n_heads * a.head_dim, cache.row());
    if qd + kvd > MAX_QK_WIDTH {
        return Err(Error::InvalidArgument(format!("q_dim + kv_dim = {} exceeds {MAX_QK_WIDTH}", qd + kvd)));
    }
    check_len("qkv", rows * (qd + 2 * kvd), qkv.len())?;
    if let Some(b) = bias {
        check_len("qkv bias", qd + 2 * kvd, b.len())?;
    }
    if let Some((qn, kn)) = qk_norm {
        check_len("q norm", a.head_dim, qn.len())?;
        check_len("k norm", a.head_dim, kn.len())?;
    }
    check_len("q_out", rows * qd, q_out.len())?;
    check_len("k_cache", cache.len(), k_cache.len())?;
    check_len("v_cache", cache.len(), v_cache.len())?;
    for (what, m) in [("row slot", meta.slot), ("row pos", meta.pos), ("row dst", meta.dst)] {
        check_len(what, rows, m.len())?;
    }
    check_len("inv_freq", a.head_dim / 2, inv_freq.len())?;
    let span = layer * cache.layer_len()..(layer + 1) * cache.layer_len();
    let args = vec![
        qkv.arg(),
        bias.map_or_else(null, |b| b.arg()),
        qk_norm.map_or_else(null, |n| n.0.arg()),
        qk_norm.map_or_else(null, |n| n.1.arg()),
        q_out.arg(),
        k_cache.slice(span.clone())?.arg(),
        v_cache.slice(span)?.arg(),
        meta.slot.arg(),
        meta.pos.arg(),
        meta.dst.arg(),
        inv_freq.arg(),
        i32_arg("rows", rows)?,
        i32_arg("n_heads", a.n_heads)?,
        i32_arg("n_kv_heads", a.n_kv_heads)?,
        i32_arg("head_dim", a.head_dim)?,
        i32_arg("max_len", cache.max_len)?,
        Arg::F32(eps),
    ];
    Ok(Launch::new("qkv_rope_kv_write_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// Attention of each sequence's nodes over layer `layer` of the cache (`tree_attention_bf16`): `out =
/// softmax(q Kᵀ / sqrt(d)) V` over the committed prefix and the visible nodes (ancestors by `anc`, `[batch, n_max]`
/// ancestor bits as [`super::ancestor_masks`] makes them; `None`: causal among the nodes).
///
/// # Errors
/// As [`rope_kv_write`].
#[allow(clippy::too_many_arguments)]
pub fn tree_attention(
    cache: CacheDims,
    layer: usize,
    tree: TreeDims,
    q: Buf<bf16>,
    k_cache: Buf<bf16>,
    v_cache: Buf<bf16>,
    out: Buf<bf16>,
    seq: SeqBufs,
    anc: Option<Buf<u64>>,
) -> Result<Launch> {
    cache.check()?;
    tree.check(anc.is_some())?;
    let a = cache.attn;
    if layer >= cache.layers {
        return Err(Error::InvalidArgument(format!("layer {layer} of {}", cache.layers)));
    }
    let q_len = tree.nodes() * a.n_heads * a.head_dim;
    check_len("q", q_len, q.len())?;
    check_len("out", q_len, out.len())?;
    check_len("k_cache", cache.len(), k_cache.len())?;
    check_len("v_cache", cache.len(), v_cache.len())?;
    for (what, m) in [("seq slot", seq.slot), ("prefix_len", seq.prefix_len), ("n_nodes", seq.n_nodes)] {
        check_len(what, tree.batch, m.len())?;
    }
    if let Some(m) = anc {
        check_len("ancestor masks", tree.nodes(), m.len())?;
    }
    let span = layer * cache.layer_len()..(layer + 1) * cache.layer_len();
    let args = vec![
        q.arg(),
        k_cache.slice(span.clone())?.arg(),
        v_cache.slice(span)?.arg(),
        out.arg(),
        seq.slot.arg(),
        seq.prefix_len.arg(),
        seq.n_nodes.arg(),
        anc.map_or_else(null, |m| m.arg()),
        i32_arg("n_max", tree.n_max)?,
        i32_arg("n_heads", a.n_heads)?,
        i32_arg("n_kv_heads", a.n_kv_heads)?,
        i32_arg("head_dim", a.head_dim)?,
        i32_arg("max_len", cache.max_len)?,
        Arg::F32(1.0 / (a.head_dim as f32).sqrt()),
    ];
    let grid = [dim("n_kv_heads", a.n_kv_heads)?, dim("n_max", tree.n_max)?, dim("batch", tree.batch)?];
    Ok(Launch::new("tree_attention_bf16", grid, ATT_BLOCK, args))
}

/// Keys a chunk of [`attention`] holds at least (4 tiles of 32).
pub const MIN_SPLIT_LEN: usize = 128;

/// How [`attention`] cuts each node's keys: `n_splits` chunks of `split_len` keys, one block per (KV head, chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunks {
    /// Keys per chunk (a multiple of 32).
    pub split_len: usize,
    /// Chunks, covering `max_len` keys.
    pub n_splits: usize,
}

impl Chunks {
    /// The chunking of a step shape: enough chunks that the grid holds about `target_blocks` blocks (twice the
    /// device's multiprocessors), none shorter than [`MIN_SPLIT_LEN`] keys; one chunk when the (KV head, node)
    /// blocks alone fill the device. Fixed per shape and `max_len`, so a captured graph replays it whatever the
    /// context lengths.
    #[must_use]
    pub fn for_shape(tree: TreeDims, n_kv_heads: usize, max_len: usize, target_blocks: usize) -> Self {
        let blocks = (n_kv_heads * tree.n_max * tree.batch).max(1);
        let want = target_blocks.div_ceil(blocks).max(1);
        let n = want.min(max_len.div_ceil(MIN_SPLIT_LEN)).max(1);
        let split_len = max_len.div_ceil(n).next_multiple_of(32);
        Self { split_len, n_splits: max_len.div_ceil(split_len).max(1) }
    }

    /// Elements of the partial buffers (`part_o`, `part_ml`) for `tree` with `n_heads` heads of `head_dim` (0 and 0
    /// with one chunk, which writes the output directly).
    #[must_use]
    pub fn part_lens(&self, tree: TreeDims, n_heads: usize, head_dim: usize) -> (usize, usize) {
        if self.n_splits == 1 {
            return (0, 0);
        }
        let parts = tree.nodes() * n_heads * self.n_splits;
        (parts * head_dim, parts * 2)
    }
}

/// Split-K attention (`attention_split_bf16`, then `attention_combine_bf16` when there is more than one chunk): the
/// same result as [`tree_attention`] with keys cut into [`Chunks`] across blocks, one warp per query head. `parts`:
/// the partial buffers of [`Chunks::part_lens`] (ignored with one chunk).
///
/// # Errors
/// As [`tree_attention`]; also for a `head_dim` that is not a multiple of 8 (16-byte loads) or partial buffers of
/// the wrong size.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    cache: CacheDims,
    layer: usize,
    tree: TreeDims,
    chunks: Chunks,
    q: Buf<bf16>,
    k_cache: Buf<bf16>,
    v_cache: Buf<bf16>,
    out: Buf<bf16>,
    seq: SeqBufs,
    anc: Option<Buf<u64>>,
    parts: Option<(Buf<f32>, Buf<f32>)>,
) -> Result<Vec<Launch>> {
    let mut one = tree_attention(cache, layer, tree, q, k_cache, v_cache, out, seq, anc)?;
    let a = cache.attn;
    if !a.head_dim.is_multiple_of(8) {
        return Err(Error::InvalidArgument(format!("split attention needs head_dim % 8 == 0, got {}", a.head_dim)));
    }
    if chunks.split_len == 0
        || !chunks.split_len.is_multiple_of(32)
        || chunks.n_splits * chunks.split_len < cache.max_len
    {
        return Err(Error::InvalidArgument(format!("chunks {chunks:?} do not cover {} keys", cache.max_len)));
    }
    let (po_len, pml_len) = chunks.part_lens(tree, a.n_heads, a.head_dim);
    let (part_o, part_ml) = match (chunks.n_splits, parts) {
        (1, _) => (null(), null()),
        (_, Some((o, ml))) => {
            check_len("part_o", po_len, o.len())?;
            check_len("part_ml", pml_len, ml.len())?;
            (o.arg(), ml.arg())
        }
        (_, None) => {
            return Err(Error::InvalidArgument("split attention over several chunks needs partial buffers".into()))
        }
    };
    // tree_attention's arguments: q, k, v, out, slot, prefix, nodes, anc, n_max, heads, kv, hd, max_len, scale.
    let scale = one.args.pop().ok_or_else(|| Error::InvalidArgument("attention plan".into()))?;
    let mut args = one.args[..3].to_vec();
    args.push(if chunks.n_splits == 1 { out.arg() } else { null() });
    args.extend([part_o, part_ml]);
    args.extend_from_slice(&one.args[4..]);
    args.extend([i32_arg("split_len", chunks.split_len)?, i32_arg("n_splits", chunks.n_splits)?, scale]);
    let group = a.n_heads / a.n_kv_heads;
    let grid = [dim("n_kv_heads x chunks", a.n_kv_heads * chunks.n_splits)?, one.grid[1], one.grid[2]];
    let mut launches = vec![Launch::new("attention_split_bf16", grid, (group * 32) as u32, args)];
    if chunks.n_splits > 1 {
        let args = vec![
            part_o,
            part_ml,
            out.arg(),
            seq.n_nodes.arg(),
            i32_arg("n_max", tree.n_max)?,
            i32_arg("n_heads", a.n_heads)?,
            i32_arg("head_dim", a.head_dim)?,
            i32_arg("n_splits", chunks.n_splits)?,
        ];
        let grid = [dim("n_heads", a.n_heads)?, one.grid[1], one.grid[2]];
        launches.push(Launch::new("attention_combine_bf16", grid, 128, args));
    }
    Ok(launches)
}

/// Moves the accepted path's K/V rows of every layer behind each sequence's committed prefix
/// (`commit_path_bf16`; `path`: `[batch, max_path]` node indices from the root, increasing; `n_acc`: `[batch]`).
///
/// # Errors
/// As [`rope_kv_write`].
#[allow(clippy::too_many_arguments)]
pub fn commit_path(
    cache: CacheDims,
    batch: usize,
    max_path: usize,
    k_cache: Buf<bf16>,
    v_cache: Buf<bf16>,
    seq: SeqBufs,
    path: Buf<i32>,
    n_acc: Buf<i32>,
) -> Result<Launch> {
    cache.check()?;
    TreeDims { batch, n_max: max_path }.check(false)?;
    check_len("k_cache", cache.len(), k_cache.len())?;
    check_len("v_cache", cache.len(), v_cache.len())?;
    check_len("seq slot", batch, seq.slot.len())?;
    check_len("prefix_len", batch, seq.prefix_len.len())?;
    check_len("path", batch * max_path, path.len())?;
    check_len("n_acc", batch, n_acc.len())?;
    let args = vec![
        k_cache.arg(),
        v_cache.arg(),
        seq.slot.arg(),
        seq.prefix_len.arg(),
        path.arg(),
        n_acc.arg(),
        i32_arg("max_path", max_path)?,
        i32_arg("slots", cache.slots)?,
        i32_arg("max_len", cache.max_len)?,
        i32_arg("row", cache.row())?,
    ];
    Ok(Launch::new("commit_path_bf16", [dim("batch", batch)?, dim("layers", cache.layers)?, 1], ATT_BLOCK, args))
}

/// Packs the hidden rows of the accepted nodes (`gather_path_rows_bf16`): `dst[b][kk] = src[b][path[b][kk]]` for
/// `kk < n_acc[b]` (`src`: `[batch, n_max, width]`, `dst`: `[batch, max_path, width]`).
///
/// # Errors
/// As [`rope_kv_write`].
#[allow(clippy::too_many_arguments)]
pub fn gather_path_rows(
    tree: TreeDims,
    max_path: usize,
    width: usize,
    src: Buf<bf16>,
    dst: Buf<bf16>,
    path: Buf<i32>,
    n_acc: Buf<i32>,
) -> Result<Launch> {
    tree.check(false)?;
    check_len("src", tree.nodes() * width, src.len())?;
    check_len("dst", tree.batch * max_path * width, dst.len())?;
    check_len("path", tree.batch * max_path, path.len())?;
    check_len("n_acc", tree.batch, n_acc.len())?;
    let args = vec![
        src.arg(),
        dst.arg(),
        path.arg(),
        n_acc.arg(),
        i32_arg("n_max", tree.n_max)?,
        i32_arg("max_path", max_path)?,
        i32_arg("width", width)?,
    ];
    let grid = [dim("max_path", max_path)?, dim("batch", tree.batch)?, 1];
    Ok(Launch::new("gather_path_rows_bf16", grid, ATT_BLOCK, args))
}

/// The target's token at every row of `logits` (`sample_rows_f32`; `[rows, vocab]` f32): the argmax at
/// `temperature == 0` (then `coins` must be `None`, and log-probs are at temperature 1), else the inverse-CDF draw
/// of `softmax(logits / temperature)` with `coins[row]` in `[0, 1)`; with its log-probability and the
/// distribution's largest probability.
///
/// # Errors
/// [`Error::InvalidArgument`] for a negative or non-finite temperature, or coins given at temperature 0 or missing
/// above it; otherwise as [`rope_kv_write`].
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    rows: usize,
    vocab: usize,
    temperature: f32,
    logits: Buf<f32>,
    coins: Option<Buf<f64>>,
    tokens: Buf<i32>,
    logprobs: Buf<f32>,
    pmax: Buf<f32>,
) -> Result<Launch> {
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(Error::InvalidArgument(format!("temperature {temperature}")));
    }
    if (temperature == 0.0) != coins.is_none() {
        return Err(Error::InvalidArgument(
            "coins are needed exactly when sampling (temperature > 0); greedy takes none".into(),
        ));
    }
    if rows == 0 || vocab == 0 {
        return Err(Error::InvalidArgument(format!("{rows} rows of vocabulary {vocab}")));
    }
    check_len("logits", rows * vocab, logits.len())?;
    if let Some(c) = coins {
        check_len("coins", rows, c.len())?;
    }
    check_len("tokens", rows, tokens.len())?;
    check_len("logprobs", rows, logprobs.len())?;
    check_len("pmax", rows, pmax.len())?;
    let inv_temp = if temperature == 0.0 { 1.0f32 } else { 1.0 / temperature };
    let args = vec![
        logits.arg(),
        coins.map_or_else(null, |c| c.arg()),
        tokens.arg(),
        logprobs.arg(),
        pmax.arg(),
        i32_arg("rows", rows)?,
        i32_arg("vocab", vocab)?,
        Arg::F32(inv_temp),
    ];
    Ok(Launch::new("sample_rows_f32", [dim("rows", rows)?, 1, 1], 256, args))
}

/// Walks each sequence's draft tree with the target's tokens (`tree_accept`; from [`sample_rows`] over the tree's
/// rows) and writes the accepted path and committed tokens. Every array is `[batch, n_max]` except `n_nodes` and
/// `n_acc` (`[batch]`).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn tree_accept(tree: TreeDims, i: AcceptInBufs, o: AcceptOutBufs) -> Result<Launch> {
    tree.check(false)?;
    let n = tree.nodes();
    for (what, len) in [
        ("parent", i.parent.len()),
        ("draft tokens", i.draft_tok.len()),
        ("target tokens", i.target_tok.len()),
        ("target log-probs", i.target_lp.len()),
        ("target p_max", i.target_pmax.len()),
        ("path", o.path.len()),
        ("committed tokens", o.tokens.len()),
        ("committed log-probs", o.logprobs.len()),
        ("committed p_max", o.pmax.len()),
    ] {
        check_len(what, n, len)?;
    }
    check_len("n_nodes", tree.batch, i.n_nodes.len())?;
    check_len("n_acc", tree.batch, o.n_acc.len())?;
    let args = vec![
        i.parent.arg(),
        i.draft_tok.arg(),
        i.target_tok.arg(),
        i.target_lp.arg(),
        i.target_pmax.arg(),
        i.n_nodes.arg(),
        o.path.arg(),
        o.n_acc.arg(),
        o.tokens.arg(),
        o.logprobs.arg(),
        o.pmax.arg(),
        i32_arg("batch", tree.batch)?,
        i32_arg("n_max", tree.n_max)?,
    ];
    Ok(Launch::new("tree_accept", [dim("batch", tree.batch.div_ceil(128))?, 1, 1], 128, args))
}

/// `x[r] = table[tokens[r]]` (`embed_rows_bf16`; bf16 rows to the f32 residual stream); `table`: `[vocab,
/// width]`. Token ids are the caller's to keep below `vocab`.
///
/// # Errors
/// As [`rope_kv_write`].
pub fn embed_rows(rows: usize, width: usize, table: Buf<bf16>, tokens: Buf<i32>, x: Buf<f32>) -> Result<Launch> {
    if width == 0 || !table.len().is_multiple_of(width) {
        return Err(Error::InvalidArgument(format!("embedding table of {} for width {width}", table.len())));
    }
    check_len("tokens", rows, tokens.len())?;
    check_len("x", rows * width, x.len())?;
    let args = vec![table.arg(), tokens.arg(), x.arg(), i32_arg("rows", rows)?, i32_arg("width", width)?];
    Ok(Launch::new("embed_rows_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// `out = rmsnorm(x) * w` per row (`rms_norm_bf16`; `x` f32 `[rows, width]`, `w` bf16 `[width]`, `out` bf16).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn rms_norm(rows: usize, width: usize, eps: f32, x: Buf<f32>, w: Buf<bf16>, out: Buf<bf16>) -> Result<Launch> {
    check_len("x", rows * width, x.len())?;
    check_len("norm weight", width, w.len())?;
    check_len("out", rows * width, out.len())?;
    let args = vec![x.arg(), w.arg(), out.arg(), i32_arg("rows", rows)?, i32_arg("width", width)?, Arg::F32(eps)];
    Ok(Launch::new("rms_norm_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// `x += y`, then `out = rmsnorm(x) * w` per row (`add_rms_norm_bf16`: the residual add fused with the next norm;
/// `x` f32 `[rows, width]`, `y` bf16, `w` bf16 `[width]`, `out` bf16).
///
/// # Errors
/// As [`rope_kv_write`].
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    rows: usize,
    width: usize,
    eps: f32,
    x: Buf<f32>,
    y: Buf<bf16>,
    w: Buf<bf16>,
    out: Buf<bf16>,
) -> Result<Launch> {
    check_len("x", rows * width, x.len())?;
    check_len("y", rows * width, y.len())?;
    check_len("norm weight", width, w.len())?;
    check_len("out", rows * width, out.len())?;
    let args =
        vec![x.arg(), y.arg(), w.arg(), out.arg(), i32_arg("rows", rows)?, i32_arg("width", width)?, Arg::F32(eps)];
    Ok(Launch::new("add_rms_norm_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// `out[r] = silu(gu[r, ..inter]) * gu[r, inter..]` (`silu_mul_packed_bf16`) over the packed gate/up rows of one
/// GEMM (`gu`: `[rows, 2 * inter]`, `out`: `[rows, inter]`, bf16).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn silu_mul_packed(rows: usize, inter: usize, gu: Buf<bf16>, out: Buf<bf16>) -> Result<Launch> {
    check_len("gate/up", rows * 2 * inter, gu.len())?;
    check_len("out", rows * inter, out.len())?;
    let args = vec![gu.arg(), out.arg(), i32_arg("rows", rows)?, i32_arg("intermediate", inter)?];
    Ok(Launch::new("silu_mul_packed_bf16", stride_grid(rows * inter), 256, args))
}

/// Qwen3's q/k norms (`head_rms_norm_bf16`): every `head_dim`-wide vector of `x` (bf16 `[vectors, head_dim]`, in
/// place) becomes `rmsnorm(x) * w` (`w` bf16 `[head_dim]`). `None` when `x` is empty (nothing to launch).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn head_rms_norm(head_dim: usize, eps: f32, x: Buf<bf16>, w: Buf<bf16>) -> Result<Option<Launch>> {
    check_len("norm weight", head_dim, w.len())?;
    if head_dim == 0 || !x.len().is_multiple_of(head_dim) {
        return Err(Error::InvalidArgument(format!("{} elements are not vectors of {head_dim}", x.len())));
    }
    let vectors = x.len() / head_dim;
    if vectors == 0 {
        return Ok(None);
    }
    let per_block = 256 / 32;
    let args = vec![x.arg(), w.arg(), i32_arg("vectors", vectors)?, i32_arg("head_dim", head_dim)?, Arg::F32(eps)];
    Ok(Some(Launch::new("head_rms_norm_bf16", [dim("blocks", vectors.div_ceil(per_block))?, 1, 1], 256, args)))
}

/// `x += y` (`add_bf16_to_f32`; the residual add; `x` f32, `y` bf16, same length).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn add_to_residual(x: Buf<f32>, y: Buf<bf16>) -> Result<Launch> {
    check_len("y", x.len(), y.len())?;
    Ok(Launch::new("add_bf16_to_f32", stride_grid(x.len()), 256, vec![x.arg(), y.arg(), Arg::U64(x.len() as u64)]))
}

/// `gate = silu(gate) * up` (`silu_mul_bf16`; bf16, same length).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn silu_mul(gate: Buf<bf16>, up: Buf<bf16>) -> Result<Launch> {
    check_len("up", gate.len(), up.len())?;
    let args = vec![gate.arg(), up.arg(), Arg::U64(gate.len() as u64)];
    Ok(Launch::new("silu_mul_bf16", stride_grid(gate.len()), 256, args))
}

/// `y[r] += bias` for every row of `y` (`bias_add_bf16`; `[rows, cols]`, bf16).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn bias_add(rows: usize, y: Buf<bf16>, bias: Buf<bf16>) -> Result<Launch> {
    let cols = bias.len();
    check_len("y", rows * cols, y.len())?;
    let args = vec![y.arg(), bias.arg(), i32_arg("rows", rows)?, i32_arg("cols", cols)?];
    Ok(Launch::new("bias_add_bf16", stride_grid(y.len()), 256, args))
}

/// Fills `out` with seeded uniform values in `[lo, hi)` (`fill_uniform_bf16`: a hash of the seed and the index,
/// the same on every device).
///
/// # Errors
/// [`Error::InvalidArgument`] for a non-finite or empty range.
pub fn fill_uniform(out: Buf<bf16>, seed: u64, lo: f32, hi: f32) -> Result<Launch> {
    if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
        return Err(Error::InvalidArgument(format!("uniform range [{lo}, {hi})")));
    }
    let args = vec![out.arg(), Arg::U64(out.len() as u64), Arg::U64(seed), Arg::F32(lo), Arg::F32(hi)];
    Ok(Launch::new("fill_uniform_bf16", stride_grid(out.len()), 256, args))
}

/// `out[r] = [a[r]; b[r]]` as bf16 (`concat_rows_bf16`; `out`: `[rows, wa + wb]`); without `b`, a conversion of
/// `a` to bf16.
///
/// # Errors
/// As [`rope_kv_write`].
pub fn concat_rows(rows: usize, a: RowBuf, b: Option<RowBuf>, out: Buf<bf16>) -> Result<Launch> {
    let (wa, wb) = (a.width(), b.map_or(0, |b| b.width()));
    if rows == 0 || wa == 0 {
        return Err(Error::InvalidArgument(format!("concat of {rows} rows of width {wa} + {wb}")));
    }
    check_len("first source", rows * wa, a.len())?;
    if let Some(b) = b {
        check_len("second source", rows * wb, b.len())?;
    }
    check_len("out", rows * (wa + wb), out.len())?;
    let mut args: Vec<Arg> = RowBuf::args(Some(a)).into_iter().chain(RowBuf::args(b)).collect();
    args.extend([out.arg(), i32_arg("rows", rows)?, i32_arg("width", wa)?, i32_arg("width", wb)?]);
    Ok(Launch::new("concat_rows_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// The `k` largest logits of every row of `logits` (`top_k_rows_f32`; `[rows, vocab]` f32), in decreasing order
/// (ties: smaller index first), and their log-probabilities under the row's softmax: `idx`, `logprob`: `[rows, k]`.
///
/// # Errors
/// [`Error::InvalidArgument`] for `k` outside `1..=min(vocab, MAX_TOP_K)`; otherwise as [`rope_kv_write`].
pub fn top_k_rows(
    rows: usize,
    vocab: usize,
    k: usize,
    logits: Buf<f32>,
    idx: Buf<i32>,
    logprob: Buf<f32>,
) -> Result<Launch> {
    if rows == 0 || k == 0 || k > vocab || k > MAX_TOP_K {
        return Err(Error::InvalidArgument(format!(
            "top-{k} of {rows} rows of {vocab} logits (k must be in 1..={MAX_TOP_K} and <= the vocabulary)"
        )));
    }
    check_len("logits", rows * vocab, logits.len())?;
    check_len("top-k indices", rows * k, idx.len())?;
    check_len("top-k log-probs", rows * k, logprob.len())?;
    let args = vec![
        logits.arg(),
        idx.arg(),
        logprob.arg(),
        i32_arg("rows", rows)?,
        i32_arg("vocab", vocab)?,
        i32_arg("k", k)?,
    ];
    Ok(Launch::new("top_k_rows_f32", [dim("rows", rows)?, 1, 1], 256, args))
}

/// The output of a [`gemm`]: bf16 or f32 elements.
#[derive(Debug, Clone, Copy)]
pub enum GemmY {
    /// bf16 output (rounded from the f32 accumulation).
    Bf16(Buf<bf16>),
    /// f32 output.
    F32(Buf<f32>),
}

impl GemmY {
    fn len(&self) -> usize {
        match self {
            Self::Bf16(b) => b.len(),
            Self::F32(b) => b.len(),
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Self::Bf16(b) => b.addr(),
            Self::F32(b) => b.addr(),
        }
    }
}

/// One `cublasGemmEx` call, column-major as cuBLAS reads it: `C (m x n) = op(A) (m x k) · op(B) (k x n)` with bf16
/// `A` and `B`, f32 compute, `alpha = 1`, `beta = 0`, and a bf16 or f32 `C`. `op(X)` is `X` or, with `trans_*`, its
/// transpose; column-major `X` of leading dimension `ld` holds element `(i, j)` at `i + j * ld`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmEx {
    /// `op(A) = Aᵀ`.
    pub trans_a: bool,
    /// `op(B) = Bᵀ`.
    pub trans_b: bool,
    /// Rows of `C`.
    pub m: i32,
    /// Columns of `C`.
    pub n: i32,
    /// The inner dimension.
    pub k: i32,
    /// `A`'s address.
    pub a: u64,
    /// `A`'s leading dimension.
    pub lda: i32,
    /// `B`'s address.
    pub b: u64,
    /// `B`'s leading dimension.
    pub ldb: i32,
    /// `C`'s address.
    pub c: u64,
    /// `C`'s leading dimension.
    pub ldc: i32,
    /// `C` is f32 (else bf16).
    pub c_f32: bool,
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` (row-major, the layout of the CPU [`crate::gemm`]) as the cuBLAS call computing it:
/// column-major `yᵀ (n x m) = op(w) · xᵀ`, where `w` read column-major with leading dimension `k` is `wᵀ` (`k x n`)
/// and so needs `op = T`, and `x` read that way is already `xᵀ` (`k x m`).
///
/// # Errors
/// [`Error::ShapeMismatch`] for buffers that disagree with the shapes, [`Error::InvalidArgument`] for sizes beyond
/// cuBLAS's `int`.
pub fn gemm(m: usize, n: usize, k: usize, x: Buf<bf16>, w: Buf<bf16>, y: GemmY) -> Result<GemmEx> {
    check_len("x", m * k, x.len())?;
    check_len("w", n * k, w.len())?;
    check_len("y", m * n, y.len())?;
    let (mi, ni, ki) = (int("m", m)?, int("n", n)?, int("k", k)?);
    Ok(GemmEx {
        trans_a: true,
        trans_b: false,
        m: ni,
        n: mi,
        k: ki,
        a: w.addr(),
        lda: ki,
        b: x.addr(),
        ldb: ki,
        c: y.addr(),
        ldc: ni,
        c_f32: matches!(y, GemmY::F32(_)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::AttnShape;

    #[test]
    fn buffer_slices_offset_by_whole_elements_and_are_checked() {
        let b: Buf<f32> = Buf::new(0x1000, 10);
        let s = b.slice(2..6).unwrap();
        assert_eq!((s.addr(), s.len()), (0x1008, 4));
        assert!(b.slice(5..11).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 6..5;
        assert!(b.slice(reversed).is_err());
        assert!(b.slice(10..10).unwrap().is_empty());
    }

    #[test]
    fn plans_check_lengths_and_compute_the_grid() {
        let cache = CacheDims { layers: 2, slots: 3, max_len: 16, attn: AttnShape::new(4, 2, 8) };
        let tree = TreeDims { batch: 3, n_max: 5 };
        let bf = |n| Buf::<bf16>::new(0x10_0000, n);
        let i = |n| Buf::<i32>::new(0x20_0000, n);
        let seq = SeqBufs { slot: i(3), prefix_len: i(3), n_nodes: i(3) };
        let q = bf(tree.nodes() * 4 * 8);
        let l = tree_attention(cache, 1, tree, q, bf(cache.len()), bf(cache.len()), q, seq, None).unwrap();
        assert_eq!((l.kernel, l.grid, l.block), ("tree_attention_bf16", [2, 5, 3], [128, 1, 1]));
        // The layer's slice of the cache starts one layer in (bf16: 2 bytes an element).
        assert_eq!(l.args[1], Arg::Ptr(0x10_0000 + 2 * cache.layer_len() as u64));
        assert_eq!(l.args[7], Arg::Ptr(0), "no masks: a null pointer");
        assert_eq!(l.args[13], Arg::F32(1.0 / 8f32.sqrt()));
        let e = tree_attention(cache, 1, tree, bf(7), bf(cache.len()), bf(cache.len()), q, seq, None).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { what: "q", .. }), "{e}");
        assert!(tree_attention(cache, 2, tree, q, bf(cache.len()), bf(cache.len()), q, seq, None).is_err());
        let f = Buf::<f32>::new(0x30_0000, 4 * 100);
        let s = sample_rows(4, 100, 0.7, f, Some(Buf::new(0x40_0000, 4)), i(4), Buf::new(0, 4), Buf::new(0, 4));
        assert_eq!(s.unwrap().args[7], Arg::F32(1.0 / 0.7));
        assert!(sample_rows(4, 100, 0.0, f, Some(Buf::new(0, 4)), i(4), Buf::new(0, 4), Buf::new(0, 4)).is_err());
        assert_eq!(add_to_residual(Buf::new(0, 300_000), bf(300_000)).unwrap().grid, [1172, 1, 1]);
        assert_eq!(add_to_residual(Buf::new(0, 100_000_000), bf(100_000_000)).unwrap().grid, [4096, 1, 1]);
        assert!(head_rms_norm(8, 1e-6, bf(0), bf(8)).unwrap().is_none());
        assert_eq!(head_rms_norm(8, 1e-6, bf(8 * 9), bf(8)).unwrap().unwrap().grid, [2, 1, 1]);
    }
}
