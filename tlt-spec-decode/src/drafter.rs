//! The drafter seam: anything that proposes a draft tree for a sequence.

use crate::{DraftTree, HiddenStates, NgramDrafter, Plan, RequestId, Result};

/// What a drafter sees of one live request when asked for a draft.
#[derive(Debug, Clone, Copy)]
pub struct DraftContext<'a> {
    /// The request.
    pub request: RequestId,
    /// Prompt + generated tokens. The last one is the root of the draft: committed, not yet fed to the target.
    pub history: &'a [u32],
    /// Length of the prompt within `history`.
    pub prompt_len: usize,
    /// When the engine records hidden states ([`Engine::record_hidden`](crate::Engine::record_hidden)): the
    /// target's features at every position fed so far, `history.len() - 1` rows (row `t` predicts
    /// `history[t + 1]`), so a feature-level drafter (EAGLE) can catch up from any point, e.g. when speculation
    /// is switched on mid-sequence.
    pub hidden: Option<&'a HiddenStates>,
}

/// Proposes draft trees. The [`Engine`](crate::Engine) verifies proposals as deterministic
/// ([`Proposal::PointMass`](crate::Proposal::PointMass)): a drafter must choose its tree as a function of the
/// context (and its own state), never by sampling from the target's stream, for sampling to stay lossless.
pub trait Drafter {
    /// Whether [`DraftContext::hidden`] must be present (the engine then refuses requests without recorded
    /// hidden states). Default: `false`.
    fn needs_hidden(&self) -> bool {
        false
    }

    /// A draft tree whose root is the last token of `ctx.history`, shaped by `plan`. A root-only tree means
    /// "no draft" (plain decoding for this request this round).
    ///
    /// # Errors
    /// On invalid input; the engine's step then fails.
    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree>;

    /// Draft trees for every live request of a round, in order. Override to batch the drafter's own forwards;
    /// the default calls [`Drafter::propose`] per request.
    ///
    /// # Errors
    /// As [`Drafter::propose`].
    fn propose_batch(&mut self, ctxs: &[DraftContext<'_>], plan: &Plan) -> Result<Vec<DraftTree>> {
        ctxs.iter().map(|c| self.propose(c, plan)).collect()
    }

    /// Tokens just committed for `request` (after the verification of its last proposal). Default: ignored.
    fn observe(&mut self, request: RequestId, committed: &[u32]) {
        let _ = (request, committed);
    }

    /// `request` finished: free any per-request state. Default: nothing.
    fn release(&mut self, request: RequestId) {
        let _ = request;
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
        NgramDrafter::propose(self, ctx.history, plan)
    }
}
