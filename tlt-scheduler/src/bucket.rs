//! Batch-size bucketing, as pure functions.
//!
//! Two kinds of bucket meet in the rollout engine:
//! - **capture sizes** (rounding *up*): a step with batch `b` runs the graph captured for the smallest captured
//!   size `>= b`, padding the rest ([`pad_up`], [`capture_sizes`]);
//! - **BEG groups** (rounding *down*): a batch belongs to the group of the largest lower bound `<= b`
//!   ([`group_of`]), and each group owns one tree size.

/// The smallest entry of `sizes` (sorted ascending, no duplicates) that is `>= b`, or `None` when `b` exceeds
/// them all (the caller then runs eagerly, unpadded).
///
/// ```
/// use tlt_scheduler::bucket::pad_up;
/// assert_eq!(pad_up(9, &[1, 2, 4, 8, 16]), Some(16));
/// assert_eq!(pad_up(8, &[1, 2, 4, 8, 16]), Some(8));
/// assert_eq!(pad_up(17, &[1, 2, 4, 8, 16]), None);
/// ```
pub fn pad_up(b: usize, sizes: &[usize]) -> Option<usize> {
    let i = sizes.partition_point(|&s| s < b);
    sizes.get(i).copied()
}

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

/// The batch sizes to capture graphs for, up to `max_bs` (SGLang's ladder): every size to 8, then every second
/// size to 32, then every 8th, and `max_bs` itself. Sorted ascending, no duplicates; empty for `max_bs = 0`.
///
/// ```
/// use tlt_scheduler::bucket::capture_sizes;
/// assert_eq!(capture_sizes(12), vec![1, 2, 3, 4, 5, 6, 7, 8, 10, 12]);
/// assert_eq!(capture_sizes(33).last(), Some(&33));
/// ```
pub fn capture_sizes(max_bs: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = 1;
    while s <= max_bs {
        out.push(s);
        s += match s {
            0..=7 => 1,
            8..=31 => 2,
            _ => 8,
        };
    }
    if out.last().is_some_and(|&l| l != max_bs) {
        out.push(max_bs);
    }
    out
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
        fn pad_up_is_ge_and_minimal(sizes in sorted_sizes(), b in 0usize..6000) {
            match pad_up(b, &sizes) {
                Some(p) => {
                    prop_assert!(p >= b);
                    prop_assert!(sizes.contains(&p));
                    prop_assert!(sizes.iter().all(|&s| s < b || s >= p), "a smaller size >= b exists");
                }
                None => prop_assert!(sizes.iter().all(|&s| s < b)),
            }
        }

        #[test]
        fn capture_ladder_pads_every_batch_minimally(max_bs in 1usize..600, b in 1usize..600) {
            let sizes = capture_sizes(max_bs);
            prop_assert!(sizes.windows(2).all(|w| w[0] < w[1]));
            prop_assert_eq!(sizes.first().copied(), Some(1));
            prop_assert_eq!(sizes.last().copied(), Some(max_bs));
            let p = pad_up(b, &sizes);
            if b <= max_bs {
                let p = p.unwrap();
                prop_assert!(p >= b && (b..p).all(|s| !sizes.contains(&s)));
            } else {
                prop_assert!(p.is_none());
            }
        }

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

    #[test]
    fn sglang_ladder_to_32() {
        let s = capture_sizes(32);
        assert_eq!(s, [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32]);
        assert!(capture_sizes(0).is_empty());
    }
}
