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

use crate::{Comm, Error, Result};

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

fn device(op: &'static str) -> impl Fn(String) -> Error {
    move |message| Error::Device { op, message }
}

/// A device buffer of the seam as cudarc's NCCL wrappers take it: its address on the device's stream, with no
/// cudarc event (the stream orders it).
struct Raw<'a> {
    buf: Buf<f32>,
    stream: &'a Arc<CudaStream>,
}

impl DeviceSlice<f32> for Raw<'_> {
    fn len(&self) -> usize {
        self.buf.len()
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl DevicePtrMut<f32> for Raw<'_> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.buf.addr(), SyncOnDrop::Sync(None))
    }
}

/// One rank of an NCCL communicator over a CUDA device: sum all-reduces and broadcasts of device buffers, queued on
/// the device's stream.
#[derive(Debug)]
pub struct NcclComm {
    nccl: Nccl,
    gpu: Arc<CudaGpu>,
}

impl NcclComm {
    /// Opens device `ordinal` and joins the communicator of `host`'s ranks ([`NcclComm::new`]).
    ///
    /// # Errors
    /// [`Error::Unavailable`] without a CUDA driver or NCCL library; as [`NcclComm::new`].
    pub fn open(host: &dyn Comm, ordinal: usize) -> Result<Self> {
        if !available() {
            return Err(Error::Unavailable(
                "NCCL needs a CUDA driver (libcuda.so) and NCCL (libnccl.so, e.g. from the nvidia-nccl-cu13 wheel) on \
                 the library path"
                    .into(),
            ));
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
            0 => Id::new()
                .map_err(|e| device("ncclGetUniqueId")(format!("{e:?}")))?
                .internal()
                .iter()
                .map(|&c| c.to_ne_bytes()[0])
                .collect(),
            _ => Vec::new(),
        };
        host.broadcast_bytes(0, &mut id)?;
        let internal: [std::ffi::c_char; ID_BYTES] = id
            .iter()
            .map(|&b| std::ffi::c_char::from_ne_bytes([b]))
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| Error::Invalid(format!("an NCCL id of {} bytes", id.len())))?;
        let nccl = Nccl::from_rank(gpu.stream().clone(), host.rank(), host.size(), Id::uninit(internal))
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
        let mut raw = Raw { buf, stream: self.gpu.stream() };
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
        let mut raw = Raw { buf, stream: self.gpu.stream() };
        self.nccl.broadcast_in_place(&mut raw, root).map(|_| ()).map_err(|e| device("ncclBroadcast")(format!("{e:?}")))
    }
}
