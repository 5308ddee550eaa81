//! Rewards overlapped with the rollout: each answer is scored as soon as it finishes, on a pool of worker
//! threads, under a per-answer deadline, so the step waits only for the answers that finish last (and never
//! longer than the deadline for a verifier that hangs).
//!
//! The pool's workers hold the environment (`Arc<E>`); the rollout hands each finished answer over with
//! [`RewardPool::submit`] and the step collects every score with [`RewardPool::collect`]. A worker busy with one
//! answer for longer than [`ScoringConfig::timeout_s`] is abandoned (its answer scores [`Score::TIMED_OUT`], its
//! late result is dropped) and replaced, so a hung verifier costs one thread, never the run. With `workers = 0`
//! answers are scored on the trainer's thread after the rollout (no overlap: the serial baseline).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::env::{Environment, Prompt};
use crate::task::Score;
use crate::{Error, Result};

/// How rewards are computed (`[trainer.scoring]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoringConfig {
    /// Threads scoring answers while the rollout decodes. 0: score every answer after the rollout on the
    /// trainer's thread (no overlap). Default 2.
    pub workers: usize,
    /// Seconds one answer's scoring may take on a worker before it counts as [`Score::TIMED_OUT`] and the worker
    /// is replaced (a hung verifier never blocks the step for longer). Not enforced with `workers = 0`. Default
    /// 30.
    pub timeout_s: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        Self { workers: 2, timeout_s: 30.0 }
    }
}

impl ScoringConfig {
    /// Checks `timeout_s` is finite and positive.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            return Err(Error::config("scoring.timeout_s", format!("{} must be finite and > 0", self.timeout_s)));
        }
        if self.workers > 1024 {
            return Err(Error::config("scoring.workers", format!("{} is more than 1024 threads", self.workers)));
        }
        Ok(())
    }
}

/// Which answer of which batch a job or a result belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct JobKey {
    batch: u64,
    index: usize,
}

struct Job {
    key: JobKey,
    prompt: Arc<Prompt>,
    tokens: Vec<u32>,
}

struct Done {
    key: JobKey,
    score: Result<Score>,
    start: Instant,
    end: Instant,
}

/// What a worker is doing, seen by the collector (deadlines) and the worker (abandonment).
#[derive(Default)]
struct WorkerSlot {
    current: Mutex<Option<(JobKey, Instant)>>,
    abandoned: AtomicBool,
}

/// Scores and timing of one batch of answers ([`RewardPool::collect`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Collected {
    /// One score per answer, in submission index order.
    pub scores: Vec<Score>,
    /// Seconds spent scoring, all answers together (worker time).
    pub busy_s: f64,
    /// The part of `busy_s` that ran while the rollout was still decoding.
    pub hidden_s: f64,
    /// Wall seconds the step waited for scores after the rollout ended.
    pub wait_s: f64,
    /// Answers whose scoring ran past the deadline.
    pub timeouts: usize,
}

impl Collected {
    /// Adds a later rollout's scoring of the same step: its scores after these, its times and timeouts summed.
    pub(crate) fn merge(&mut self, other: Collected) {
        self.scores.extend(other.scores);
        self.busy_s += other.busy_s;
        self.hidden_s += other.hidden_s;
        self.wait_s += other.wait_s;
        self.timeouts += other.timeouts;
    }
}

/// The pool; see the [module docs](self).
pub(crate) struct RewardPool<E: Environment> {
    env: Arc<E>,
    cfg: ScoringConfig,
    jobs: Sender<Job>,
    jobs_rx: Receiver<Job>,
    done_tx: Sender<Done>,
    done: Receiver<Done>,
    workers: Vec<Arc<WorkerSlot>>,
    batch: u64,
    /// Answers of the current batch submitted so far (inline mode: waiting to be scored).
    pending: Vec<Job>,
    submitted: usize,
}

impl<E: Environment> RewardPool<E> {
    /// A pool of `cfg.workers` threads scoring with `env`.
    pub(crate) fn new(env: Arc<E>, cfg: ScoringConfig) -> Self {
        let (jobs, jobs_rx) = unbounded();
        let (done_tx, done) = unbounded();
        let mut pool = Self {
            env,
            cfg,
            jobs,
            jobs_rx,
            done_tx,
            done,
            workers: Vec::new(),
            batch: 0,
            pending: Vec::new(),
            submitted: 0,
        };
        for _ in 0..pool.cfg.workers {
            pool.spawn_worker();
        }
        pool
    }

    /// The environment.
    pub(crate) fn env(&self) -> &E {
        &self.env
    }

    fn spawn_worker(&mut self) {
        let slot = Arc::new(WorkerSlot::default());
        let (rx, tx, env, me) = (self.jobs_rx.clone(), self.done_tx.clone(), self.env.clone(), slot.clone());
        std::thread::spawn(move || {
            while let Ok(job) = rx.recv() {
                let start = Instant::now();
                *me.current.lock() = Some((job.key, start));
                let score = score_one(env.as_ref(), &job.prompt, &job.tokens);
                let end = Instant::now();
                *me.current.lock() = None;
                if me.abandoned.load(Ordering::Acquire) {
                    break; // replaced after its deadline: the result is no longer wanted
                }
                if tx.send(Done { key: job.key, score, start, end }).is_err() {
                    break;
                }
            }
        });
        self.workers.push(slot);
    }

    /// Starts a new batch of answers (a rollout): indices restart at 0 and results of earlier batches still in
    /// flight are ignored.
    pub(crate) fn begin(&mut self) {
        self.batch += 1;
        self.pending.clear();
        self.submitted = 0;
    }

    /// Hands answer `index` of the current batch (`tokens` answering `prompt`) to the pool.
    pub(crate) fn submit(&mut self, index: usize, prompt: &Arc<Prompt>, tokens: &[u32]) {
        let job = Job { key: JobKey { batch: self.batch, index }, prompt: prompt.clone(), tokens: tokens.to_vec() };
        self.submitted += 1;
        if self.workers.is_empty() {
            self.pending.push(job);
        } else if let Err(e) = self.jobs.send(job) {
            // Cannot happen while the pool holds the receiver; keep the answer for inline scoring.
            self.pending.push(e.into_inner());
        }
    }

    /// Waits for the scores of the `n` answers of the current batch (indices `0..n`, all submitted) and accounts
    /// their time against the rollout's decoding window `decoding` (start, end).
    ///
    /// # Errors
    /// The first (by index) error the environment returned, a panic in its `score`, or fewer than `n` answers
    /// submitted.
    pub(crate) fn collect(&mut self, n: usize, decoding: (Instant, Instant)) -> Result<Collected> {
        if self.submitted != n {
            return Err(Error::InvalidArgument(format!(
                "{} answers submitted for scoring, {n} expected",
                self.submitted
            )));
        }
        let t_wait = Instant::now();
        let mut got: Vec<Option<(Result<Score>, Instant, Instant)>> = (0..n).map(|_| None).collect();
        for job in std::mem::take(&mut self.pending) {
            let start = Instant::now();
            let score = score_one(self.env.as_ref(), &job.prompt, &job.tokens);
            put(&mut got, job.key.index, (score, start, Instant::now()))?;
        }
        let mut remaining = got.iter().filter(|g| g.is_none()).count();
        let timeout = Duration::from_secs_f64(self.cfg.timeout_s);
        let mut timeouts = 0;
        while remaining > 0 {
            match self.done.recv_timeout(Duration::from_millis(20)) {
                Ok(d) if d.key.batch == self.batch => {
                    if got.get(d.key.index).is_some_and(Option::is_none) {
                        put(&mut got, d.key.index, (d.score, d.start, d.end))?;
                        remaining -= 1;
                    }
                }
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::InvalidArgument("the reward workers are gone".into()));
                }
            }
            // Abandon (and replace) every worker stuck on an answer of this batch past the deadline.
            let late: Vec<(usize, JobKey, Instant)> = self
                .workers
                .iter()
                .enumerate()
                .filter_map(|(w, slot)| match *slot.current.lock() {
                    Some((key, start)) if key.batch == self.batch && start.elapsed() > timeout => Some((w, key, start)),
                    _ => None,
                })
                .collect();
            for (w, key, start) in late.into_iter().rev() {
                self.workers[w].abandoned.store(true, Ordering::Release);
                self.workers.swap_remove(w);
                self.spawn_worker();
                if got.get(key.index).is_some_and(Option::is_none) {
                    tracing::warn!(answer = key.index, timeout_s = self.cfg.timeout_s, "reward timed out; scored 0");
                    put(&mut got, key.index, (Ok(Score::TIMED_OUT), start, Instant::now()))?;
                    remaining -= 1;
                    timeouts += 1;
                }
            }
        }
        let wait_s = t_wait.elapsed().as_secs_f64();
        let (t0, t_end) = decoding;
        let mut out = Collected { wait_s, timeouts, ..Collected::default() };
        for g in got {
            let (score, start, end) = g.ok_or_else(|| Error::InvalidArgument("an answer was never scored".into()))?;
            out.scores.push(score?);
            out.busy_s += end.duration_since(start).as_secs_f64();
            let (a, b) = (start.max(t0), end.min(t_end));
            if b > a {
                out.hidden_s += b.duration_since(a).as_secs_f64();
            }
        }
        Ok(out)
    }
}

impl<E: Environment> Drop for RewardPool<E> {
    fn drop(&mut self) {
        // Closing the job channel ends the idle workers; an abandoned one ends when its verifier returns.
        for slot in &self.workers {
            slot.abandoned.store(true, Ordering::Release);
        }
    }
}

fn put<T>(got: &mut [Option<T>], index: usize, value: T) -> Result<()> {
    let slot = got.get_mut(index).ok_or_else(|| Error::InvalidArgument(format!("answer {index} is out of range")))?;
    *slot = Some(value);
    Ok(())
}

/// `env.score`, with a panic turned into an error.
fn score_one<E: Environment>(env: &E, prompt: &Prompt, tokens: &[u32]) -> Result<Score> {
    catch_unwind(AssertUnwindSafe(|| env.score(prompt, tokens))).unwrap_or_else(|p| {
        let what = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
        Err(Error::InvalidArgument(format!("the environment's score panicked: {}", what.unwrap_or_default())))
    })
}
