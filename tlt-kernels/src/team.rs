//! A team of spinning helper threads for the short parallel loops of small-batch decoding.
//!
//! A decode step of a small model is a few hundred GEMMs of 20–200 µs each. Handing each one to rayon's pool
//! from a thread outside it costs a sleep/wake round trip per call (measured at ~10% of a SmolLM2-135M decode
//! step on a 2-vCPU EPYC VM, as scheduler time). Like ggml's thread pool, the helpers here spin on an atomic
//! state between jobs, so a job starts within a cache-line transfer; the calling thread runs part 0 itself. A
//! helper parks on a condition variable after [`SPIN`] without work, so an idle team costs nothing.
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
    /// `epoch << 16 | parts` of the newest job.
    state: AtomicU64,
    /// Helpers still running the newest job.
    remaining: AtomicUsize,
    /// The newest job; written only while no helper can read it (see [`Team::run`]).
    job: UnsafeCell<Option<Job>>,
    /// Whether a part of the newest job panicked.
    panicked: AtomicBool,
    /// Helpers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written by the owner of `Team::owner` only while every helper that will read it is waiting
// for the state change that publishes it, and read by helpers only between that change and their decrement of
// `remaining`, which the owner waits for before returning (and before writing `job` again).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// The process-wide team.
pub(crate) struct Team {
    shared: &'static Shared,
    helpers: usize,
    owner: Mutex<()>,
}

impl Team {
    /// The team with `threads - 1` helpers for [`crate::default_threads`] threads, started on first use.
    pub(crate) fn global() -> &'static Team {
        static TEAM: OnceLock<Team> = OnceLock::new();
        TEAM.get_or_init(|| Team::start(crate::default_threads().saturating_sub(1)))
    }

    fn start(helpers: usize) -> Team {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            state: AtomicU64::new(0),
            remaining: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        }));
        let mut started = 0;
        for idx in 1..=helpers {
            let spawned =
                std::thread::Builder::new().name(format!("tlt-team-{idx}")).spawn(move || helper(shared, idx));
            if spawned.is_err() {
                break;
            }
            started += 1;
        }
        Team { shared, helpers: started, owner: Mutex::new(()) }
    }

    /// Runs `f(0)`, …, `f(parts - 1)` in parallel (part 0 on the calling thread) and returns `true`, or returns
    /// `false` without running anything when the team is busy with another caller or has fewer than
    /// `parts - 1` helpers. Panics if a part panicked (after every part has finished).
    pub(crate) fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        if parts <= 1 {
            if parts == 1 {
                f(0);
            }
            return true;
        }
        if parts - 1 > self.helpers || parts >= 1 << 16 {
            return false;
        }
        // A poisoned lock only means an earlier job panicked; the team itself is consistent.
        let _owner = match self.owner.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        let s = self.shared;
        // SAFETY: only the lifetime is erased; the job is read by helpers only until `remaining` reaches 0,
        // which this function waits for before returning.
        let job: Job = unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f) };
        // SAFETY: see `Shared`: every participant of the previous job has finished with it.
        unsafe { *s.job.get() = Some(job) };
        s.remaining.store(parts - 1, Ordering::Relaxed);
        let epoch = (s.state.load(Ordering::Relaxed) >> 16) + 1;
        s.state.store(epoch << 16 | parts as u64, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 {
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

fn helper(s: &'static Shared, idx: usize) {
    let mut seen = 0u64;
    loop {
        let state = wait_for_job(s, seen);
        seen = state >> 16;
        let parts = (state & 0xFFFF) as usize;
        if idx >= parts {
            continue;
        }
        // SAFETY: see `Shared`; the owner waits for our decrement below before touching `job` again.
        if let Some(job) = unsafe { *s.job.get() } {
            // SAFETY: the job outlives this call (the owner is waiting in `Team::run`).
            let f = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| f(idx))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}

/// Waits until the epoch differs from `seen` (spinning for [`SPIN`], then parked) and returns the state.
fn wait_for_job(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let state = s.state.load(Ordering::Acquire);
        if state >> 16 != seen {
            return state;
        }
        spins = spins.wrapping_add(1);
        if spins % 1024 == 0 && start.elapsed() > SPIN {
            break;
        }
        std::hint::spin_loop();
    }
    let mut guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
    s.sleepers.fetch_add(1, Ordering::SeqCst);
    loop {
        let state = s.state.load(Ordering::SeqCst);
        if state >> 16 != seen {
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            return state;
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
        for round in 0..200 {
            let parts = 1 + round % 4;
            let hits: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
            assert!(team.run(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }));
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(h.load(Ordering::Relaxed), usize::from(i < parts), "round {round} part {i}");
            }
            if round % 50 == 0 {
                std::thread::sleep(SPIN * 3); // let the helpers park
            }
        }
    }

    #[test]
    fn too_many_parts_is_refused() {
        let team = Team::start(1);
        assert!(!team.run(3, &|_| {}));
        assert!(team.run(2, &|_| {}));
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
