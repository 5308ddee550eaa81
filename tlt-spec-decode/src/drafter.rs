//! The drafter seam: anything that proposes a draft tree for a sequence.

use crate::{DraftTree, Error, GroupId, HiddenStates, NgramDrafter, Plan, RequestId, Result};

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
    /// The request's group (e.g. the GRPO group of samples of one prompt), if it was added with one
    /// ([`Engine::add_group`](crate::Engine::add_group)); group drafters draft from its siblings.
    pub group: Option<GroupId>,
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

    /// Brings the drafter's own state up to date with the live requests' histories (e.g. a learned drafter's KV
    /// cache over the positions committed while it did not draft), so the next [`Drafter::propose_batch`] costs
    /// only the drafting itself. Called by [`Engine::prepare_drafter`](crate::Engine::prepare_drafter), which a
    /// scheduler uses to keep that one-off cost out of its measurement of a speculative round. Default: nothing.
    ///
    /// # Errors
    /// As [`Drafter::propose`].
    fn prepare(&mut self, ctxs: &[DraftContext<'_>]) -> Result<()> {
        let _ = ctxs;
        Ok(())
    }

    /// A request joins the batch: called once per request, before its first [`Drafter::observe`] or
    /// [`Drafter::propose`], with its history at that point (usually just the prompt). Default: ignored.
    fn admit(&mut self, ctx: &DraftContext<'_>) {
        let _ = ctx;
    }

    /// Tokens just committed for `request`, in every round the engine runs with this drafter, speculative or
    /// plain ([`Engine::round`](crate::Engine::round)). Default: ignored.
    fn observe(&mut self, request: RequestId, committed: &[u32]) {
        let _ = (request, committed);
    }

    /// `request` finished: free any per-request state. Default: nothing.
    fn release(&mut self, request: RequestId) {
        let _ = request;
    }

    /// How many drafter kinds this drafter switches between ([`DrafterSet`]); 1 by default.
    fn kinds(&self) -> usize {
        1
    }

    /// Drafts the next proposals with kind `kind` (`< kinds()`). Default: ignored.
    fn select_kind(&mut self, kind: usize) {
        let _ = kind;
    }
}

/// Several drafters behind one: every member sees every admission, commit and release (so each stays current),
/// and the selected one ([`Drafter::select_kind`], e.g. by the scheduler's bandit) proposes.
pub struct DrafterSet<'a> {
    members: Vec<Box<dyn Drafter + 'a>>,
    active: usize,
}

impl std::fmt::Debug for DrafterSet<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrafterSet").field("members", &self.members.len()).field("active", &self.active).finish()
    }
}

impl<'a> DrafterSet<'a> {
    /// A set of `members` (kind `i` is `members[i]`), the first one selected.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty set.
    pub fn new(members: Vec<Box<dyn Drafter + 'a>>) -> Result<Self> {
        if members.is_empty() {
            return Err(Error::InvalidArgument("a drafter set needs at least one drafter".into()));
        }
        Ok(Self { members, active: 0 })
    }

    /// The selected kind.
    pub fn active(&self) -> usize {
        self.active
    }

    /// Member `i`.
    pub fn member_mut(&mut self, i: usize) -> Option<&mut (dyn Drafter + 'a)> {
        Some(self.members.get_mut(i)?.as_mut())
    }
}

impl Drafter for DrafterSet<'_> {
    fn needs_hidden(&self) -> bool {
        self.members.iter().any(|m| m.needs_hidden())
    }
    fn admit(&mut self, ctx: &DraftContext<'_>) {
        self.members.iter_mut().for_each(|m| m.admit(ctx));
    }
    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
        self.members[self.active].propose(ctx, plan)
    }
    fn propose_batch(&mut self, ctxs: &[DraftContext<'_>], plan: &Plan) -> Result<Vec<DraftTree>> {
        self.members[self.active].propose_batch(ctxs, plan)
    }
    fn prepare(&mut self, ctxs: &[DraftContext<'_>]) -> Result<()> {
        self.members[self.active].prepare(ctxs)
    }
    fn observe(&mut self, request: RequestId, committed: &[u32]) {
        self.members.iter_mut().for_each(|m| m.observe(request, committed));
    }
    fn release(&mut self, request: RequestId) {
        self.members.iter_mut().for_each(|m| m.release(request));
    }
    fn kinds(&self) -> usize {
        self.members.len()
    }
    fn select_kind(&mut self, kind: usize) {
        if kind < self.members.len() {
            self.active = kind;
        }
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
        NgramDrafter::propose(self, ctx.history, plan)
    }
}
