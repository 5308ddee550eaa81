//! The graph pool: captured graphs under one byte budget, least recently used evicted first.

use std::collections::HashMap;
use std::hash::Hash;

use serde::{Deserialize, Serialize};

use crate::key::GraphKey;

/// Why a run did not replay a graph.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FallbackReason {
    /// The batch is larger than every captured size.
    BatchTooLarge {
        /// The batch.
        batch: usize,
        /// The largest captured size.
        max: usize,
    },
    /// The graph alone is larger than the pool's whole budget.
    OverBudget {
        /// Its bytes.
        need: u64,
        /// The budget.
        budget: u64,
    },
    /// Capture failed (the error's text); the key is not retried.
    CaptureFailed(String),
    /// Capture of this key failed earlier or its graph can never fit; not retried.
    Uncapturable,
}

/// Counters of a pool and its executor.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// Lookups that found a graph.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Graphs captured and admitted.
    pub captures: u64,
    /// Captures that failed.
    pub capture_failures: u64,
    /// Graphs evicted to make room.
    pub evictions: u64,
    /// Runs that went eager (any reason).
    pub eager_runs: u64,
    /// Eager runs because the batch was too large.
    pub fallback_batch_too_large: u64,
    /// Eager runs because a graph could not fit the budget.
    pub fallback_over_budget: u64,
    /// Eager runs because capture failed (now or before).
    pub fallback_capture_failed: u64,
    /// Bytes held by resident graphs.
    pub bytes_in_use: u64,
    /// Most bytes ever held at once.
    pub peak_bytes: u64,
    /// Resident graphs.
    pub graphs: u64,
}

impl PoolStats {
    pub(crate) fn count_fallback(&mut self, r: &FallbackReason) {
        self.eager_runs += 1;
        match r {
            FallbackReason::BatchTooLarge { .. } => self.fallback_batch_too_large += 1,
            FallbackReason::OverBudget { .. } => self.fallback_over_budget += 1,
            FallbackReason::CaptureFailed(_) | FallbackReason::Uncapturable => self.fallback_capture_failed += 1,
        }
    }
}

#[derive(Debug)]
struct Slot<G> {
    graph: G,
    bytes: u64,
    last_used: u64,
}

/// A graph that was not admitted because it alone exceeds the budget; the graph is handed back.
#[derive(Debug)]
pub struct Rejected<G> {
    /// The graph.
    pub graph: G,
    /// Its bytes.
    pub need: u64,
    /// The budget.
    pub budget: u64,
}

/// Graphs by key, holding at most `budget` bytes in total: admitting a graph evicts the least recently used
/// ones until it fits. Generic over the graph type (`cudarc`'s `CudaGraph`, a test double, a shape's buffers
/// with its graph...) and the key (a [`GraphKey`] by default).
///
/// ```
/// use tlt_cudagraph::{GraphKey, GraphPool};
/// let mut pool = GraphPool::new(100);
/// pool.insert(GraphKey::decode(1), "g1", 60).unwrap();
/// assert_eq!(pool.get(&GraphKey::decode(1)), Some(&"g1"));
/// let evicted = pool.insert(GraphKey::decode(2), "g2", 60).unwrap();
/// assert_eq!(evicted, [GraphKey::decode(1)]);
/// assert!(pool.insert(GraphKey::decode(4), "g4", 101).is_err());
/// assert!(pool.stats().bytes_in_use <= 100);
/// ```
#[derive(Debug)]
pub struct GraphPool<G, K = GraphKey> {
    budget: u64,
    slots: HashMap<K, Slot<G>>,
    tick: u64,
    stats: PoolStats,
}

impl<G, K: Hash + Eq + Copy> GraphPool<G, K> {
    /// An empty pool of `budget` bytes.
    pub fn new(budget: u64) -> Self {
        Self { budget, slots: HashMap::new(), tick: 0, stats: PoolStats::default() }
    }

    /// The graph for `key`, marking it most recently used; counts a hit or a miss.
    pub fn get(&mut self, key: &K) -> Option<&G> {
        self.tick += 1;
        match self.slots.get_mut(key) {
            Some(s) => {
                s.last_used = self.tick;
                self.stats.hits += 1;
                Some(&s.graph)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Whether `key` is resident (no counting, no LRU update).
    pub fn contains(&self, key: &K) -> bool {
        self.slots.contains_key(key)
    }

    /// Admits a captured graph of `bytes`, evicting least recently used graphs until it fits; returns the
    /// evicted keys (their graphs are dropped). Replaces a graph already under `key`.
    ///
    /// # Errors
    /// [`Rejected`] (nothing is evicted) if `bytes` exceeds the whole budget.
    pub fn insert(&mut self, key: K, graph: G, bytes: u64) -> std::result::Result<Vec<K>, Rejected<G>> {
        if bytes > self.budget {
            return Err(Rejected { graph, need: bytes, budget: self.budget });
        }
        if let Some(old) = self.slots.remove(&key) {
            self.stats.bytes_in_use -= old.bytes;
        }
        let mut evicted = Vec::new();
        while self.stats.bytes_in_use + bytes > self.budget {
            let Some(victim) = self.slots.iter().min_by_key(|(_, s)| s.last_used).map(|(k, _)| *k) else { break };
            if let Some(s) = self.slots.remove(&victim) {
                self.stats.bytes_in_use -= s.bytes;
                self.stats.evictions += 1;
                evicted.push(victim);
            }
        }
        self.tick += 1;
        self.slots.insert(key, Slot { graph, bytes, last_used: self.tick });
        self.stats.bytes_in_use += bytes;
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.stats.bytes_in_use);
        self.stats.captures += 1;
        self.stats.graphs = self.slots.len() as u64;
        Ok(evicted)
    }

    /// The graph of `key` without counting or marking it used.
    pub fn peek(&self, key: &K) -> Option<&G> {
        self.slots.get(key).map(|s| &s.graph)
    }

    /// Takes the graph of `key` out of the pool (its bytes are freed; nothing is counted).
    pub fn remove(&mut self, key: &K) -> Option<G> {
        let s = self.slots.remove(key)?;
        self.stats.bytes_in_use -= s.bytes;
        self.stats.graphs = self.slots.len() as u64;
        Some(s.graph)
    }

    /// Drops every graph.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.stats.bytes_in_use = 0;
        self.stats.graphs = 0;
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Counters.
    pub fn stats(&self) -> &PoolStats {
        &self.stats
    }

    pub(crate) fn stats_mut(&mut self) -> &mut PoolStats {
        &mut self.stats
    }

    /// Resident keys, least recently used first.
    pub fn keys_by_recency(&self) -> Vec<K> {
        let mut v: Vec<(u64, K)> = self.slots.iter().map(|(k, s)| (s.last_used, *k)).collect();
        v.sort_unstable_by_key(|(t, _)| *t);
        v.into_iter().map(|(_, k)| k).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Get(usize),
        Insert(usize, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![(0usize..12).prop_map(Op::Get), (0usize..12, 0u64..400).prop_map(|(k, b)| Op::Insert(k, b))]
    }

    proptest! {
        /// The pool never holds more than its budget, evicts only when it must, and evicts least recently used
        /// first.
        #[test]
        fn never_exceeds_budget_and_evicts_lru(budget in 0u64..1000, ops in proptest::collection::vec(op(), 1..200)) {
            let mut pool = GraphPool::new(budget);
            let mut sizes = std::collections::HashMap::new();
            for o in ops {
                match o {
                    Op::Get(k) => { pool.get(&GraphKey::decode(k)); }
                    Op::Insert(k, bytes) => {
                        let key = GraphKey::decode(k);
                        let before = pool.keys_by_recency();
                        let used_before = pool.stats().bytes_in_use;
                        match pool.insert(key, k, bytes) {
                            Ok(evicted) => {
                                // Evicted keys are a prefix of the recency order (ignoring `key` itself).
                                let order: Vec<_> = before.into_iter().filter(|b| *b != key).collect();
                                prop_assert_eq!(&order[..evicted.len()], &evicted[..]);
                                prop_assert!(pool.contains(&key));
                                // Minimal: keeping the last evicted graph would not have fitted.
                                if let Some(last) = evicted.last() {
                                    let kept = pool.stats().bytes_in_use - bytes + sizes[&last.batch];
                                    prop_assert!(kept + bytes > budget);
                                }
                                for e in &evicted { sizes.remove(&e.batch); }
                                sizes.insert(k, bytes);
                            }
                            Err(r) => {
                                prop_assert!(bytes > budget);
                                prop_assert_eq!(r.need, bytes);
                                prop_assert_eq!(pool.stats().bytes_in_use, used_before);
                            }
                        }
                    }
                }
                prop_assert!(pool.stats().bytes_in_use <= budget);
                prop_assert!(pool.stats().peak_bytes <= budget);
            }
        }
    }

    #[test]
    fn replacing_a_key_frees_its_bytes() {
        let mut pool = GraphPool::new(100);
        pool.insert(GraphKey::decode(1), 1, 80).unwrap();
        let ev = pool.insert(GraphKey::decode(1), 2, 90).unwrap();
        assert!(ev.is_empty());
        assert_eq!(pool.stats().bytes_in_use, 90);
        assert_eq!(pool.get(&GraphKey::decode(1)), Some(&2));
        assert_eq!(pool.get(&GraphKey::decode(2)), None);
        assert_eq!((pool.stats().hits, pool.stats().misses), (1, 1));
        pool.clear();
        assert_eq!(pool.stats().bytes_in_use, 0);
    }
}
