//! The shape of one speculative round: how deep to draft, how wide, and how many tree nodes to verify.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The shape of a draft tree for one speculative round, in SGLang's terms `--speculative-num-steps`,
/// `--speculative-eagle-topk` and `--speculative-num-draft-tokens` (fastrl's arm `8_4_48` is
/// `Plan { steps: 8, top_k: 4, verify_tokens: 48 }`, the [`Default`]).
///
/// At most `steps + 1` tokens are committed per verification (`steps` drafted ones plus the bonus/correction).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Plan {
    /// Draft depth: the number of tree levels below the root (`>= 1`).
    pub steps: usize,
    /// Branching: frontier beams kept per level and children expanded per beam (`>= 1`; `1` = a chain).
    pub top_k: usize,
    /// Tree nodes sent to the target, root included (`>= 1`, at most [`Plan::max_tree_nodes`]).
    pub verify_tokens: usize,
}

impl Default for Plan {
    /// fastrl's default arm: 8 steps, top-k 4, 48 verify tokens.
    fn default() -> Self {
        Self { steps: 8, top_k: 4, verify_tokens: 48 }
    }
}

impl Plan {
    /// A chain draft of `steps` tokens: `top_k = 1`, `verify_tokens = steps + 1`.
    ///
    /// ```
    /// use tlt_spec_decode::Plan;
    /// let p = Plan::chain(4);
    /// assert_eq!((p.steps, p.top_k, p.verify_tokens), (4, 1, 5));
    /// assert!(p.validate().is_ok());
    /// ```
    pub fn chain(steps: usize) -> Self {
        Self { steps, top_k: 1, verify_tokens: steps.saturating_add(1) }
    }

    /// The most nodes (root included) an EAGLE-2 tree of this depth and width can hold:
    /// `1 + top_k + (steps - 1) * top_k^2`. The first level holds the root's `top_k` children; each later level
    /// scores `top_k` beams times `top_k` children. For a chain this is `1 + steps`. Saturates instead of
    /// overflowing.
    pub fn max_tree_nodes(&self) -> usize {
        let k = self.top_k;
        let later = self.steps.saturating_sub(1).saturating_mul(k.saturating_mul(k));
        1usize.saturating_add(k).saturating_add(later)
    }

    /// Checks that `steps`, `top_k` and `verify_tokens` are all `>= 1` and that `verify_tokens` does not exceed
    /// [`Plan::max_tree_nodes`] (more nodes than the tree can hold would only be padding).
    ///
    /// # Errors
    /// [`Error::InvalidPlan`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if self.steps == 0 {
            return Err(Error::InvalidPlan("steps must be at least 1".into()));
        }
        if self.top_k == 0 {
            return Err(Error::InvalidPlan("top_k must be at least 1".into()));
        }
        if self.verify_tokens == 0 {
            return Err(Error::InvalidPlan("verify_tokens must be at least 1 (the root)".into()));
        }
        let max = self.max_tree_nodes();
        if self.verify_tokens > max {
            return Err(Error::InvalidPlan(format!(
                "verify_tokens {} exceeds the {max} nodes a tree of {} steps and top_k {} can hold",
                self.verify_tokens, self.steps, self.top_k
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_chain_are_valid() {
        assert!(Plan::default().validate().is_ok());
        assert_eq!(Plan::default().max_tree_nodes(), 1 + 4 + 7 * 16);
        for s in 1..10 {
            assert!(Plan::chain(s).validate().is_ok());
            assert_eq!(Plan::chain(s).max_tree_nodes(), s + 1);
        }
    }

    #[test]
    fn rejects_bad_fields() {
        assert!(Plan { steps: 0, top_k: 1, verify_tokens: 1 }.validate().is_err());
        assert!(Plan { steps: 1, top_k: 0, verify_tokens: 1 }.validate().is_err());
        assert!(Plan { steps: 1, top_k: 1, verify_tokens: 0 }.validate().is_err());
        assert!(Plan::chain(0).validate().is_err());
        // A chain of 3 holds 4 nodes, not 5.
        assert!(Plan { steps: 3, top_k: 1, verify_tokens: 5 }.validate().is_err());
        assert!(Plan { steps: 2, top_k: 2, verify_tokens: 7 }.validate().is_ok());
        assert!(Plan { steps: 2, top_k: 2, verify_tokens: 8 }.validate().is_err());
        assert!(Plan { steps: usize::MAX, top_k: usize::MAX, verify_tokens: usize::MAX }.validate().is_ok());
    }
}
