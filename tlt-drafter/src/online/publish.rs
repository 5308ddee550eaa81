//! Versioned weight publication: a trainer publishes immutable snapshots, readers swap to the newest only at
//! points they choose (between verify rounds), so a round always uses exactly one version.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

/// A published snapshot and its version (0 = the initial weights, then 1, 2, ...).
#[derive(Debug)]
pub struct Versioned<W> {
    /// Monotonic version.
    pub version: u64,
    /// The weights; immutable once published.
    pub weights: W,
}

/// The slot a trainer publishes into. Publishing swaps an `Arc`: a reader holding the previous snapshot keeps
/// it intact until it lets go.
#[derive(Debug)]
pub struct WeightsSlot<W> {
    current: RwLock<Arc<Versioned<W>>>,
    version: AtomicU64,
}

impl<W> WeightsSlot<W> {
    /// A slot holding `initial` as version 0.
    pub fn new(initial: W) -> Self {
        Self::with_version(initial, 0)
    }

    /// A slot holding `initial` as `version` (a resumed run continues its numbering).
    pub fn with_version(initial: W, version: u64) -> Self {
        Self {
            current: RwLock::new(Arc::new(Versioned { version, weights: initial })),
            version: AtomicU64::new(version),
        }
    }

    /// Publishes `weights` as the next version and returns it.
    pub fn publish(&self, weights: W) -> u64 {
        let mut g = self.current.write();
        let version = g.version + 1;
        *g = Arc::new(Versioned { version, weights });
        self.version.store(version, Ordering::Release);
        version
    }

    /// Publishes `weights` as `version`, the numbering of another slot this one replicates (a data-parallel
    /// rank installing the weights another rank trained). Returns false, changing nothing, unless `version` is
    /// newer than the current one.
    pub fn publish_as(&self, weights: W, version: u64) -> bool {
        let mut g = self.current.write();
        if version <= g.version {
            return false;
        }
        *g = Arc::new(Versioned { version, weights });
        self.version.store(version, Ordering::Release);
        true
    }

    /// The newest snapshot.
    pub fn latest(&self) -> Arc<Versioned<W>> {
        self.current.read().clone()
    }

    /// The newest version number (a cheap atomic load).
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }
}

/// A reader's view of a [`WeightsSlot`]: it holds one snapshot and swaps only in [`WeightsReader::refresh`].
#[derive(Debug)]
pub struct WeightsReader<W> {
    slot: Arc<WeightsSlot<W>>,
    held: Arc<Versioned<W>>,
}

impl<W> WeightsReader<W> {
    /// A reader holding the slot's newest snapshot.
    pub fn new(slot: Arc<WeightsSlot<W>>) -> Self {
        let held = slot.latest();
        Self { slot, held }
    }

    /// Swaps to the newest snapshot if there is one; returns whether it did.
    pub fn refresh(&mut self) -> bool {
        if self.slot.version() == self.held.version {
            return false;
        }
        self.held = self.slot.latest();
        true
    }

    /// The snapshot held.
    pub fn current(&self) -> &Versioned<W> {
        &self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_follows_another_slots_numbering_forward_only() {
        let slot = WeightsSlot::new(0u8);
        assert!(slot.publish_as(7, 5));
        assert_eq!((slot.version(), slot.latest().weights), (5, 7));
        assert!(!slot.publish_as(9, 5), "not newer");
        assert!(!slot.publish_as(9, 2), "older");
        assert_eq!((slot.version(), slot.latest().weights), (5, 7));
        assert_eq!(slot.publish(8), 6, "own publications continue from there");
    }

    #[test]
    fn readers_swap_only_on_refresh_and_never_see_torn_weights() {
        let slot = Arc::new(WeightsSlot::new(vec![0u64; 64]));
        let mut reader = WeightsReader::new(slot.clone());
        assert_eq!(reader.current().version, 0);
        assert_eq!(slot.publish(vec![1; 64]), 1);
        assert_eq!(reader.current().version, 0, "no swap before refresh");
        assert!(reader.refresh());
        assert!(!reader.refresh());
        assert_eq!(reader.current().weights, vec![1; 64]);

        // A writer publishes 200 versions, each filled with its own number, while readers check every snapshot
        // is uniform and versions never go back.
        let writer = {
            let slot = slot.clone();
            std::thread::spawn(move || {
                for v in 2..=201u64 {
                    assert_eq!(slot.publish(vec![v; 64]), v);
                }
            })
        };
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let mut r = WeightsReader::new(slot.clone());
                std::thread::spawn(move || {
                    let mut last = 0;
                    while last < 201 {
                        r.refresh();
                        let c = r.current();
                        assert!(c.weights.iter().all(|&x| x == c.version), "torn snapshot");
                        assert!(c.version >= last);
                        last = c.version;
                    }
                })
            })
            .collect();
        writer.join().unwrap();
        for r in readers {
            r.join().unwrap();
        }
    }
}
