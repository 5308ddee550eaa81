//! Model-free n-gram drafting ("prompt lookup decoding"): propose what followed earlier occurrences of the
//! sequence's last few tokens.

use serde::{Deserialize, Serialize};

use crate::{DraftTree, Error, Plan, Result};

/// A prompt-lookup drafter. It looks for earlier occurrences of the last `n` tokens of the history (prompt +
/// generated), for `n` from `max_ngram` down to `min_ngram`, and proposes the tokens that followed them.
///
/// Its proposals are deterministic functions of the history, so verify them with
/// [`Proposal::PointMass`](crate::Proposal::PointMass). Every edge gets draft log-probability 0.
///
/// ```
/// use tlt_spec_decode::{NgramDrafter, Plan};
///
/// # fn main() -> tlt_spec_decode::Result<()> {
/// // "... 5 6 7 8 ... 5 6" -> propose "7 8" after the root 6.
/// let history = [1, 5, 6, 7, 8, 2, 5, 6];
/// let tree = NgramDrafter::default().propose(&history, &Plan::chain(2))?;
/// assert_eq!(tree.tokens(), vec![6, 7, 8]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct NgramDrafter {
    /// Shortest suffix length matched (`>= 1`; default 1).
    pub min_ngram: usize,
    /// Longest suffix length matched, tried first (`>= min_ngram`; default 3).
    pub max_ngram: usize,
}

impl Default for NgramDrafter {
    /// Suffixes of 3, 2, then 1 tokens.
    fn default() -> Self {
        Self { min_ngram: 1, max_ngram: 3 }
    }
}

impl NgramDrafter {
    /// Checks `1 <= min_ngram <= max_ngram`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if self.min_ngram == 0 {
            return Err(Error::InvalidArgument("min_ngram must be at least 1".into()));
        }
        if self.max_ngram < self.min_ngram {
            return Err(Error::InvalidArgument(format!(
                "max_ngram {} is below min_ngram {}",
                self.max_ngram, self.min_ngram
            )));
        }
        Ok(())
    }

    /// Proposes a draft tree rooted at the last token of `history`.
    ///
    /// Continuations (up to `plan.steps` tokens each) are taken from the longest matching suffix first and,
    /// within one suffix length, from the most recent occurrence first; shorter suffixes are tried after
    /// longer ones. The first continuation becomes the main chain; later ones are merged into the tree as a
    /// trie (a shared prefix follows the existing branch, a new token opens a new branch). A continuation is
    /// cut where it would give a node more than `plan.top_k` children or the tree more than
    /// `plan.verify_tokens` nodes. Without any match the tree is just the root (plain decoding).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty `history` or invalid n-gram bounds, [`Error::InvalidPlan`] for an
    /// invalid `plan`.
    pub fn propose(&self, history: &[u32], plan: &Plan) -> Result<DraftTree> {
        self.validate()?;
        plan.validate()?;
        let Some(&root) = history.last() else {
            return Err(Error::InvalidArgument("n-gram drafting needs a non-empty history".into()));
        };
        let mut tree = DraftTree::new(root);
        let len = history.len();
        // A match at `s` needs `s + n < len` so that at least one token follows it.
        for n in (self.min_ngram..=self.max_ngram.min(len - 1)).rev() {
            let suffix = &history[len - n..];
            for s in (0..len - n).rev() {
                if tree.len() >= plan.verify_tokens {
                    return Ok(tree);
                }
                if &history[s..s + n] != suffix {
                    continue;
                }
                let end = (s + n + plan.steps).min(len);
                insert(&mut tree, &history[s + n..end], plan)?;
            }
        }
        Ok(tree)
    }
}

/// Merges `cont` into `tree` below the root as a trie path, stopping at the width or size limit.
fn insert(tree: &mut DraftTree, cont: &[u32], plan: &Plan) -> Result<()> {
    let mut cur = 0;
    for &tok in cont {
        let kids = tree.children(cur)?;
        if let Some(&c) = kids.iter().find(|&&c| tree.nodes()[c].token == tok) {
            cur = c;
            continue;
        }
        if kids.len() >= plan.top_k || tree.len() >= plan.verify_tokens {
            break;
        }
        cur = tree.push_child(cur, tok, 0.0)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_match_is_root_only() {
        let t = NgramDrafter::default().propose(&[1, 2, 3, 4], &Plan::default()).expect("valid");
        assert_eq!(t.tokens(), vec![4]);
        let t = NgramDrafter::default().propose(&[9], &Plan::default()).expect("valid");
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(NgramDrafter::default().propose(&[], &Plan::default()).is_err());
        assert!(NgramDrafter { min_ngram: 0, max_ngram: 2 }.propose(&[1, 1], &Plan::default()).is_err());
        assert!(NgramDrafter { min_ngram: 3, max_ngram: 2 }.propose(&[1, 1], &Plan::default()).is_err());
        assert!(NgramDrafter::default().propose(&[1, 1], &Plan::chain(0)).is_err());
    }

    #[test]
    fn most_recent_longest_match_is_the_main_chain() {
        // Suffix "1 2" occurs at 0 (followed by 3 4 5) and at 5 (followed by 6 7 8); the latter is more recent.
        let h = [1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 0, 1, 2];
        let plan = Plan { steps: 3, top_k: 2, verify_tokens: 7 };
        let d = NgramDrafter { min_ngram: 2, max_ngram: 2 };
        let t = d.propose(&h, &plan).expect("valid");
        assert_eq!(t.tokens(), vec![2, 6, 7, 8, 3, 4, 5]);
        assert_eq!(t.parents(), vec![None, Some(0), Some(1), Some(2), Some(0), Some(4), Some(5)]);
        // A budget of 5 cuts the second branch.
        let t = d.propose(&h, &Plan { verify_tokens: 5, ..plan }).expect("valid");
        assert_eq!(t.tokens(), vec![2, 6, 7, 8, 3]);
        // top_k 1 allows no second branch at all.
        let t = d.propose(&h, &Plan { steps: 3, top_k: 1, verify_tokens: 4 }).expect("valid");
        assert_eq!(t.tokens(), vec![2, 6, 7, 8]);
    }

    #[test]
    fn shared_prefixes_merge() {
        // "9" is followed by "3 4" and (more recently) "3 5": one branch "3" with children 5 then 4.
        let h = [9, 3, 4, 9, 3, 5, 9];
        let plan = Plan { steps: 2, top_k: 2, verify_tokens: 7 };
        let t = NgramDrafter { min_ngram: 1, max_ngram: 1 }.propose(&h, &plan).expect("valid");
        assert_eq!(t.tokens(), vec![9, 3, 5, 4]);
        assert_eq!(t.parents(), vec![None, Some(0), Some(1), Some(1)]);
    }

    #[test]
    fn longer_suffix_wins_over_more_recent_shorter_one() {
        // Suffix "1 2 3": the 3-gram match at 0 (-> 4) beats the more recent 1-gram match of "3" (-> 7).
        let h = [1, 2, 3, 4, 0, 3, 7, 1, 2, 3];
        let t = NgramDrafter::default().propose(&h, &Plan::chain(1)).expect("valid");
        assert_eq!(t.tokens(), vec![3, 4]);
    }
}
