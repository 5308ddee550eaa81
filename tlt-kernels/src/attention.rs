//! Tree attention: softmax attention of `n` new query tokens over a committed KV prefix and over each other,
//! where each new token sees its ancestors in a token tree (speculative verification) or all earlier new tokens
//! (causal decode / prefill).
//!
//! The kernel is written once over [`Simd`] and runs flash-attention style: key rows are processed in tiles of
//! [`TILE`]; for each tile the scores of every query vector of a GQA group are computed, folded into a running
//! (online) softmax, and the tile's value rows are accumulated while they are hot in L1. Each key/value row thus
//! comes from memory once per kv head, for all query heads sharing it and all `n` query tokens. No
//! `[n, base + n]` mask is ever built: visibility among the new tokens comes from per-node ancestor bitsets of the
//! `n` new tokens (or from `r <= i` for causal attention).
//!
//! Position invariance: a token's output bits depend only on the key rows it sees, in its own order (the prefix,
//! then its ancestors by depth). Tiles start at multiples of `TILE` in that order, a tile's sums always run over
//! its `TILE` positions, and a row's score is reduced the same way wherever it sits; a tree node's rows past the
//! prefix's whole tiles are gathered into contiguous scratch. So a decode step, a prefill chunk's token and a verify
//! node at the same position give the same bits, whatever the round's base and the tree around them.

// Hot loops index fixed-size register arrays on purpose (closures would not inherit the target features).
#![allow(clippy::needless_range_loop)]

use std::cell::RefCell;
use std::ops::Range;

use crate::error::check_len;
use crate::simd::{Scalar, Simd};
use crate::{Error, Isa, Result};

/// Key rows per tile (a multiple of every ISA's lanes: a tile's sums are taken lane by lane over it whole).
const TILE: usize = 32;
const _: () = assert!(TILE.is_multiple_of(16));

/// Head layout of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (`n_heads` must be a multiple; `n_heads / n_kv_heads` query heads share each).
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl AttnShape {
    /// A shape with `n_heads` query heads, `n_kv_heads` key/value heads of `head_dim` elements each.
    pub const fn new(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        Self { n_heads, n_kv_heads, head_dim }
    }

    /// Checks that all sizes are non-zero, that `n_heads` is a multiple of `n_kv_heads` and that row widths fit
    /// in `usize`.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(format!("{m} (shape {self:?})")));
        if self.n_heads == 0 || self.n_kv_heads == 0 || self.head_dim == 0 {
            return bad("attention heads and head_dim must be non-zero");
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad("n_heads must be a multiple of n_kv_heads");
        }
        if self.n_heads.checked_mul(self.head_dim).is_none() {
            return bad("n_heads * head_dim overflows");
        }
        Ok(())
    }

    /// Query heads per key/value head (0 for an invalid shape with `n_kv_heads == 0`).
    pub fn group_size(&self) -> usize {
        self.n_heads.checked_div(self.n_kv_heads).unwrap_or(0)
    }

    /// Elements of one query or output row: `n_heads * head_dim` (saturating).
    pub fn q_width(&self) -> usize {
        self.n_heads.saturating_mul(self.head_dim)
    }

    /// Elements of one key or value row: `n_kv_heads * head_dim` (saturating).
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads.saturating_mul(self.head_dim)
    }
}

/// Which of the `n` new tokens each new token sees (besides the whole committed prefix, which all see).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visibility<'a> {
    /// New token `i` sees new tokens `0..=i` (plain decode, chunked prefill).
    Causal,
    /// A token tree: `parents[i]` is the index of token `i`'s parent among the new tokens (it must be `< i`), or
    /// `None` if its parent is the last committed token. Token `i` sees itself and its ancestors. The number of
    /// new tokens is `parents.len()`.
    Tree(&'a [Option<usize>]),
}

/// Tree attention with the best instruction set of this CPU: `out[i] = softmax(q_i · Kᵀ · scale, masked) · V` for
/// the `n` new query rows.
///
/// - `q`: `[n, n_heads * head_dim]` row-major;
/// - `keys`, `values`: `[base + n, n_kv_heads * head_dim]` row-major: the `base` committed rows, then the `n` new
///   rows (already written);
/// - `out`: `[n, n_heads * head_dim]`.
///
/// New token `i` attends to all `base` committed rows and to the new rows allowed by `vis`. Query head `h` uses
/// kv head `h / (n_heads / n_kv_heads)`. `n` is `parents.len()` for [`Visibility::Tree`] and
/// `q.len() / (n_heads * head_dim)` for [`Visibility::Causal`]; `n = 0` is a no-op.
///
/// # Errors
/// [`Error::InvalidArgument`] for an invalid [`AttnShape`], a non-finite `scale` or a parent index `>= i`;
/// [`Error::ShapeMismatch`] when a buffer length disagrees with the shapes.
///
/// ```
/// use tlt_kernels::{tree_attention, AttnShape, Visibility};
///
/// # fn main() -> tlt_kernels::Result<()> {
/// let shape = AttnShape::new(2, 1, 4);
/// let (base, n) = (3, 2);
/// let q = vec![0.1; n * 8];
/// let keys = vec![0.2; (base + n) * 4];
/// let values: Vec<f32> = (0..(base + n) * 4).map(|i| i as f32).collect();
/// let mut out = vec![0.0; n * 8];
/// // Token 1 is a sibling of token 0: both see only the prefix and themselves.
/// tree_attention(&q, &keys, &values, base, Visibility::Tree(&[None, None]), shape, 0.5, &mut out)?;
/// // All scores are equal, so token 0 averages value rows 0, 1, 2 and 3.
/// assert!((out[0] - (0.0 + 4.0 + 8.0 + 12.0) / 4.0).abs() < 1e-4);
/// # Ok(()) }
/// ```
#[allow(clippy::too_many_arguments)]
pub fn tree_attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    base: usize,
    vis: Visibility<'_>,
    shape: AttnShape,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    tree_attention_with(Isa::best(), q, keys, values, base, vis, shape, scale, out)
}

/// [`tree_attention`] on an explicit instruction set.
///
/// # Errors
/// As [`tree_attention`], plus [`Error::IsaUnavailable`] if this CPU lacks `isa`.
#[allow(clippy::too_many_arguments)]
pub fn tree_attention_with(
    isa: Isa,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    base: usize,
    vis: Visibility<'_>,
    shape: AttnShape,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    shape.validate()?;
    if !isa.is_available() {
        return Err(Error::IsaUnavailable(isa));
    }
    if !scale.is_finite() {
        return Err(Error::InvalidArgument(format!("attention scale must be finite, got {scale}")));
    }
    let (qw, kvw) = (shape.q_width(), shape.kv_width());
    let n = match vis {
        Visibility::Tree(parents) => parents.len(),
        Visibility::Causal => q.len() / qw,
    };
    let overflow = || Error::InvalidArgument("attention buffer sizes overflow usize".into());
    let q_len = n.checked_mul(qw).ok_or_else(overflow)?;
    let kv_len = base.checked_add(n).and_then(|r| r.checked_mul(kvw)).ok_or_else(overflow)?;
    check_len("q", q_len, q.len())?;
    check_len("keys", kv_len, keys.len())?;
    check_len("values", kv_len, values.len())?;
    check_len("out", q_len, out.len())?;
    let (anc, words) = match vis {
        Visibility::Causal => (Vec::new(), 0),
        Visibility::Tree(parents) => ancestors(parents)?,
    };
    if n == 0 {
        return Ok(());
    }
    let args = Args { q, k: keys, v: values, base, n, shape, scale, anc: &anc, words };
    let f: KernelFn = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => attend_avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => attend_avx2,
        _ => attend_scalar,
    };
    // Query heads are independent (each has its own softmax state), so contiguous ranges of them run on the
    // kernels' team; every head's result is the same whatever the split. Small calls stay on this thread.
    let work = n.saturating_mul(base + n).saturating_mul(qw);
    let parts = crate::default_threads().min(shape.n_heads).max(1);
    let parts = if work >= MIN_PARALLEL_WORK { parts } else { 1 };
    let out_ptr = SendPtr(out.as_mut_ptr());
    let run_heads = |heads: Range<usize>| {
        let mut scratch = SCRATCH.take();
        // SAFETY: all lengths were checked above, parents are < their child, and `isa` is available; concurrent
        // calls write the disjoint output columns of their heads.
        unsafe { f(&args, out_ptr, heads, &mut scratch) };
        SCRATCH.set(scratch);
    };
    let part = |t: usize| run_heads((t * shape.n_heads / parts)..((t + 1) * shape.n_heads / parts));
    if !crate::team::Team::global().is_some_and(|team| team.run(parts, &part)) {
        run_heads(0..shape.n_heads);
    }
    Ok(())
}

/// Score-times-value multiply-adds below which one call stays on the calling thread.
const MIN_PARALLEL_WORK: usize = 1 << 15;

/// The output pointer shared by the parts of one call.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the parts of one call write disjoint head columns of the output while the caller waits.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Per-node ancestor-or-self bitsets over the `n` new tokens: `words` u64 per node.
fn ancestors(parents: &[Option<usize>]) -> Result<(Vec<u64>, usize)> {
    let n = parents.len();
    let words = n.div_ceil(64);
    let mut anc = vec![0u64; n * words];
    for (i, p) in parents.iter().enumerate() {
        if let Some(p) = *p {
            if p >= i {
                return Err(Error::InvalidArgument(format!(
                    "tree parent of token {i} is {p}; parents must precede their children"
                )));
            }
            anc.copy_within(p * words..(p + 1) * words, i * words);
        }
        anc[i * words + i / 64] |= 1u64 << (i % 64);
    }
    Ok((anc, words))
}

/// `exp(x)` for `x <= 88` to about 2e-7 relative error, exactly 0 below -87.3 (so `exp(-inf) = 0`). Branch-free
/// so loops over it vectorise.
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer kept in the low mantissa bits.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = x.clamp(-87.3, 88.0);
    let t = xc * LOG2E + MAGIC;
    let nf = t - MAGIC;
    let r = xc - nf * LN2_HI - nf * LN2_LO;
    // Taylor series of degree 7 on |r| <= ln2 / 2.
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let pow2 = f32::from_bits((ni.wrapping_add(127) << 23) as u32);
    if x < -87.3 {
        0.0
    } else {
        p * pow2
    }
}

/// Validated arguments of one call.
struct Args<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    base: usize,
    n: usize,
    shape: AttnShape,
    scale: f32,
    /// Ancestor bitsets (`words` per new token); empty for causal attention.
    anc: &'a [u64],
    words: usize,
}

/// Per-thread working memory, reused across calls.
#[derive(Default)]
struct Scratch {
    /// Scaled queries of one GQA group, `[n * group, head_dim]`.
    qs: Vec<f32>,
    /// Un-normalised outputs, `[n * group, head_dim]`.
    acc: Vec<f32>,
    /// Running max and running sum of each query vector.
    m: Vec<f32>,
    l: Vec<f32>,
    /// Scores then probabilities of one tile, `[n * group, TILE]`.
    s: Vec<f32>,
    /// Whether a query vector sees any row of the current tile.
    live: Vec<bool>,
    /// One tree token's gathered key and value rows of one kv head, `[rows, head_dim]` each.
    gk: Vec<f32>,
    gv: Vec<f32>,
}

/// Key and value rows of one kv head: row `r`'s elements start `r * stride` after `k` and `v`.
#[derive(Clone, Copy)]
struct Kv {
    k: *const f32,
    v: *const f32,
    stride: usize,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Raw views of the scratch buffers.
#[derive(Clone, Copy)]
struct Buf {
    qs: *mut f32,
    acc: *mut f32,
    m: *mut f32,
    l: *mut f32,
    s: *mut f32,
    live: *mut bool,
    /// Query heads of the current group handled by this call (query vectors are `token * gh + head`).
    gh: usize,
}

type KernelFn = unsafe fn(&Args<'_>, SendPtr, Range<usize>, &mut Scratch);

unsafe fn attend_scalar(a: &Args<'_>, out: SendPtr, heads: Range<usize>, sc: &mut Scratch) {
    unsafe { attend::<Scalar>(a, out, heads, sc) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(a: &Args<'_>, out: SendPtr, heads: Range<usize>, sc: &mut Scratch) {
    unsafe { attend::<crate::simd::Avx2>(a, out, heads, sc) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn attend_avx512(a: &Args<'_>, out: SendPtr, heads: Range<usize>, sc: &mut Scratch) {
    unsafe { attend::<crate::simd::Avx512>(a, out, heads, sc) }
}

/// The attention of query heads `heads`, one kv head (GQA group) at a time.
///
/// # Safety
/// `a` was validated by [`tree_attention_with`]; `out` holds `a.n * n_heads * head_dim` f32 of which this call
/// writes only the columns of `heads`; the CPU supports `S`.
#[inline(always)]
unsafe fn attend<S: Simd>(a: &Args<'_>, out: SendPtr, heads: Range<usize>, sc: &mut Scratch) {
    unsafe {
        let AttnShape { n_heads: h, n_kv_heads: kvh, head_dim: d } = a.shape;
        let gq = h / kvh;
        let qw = h * d;
        let (qp, op) = (a.q.as_ptr(), out.0);
        for g in 0..kvh {
            // The heads of this group in `heads`: group-relative `h0..h0 + gh`.
            let lo = heads.start.max(g * gq);
            let hi = heads.end.min((g + 1) * gq);
            if lo >= hi {
                continue;
            }
            let (h0, gh) = (lo - g * gq, hi - lo);
            let nq = a.n * gh;
            sc.qs.resize(nq * d, 0.0);
            sc.acc.resize(nq * d, 0.0);
            sc.m.resize(nq, 0.0);
            sc.l.resize(nq, 0.0);
            sc.s.resize(nq * TILE, 0.0);
            sc.live.resize(nq, false);
            let b = Buf {
                qs: sc.qs.as_mut_ptr(),
                acc: sc.acc.as_mut_ptr(),
                m: sc.m.as_mut_ptr(),
                l: sc.l.as_mut_ptr(),
                s: sc.s.as_mut_ptr(),
                live: sc.live.as_mut_ptr(),
                gh,
            };
            // Query vector j = i * gh + hh is token i, head g * gq + h0 + hh; pre-scaled.
            for j in 0..nq {
                let src = qp.add((j / gh) * qw + (g * gq + h0 + j % gh) * d);
                let dst = b.qs.add(j * d);
                for e in 0..d {
                    *dst.add(e) = *src.add(e) * a.scale;
                }
                *b.m.add(j) = f32::NEG_INFINITY;
                *b.l.add(j) = 0.0;
            }
            for e in 0..nq * d {
                *b.acc.add(e) = 0.0;
            }
            let kvw = kvh * d;
            let cache = Kv { k: a.k.as_ptr().add(g * d), v: a.v.as_ptr().add(g * d), stride: kvw };
            // Tiles start at multiples of TILE in every query's own key order (its logical positions: the
            // prefix, then its visible new rows), so a row's result is the same bits whatever the base and the
            // tree around it (decode, prefill chunk, verify node). Whole prefix tiles serve every query at once.
            let whole = a.base / TILE * TILE;
            let mut r0 = 0;
            while r0 < whole {
                tile::<S>(a, b, cache, r0..r0 + TILE, 0..nq, false);
                r0 += TILE;
            }
            if a.words == 0 {
                // Causal: logical positions are the rows; the new rows only concern tokens at or after them.
                let end = a.base + a.n;
                while r0 < end {
                    let r1 = (r0 + TILE).min(end);
                    tile::<S>(a, b, cache, r0..r1, r0.saturating_sub(a.base) * gh..nq, true);
                    r0 = r1;
                }
            } else {
                // A tree: each token's key order is the prefix's last partial tile, then its ancestors by depth,
                // gathered into contiguous rows for its query heads.
                for i in 0..a.n {
                    sc.gk.clear();
                    sc.gv.clear();
                    let mut push = |row: usize| {
                        let (kr, vr) = (cache.k.add(row * kvw), cache.v.add(row * kvw));
                        sc.gk.extend_from_slice(std::slice::from_raw_parts(kr, d));
                        sc.gv.extend_from_slice(std::slice::from_raw_parts(vr, d));
                    };
                    (whole..a.base).for_each(&mut push);
                    for x in 0..=i {
                        if (*a.anc.get_unchecked(i * a.words + x / 64) >> (x % 64)) & 1 == 1 {
                            push(a.base + x);
                        }
                    }
                    let len = sc.gk.len() / d;
                    let tail = Kv { k: sc.gk.as_ptr(), v: sc.gv.as_ptr(), stride: d };
                    let mut t0 = 0;
                    while t0 < len {
                        let t1 = (t0 + TILE).min(len);
                        tile::<S>(a, b, tail, t0..t1, i * gh..(i + 1) * gh, false);
                        t0 = t1;
                    }
                }
            }
            for j in 0..nq {
                let dst = op.add((j / gh) * qw + (g * gq + h0 + j % gh) * d);
                let src = b.acc.add(j * d);
                // Every token sees itself, so l > 0.
                let inv = 1.0 / *b.l.add(j);
                for e in 0..d {
                    *dst.add(e) = *src.add(e) * inv;
                }
            }
        }
    }
}

/// Dot products of `q` with the four key rows `k`, each of `d` elements.
#[inline(always)]
unsafe fn dots4<S: Simd>(q: *const f32, k: [*const f32; 4], d: usize) -> [f32; 4] {
    unsafe {
        let mut acc = [S::zero(); 4];
        let mut e = 0;
        while e + S::LANES <= d {
            let qv = S::load(q.add(e));
            for x in 0..4 {
                acc[x] = S::fma(qv, S::load(k[x].add(e)), acc[x]);
            }
            e += S::LANES;
        }
        // Each row reduced as `dot1` reduces it, so a row's score does not depend on its place in the tile.
        let mut out = [S::reduce_add(acc[0]), S::reduce_add(acc[1]), S::reduce_add(acc[2]), S::reduce_add(acc[3])];
        for x in 0..4 {
            for t in e..d {
                out[x] += *q.add(t) * *k[x].add(t);
            }
        }
        out
    }
}

/// Dot product of `q` with the key row `k` of `d` elements.
#[inline(always)]
unsafe fn dot1<S: Simd>(q: *const f32, k: *const f32, d: usize) -> f32 {
    unsafe {
        let mut acc = S::zero();
        let mut e = 0;
        while e + S::LANES <= d {
            acc = S::fma(S::load(q.add(e)), S::load(k.add(e)), acc);
            e += S::LANES;
        }
        let mut s = S::reduce_add(acc);
        for t in e..d {
            s += *q.add(t) * *k.add(t);
        }
        s
    }
}

/// Processes key/value rows `rows` of `kv` (`rows.len() <= TILE`, `rows.start` a multiple of `TILE` in the key
/// order of every query vector of `js`) for those query vectors: scores, the causal mask when `causal` (rows are
/// then the cache's, new token `i` seeing rows `< base + i + 1`), online softmax update and value accumulation.
/// Every sum is taken over the tile's positions as if it were full (missing rows add nothing), so a query's
/// result depends only on its own visible rows in order.
///
/// # Safety
/// As [`attend`]; `kv` points at this group's rows, at least `rows.end` of them.
#[inline(always)]
unsafe fn tile<S: Simd>(a: &Args<'_>, b: Buf, kv: Kv, rows: Range<usize>, js: Range<usize>, causal: bool) {
    unsafe {
        let d = a.shape.head_dim;
        let gq = b.gh;
        let t = rows.len();
        let lanes = S::LANES;
        let (kp, vp, kvw) = (kv.k, kv.v, kv.stride);

        // 1. Scores, four key rows at a time (each the same bits as alone).
        for j in js.clone() {
            let qj = b.qs.add(j * d);
            let srow = b.s.add(j * TILE);
            let mut tt = 0;
            while tt + 4 <= t {
                let mut ks = [kp; 4];
                for x in 0..4 {
                    ks[x] = kp.add((rows.start + tt + x) * kvw);
                }
                let s4 = dots4::<S>(qj, ks, d);
                for x in 0..4 {
                    *srow.add(tt + x) = s4[x];
                }
                tt += 4;
            }
            while tt < t {
                *srow.add(tt) = dot1::<S>(qj, kp.add((rows.start + tt) * kvw), d);
                tt += 1;
            }
        }

        // 2. Mask the new rows a token does not see yet.
        if causal && rows.end > a.base {
            for j in js.clone() {
                let last = a.base + j / gq;
                let srow = b.s.add(j * TILE);
                for tt in last.saturating_sub(rows.start) + 1..t {
                    *srow.add(tt) = f32::NEG_INFINITY;
                }
            }
        }

        // 3. Online softmax: rescale the running state to the new max, turn scores into probabilities.
        for j in js.clone() {
            let srow = b.s.add(j * TILE);
            let mut mv = S::splat(f32::NEG_INFINITY);
            let mut tt = 0;
            while tt + lanes <= t {
                mv = S::max(mv, S::load(srow.add(tt)));
                tt += lanes;
            }
            let mut mx = S::reduce_max(mv);
            for x in tt..t {
                mx = mx.max(*srow.add(x));
            }
            if mx == f32::NEG_INFINITY {
                *b.live.add(j) = false;
                continue;
            }
            *b.live.add(j) = true;
            let m_old = *b.m.add(j);
            let m_new = m_old.max(mx);
            for x in 0..t {
                *srow.add(x) = exp_approx(*srow.add(x) - m_new);
            }
            // The full tile's lanes, the missing rows as zeros: the sum's order is fixed by positions alone.
            for x in t..TILE {
                *srow.add(x) = 0.0;
            }
            let mut sv = S::zero();
            tt = 0;
            while tt < TILE {
                sv = S::add(sv, S::load(srow.add(tt)));
                tt += lanes;
            }
            let sum = S::reduce_add(sv);
            let corr = exp_approx(m_old - m_new);
            *b.l.add(j) = *b.l.add(j) * corr + sum;
            *b.m.add(j) = m_new;
            if corr != 1.0 {
                let accj = b.acc.add(j * d);
                for e in 0..d {
                    *accj.add(e) *= corr;
                }
            }
        }

        // 4. acc_j += P_j · V_tile, four vectors of head_dim at a time held in registers.
        let vrow0 = vp.add(rows.start * kvw);
        for j in js {
            if !*b.live.add(j) {
                continue;
            }
            let prow = b.s.add(j * TILE);
            let accj = b.acc.add(j * d);
            let mut c = 0;
            while c + 4 * lanes <= d {
                // Even and odd rows in separate accumulators: eight independent FMA chains.
                let mut acc = [S::zero(); 4];
                let mut acc2 = [S::zero(); 4];
                for x in 0..4 {
                    acc[x] = S::load(accj.add(c + x * lanes));
                }
                let mut tt = 0;
                while tt + 2 <= t {
                    let (p0, p1) = (S::splat(*prow.add(tt)), S::splat(*prow.add(tt + 1)));
                    let vr = vrow0.add(tt * kvw + c);
                    for x in 0..4 {
                        acc[x] = S::fma(p0, S::load(vr.add(x * lanes)), acc[x]);
                        acc2[x] = S::fma(p1, S::load(vr.add(kvw + x * lanes)), acc2[x]);
                    }
                    tt += 2;
                }
                if tt < t {
                    let p0 = S::splat(*prow.add(tt));
                    let vr = vrow0.add(tt * kvw + c);
                    for x in 0..4 {
                        acc[x] = S::fma(p0, S::load(vr.add(x * lanes)), acc[x]);
                    }
                }
                for x in 0..4 {
                    S::store(accj.add(c + x * lanes), S::add(acc[x], acc2[x]));
                }
                c += 4 * lanes;
            }
            while c + lanes <= d {
                let mut acc = S::load(accj.add(c));
                for tt in 0..t {
                    acc = S::fma(S::splat(*prow.add(tt)), S::load(vrow0.add(tt * kvw + c)), acc);
                }
                S::store(accj.add(c), acc);
                c += lanes;
            }
            if c < d {
                for tt in 0..t {
                    let p = *prow.add(tt);
                    let vr = vrow0.add(tt * kvw);
                    for e in c..d {
                        *accj.add(e) += p * *vr.add(e);
                    }
                }
            }
        }
    }
}
