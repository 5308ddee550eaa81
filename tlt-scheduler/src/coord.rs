//! Idle-worker coordination: rollout workers that finish their shard train the drafter until the rollout ends.
//!
//! `N` rollout workers (threads here; processes or GPUs on a cluster) each own a shard. A worker that finishes
//! its shard becomes **idle**; while the rollout is still going (another worker is decoding the long tail) and
//! fewer than `max_trainers` are training, it is handed drafter-training work through [`DrafterTrainer::train`].
//! When the **last** worker finishes (the rollout ends), or when [`Coordinator::preempt_training`] is called
//! (the next phase needs the workers), every trainer is asked to stop; preemption is cooperative, and a trainer
//! must return within `preempt_latency` of the request ([`TrainContext::should_stop`] between chunks of at
//! most that length). Overruns are recorded, not hidden. Every transition is an [`Event`] with a timestamp.
//!
//! fastrl stops the training group when *it* finishes post-processing (its first worker's own release), which
//! leaves almost no training window; here training stops only when the whole rollout ends.
//!
//! ```
//! use std::time::Duration;
//! use tlt_scheduler::{Coordinator, CoordinatorConfig, DrafterTrainer, TrainContext, TrainExit};
//! struct Chunks;
//! impl DrafterTrainer for Chunks {
//!     fn train(&self, ctx: &TrainContext<'_>) -> TrainExit {
//!         while !ctx.should_stop() {
//!             std::thread::sleep(Duration::from_millis(1)); // one bounded chunk of drafter training
//!         }
//!         TrainExit::Preempted
//!     }
//! }
//! let coord = Coordinator::new(CoordinatorConfig::default()).unwrap();
//! let shards = vec![1u64, 30];
//! let (results, report) = coord.run(shards, |_w, ms| { std::thread::sleep(Duration::from_millis(ms)); ms }, &Chunks);
//! assert_eq!(results, [1, 30]);
//! assert!(report.training_seconds > 0.0);
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use crate::error::{invalid, Result};

/// [`Coordinator`] settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    /// Most workers training at once (`>= 1`). Default `usize::MAX` (every idle worker); fastrl trains on one
    /// group at a time.
    pub max_trainers: usize,
    /// Idle workers needed before training starts (`>= 1`). Default 1 (fastrl's `min_workers_for_training`).
    pub min_idle: usize,
    /// How long a trainer may take to return after a stop request, in milliseconds (`>= 1`). Default 50.
    pub preempt_latency_ms: u64,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self { max_trainers: usize::MAX, min_idle: 1, preempt_latency_ms: 50 }
    }
}

impl CoordinatorConfig {
    /// Checks that every field is `>= 1`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig).
    pub fn validate(&self) -> Result<()> {
        if self.max_trainers == 0 {
            return Err(invalid("coordinator.max_trainers", "must be at least 1"));
        }
        if self.min_idle == 0 {
            return Err(invalid("coordinator.min_idle", "must be at least 1"));
        }
        if self.preempt_latency_ms == 0 {
            return Err(invalid("coordinator.preempt_latency_ms", "must be at least 1"));
        }
        Ok(())
    }

    /// `preempt_latency_ms` as a duration.
    pub fn preempt_latency(&self) -> Duration {
        Duration::from_millis(self.preempt_latency_ms)
    }
}

/// How a [`DrafterTrainer::train`] call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TrainExit {
    /// It saw [`TrainContext::should_stop`] and returned.
    Preempted,
    /// It had nothing (left) to train on; the worker stays idle until the rollout ends.
    OutOfWork,
}

/// What a trainer sees: which worker it runs on, and the stop flag to poll.
#[derive(Debug)]
pub struct TrainContext<'a> {
    /// The idle worker lending itself.
    pub worker: usize,
    /// The preemption bound: check [`TrainContext::should_stop`] at least this often.
    pub preempt_latency: Duration,
    stop: &'a AtomicBool,
}

impl TrainContext<'_> {
    /// `true` once training must stop (the rollout ended or the next phase needs the worker).
    pub fn should_stop(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// Drafter training lent to idle workers. Implementations train in chunks no longer than
/// [`TrainContext::preempt_latency`] and return when [`TrainContext::should_stop`] turns `true`.
pub trait DrafterTrainer: Sync {
    /// Trains on `ctx.worker` until stopped or out of work.
    fn train(&self, ctx: &TrainContext<'_>) -> TrainExit;
}

/// A coordination transition.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum EventKind {
    /// A worker started its shard.
    RolloutStarted,
    /// A worker finished its shard.
    RolloutFinished,
    /// A finished worker became idle (the rollout is still going).
    Idle,
    /// An idle worker started drafter training.
    TrainingStarted,
    /// Training on a worker returned.
    TrainingStopped {
        /// How.
        exit: TrainExit,
        /// Seconds from the stop request to the return, if a stop had been requested.
        stop_latency_s: Option<f64>,
    },
    /// A trainer returned later than `preempt_latency` after the stop request.
    PreemptionOverrun {
        /// Seconds it took.
        latency_s: f64,
    },
    /// [`Coordinator::preempt_training`] was called.
    TrainingPreempted,
    /// The last worker finished: the rollout is over and training is asked to stop.
    RolloutEnded,
}

/// One timestamped transition.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Seconds since [`Coordinator::run`] started.
    pub at_s: f64,
    /// The worker, for per-worker events.
    pub worker: Option<usize>,
    /// What happened.
    pub kind: EventKind,
}

/// The outcome of a coordinated rollout.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CoordinationReport {
    /// Every transition, in order.
    pub events: Vec<Event>,
    /// When the last worker finished its shard (s).
    pub rollout_end_s: f64,
    /// When the last trainer returned (s), `rollout_end_s` if none trained.
    pub all_stopped_s: f64,
    /// Worker-seconds spent training.
    pub training_seconds: f64,
    /// Worker-seconds spent idle (finished, rollout not over), training included.
    pub idle_seconds: f64,
    /// Largest stop latency observed (s).
    pub max_stop_latency_s: f64,
    /// Trainers that overran the preemption bound.
    pub overruns: u64,
}

#[derive(Debug, Default)]
struct State {
    finished: usize,
    idle: usize,
    training: usize,
    ended: bool,
    stop_requested_at: Option<Instant>,
    events: Vec<Event>,
    training_seconds: f64,
    idle_seconds: f64,
    max_stop_latency: f64,
    overruns: u64,
}

/// Runs a rollout over worker threads and lends idle workers to drafter training; see the
/// [module docs](self).
#[derive(Debug)]
pub struct Coordinator {
    cfg: CoordinatorConfig,
    state: Mutex<State>,
    cv: Condvar,
    stop: AtomicBool,
    start: Mutex<Option<Instant>>,
}

impl Coordinator {
    /// A coordinator.
    ///
    /// # Errors
    /// If `cfg` does not [validate](CoordinatorConfig::validate).
    pub fn new(cfg: CoordinatorConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            start: Mutex::new(None),
        })
    }

    /// Asks every trainer to stop and starts no new training (the next phase needs the workers). May be called
    /// from any thread while [`Coordinator::run`] runs.
    pub fn preempt_training(&self) {
        let mut s = self.state.lock();
        if s.stop_requested_at.is_none() {
            s.stop_requested_at = Some(Instant::now());
            self.stop.store(true, Ordering::Release);
            self.push(&mut s, None, EventKind::TrainingPreempted);
        }
        self.cv.notify_all();
    }

    fn now_s(&self) -> f64 {
        self.start.lock().map_or(0.0, |t| t.elapsed().as_secs_f64())
    }

    fn push(&self, s: &mut State, worker: Option<usize>, kind: EventKind) {
        let at_s = self.now_s();
        s.events.push(Event { at_s, worker, kind });
    }

    /// Runs `rollout(worker, shard)` on one thread per shard and lends finished workers to `trainer` until the
    /// last shard is done and every trainer has returned. Returns the shards' results in shard order and the
    /// report. A coordinator runs one rollout at a time (a second concurrent `run` would share its state).
    pub fn run<S, R, F>(&self, shards: Vec<S>, rollout: F, trainer: &dyn DrafterTrainer) -> (Vec<R>, CoordinationReport)
    where
        S: Send,
        R: Send,
        F: Fn(usize, S) -> R + Sync,
    {
        let n = shards.len();
        *self.state.lock() = State::default();
        self.stop.store(false, Ordering::Release);
        *self.start.lock() = Some(Instant::now());
        let rollout = &rollout;
        let results: Vec<R> = std::thread::scope(|scope| {
            let handles: Vec<_> = shards
                .into_iter()
                .enumerate()
                .map(|(w, shard)| scope.spawn(move || self.worker(w, n, shard, rollout, trainer)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        let s = std::mem::take(&mut *self.state.lock());
        let rollout_end_s = s.events.iter().find(|e| e.kind == EventKind::RolloutEnded).map_or(0.0, |e| e.at_s);
        let all_stopped_s = s
            .events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::TrainingStopped { .. }))
            .map(|e| e.at_s)
            .fold(rollout_end_s, f64::max);
        let report = CoordinationReport {
            events: s.events,
            rollout_end_s,
            all_stopped_s,
            training_seconds: s.training_seconds,
            idle_seconds: s.idle_seconds,
            max_stop_latency_s: s.max_stop_latency,
            overruns: s.overruns,
        };
        (results, report)
    }

    fn worker<S, R>(
        &self,
        w: usize,
        n: usize,
        shard: S,
        rollout: &(impl Fn(usize, S) -> R + Sync),
        trainer: &dyn DrafterTrainer,
    ) -> R {
        self.push(&mut self.state.lock(), Some(w), EventKind::RolloutStarted);
        let result = rollout(w, shard);
        let mut s = self.state.lock();
        s.finished += 1;
        self.push(&mut s, Some(w), EventKind::RolloutFinished);
        if s.finished == n {
            s.ended = true;
            if s.stop_requested_at.is_none() {
                s.stop_requested_at = Some(Instant::now());
            }
            self.stop.store(true, Ordering::Release);
            self.push(&mut s, None, EventKind::RolloutEnded);
            self.cv.notify_all();
            return result;
        }
        let idle_since = Instant::now();
        s.idle += 1;
        self.push(&mut s, Some(w), EventKind::Idle);
        self.cv.notify_all();
        let mut out_of_work = false;
        while !s.ended {
            let may_train = !out_of_work
                && s.stop_requested_at.is_none()
                && s.training < self.cfg.max_trainers
                && s.idle >= self.cfg.min_idle;
            if !may_train {
                self.cv.wait(&mut s);
                continue;
            }
            s.training += 1;
            self.push(&mut s, Some(w), EventKind::TrainingStarted);
            let started = Instant::now();
            drop(s);
            let exit = trainer.train(&TrainContext {
                worker: w,
                preempt_latency: self.cfg.preempt_latency(),
                stop: &self.stop,
            });
            let returned = Instant::now();
            s = self.state.lock();
            s.training -= 1;
            s.training_seconds += returned.duration_since(started).as_secs_f64();
            let latency = s.stop_requested_at.map(|t| returned.saturating_duration_since(t).as_secs_f64());
            self.push(&mut s, Some(w), EventKind::TrainingStopped { exit, stop_latency_s: latency });
            if let Some(l) = latency {
                s.max_stop_latency = s.max_stop_latency.max(l);
                if l > self.cfg.preempt_latency().as_secs_f64() {
                    s.overruns += 1;
                    self.push(&mut s, Some(w), EventKind::PreemptionOverrun { latency_s: l });
                }
            }
            out_of_work |= exit == TrainExit::OutOfWork;
            self.cv.notify_all();
        }
        s.idle -= 1;
        s.idle_seconds += idle_since.elapsed().as_secs_f64();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// Trains in 2 ms chunks forever, counting chunks per worker.
    struct Chunked {
        chunk: Duration,
        chunks: Vec<AtomicU64>,
        budget: Option<u64>,
    }

    impl Chunked {
        fn new(workers: usize, budget: Option<u64>) -> Self {
            Self { chunk: Duration::from_millis(2), chunks: (0..workers).map(|_| AtomicU64::new(0)).collect(), budget }
        }
    }

    impl DrafterTrainer for Chunked {
        fn train(&self, ctx: &TrainContext<'_>) -> TrainExit {
            assert!(self.chunk <= ctx.preempt_latency);
            let mut done = 0;
            while !ctx.should_stop() {
                if self.budget.is_some_and(|b| done >= b) {
                    return TrainExit::OutOfWork;
                }
                std::thread::sleep(self.chunk);
                self.chunks[ctx.worker].fetch_add(1, Ordering::Relaxed);
                done += 1;
            }
            TrainExit::Preempted
        }
    }

    fn sleepy(_w: usize, ms: u64) -> u64 {
        std::thread::sleep(Duration::from_millis(ms));
        ms
    }

    fn first(report: &CoordinationReport, w: Option<usize>, pred: impl Fn(&EventKind) -> bool) -> Option<f64> {
        report.events.iter().find(|e| e.worker == w && pred(&e.kind)).map(|e| e.at_s)
    }

    #[test]
    fn training_only_on_idle_workers_and_only_until_the_rollout_ends() {
        let cfg = CoordinatorConfig { preempt_latency_ms: 100, ..Default::default() };
        let bound = cfg.preempt_latency().as_secs_f64();
        let coord = Coordinator::new(cfg).unwrap();
        let shards = vec![10u64, 40, 80, 200];
        let trainer = Chunked::new(shards.len(), None);
        let (res, rep) = coord.run(shards.clone(), sleepy, &trainer);
        assert_eq!(res, shards);
        let end = rep.rollout_end_s;
        let last_finish = first(&rep, Some(3), |k| *k == EventKind::RolloutFinished).unwrap();
        let last_any = rep.events.iter().rev().find(|e| e.kind == EventKind::RolloutFinished).unwrap().at_s;
        assert!(end >= last_any && end - last_any < 0.005, "the end is the last finish");
        assert!(last_finish <= end);
        // The last worker never trains; every other one trains from its own finish until the rollout ends.
        assert!(first(&rep, Some(3), |k| *k == EventKind::TrainingStarted).is_none());
        for w in 0..3 {
            let fin = first(&rep, Some(w), |k| *k == EventKind::RolloutFinished).unwrap();
            let start = first(&rep, Some(w), |k| *k == EventKind::TrainingStarted).unwrap();
            let stop = first(&rep, Some(w), |k| matches!(k, EventKind::TrainingStopped { .. })).unwrap();
            assert!(fin <= start && start < end, "worker {w}: finished {fin}, trained at {start}, end {end}");
            assert!(stop >= end, "worker {w} stopped training at {stop} before the rollout ended at {end}");
            assert!(stop - end <= bound + 0.05, "worker {w} stopped {} s after the end", stop - end);
            assert!(trainer.chunks[w].load(Ordering::Relaxed) > 0);
        }
        assert_eq!(rep.overruns, 0);
        assert!(rep.max_stop_latency_s <= bound + 0.05);
        // Training harvested most of the idle time: (200-10) + (200-40) + (200-80) ms of idle.
        assert!(rep.idle_seconds >= 0.45, "{}", rep.idle_seconds);
        assert!(rep.training_seconds >= 0.8 * rep.idle_seconds, "{} of {}", rep.training_seconds, rep.idle_seconds);
        // No training starts after the end.
        assert!(rep.events.iter().filter(|e| e.kind == EventKind::TrainingStarted).all(|e| e.at_s < end));
    }

    #[test]
    fn training_never_delays_the_last_rollout_worker() {
        // The last worker's shard takes 150 ms of work; the coordinated run ends within the bound after it.
        let cfg = CoordinatorConfig { preempt_latency_ms: 100, ..Default::default() };
        let bound = cfg.preempt_latency().as_secs_f64();
        let coord = Coordinator::new(cfg).unwrap();
        let trainer = Chunked::new(8, None);
        let t0 = Instant::now();
        let (_, rep) = coord.run(vec![5u64, 5, 5, 5, 5, 5, 5, 150], sleepy, &trainer);
        let wall = t0.elapsed().as_secs_f64();
        let started = first(&rep, Some(7), |k| *k == EventKind::RolloutStarted).unwrap();
        let finished = first(&rep, Some(7), |k| *k == EventKind::RolloutFinished).unwrap();
        assert!(finished - started < 0.150 + bound, "last worker took {} s", finished - started);
        assert!(rep.all_stopped_s - rep.rollout_end_s <= bound + 0.05);
        assert!(wall <= rep.rollout_end_s + bound + 0.1, "wall {wall}, end {}", rep.rollout_end_s);
    }

    #[test]
    fn max_trainers_out_of_work_and_external_preemption() {
        let cfg = CoordinatorConfig { max_trainers: 1, preempt_latency_ms: 20, ..Default::default() };
        let coord = Coordinator::new(cfg).unwrap();
        // Each call trains 3 chunks then runs out of work: the single training slot passes between workers.
        let trainer = Chunked::new(3, Some(3));
        let (_, rep) = coord.run(vec![1u64, 1, 120], sleepy, &trainer);
        let starts: Vec<_> = rep.events.iter().filter(|e| e.kind == EventKind::TrainingStarted).collect();
        assert_eq!(starts.len(), 2, "each idle worker trains once, one at a time");
        let mut active = 0i32;
        for e in &rep.events {
            match e.kind {
                EventKind::TrainingStarted => active += 1,
                EventKind::TrainingStopped { .. } => active -= 1,
                _ => {}
            }
            assert!((0..=1).contains(&active));
        }
        assert!(rep
            .events
            .iter()
            .any(|e| e.kind == EventKind::TrainingStopped { exit: TrainExit::OutOfWork, stop_latency_s: None }));

        // The next phase preempts training before the rollout ends.
        let coord = std::sync::Arc::new(Coordinator::new(CoordinatorConfig::default()).unwrap());
        let c2 = coord.clone();
        let trainer = Chunked::new(2, None);
        let preempter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(40));
            c2.preempt_training();
        });
        let (_, rep) = coord.run(vec![1u64, 150], sleepy, &trainer);
        preempter.join().unwrap();
        let pre = first(&rep, None, |k| *k == EventKind::TrainingPreempted).unwrap();
        let stop = first(&rep, Some(0), |k| matches!(k, EventKind::TrainingStopped { .. })).unwrap();
        assert!(stop >= pre && stop < rep.rollout_end_s);
        assert_eq!(rep.events.iter().filter(|e| e.kind == EventKind::TrainingStarted).count(), 1);
    }

    #[test]
    fn overruns_are_recorded() {
        struct Slow;
        impl DrafterTrainer for Slow {
            fn train(&self, ctx: &TrainContext<'_>) -> TrainExit {
                while !ctx.should_stop() {
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(Duration::from_millis(30));
                TrainExit::Preempted
            }
        }
        let coord = Coordinator::new(CoordinatorConfig { preempt_latency_ms: 5, ..Default::default() }).unwrap();
        let (_, rep) = coord.run(vec![1u64, 20], sleepy, &Slow);
        assert_eq!(rep.overruns, 1);
        assert!(rep
            .events
            .iter()
            .any(|e| matches!(e.kind, EventKind::PreemptionOverrun { latency_s } if latency_s >= 0.03)));
        assert!(CoordinatorConfig { max_trainers: 0, ..Default::default() }.validate().is_err());
        assert!(CoordinatorConfig { min_idle: 0, ..Default::default() }.validate().is_err());
        assert!(CoordinatorConfig { preempt_latency_ms: 0, ..Default::default() }.validate().is_err());
    }
}
