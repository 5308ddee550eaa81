//! Token-budget micro-batching for gradient accumulation (verl `use_dynamic_bsz` / `ppo_max_token_len_per_gpu`).

use crate::{Error, Result};

/// Splits sequence indices `0..lengths.len()` into micro-batches whose padded size (sequences × longest length in
/// the micro-batch) is at most `token_budget`.
///
/// Sequences are taken longest first (ties by index) and added to the current micro-batch while it stays within
/// budget; otherwise a new one starts. A sequence longer than the budget gets a micro-batch of its own. Lengths of 0
/// count as 1, so a micro-batch never holds more than `token_budget` sequences. Deterministic; the micro-batches come
/// longest first, and indices inside each are ascending. Errors on `token_budget == 0`.
pub fn plan_micro_batches(lengths: &[usize], token_budget: usize) -> Result<Vec<Vec<usize>>> {
    if token_budget == 0 {
        return Err(Error::InvalidArgument("plan_micro_batches: token_budget is 0".into()));
    }
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    let mut plan: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    // Longest length of `current`: its first element, as lengths only decrease along `order`.
    let mut longest = 0usize;
    for i in order {
        let len = lengths[i].max(1);
        if current.is_empty() {
            longest = len;
        } else if (current.len() + 1).saturating_mul(longest) > token_budget {
            plan.push(std::mem::take(&mut current));
            longest = len;
        }
        current.push(i);
    }
    if !current.is_empty() {
        plan.push(current);
    }
    for mb in &mut plan {
        mb.sort_unstable();
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn microbatch_hand_computed() {
        // Sorted: 3 (len 9), 0 (5), 2 (5), 1 (3), 4 (1).
        let plan = plan_micro_batches(&[5, 3, 5, 9, 1], 10).unwrap();
        assert_eq!(plan, vec![vec![3], vec![0, 2], vec![1, 4]]);
        assert_eq!(plan_micro_batches(&[20, 2], 10).unwrap(), vec![vec![0], vec![1]]);
        assert_eq!(plan_micro_batches(&[2, 2, 2], 100).unwrap(), vec![vec![0, 1, 2]]);
        assert_eq!(plan_micro_batches(&[0, 0, 0], 2).unwrap(), vec![vec![0, 1], vec![2]]);
        assert!(plan_micro_batches(&[], 10).unwrap().is_empty());
        assert!(matches!(plan_micro_batches(&[1], 0), Err(Error::InvalidArgument(_))));
    }

    proptest! {
        #[test]
        fn microbatch_partition_budget_determinism(
            lengths in prop::collection::vec(0usize..64, 0..40),
            budget in 1usize..256,
        ) {
            let plan = plan_micro_batches(&lengths, budget).unwrap();
            let mut seen = vec![0usize; lengths.len()];
            for mb in &plan {
                prop_assert!(!mb.is_empty());
                prop_assert!(mb.windows(2).all(|w| w[0] < w[1]));
                for &i in mb {
                    seen[i] += 1;
                }
                let longest = mb.iter().map(|&i| lengths[i].max(1)).max().unwrap_or(0);
                prop_assert!(mb.len() == 1 || mb.len() * longest <= budget, "{:?} over budget {}", mb, budget);
            }
            prop_assert!(seen.iter().all(|&c| c == 1));
            prop_assert_eq!(plan_micro_batches(&lengths, budget).unwrap(), plan);
        }
    }
}
