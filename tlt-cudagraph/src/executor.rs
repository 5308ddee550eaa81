//! Executors: run the forward for a key, eagerly or by replaying a captured graph.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::bucket::BucketPolicy;
use crate::error::{Error, Result};
use crate::key::GraphKey;
use crate::pool::{FallbackReason, GraphPool, PoolStats};

/// How a run was executed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunMode {
    /// A resident graph was replayed.
    Replayed,
    /// The graph was captured now (and then replayed).
    Captured,
    /// The eager forward ran; `None` for an executor that is always eager.
    Eager(Option<FallbackReason>),
}

/// What [`Executor::run`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunInfo {
    /// The key that ran: the padded key for graphs, the requested key for eager runs.
    pub key: GraphKey,
    /// How.
    pub mode: RunMode,
}

/// Runs the forward named by a key over caller-owned static input/output buffers `Io`.
///
/// A graph executor runs the graph of the *padded* batch ([`RunInfo::key`]); `Io` must then hold rows for the
/// padded batch (the caller sizes its static buffers for the largest captured batch and fills the padding with
/// harmless rows).
pub trait Executor<Io: ?Sized> {
    /// Runs `key` on `io`.
    ///
    /// # Errors
    /// The forward's own error; graph problems fall back to eager and are reported in [`RunInfo::mode`].
    fn run(&mut self, key: &GraphKey, io: &mut Io) -> Result<RunInfo>;
}

/// The CPU executor: calls the forward every time.
///
/// ```
/// use tlt_cudagraph::{EagerExecutor, Executor, GraphKey, RunMode};
/// let mut ex = EagerExecutor::new(|k: &GraphKey, out: &mut Vec<usize>| {
///     out.push(k.tokens());
///     Ok(())
/// });
/// let mut out = Vec::new();
/// let info = ex.run(&GraphKey::verify(3, 8), &mut out).unwrap();
/// assert_eq!((out, info.mode), (vec![24], RunMode::Eager(None)));
/// ```
#[derive(Debug)]
pub struct EagerExecutor<F> {
    forward: F,
    runs: u64,
}

impl<F> EagerExecutor<F> {
    /// Wraps the forward.
    pub fn new(forward: F) -> Self {
        Self { forward, runs: 0 }
    }

    /// Runs so far.
    pub fn runs(&self) -> u64 {
        self.runs
    }
}

impl<Io: ?Sized, F: FnMut(&GraphKey, &mut Io) -> Result<()>> Executor<Io> for EagerExecutor<F> {
    fn run(&mut self, key: &GraphKey, io: &mut Io) -> Result<RunInfo> {
        (self.forward)(key, io)?;
        self.runs += 1;
        Ok(RunInfo { key: *key, mode: RunMode::Eager(None) })
    }
}

/// A captured graph and the device memory it holds.
#[derive(Debug)]
pub struct Captured<G> {
    /// The graph.
    pub graph: G,
    /// Bytes it holds (counted against the pool budget).
    pub bytes: u64,
}

/// A way to capture and replay graphs (`CudaGraphBackend` with `cuda`; test doubles on CPU).
pub trait GraphBackend<Io: ?Sized> {
    /// The captured graph.
    type Graph;

    /// Records the forward of `key` on `io` into a graph. Capturing does not run the work: the executor
    /// replays the graph right after.
    ///
    /// # Errors
    /// Any capture failure; the executor then runs eagerly and never retries `key`.
    fn capture(&mut self, key: &GraphKey, io: &mut Io) -> Result<Captured<Self::Graph>>;

    /// Replays `graph` (captured for `key`) on the buffers it was captured with.
    ///
    /// # Errors
    /// A replay failure; it is returned (not hidden behind an eager run).
    fn replay(&mut self, graph: &Self::Graph, key: &GraphKey, io: &mut Io) -> Result<()>;
}

/// Capture on first use, replay after, eager when a graph cannot be had (the reason is returned and counted).
#[derive(Debug)]
pub struct GraphExecutor<B, G, F> {
    backend: B,
    eager: F,
    pool: GraphPool<G>,
    policy: BucketPolicy,
    uncapturable: HashSet<GraphKey>,
}

impl<B, G, F> GraphExecutor<B, G, F> {
    /// An executor with an empty pool of `budget` bytes.
    ///
    /// # Errors
    /// If `policy` does not validate.
    pub fn new(backend: B, eager: F, policy: BucketPolicy, budget: u64) -> Result<Self> {
        policy.validate()?;
        Ok(Self { backend, eager, pool: GraphPool::new(budget), policy, uncapturable: HashSet::new() })
    }

    /// Pool and fallback counters.
    pub fn stats(&self) -> &PoolStats {
        self.pool.stats()
    }

    /// The pool.
    pub fn pool(&self) -> &GraphPool<G> {
        &self.pool
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The bucketing policy.
    pub fn policy(&self) -> &BucketPolicy {
        &self.policy
    }
}

fn fallback<Io: ?Sized, F: FnMut(&GraphKey, &mut Io) -> Result<()>>(
    eager: &mut F,
    stats: &mut PoolStats,
    key: &GraphKey,
    io: &mut Io,
    reason: FallbackReason,
) -> Result<RunInfo> {
    eager(key, io)?;
    stats.count_fallback(&reason);
    Ok(RunInfo { key: *key, mode: RunMode::Eager(Some(reason)) })
}

impl<Io: ?Sized, B, F> Executor<Io> for GraphExecutor<B, B::Graph, F>
where
    B: GraphBackend<Io>,
    F: FnMut(&GraphKey, &mut Io) -> Result<()>,
{
    fn run(&mut self, key: &GraphKey, io: &mut Io) -> Result<RunInfo> {
        let Some(padded) = self.policy.pad(key.batch) else {
            let max = self.policy.max_batch().unwrap_or(0);
            return fallback(
                &mut self.eager,
                self.pool.stats_mut(),
                key,
                io,
                FallbackReason::BatchTooLarge { batch: key.batch, max },
            );
        };
        let pk = key.with_batch(padded);
        if let Some(g) = self.pool.get(&pk) {
            self.backend.replay(g, &pk, io)?;
            return Ok(RunInfo { key: pk, mode: RunMode::Replayed });
        }
        if self.uncapturable.contains(&pk) {
            return fallback(&mut self.eager, self.pool.stats_mut(), key, io, FallbackReason::Uncapturable);
        }
        let captured = match self.backend.capture(&pk, io) {
            Ok(c) => c,
            Err(e) => {
                self.uncapturable.insert(pk);
                self.pool.stats_mut().capture_failures += 1;
                return fallback(
                    &mut self.eager,
                    self.pool.stats_mut(),
                    key,
                    io,
                    FallbackReason::CaptureFailed(e.to_string()),
                );
            }
        };
        match self.pool.insert(pk, captured.graph, captured.bytes) {
            Ok(_evicted) => {}
            Err(r) => {
                self.uncapturable.insert(pk);
                return fallback(
                    &mut self.eager,
                    self.pool.stats_mut(),
                    key,
                    io,
                    FallbackReason::OverBudget { need: r.need, budget: r.budget },
                );
            }
        }
        // Capture only records: run the work now. `insert` just placed the graph, so `get` finds it (and
        // counts a hit, which is what the next run would be anyway).
        let g = self.pool.get(&pk).ok_or_else(|| Error::EmptyCapture { key: pk.to_string() })?;
        self.backend.replay(g, &pk, io)?;
        Ok(RunInfo { key: pk, mode: RunMode::Captured })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::BoxError;
    use proptest::prelude::*;

    /// Io for the tests: inputs per padded row, outputs written by the forward.
    #[derive(Debug, Clone, PartialEq)]
    struct Io {
        input: Vec<f32>,
        output: Vec<f32>,
    }

    fn forward(key: &GraphKey, io: &mut Io) -> Result<()> {
        let n = key.batch.min(io.input.len());
        for i in 0..n {
            io.output[i] = io.input[i] * 2.0 + key.tokens() as f32;
        }
        Ok(())
    }

    /// A "graph" that is the recorded key; replay calls the same forward (what a real graph does, by
    /// construction); capture fails for keys in `fail` and reports `bytes_per_token` x tokens.
    struct FakeBackend {
        fail: HashSet<usize>,
        bytes_per_token: u64,
        captures: u64,
    }

    impl GraphBackend<Io> for FakeBackend {
        type Graph = GraphKey;
        fn capture(&mut self, key: &GraphKey, _io: &mut Io) -> Result<Captured<GraphKey>> {
            if self.fail.contains(&key.batch) {
                let e: BoxError = "capture refused".into();
                return Err(Error::Run(e));
            }
            self.captures += 1;
            Ok(Captured { graph: *key, bytes: self.bytes_per_token * key.tokens() as u64 })
        }
        fn replay(&mut self, graph: &GraphKey, key: &GraphKey, io: &mut Io) -> Result<()> {
            assert_eq!(graph, key);
            forward(graph, io)
        }
    }

    fn io(n: usize) -> Io {
        Io { input: (0..n).map(|i| i as f32).collect(), output: vec![0.0; n] }
    }

    #[test]
    fn capture_once_then_replay_with_padding_and_fallbacks() {
        let be = FakeBackend { fail: [7].into(), bytes_per_token: 10, captures: 0 };
        let mut ex = GraphExecutor::new(be, forward, BucketPolicy::ladder(16), 10_000).unwrap();
        let mut buf = io(16);
        let a = ex.run(&GraphKey::verify(9, 8), &mut buf).unwrap();
        assert_eq!((a.key, a.mode), (GraphKey::verify(10, 8), RunMode::Captured));
        let b = ex.run(&GraphKey::verify(10, 8), &mut buf).unwrap();
        assert_eq!(b.mode, RunMode::Replayed);
        let c = ex.run(&GraphKey::decode(17), &mut buf).unwrap();
        assert_eq!(c.mode, RunMode::Eager(Some(FallbackReason::BatchTooLarge { batch: 17, max: 16 })));
        let d = ex.run(&GraphKey::decode(7), &mut buf).unwrap();
        assert!(matches!(d.mode, RunMode::Eager(Some(FallbackReason::CaptureFailed(ref m))) if m.contains("refused")));
        let e = ex.run(&GraphKey::decode(7), &mut buf).unwrap();
        assert_eq!(e.mode, RunMode::Eager(Some(FallbackReason::Uncapturable)));
        // 16 x 1000 tokens x 10 bytes can never fit 10 000 bytes.
        let f = ex.run(&GraphKey::verify(16, 1000), &mut buf).unwrap();
        assert!(matches!(f.mode, RunMode::Eager(Some(FallbackReason::OverBudget { need: 160_000, .. }))));
        let s = ex.stats();
        assert_eq!((s.captures, s.capture_failures, s.eager_runs), (1, 1, 4));
        assert_eq!((s.fallback_batch_too_large, s.fallback_capture_failed, s.fallback_over_budget), (1, 2, 1));
        assert_eq!(ex.backend().captures, 2, "one admitted, one over budget");
        assert_eq!(s.bytes_in_use, 800);
    }

    proptest! {
        /// Replay output equals eager output for every key, the pool stays under budget, and every key is
        /// captured at most once while it stays resident.
        #[test]
        fn replay_equals_eager_and_budget_holds(
            budget in 0u64..3000,
            keys in proptest::collection::vec((1usize..40, 0usize..3, 1usize..6), 1..120),
        ) {
            let be = FakeBackend { fail: HashSet::new(), bytes_per_token: 3, captures: 0 };
            let mut ex = GraphExecutor::new(be, forward, BucketPolicy::ladder(32), budget).unwrap();
            let mut eager = EagerExecutor::new(forward);
            for (b, phase, t) in keys {
                let key = match phase {
                    0 => GraphKey::decode(b),
                    1 => GraphKey::verify(b, 8 * t),
                    _ => GraphKey::draft(b, t, 4),
                };
                let mut g = io(40);
                let info = ex.run(&key, &mut g).unwrap();
                let mut e = io(40);
                eager.run(&info.key, &mut e).unwrap();
                prop_assert_eq!(&g, &e);
                prop_assert!(info.key.batch >= key.batch);
                prop_assert!(ex.stats().bytes_in_use <= budget);
            }
            let s = ex.stats();
            prop_assert_eq!(s.misses, s.captures + s.eager_runs - s.fallback_batch_too_large);
        }
    }
}
