//! [`SimGpu`]: the device seam ([`tlt_kernels::cuda::Gpu`]) on the simulated device, with a stream that is
//! asynchronous the way a GPU's is. Launches, GEMMs and copies are queued and run later: when the host waits (an
//! event, a synchronisation, a pageable download), and, under a [`Schedule::Seeded`] schedule, at random points
//! after any call. The host side of the GPU path (`CudaLlama`, `CudaTarget`, `CudaDrafter`, the graph pool, the
//! transfers) runs on it in CI through the same code it runs on a GPU, and the seam's ordering rule is checked:
//!
//! - a host read of pinned memory that a copy not yet waited for writes sees poison (`0xFF` bytes; the copy's bytes
//!   are dropped) and is recorded ([`SimGpu::races`]);
//! - a host write into pinned memory that a queued copy still reads (or writes) is an error
//!   ([`crate::Error::HostRace`]), as is freeing it (recorded: a destructor cannot return an error);
//! - during a capture only launches, GEMMs and device copies are allowed; a graph replayed after one of its buffers
//!   was freed (or freed and allocated again at the same address) is an error;
//! - a launch or copy whose pointers lie outside the live buffers is an error at once; a kernel that fails when it
//!   runs (a deadlock, a misaligned access) fails the next wait, as a sticky CUDA error does.
//!
//! [`Fault`]s re-create the first GPU run's fault (waits that wait for nothing), for negative controls.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tlt_kernels::cuda::plan::{GemmEx, Launch};
use tlt_kernels::cuda::{DeviceMem, Gpu, GpuEvent, GpuGraph, GpuInfo, PinnedMem, SharedGpu};
use tlt_kernels::SplitMix64;

use crate::exec::{self, Allocs, RunOptions, ALIGN};
use crate::{Error, LaunchRecord, Result};

/// When queued work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Only when the host waits: the most delayed a GPU can be.
    Lazy,
    /// At once, as it is queued (as under `CUDA_LAUNCH_BLOCKING=1`); the host must still wait before touching
    /// pinned memory.
    Eager,
    /// After every call, a seeded random number of the queued operations.
    Seeded(u64),
}

/// A deliberate fault of the simulated device, for negative controls: a kind of host wait that returns at once
/// without running anything, as cudarc's `PinnedHostSlice` waits did on the first GPU run (on an event a context
/// without event tracking never records).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// [`Gpu::synchronize`] waits for nothing: the wait `Fetched::fetch` makes before it reads its results.
    NoSynchronize,
    /// [`Gpu::wait`] (an event) waits for nothing: the wait `Staged::send` makes before it rewrites its staging
    /// buffer.
    NoEventWaits,
}

/// One queued operation.
#[derive(Debug, Clone)]
enum Op {
    Launch(Launch),
    Gemm(GemmEx),
    Copy {
        src: u64,
        dst: u64,
        bytes: usize,
    },
    Memset {
        dst: u64,
        bytes: usize,
    },
    /// From pinned memory at `src` (read when the copy runs).
    UploadPinned {
        src: u64,
        dst: u64,
        bytes: usize,
    },
    /// From bytes the host handed over (pageable memory is consumed at the call).
    UploadOwned {
        data: Vec<u8>,
        dst: u64,
    },
    /// Into pinned memory at `dst` (`cancelled` when the host read it too early or freed it).
    DownloadPinned {
        src: u64,
        dst: u64,
        bytes: usize,
        cancelled: bool,
    },
    Replay(Arc<Captured>),
    /// A stream-ordered free of a device allocation.
    Free {
        addr: u64,
        bytes: usize,
    },
}

/// A captured graph: its operations and the allocations (start, id) their pointers lie in.
#[derive(Debug)]
struct Captured {
    device: u64,
    ops: Vec<Op>,
    buffers: Vec<(u64, u64)>,
}

/// A pinned allocation's last queued copies (sequence numbers).
#[derive(Debug, Clone, Copy, Default)]
struct PinnedUse {
    bytes: usize,
    last_read: u64,
    last_write: u64,
}

#[derive(Debug)]
struct State {
    /// Allocations the host holds (checked when work is queued).
    live: Allocs,
    /// Allocations not yet freed in stream order (checked when work runs).
    physical: Allocs,
    pinned: HashMap<u64, PinnedUse>,
    queue: VecDeque<(u64, Op)>,
    /// Sequence number of the last queued operation.
    queued: u64,
    /// The last sequence number the host waited for.
    waited: u64,
    capture: Option<Vec<Op>>,
    capture_broken: Option<String>,
    schedule: Schedule,
    rng: SplitMix64,
    faults: Vec<Fault>,
    /// The first failure of queued work, reported by the next wait.
    sticky: Option<Error>,
    log: Vec<LaunchRecord>,
    gemms: u64,
    races: Vec<String>,
    ran_later: u64,
    /// Bytes copied from the device to the host (pageable and pinned).
    downloaded: u64,
}

static NEXT_DEVICE: AtomicU64 = AtomicU64::new(1);

/// The simulated device behind the [`Gpu`] seam (see the module docs). Cheap to clone: clones share the device.
#[derive(Clone)]
pub struct SimGpu {
    id: u64,
    info: GpuInfo,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for SimGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimGpu").field("id", &self.id).field("name", &self.info.name).finish_non_exhaustive()
    }
}

impl Default for SimGpu {
    fn default() -> Self {
        Self::new(Schedule::Lazy)
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn to_kernels(e: Error) -> tlt_kernels::Error {
    tlt_kernels::Error::Cuda { op: "simulated device", message: e.to_string() }
}

impl SimGpu {
    /// A simulated device with 4 multiprocessors (so split attention cuts even short contexts into chunks) whose
    /// stream runs work as `schedule` says.
    #[must_use]
    pub fn new(schedule: Schedule) -> Self {
        let seed = match schedule {
            Schedule::Seeded(s) => s,
            _ => 0,
        };
        let state = State {
            live: Allocs::default(),
            physical: Allocs::default(),
            pinned: HashMap::new(),
            queue: VecDeque::new(),
            queued: 0,
            waited: 0,
            capture: None,
            capture_broken: None,
            schedule,
            rng: SplitMix64::new(seed),
            faults: Vec::new(),
            sticky: None,
            log: Vec::new(),
            gemms: 0,
            races: Vec::new(),
            ran_later: 0,
            downloaded: 0,
        };
        let info = GpuInfo {
            name: format!("simulated ({schedule:?})"),
            arch: 90,
            multiprocessors: 4,
            total_memory: 1 << 32,
            simulated: true,
            attention_blocks_per_sm: tlt_kernels::cuda::plan::ATTENTION_BLOCKS_PER_SM,
        };
        Self { id: NEXT_DEVICE.fetch_add(1, Ordering::Relaxed), info, state: Arc::new(Mutex::new(state)) }
    }

    /// The schedules CI runs the host code under: lazy, eager and three seeds.
    #[must_use]
    pub fn schedules() -> [Schedule; 5] {
        [Schedule::Lazy, Schedule::Eager, Schedule::Seeded(1), Schedule::Seeded(2), Schedule::Seeded(3)]
    }

    /// The same device with `fault` too, from now on.
    #[must_use]
    pub fn with_fault(self, fault: Fault) -> Self {
        lock(&self.state).faults.push(fault);
        self
    }

    /// Ordering violations so far (host reads of pinned memory before the wait, pinned memory freed under a copy).
    #[must_use]
    pub fn races(&self) -> Vec<String> {
        lock(&self.state).races.clone()
    }

    /// The launches that have run so far (graph replays included).
    #[must_use]
    pub fn launches(&self) -> Vec<LaunchRecord> {
        lock(&self.state).log.clone()
    }

    /// GEMMs that have run so far.
    #[must_use]
    pub fn gemms(&self) -> u64 {
        lock(&self.state).gemms
    }

    /// Bytes copied from the device to the host so far (pageable and pinned downloads).
    #[must_use]
    pub fn downloaded_bytes(&self) -> u64 {
        lock(&self.state).downloaded
    }

    /// Bytes of device memory allocated and not yet freed (what a memory plan is checked against).
    #[must_use]
    pub fn live_bytes(&self) -> u64 {
        lock(&self.state).live.bytes()
    }

    /// Operations that ran after the call that queued them returned (the stream was asynchronous).
    #[must_use]
    pub fn ran_later(&self) -> u64 {
        lock(&self.state).ran_later
    }

    /// Queues `op` (or records it into the capture), checking its pointers against the live buffers, then lets the
    /// schedule run some of the queue.
    fn enqueue(&self, op: Op) -> Result<()> {
        let mut s = lock(&self.state);
        check_live(&s.live, &op)?;
        if let Op::UploadPinned { src: p, .. } | Op::DownloadPinned { dst: p, .. } = &op {
            if !s.pinned.contains_key(p) {
                return Err(Error::HostRace(format!("{p:#x} is not pinned memory of this device")));
            }
        }
        if let Some(c) = s.capture.as_mut() {
            match op {
                Op::Launch(_) | Op::Gemm(_) | Op::Copy { .. } | Op::Memset { .. } => {
                    c.push(op);
                    return Ok(());
                }
                _ => return Err(s.break_capture("a host transfer or graph replay")),
            }
        }
        s.queued += 1;
        let seq = s.queued;
        match &op {
            Op::UploadPinned { src, .. } => s.pinned.entry(*src).or_default().last_read = seq,
            Op::DownloadPinned { dst, bytes, .. } => {
                s.pinned.entry(*dst).or_default().last_write = seq;
                // In flight: what the host would see now.
                // SAFETY: `dst` is a live pinned allocation of at least `bytes` bytes (checked by the caller).
                unsafe { std::ptr::write_bytes(*dst as *mut u8, 0xFF, *bytes) };
            }
            _ => {}
        }
        s.queue.push_back((seq, op));
        s.after_call(seq);
        Ok(())
    }

    /// Runs the queue up to `seq` and counts it as waited for (unless `fault` is on: a wait that waits for
    /// nothing); the sticky error, if any.
    fn wait_for(&self, seq: u64, fault: Option<Fault>) -> Result<()> {
        let mut s = lock(&self.state);
        if s.capture.is_some() {
            return Err(s.break_capture("a host wait"));
        }
        if fault.is_some_and(|f| s.faults.contains(&f)) {
            return Ok(());
        }
        let n = s.queue.iter().take_while(|(q, _)| *q <= seq).count();
        s.run(n, None);
        s.waited = s.waited.max(seq);
        match s.sticky.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Every pointer `op` touches must lie in a live allocation (pinned ones are checked by their callers).
fn check_live(live: &Allocs, op: &Op) -> Result<()> {
    let range = |kernel: &str, arg: usize, addr: u64, bytes: usize| {
        live.find(addr, bytes as u64).map(|_| ()).ok_or(Error::BadPointer { kernel: kernel.into(), arg, addr })
    };
    match op {
        Op::Launch(l) => {
            for (i, p) in exec::pointers(l).enumerate() {
                if live.find(p, 0).is_none() {
                    return Err(Error::BadPointer { kernel: l.kernel.into(), arg: i, addr: p });
                }
            }
            Ok(())
        }
        Op::Copy { src, dst, bytes } => range("memcpy", 0, *src, *bytes).and(range("memcpy", 1, *dst, *bytes)),
        Op::Memset { dst, bytes } => range("memset", 0, *dst, *bytes),
        Op::UploadPinned { dst, bytes, .. } => range("upload", 1, *dst, *bytes),
        Op::DownloadPinned { src, bytes, .. } => range("download", 0, *src, *bytes),
        Op::UploadOwned { data, dst } => range("upload", 0, *dst, data.len()),
        Op::Gemm(_) | Op::Replay(_) | Op::Free { .. } => Ok(()),
    }
}

impl State {
    fn break_capture(&mut self, what: &str) -> Error {
        let msg = format!("{what} while the stream captures a graph (CUDA invalidates the capture)");
        self.capture_broken.get_or_insert(msg.clone());
        Error::Graph(msg)
    }

    /// What the schedule runs at the end of the call that queued operation `seq`.
    fn after_call(&mut self, seq: u64) {
        let n = match self.schedule {
            Schedule::Lazy => 0,
            Schedule::Eager => self.queue.len(),
            Schedule::Seeded(_) => {
                let len = self.queue.len();
                self.rng.below(len + 1)
            }
        };
        self.run(n, Some(seq));
    }

    /// Runs the first `n` queued operations (`queuing`: the operation the current call queued, which runs "at
    /// once"; every other ran after the call that queued it returned); a failure becomes the sticky error (the rest
    /// still runs, as a GPU's stream goes on after a failed kernel until the host looks).
    fn run(&mut self, n: usize, queuing: Option<u64>) {
        for _ in 0..n {
            let Some((seq, op)) = self.queue.pop_front() else { return };
            if Some(seq) != queuing {
                self.ran_later += 1;
            }
            if let Err(e) = self.execute(&op) {
                self.sticky.get_or_insert(e);
            }
        }
    }

    fn execute(&mut self, op: &Op) -> Result<()> {
        match op {
            Op::Launch(l) => {
                self.log.push(LaunchRecord::of(l));
                exec::launch(&self.physical, l, RunOptions::default()).map(|_| ())
            }
            Op::Gemm(g) => {
                self.gemms += 1;
                exec::gemm(&self.physical, g)
            }
            Op::Copy { src, dst, bytes } => exec::copy(&self.physical, *src, *dst, *bytes),
            Op::Memset { dst, bytes } => exec::memset_zero(&self.physical, *dst, *bytes),
            Op::UploadPinned { src, dst, bytes } => {
                if self.physical.find(*dst, *bytes as u64).is_none() {
                    return Err(Error::BadPointer { kernel: "upload".into(), arg: 0, addr: *dst });
                }
                // SAFETY: `src` is a pinned allocation that is still alive (freeing it with this copy queued cancels
                // nothing but is recorded as a race, and the owner waits; see `PinnedOwner::drop`), `dst` a
                // physical device range of `bytes` bytes.
                unsafe { std::ptr::copy(*src as *const u8, *dst as *mut u8, *bytes) };
                Ok(())
            }
            Op::UploadOwned { data, dst } => {
                if self.physical.find(*dst, data.len() as u64).is_none() {
                    return Err(Error::BadPointer { kernel: "upload".into(), arg: 0, addr: *dst });
                }
                // SAFETY: checked physical range.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), *dst as *mut u8, data.len()) };
                Ok(())
            }
            Op::DownloadPinned { src, dst, bytes, cancelled } => {
                if *cancelled {
                    return Ok(());
                }
                if self.physical.find(*src, *bytes as u64).is_none() {
                    return Err(Error::BadPointer { kernel: "download".into(), arg: 0, addr: *src });
                }
                // SAFETY: a live pinned allocation (cancelled otherwise) and a physical device range.
                unsafe { std::ptr::copy(*src as *const u8, *dst as *mut u8, *bytes) };
                Ok(())
            }
            Op::Replay(g) => {
                for &(start, id) in &g.buffers {
                    if self.physical.id_at(start) != Some(id) {
                        return Err(Error::Graph(format!(
                            "a graph replayed after its buffer at {start:#x} (allocation #{id}) was freed or moved"
                        )));
                    }
                }
                for op in &g.ops {
                    self.execute(op)?;
                }
                Ok(())
            }
            Op::Free { addr, bytes } => {
                self.physical.remove(*addr);
                // SAFETY: the allocation came from `alloc_raw(bytes, ALIGN)` and is freed once, in stream order.
                unsafe { exec::free_raw(*addr as *mut u8, *bytes, ALIGN) };
                Ok(())
            }
        }
    }

    /// Checks a host access to pinned memory at `ptr`: `write` (the host will write it) or a read.
    fn host_access(&mut self, ptr: u64, write: bool) -> Result<()> {
        let Some(u) = self.pinned.get(&ptr).copied() else {
            return Err(Error::HostRace(format!("{ptr:#x} is not pinned memory of this device")));
        };
        let unwaited_write = u.last_write > self.waited;
        if write && (u.last_read > self.waited || unwaited_write) {
            let seq = if u.last_read > self.waited { u.last_read } else { u.last_write };
            return Err(Error::HostRace(format!(
                "the host writes pinned memory at {ptr:#x} that queued copy #{seq} still uses (no wait since)"
            )));
        }
        if !write && unwaited_write {
            self.races.push(format!(
                "the host read pinned memory at {ptr:#x} before waiting for copy #{} into it: it saw poison",
                u.last_write
            ));
            for (_, op) in self.queue.iter_mut() {
                if let Op::DownloadPinned { dst, cancelled, .. } = op {
                    if *dst == ptr {
                        *cancelled = true;
                    }
                }
            }
            // SAFETY: a live pinned allocation of `u.bytes` bytes.
            unsafe { std::ptr::write_bytes(ptr as *mut u8, 0xFF, u.bytes) };
        }
        Ok(())
    }
}

/// Owns a device allocation: its drop frees it in stream order.
#[derive(Debug)]
struct DeviceOwner {
    gpu: SimGpu,
    addr: u64,
    bytes: usize,
}

impl Drop for DeviceOwner {
    fn drop(&mut self) {
        lock(&self.gpu.state).live.remove(self.addr);
        let free = Op::Free { addr: self.addr, bytes: self.bytes };
        let mut s = lock(&self.gpu.state);
        s.queued += 1;
        let seq = s.queued;
        s.queue.push_back((seq, free));
        s.after_call(seq);
    }
}

/// Owns a pinned allocation. Pinned memory is freed at once (not in stream order): freeing it while a queued copy
/// still uses it is recorded as a race, and that copy is cancelled.
#[derive(Debug)]
struct PinnedOwner {
    gpu: SimGpu,
    ptr: u64,
    bytes: usize,
}

impl Drop for PinnedOwner {
    fn drop(&mut self) {
        let mut s = lock(&self.gpu.state);
        let u = s.pinned.remove(&self.ptr).unwrap_or_default();
        if u.last_read > s.waited || u.last_write > s.waited {
            s.races.push(format!("pinned memory at {:#x} freed while a queued copy still uses it", self.ptr));
            let ptr = self.ptr;
            s.queue.retain(|(_, op)| {
                !matches!(op, Op::UploadPinned { src, .. } if *src == ptr)
                    && !matches!(op, Op::DownloadPinned { dst, .. } if *dst == ptr)
            });
        }
        drop(s);
        // SAFETY: allocated by `alloc_pinned` with these sizes, freed once; no queued copy refers to it any more.
        unsafe { exec::free_raw(self.ptr as *mut u8, self.bytes, ALIGN) };
    }
}

/// A recorded point of the stream.
#[derive(Debug)]
struct SimEvent {
    device: u64,
    seq: u64,
}

impl Gpu for SimGpu {
    fn info(&self) -> &GpuInfo {
        &self.info
    }

    fn alloc(&self, bytes: usize) -> tlt_kernels::Result<DeviceMem> {
        let bytes = bytes.max(1);
        let p = exec::alloc_raw(bytes, ALIGN) as u64;
        {
            let mut s = lock(&self.state);
            s.live.insert(p, bytes);
            s.physical.insert(p, bytes);
        }
        Ok(DeviceMem::new(p, bytes, Box::new(DeviceOwner { gpu: self.clone(), addr: p, bytes })))
    }

    fn alloc_pinned(&self, bytes: usize, _write_combined: bool) -> tlt_kernels::Result<PinnedMem> {
        let bytes = bytes.max(1);
        let p = exec::alloc_raw(bytes, ALIGN);
        lock(&self.state).pinned.insert(p as u64, PinnedUse { bytes, ..PinnedUse::default() });
        let owner = PinnedOwner { gpu: self.clone(), ptr: p as u64, bytes };
        // SAFETY: `bytes` zeroed bytes (alloc_raw), freed only by the owner's drop; the simulated device touches
        // them only in copies the ordering checks allow.
        Ok(unsafe { PinnedMem::new(p, bytes, Box::new(owner)) })
    }

    fn launch(&self, launch: &Launch) -> tlt_kernels::Result<()> {
        self.enqueue(Op::Launch(launch.clone())).map_err(to_kernels)
    }

    fn gemm(&self, gemm: &GemmEx) -> tlt_kernels::Result<()> {
        self.enqueue(Op::Gemm(*gemm)).map_err(to_kernels)
    }

    fn copy(&self, src: u64, dst: u64, bytes: usize) -> tlt_kernels::Result<()> {
        self.enqueue(Op::Copy { src, dst, bytes }).map_err(to_kernels)
    }

    fn memset_zero(&self, dst: u64, bytes: usize) -> tlt_kernels::Result<()> {
        self.enqueue(Op::Memset { dst, bytes }).map_err(to_kernels)
    }

    fn upload_pinned(&self, src: &PinnedMem, dst: u64, bytes: usize) -> tlt_kernels::Result<()> {
        if bytes > src.bytes() {
            return Err(tlt_kernels::Error::InvalidArgument(format!("{bytes} bytes from {} pinned", src.bytes())));
        }
        self.enqueue(Op::UploadPinned { src: src.ptr() as u64, dst, bytes }).map_err(to_kernels)
    }

    fn download_pinned(&self, src: u64, dst: &PinnedMem, bytes: usize) -> tlt_kernels::Result<()> {
        if bytes > dst.bytes() {
            return Err(tlt_kernels::Error::InvalidArgument(format!("{bytes} bytes into {} pinned", dst.bytes())));
        }
        lock(&self.state).downloaded += bytes as u64;
        self.enqueue(Op::DownloadPinned { src, dst: dst.ptr() as u64, bytes, cancelled: false }).map_err(to_kernels)
    }

    fn upload(&self, src: &[u8], dst: u64) -> tlt_kernels::Result<()> {
        self.enqueue(Op::UploadOwned { data: src.to_vec(), dst }).map_err(to_kernels)
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> tlt_kernels::Result<()> {
        let seq = lock(&self.state).queued;
        self.wait_for(seq, None).map_err(to_kernels)?;
        let mut s = lock(&self.state);
        if s.physical.find(src, dst.len() as u64).is_none() {
            return Err(to_kernels(Error::BadPointer { kernel: "download".into(), arg: 0, addr: src }));
        }
        s.downloaded += dst.len() as u64;
        // SAFETY: a physical device range of `dst.len()` bytes; all work queued before has run.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn record(&self) -> tlt_kernels::Result<GpuEvent> {
        let mut s = lock(&self.state);
        if s.capture.is_some() {
            return Err(to_kernels(s.break_capture("an event record")));
        }
        Ok(GpuEvent(Box::new(SimEvent { device: self.id, seq: s.queued })))
    }

    fn wait(&self, event: &GpuEvent) -> tlt_kernels::Result<()> {
        let e = event
            .0
            .downcast_ref::<SimEvent>()
            .filter(|e| e.device == self.id)
            .ok_or_else(|| tlt_kernels::Error::InvalidArgument("an event of another device".into()))?;
        self.wait_for(e.seq, Some(Fault::NoEventWaits)).map_err(to_kernels)
    }

    fn synchronize(&self) -> tlt_kernels::Result<()> {
        let seq = lock(&self.state).queued;
        self.wait_for(seq, Some(Fault::NoSynchronize)).map_err(to_kernels)
    }

    fn pinned_read<'a>(&self, mem: &'a PinnedMem) -> tlt_kernels::Result<&'a [u8]> {
        lock(&self.state).host_access(mem.ptr() as u64, false).map_err(to_kernels)?;
        Ok(mem.as_slice())
    }

    fn pinned_write<'a>(&self, mem: &'a mut PinnedMem) -> tlt_kernels::Result<&'a mut [u8]> {
        lock(&self.state).host_access(mem.ptr() as u64, true).map_err(to_kernels)?;
        Ok(mem.as_mut_slice())
    }

    fn begin_capture(&self) -> tlt_kernels::Result<()> {
        let mut s = lock(&self.state);
        if s.capture.is_some() {
            return Err(to_kernels(Error::Graph("begin_capture while already capturing".into())));
        }
        s.capture = Some(Vec::new());
        s.capture_broken = None;
        Ok(())
    }

    fn end_capture(&self) -> tlt_kernels::Result<Option<GpuGraph>> {
        let mut s = lock(&self.state);
        let ops = s.capture.take().ok_or_else(|| to_kernels(Error::Graph("end_capture without a capture".into())))?;
        if let Some(why) = s.capture_broken.take() {
            return Err(to_kernels(Error::Graph(format!("the capture was invalidated: {why}"))));
        }
        if ops.is_empty() {
            return Ok(None);
        }
        let mut buffers = Vec::new();
        for op in &ops {
            let ptrs: Vec<u64> = match op {
                Op::Launch(l) => exec::pointers(l).collect(),
                Op::Gemm(g) => vec![g.a, g.b, g.c],
                Op::Copy { src, dst, .. } => vec![*src, *dst],
                Op::Memset { dst, .. } => vec![*dst],
                _ => Vec::new(),
            };
            for p in ptrs {
                let at = s
                    .live
                    .find(p, 0)
                    .ok_or_else(|| to_kernels(Error::BadPointer { kernel: "graph capture".into(), arg: 0, addr: p }))?;
                if !buffers.contains(&at) {
                    buffers.push(at);
                }
            }
        }
        Ok(Some(GpuGraph(Box::new(Arc::new(Captured { device: self.id, ops, buffers })))))
    }

    fn replay(&self, graph: &GpuGraph) -> tlt_kernels::Result<()> {
        let g = graph
            .0
            .downcast_ref::<Arc<Captured>>()
            .filter(|g| g.device == self.id)
            .ok_or_else(|| tlt_kernels::Error::InvalidArgument("a graph of another device".into()))?
            .clone();
        {
            let s = lock(&self.state);
            for &(start, id) in &g.buffers {
                if s.live.id_at(start) != Some(id) {
                    return Err(to_kernels(Error::Graph(format!(
                        "a graph replayed after its buffer at {start:#x} (allocation #{id}) was freed or moved"
                    ))));
                }
            }
        }
        self.enqueue(Op::Replay(g)).map_err(to_kernels)
    }

    fn memory(&self) -> tlt_kernels::Result<(usize, usize)> {
        let total = self.info.total_memory;
        Ok((total / 2, total))
    }
}

/// The devices a device test of the host code runs on: the CUDA device when a driver loads (then only it: the
/// simulated runs belong to CI), else one simulated device per schedule of `schedules`. Prints which, under `test`.
///
/// # Errors
/// With `TLT_REQUIRE_GPU=1` (the GPU plan sets it) when no driver loads or the device cannot be opened.
pub fn test_devices(test: &str, schedules: &[Schedule]) -> tlt_kernels::Result<Vec<SharedGpu>> {
    let required = std::env::var("TLT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    if tlt_kernels::cuda::driver_available() || required {
        let gpu = tlt_kernels::cuda::open_device(0)?;
        println!("{test}: on {}", gpu.info().name);
        return Ok(vec![gpu]);
    }
    println!("{test}: on the simulated device, schedules {schedules:?}");
    Ok(schedules.iter().map(|&s| Arc::new(SimGpu::new(s)) as SharedGpu).collect())
}
