//! Per-shape device state under one memory budget: each shape's buffers and, once captured, the graph over them
//! live and die together (least recently used evicted first); a shape whose capture failed, or whose buffers and
//! graph cannot fit the budget at all, is remembered with the reason and runs eagerly from then on (never captured
//! again); the buffers of such a shape, and of shapes that are never captured (prefill chunks), are kept as one
//! spare until another such shape needs the room.

use std::collections::HashMap;
use std::hash::Hash;

use serde::{Deserialize, Serialize};

use crate::pool::{FallbackReason, GraphPool};

/// A shape's device state.
#[derive(Debug)]
pub struct ShapeEntry<B, G> {
    /// The captured graph (declared first, so it is dropped before the buffers it reads and writes).
    pub graph: Option<G>,
    /// The buffers.
    pub bufs: B,
}

/// How to run a checked-out shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShapePlan {
    /// Replay the entry's graph.
    Replay,
    /// Run eagerly, then capture the same work into a graph ([`ShapeCache::capture_failed`] on failure).
    Capture,
    /// Run eagerly: capture is off for this shape (`None`: never asked for), or not possible (the reason).
    Eager(Option<FallbackReason>),
}

/// Counters of a [`ShapeCache`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapeStats {
    /// Buffers allocated (a shape seen for the first time, or again after eviction).
    pub allocations: u64,
    /// Entries evicted to make room (buffers and graph together).
    pub evictions: u64,
    /// Check-outs that found a graph to replay.
    pub replays: u64,
    /// Check-outs asked to capture.
    pub captures: u64,
    /// Captures that failed (the shapes then run eagerly, with the reason kept).
    pub capture_failures: u64,
    /// Shapes whose buffers and graph alone exceed the budget (they run eagerly on the spare buffers).
    pub over_budget: u64,
    /// Eager check-outs (capture off or not possible).
    pub eager_runs: u64,
    /// Resident shapes.
    pub entries: u64,
    /// Bytes of the resident entries (at most the budget).
    pub bytes_in_use: u64,
    /// Most bytes ever resident at once.
    pub peak_bytes: u64,
    /// Bytes of the spare buffers (outside the budget: the one shape running eagerly needs them).
    pub spare_bytes: u64,
}

/// Shapes' buffers and graphs under `budget` bytes. `K`: the shape key; `B`: its buffers; `G`: its graph.
///
/// ```
/// use tlt_cudagraph::{ShapeCache, ShapePlan};
/// let mut cache: ShapeCache<u32, Vec<u8>, &str> = ShapeCache::new(100);
/// let (mut e, plan) = cache.checkout::<()>(1, true, || Ok((vec![0; 40], 40))).unwrap();
/// assert_eq!(plan, ShapePlan::Capture);
/// e.graph = Some("graph of 1");
/// cache.checkin(1, e, 60, true);
/// let (e, plan) = cache.checkout::<()>(1, true, || unreachable!()).unwrap();
/// assert_eq!((plan, e.graph), (ShapePlan::Replay, Some("graph of 1")));
/// ```
pub struct ShapeCache<K, B, G> {
    pool: GraphPool<ShapeEntry<B, G>, K>,
    eager: HashMap<K, FallbackReason>,
    spare: Option<(K, ShapeEntry<B, G>, u64)>,
    stats: ShapeStats,
}

impl<K: Hash + Eq + Copy, B, G> std::fmt::Debug for ShapeCache<K, B, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShapeCache").field("budget", &self.pool.budget()).field("stats", &self.stats).finish()
    }
}

impl<K: Hash + Eq + Copy, B, G> ShapeCache<K, B, G> {
    /// An empty cache of `budget` bytes.
    pub fn new(budget: u64) -> Self {
        Self { pool: GraphPool::new(budget), eager: HashMap::new(), spare: None, stats: ShapeStats::default() }
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.pool.budget()
    }

    /// Counters.
    pub fn stats(&self) -> &ShapeStats {
        &self.stats
    }

    /// Shapes that run eagerly for a reason (capture failed, or they cannot fit), with the reason.
    pub fn eager_shapes(&self) -> impl Iterator<Item = (&K, &FallbackReason)> {
        self.eager.iter()
    }

    /// Takes shape `key`'s entry out (allocating its buffers with `alloc`, which returns them and their bytes,
    /// when it has none) and says how to run it: replay its graph, capture (when `capture` is asked for and the
    /// shape is not known to be uncapturable), or eagerly. Give the entry back with [`ShapeCache::checkin`].
    ///
    /// # Errors
    /// `alloc`'s error (nothing changes).
    pub fn checkout<E>(
        &mut self,
        key: K,
        capture: bool,
        alloc: impl FnOnce() -> Result<(B, u64), E>,
    ) -> Result<(ShapeEntry<B, G>, ShapePlan), E> {
        let entry = match self.pool.remove(&key) {
            Some(e) => e,
            None => match self.spare.take() {
                Some((k, e, _)) if k == key => e,
                other => {
                    // Another shape's spare buffers make room for this one.
                    drop(other);
                    self.stats.spare_bytes = 0;
                    let (bufs, _) = alloc()?;
                    self.stats.allocations += 1;
                    ShapeEntry { graph: None, bufs }
                }
            },
        };
        self.sync_bytes();
        let plan = match (&entry.graph, self.eager.get(&key)) {
            (Some(_), _) => ShapePlan::Replay,
            (None, Some(reason)) => ShapePlan::Eager(Some(reason.clone())),
            (None, None) if capture => ShapePlan::Capture,
            (None, None) => ShapePlan::Eager(None),
        };
        match plan {
            ShapePlan::Replay => self.stats.replays += 1,
            ShapePlan::Capture => self.stats.captures += 1,
            ShapePlan::Eager(_) => self.stats.eager_runs += 1,
        }
        Ok((entry, plan))
    }

    /// Records that capturing `key` failed (`message`): it runs eagerly from now on.
    pub fn capture_failed(&mut self, key: K, message: String) {
        self.stats.capture_failures += 1;
        self.eager.insert(key, FallbackReason::CaptureFailed(message));
    }

    /// Gives back the entry of `key`, now holding `bytes` (buffers and graph). Resident entries (`keep`) count
    /// against the budget, evicting the least recently used ones (buffers and graphs together) to fit; an entry that
    /// alone exceeds the budget loses its graph, is remembered as over budget (eager from now on) and becomes the
    /// spare, as does every entry given back with `keep == false` (shapes that are never captured).
    pub fn checkin(&mut self, key: K, mut entry: ShapeEntry<B, G>, bytes: u64, keep: bool) {
        let spare = if keep {
            match self.pool.insert(key, entry, bytes) {
                Ok(evicted) => {
                    self.stats.evictions += evicted.len() as u64;
                    None
                }
                Err(rejected) => {
                    let mut e = rejected.graph;
                    e.graph = None;
                    self.stats.over_budget += 1;
                    let reason = FallbackReason::OverBudget { need: rejected.need, budget: rejected.budget };
                    self.eager.insert(key, reason);
                    Some(e)
                }
            }
        } else {
            entry.graph = None;
            Some(entry)
        };
        if let Some(e) = spare {
            self.stats.spare_bytes = bytes;
            self.spare = Some((key, e, bytes));
        }
        self.sync_bytes();
    }

    /// The buffers of `key` (resident or spare), without counting or marking them used.
    pub fn get(&self, key: &K) -> Option<&B> {
        self.pool.peek(key).map(|e| &e.bufs).or_else(|| match &self.spare {
            Some((k, e, _)) if k == key => Some(&e.bufs),
            _ => None,
        })
    }

    /// Drops every entry and the spare, and forgets the eager shapes (e.g. after the buffers' layout changed).
    pub fn clear(&mut self) {
        self.pool.clear();
        self.spare = None;
        self.eager.clear();
        self.stats.spare_bytes = 0;
        self.sync_bytes();
    }

    fn sync_bytes(&mut self) {
        let s = self.pool.stats();
        self.stats.bytes_in_use = s.bytes_in_use;
        self.stats.entries = s.graphs;
        self.stats.peak_bytes = self.stats.peak_bytes.max(s.bytes_in_use);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// Buffers that count how many of them are alive.
    #[derive(Debug)]
    struct Bufs(Rc<Cell<i64>>, u64);

    impl Drop for Bufs {
        fn drop(&mut self) {
            self.0.set(self.0.get() - 1);
        }
    }

    proptest! {
        /// Resident entries stay within the budget; a shape captured once replays until it is evicted; a shape that
        /// failed capture or cannot fit is never captured again; every buffer allocated is either resident, the
        /// spare, or dropped (no leak).
        #[test]
        fn budget_holds_and_failed_shapes_stay_eager(
            budget in 0u64..2000,
            runs in proptest::collection::vec((0u32..10, 1u64..900, any::<bool>(), any::<bool>()), 1..150),
        ) {
            let alive = Rc::new(Cell::new(0i64));
            let mut cache: ShapeCache<u32, Bufs, u32> = ShapeCache::new(budget);
            let mut failed = std::collections::HashSet::new();
            for (key, bytes, capture, fails) in runs {
                // A shape's size is a function of its key (as buffers are of their shape).
                let bytes = bytes / 100 * 100 + u64::from(key);
                let (mut e, plan) = cache
                    .checkout::<()>(key, capture, || {
                        alive.set(alive.get() + 1);
                        Ok((Bufs(alive.clone(), bytes), bytes))
                    })
                    .unwrap();
                if failed.contains(&key) {
                    prop_assert!(matches!(plan, ShapePlan::Eager(Some(_))), "{key} captured again: {plan:?}");
                }
                match plan {
                    ShapePlan::Replay => prop_assert_eq!(e.graph, Some(key)),
                    ShapePlan::Capture if fails => {
                        cache.capture_failed(key, "refused".into());
                        failed.insert(key);
                    }
                    ShapePlan::Capture => e.graph = Some(key),
                    ShapePlan::Eager(_) => prop_assert!(e.graph.is_none()),
                }
                let total = e.bufs.1 + if e.graph.is_some() { 50 } else { 0 };
                cache.checkin(key, e, total, true);
                if cache.eager_shapes().any(|(k, r)| *k == key && matches!(r, FallbackReason::OverBudget { .. })) {
                    failed.insert(key);
                }
                prop_assert!(cache.stats().bytes_in_use <= budget);
                prop_assert!(cache.get(&key).is_some(), "the shape just run keeps its buffers");
                let resident = cache.pool.stats().graphs as i64 + i64::from(cache.spare.is_some());
                prop_assert_eq!(alive.get(), resident, "buffers leaked or lost");
            }
            cache.clear();
            prop_assert_eq!(alive.get(), 0);
        }
    }

    #[test]
    fn never_captured_shapes_share_one_spare() {
        let mut cache: ShapeCache<u32, u64, ()> = ShapeCache::new(1000);
        for key in [7, 7, 8] {
            let (e, plan) = cache.checkout::<()>(key, false, || Ok((u64::from(key), 10))).unwrap();
            assert_eq!(plan, ShapePlan::Eager(None));
            cache.checkin(key, e, 10, false);
        }
        let s = cache.stats();
        assert_eq!((s.allocations, s.bytes_in_use, s.spare_bytes), (2, 0, 10), "7 reused its spare, 8 replaced it");
        assert_eq!(cache.get(&8), Some(&8));
        assert_eq!(cache.get(&7), None);
    }

    #[test]
    fn a_shape_over_budget_is_remembered_and_runs_on_the_spare() {
        let mut cache: ShapeCache<u32, u64, &str> = ShapeCache::new(100);
        let (mut e, plan) = cache.checkout::<()>(1, true, || Ok((1, 90))).unwrap();
        assert_eq!(plan, ShapePlan::Capture);
        e.graph = Some("g");
        cache.checkin(1, e, 150, true);
        let (e, plan) = cache.checkout::<()>(1, true, || panic!("the spare is reused")).unwrap();
        assert_eq!(plan, ShapePlan::Eager(Some(FallbackReason::OverBudget { need: 150, budget: 100 })));
        assert!(e.graph.is_none(), "the graph that could not fit is dropped");
        assert_eq!(cache.stats().over_budget, 1);
    }
}
