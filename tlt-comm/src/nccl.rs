//! NCCL for device buffers (feature `nccl`): one rank per GPU, the ranks those of a host [`Comm`] (MPI), which
//! carries the communicator's unique id from rank 0 to the others — the pairing HPC training stacks use. NCCL and
//! the CUDA driver are loaded at run time (cudarc's dynamic loading), so this builds without a toolkit, and
//! [`NcclComm::new`] returns [`Error::Unavailable`] (never panics) on a machine without them.
//!
//! Nothing here has run on a GPU yet: `tests/nccl.rs` checks the error without a driver and, where a driver and
//! NCCL load, the collectives on one device (`cargo xtask gpu-bundle`'s `tests` call).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm as Nccl, Id, ReduceOp};

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

/// One rank of an NCCL communicator over device `ordinal`: sum all-reduces and broadcasts of device buffers, queued
/// on its stream.
#[derive(Debug)]
pub struct NcclComm {
    nccl: Nccl,
    stream: Arc<CudaStream>,
}

impl NcclComm {
    /// Joins the communicator of `host`'s ranks (collectively: every rank of `host` calls it, each with its own
    /// GPU): rank 0 creates the unique id, `host` broadcasts it, and NCCL connects the ranks.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without a CUDA driver or NCCL library; [`Error::Device`] when the device or NCCL
    /// fails; `host`'s failure.
    pub fn new(host: &dyn Comm, ordinal: usize) -> Result<Self> {
        if !available() {
            return Err(Error::Unavailable(
                "NCCL needs a CUDA driver (libcuda.so) and NCCL (libnccl.so, e.g. from the nvidia-nccl-cu13 wheel) on \
                 the library path"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| device("opening the CUDA device")(e.to_string()))?;
        let stream = ctx.default_stream();
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
        let nccl = Nccl::from_rank(stream.clone(), host.rank(), host.size(), Id::uninit(internal))
            .map_err(|e| device("ncclCommInitRank")(format!("{e:?}")))?;
        Ok(Self { nccl, stream })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.nccl.rank()
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.nccl.world_size()
    }

    /// The stream its collectives are queued on (synchronise it before reading results on the host).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `buf[i] = sum over ranks of buf[i]`, in place, on every rank (queued on [`Self::stream`]).
    ///
    /// # Errors
    /// [`Error::Device`] when NCCL fails.
    pub fn all_reduce_sum_f32(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        self.nccl
            .all_reduce_in_place(buf, &ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| device("ncclAllReduce")(format!("{e:?}")))
    }

    /// `root`'s `buf` on every rank, in place (queued on [`Self::stream`]): how a rank that trained new weights
    /// (the drafter's) hands them to the others' devices.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a root out of range; [`Error::Device`] when NCCL fails.
    pub fn broadcast_f32(&self, root: usize, buf: &mut CudaSlice<f32>) -> Result<()> {
        let bad = || Error::Invalid(format!("rank {root} of a communicator of {}", self.size()));
        if root >= self.size() {
            return Err(bad());
        }
        let root = i32::try_from(root).map_err(|_| bad())?;
        self.nccl.broadcast_in_place(buf, root).map(|_| ()).map_err(|e| device("ncclBroadcast")(format!("{e:?}")))
    }
}
