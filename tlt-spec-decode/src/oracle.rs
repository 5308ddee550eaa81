//! A drafter that knows the answer: it proposes a request's known continuation (e.g. the target's own greedy
//! output), corrupted at a set rate, so benchmarks and tests control the accept length exactly.

use std::collections::HashMap;

use crate::{DraftContext, DraftTree, Drafter, Error, Plan, RequestId, Result};

/// Which drafted positions of the continuation an [`OracleDrafter`] gets wrong.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Corruption {
    /// Every `n`-th generated position (positions `n - 1`, `2n - 1`, ... counting from 0).
    Every(usize),
    /// Each position independently with probability `rate`, decided by a hash of `(seed, request, position)`
    /// (so the same position is always right or always wrong).
    Rate {
        /// Probability that a position is wrong, in `[0, 1]`.
        rate: f64,
        /// Seed of the hash.
        seed: u64,
    },
}

/// Proposes the known continuation of each registered request: a chain of up to `plan.steps` tokens (capped by
/// `plan.verify_tokens - 1`), wrong at the positions [`Corruption`] picks. With `siblings`, a wrong position
/// also gets the true token as a second child (when `plan.top_k >= 2`) and the chain continues below it, so
/// accepted paths skip nodes. Requests it does not know, or whose history has left the continuation (sampling),
/// get no draft.
#[derive(Debug, Clone)]
pub struct OracleDrafter {
    continuations: HashMap<RequestId, (usize, Vec<u32>)>,
    vocab: u32,
    corruption: Corruption,
    siblings: bool,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl OracleDrafter {
    /// An oracle over a vocabulary of `vocab` tokens.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `vocab < 2`, `Every(0)`, or a rate outside `[0, 1]`.
    pub fn new(vocab: usize, corruption: Corruption, siblings: bool) -> Result<Self> {
        let bad = match corruption {
            Corruption::Every(n) => n == 0,
            Corruption::Rate { rate, .. } => !(0.0..=1.0).contains(&rate),
        };
        if vocab < 2 || vocab > u32::MAX as usize || bad {
            return Err(Error::InvalidArgument(format!("oracle: vocab {vocab}, corruption {corruption:?}")));
        }
        Ok(Self { continuations: HashMap::new(), vocab: vocab as u32, corruption, siblings })
    }

    /// Registers the continuation (generated tokens) of `request`, whose prompt has `prompt_len` tokens.
    pub fn insert(&mut self, request: RequestId, prompt_len: usize, continuation: Vec<u32>) {
        self.continuations.insert(request, (prompt_len, continuation));
    }

    /// The token drafted at generated position `j` of `request`, whose true token is `tok`.
    fn drafted(&self, request: RequestId, j: usize, tok: u32) -> u32 {
        let wrong = match self.corruption {
            Corruption::Every(n) => (j + 1).is_multiple_of(n),
            Corruption::Rate { rate, seed } => {
                let h = splitmix(splitmix(seed ^ splitmix(request.0 as u64)) ^ j as u64);
                ((h >> 11) as f64 / (1u64 << 53) as f64) < rate
            }
        };
        if wrong {
            (tok + 1) % self.vocab
        } else {
            tok
        }
    }
}

impl Drafter for OracleDrafter {
    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
        let root = *ctx.history.last().ok_or_else(|| Error::InvalidArgument("empty history".into()))?;
        let Some((prompt_len, cont)) = self.continuations.get(&ctx.request) else {
            return Ok(DraftTree::new(root));
        };
        let g = ctx.history.len().saturating_sub(*prompt_len);
        if ctx.history.len() < *prompt_len || g > cont.len() || ctx.history[*prompt_len..] != cont[..g] {
            return Ok(DraftTree::new(root));
        }
        let mut tree = DraftTree::new(root);
        let mut cur = 0;
        for (j, &tok) in cont.iter().enumerate().skip(g).take(plan.steps) {
            if tree.len() >= plan.verify_tokens {
                break;
            }
            let d = self.drafted(ctx.request, j, tok);
            if d != tok && self.siblings && plan.top_k >= 2 {
                tree.push_child(cur, d, -0.5)?;
                if tree.len() >= plan.verify_tokens {
                    break;
                }
                cur = tree.push_child(cur, tok, -0.5)?;
            } else {
                cur = tree.push_child(cur, d, -0.5)?;
            }
        }
        Ok(tree)
    }

    fn release(&mut self, request: RequestId) {
        self.continuations.remove(&request);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(history: &[u32]) -> DraftContext<'_> {
        DraftContext { request: RequestId(0), history, prompt_len: 2, hidden: None, group: None }
    }

    #[test]
    fn proposes_the_continuation_with_set_errors() {
        let mut o = OracleDrafter::new(10, Corruption::Every(3), false).unwrap();
        o.insert(RequestId(0), 2, vec![5, 6, 7, 8, 9]);
        let plan = Plan { steps: 4, top_k: 1, verify_tokens: 8 };
        let t = o.propose(&ctx(&[1, 2]), &plan).unwrap();
        assert_eq!(t.tokens(), vec![2, 5, 6, 8, 8]); // position 2 (token 7) corrupted to 8
        let t = o.propose(&ctx(&[1, 2, 5, 6, 7]), &plan).unwrap();
        assert_eq!(t.tokens(), vec![7, 8, 9]);
        let off_track = o.propose(&ctx(&[1, 2, 4]), &plan).unwrap();
        assert_eq!(off_track.len(), 1);
        let mut s = OracleDrafter::new(10, Corruption::Every(2), true).unwrap();
        s.insert(RequestId(0), 2, vec![5, 6, 7]);
        let t = s.propose(&ctx(&[1, 2]), &Plan { steps: 3, top_k: 2, verify_tokens: 8 }).unwrap();
        assert_eq!(t.tokens(), vec![2, 5, 7, 6, 7]);
        assert_eq!(t.parents(), vec![None, Some(0), Some(1), Some(1), Some(3)]);
        assert!(OracleDrafter::new(1, Corruption::Every(1), false).is_err());
        assert!(OracleDrafter::new(4, Corruption::Rate { rate: 1.5, seed: 0 }, false).is_err());
    }

    #[test]
    fn corruption_rate_is_respected() {
        let mut o = OracleDrafter::new(100, Corruption::Rate { rate: 0.25, seed: 7 }, false).unwrap();
        let cont: Vec<u32> = (0..4000).map(|i| i % 50).collect();
        o.insert(RequestId(0), 2, cont.clone());
        let wrong = (0..cont.len()).filter(|&j| o.drafted(RequestId(0), j, cont[j]) != cont[j]).count();
        let rate = wrong as f64 / cont.len() as f64;
        assert!((rate - 0.25).abs() < 0.03, "{rate}");
    }
}
