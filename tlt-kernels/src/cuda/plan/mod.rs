//! Launch plans: for every kernel of ours, the checks, the launch configuration and the argument list the host
//! computes, as plain data ([`Launch`]). A CUDA device (`CudaGpu`, feature `cuda`) and the CPU
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

mod attention;
mod draft_train;
mod gemm;
mod rows;
mod skinny;
mod train;
mod train_attention;

pub use attention::*;
pub use draft_train::*;
pub use gemm::*;
pub use rows::*;
pub use skinny::*;
pub use train::*;
pub use train_attention::*;

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
    fn attention_of_a_shape_the_tensor_cores_do_not_take_runs_the_tree_kernel() {
        // The tiny test drafters' heads (head_dim 4): the first GPU run failed them with "split attention needs
        // head_dim % 8 == 0, got 4"; now they (and head dims of 8) plan the
        // one-block-per-(head, node) kernel, whatever the chunks.
        let bf = |n| Buf::<bf16>::new(0x10_0000, n);
        let i = |n| Buf::<i32>::new(0x20_0000, n);
        let seq = SeqBufs { slot: i(2), prefix_len: i(2), n_nodes: i(2) };
        let tree = TreeDims { batch: 2, n_max: 3 };
        let parts =
            SplitParts { o: Buf::new(0x30_0000, 1 << 20), ml: Buf::new(0x40_0000, 1 << 20), arrivals: Buf::new(0, 4) };
        for attn in [AttnShape::new(4, 2, 4), AttnShape::new(4, 2, 8)] {
            let cache = CacheDims { layers: 1, slots: 2, max_len: 512, attn };
            let q = bf(tree.nodes() * attn.n_heads * attn.head_dim);
            let chunks = Chunks::for_cache(attn, 512, 264);
            assert!(chunks.n_splits > 1, "the case asks for several chunks");
            let l = attention(cache, 0, tree, chunks, q, bf(cache.len()), bf(cache.len()), q, seq, None, Some(parts));
            let kernels: Vec<&str> = l.unwrap().iter().map(|l| l.kernel).collect();
            assert_eq!(kernels, ["tree_attention_bf16"], "{attn:?}");
        }
        // Head dims of 16 take the tensor-core kernel: groups of 3 put 5 nodes in a 16-row tile (3 nodes: 1 tile).
        let attn = AttnShape::new(6, 2, 16);
        let cache = CacheDims { layers: 1, slots: 2, max_len: 512, attn };
        let q = bf(tree.nodes() * 6 * 16);
        let chunks = Chunks::for_cache(attn, 512, 264);
        let [po, pml, pa] = chunks.part_lens(tree, attn);
        assert_eq!(pa, 2 * 2, "a row tile per sequence and KV head");
        let parts = SplitParts { o: Buf::new(0x30_0000, po), ml: Buf::new(0x40_0000, pml), arrivals: Buf::new(0, pa) };
        let l = attention(cache, 0, tree, chunks, q, bf(cache.len()), bf(cache.len()), q, seq, None, Some(parts));
        let l = l.unwrap();
        assert_eq!(l.len(), 1, "the chunks combine inside the kernel");
        assert_eq!(l[0].kernel, "attention_split_bf16");
        assert_eq!(l[0].grid, [(2 * chunks.n_splits) as u32, 1, 2]);
        assert_eq!(row_tiles(8, 4), 2);
        assert_eq!(row_tiles(1, 8), 1);
        assert_eq!(row_tiles(64, 16), 64);
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
