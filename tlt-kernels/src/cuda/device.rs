//! [`Gpu`] on a CUDA device through cudarc (feature `cuda`): our kernels compiled by NVRTC for the device and
//! loaded there, cuBLAS for the GEMMs, one non-blocking stream for everything.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::gpu::{DeviceMem, Gpu, GpuEvent, GpuGraph, GpuInfo, PinnedMem};
use super::plan::{Arg, GemmEx, Launch};
use super::{compile_cached, SOURCES};
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

/// Bytes of the workspace cuBLAS gets: 32 MiB, NVIDIA's recommendation for Hopper (what
/// `CUBLAS_WORKSPACE_CONFIG=:4096:8` gives). GEMMs recorded into a CUDA graph then use memory that lives as long as
/// the handle instead of cuBLAS's own pool.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A captured graph. cudarc's graphs are not `Send` (the driver does not synchronise calls on one graph); a
/// [`GpuGraph`] is owned and used by one thread at a time.
struct SendGraph(CudaGraph);

// SAFETY: the graph is only ever used through `&GpuGraph` held by its one owner (a shape cache entry); calls on it
// are never concurrent.
unsafe impl Send for SendGraph {}

/// One CUDA device's stream with our kernels loaded and a cuBLAS handle on it: the [`Gpu`] of a real device.
///
/// Event tracking is off for the context: every buffer is used on the one stream, so stream order keeps it
/// correct, and CUDA graph capture cannot tolerate cudarc's per-buffer events. Host access to pinned memory follows
/// the seam's ordering rule ([`super::gpu`]).
#[derive(Debug)]
pub struct CudaGpu {
    // Fields drop in declaration order: the cuBLAS handle before its workspace, both before the stream.
    blas: CudaBlas,
    /// cuBLAS's workspace, kept alive as long as the handle that uses it.
    _workspace: CudaSlice<u8>,
    functions: Vec<(&'static str, CudaFunction)>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    info: GpuInfo,
}

impl CudaGpu {
    /// Opens device `ordinal`: compiles every kernel for its compute capability (NVRTC) and loads them, and makes a
    /// non-blocking stream and a cuBLAS handle on it.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] when no driver or no NVRTC library loads (never panics), [`Error::Cuda`] when the
    /// device cannot be opened or a module not loaded, [`Error::CudaCompile`] when a source does not compile.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        if !driver_available() {
            return Err(Error::CudaUnavailable("no CUDA driver: libcuda.so could not be loaded".into()));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| Error::CudaUnavailable("the CUDA driver library lacks a required symbol".into()))?
            .map_err(drv("cuCtxCreate"))?;
        keep_pool_memory(&ctx)?;
        // SAFETY: every buffer of this device object is used on its one stream only (see the type's docs).
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(drv("compute_capability"))?;
        let arch = u32::try_from(major * 10 + minor)
            .map_err(|_| Error::Cuda { op: "compute_capability", message: format!("{major}.{minor}") })?;
        let mut functions = Vec::new();
        for source in SOURCES {
            let compiled = compile_cached(source, arch)?;
            let module = ctx.load_module(Ptx::from_binary(compiled.cubin)).map_err(drv("cuModuleLoadData"))?;
            for &name in source.kernels {
                functions.push((name, module.load_function(name).map_err(drv("cuModuleGetFunction"))?));
            }
        }
        // Not the legacy default stream, which cannot be captured and is not ordered against non-blocking streams.
        let stream = ctx.new_stream().map_err(drv("new_stream"))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("multiprocessor count"))?;
        // The split attention kernel's real residency (registers and shared memory), the size of its waves.
        let attention_blocks_per_sm = functions
            .iter()
            .find(|(n, _)| *n == "attention_split_bf16")
            .and_then(|(_, f)| f.occupancy_max_active_blocks_per_multiprocessor(128, 0, None).ok())
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
            .unwrap_or(super::plan::ATTENTION_BLOCKS_PER_SM);
        let info = GpuInfo {
            name: ctx.name().unwrap_or_else(|_| format!("CUDA device {ordinal}")),
            arch,
            multiprocessors: usize::try_from(sms).unwrap_or(1).max(1),
            total_memory: ctx.total_mem().map_err(drv("total memory"))?,
            simulated: false,
            attention_blocks_per_sm,
        };
        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| Error::Cuda { op: "cublasCreate", message: format!("{e:?}") })?;
        let workspace = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES).map_err(drv("alloc cuBLAS workspace"))?;
        let (ws, _) = workspace.device_ptr(&stream);
        // SAFETY: the handle is live and bound to `stream` (cudarc set it at creation; nothing resets it later, which
        // would also reset the workspace); the workspace is a live device allocation of the stated size, owned next
        // to the handle and freed after it.
        let status = unsafe {
            blas_sys::cublasSetWorkspace_v2(*blas.handle(), ws as *mut std::ffi::c_void, CUBLAS_WORKSPACE_BYTES)
        };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(Error::Cuda { op: "cublasSetWorkspace", message: format!("{status:?}") });
        }
        Ok(Arc::new(Self { blas, _workspace: workspace, functions, stream, ctx, info }))
    }

    /// The stream every operation runs on.
    #[must_use]
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device context.
    #[must_use]
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn function(&self, name: &'static str) -> Result<&CudaFunction> {
        self.functions
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| f)
            .ok_or_else(|| Error::InvalidArgument(format!("kernel `{name}` is not loaded")))
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("bind context"))
    }
}

impl Gpu for CudaGpu {
    fn info(&self) -> &GpuInfo {
        &self.info
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceMem> {
        let s = self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(drv("alloc"))?;
        let (addr, _) = s.device_ptr(&self.stream);
        let n = s.len();
        Ok(DeviceMem::new(addr, n, Box::new(s)))
    }

    fn alloc_pinned(&self, bytes: usize, write_combined: bool) -> Result<PinnedMem> {
        let flags = if write_combined { sys::CU_MEMHOSTALLOC_WRITECOMBINED } else { 0 };
        // SAFETY: the memory is zeroed right below, before anything reads it.
        let mut p: PinnedHostSlice<u8> =
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), flags) }.map_err(drv("pinned alloc"))?;
        p.as_mut_slice().map_err(drv("pinned alloc"))?.fill(0);
        let ptr = p.as_mut_ptr().map_err(drv("pinned alloc"))?;
        let n = p.len();
        // SAFETY: `ptr` is the slice's own allocation of `n` zeroed bytes, freed only when the slice (the owner) is
        // dropped; nothing else touches it.
        Ok(unsafe { PinnedMem::new(ptr, n, Box::new(p)) })
    }

    fn launch(&self, plan: &Launch) -> Result<()> {
        let f = self.function(plan.kernel)?;
        let mut b = self.stream.launch_builder(f);
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
        // 64-bit device addresses of live buffers of this stream).
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| Error::Cuda { op: plan.kernel, message: e.to_string() })
    }

    fn gemm(&self, g: &GemmEx) -> Result<()> {
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let c_type = if g.c_f32 { blas_sys::cudaDataType::CUDA_R_32F } else { blas_sys::cudaDataType::CUDA_R_16BF };
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
        self.bind()?;
        // SAFETY: a `GemmEx` from `plan::gemm`, which checked every buffer against the shapes; its addresses are live
        // device buffers of this stream, the handle's; alpha/beta are host f32 scalars, as CUBLAS_COMPUTE_32F with
        // the default host pointer mode expects.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                op(g.trans_a),
                op(g.trans_b),
                g.m,
                g.n,
                g.k,
                (&alpha as *const f32).cast(),
                g.a as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                g.lda,
                g.b as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                g.ldb,
                (&beta as *const f32).cast(),
                g.c as *mut _,
                c_type,
                g.ldc,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::Cuda { op: "cublasGemmEx", message: format!("{e:?}") })
    }

    fn copy(&self, src: u64, dst: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the callers' plans address live device buffers of this stream of at least `bytes` bytes.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(drv("copy"))
    }

    fn memset_zero(&self, dst: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: as `copy`.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }.map_err(drv("memset"))
    }

    fn upload_pinned(&self, src: &PinnedMem, dst: u64, bytes: usize) -> Result<()> {
        let host = src.as_slice().get(..bytes).ok_or_else(|| too_many(bytes, src.bytes()))?;
        self.bind()?;
        // SAFETY: `host` is pinned memory that stays allocated while `src` lives (its owners wait for this copy
        // before freeing or rewriting it: the ordering rule); `dst` is a live device buffer of at least `bytes`.
        unsafe { result::memcpy_htod_async(dst, host, self.stream.cu_stream()) }.map_err(drv("upload"))
    }

    fn download_pinned(&self, src: u64, dst: &PinnedMem, bytes: usize) -> Result<()> {
        if bytes > dst.bytes() {
            return Err(too_many(bytes, dst.bytes()));
        }
        self.bind()?;
        // SAFETY: the device writes `bytes` bytes of `dst`'s pinned allocation when the copy runs; by the ordering
        // rule the host neither reads nor frees it before waiting for that.
        let host = unsafe { std::slice::from_raw_parts_mut(dst.ptr(), bytes) };
        // SAFETY: as above; `src` is a live device buffer of at least `bytes`.
        unsafe { result::memcpy_dtoh_async(host, src, self.stream.cu_stream()) }.map_err(drv("download"))
    }

    fn upload(&self, src: &[u8], dst: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: from pageable memory the driver stages `src` before returning (so it may be reused); `dst` is a
        // live device buffer of at least `src.len()` bytes.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(drv("upload"))
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: `dst` is a pageable host slice the call fills; `src` a live device buffer of at least its length.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(drv("download"))?;
        // A copy into pageable memory returns when it has landed; the synchronisation also reports a failed kernel.
        self.stream.synchronize().map_err(drv("download"))
    }

    fn record(&self) -> Result<GpuEvent> {
        let e = self.stream.record_event(None).map_err(drv("event record"))?;
        Ok(GpuEvent(Box::new(e)))
    }

    fn wait(&self, event: &GpuEvent) -> Result<()> {
        let e = event
            .0
            .downcast_ref::<CudaEvent>()
            .ok_or_else(|| Error::InvalidArgument("an event of another device".into()))?;
        e.synchronize().map_err(drv("event synchronize"))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("synchronize"))
    }

    fn pinned_read<'a>(&self, mem: &'a PinnedMem) -> Result<&'a [u8]> {
        Ok(mem.as_slice())
    }

    fn pinned_write<'a>(&self, mem: &'a mut PinnedMem) -> Result<&'a mut [u8]> {
        Ok(mem.as_mut_slice())
    }

    fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("begin_capture"))
    }

    fn end_capture(&self) -> Result<Option<GpuGraph>> {
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(drv("end_capture"))?;
        match graph {
            None => Ok(None),
            Some(g) => {
                g.upload().map_err(drv("graph upload"))?;
                Ok(Some(GpuGraph(Box::new(SendGraph(g)))))
            }
        }
    }

    fn replay(&self, graph: &GpuGraph) -> Result<()> {
        let g = graph
            .0
            .downcast_ref::<SendGraph>()
            .ok_or_else(|| Error::InvalidArgument("a graph of another device".into()))?;
        g.0.launch().map_err(drv("graph launch"))
    }

    fn graph_memory(&self) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: the attribute is a 64-bit counter written into `v`; the device handle is the context's.
        let r = unsafe {
            sys::cuDeviceGetGraphMemAttribute(
                self.ctx.cu_device(),
                sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
                (&mut v as *mut u64).cast(),
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS {
            v
        } else {
            0
        }
    }

    fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(drv("memory info"))
    }
}

fn too_many(bytes: usize, have: usize) -> Error {
    Error::InvalidArgument(format!("a copy of {bytes} bytes with a pinned buffer of {have}"))
}

/// Sets the release threshold of the device's default memory pool (the one cudarc's stream-ordered allocations
/// use) to "never": with the default of 0 the driver returns freed memory to the OS at every synchronisation (each
/// download), and the next allocation pays for it again.
/// Devices without memory pools (cudarc then allocates synchronously) are left alone.
fn keep_pool_memory(ctx: &Arc<CudaContext>) -> Result<()> {
    let pools = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
        .map_err(drv("memory pools supported"))?;
    if pools == 0 {
        return Ok(());
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    ctx.bind_to_thread().map_err(drv("bind context"))?;
    // SAFETY: `pool` receives the device's default pool handle; the attribute is a 64-bit value read from
    // `threshold`, which outlives the call. The context is current on this thread (bound above).
    unsafe {
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
