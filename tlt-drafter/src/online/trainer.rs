//! A background trainer: runs training micro-steps on its own thread while the worker is idle and stops within
//! one micro-step when the rollout needs the worker back.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use std::sync::Arc;

use crate::{Error, Result};

/// What a micro-step reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroStepOutcome {
    /// It trained; call again.
    Trained,
    /// Nothing to train on yet: the trainer waits `idle_wait` before trying again (or until paused).
    NoData,
}

/// Lifetime figures of a [`BackgroundTrainer`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainerStats {
    /// Micro-steps that trained.
    pub steps: u64,
    /// Seconds spent inside micro-steps.
    pub busy_s: f64,
    /// Latency of every [`BackgroundTrainer::pause`]: from the request until the worker had stopped.
    pub pause_latencies: Vec<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Pause,
    Run,
    Shutdown,
}

#[derive(Debug)]
struct Ctrl {
    want: Want,
    /// The worker is inside its run loop (possibly mid-step).
    running: bool,
    stats: TrainerStats,
    error: Option<Error>,
}

#[derive(Debug)]
struct Shared {
    ctrl: Mutex<Ctrl>,
    cv: Condvar,
}

/// Runs a training micro-step closure on a dedicated thread, only while resumed. Preemption is cooperative:
/// the flag is checked between micro-steps, so [`BackgroundTrainer::pause`] returns within one micro-step. A
/// failing step pauses the trainer; the error comes back from [`BackgroundTrainer::shutdown`].
#[derive(Debug)]
pub struct BackgroundTrainer {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
}

impl BackgroundTrainer {
    /// Starts the thread, paused. `step` runs one micro-step (a forward/backward and optimizer step on one
    /// batch, or one gradient-accumulation part of it); keep it short, it bounds the preemption latency.
    pub fn spawn<F>(mut step: F, idle_wait: Duration) -> Self
    where
        F: FnMut() -> Result<MicroStepOutcome> + Send + 'static,
    {
        let shared = Arc::new(Shared {
            ctrl: Mutex::new(Ctrl { want: Want::Pause, running: false, stats: TrainerStats::default(), error: None }),
            cv: Condvar::new(),
        });
        let worker = shared.clone();
        let handle = std::thread::Builder::new()
            .name("tlt-drafter-trainer".into())
            .spawn(move || {
                let mut g = worker.ctrl.lock();
                loop {
                    match g.want {
                        Want::Shutdown => break,
                        Want::Pause => {
                            g.running = false;
                            worker.cv.notify_all();
                            worker.cv.wait(&mut g);
                            continue;
                        }
                        Want::Run => {}
                    }
                    g.running = true;
                    drop(g);
                    let t = Instant::now();
                    let out = step();
                    let busy = t.elapsed().as_secs_f64();
                    g = worker.ctrl.lock();
                    g.stats.busy_s += busy;
                    match out {
                        Ok(MicroStepOutcome::Trained) => g.stats.steps += 1,
                        Ok(MicroStepOutcome::NoData) => {
                            if g.want == Want::Run {
                                worker.cv.wait_for(&mut g, idle_wait);
                            }
                        }
                        Err(e) => {
                            g.error = Some(e);
                            if g.want == Want::Run {
                                g.want = Want::Pause;
                            }
                        }
                    }
                }
                g.running = false;
                worker.cv.notify_all();
            })
            .ok();
        Self { shared, handle }
    }

    /// Lets the trainer run (the worker went idle). Does nothing after a step failed.
    pub fn resume(&self) {
        let mut g = self.shared.ctrl.lock();
        if g.want == Want::Pause && g.error.is_none() {
            g.want = Want::Run;
            self.shared.cv.notify_all();
        }
    }

    /// Preempts the trainer and blocks until it has stopped (at most the rest of the current micro-step);
    /// returns how long that took.
    pub fn pause(&self) -> Duration {
        let t = Instant::now();
        let mut g = self.shared.ctrl.lock();
        if g.want == Want::Run {
            g.want = Want::Pause;
        }
        self.shared.cv.notify_all();
        while g.running {
            self.shared.cv.wait(&mut g);
        }
        let latency = t.elapsed();
        g.stats.pause_latencies.push(latency);
        latency
    }

    /// Whether the trainer is inside its run loop now.
    pub fn is_running(&self) -> bool {
        self.shared.ctrl.lock().running
    }

    /// The figures so far.
    pub fn stats(&self) -> TrainerStats {
        self.shared.ctrl.lock().stats.clone()
    }

    /// Stops the thread (after the current micro-step) and returns the figures.
    ///
    /// # Errors
    /// The error of a failed micro-step, or [`Error::InvalidArgument`] if the thread could not be started or
    /// panicked.
    pub fn shutdown(mut self) -> Result<TrainerStats> {
        self.stop_thread()?;
        let mut g = self.shared.ctrl.lock();
        match g.error.take() {
            Some(e) => Err(e),
            None => Ok(g.stats.clone()),
        }
    }

    fn stop_thread(&mut self) -> Result<()> {
        {
            let mut g = self.shared.ctrl.lock();
            g.want = Want::Shutdown;
            self.shared.cv.notify_all();
        }
        match self.handle.take() {
            Some(h) => h.join().map_err(|_| Error::InvalidArgument("the trainer thread panicked".into())),
            None => Err(Error::InvalidArgument("the trainer thread could not be started".into())),
        }
    }
}

impl Drop for BackgroundTrainer {
    fn drop(&mut self) {
        if self.handle.is_some() {
            let _ = self.stop_thread();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn runs_only_while_resumed_and_pauses_within_a_step() {
        let count = Arc::new(AtomicU64::new(0));
        let c = count.clone();
        let step_time = Duration::from_millis(5);
        let t = BackgroundTrainer::spawn(
            move || {
                std::thread::sleep(step_time);
                c.fetch_add(1, Ordering::SeqCst);
                Ok(MicroStepOutcome::Trained)
            },
            Duration::from_millis(1),
        );
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(count.load(Ordering::SeqCst), 0, "paused at start");
        for _ in 0..5 {
            t.resume();
            std::thread::sleep(Duration::from_millis(20));
            let latency = t.pause();
            assert!(latency < step_time * 4, "pause took {latency:?}");
            let n = count.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(15));
            assert_eq!(count.load(Ordering::SeqCst), n, "no step after pause returned");
            assert!(!t.is_running());
        }
        let stats = t.shutdown().unwrap();
        assert_eq!(stats.steps, count.load(Ordering::SeqCst));
        assert!(stats.steps >= 5);
        assert_eq!(stats.pause_latencies.len(), 5);
    }

    #[test]
    fn a_failing_step_pauses_and_reports() {
        let t = BackgroundTrainer::spawn(|| Err(Error::InvalidArgument("boom".into())), Duration::from_millis(1));
        t.resume();
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_running());
        assert!(matches!(t.shutdown(), Err(Error::InvalidArgument(m)) if m == "boom"));
    }

    #[test]
    fn no_data_waits_and_pause_still_returns() {
        let t = BackgroundTrainer::spawn(|| Ok(MicroStepOutcome::NoData), Duration::from_secs(10));
        t.resume();
        std::thread::sleep(Duration::from_millis(10));
        let latency = t.pause();
        assert!(latency < Duration::from_secs(1), "{latency:?}");
        assert_eq!(t.shutdown().unwrap().steps, 0);
    }
}
