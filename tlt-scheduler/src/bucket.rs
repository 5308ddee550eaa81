//! Batch-size bucketing, as pure functions.
//!
//! Two kinds of bucket meet in the rollout engine:
//! - **capture sizes** (rounding *up*): a step with batch `b` runs the graph captured for the smallest captured
//!   size `>= b`, padding the rest: that ladder is `tlt_cudagraph::BucketPolicy`, the one the graph pool uses;
//! - **BEG groups** (rounding *down*): a batch belongs to the group of the largest lower bound `<= b`
//!   ([`group_of`]), and each group owns one tree size.

/// Index of the group whose lower bound is the largest entry of `thresholds` (sorted ascending) that is `<= b`;
/// a batch below every threshold (only `b = 0` with thresholds starting at 1) falls in group 0.
///
/// ```
/// use tlt_scheduler::bucket::group_of;
/// let t = [1, 2, 5, 21]; // fastrl's `mab_bs_threshold`
/// assert_eq!([1, 2, 4, 5, 20, 21, 500].map(|b| group_of(b, &t)), [0, 1, 1, 2, 2, 3, 3]);
/// ```
pub fn group_of(b: usize, thresholds: &[usize]) -> usize {
    thresholds.partition_point(|&t| t <= b).saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sorted_sizes() -> impl Strategy<Value = Vec<usize>> {
        proptest::collection::btree_set(1usize..5000, 1..40).prop_map(|s| s.into_iter().collect())
    }

    proptest! {
        #[test]
        fn group_is_le_and_maximal(sizes in sorted_sizes(), b in 0usize..6000) {
            let g = group_of(b, &sizes);
            prop_assert!(g < sizes.len());
            if sizes[g] <= b {
                prop_assert!(sizes.get(g + 1).is_none_or(|&next| next > b));
            } else {
                prop_assert_eq!(g, 0, "only batches below every bound may land in a group they are below");
            }
        }
    }
}
