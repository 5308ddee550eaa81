//! [`DataSplit`]: training and held-out evaluation prompts from one task, training data in a seeded shuffled order.

use serde::{Deserialize, Serialize};
use tlt_kernels::SplitMix64;

use crate::{Error, Result};

/// Which prompts of a task: the training stream or the held-out evaluation set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Prompts the policy trains on.
    Train,
    /// Held-out prompts, never trained on.
    Eval,
}

/// First task index of a generator's evaluation prompts; training positions stay below it.
pub const GENERATOR_EVAL_BASE: u64 = 1 << 62;

/// Maps a position in a [`Split`] to a task data index.
///
/// - A **finite** task (a file dataset of `n` problems) is permuted once by the seed; the first `held_out` problems
///   of that permutation are the evaluation set and the rest the training pool. Training position `k` is item
///   `k mod pool` of the pool in an order reshuffled (seeded) every epoch, so every training problem is seen once per
///   epoch and no held-out problem ever is.
/// - A **generator** (no length) is already a seeded random stream: training position `k` is index `k`, evaluation
///   position `j` is index [`GENERATOR_EVAL_BASE`]` + j`; the ranges never meet.
///
/// ```
/// use tlt_rl::task::{DataSplit, Split};
///
/// let split = DataSplit::new(Some(10), 3, 7)?;
/// let eval: Vec<u64> = (0..3).map(|j| split.index(Split::Eval, j)).collect::<Result<_, _>>()?;
/// let epoch: Vec<u64> = (0..7).map(|k| split.index(Split::Train, k)).collect::<Result<_, _>>()?;
/// assert!(epoch.iter().all(|i| !eval.contains(i)));
/// # Ok::<(), tlt_rl::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataSplit {
    len: Option<u64>,
    held_out: u64,
    seed: u64,
}

/// Fisher–Yates permutation of `0..n` drawn from `rng`.
fn permutation(n: u64, mut rng: SplitMix64) -> Vec<u64> {
    let mut p: Vec<u64> = (0..n).collect();
    for i in (1..p.len()).rev() {
        p.swap(i, rng.below(i + 1));
    }
    p
}

impl DataSplit {
    /// A split of a task of `len` problems (`None`: a generator) holding out `held_out` of them, shuffled by `seed`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a finite task would keep no training problem.
    pub fn new(len: Option<u64>, held_out: u64, seed: u64) -> Result<Self> {
        if let Some(n) = len {
            if held_out >= n {
                return Err(Error::config(
                    "task.held_out",
                    format!("holding out {held_out} of {n} problems leaves none to train on"),
                ));
            }
        }
        Ok(Self { len, held_out, seed })
    }

    /// Problems held out for evaluation (`None` for a generator: unbounded).
    pub fn held_out(&self) -> Option<u64> {
        self.len.map(|_| self.held_out)
    }

    /// The task index of position `pos` of `split`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an evaluation position past the held-out set, or a generator's training
    /// position at or past [`GENERATOR_EVAL_BASE`].
    pub fn index(&self, split: Split, pos: u64) -> Result<u64> {
        let Some(n) = self.len else {
            return match split {
                Split::Train if pos < GENERATOR_EVAL_BASE => Ok(pos),
                Split::Eval if pos < GENERATOR_EVAL_BASE => Ok(GENERATOR_EVAL_BASE + pos),
                _ => Err(Error::InvalidArgument(format!("data position {pos} is past the generator's range"))),
            };
        };
        let base = SplitMix64::new(self.seed);
        let order = permutation(n, base.fork(0));
        match split {
            Split::Eval if pos < self.held_out => Ok(order[pos as usize]),
            Split::Eval => Err(Error::InvalidArgument(format!(
                "evaluation prompt {pos} is past the held-out set of {} problems (raise task.held_out)",
                self.held_out
            ))),
            Split::Train => {
                let pool = n - self.held_out;
                let (epoch, k) = (pos / pool, pos % pool);
                let shuffle = permutation(pool, base.fork(epoch.wrapping_add(1)));
                Ok(order[(self.held_out + shuffle[k as usize]) as usize])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    fn indices(s: &DataSplit, split: Split, range: std::ops::Range<u64>) -> Vec<u64> {
        range.map(|k| s.index(split, k).unwrap()).collect()
    }

    #[test]
    fn every_training_problem_once_per_epoch_in_a_new_order() {
        let s = DataSplit::new(Some(50), 8, 3).unwrap();
        let eval: BTreeSet<u64> = indices(&s, Split::Eval, 0..8).into_iter().collect();
        assert_eq!(eval.len(), 8);
        let e0 = indices(&s, Split::Train, 0..42);
        let e1 = indices(&s, Split::Train, 42..84);
        for e in [&e0, &e1] {
            let set: BTreeSet<u64> = e.iter().copied().collect();
            assert_eq!(set.len(), 42, "each training problem once per epoch");
            assert!(set.is_disjoint(&eval));
            assert_eq!(set.len() + eval.len(), 50);
        }
        assert_ne!(e0, e1, "reshuffled every epoch");
        assert_ne!(e0, (0..42).collect::<Vec<_>>(), "shuffled, not in file order");
        // Seeded: the same seed gives the same order, another seed another.
        assert_eq!(e0, indices(&DataSplit::new(Some(50), 8, 3).unwrap(), Split::Train, 0..42));
        assert_ne!(e0, indices(&DataSplit::new(Some(50), 8, 4).unwrap(), Split::Train, 0..42));
    }

    #[test]
    fn bad_splits_are_errors() {
        assert!(DataSplit::new(Some(5), 5, 0).is_err());
        let s = DataSplit::new(Some(5), 2, 0).unwrap();
        let e = s.index(Split::Eval, 2).unwrap_err().to_string();
        assert!(e.contains("held-out set of 2"), "{e}");
        let g = DataSplit::new(None, 0, 0).unwrap();
        assert_eq!(g.index(Split::Train, 5).unwrap(), 5);
        assert_eq!(g.index(Split::Eval, 5).unwrap(), GENERATOR_EVAL_BASE + 5);
        assert!(g.index(Split::Train, GENERATOR_EVAL_BASE).is_err());
        assert_eq!(g.held_out(), None);
    }

    proptest! {
        /// The held-out split never overlaps training, for any size, hold-out and seed, over several epochs.
        #[test]
        fn held_out_never_overlaps_training(n in 2u64..200, frac in 0.0f64..1.0, seed in any::<u64>()) {
            let held = ((n - 1) as f64 * frac) as u64;
            let s = DataSplit::new(Some(n), held, seed).unwrap();
            let eval: BTreeSet<u64> = indices(&s, Split::Eval, 0..held).into_iter().collect();
            prop_assert_eq!(eval.len() as u64, held);
            for i in indices(&s, Split::Train, 0..3 * (n - held)) {
                prop_assert!(i < n && !eval.contains(&i));
            }
        }
    }
}
