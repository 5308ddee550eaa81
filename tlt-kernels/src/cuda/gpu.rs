//! The device seam: everything the host code of the GPU path asks of a device, as one trait ([`Gpu`]: one stream of
//! one device, its allocations, copies, events and graphs). `CudaGpu` (feature `cuda`) implements it on a CUDA
//! device through cudarc; `tlt-cuda-sim`'s `SimGpu` implements it on the CPU with a stream that completes its work
//! later, so that the same host code (`CudaLlama`, `CudaTarget`, `CudaDrafter`, the graph pool, the transfers) runs
//! in CI exactly as it runs on a GPU.
//!
//! # The ordering rule
//! Work on a [`Gpu`] runs in the order it was queued, after the calls that queued it have returned. The host may
//! touch memory the device reads or writes only once it has waited for that work:
//! - **pinned memory** ([`PinnedMem`]): read it ([`Gpu::pinned_read`]) only after a wait ([`Gpu::wait`] on an event
//!   recorded after the copy into it, or [`Gpu::synchronize`]) that covers every queued copy writing it; write it
//!   ([`Gpu::pinned_write`]) only after a wait that covers every queued copy reading it. Nothing else orders them:
//!   a copy from or into pinned memory returns at once.
//! - **pageable memory** (`&[u8]`): [`Gpu::upload`] has consumed its source when it returns, and [`Gpu::download`]
//!   returns when the bytes have landed (after all work queued before it), so they need no wait.
//! - **device memory** is ordered by the stream alone: a buffer freed (dropped) while queued work still uses it is
//!   released after that work.
//!
//! The simulated device checks the rule: a host read of pinned memory that a copy not yet waited for writes sees
//! poison (`0xFF` bytes), a host write into pinned memory that a queued copy still reads is an error.

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use half::{bf16, f16};

use super::plan::{Buf, GemmEx, Launch};
use crate::error::{Error, Result};

/// What a device is: for plans (the SM count sizes split attention) and reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// The device's name (`NVIDIA H200`, `simulated`).
    pub name: String,
    /// Compute capability as `major * 10 + minor` (90 on Hopper).
    pub arch: u32,
    /// Streaming multiprocessors.
    pub multiprocessors: usize,
    /// Bytes of device memory.
    pub total_memory: usize,
    /// Whether this is the CPU simulation of a device (tests size their work by it: it runs kernels thousands of
    /// times slower).
    pub simulated: bool,
    /// Blocks of split attention (`attention_split_bf16`, 128 threads) resident on one multiprocessor at once: on a
    /// GPU `cuOccupancyMaxActiveBlocksPerMultiprocessor` of the loaded kernel, else
    /// [`super::plan::ATTENTION_BLOCKS_PER_SM`] (the simulated device reports that too).
    pub attention_blocks_per_sm: usize,
}

impl GpuInfo {
    /// Blocks of split attention resident on the whole device at once (one wave): multiprocessors x
    /// [`GpuInfo::attention_blocks_per_sm`]. [`super::plan::Chunks::for_cache`] sizes chunks by it.
    #[must_use]
    pub fn target_blocks(&self) -> usize {
        self.multiprocessors.max(1) * self.attention_blocks_per_sm.max(1)
    }
}

/// An allocation of device memory: its address and size. Freed in stream order when dropped (after the work queued
/// before the drop).
pub struct DeviceMem {
    addr: u64,
    bytes: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

impl DeviceMem {
    /// An allocation at `addr` of `bytes` bytes, released when `owner` is dropped (for [`Gpu`] implementations).
    #[must_use]
    pub fn new(addr: u64, bytes: usize, owner: Box<dyn Any + Send + Sync>) -> Self {
        Self { addr, bytes, _owner: owner }
    }

    /// Its device address.
    #[must_use]
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its size in bytes.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl fmt::Debug for DeviceMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceMem({:#x}, {} bytes)", self.addr, self.bytes)
    }
}

/// Page-locked host memory, the source and destination of asynchronous copies. The host reaches it only through
/// [`Gpu::pinned_read`] and [`Gpu::pinned_write`] (see the module's ordering rule).
pub struct PinnedMem {
    ptr: *mut u8,
    bytes: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the memory is a plain host allocation owned by `_owner` (itself Send + Sync); the pointer is only
// dereferenced through `&self`/`&mut self` borrows by the functions below.
unsafe impl Send for PinnedMem {}
// SAFETY: as above; shared access gives shared slices only.
unsafe impl Sync for PinnedMem {}

impl PinnedMem {
    /// `bytes` bytes at `ptr`, valid until `owner` is dropped (for [`Gpu`] implementations).
    ///
    /// # Safety
    /// `ptr` must point to `bytes` bytes of initialised host memory that stay valid and are not otherwise accessed
    /// until `owner` is dropped.
    #[must_use]
    pub unsafe fn new(ptr: *mut u8, bytes: usize, owner: Box<dyn Any + Send + Sync>) -> Self {
        Self { ptr, bytes, _owner: owner }
    }

    /// Its host address.
    #[must_use]
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its size in bytes.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The bytes, without any ordering (for [`Gpu`] implementations, which check the ordering rule first).
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `new`'s contract: `bytes` initialised bytes, valid while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    /// The bytes, mutably, without any ordering (for [`Gpu`] implementations).
    #[must_use]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` is the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl fmt::Debug for PinnedMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PinnedMem({:p}, {} bytes)", self.ptr, self.bytes)
    }
}

/// A point in a [`Gpu`]'s stream ([`Gpu::record`]), to wait for ([`Gpu::wait`]).
pub struct GpuEvent(pub Box<dyn Any + Send + Sync>);

impl fmt::Debug for GpuEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GpuEvent")
    }
}

/// Work captured from a [`Gpu`]'s stream ([`Gpu::begin_capture`] .. [`Gpu::end_capture`]), replayed with
/// [`Gpu::replay`] on the buffers it was captured with.
pub struct GpuGraph(pub Box<dyn Any + Send>);

impl fmt::Debug for GpuGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GpuGraph")
    }
}

/// One stream of one device: what the host code of the GPU path runs on. Every method but the host accesses and
/// waits only queues work (see the module's ordering rule); none panics on bad input.
pub trait Gpu: Send + Sync + fmt::Debug {
    /// The device.
    fn info(&self) -> &GpuInfo;

    /// `bytes` (at least 1) of zeroed device memory.
    ///
    /// # Errors
    /// When the device is out of memory or the call fails.
    fn alloc(&self, bytes: usize) -> Result<DeviceMem>;

    /// `bytes` (at least 1) of zeroed page-locked host memory; `write_combined` for memory the host only writes.
    ///
    /// # Errors
    /// When the allocation fails.
    fn alloc_pinned(&self, bytes: usize, write_combined: bool) -> Result<PinnedMem>;

    /// Queues a kernel launch ([`crate::cuda::plan`]).
    ///
    /// # Errors
    /// An unknown kernel or a failed launch.
    fn launch(&self, launch: &Launch) -> Result<()>;

    /// Queues a GEMM (`cublasGemmEx` as [`crate::cuda::plan::gemm`] plans it).
    ///
    /// # Errors
    /// When the GEMM cannot be queued.
    fn gemm(&self, gemm: &GemmEx) -> Result<()>;

    /// Queues a copy of `bytes` bytes from device address `src` to `dst`.
    ///
    /// # Errors
    /// When the copy cannot be queued.
    fn copy(&self, src: u64, dst: u64, bytes: usize) -> Result<()>;

    /// Queues zeroing `bytes` bytes at device address `dst`.
    ///
    /// # Errors
    /// When the call fails.
    fn memset_zero(&self, dst: u64, bytes: usize) -> Result<()>;

    /// Queues a copy of the first `bytes` bytes of `src` to device address `dst`; `src` is read when the copy runs.
    ///
    /// # Errors
    /// For more bytes than `src` holds, or when the copy cannot be queued.
    fn upload_pinned(&self, src: &PinnedMem, dst: u64, bytes: usize) -> Result<()>;

    /// Queues a copy of `bytes` bytes from device address `src` into the start of `dst`; they land when the copy
    /// runs.
    ///
    /// # Errors
    /// For more bytes than `dst` holds, or when the copy cannot be queued.
    fn download_pinned(&self, src: u64, dst: &PinnedMem, bytes: usize) -> Result<()>;

    /// Copies pageable `src` to device address `dst` in stream order; `src` may be reused when this returns.
    ///
    /// # Errors
    /// When the copy fails.
    fn upload(&self, src: &[u8], dst: u64) -> Result<()>;

    /// Copies `dst.len()` bytes from device address `src` into pageable `dst` after all queued work; returns when
    /// they have landed.
    ///
    /// # Errors
    /// When the copy fails (or a queued kernel failed).
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;

    /// An event at the current end of the stream.
    ///
    /// # Errors
    /// When the call fails.
    fn record(&self) -> Result<GpuEvent>;

    /// Blocks the host until the work queued before `event` was recorded has run.
    ///
    /// # Errors
    /// When the wait fails (or queued work failed).
    fn wait(&self, event: &GpuEvent) -> Result<()>;

    /// Blocks the host until all queued work has run.
    ///
    /// # Errors
    /// When queued work failed.
    fn synchronize(&self) -> Result<()>;

    /// The bytes of `mem`, for the host to read (after the wait the ordering rule asks for).
    ///
    /// # Errors
    /// The simulated device's ordering checks; never on a real device.
    fn pinned_read<'a>(&self, mem: &'a PinnedMem) -> Result<&'a [u8]>;

    /// The bytes of `mem`, for the host to write (after the wait the ordering rule asks for).
    ///
    /// # Errors
    /// The simulated device's ordering checks (a queued copy still reads `mem`); never on a real device.
    fn pinned_write<'a>(&self, mem: &'a mut PinnedMem) -> Result<&'a mut [u8]>;

    /// Starts recording the stream's work into a graph instead of running it (only launches, GEMMs and device
    /// copies may be queued until [`Gpu::end_capture`]).
    ///
    /// # Errors
    /// When capture cannot start (e.g. already capturing).
    fn begin_capture(&self) -> Result<()>;

    /// Ends the capture; `None` when nothing was recorded.
    ///
    /// # Errors
    /// When the capture was invalidated (a forbidden call during it) or the graph cannot be instantiated.
    fn end_capture(&self) -> Result<Option<GpuGraph>>;

    /// Queues a replay of `graph` (captured on this stream).
    ///
    /// # Errors
    /// A graph of another device, or a failed launch.
    fn replay(&self, graph: &GpuGraph) -> Result<()>;

    /// Bytes of device memory the graphs of this device hold (0 where not tracked).
    fn graph_memory(&self) -> u64 {
        0
    }

    /// `(free, total)` bytes of device memory.
    ///
    /// # Errors
    /// When the query fails.
    fn memory(&self) -> Result<(usize, usize)>;
}

/// Element types of [`DeviceBuf`]: plain data whose every byte pattern is a value.
///
/// # Safety
/// Implementors have no padding and no invalid bit patterns.
pub unsafe trait Elem: Copy + Default + Send + Sync + 'static {}

// SAFETY: primitive numbers: no padding, every bit pattern valid.
unsafe impl Elem for u8 {}
// SAFETY: as above.
unsafe impl Elem for i32 {}
// SAFETY: as above.
unsafe impl Elem for u32 {}
// SAFETY: as above.
unsafe impl Elem for u64 {}
// SAFETY: as above.
unsafe impl Elem for f32 {}
// SAFETY: as above.
unsafe impl Elem for f64 {}
// SAFETY: a transparent u16.
unsafe impl Elem for bf16 {}
// SAFETY: a transparent u16.
unsafe impl Elem for f16 {}

/// `v` as bytes.
#[must_use]
pub fn bytes_of<T: Elem>(v: &[T]) -> &[u8] {
    // SAFETY: `Elem` types have no padding; the length is the slice's in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// `v` as mutable bytes.
fn bytes_of_mut<T: Elem>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: `Elem` types have no padding and accept every bit pattern.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// A device buffer of `len` elements of `T` (at least one element's bytes are allocated).
pub struct DeviceBuf<T> {
    mem: DeviceMem,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for DeviceBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuf<{}>({:#x}, {})", std::any::type_name::<T>(), self.mem.addr, self.len)
    }
}

impl<T: Elem> DeviceBuf<T> {
    /// `len` zeroed elements on `gpu`.
    ///
    /// # Errors
    /// As [`Gpu::alloc`].
    pub fn zeros(gpu: &dyn Gpu, len: usize) -> Result<Self> {
        let bytes = len.max(1) * std::mem::size_of::<T>();
        Ok(Self { mem: gpu.alloc(bytes)?, len, _t: PhantomData })
    }

    /// A buffer holding `data`.
    ///
    /// # Errors
    /// As [`Gpu::alloc`] and [`Gpu::upload`].
    pub fn from_host(gpu: &dyn Gpu, data: &[T]) -> Result<Self> {
        let b = Self::zeros(gpu, data.len())?;
        if !data.is_empty() {
            gpu.upload(bytes_of(data), b.mem.addr)?;
        }
        Ok(b)
    }

    /// `mem` as a buffer of `len` elements (it must hold at least `len * size_of::<T>()` bytes).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it is too small.
    pub fn from_mem(mem: DeviceMem, len: usize) -> Result<Self> {
        if mem.bytes < len * std::mem::size_of::<T>() {
            return Err(Error::InvalidArgument(format!("{len} elements in an allocation of {} bytes", mem.bytes)));
        }
        Ok(Self { mem, len, _t: PhantomData })
    }

    /// The allocation.
    #[must_use]
    pub fn into_mem(self) -> DeviceMem {
        self.mem
    }

    /// The buffer as a plan's argument.
    #[must_use]
    pub fn buf(&self) -> Buf<T> {
        Buf::new(self.mem.addr, self.len)
    }

    /// Its length in elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of device memory it holds.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.mem.bytes
    }

    /// Its contents, after all queued work.
    ///
    /// # Errors
    /// As [`Gpu::download`].
    pub fn to_host(&self, gpu: &dyn Gpu) -> Result<Vec<T>> {
        read(gpu, self.buf())
    }

    /// Writes `data` at element `offset` (in stream order).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the buffer; [`Gpu::upload`]'s errors.
    pub fn write(&self, gpu: &dyn Gpu, offset: usize, data: &[T]) -> Result<()> {
        let dst = self.buf().slice(offset..offset + data.len())?;
        if !data.is_empty() {
            gpu.upload(bytes_of(data), dst.addr())?;
        }
        Ok(())
    }
}

/// The contents of `src` (any device range), after all queued work.
///
/// # Errors
/// As [`Gpu::download`].
pub fn read<T: Elem>(gpu: &dyn Gpu, src: Buf<T>) -> Result<Vec<T>> {
    let mut out = vec![T::default(); src.len()];
    if !out.is_empty() {
        gpu.download(src.addr(), bytes_of_mut(&mut out))?;
    }
    Ok(out)
}

/// Queues a copy of `src` into `dst` (same length).
///
/// # Errors
/// [`Error::ShapeMismatch`] for lengths that differ; [`Gpu::copy`]'s errors.
pub fn copy<T: Elem>(gpu: &dyn Gpu, src: Buf<T>, dst: Buf<T>) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::ShapeMismatch { what: "copy destination", expected: src.len(), got: dst.len() });
    }
    if src.is_empty() {
        return Ok(());
    }
    gpu.copy(src.addr(), dst.addr(), src.len() * std::mem::size_of::<T>())
}

/// Queues zeroing `dst`.
///
/// # Errors
/// As [`Gpu::memset_zero`].
pub fn zero<T: Elem>(gpu: &dyn Gpu, dst: Buf<T>) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    gpu.memset_zero(dst.addr(), dst.len() * std::mem::size_of::<T>())
}

/// A shared handle to a device.
pub type SharedGpu = Arc<dyn Gpu>;
