//! # tlt-comm
//!
//! The collective seam of data-parallel TLT: a [`Comm`] is this process's view of the job's ranks, with the
//! operations data-parallel GRPO and TLT's idle-rank drafter training need: the rank and size, a barrier, sum
//! all-reduces of gradients and counts, a broadcast and an all-gather of bytes (configs, shard plans, metrics), and
//! tagged point-to-point messages that a busy rank polls without blocking (new drafter versions, stolen work).
//!
//! Engines, not a home-made transport: [`SelfComm`] is the one-rank job (every collective is the identity), and
//! `mpi::MpiComm` (feature `mpi`) runs ranks as MPI processes launched by `mpirun`/`srun`. Device tensors go
//! through NCCL: `nccl::NcclComm` (feature `nccl`), one rank per GPU, its unique id broadcast over a [`Comm`] or
//! read from torch's `TCPStore` ([`store`]) when the other ranks are a torch job's.
//!
//! ```
//! use tlt_comm::{Comm, SelfComm};
//! let comm = SelfComm;
//! let mut grads = [1.0f32, 2.0];
//! comm.all_reduce_sum_f32(&mut grads).unwrap();
//! assert_eq!((comm.rank(), comm.size(), grads), (0, 1, [1.0, 2.0]));
//! assert_eq!(comm.all_gather_bytes(b"metrics").unwrap(), [b"metrics".to_vec()]);
//! assert!(comm.try_recv(7).unwrap().is_none());
//! ```
//!
//! **Where it sits:** depends on thiserror and, with `mpi`, rsmpi; used by `tlt-rl` (data-parallel GRPO).

pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod store;

/// A point-to-point message tag (which kind of control message).
pub type Tag = u16;

/// The element types a torch tensor crosses the wire in (NCCL broadcasts name the tensor's own type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// `torch.float32`.
    F32,
    /// `torch.float16`.
    F16,
    /// `torch.bfloat16`.
    Bf16,
}

impl Elem {
    /// Bytes per element.
    #[must_use]
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// The type torch names `name` (`bfloat16`, `float16`/`half`, `float32`/`float`, with or without `torch.`).
    #[must_use]
    pub fn from_torch(name: &str) -> Option<Self> {
        match name.strip_prefix("torch.").unwrap_or(name) {
            "float32" | "float" => Some(Self::F32),
            "float16" | "half" => Some(Self::F16),
            "bfloat16" => Some(Self::Bf16),
            _ => None,
        }
    }
}

/// Everything that can go wrong in `tlt-comm`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An engine could not start: MPI could not be initialised (already initialised in this process, or without
    /// the threading level needed), or no CUDA driver or NCCL library loads.
    #[error("communication engine unavailable: {0}")]
    Unavailable(String),
    /// torch's `TCPStore` (where a trainer's process group meets) could not be reached, or answered otherwise than
    /// torch does, or a key was not set in time.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A rank out of range, a message to oneself, or buffers whose lengths differ across ranks.
    #[error("invalid communication: {0}")]
    Invalid(String),
    /// A device collective (NCCL) or the CUDA driver under it failed.
    #[error("{op} failed: {message}")]
    Device {
        /// What was being done.
        op: &'static str,
        /// The library's message.
        message: String,
    },
    /// A wait for other ranks lasted [`Deadlines::wait`], or a rank did not answer for [`Deadlines::silence`]
    /// (stopped, dead or hung): the job cannot go on. Checkpoints written before stay usable.
    #[error("rank {rank} stopped waiting for {what} after {waited:.1?}: {peers}")]
    Unresponsive {
        /// The rank that gave up.
        rank: usize,
        /// What it waited for.
        what: String,
        /// How long it waited.
        waited: std::time::Duration,
        /// Every other rank: answering or silent, and what it last said it was doing.
        peers: String,
    },
}

/// How long a rank waits for the others before it gives up with [`Error::Unresponsive`]. A busy rank answers the
/// others' liveness checks (MPI: a service thread), so a long wait for a rank that is still working lasts up to
/// `wait`, while a rank that stopped answering (`SIGSTOP`, a dead host, a hung process) ends the wait after
/// `silence`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// The longest wait for other ranks in one operation (a collective, a receive, a polling loop). Default 30
    /// minutes: well above a GRPO step's rollout on the machines this runs on.
    pub wait: std::time::Duration,
    /// How long a rank may leave a liveness check unanswered. Default 60 s.
    pub silence: std::time::Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self { wait: std::time::Duration::from_secs(30 * 60), silence: std::time::Duration::from_secs(60) }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// One process's view of a job of [`Comm::size`] ranks. Collectives must be called by every rank, in the same order,
/// with buffers of the same length; point-to-point messages may be sent and polled at any time. Implementations are
/// safe to share between threads (calls are serialised inside).
pub trait Comm: Send + Sync {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;

    /// Ranks in the job.
    fn size(&self) -> usize;

    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// The engine's failure.
    fn barrier(&self) -> Result<()>;

    /// `buf[i] = sum over ranks of buf[i]`, the same on every rank.
    ///
    /// # Errors
    /// The engine's failure.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()>;

    /// As [`Comm::all_reduce_sum_f32`], in f64 (counts and losses summed without losing integers).
    ///
    /// # Errors
    /// The engine's failure.
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()>;

    /// Every rank's `mine`, in rank order.
    ///
    /// # Errors
    /// The engine's failure.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// `root`'s `buf` on every rank (other ranks' contents are replaced, whatever their length).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a root out of range; the engine's failure.
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<()>;

    /// Sends `bytes` to rank `to` with `tag`, without waiting for the receiver (a copy goes out): two ranks may
    /// send each other messages of any size before either receives.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a rank out of range or this rank.
    fn send(&self, to: usize, tag: Tag, bytes: &[u8]) -> Result<()>;

    /// A message with `tag` from any rank if one has arrived: `(sender, bytes)`; never blocks.
    ///
    /// # Errors
    /// The engine's failure.
    fn try_recv(&self, tag: Tag) -> Result<Option<(usize, Vec<u8>)>>;

    /// The next message with `tag` from any rank, waiting for it: `(sender, bytes)`.
    ///
    /// # Errors
    /// [`Error::Invalid`] in a one-rank job (nothing can ever arrive); [`Error::Unresponsive`] past the job's
    /// [`Deadlines`]; the engine's failure.
    fn recv(&self, tag: Tag) -> Result<(usize, Vec<u8>)>;

    /// For code that waits for other ranks in a polling loop (`what` it waits for, `since` when it started),
    /// called on every turn: an error once the wait has lasted the job's [`Deadlines::wait`] or another rank has
    /// not answered for [`Deadlines::silence`]. One rank: never an error.
    ///
    /// # Errors
    /// [`Error::Unresponsive`] as said; the engine's failure.
    fn check_wait(&self, what: &str, since: std::time::Instant) -> Result<()> {
        let _ = (what, since);
        Ok(())
    }
}

/// The job of one rank: every collective is the identity and no message ever arrives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SelfComm;

impl Comm for SelfComm {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn all_reduce_sum_f32(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn all_reduce_sum_f64(&self, _buf: &mut [f64]) -> Result<()> {
        Ok(())
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![mine.to_vec()])
    }

    fn broadcast_bytes(&self, root: usize, _buf: &mut Vec<u8>) -> Result<()> {
        check_rank(self, root)
    }

    fn send(&self, to: usize, _tag: Tag, _bytes: &[u8]) -> Result<()> {
        Err(Error::Invalid(format!("a message to rank {to} in a one-rank job")))
    }

    fn try_recv(&self, _tag: Tag) -> Result<Option<(usize, Vec<u8>)>> {
        Ok(None)
    }

    fn recv(&self, tag: Tag) -> Result<(usize, Vec<u8>)> {
        Err(Error::Invalid(format!("waiting for a message (tag {tag}) in a one-rank job would never return")))
    }
}

/// [`Error::Invalid`] unless `rank` is one of `comm`'s.
///
/// # Errors
/// As said.
pub fn check_rank(comm: &(impl Comm + ?Sized), rank: usize) -> Result<()> {
    if rank < comm.size() {
        Ok(())
    } else {
        Err(Error::Invalid(format!("rank {rank} of a job of {}", comm.size())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rank_collectives_are_the_identity_and_messages_are_errors() {
        let c = SelfComm;
        let mut v = vec![1.5f64, -2.0];
        c.all_reduce_sum_f64(&mut v).unwrap();
        assert_eq!(v, [1.5, -2.0]);
        let mut b = b"cfg".to_vec();
        c.broadcast_bytes(0, &mut b).unwrap();
        assert_eq!(b, b"cfg");
        assert!(c.broadcast_bytes(1, &mut b).is_err(), "root out of range");
        assert!(c.send(0, 1, b"x").is_err(), "no one to send to");
        assert!(c.recv(1).is_err(), "a blocking receive would hang");
        c.barrier().unwrap();
    }
}

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
