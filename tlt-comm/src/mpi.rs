//! Ranks as MPI processes (feature `mpi`): [`MpiComm`] over `MPI_COMM_WORLD` of the system's MPI library (Open MPI or
//! MPICH, through rsmpi). Launch with `mpirun -np N <program>` (or `srun`); a program started without a launcher is
//! a one-rank job.

use std::sync::{Mutex, MutexGuard, PoisonError};

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::point_to_point::MatchedReceiveVec;
use mpi::request::{Request, StaticScope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::{Count, Threading};

use crate::{check_rank, Comm, Error, Result, Tag};

/// A message on its way: MPI's request and the buffer it reads, owned here until the request completes.
struct Pending {
    request: Request<'static, [u8]>,
    buf: *mut [u8],
}

impl Pending {
    /// Frees the buffer of a completed request.
    fn free(buf: *mut [u8]) {
        // SAFETY: `buf` came from `Box::leak` in `send`, and its request has completed, so MPI no longer reads it.
        drop(unsafe { Box::from_raw(buf) });
    }
}

/// The MPI handles; the pending sends go first (completed on drop), then the world communicator, then the universe,
/// whose drop finalises MPI.
struct Handles {
    pending: Vec<Pending>,
    world: SimpleCommunicator,
    _universe: Universe,
}

impl Handles {
    /// Completes what it can of the pending sends (never blocks).
    fn progress(&mut self) {
        let mut still = Vec::with_capacity(self.pending.len());
        for p in self.pending.drain(..) {
            match p.request.test() {
                Ok(_) => Pending::free(p.buf),
                Err(request) => still.push(Pending { request, buf: p.buf }),
            }
        }
        self.pending = still;
    }
}

/// How long a closing rank waits for its last messages to be taken before it aborts the job.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl Drop for Handles {
    fn drop(&mut self) {
        // Every message must be delivered before MPI is finalised. A receiver that never takes one (a rank leaving
        // on an error while the others wait elsewhere) would hang this rank and then the job: abort it instead, so
        // the launcher stops every rank with an error.
        if std::thread::panicking() {
            // Finalising would wait for ranks that wait for this one: end the job instead.
            eprintln!("tlt-comm: a rank is panicking: aborting the MPI job");
            self.world.abort(101);
        }
        let deadline = std::time::Instant::now() + DRAIN_TIMEOUT;
        while !self.pending.is_empty() && std::time::Instant::now() < deadline {
            self.progress();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if !self.pending.is_empty() {
            eprintln!(
                "tlt-comm: {} message(s) not taken by their receivers within {DRAIN_TIMEOUT:?}: aborting the MPI job",
                self.pending.len()
            );
            self.world.abort(70);
        }
    }
}

/// `MPI_COMM_WORLD` as a [`Comm`]. Every call holds one lock, so the MPI library needs only
/// `MPI_THREAD_SERIALIZED` (checked at [`MpiComm::init`]). Messages go out as immediate (non-blocking) sends of a
/// copy of the bytes, completed by later calls: two ranks sending each other large messages never wait on each
/// other (a blocking send of a large message waits until its receiver polls for it).
pub struct MpiComm {
    handles: Mutex<Handles>,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm").field("rank", &self.rank).field("size", &self.size).finish_non_exhaustive()
    }
}

// SAFETY: the MPI handles are plain integers or pointers owned by the MPI library; every use goes through the mutex,
// so calls are serialised across threads, which `init` checked the library allows (MPI_THREAD_SERIALIZED or more).
unsafe impl Send for MpiComm {}
// SAFETY: as above: shared references only reach the handles through the mutex.
unsafe impl Sync for MpiComm {}

fn count(n: usize) -> Result<Count> {
    Count::try_from(n).map_err(|_| Error::Invalid(format!("{n} elements exceed MPI's int count")))
}

impl MpiComm {
    /// Initialises MPI (once per process) and joins the world communicator.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when MPI was already initialised in this process, or the library offers less than
    /// `MPI_THREAD_SERIALIZED`.
    pub fn init() -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::Unavailable("MPI was already initialised in this process".into()))?;
        if !matches!(threading, Threading::Serialized | Threading::Multiple) {
            return Err(Error::Unavailable(format!(
                "the MPI library offers {threading:?} threading; calls from several threads need Serialized"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank(), world.size());
        let as_usize = |v: i32| usize::try_from(v).map_err(|_| Error::Unavailable(format!("MPI returned {v}")));
        Ok(Self {
            rank: as_usize(rank)?,
            size: as_usize(size)?,
            handles: Mutex::new(Handles { pending: Vec::new(), world, _universe: universe }),
        })
    }

    fn world(&self) -> MutexGuard<'_, Handles> {
        // A panic while holding the lock leaves no MPI state half-changed on our side: keep going.
        self.handles.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn peer(&self, rank: usize) -> Result<i32> {
        check_rank(self, rank)?;
        i32::try_from(rank).map_err(|_| Error::Invalid(format!("rank {rank}")))
    }
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn barrier(&self) -> Result<()> {
        self.world().world.barrier();
        Ok(())
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        let send = buf.to_vec();
        self.world().world.all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        let send = buf.to_vec();
        self.world().world.all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let h = self.world();
        let mut lens = vec![0 as Count; self.size];
        h.world.all_gather_into(&count(mine.len())?, &mut lens[..]);
        let mut displs = Vec::with_capacity(self.size);
        let mut total: Count = 0;
        for &l in &lens {
            displs.push(total);
            total =
                total.checked_add(l).ok_or_else(|| Error::Invalid("gathered bytes exceed MPI's int count".into()))?;
        }
        if total == 0 {
            // Every part empty: nothing to move (and MPI may reject a zero-length buffer's dangling address).
            return Ok(vec![Vec::new(); self.size]);
        }
        let mut all = vec![0u8; usize::try_from(total).unwrap_or(0)];
        {
            let mut part = PartitionMut::new(&mut all[..], &lens[..], &displs[..]);
            h.world.all_gather_varcount_into(mine, &mut part);
        }
        let mut out = Vec::with_capacity(self.size);
        for (&d, &l) in displs.iter().zip(&lens) {
            let (d, l) = (usize::try_from(d).unwrap_or(0), usize::try_from(l).unwrap_or(0));
            out.push(all[d..d + l].to_vec());
        }
        Ok(out)
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<()> {
        let root = self.peer(root)?;
        let h = self.world();
        let p = h.world.process_at_rank(root);
        let mut len = u64::try_from(buf.len()).unwrap_or(u64::MAX);
        p.broadcast_into(&mut len);
        buf.resize(usize::try_from(len).map_err(|_| Error::Invalid(format!("a broadcast of {len} bytes")))?, 0);
        count(buf.len())?;
        if !buf.is_empty() {
            // A zero-length broadcast has nothing to move (and MPI may reject an empty buffer's dangling address).
            p.broadcast_into(&mut buf[..]);
        }
        Ok(())
    }

    fn send(&self, to: usize, tag: Tag, bytes: &[u8]) -> Result<()> {
        if to == self.rank {
            return Err(Error::Invalid(format!("rank {to} sending to itself")));
        }
        let to = self.peer(to)?;
        count(bytes.len())?;
        let mut h = self.world();
        h.progress();
        let buf: &'static [u8] = Box::leak(bytes.to_vec().into_boxed_slice());
        let request = h.world.process_at_rank(to).immediate_send_with_tag(StaticScope, buf, i32::from(tag));
        h.pending.push(Pending { request, buf: std::ptr::from_ref(buf).cast_mut() });
        Ok(())
    }

    fn try_recv(&self, tag: Tag) -> Result<Option<(usize, Vec<u8>)>> {
        let mut h = self.world();
        h.progress();
        let Some(probed) = h.world.any_process().immediate_matched_probe_with_tag(i32::from(tag)) else {
            return Ok(None);
        };
        let (bytes, status) = probed.matched_receive_vec::<u8>();
        let from =
            usize::try_from(status.source_rank()).map_err(|_| Error::Invalid("a message from no rank".into()))?;
        Ok(Some((from, bytes)))
    }

    fn recv(&self, tag: Tag) -> Result<(usize, Vec<u8>)> {
        // Poll rather than block inside the lock: other threads of this rank keep their access to MPI.
        loop {
            if let Some(m) = self.try_recv(tag)? {
                return Ok(m);
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
}
