//! One tree from two drafters: the union of their trees, deduplicated by prefix, pruned to one verify budget.

use std::collections::HashMap;

use crate::{DraftContext, DraftTree, Drafter, Error, Plan, RequestId, Result};

/// Merges `a` and `b` (trees with the same root) into one tree of at most `plan.verify_tokens` nodes.
///
/// The scoring rule: both trees are read as tries of token paths; a path present in both keeps the **higher**
/// of its two cumulative draft log-probabilities (scores), so each drafter's own confidence speaks for its nodes
/// and agreement never lowers a node. A node is ranked by the minimum score along its path (its own score when
/// edge log-probabilities are `<= 0`, as they are for normalised drafters and the suffix drafter), ties broken
/// by depth and then by order of appearance (`a`'s nodes first), and the best `verify_tokens - 1` nodes are kept
/// with the root. The kept set is ancestor-closed, children keep their order of appearance, and node depth stays
/// within the inputs' (so within `plan.steps`). A node may get more than `plan.top_k` children when both trees
/// branch differently there: the budget that verification pays for is `verify_tokens`.
///
/// # Errors
/// [`Error::InvalidTree`] if the roots differ, [`Error::InvalidPlan`] for an invalid plan.
pub fn merge_trees(a: &DraftTree, b: &DraftTree, plan: &Plan) -> Result<DraftTree> {
    plan.validate()?;
    if a.root_token() != b.root_token() {
        return Err(Error::InvalidTree(format!(
            "cannot merge trees rooted at {} and {}",
            a.root_token(),
            b.root_token()
        )));
    }
    // Merged trie: (token, parent, depth, score); node 0 is the root.
    let mut nodes: Vec<(u32, usize, usize, f32)> = vec![(a.root_token(), 0, 0, 0.0)];
    let mut index: HashMap<(usize, u32), usize> = HashMap::new();
    for t in [a, b] {
        let mut map = vec![0usize; t.len()];
        for (i, n) in t.nodes().iter().enumerate().skip(1) {
            let p = map[n.parent.unwrap_or(0)];
            let m = *index.entry((p, n.token)).or_insert_with(|| {
                nodes.push((n.token, p, nodes[p].2 + 1, f32::NEG_INFINITY));
                nodes.len() - 1
            });
            nodes[m].3 = nodes[m].3.max(n.score);
            map[i] = m;
        }
    }
    // Rank by the minimum score along the path (parents precede children in `nodes`).
    let mut eff = vec![0.0f32; nodes.len()];
    for i in 1..nodes.len() {
        eff[i] = nodes[i].3.min(eff[nodes[i].1]);
    }
    let mut order: Vec<usize> = (1..nodes.len()).collect();
    order.sort_by(|&x, &y| eff[y].total_cmp(&eff[x]).then(nodes[x].2.cmp(&nodes[y].2)).then(x.cmp(&y)));
    order.truncate(plan.verify_tokens.saturating_sub(1));
    // Emit in merged-trie order so parents precede children and siblings keep their order of appearance.
    order.sort_unstable();
    let mut out = DraftTree::new(a.root_token());
    let mut pos = vec![usize::MAX; nodes.len()];
    pos[0] = 0;
    for m in order {
        let p = nodes[m].1;
        if pos[p] == usize::MAX {
            return Err(Error::InvalidTree("merged tree is not ancestor-closed".into()));
        }
        let lp = if eff[m].is_finite() && eff[p].is_finite() { eff[m] - eff[p] } else { eff[m] };
        pos[m] = out.push_child(pos[p], nodes[m].0, lp)?;
    }
    Ok(out)
}

/// Drafts with two drafters and verifies the union of their trees ([`merge_trees`]): e.g. a
/// [`SuffixDrafter`](crate::SuffixDrafter) over a group's siblings with a trained EAGLE drafter, in one target
/// forward under one `verify_tokens` budget. Both drafters see every admission, commit and release.
#[derive(Debug)]
pub struct HybridDrafter<A, B> {
    /// The first drafter (its nodes win ties).
    pub a: A,
    /// The second drafter.
    pub b: B,
}

impl<A, B> HybridDrafter<A, B> {
    /// The hybrid of `a` and `b`.
    pub fn new(a: A, b: B) -> Self {
        Self { a, b }
    }
}

impl<A: Drafter, B: Drafter> Drafter for HybridDrafter<A, B> {
    fn needs_hidden(&self) -> bool {
        self.a.needs_hidden() || self.b.needs_hidden()
    }

    fn admit(&mut self, ctx: &DraftContext<'_>) {
        self.a.admit(ctx);
        self.b.admit(ctx);
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
        let ta = self.a.propose(ctx, plan)?;
        let tb = self.b.propose(ctx, plan)?;
        merge_trees(&ta, &tb, plan)
    }

    fn propose_batch(&mut self, ctxs: &[DraftContext<'_>], plan: &Plan) -> Result<Vec<DraftTree>> {
        let ta = self.a.propose_batch(ctxs, plan)?;
        let tb = self.b.propose_batch(ctxs, plan)?;
        if ta.len() != ctxs.len() || tb.len() != ctxs.len() {
            return Err(Error::ShapeMismatch { what: "hybrid draft trees", expected: ctxs.len(), got: ta.len() });
        }
        ta.iter().zip(&tb).map(|(x, y)| merge_trees(x, y, plan)).collect()
    }

    fn prepare(&mut self, ctxs: &[DraftContext<'_>]) -> Result<()> {
        self.a.prepare(ctxs)?;
        self.b.prepare(ctxs)
    }

    fn observe(&mut self, request: RequestId, committed: &[u32]) {
        self.a.observe(request, committed);
        self.b.observe(request, committed);
    }

    fn release(&mut self, request: RequestId) {
        self.a.release(request);
        self.b.release(request);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_dedups_and_keeps_best() {
        // a: 5 -> 1 (-0.1) -> 2 (-0.3); b: 5 -> 1 (-0.5) -> 3 (-0.2), 5 -> 4 (-2.0).
        let mut a = DraftTree::new(5);
        let n = a.push_child(0, 1, -0.1).expect("ok");
        a.push_child(n, 2, -0.2).expect("ok");
        let mut b = DraftTree::new(5);
        let n = b.push_child(0, 1, -0.5).expect("ok");
        b.push_child(n, 3, -0.2).expect("ok");
        b.push_child(0, 4, -2.0).expect("ok");
        let plan = Plan { steps: 2, top_k: 2, verify_tokens: 4 };
        let m = merge_trees(&a, &b, &plan).expect("merge");
        // Root, 1 (score -0.1), 2 (-0.3), 3 (-0.7); 4 (-2.0) is cut by the budget.
        assert_eq!(m.tokens(), vec![5, 1, 2, 3]);
        assert_eq!(m.parents(), vec![None, Some(0), Some(1), Some(1)]);
        assert!((m.nodes()[1].score + 0.1).abs() < 1e-6);
        assert!((m.nodes()[3].score + 0.7).abs() < 1e-6);
        let roots = DraftTree::new(6);
        assert!(merge_trees(&a, &roots, &plan).is_err());
    }
}
