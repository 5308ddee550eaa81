//! Plans of the attention kernels: RoPE and the cache write, tree and split (flash-decoding) attention, commits
//! and row gathers along accepted paths.

use super::*;
use crate::attention::AttnShape;

/// Threads per block of the attention-side kernels.
const ATT_BLOCK: u32 = 128;

/// The checks and arguments both RoPE + cache-write kernels share: the layer and its cache spans, the rows'
/// metadata, the RoPE frequencies, then `rows, n_heads, n_kv_heads, head_dim, max_len`.
fn cache_write_args(
    cache: CacheDims,
    layer: usize,
    rows: usize,
    k_cache: Buf<bf16>,
    v_cache: Buf<bf16>,
    meta: RowBufs,
    inv_freq: Buf<f64>,
) -> Result<Vec<Arg>> {
    cache.check()?;
    let a = cache.attn;
    if layer >= cache.layers || rows == 0 {
        return Err(Error::InvalidArgument(format!("layer {layer} of {} with {rows} rows", cache.layers)));
    }
    check_len("k_cache", cache.len(), k_cache.len())?;
    check_len("v_cache", cache.len(), v_cache.len())?;
    for (what, m) in [("row slot", meta.slot), ("row pos", meta.pos), ("row dst", meta.dst)] {
        check_len(what, rows, m.len())?;
    }
    check_len("inv_freq", a.head_dim / 2, inv_freq.len())?;
    let span = layer * cache.layer_len()..(layer + 1) * cache.layer_len();
    Ok(vec![
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
    ])
}

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
    let tail = cache_write_args(cache, layer, rows, k_cache, v_cache, meta, inv_freq)?;
    let a = cache.attn;
    check_len("q", rows * a.n_heads * a.head_dim, q.len())?;
    check_len("k", rows * cache.row(), k.len())?;
    check_len("v", rows * cache.row(), v.len())?;
    let args: Vec<Arg> = [q.arg(), k.arg(), v.arg()].into_iter().chain(tail).collect();
    Ok(Launch::new("rope_kv_write_bf16", [dim("rows", rows)?, 1, 1], ATT_BLOCK, args))
}

/// The largest grid y (and z) of a CUDA launch.
pub const MAX_GRID_Y: u32 = 65_535;

/// The largest head dim of [`qkv_rope_kv_write`] (one thread per RoPE pair, at most 128 a block).
pub const MAX_QKV_HEAD_DIM: usize = 256;

/// The epilogue of the fused q/k/v projection (`qkv_rope_kv_write_bf16`, one block per head vector of a row): for
/// every row of `qkv` (`[rows, q_dim + 2 kv_dim]`, one GEMM's output), the bias added (Qwen2), every head's q and k
/// RMS-normalised with `qk_norm` (Qwen3), RoPE at the row's position on q (into `q_out`, `[rows, n_heads,
/// head_dim]`) and on k, and k and v written into layer `layer` of the caches, as [`rope_kv_write`] does.
///
/// # Errors
/// As [`rope_kv_write`]; also for a head dim above [`MAX_QKV_HEAD_DIM`], a bias or norm of the wrong length, or more
/// head vectors than [`MAX_GRID_Y`] (rows go in grid.x, any count a launch takes).
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
    let tail = cache_write_args(cache, layer, rows, k_cache, v_cache, meta, inv_freq)?;
    let a = cache.attn;
    let (qd, kvd) = (a.n_heads * a.head_dim, cache.row());
    if a.head_dim > MAX_QKV_HEAD_DIM {
        return Err(Error::InvalidArgument(format!("head_dim {} exceeds {MAX_QKV_HEAD_DIM}", a.head_dim)));
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
    let head = [
        qkv.arg(),
        bias.map_or_else(null, |b| b.arg()),
        qk_norm.map_or_else(null, |n| n.0.arg()),
        qk_norm.map_or_else(null, |n| n.1.arg()),
        q_out.arg(),
    ];
    let args: Vec<Arg> = head.into_iter().chain(tail).chain([Arg::F32(eps)]).collect();
    let vectors = dim("head vectors", a.n_heads + 2 * a.n_kv_heads)?;
    let block = (a.head_dim / 2).next_multiple_of(32) as u32;
    // Rows in grid.x (up to 2^31 - 1), head vectors in grid.y: a grid's y is at most 65,535, a prefill's rows are not.
    if vectors > MAX_GRID_Y {
        return Err(Error::InvalidArgument(format!("{vectors} head vectors exceed a grid's y limit of {MAX_GRID_Y}")));
    }
    Ok(Launch::new("qkv_rope_kv_write_bf16", [dim("rows", rows)?, vectors, 1], block, args))
}

/// Attention of each sequence's nodes over layer `layer` of the cache (`tree_attention_bf16`): `out =
/// softmax(q Kᵀ / sqrt(d)) V` over the committed prefix and the visible nodes (ancestors by `anc`, `[batch, n_max]`
/// ancestor bits as [`crate::cuda::ancestor_masks`] makes them; `None`: causal among the nodes).
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

/// The fewest keys per chunk [`Chunks::for_cache`] plans.
pub const MIN_SPLIT_LEN: usize = 128;

/// Chunk lengths are multiples of this: the split kernel's 4 warps take 16-key tiles in turn.
pub const CHUNK_ALIGN: usize = 64;

/// Resident blocks of [`attention`]'s kernel per multiprocessor where the device cannot say
/// ([`crate::cuda::GpuInfo::attention_blocks_per_sm`]): 2, the H100's and H200's (209 registers a thread, 128
/// threads a block, 64K registers an SM).
pub const ATTENTION_BLOCKS_PER_SM: usize = 2;

/// Query rows (node, head) of one block of [`attention`]'s tensor-core kernel: one `m16n8k16` row tile.
pub const MMA_ROWS: usize = 16;

/// Whether [`attention`] runs the split tensor-core kernel for `attn` (head dims a multiple of 16 up to 128, query
/// groups up to [`MMA_ROWS`]); other shapes run [`tree_attention`].
#[must_use]
pub fn splits_attention(attn: AttnShape) -> bool {
    let group = attn.n_heads / attn.n_kv_heads.max(1);
    attn.head_dim.is_multiple_of(16) && attn.head_dim <= 128 && (1..=MMA_ROWS).contains(&group)
}

/// Row tiles of [`attention`]'s kernel for `n_max` nodes of a query group of `group` heads: `MMA_ROWS / group`
/// consecutive nodes each.
#[must_use]
pub fn row_tiles(n_max: usize, group: usize) -> usize {
    n_max.div_ceil((MMA_ROWS / group.clamp(1, MMA_ROWS)).max(1)).max(1)
}

/// How [`attention`] cuts each row's keys: chunks of `chunk_len` keys along the row's logical key sequence (the
/// committed prefix, then a tree node's ancestors by depth and itself), at logical positions 0, `chunk_len`, ...,
/// combined in order; `n_splits` chunks cover `max_len`, one block per (KV head, chunk, row tile), blocks past a
/// row tile's keys returning at once. Fixed per cache and device, never per batch or tree: a decode row, the same
/// row beside 63 other sequences, and the verify node at the same depth sum the same keys in the same order, so
/// their outputs are the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunks {
    /// Chunks per (KV head, row tile, sequence): the grid's, `max_len.div_ceil(chunk_len)`.
    pub n_splits: usize,
    /// Keys per chunk (a multiple of 16).
    pub chunk_len: usize,
}

impl Chunks {
    /// The chunking of a cache of `max_len` positions on a device where `resident_blocks` blocks of the kernel run
    /// at once ([`crate::cuda::GpuInfo::target_blocks`]: resident blocks per SM x SMs): the shortest chunk, a
    /// multiple of [`CHUNK_ALIGN`] and at least [`MIN_SPLIT_LEN`], such that batch-1 decode over the whole cache
    /// (`n_kv_heads` blocks a chunk) fits one wave, `n_kv_heads * n_splits <= resident_blocks`. It depends on the
    /// cache and device alone, never on the batch or the tree, and is fixed per cache, so a captured graph replays
    /// it whatever the context lengths.
    #[must_use]
    pub fn for_cache(attn: AttnShape, max_len: usize, resident_blocks: usize) -> Self {
        let max_len = max_len.max(1);
        let chunks_per_wave = (resident_blocks / attn.n_kv_heads.max(1)).max(1);
        let chunk_len = max_len.div_ceil(chunks_per_wave).next_multiple_of(CHUNK_ALIGN).max(MIN_SPLIT_LEN);
        Self { n_splits: max_len.div_ceil(chunk_len), chunk_len }
    }

    /// [`Chunks::for_cache`] (the step shape `_tree` does not enter: kept for callers that name it).
    #[must_use]
    pub fn for_shape(_tree: TreeDims, attn: AttnShape, max_len: usize, resident_blocks: usize) -> Self {
        Self::for_cache(attn, max_len, resident_blocks)
    }

    /// The OLD, batch-dependent rule, for negative controls only: enough chunks that the grid holds about
    /// `target_blocks` blocks for `tree`'s batch, the keys cut into that many equal chunks. With it a row's output
    /// bits depend on the batch and tree beside it, which the batch-invariance tests must catch.
    #[doc(hidden)]
    #[must_use]
    pub fn batch_dependent(tree: TreeDims, attn: AttnShape, max_len: usize, target_blocks: usize) -> Self {
        let group = attn.n_heads / attn.n_kv_heads.max(1);
        let blocks = (attn.n_kv_heads * row_tiles(tree.n_max, group) * tree.batch).max(1);
        let want = target_blocks.div_ceil(blocks).max(1);
        let n_splits = want.min(max_len.div_ceil(MIN_SPLIT_LEN)).max(1);
        let chunk_len = max_len.max(1).div_ceil(n_splits).next_multiple_of(16);
        Self { n_splits: max_len.max(1).div_ceil(chunk_len), chunk_len }
    }

    /// Elements of the buffers of [`SplitParts`] for `tree` and `attn` (`[o, ml, arrivals]`; all 0 with one chunk,
    /// which writes the output directly). Fixed per shape: a captured graph keeps them.
    #[must_use]
    pub fn part_lens(&self, tree: TreeDims, attn: AttnShape) -> [usize; 3] {
        if self.n_splits == 1 {
            return [0; 3];
        }
        let parts = tree.nodes() * attn.n_heads * self.n_splits;
        let group = attn.n_heads / attn.n_kv_heads.max(1);
        [parts * attn.head_dim, parts * 2, tree.batch * row_tiles(tree.n_max, group) * attn.n_kv_heads]
    }
}

/// The scratch of [`attention`] over several chunks ([`Chunks::part_lens`]): each chunk's partial output (`o`, f32
/// `[batch, n_max, n_heads, n_splits, head_dim]`) and (max, sum) (`ml`), and one arrival counter per (sequence, row
/// tile, KV head) (`arrivals`): **zero before the first launch**; the kernel leaves them zero, so a captured graph
/// replays.
#[derive(Debug, Clone, Copy)]
pub struct SplitParts {
    /// Partial outputs.
    pub o: Buf<f32>,
    /// Partial (max, sum) pairs.
    pub ml: Buf<f32>,
    /// Arrival counters (zeroed once).
    pub arrivals: Buf<i32>,
}

/// Split-K attention on the tensor cores (`attention_split_bf16`, one launch: with several chunks the last block of
/// each to arrive combines them): the same result as [`tree_attention`] with each row's logical keys cut into
/// [`Chunks`] across blocks, each block serving 16 query rows (a KV head's whole query group, for as many nodes as
/// fit) so that a tree's nodes and a group's heads share every K/V read of the committed prefix; a row's output bits
/// do not depend on the batch or the tree around it (the keys past the prefix are read per node). `parts`: the
/// scratch of [`Chunks::part_lens`] (ignored with one chunk).
///
/// # Errors
/// As [`tree_attention`]; also for partial buffers of the wrong size or chunks that do not cover `max_len`. A shape the kernel does not take
/// ([`splits_attention`]: tiny test drafters have head_dim 4) plans [`tree_attention`] alone, whatever the chunks.
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
    parts: Option<SplitParts>,
) -> Result<Vec<Launch>> {
    let mut one = tree_attention(cache, layer, tree, q, k_cache, v_cache, out, seq, anc)?;
    let a = cache.attn;
    if !splits_attention(a) {
        // Before the first GPU run such drafters failed with "split attention needs head_dim % 8 == 0, got 4".
        return Ok(vec![one]);
    }
    if chunks.n_splits == 0
        || chunks.chunk_len == 0
        || !chunks.chunk_len.is_multiple_of(16)
        || chunks.n_splits * chunks.chunk_len < cache.max_len
    {
        return Err(Error::InvalidArgument(format!(
            "attention chunks {chunks:?} do not cover a cache of {} positions in 16-key tiles",
            cache.max_len
        )));
    }
    let lens = chunks.part_lens(tree, a);
    let (part_o, part_ml, arrivals) = match (chunks.n_splits, parts) {
        (1, _) => (null(), null(), null()),
        (_, Some(p)) => {
            check_len("part_o", lens[0], p.o.len())?;
            check_len("part_ml", lens[1], p.ml.len())?;
            check_len("arrivals", lens[2], p.arrivals.len())?;
            (p.o.arg(), p.ml.arg(), p.arrivals.arg())
        }
        (_, None) => {
            return Err(Error::InvalidArgument("split attention over several chunks needs partial buffers".into()))
        }
    };
    // tree_attention's arguments: q, k, v, out, slot, prefix, nodes, anc, n_max, heads, kv, hd, max_len, scale.
    let scale = one.args.pop().ok_or_else(|| Error::InvalidArgument("attention plan".into()))?;
    let group = a.n_heads / a.n_kv_heads;
    let tiles = row_tiles(tree.n_max, group);
    let mut args = one.args[..4].to_vec();
    args.extend([part_o, part_ml, arrivals]);
    args.extend_from_slice(&one.args[4..]);
    args.extend([
        i32_arg("n_splits", chunks.n_splits)?,
        i32_arg("chunk_len", chunks.chunk_len)?,
        i32_arg("row_tiles", tiles)?,
        scale,
    ]);
    let grid = [dim("row tiles x chunks x KV heads", tiles * chunks.n_splits * a.n_kv_heads)?, 1, one.grid[2]];
    Ok(vec![Launch::new("attention_split_bf16", grid, 128, args)])
}

/// `mma_bf16_probe`: `d = a b` on the tensor cores for one warp, `a` 16 x 16 and `b` 16 x 8 bf16 row-major, `d`
/// 16 x 8 f32 row-major: the fragment layout [`attention`] relies on, checked against a CPU product.
///
/// # Errors
/// [`Error::ShapeMismatch`] for buffers of other lengths.
pub fn mma_probe(a: Buf<bf16>, b: Buf<bf16>, d: Buf<f32>) -> Result<Launch> {
    check_len("a", 256, a.len())?;
    check_len("b", 128, b.len())?;
    check_len("d", 128, d.len())?;
    Ok(Launch::new("mma_bf16_probe", [1, 1, 1], 32, vec![a.arg(), b.arg(), d.arg()]))
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
