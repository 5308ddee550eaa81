//! NCCL for device buffers (feature `nccl`): one rank per GPU, the ranks those of a host [`Comm`] (MPI), which
//! carries the communicator's unique id from rank 0 to the others — the pairing HPC training stacks use. NCCL and
//! the CUDA driver are loaded at run time (cudarc's dynamic loading), so this builds without a toolkit, and
//! [`NcclComm::open`] returns [`Error::Unavailable`] (never panics) on a machine without them.
//!
//! The collectives are queued on the stream of the device they run on (`tlt_kernels::cuda::CudaGpu`, the seam's CUDA
//! device), the stream every kernel and copy of that device's buffers runs on, so stream order alone places them
//! after the work that wrote their buffers and before the work that reads them (the seam's ordering rule). The first
//! version queued them on the legacy default stream, which is not ordered against cudarc's non-blocking streams: an
//! all-reduce could have read gradients still being written.
//!
//! The one-rank test (`tests/nccl.rs`) ran on an H200 (2026-11-27) before this change; this version has not run on
//! a GPU yet.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::safe::{Comm as Nccl, Id, ReduceOp};
use tlt_kernels::cuda::plan::Buf;
use tlt_kernels::cuda::CudaGpu;

use crate::{Comm, Elem, Error, Result};

/// Bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

/// Whether the CUDA driver (`libcuda.so`) and NCCL (`libnccl.so`) can be loaded. Never panics.
#[must_use]
pub fn available() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and drops what it opened.
    let driver = std::panic::catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false);
    // SAFETY: as above.
    driver && std::panic::catch_unwind(|| unsafe { cudarc::nccl::sys::is_culib_present() }).unwrap_or(false)
}

fn unavailable() -> Error {
    Error::Unavailable(
        "NCCL needs a CUDA driver (libcuda.so) and NCCL (libnccl.so, e.g. from the nvidia-nccl-cu13 wheel) on the \
         library path"
            .into(),
    )
}

fn device(op: &'static str) -> impl Fn(String) -> Error {
    move |message| Error::Device { op, message }
}

/// Device memory as cudarc's NCCL wrappers take it: `len` elements of `T` at `addr` on the device's stream, with no
/// cudarc event (the stream orders it).
struct Raw<'a, T> {
    addr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    elem: std::marker::PhantomData<T>,
}

impl<'a, T> Raw<'a, T> {
    fn new(addr: u64, len: usize, stream: &'a Arc<CudaStream>) -> Self {
        Self { addr, len, stream, elem: std::marker::PhantomData }
    }
}

impl<T> DeviceSlice<T> for Raw<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtrMut<T> for Raw<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.addr, SyncOnDrop::Sync(None))
    }
}

/// One rank of an NCCL communicator over a CUDA device: sum all-reduces and broadcasts of device buffers, queued on
/// the device's stream.
#[derive(Debug)]
pub struct NcclComm {
    nccl: Nccl,
    gpu: Arc<CudaGpu>,
}

// SAFETY: NCCL lets a communicator be used from any thread, one at a time (its collectives are not thread-safe,
// which `NcclComm` not being `Sync` keeps); the stream and device it holds are `Send` themselves.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Opens device `ordinal` and joins the communicator of `host`'s ranks ([`NcclComm::new`]).
    ///
    /// # Errors
    /// [`Error::Unavailable`] without a CUDA driver or NCCL library; as [`NcclComm::new`].
    pub fn open(host: &dyn Comm, ordinal: usize) -> Result<Self> {
        if !available() {
            return Err(unavailable());
        }
        let gpu = CudaGpu::open(ordinal).map_err(|e| device("opening the CUDA device")(e.to_string()))?;
        Self::new(host, gpu)
    }

    /// Joins the communicator of `host`'s ranks on `gpu`'s stream (collectively: every rank of `host` calls it, each
    /// with its own GPU): rank 0 creates the unique id, `host` broadcasts it, and NCCL connects the ranks.
    ///
    /// # Errors
    /// [`Error::Device`] when NCCL fails; `host`'s failure.
    pub fn new(host: &dyn Comm, gpu: Arc<CudaGpu>) -> Result<Self> {
        let mut id = match host.rank() {
            0 => Self::unique_id()?,
            _ => Vec::new(),
        };
        host.broadcast_bytes(0, &mut id)?;
        Self::with_id(gpu, host.rank(), host.size(), &id)
    }

    /// A new NCCL unique id (what rank 0 hands the others).
    ///
    /// # Errors
    /// [`Error::Unavailable`] without NCCL; [`Error::Device`] when NCCL fails.
    pub fn unique_id() -> Result<Vec<u8>> {
        if !available() {
            return Err(unavailable());
        }
        Ok(Id::new()
            .map_err(|e| device("ncclGetUniqueId")(format!("{e:?}")))?
            .internal()
            .iter()
            .map(|&c| c.to_ne_bytes()[0])
            .collect())
    }

    /// Joins as `rank` of `size` the communicator whose unique id rank 0 made (`id`, its 128 bytes, however they
    /// travelled: a host [`Comm`], or a torch job's `TCPStore` ([`crate::store`])), on `gpu`'s stream. Blocks until
    /// every rank has joined.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without NCCL; [`Error::Invalid`] for an id of another length or a rank out of range;
    /// [`Error::Device`] when NCCL fails.
    pub fn with_id(gpu: Arc<CudaGpu>, rank: usize, size: usize, id: &[u8]) -> Result<Self> {
        if !available() {
            return Err(unavailable());
        }
        if rank >= size {
            return Err(Error::Invalid(format!("rank {rank} of a communicator of {size}")));
        }
        let internal: [std::ffi::c_char; ID_BYTES] = id
            .iter()
            .map(|&b| std::ffi::c_char::from_ne_bytes([b]))
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| Error::Invalid(format!("an NCCL id of {} bytes (NCCL's are {ID_BYTES})", id.len())))?;
        let nccl = Nccl::from_rank(gpu.stream().clone(), rank, size, Id::uninit(internal))
            .map_err(|e| device("ncclCommInitRank")(format!("{e:?}")))?;
        Ok(Self { nccl, gpu })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.nccl.rank()
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.nccl.world_size()
    }

    /// The device the collectives run on (its stream orders them; wait on it before reading results on the host).
    pub fn gpu(&self) -> &Arc<CudaGpu> {
        &self.gpu
    }

    /// `buf[i] = sum over ranks of buf[i]`, in place, on every rank (queued on the device's stream).
    ///
    /// # Errors
    /// [`Error::Device`] when NCCL fails.
    pub fn all_reduce_sum_f32(&self, buf: Buf<f32>) -> Result<()> {
        let mut raw = Raw::<f32>::new(buf.addr(), buf.len(), self.gpu.stream());
        self.nccl
            .all_reduce_in_place(&mut raw, &ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| device("ncclAllReduce")(format!("{e:?}")))
    }

    /// `root`'s `buf` on every rank, in place (queued on the device's stream): how a rank that trained new weights
    /// (the drafter's) hands them to the others' devices.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a root out of range; [`Error::Device`] when NCCL fails.
    pub fn broadcast_f32(&self, root: usize, buf: Buf<f32>) -> Result<()> {
        let bad = || Error::Invalid(format!("rank {root} of a communicator of {}", self.size()));
        if root >= self.size() {
            return Err(bad());
        }
        let root = i32::try_from(root).map_err(|_| bad())?;
        let mut raw = Raw::<f32>::new(buf.addr(), buf.len(), self.gpu.stream());
        self.nccl.broadcast_in_place(&mut raw, root).map(|_| ()).map_err(|e| device("ncclBroadcast")(format!("{e:?}")))
    }

    /// `root`'s `count` elements of `elem` on every rank, received into device memory and read back to the host
    /// (the bytes as the device holds them, little-endian): how a rollout server takes a tensor a torch trainer
    /// broadcasts (`dist.broadcast(t, src=0, group=...)`, same element type and count), one tensor at a time. The
    /// device memory is this call's own; the call returns once the stream has finished.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a root out of range; [`Error::Device`] when NCCL or the copy fails.
    pub fn broadcast_to_host(&self, root: usize, elem: Elem, count: usize) -> Result<Vec<u8>> {
        use tlt_kernels::cuda::Gpu as _;
        let bad = || Error::Invalid(format!("rank {root} of a communicator of {}", self.size()));
        if root >= self.size() {
            return Err(bad());
        }
        let root = i32::try_from(root).map_err(|_| bad())?;
        let bytes = count.checked_mul(elem.bytes()).ok_or_else(|| Error::Invalid(format!("{count} elements")))?;
        let mem = self.gpu.alloc(bytes).map_err(|e| device("allocating a receive buffer")(e.to_string()))?;
        let stream = self.gpu.stream();
        let done = match elem {
            Elem::F32 => self.nccl.broadcast_in_place(&mut Raw::<f32>::new(mem.addr(), count, stream), root),
            Elem::F16 => self.nccl.broadcast_in_place(&mut Raw::<half::f16>::new(mem.addr(), count, stream), root),
            Elem::Bf16 => self.nccl.broadcast_in_place(&mut Raw::<half::bf16>::new(mem.addr(), count, stream), root),
        };
        done.map_err(|e| device("ncclBroadcast")(format!("{e:?}")))?;
        self.gpu.synchronize().map_err(|e| device("waiting for a broadcast")(e.to_string()))?;
        let mut out = vec![0u8; bytes];
        self.gpu.download(mem.addr(), &mut out).map_err(|e| device("reading a received tensor")(e.to_string()))?;
        Ok(out)
    }
}
