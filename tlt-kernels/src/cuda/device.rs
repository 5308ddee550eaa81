//! The kernels loaded on a CUDA device, with launches that check every buffer against the shapes first.

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

use super::plan::{self, AcceptInBufs, AcceptOutBufs, Arg, Buf, Launch, RowBufs, SeqBufs};
use super::shapes::{CacheDims, TreeDims};
use super::{compile, SOURCES};
use crate::error::{Error, Result};

/// Whether a CUDA driver library (`libcuda.so`) can be loaded. Never panics.
#[must_use]
pub fn driver_available() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and drops what it opened.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// For GPU test suites: `Ok(true)` when a CUDA driver can be loaded; otherwise prints why `test` is skipped and
/// returns `Ok(false)`, unless `TLT_REQUIRE_GPU=1` (set by `cargo xtask test-cuda --gpu`) makes a missing driver an
/// error.
///
/// # Errors
/// [`Error::CudaUnavailable`] when a GPU is required and no driver loads.
pub fn gpu_or_skip(test: &str) -> Result<bool> {
    if driver_available() {
        return Ok(true);
    }
    if std::env::var("TLT_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        return Err(Error::CudaUnavailable(format!("TLT_REQUIRE_GPU=1 but no CUDA driver loads (test {test})")));
    }
    eprintln!("SKIP {test}: no CUDA driver (run `cargo xtask test-cuda --gpu` on a GPU machine)");
    Ok(false)
}

pub(super) fn drv(op: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda { op, message: e.to_string() }
}

/// The per-sequence metadata of a step, in device buffers (`[batch]` i32 each), written by the host before the step
/// or a graph replay.
#[derive(Debug, Clone, Copy)]
pub struct SeqMeta<'a> {
    /// The cache slot of each sequence.
    pub slot: &'a CudaSlice<i32>,
    /// Committed positions of each sequence (its keys before this step's nodes).
    pub prefix_len: &'a CudaSlice<i32>,
    /// This step's nodes of each sequence (`<= n_max`).
    pub n_nodes: &'a CudaSlice<i32>,
}

/// Per-row metadata of [`CudaKernels::rope_kv_write`] (`[rows]` i32 each): cache slot (negative: padding), RoPE
/// position and cache position of every new token.
#[derive(Debug, Clone, Copy)]
pub struct RowMeta<'a> {
    /// Cache slot of the row's sequence (negative for a padded row).
    pub slot: &'a CudaSlice<i32>,
    /// RoPE position.
    pub pos: &'a CudaSlice<i32>,
    /// Cache position the row's K/V go to.
    pub dst: &'a CudaSlice<i32>,
}

/// What [`CudaKernels::tree_accept`] reads: the trees (`[batch, n_max]` parents, node 0's negative, and drafted
/// tokens), the target's token, log-prob and largest probability at every node (from [`CudaKernels::sample_rows`]),
/// and each tree's node count (`[batch]`).
#[derive(Debug, Clone, Copy)]
pub struct AcceptIn<'a> {
    /// Parent of every node (node 0: negative).
    pub parent: &'a CudaSlice<i32>,
    /// Drafted token of every node.
    pub draft_tok: &'a CudaSlice<i32>,
    /// The target's token at every node.
    pub target_tok: &'a CudaSlice<i32>,
    /// Its log-probability.
    pub target_lp: &'a CudaSlice<f32>,
    /// The largest probability of the node's distribution.
    pub target_pmax: &'a CudaSlice<f32>,
    /// Nodes of each tree.
    pub n_nodes: &'a CudaSlice<i32>,
}

/// What [`CudaKernels::tree_accept`] writes: per sequence the accepted nodes from the root (`path[b][..n_acc[b]]`,
/// `path[b][0] = 0`) and the committed tokens with their log-probs and the largest probability of the distribution
/// each was drawn from (`[batch, n_max]`, first `n_acc[b]` valid).
#[derive(Debug)]
pub struct AcceptOut<'a> {
    /// Accepted nodes.
    pub path: &'a mut CudaSlice<i32>,
    /// Accepted nodes per sequence (`[batch]`), root included.
    pub n_acc: &'a mut CudaSlice<i32>,
    /// Committed tokens.
    pub tokens: &'a mut CudaSlice<i32>,
    /// Their log-probabilities.
    pub logprobs: &'a mut CudaSlice<f32>,
    /// The largest probability at each committed position.
    pub pmax: &'a mut CudaSlice<f32>,
}

/// Our kernels compiled for one device (NVRTC, at its compute capability) and loaded there.
#[derive(Debug)]
pub struct CudaKernels {
    ctx: Arc<CudaContext>,
    arch: u32,
    functions: Vec<(&'static str, CudaFunction)>,
}

impl CudaKernels {
    /// Compiles and loads every kernel on device `ordinal`.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] when no driver or no NVRTC library loads (never panics), [`Error::Cuda`] when the
    /// device cannot be opened or a module not loaded, [`Error::CudaCompile`] when a source does not compile.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_available() {
            return Err(Error::CudaUnavailable("no CUDA driver: libcuda.so could not be loaded".into()));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| Error::CudaUnavailable("the CUDA driver library lacks a required symbol".into()))?
            .map_err(drv("cuCtxCreate"))?;
        keep_pool_memory(&ctx)?;
        let (major, minor) = ctx.compute_capability().map_err(drv("compute_capability"))?;
        let arch = u32::try_from(major * 10 + minor)
            .map_err(|_| Error::Cuda { op: "compute_capability", message: format!("{major}.{minor}") })?;
        let mut functions = Vec::new();
        for source in SOURCES {
            let compiled = compile(source, arch)?;
            let module = ctx.load_module(Ptx::from_binary(compiled.cubin)).map_err(drv("cuModuleLoadData"))?;
            for &name in source.kernels {
                functions.push((name, module.load_function(name).map_err(drv("cuModuleGetFunction"))?));
            }
        }
        Ok(Self { ctx, arch, functions })
    }

    /// The device context.
    #[must_use]
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The compute capability the kernels were compiled for (90 on an H100).
    #[must_use]
    pub fn arch(&self) -> u32 {
        self.arch
    }

    pub(super) fn function(&self, name: &'static str) -> Result<&CudaFunction> {
        self.functions
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| f)
            .ok_or_else(|| Error::InvalidArgument(format!("kernel `{name}` is not loaded")))
    }

    /// Runs `plan` on `stream`. The plan's buffers must be live device buffers used in `stream`'s order (the
    /// typed methods hold cudarc's guards until the launch is enqueued; a caller with event tracking off, as a step
    /// program's, needs none).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a kernel that is not loaded, [`Error::Cuda`] when the launch fails.
    pub fn run(&self, stream: &CudaStream, plan: &Launch) -> Result<()> {
        let f = self.function(plan.kernel)?;
        let mut b = stream.launch_builder(f);
        for a in &plan.args {
            match a {
                Arg::Ptr(p) | Arg::U64(p) => b.arg(p),
                Arg::I32(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
            };
        }
        let [gx, gy, gz] = plan.grid;
        let [bx, by, bz] = plan.block;
        let cfg = LaunchConfig { grid_dim: (gx, gy, gz), block_dim: (bx, by, bz), shared_mem_bytes: plan.shared_bytes };
        // SAFETY: every plan comes from `plan::*`, which checked each buffer's length against the shapes the kernel
        // indexes with and lists the arguments in the order and types of the kernel's signature (pointers as
        // 64-bit device addresses of live buffers, whose stream-ordering guards the caller holds until here).
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| Error::Cuda { op: plan.kernel, message: e.to_string() })
    }

    /// RoPE at each row's position on `q` (in place) and on `k`, and the write of the rotated `k` and of `v` into
    /// layer `layer` of the caches at each row's slot and position ([`plan::rope_kv_write`]).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] / [`Error::InvalidArgument`] for buffers that disagree with the shapes,
    /// [`Error::Cuda`] when the launch fails.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_write(
        &self,
        stream: &CudaStream,
        cache: CacheDims,
        layer: usize,
        rows: usize,
        q: &mut CudaSlice<bf16>,
        k: &CudaSlice<bf16>,
        v: &CudaSlice<bf16>,
        k_cache: &mut CudaSlice<bf16>,
        v_cache: &mut CudaSlice<bf16>,
        meta: RowMeta<'_>,
        inv_freq: &CudaSlice<f64>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let rows_meta = RowBufs { slot: p.r(meta.slot), pos: p.r(meta.pos), dst: p.r(meta.dst) };
        let (q, k, v, inv) = (p.w(q), p.r(k), p.r(v), p.r(inv_freq));
        let (kc, vc) = (p.w(k_cache), p.w(v_cache));
        self.run(stream, &plan::rope_kv_write(cache, layer, rows, q, k, v, kc, vc, rows_meta, inv)?)
    }

    /// Attention of each sequence's nodes over layer `layer` of the cache ([`plan::tree_attention`]).
    ///
    /// # Errors
    /// As [`CudaKernels::rope_kv_write`].
    #[allow(clippy::too_many_arguments)]
    pub fn tree_attention(
        &self,
        stream: &CudaStream,
        cache: CacheDims,
        layer: usize,
        tree: TreeDims,
        q: &CudaSlice<bf16>,
        k_cache: &CudaSlice<bf16>,
        v_cache: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        seq: SeqMeta<'_>,
        anc: Option<&CudaSlice<u64>>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let seq = p.seq(seq);
        let anc = anc.map(|m| p.r(m));
        let (q, kc, vc, out) = (p.r(q), p.r(k_cache), p.r(v_cache), p.w(out));
        self.run(stream, &plan::tree_attention(cache, layer, tree, q, kc, vc, out, seq, anc)?)
    }

    /// Moves the accepted path's K/V rows of every layer behind each sequence's committed prefix
    /// ([`plan::commit_path`]).
    ///
    /// # Errors
    /// As [`CudaKernels::rope_kv_write`].
    #[allow(clippy::too_many_arguments)]
    pub fn commit_path(
        &self,
        stream: &CudaStream,
        cache: CacheDims,
        batch: usize,
        max_path: usize,
        k_cache: &mut CudaSlice<bf16>,
        v_cache: &mut CudaSlice<bf16>,
        seq: SeqMeta<'_>,
        path: &CudaSlice<i32>,
        n_acc: &CudaSlice<i32>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let seq = p.seq(seq);
        let (kc, vc, path, n_acc) = (p.w(k_cache), p.w(v_cache), p.r(path), p.r(n_acc));
        self.run(stream, &plan::commit_path(cache, batch, max_path, kc, vc, seq, path, n_acc)?)
    }

    /// Packs the hidden rows of the accepted nodes ([`plan::gather_path_rows`]).
    ///
    /// # Errors
    /// As [`CudaKernels::rope_kv_write`].
    #[allow(clippy::too_many_arguments)]
    pub fn gather_path_rows(
        &self,
        stream: &CudaStream,
        tree: TreeDims,
        max_path: usize,
        width: usize,
        src: &CudaSlice<bf16>,
        dst: &mut CudaSlice<bf16>,
        path: &CudaSlice<i32>,
        n_acc: &CudaSlice<i32>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let (src, dst, path, n_acc) = (p.r(src), p.w(dst), p.r(path), p.r(n_acc));
        self.run(stream, &plan::gather_path_rows(tree, max_path, width, src, dst, path, n_acc)?)
    }

    /// The target's token at every row of `logits` ([`plan::sample_rows`]).
    ///
    /// # Errors
    /// As [`plan::sample_rows`], and [`Error::Cuda`] when the launch fails.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_rows(
        &self,
        stream: &CudaStream,
        rows: usize,
        vocab: usize,
        temperature: f32,
        logits: &CudaSlice<f32>,
        coins: Option<&CudaSlice<f64>>,
        tokens: &mut CudaSlice<i32>,
        logprobs: &mut CudaSlice<f32>,
        pmax: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let coins = coins.map(|c| p.r(c));
        let (logits, tokens, logprobs, pmax) = (p.r(logits), p.w(tokens), p.w(logprobs), p.w(pmax));
        self.run(stream, &plan::sample_rows(rows, vocab, temperature, logits, coins, tokens, logprobs, pmax)?)
    }

    /// Walks each sequence's draft tree with the target's tokens ([`plan::tree_accept`]).
    ///
    /// # Errors
    /// As [`CudaKernels::rope_kv_write`].
    pub fn tree_accept(&self, stream: &CudaStream, tree: TreeDims, i: AcceptIn<'_>, o: AcceptOut<'_>) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let inp = AcceptInBufs {
            parent: p.r(i.parent),
            draft_tok: p.r(i.draft_tok),
            target_tok: p.r(i.target_tok),
            target_lp: p.r(i.target_lp),
            target_pmax: p.r(i.target_pmax),
            n_nodes: p.r(i.n_nodes),
        };
        let out = AcceptOutBufs {
            path: p.w(o.path),
            n_acc: p.w(o.n_acc),
            tokens: p.w(o.tokens),
            logprobs: p.w(o.logprobs),
            pmax: p.w(o.pmax),
        };
        self.run(stream, &plan::tree_accept(tree, inp, out)?)
    }
}

/// Sets the release threshold of the device's default memory pool (the one cudarc's stream-ordered allocations
/// use) to "never": with the default of 0 the driver returns freed memory to the OS at every synchronisation (each
/// download), and the next allocation pays for it again.
/// Devices without memory pools (cudarc then allocates synchronously) are left alone.
fn keep_pool_memory(ctx: &CudaContext) -> Result<()> {
    let pools = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
        .map_err(drv("memory pools supported"))?;
    if pools == 0 {
        return Ok(());
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: `pool` receives the device's default pool handle; the attribute is a 64-bit value read from
    // `threshold`, which outlives the call. The context is current on this thread (cudarc binds it on creation).
    unsafe {
        ctx.bind_to_thread().map_err(drv("bind context"))?;
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(drv("cuDeviceGetDefaultMemPool"))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .map_err(drv("cuMemPoolSetAttribute"))?;
    }
    Ok(())
}

/// Device addresses of a launch's buffers, with cudarc's stream-ordering guards held until the launch is enqueued.
pub(super) struct Ptrs<'a> {
    stream: &'a CudaStream,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Ptrs<'a> {
    pub(super) fn new(stream: &'a CudaStream) -> Self {
        Self { stream, guards: Vec::new() }
    }

    /// A buffer the kernel reads.
    pub(super) fn r<T>(&mut self, s: &'a CudaSlice<T>) -> Buf<T> {
        let (ptr, guard) = s.device_ptr(self.stream);
        self.guards.push(guard);
        Buf::new(ptr, s.len())
    }

    /// A buffer the kernel writes.
    pub(super) fn w<T>(&mut self, s: &'a mut CudaSlice<T>) -> Buf<T> {
        let len = s.len();
        let (ptr, guard) = s.device_ptr_mut(self.stream);
        self.guards.push(guard);
        Buf::new(ptr, len)
    }

    fn seq(&mut self, m: SeqMeta<'a>) -> SeqBufs {
        SeqBufs { slot: self.r(m.slot), prefix_len: self.r(m.prefix_len), n_nodes: self.r(m.n_nodes) }
    }
}
