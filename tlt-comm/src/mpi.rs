//! Ranks as MPI processes (feature `mpi`): [`MpiComm`] over `MPI_COMM_WORLD` of the system's MPI library (Open MPI or
//! MPICH, through rsmpi). Launch with `mpirun -np N <program>` (or `srun`); a program started without a launcher is
//! a one-rank job.
//!
//! **No wait is unbounded.** Every collective runs as MPI's immediate (non-blocking) form, polled with the lock
//! released, and every wait (collectives, [`Comm::recv`], callers' loops through [`Comm::check_wait`]) ends with
//! [`Error::Unresponsive`] once it has lasted [`Deadlines::wait`], or sooner when a rank stops answering: after a
//! second of waiting a rank asks the others what they are doing (`PING`), and each rank's service thread answers
//! (`PONG`, with its current operation) even while its main thread computes; a rank that leaves a question
//! unanswered for [`Deadlines::silence`] is stopped, dead or hung. The error names every other rank, whether it
//! answers and what it last said it was doing. An abandoned operation keeps its buffers (MPI may still write them)
//! and marks the communicator failed: dropping it then aborts the job instead of finalising MPI with ranks that
//! may never arrive.
//!
//! **Any length.** MPI counts a message's elements in a C `int` (at most 2^31 - 1): all-reduces and broadcasts go as
//! consecutive chunks of at most [`MpiComm::max_count`] elements (default [`MpiComm::DEFAULT_MAX_COUNT`]), each its
//! own collective with its own bounded wait, so a flattened gradient of billions of parameters sums in pieces and
//! the copies MPI needs hold one chunk, not the whole buffer. All-gathers and messages past MPI's count are errors.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::datatype::{Equivalence, PartitionMut};
use mpi::environment::Universe;
use mpi::point_to_point::MatchedReceiveVec;
use mpi::request::{Request, StaticScope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::{Count, Threading};

use crate::{check_rank, Comm, Deadlines, Error, Result, Tag};

/// Liveness questions and answers: tags above every [`Tag`] a caller may use.
const PING: i32 = 32_766;
const PONG: i32 = 32_767;
/// The highest tag a caller may use (MPI guarantees tags up to 32,767).
const MAX_TAG: Tag = 32_765;
/// How long a wait runs before the waiting rank asks the others whether they are alive, and how often it asks.
const ASK_AFTER: Duration = Duration::from_secs(1);
/// How often the service thread answers questions.
const SERVICE_POLL: Duration = Duration::from_millis(50);

/// A buffer an immediate operation reads or writes, leaked so that it lives as long as MPI may use it; taken back
/// once the operation completed, and never freed when it is abandoned.
struct Leaked<T: 'static>(*mut [T]);

impl<T: 'static> Leaked<T> {
    fn new(v: Vec<T>) -> (Self, &'static mut [T]) {
        let buf: &'static mut [T] = Box::leak(v.into_boxed_slice());
        (Self(std::ptr::from_mut(buf)), buf)
    }

    /// The buffer back.
    ///
    /// # Safety
    /// The operation that used the buffer has completed (MPI no longer reads or writes it), and the `&'static`
    /// reference [`Self::new`] returned is no longer used.
    unsafe fn take(self) -> Vec<T> {
        // SAFETY: `self.0` came from `Box::leak` in `new`; the caller guarantees nothing else uses it.
        unsafe { Box::from_raw(self.0) }.into_vec()
    }
}

/// A message on its way: MPI's request and the buffer it reads, owned here until the request completes.
struct Pending {
    request: Request<'static, [u8]>,
    buf: Leaked<u8>,
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
                // SAFETY: the send completed, and its `&'static` buffer went into the consumed request.
                Ok(_) => drop(unsafe { p.buf.take() }),
                Err(request) => still.push(Pending { request, buf: p.buf }),
            }
        }
        self.pending = still;
    }

    /// Sends a copy of `bytes` to `to` with `tag` without waiting (completed by later calls).
    ///
    /// # Errors
    /// [`Error::Invalid`] for more bytes than MPI's `int` count (nothing is sent).
    fn send(&mut self, to: i32, tag: i32, bytes: &[u8]) -> Result<()> {
        count(bytes.len())?;
        self.progress();
        let (buf, data) = Leaked::new(bytes.to_vec());
        let request = self.world.process_at_rank(to).immediate_send_with_tag(StaticScope, &*data, tag);
        self.pending.push(Pending { request, buf });
        Ok(())
    }

    /// A message with `tag` from any rank, if one has arrived.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a message whose length MPI's `int` count cannot say (only a sender outside this crate
    /// sends one): it is left unreceived, its handle leaked, since rsmpi can neither receive nor drop it.
    fn try_recv(&mut self, tag: i32) -> Result<Option<(usize, Vec<u8>)>> {
        self.progress();
        let Some((message, status)) = self.world.any_process().immediate_matched_probe_with_tag(tag) else {
            return Ok(None);
        };
        if status.count(u8::equivalent_datatype()) < 0 {
            std::mem::forget(message);
            return Err(Error::Invalid(format!(
                "a message (tag {tag}) from rank {} longer than MPI's int count",
                status.source_rank()
            )));
        }
        let (bytes, status) = (message, status).matched_receive_vec::<u8>();
        Ok(usize::try_from(status.source_rank()).ok().map(|from| (from, bytes)))
    }
}

/// How long a closing rank waits for its last messages to be taken before it aborts the job.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

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
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while !self.pending.is_empty() && Instant::now() < deadline {
            self.progress();
            std::thread::sleep(Duration::from_millis(1));
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

/// What this rank knows of another: when it last answered, what it said it was doing, and since when a question
/// to it is unanswered.
#[derive(Debug, Clone)]
struct Peer {
    heard: Option<Instant>,
    doing: String,
    asked: Option<Instant>,
}

/// State shared by the communicator and its service thread.
struct Shared {
    handles: Mutex<Handles>,
    peers: Mutex<Vec<Peer>>,
    /// This rank's current operation, sent in answers.
    doing: Mutex<String>,
    deadlines: Mutex<Deadlines>,
    /// Operations started (numbers them in `doing`).
    ops: AtomicU64,
    /// The most elements one MPI call moves ([`MpiComm::set_max_count`]).
    max_count: AtomicUsize,
    /// An operation was abandoned (why): finalising could wait forever.
    failed: Mutex<Option<String>>,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock leaves no MPI state half-changed on our side: keep going.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `MPI_COMM_WORLD` as a [`Comm`]. Every MPI call holds one lock, so the MPI library needs only
/// `MPI_THREAD_SERIALIZED` (checked at [`MpiComm::init`]). Messages go out as immediate (non-blocking) sends of a
/// copy of the bytes, completed by later calls: two ranks sending each other large messages never wait on each
/// other (a blocking send of a large message waits until its receiver polls for it). Waits are bounded by
/// [`Deadlines`] (see the module docs).
pub struct MpiComm {
    shared: Arc<Shared>,
    service: Option<JoinHandle<()>>,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm").field("rank", &self.rank).field("size", &self.size).finish_non_exhaustive()
    }
}

// SAFETY: the MPI handles are plain integers or pointers owned by the MPI library; every use goes through the
// mutex, so calls are serialised across threads, which `init` checked the library allows (MPI_THREAD_SERIALIZED or
// more). The leaked buffers' raw pointers are only dereferenced by the thread holding that mutex.
unsafe impl Send for Shared {}
// SAFETY: as above: shared references only reach the handles through the mutex.
unsafe impl Sync for Shared {}

/// `n` as MPI's `int` count.
///
/// # Errors
/// [`Error::Invalid`] past `i32::MAX`.
fn count(n: usize) -> Result<Count> {
    Count::try_from(n).map_err(|_| Error::Invalid(format!("{n} elements exceed MPI's int count")))
}

/// `n` if it is a usable chunk limit: at least one element, at most MPI's `int` count.
///
/// # Errors
/// [`Error::Invalid`] otherwise.
fn check_max_count(n: usize) -> Result<usize> {
    if n == 0 || count(n).is_err() {
        return Err(Error::Invalid(format!("a chunk of {n} elements (1 to {} fit MPI's int count)", Count::MAX)));
    }
    Ok(n)
}

/// `0..len` as consecutive ranges of at most `max` elements (`max` 0 counts as 1); none for `len` 0.
fn chunks(len: usize, max: usize) -> impl Iterator<Item = Range<usize>> {
    let max = max.max(1);
    (0..len).step_by(max).map(move |start| start..len.min(start.saturating_add(max)))
}

/// Where each rank's part of an all-gather of `lens` bytes lies in the whole, and the whole's length.
///
/// # Errors
/// [`Error::Invalid`] when a part (-1: past MPI's count) or the whole exceeds MPI's `int` count.
fn gather_layout(lens: &[Count]) -> Result<(Vec<Count>, Count)> {
    if let Some(r) = lens.iter().position(|&l| l < 0) {
        return Err(Error::Invalid(format!("rank {r}'s part of an all-gather exceeds MPI's int count")));
    }
    let mut displs = Vec::with_capacity(lens.len());
    let mut total: Count = 0;
    for &l in lens {
        displs.push(total);
        total = total.checked_add(l).ok_or_else(|| Error::Invalid("gathered bytes exceed MPI's int count".into()))?;
    }
    Ok((displs, total))
}

/// What a chunk's wait names: the operation alone when it is one chunk, else with chunk `i` (from 0) of `total`.
fn chunk_what(what: &str, i: usize, total: usize) -> Cow<'_, str> {
    if total > 1 {
        Cow::Owned(format!("{what}, chunk {} of {total}", i + 1))
    } else {
        Cow::Borrowed(what)
    }
}

impl MpiComm {
    /// The most elements one MPI call moves unless [`Self::set_max_count`] says otherwise: 2^27. MPI counts elements
    /// in a C `int` (at most 2^31 - 1), so longer buffers go as chunks; 2^27 elements stay under 2^31 bytes even
    /// for 8-byte elements (f64), so no transport that counts bytes in an `int` overflows either, and the two copies
    /// an all-reduce chunk needs (send and receive) take at most 1 GiB each, not two of the whole buffer. An extra
    /// collective per 0.5 to 1 GiB costs nothing next to moving it.
    pub const DEFAULT_MAX_COUNT: usize = 1 << 27;

    /// Initialises MPI (once per process) and joins the world communicator, with the default [`Deadlines`].
    ///
    /// # Errors
    /// [`Error::Unavailable`] when MPI was already initialised in this process, or the library offers less than
    /// `MPI_THREAD_SERIALIZED`.
    pub fn init() -> Result<Self> {
        Self::init_with(Deadlines::default())
    }

    /// [`Self::init`] with `deadlines`; starts the service thread that answers the other ranks' liveness checks.
    ///
    /// # Errors
    /// As [`Self::init`].
    pub fn init_with(deadlines: Deadlines) -> Result<Self> {
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
        let (rank, size) = (as_usize(rank)?, as_usize(size)?);
        let shared = Arc::new(Shared {
            handles: Mutex::new(Handles { pending: Vec::new(), world, _universe: universe }),
            peers: Mutex::new(vec![Peer { heard: None, doing: "(not heard from yet)".into(), asked: None }; size]),
            doing: Mutex::new("starting".into()),
            deadlines: Mutex::new(deadlines),
            ops: AtomicU64::new(0),
            max_count: AtomicUsize::new(Self::DEFAULT_MAX_COUNT),
            failed: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let service = (size > 1).then(|| {
            let shared = shared.clone();
            std::thread::Builder::new().name("tlt-comm-liveness".into()).spawn(move || serve(&shared))
        });
        let service =
            service.transpose().map_err(|e| Error::Unavailable(format!("starting the liveness thread: {e}")))?;
        Ok(Self { shared, service, rank, size })
    }

    /// The waits' limits from now on.
    pub fn set_deadlines(&self, deadlines: Deadlines) {
        *lock(&self.shared.deadlines) = deadlines;
    }

    /// Moves at most `n` elements per MPI call from now on: longer all-reduces and broadcasts go as consecutive
    /// chunks (see [`Self::DEFAULT_MAX_COUNT`]). Every rank must use the same limit, since each chunk is its own
    /// collective. The sums and bytes do not depend on it (sums are elementwise), though with more than two ranks
    /// the MPI library may pick another summation order for another message size.
    ///
    /// # Errors
    /// [`Error::Invalid`] for 0 or more than `i32::MAX` (MPI's `int` count); the limit is then unchanged.
    pub fn set_max_count(&self, n: usize) -> Result<()> {
        self.shared.max_count.store(check_max_count(n)?, Ordering::Relaxed);
        Ok(())
    }

    /// The most elements one MPI call moves ([`Self::set_max_count`]; [`Self::DEFAULT_MAX_COUNT`] at first).
    #[must_use]
    pub fn max_count(&self) -> usize {
        self.shared.max_count.load(Ordering::Relaxed)
    }

    fn world(&self) -> MutexGuard<'_, Handles> {
        lock(&self.shared.handles)
    }

    fn peer(&self, rank: usize) -> Result<i32> {
        check_rank(self, rank)?;
        i32::try_from(rank).map_err(|_| Error::Invalid(format!("rank {rank}")))
    }

    /// Says (in answers to liveness checks) that this rank now runs `op`; returns its description.
    fn enter(&self, op: &str) -> String {
        let n = self.shared.ops.fetch_add(1, Ordering::Relaxed) + 1;
        let what = format!("{op} #{n}");
        *lock(&self.shared.doing) = format!("in {what}");
        what
    }

    fn leave(&self, what: &str) {
        *lock(&self.shared.doing) = format!("computing, after {what}");
    }

    /// Polls `request` (started by `start` under the lock) until it completes, the lock released between polls,
    /// and bounded by [`Comm::check_wait`]; on an error the request is abandoned (its buffers stay leaked) and
    /// the communicator marked failed.
    fn complete<R: ?Sized>(&self, what: &str, request: Request<'static, R, StaticScope>) -> Result<()> {
        let since = Instant::now();
        let mut request = Some(request);
        let mut spins = 0u32;
        loop {
            if let Some(r) = request.take() {
                let _held = self.world();
                match r.test() {
                    Ok(_) => return Ok(()),
                    Err(r) => request = Some(r),
                }
            }
            if let Err(e) = self.check_wait(what, since) {
                // Abandoned: MPI may still use the request's buffers, so they stay leaked.
                std::mem::forget(request);
                return Err(e);
            }
            spins += 1;
            if spins < 200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// An all-reduce (sum) of `buf` in place, in chunks of at most [`Self::max_count`] elements, each through the
    /// same two chunk-sized copies (MPI reads one and writes the other). An empty `buf` moves nothing.
    fn all_reduce<T>(&self, op: &str, buf: &mut [T]) -> Result<()>
    where
        T: Copy + Default + 'static,
        [T]: Buffer + BufferMut,
    {
        let what = self.enter(op);
        let max = self.max_count();
        let total = buf.len().div_ceil(max);
        let (mut send, mut recv) = (Vec::new(), Vec::new());
        for (i, range) in chunks(buf.len(), max).enumerate() {
            let part = &mut buf[range];
            send.clear();
            send.extend_from_slice(part);
            recv.resize(part.len(), T::default());
            (send, recv) = self.all_reduce_chunk(&chunk_what(&what, i, total), send, recv)?;
            part.copy_from_slice(&recv);
        }
        self.leave(&what);
        Ok(())
    }

    /// One all-reduce (sum) of `send` into `recv` (same length, within MPI's count); both back once it completed.
    fn all_reduce_chunk<T>(&self, what: &str, send: Vec<T>, recv: Vec<T>) -> Result<(Vec<T>, Vec<T>)>
    where
        T: 'static,
        [T]: Buffer + BufferMut,
    {
        count(send.len().max(recv.len()))?;
        let (send, send_ref) = Leaked::new(send);
        let (recv, recv_ref) = Leaked::new(recv);
        let request =
            self.world().world.immediate_all_reduce_into(StaticScope, &*send_ref, recv_ref, SystemOperation::sum());
        self.complete(what, request)?;
        // SAFETY: the all-reduce completed; its references went into the consumed request.
        Ok(unsafe { (send.take(), recv.take()) })
    }

    /// Every rank's `mine` (one value each), in rank order.
    fn all_gather_one(&self, what: &str, mine: Count) -> Result<Vec<Count>> {
        let (send, send_ref) = Leaked::new(vec![mine]);
        let (recv, recv_ref) = Leaked::new(vec![0 as Count; self.size]);
        let request = self.world().world.immediate_all_gather_into(StaticScope, &*send_ref, recv_ref);
        self.complete(what, request)?;
        // SAFETY: completed, as above.
        Ok(unsafe { (send.take(), recv.take()) }.1)
    }

    /// `root`'s `buf` into every rank's `buf` (same length everywhere), in chunks of at most `max` bytes, each
    /// through the same chunk-sized copy. An empty `buf` moves nothing (and MPI may reject an empty buffer's
    /// dangling address).
    fn broadcast_into(&self, what: &str, root: i32, buf: &mut [u8], max: usize) -> Result<()> {
        let total = buf.len().div_ceil(max.max(1));
        let mut data = Vec::new();
        for (i, range) in chunks(buf.len(), max).enumerate() {
            let part = &mut buf[range];
            data.clear();
            data.extend_from_slice(part);
            data = self.broadcast_chunk(&chunk_what(what, i, total), root, data)?;
            part.copy_from_slice(&data);
        }
        Ok(())
    }

    /// One broadcast of `root`'s `data` into every rank's (within MPI's count); back once it completed.
    fn broadcast_chunk(&self, what: &str, root: i32, data: Vec<u8>) -> Result<Vec<u8>> {
        count(data.len())?;
        let (data, data_ref) = Leaked::new(data);
        let request = self.world().world.process_at_rank(root).immediate_broadcast_into(StaticScope, data_ref);
        self.complete(what, request)?;
        // SAFETY: completed, as above.
        Ok(unsafe { data.take() })
    }
}

/// The service thread: answers the other ranks' liveness questions with what this rank is doing, until stopped.
fn serve(shared: &Shared) {
    while !shared.stop.load(Ordering::Relaxed) {
        {
            let mut h = lock(&shared.handles);
            while let Ok(Some((from, _))) = h.try_recv(PING) {
                let doing = lock(&shared.doing).clone();
                if let Ok(to) = i32::try_from(from) {
                    // An answer is a short string: within MPI's count.
                    let _ = h.send(to, PONG, doing.as_bytes());
                }
            }
        }
        std::thread::sleep(SERVICE_POLL);
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.service.take() {
            let _ = t.join();
        }
        if let Some(why) = lock(&self.shared.failed).take() {
            // An abandoned operation: other ranks may never arrive at what finalising waits for.
            eprintln!("tlt-comm: {why}: aborting the MPI job");
            self.world().world.abort(75);
        }
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
        let what = self.enter("barrier");
        let request = self.world().world.immediate_barrier();
        self.complete(&what, request)?;
        self.leave(&what);
        Ok(())
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce("all-reduce (f32)", buf)
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.all_reduce("all-reduce (f64)", buf)
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let what = self.enter("all-gather");
        // A part past MPI's count goes as -1, so that every rank (not only its own) returns the error.
        let lens = self.all_gather_one(&what, count(mine.len()).unwrap_or(-1))?;
        let (displs, total) = gather_layout(&lens)?;
        if total == 0 {
            // Every part empty: nothing to move (and MPI may reject a zero-length buffer's dangling address).
            self.leave(&what);
            return Ok(vec![Vec::new(); self.size]);
        }
        let (send, send_ref) = Leaked::new(mine.to_vec());
        let (all, all_ref) = Leaked::new(vec![0u8; usize::try_from(total).unwrap_or(0)]);
        let part: &'static mut PartitionMut<'static, [u8], Vec<Count>, Vec<Count>> =
            Box::leak(Box::new(PartitionMut::new(all_ref, lens.clone(), displs.clone())));
        let part_ptr = std::ptr::from_mut(part);
        let request = self.world().world.immediate_all_gather_varcount_into(StaticScope, &*send_ref, part);
        self.complete(&what, request)?;
        // SAFETY: the gather completed; the partition (and through it the buffer) went into the consumed request.
        let all = unsafe {
            drop(Box::from_raw(part_ptr));
            drop(send.take());
            all.take()
        };
        let mut out = Vec::with_capacity(self.size);
        for (&d, &l) in displs.iter().zip(&lens) {
            let (d, l) = (usize::try_from(d).unwrap_or(0), usize::try_from(l).unwrap_or(0));
            out.push(all[d..d + l].to_vec());
        }
        self.leave(&what);
        Ok(out)
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<()> {
        let root = self.peer(root)?;
        let what = self.enter("broadcast");
        let max = self.max_count();
        let mut len = u64::try_from(buf.len()).unwrap_or(u64::MAX).to_le_bytes();
        self.broadcast_into(&what, root, &mut len, max)?;
        let len = u64::from_le_bytes(len);
        buf.resize(usize::try_from(len).map_err(|_| Error::Invalid(format!("a broadcast of {len} bytes")))?, 0);
        self.broadcast_into(&what, root, buf, max)?;
        self.leave(&what);
        Ok(())
    }

    fn send(&self, to: usize, tag: Tag, bytes: &[u8]) -> Result<()> {
        if to == self.rank {
            return Err(Error::Invalid(format!("rank {to} sending to itself")));
        }
        if tag > MAX_TAG {
            return Err(Error::Invalid(format!("tag {tag} (at most {MAX_TAG}; higher ones are the liveness checks')")));
        }
        let to = self.peer(to)?;
        self.world().send(to, i32::from(tag), bytes)
    }

    fn try_recv(&self, tag: Tag) -> Result<Option<(usize, Vec<u8>)>> {
        self.world().try_recv(i32::from(tag))
    }

    fn recv(&self, tag: Tag) -> Result<(usize, Vec<u8>)> {
        // Poll rather than block inside the lock: other threads of this rank keep their access to MPI.
        let what = self.enter(&format!("a receive (tag {tag})"));
        let since = Instant::now();
        loop {
            if let Some(m) = self.try_recv(tag)? {
                self.leave(&what);
                return Ok(m);
            }
            self.check_wait(&what, since)?;
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn check_wait(&self, what: &str, since: Instant) -> Result<()> {
        let waited = since.elapsed();
        if waited < ASK_AFTER {
            return Ok(());
        }
        let deadlines = *lock(&self.shared.deadlines);
        let now = Instant::now();
        let mut peers = lock(&self.shared.peers);
        {
            let mut h = self.world();
            while let Ok(Some((from, bytes))) = h.try_recv(PONG) {
                if let Some(p) = peers.get_mut(from) {
                    *p = Peer { heard: Some(now), doing: String::from_utf8_lossy(&bytes).into_owned(), asked: None };
                }
            }
            for (r, p) in peers.iter_mut().enumerate() {
                let recent = p.heard.is_some_and(|t| now.duration_since(t) < ASK_AFTER);
                if r != self.rank && p.asked.is_none() && !recent {
                    if let Ok(to) = i32::try_from(r) {
                        if h.send(to, PING, &[]).is_ok() {
                            p.asked = Some(now);
                        }
                    }
                }
            }
        }
        let silent = |p: &Peer| p.asked.is_some_and(|t| now.duration_since(t) > deadlines.silence);
        if waited <= deadlines.wait && !peers.iter().any(silent) {
            return Ok(());
        }
        let report: Vec<String> = peers
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != self.rank)
            .map(|(r, p)| {
                let last = match p.heard {
                    Some(t) => format!("last answered {:.1?} ago, {}", now.duration_since(t), p.doing),
                    None => "never answered".to_string(),
                };
                if silent(p) {
                    format!("rank {r} has not answered for {:.1?} (stopped, dead or hung; {last})", deadlines.silence)
                } else {
                    format!("rank {r} answers ({last})")
                }
            })
            .collect();
        let e = Error::Unresponsive { rank: self.rank, what: what.to_string(), waited, peers: report.join("; ") };
        // The job cannot go on: dropping this communicator aborts it rather than finalising (which waits for
        // every rank).
        *lock(&self.shared.failed) = Some(e.to_string());
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length and limit of a small grid: the chunks cover `0..len` in order, without gaps or overlaps, each
    /// of 1 to `max` elements, all but the last exactly `max`, `len.div_ceil(max)` of them.
    #[test]
    fn chunks_cover_the_buffer_in_order_within_the_limit() {
        for len in 0..60 {
            for max in 1..20 {
                let parts: Vec<_> = chunks(len, max).collect();
                assert_eq!(parts.len(), len.div_ceil(max), "len {len}, max {max}");
                let mut next = 0;
                for (i, p) in parts.iter().enumerate() {
                    assert_eq!(p.start, next, "len {len}, max {max}: {parts:?}");
                    assert!(!p.is_empty() && p.len() <= max, "len {len}, max {max}: {parts:?}");
                    assert!(i + 1 == parts.len() || p.len() == max, "len {len}, max {max}: {parts:?}");
                    next = p.end;
                }
                assert_eq!(next, len, "len {len}, max {max}");
            }
        }
    }

    /// Past `i32::MAX` elements (a 2.1-billion-parameter gradient): chunks within MPI's count, none past the end,
    /// computed without touching memory.
    #[test]
    fn a_buffer_past_mpis_count_goes_as_chunks_within_it() {
        let len = 5 * (1usize << 30) + 3;
        let max = MpiComm::DEFAULT_MAX_COUNT;
        let parts: Vec<_> = chunks(len, max).collect();
        assert_eq!(parts.len(), 41);
        assert!(parts.iter().all(|p| count(p.len()).is_ok()));
        assert_eq!(parts.last(), Some(&(40 * max..len)));
        // The end of a chunk near `usize::MAX` saturates rather than overflows.
        let half = usize::MAX / 2 + 1;
        assert_eq!(chunks(usize::MAX - 1, half).collect::<Vec<_>>(), [0..half, half..usize::MAX - 1]);
        assert_eq!(chunks(3, 0).count(), 3, "a zero limit counts as one");
    }

    #[test]
    fn the_chunk_limit_is_at_least_one_and_within_mpis_count() {
        assert!(check_max_count(0).is_err());
        assert!(check_max_count(Count::MAX as usize + 1).is_err());
        assert!(check_max_count(usize::MAX).is_err());
        assert_eq!(check_max_count(1).ok(), Some(1));
        assert_eq!(check_max_count(Count::MAX as usize).ok(), Some(Count::MAX as usize));
        assert!(check_max_count(MpiComm::DEFAULT_MAX_COUNT).is_ok());
        // Within MPI's count even in bytes, for elements of up to 8 bytes.
        assert!(count(MpiComm::DEFAULT_MAX_COUNT * std::mem::size_of::<f64>()).is_ok());
    }

    #[test]
    fn an_all_gather_part_or_whole_past_mpis_count_is_an_error() {
        assert_eq!(gather_layout(&[0, 3, 2]).ok(), Some((vec![0, 0, 3], 5)));
        assert!(gather_layout(&[4, -1, 2]).is_err_and(|e| e.to_string().contains("rank 1's part")));
        assert!(gather_layout(&[Count::MAX, 1]).is_err());
        assert_eq!(gather_layout(&[]).ok(), Some((vec![], 0)));
    }

    #[test]
    fn a_chunk_is_named_only_when_there_are_several() {
        assert_eq!(chunk_what("all-reduce (f32) #4", 0, 1), "all-reduce (f32) #4");
        assert_eq!(chunk_what("all-reduce (f32) #4", 2, 7), "all-reduce (f32) #4, chunk 3 of 7");
    }
}
