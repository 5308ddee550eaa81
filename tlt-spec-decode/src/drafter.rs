//! The drafter seam: anything that proposes a draft tree for a sequence.

use crate::{DraftTree, NgramDrafter, Plan, Result};

/// Proposes draft trees. The [`Engine`](crate::Engine) verifies proposals as deterministic
/// ([`Proposal::PointMass`](crate::Proposal::PointMass)): a drafter must choose its tree as a function of the
/// history (and its own state), never by sampling, for sampling to stay lossless.
pub trait Drafter {
    /// A draft tree for request `seq_id` whose root is the last token of `history` (prompt + generated so far),
    /// shaped by `plan`. A root-only tree means "no draft" (plain decoding for this round).
    ///
    /// # Errors
    /// On invalid input; the engine's step then fails.
    fn propose(&mut self, seq_id: usize, history: &[u32], plan: &Plan) -> Result<DraftTree>;

    /// Tokens just committed for `seq_id` (after the verification of its last proposal). Default: ignored.
    fn observe(&mut self, seq_id: usize, committed: &[u32]) {
        let _ = (seq_id, committed);
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, _seq_id: usize, history: &[u32], plan: &Plan) -> Result<DraftTree> {
        NgramDrafter::propose(self, history, plan)
    }
}
