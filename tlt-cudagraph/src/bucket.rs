//! Which batch sizes get graphs, and how a batch is padded to one (pure functions).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The batch sizes graphs are captured for; a batch runs the graph of the smallest captured size `>= batch`
/// (the extra rows are padding), or eagerly when it is larger than all of them.
///
/// ```
/// use tlt_cudagraph::BucketPolicy;
/// let p = BucketPolicy::ladder(32);
/// assert_eq!(p.pad(9), Some(10));
/// assert_eq!(p.pad(32), Some(32));
/// assert_eq!(p.pad(33), None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketPolicy {
    /// Captured batch sizes, strictly ascending, starting at `>= 1`.
    pub batch_sizes: Vec<usize>,
}

impl Default for BucketPolicy {
    /// [`BucketPolicy::ladder`]`(32)` (fastrl's `cuda_graph_max_bs = 32`).
    fn default() -> Self {
        Self::ladder(32)
    }
}

impl BucketPolicy {
    /// SGLang's ladder up to `max_bs`: every size to 8, every second to 32, every 8th beyond, and `max_bs`.
    pub fn ladder(max_bs: usize) -> Self {
        let mut v = Vec::new();
        let mut s = 1;
        while s <= max_bs {
            v.push(s);
            s += match s {
                0..=7 => 1,
                8..=31 => 2,
                _ => 8,
            };
        }
        if v.last().is_some_and(|&l| l != max_bs) {
            v.push(max_bs);
        }
        Self { batch_sizes: v }
    }

    /// Only the sizes in `lo..=hi` (e.g. the batch sizes one BEG bucket serves: a tree size's graphs need not
    /// exist for batches that never use that tree size).
    #[must_use]
    pub fn restricted(&self, lo: usize, hi: usize) -> Self {
        Self { batch_sizes: self.batch_sizes.iter().copied().filter(|s| (lo..=hi).contains(s)).collect() }
    }

    /// The captured size a batch runs at: the smallest `>= batch`, `None` above the largest.
    pub fn pad(&self, batch: usize) -> Option<usize> {
        let i = self.batch_sizes.partition_point(|&s| s < batch);
        self.batch_sizes.get(i).copied()
    }

    /// The largest captured size.
    pub fn max_batch(&self) -> Option<usize> {
        self.batch_sizes.last().copied()
    }

    /// Checks: non-empty, strictly ascending, first `>= 1`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`].
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: &str| Err(Error::InvalidConfig { field: "buckets.batch_sizes", reason: reason.into() });
        if self.batch_sizes.first().is_none_or(|&s| s == 0) {
            return bad("must be non-empty and start at >= 1");
        }
        if self.batch_sizes.windows(2).any(|w| w[0] >= w[1]) {
            return bad("must be strictly ascending");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pad_is_ge_and_minimal(set in proptest::collection::btree_set(1usize..3000, 1..50), b in 0usize..3500) {
            let p = BucketPolicy { batch_sizes: set.iter().copied().collect() };
            prop_assert!(p.validate().is_ok());
            match p.pad(b) {
                Some(s) => {
                    prop_assert!(s >= b && set.contains(&s));
                    prop_assert!(set.range(b..s).next().is_none(), "a smaller captured size fits");
                }
                None => prop_assert!(set.iter().all(|&s| s < b)),
            }
        }

        #[test]
        fn ladder_covers_every_batch(max_bs in 1usize..1000, b in 1usize..1000) {
            let p = BucketPolicy::ladder(max_bs);
            prop_assert!(p.validate().is_ok());
            prop_assert_eq!(p.max_batch(), Some(max_bs));
            prop_assert_eq!(p.pad(b).is_some(), b <= max_bs);
        }
    }

    #[test]
    fn defaults_restriction_and_validation() {
        let p = BucketPolicy::default();
        assert_eq!(p.batch_sizes, [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32]);
        // fastrl's verify graphs of 16 tokens exist for batches 5..=20 only.
        assert_eq!(p.restricted(5, 20).batch_sizes, [5, 6, 7, 8, 10, 12, 14, 16, 18, 20]);
        assert!(BucketPolicy { batch_sizes: vec![] }.validate().is_err());
        assert!(BucketPolicy { batch_sizes: vec![0, 1] }.validate().is_err());
        assert!(BucketPolicy { batch_sizes: vec![2, 2] }.validate().is_err());
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<BucketPolicy>(&json).unwrap(), p);
    }
}
