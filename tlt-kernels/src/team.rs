//! A team of spinning helper threads for the short parallel loops of small-batch decoding.
//!
//! A decode step of a small model is a few hundred GEMMs of 20–200 µs each. Handing each one to rayon's pool
//! from a thread outside it costs a sleep/wake round trip per call (measured at ~10% of a SmolLM2-135M decode
//! step on a 2-vCPU EPYC VM, as scheduler time). Like ggml's thread pool, the helpers here spin on an atomic
//! state between jobs, so a job starts within a cache-line transfer. A helper parks on a condition variable
//! after [`SPIN`] without work, so an idle team costs nothing.
//!
//! Parts are *claimed*, not assigned: the calling thread claims parts too, so when the machine is
//! oversubscribed and a helper is not running, the caller simply runs every part itself instead of waiting for
//! it. The caller waits only for parts a helper has claimed and is running.
//!
//! `TLT_KERNELS_NO_TEAM=1` turns the team off (GEMMs then fork onto rayon's pool, attention runs on the caller),
//! for comparisons and for machines where spinning threads are unwelcome.
//!
//! One caller at a time owns the team; a concurrent caller (say, a drafter trainer beside the engine) gets
//! `false` from [`Team::run`] and runs its loop another way.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle helper spins before parking.
const SPIN: Duration = Duration::from_micros(300);

/// A type-erased job: `f(part)` for every part.
type Job = *const (dyn Fn(usize) + Sync + 'static);

struct Shared {
    /// `epoch << 32 | next unclaimed part` of the newest job: a helper claims a part of the job it saw only
    /// while the epoch still matches.
    claim: AtomicU64,
    /// Parts of the newest job (written before its epoch is published).
    parts: AtomicUsize,
    /// Parts of the newest job finished.
    done: AtomicUsize,
    /// The newest job; written only while no part of any job is claimed (see [`Team::run`]).
    job: UnsafeCell<Option<Job>>,
    /// Whether a helper's part of the newest job panicked.
    panicked: AtomicBool,
    /// Helpers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

impl Shared {
    fn new() -> Self {
        Shared {
            claim: AtomicU64::new(0),
            parts: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        }
    }
}

// SAFETY: `job` is written by the owner of `Team::owner` only after every part of the previous job has finished
// (`done == parts`), before the new epoch is published; helpers read it only after claiming a part of the new
// epoch, and the owner does not return (nor write `job` again) until that part is done.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// The process-wide team.
pub(crate) struct Team {
    shared: &'static Shared,
    helpers: usize,
    owner: Mutex<()>,
}

impl Team {
    /// The team with `threads - 1` helpers for [`crate::default_threads`] threads, started on first use;
    /// `None` when `TLT_KERNELS_NO_TEAM` is set (and not `0`).
    pub(crate) fn global() -> Option<&'static Team> {
        static TEAM: OnceLock<Option<Team>> = OnceLock::new();
        TEAM.get_or_init(|| {
            let off = std::env::var_os("TLT_KERNELS_NO_TEAM").is_some_and(|v| v != "0");
            (!off).then(|| Team::start(crate::default_threads().saturating_sub(1)))
        })
        .as_ref()
    }

    fn start(helpers: usize) -> Team {
        let shared: &'static Shared = Box::leak(Box::new(Shared::new()));
        let mut started = 0;
        for idx in 1..=helpers {
            let spawned = std::thread::Builder::new().name(format!("tlt-team-{idx}")).spawn(move || helper(shared));
            if spawned.is_err() {
                break;
            }
            started += 1;
        }
        Team { shared, helpers: started, owner: Mutex::new(()) }
    }

    /// Runs `f(0)`, …, `f(parts - 1)`, each exactly once, on the calling thread and the helpers, and returns
    /// `true`; or returns `false` without running anything when another caller owns the team. With no helpers
    /// every part runs on the calling thread. Panics if a part panicked (after every claimed part finished).
    pub(crate) fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        if parts <= 1 || self.helpers == 0 {
            (0..parts).for_each(f);
            return true;
        }
        // A poisoned lock only means an earlier job panicked; the team itself is consistent.
        let _owner = match self.owner.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        let s = self.shared;
        // SAFETY: only the lifetime is erased; parts are claimed only while this call runs (see `Shared`).
        let job: Job = unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f) };
        // SAFETY: see `Shared`: every part of the previous job has finished.
        unsafe { *s.job.get() = Some(job) };
        s.parts.store(parts, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        let epoch = (s.claim.load(Ordering::Relaxed) >> 32) + 1;
        s.claim.store(epoch << 32, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mut mine = Ok(());
        let mut ran = 0;
        while let Some(i) = try_claim(s, epoch, parts) {
            if mine.is_ok() {
                mine = catch_unwind(AssertUnwindSafe(|| f(i)));
            }
            ran += 1;
        }
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) + ran < parts {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let theirs = s.panicked.swap(false, Ordering::Relaxed);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        assert!(!theirs, "a tlt-kernels team helper panicked");
        true
    }
}

/// Claims the next part of job `epoch`, if that job is still the newest and has one left.
fn try_claim(s: &Shared, epoch: u64, parts: usize) -> Option<usize> {
    let mut c = s.claim.load(Ordering::Acquire);
    loop {
        if c >> 32 != epoch || (c & 0xFFFF_FFFF) as usize >= parts {
            return None;
        }
        match s.claim.compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some((c & 0xFFFF_FFFF) as usize),
            Err(now) => c = now,
        }
    }
}

fn helper(s: &'static Shared) {
    let mut seen = 0u64;
    loop {
        seen = wait_for_job(s, seen);
        let parts = s.parts.load(Ordering::Relaxed);
        while let Some(i) = try_claim(s, seen, parts) {
            // SAFETY: see `Shared`: having claimed a part of epoch `seen`, the job is that epoch's and stays
            // alive until our `done` increment below.
            if let Some(job) = unsafe { *s.job.get() } {
                // SAFETY: as above.
                let f = unsafe { &*job };
                if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                    s.panicked.store(true, Ordering::Relaxed);
                }
            }
            s.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// Waits until the epoch differs from `seen` (spinning for [`SPIN`], then parked) and returns the new epoch.
fn wait_for_job(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let epoch = s.claim.load(Ordering::Acquire) >> 32;
        if epoch != seen {
            return epoch;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            if start.elapsed() > SPIN {
                break;
            }
            // Give the core away if another thread wants it (an oversubscribed machine: parallel test
            // processes, a trainer beside the engine); returns at once otherwise.
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    let mut guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
    s.sleepers.fetch_add(1, Ordering::SeqCst);
    loop {
        let epoch = s.claim.load(Ordering::SeqCst) >> 32;
        if epoch != seen {
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            return epoch;
        }
        guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_per_job_even_after_parking() {
        let team = Team::start(3);
        for round in 0..2000 {
            let parts = 1 + round % 4;
            let hits: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
            assert!(team.run(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }));
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(h.load(Ordering::Relaxed), usize::from(i < parts), "round {round} part {i}");
            }
            if round % 500 == 0 {
                std::thread::sleep(SPIN * 3); // let the helpers park
            }
        }
    }

    #[test]
    fn more_parts_than_threads_all_run_once() {
        let team = Team::start(1);
        let hits: Vec<AtomicUsize> = (0..7).map(|_| AtomicUsize::new(0)).collect();
        assert!(team.run(7, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        }));
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_team_without_helpers_runs_on_the_caller() {
        let team = Team::start(0);
        let sum = AtomicUsize::new(0);
        assert!(team.run(4, &|i| {
            sum.fetch_add(i + 1, Ordering::Relaxed);
        }));
        assert_eq!(sum.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn a_busy_team_refuses_a_second_caller() {
        let team = Team::start(1);
        let inner = std::sync::atomic::AtomicBool::new(true);
        assert!(team.run(2, &|i| {
            if i == 0 {
                inner.store(team.run(2, &|_| {}), Ordering::Relaxed);
            }
        }));
        assert!(!inner.load(Ordering::Relaxed));
    }

    #[test]
    fn a_helper_panic_reaches_the_caller() {
        let team = Team::start(1);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.run(2, &|i| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        assert!(team.run(2, &|_| {}), "the team still works after a panic");
    }
}
