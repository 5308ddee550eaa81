//! The kernels loaded on a CUDA device, with launches that check every buffer against the shapes first.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use half::bf16;

use super::shapes::{CacheDims, TreeDims};
use super::{compile, SOURCES};
use crate::error::{check_len, Error, Result};

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

pub(super) fn dim(what: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} = {v} does not fit a launch dimension")))
}

pub(super) fn int(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} = {v} does not fit an i32 kernel argument")))
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

    /// RoPE at each row's position on `q` (in place) and on `k`, and the write of the rotated `k` and of `v` into
    /// layer `layer` of the caches at each row's slot and position.
    ///
    /// `q`: `[rows, n_heads, head_dim]`, `k`, `v`: `[rows, n_kv_heads, head_dim]` (bf16 bits); `inv_freq`:
    /// `[head_dim / 2]`.
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
        let mut kc = k_cache.slice_mut(span.clone());
        let mut vc = v_cache.slice_mut(span);
        let (rows_i, heads, kv, hd, max_len) = (
            int("rows", rows)?,
            int("n_heads", a.n_heads)?,
            int("n_kv_heads", a.n_kv_heads)?,
            int("head_dim", a.head_dim)?,
            int("max_len", cache.max_len)?,
        );
        let cfg = LaunchConfig { grid_dim: (dim("rows", rows)?, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let f = self.function("rope_kv_write_bf16")?;
        let mut b = stream.launch_builder(f);
        b.arg(q).arg(k).arg(v).arg(&mut kc).arg(&mut vc).arg(meta.slot).arg(meta.pos).arg(meta.dst).arg(inv_freq);
        b.arg(&rows_i).arg(&heads).arg(&kv).arg(&hd).arg(&max_len);
        // SAFETY: the argument list matches the kernel's signature, every buffer was checked against the shapes the
        // kernel indexes with, and cache positions outside `max_len` are skipped by the kernel.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch rope_kv_write_bf16"))
    }

    /// Attention of each sequence's nodes over layer `layer` of the cache: `out = softmax(q Kᵀ / sqrt(d)) V` over
    /// the committed prefix and the visible nodes (ancestors by `anc`, `[batch, n_max]` ancestor bits as
    /// [`super::ancestor_masks`] makes them; `None`: causal among the nodes).
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
        let (kc, vc) = (k_cache.slice(span.clone()), v_cache.slice(span));
        let (n_max, heads, kv, hd, max_len) = (
            int("n_max", tree.n_max)?,
            int("n_heads", a.n_heads)?,
            int("n_kv_heads", a.n_kv_heads)?,
            int("head_dim", a.head_dim)?,
            int("max_len", cache.max_len)?,
        );
        let scale = 1.0 / (a.head_dim as f32).sqrt();
        let null: u64 = 0;
        let cfg = LaunchConfig {
            grid_dim: (dim("n_kv_heads", a.n_kv_heads)?, dim("n_max", tree.n_max)?, dim("batch", tree.batch)?),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function("tree_attention_bf16")?;
        let mut b = stream.launch_builder(f);
        b.arg(q).arg(&kc).arg(&vc).arg(out).arg(seq.slot).arg(seq.prefix_len).arg(seq.n_nodes);
        match anc {
            Some(m) => b.arg(m),
            None => b.arg(&null),
        };
        b.arg(&n_max).arg(&heads).arg(&kv).arg(&hd).arg(&max_len).arg(&scale);
        // SAFETY: the arguments match the kernel's signature (a null `anc` is a zero device pointer) and every
        // buffer was checked against the shapes; the kernel reads keys only below prefix_len + n_nodes, which the
        // caller keeps within max_len (the step planner's invariant).
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch tree_attention_bf16"))
    }

    /// Moves the accepted path's K/V rows of every layer behind each sequence's committed prefix (`path`:
    /// `[batch, max_path]` node indices from the root, increasing; `n_acc`: `[batch]`).
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
        cache.check()?;
        TreeDims { batch, n_max: max_path }.check(false)?;
        check_len("k_cache", cache.len(), k_cache.len())?;
        check_len("v_cache", cache.len(), v_cache.len())?;
        check_len("seq slot", batch, seq.slot.len())?;
        check_len("prefix_len", batch, seq.prefix_len.len())?;
        check_len("path", batch * max_path, path.len())?;
        check_len("n_acc", batch, n_acc.len())?;
        let (mp, slots, max_len, row) = (
            int("max_path", max_path)?,
            int("slots", cache.slots)?,
            int("max_len", cache.max_len)?,
            int("row", cache.row())?,
        );
        let cfg = LaunchConfig {
            grid_dim: (dim("batch", batch)?, dim("layers", cache.layers)?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function("commit_path_bf16")?;
        let mut b = stream.launch_builder(f);
        b.arg(k_cache).arg(v_cache).arg(seq.slot).arg(seq.prefix_len).arg(path).arg(n_acc);
        b.arg(&mp).arg(&slots).arg(&max_len).arg(&row);
        // SAFETY: arguments match the signature; buffers checked; the kernel stops at rows beyond max_len.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch commit_path_bf16"))
    }

    /// Packs the hidden rows of the accepted nodes: `dst[b][kk] = src[b][path[b][kk]]` for `kk < n_acc[b]`
    /// (`src`: `[batch, n_max, width]`, `dst`: `[batch, max_path, width]`).
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
        tree.check(false)?;
        check_len("src", tree.nodes() * width, src.len())?;
        check_len("dst", tree.batch * max_path * width, dst.len())?;
        check_len("path", tree.batch * max_path, path.len())?;
        check_len("n_acc", tree.batch, n_acc.len())?;
        let (n_max, mp, w) = (int("n_max", tree.n_max)?, int("max_path", max_path)?, int("width", width)?);
        let cfg = LaunchConfig {
            grid_dim: (dim("max_path", max_path)?, dim("batch", tree.batch)?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function("gather_path_rows_bf16")?;
        let mut b = stream.launch_builder(f);
        b.arg(src).arg(dst).arg(path).arg(n_acc).arg(&n_max).arg(&mp).arg(&w);
        // SAFETY: arguments match the signature; buffers checked; the kernel skips node indices outside n_max.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch gather_path_rows_bf16"))
    }

    /// The target's token at every row of `logits` (`[rows, vocab]` f32): the argmax at `temperature == 0` (then
    /// `coins` must be `None`, and log-probs are at temperature 1), else the inverse-CDF draw of
    /// `softmax(logits / temperature)` with `coins[row]` in `[0, 1)`; with its log-probability and the
    /// distribution's largest probability. Top-k and top-p are not implemented on the device.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a negative or non-finite temperature, or coins given at temperature 0 or
    /// missing above it; otherwise as [`CudaKernels::rope_kv_write`].
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
        let (rows_i, v) = (int("rows", rows)?, int("vocab", vocab)?);
        let inv_temp = if temperature == 0.0 { 1.0f32 } else { 1.0 / temperature };
        let null: u64 = 0;
        let cfg = LaunchConfig { grid_dim: (dim("rows", rows)?, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let f = self.function("sample_rows_f32")?;
        let mut b = stream.launch_builder(f);
        b.arg(logits);
        match coins {
            Some(c) => b.arg(c),
            None => b.arg(&null),
        };
        b.arg(tokens).arg(logprobs).arg(pmax).arg(&rows_i).arg(&v).arg(&inv_temp);
        // SAFETY: arguments match the signature (a null `coins` is a zero device pointer); buffers checked.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch sample_rows_f32"))
    }

    /// Walks each sequence's draft tree with the target's tokens (from [`CudaKernels::sample_rows`] over the tree's
    /// rows) and writes the accepted path and committed tokens ([`AcceptOut`]). Every array is `[batch, n_max]`
    /// except `n_nodes` and `n_acc` (`[batch]`); node 0 is the root and every other node's parent precedes it.
    ///
    /// # Errors
    /// As [`CudaKernels::rope_kv_write`].
    pub fn tree_accept(&self, stream: &CudaStream, tree: TreeDims, i: AcceptIn<'_>, o: AcceptOut<'_>) -> Result<()> {
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
        let (batch, n_max) = (int("batch", tree.batch)?, int("n_max", tree.n_max)?);
        let cfg = LaunchConfig {
            grid_dim: (dim("batch", tree.batch.div_ceil(128))?, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function("tree_accept")?;
        let mut b = stream.launch_builder(f);
        b.arg(i.parent).arg(i.draft_tok).arg(i.target_tok).arg(i.target_lp).arg(i.target_pmax).arg(i.n_nodes);
        b.arg(o.path).arg(o.n_acc).arg(o.tokens).arg(o.logprobs).arg(o.pmax).arg(&batch).arg(&n_max);
        // SAFETY: arguments match the signature; buffers checked; the kernel clamps n_nodes to n_max.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch tree_accept"))
    }
}
