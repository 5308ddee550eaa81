//! Draft token trees: the data structure sent to the target for one verification, and its builders (chains and
//! EAGLE-2 dynamic trees).

use crate::{Error, Plan, Result};

/// One node of a [`DraftTree`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Node {
    /// The token this node proposes (for the root: the last committed token).
    pub token: u32,
    /// The parent's index (always smaller than this node's), `None` for the root.
    pub parent: Option<usize>,
    /// Distance from the root (root 0).
    pub depth: usize,
    /// Cumulative draft log-probability of the path from the root (root 0).
    pub score: f32,
}

/// A tree of drafted tokens for one sequence and one verification.
///
/// Node 0 is the **root**: the last committed token that the target has not processed yet, so its logits row
/// gives the distribution of the first new token. Every other node has a parent with a smaller index, so parents
/// always precede children. [`DraftTree::parents`] is exactly the `tree` that `tlt_model::SeqInput` takes, and
/// an accepted root path ([`crate::Accepted::path`]) is exactly what `KvCache::commit` keeps.
///
/// ```
/// use tlt_spec_decode::DraftTree;
///
/// # fn main() -> tlt_spec_decode::Result<()> {
/// let mut t = DraftTree::new(7);
/// let a = t.push_child(0, 1, -0.1)?;
/// let b = t.push_child(0, 2, -0.5)?;
/// let c = t.push_child(a, 3, -0.2)?;
/// assert_eq!(t.parents(), vec![None, Some(0), Some(0), Some(1)]);
/// assert_eq!(t.tokens(), vec![7, 1, 2, 3]);
/// assert_eq!(t.children(0)?, &[a, b]);
/// assert_eq!(t.path_to(c)?, vec![0, a, c]);
/// assert!(t.is_ancestor(a, c)? && !t.is_ancestor(b, c)?);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct DraftTree {
    nodes: Vec<Node>,
    children: Vec<Vec<usize>>,
}

/// Rejects NaN and `+inf` log-probabilities (`-inf`, a zero-probability proposal, is allowed).
fn check_log_prob(token: u32, lp: f32) -> Result<()> {
    if lp.is_nan() || lp == f32::INFINITY {
        return Err(Error::InvalidLogProb { token, value: lp.to_string() });
    }
    Ok(())
}

/// One node to expand in [`DraftTree::eagle2_many`].
#[derive(Debug, Clone, Copy)]
pub struct Beam<'a> {
    /// Which tree (index into the roots).
    pub tree: usize,
    /// The node's id in its tree's build (0 = the root).
    pub node: usize,
    /// Its parent's id (`None` for the root).
    pub parent: Option<usize>,
    /// Tokens from the root (first) to this node (last).
    pub tokens: &'a [u32],
}

impl DraftTree {
    /// A tree holding only the root: plain decoding (one committed token per verification).
    pub fn new(root_token: u32) -> Self {
        Self { nodes: vec![Node { token: root_token, parent: None, depth: 0, score: 0.0 }], children: vec![vec![]] }
    }

    /// Appends a child of `parent` proposing `token` with draft log-probability `log_prob` (its score becomes
    /// the parent's score plus `log_prob`) and returns its index. Children keep the order they were pushed in.
    ///
    /// # Errors
    /// [`Error::InvalidTree`] if `parent` does not exist, [`Error::InvalidLogProb`] for a NaN or `+inf`
    /// `log_prob`.
    pub fn push_child(&mut self, parent: usize, token: u32, log_prob: f32) -> Result<usize> {
        check_log_prob(token, log_prob)?;
        let p = *self.node(parent)?;
        let idx = self.nodes.len();
        self.nodes.push(Node { token, parent: Some(parent), depth: p.depth + 1, score: p.score + log_prob });
        self.children.push(vec![]);
        self.children[parent].push(idx);
        Ok(idx)
    }

    /// A chain: the root followed by `draft` in order (each with log-probability 0).
    pub fn chain(root_token: u32, draft: &[u32]) -> Self {
        let mut t = Self::new(root_token);
        for (i, &tok) in draft.iter().enumerate() {
            // Node i exists and 0.0 is a valid log-probability, so this cannot fail.
            let idx = t.nodes.len();
            t.nodes.push(Node { token: tok, parent: Some(i), depth: i + 1, score: 0.0 });
            t.children.push(vec![]);
            t.children[i].push(idx);
        }
        t
    }

    /// EAGLE-2's dynamic draft tree (`topK_genrate` in SafeAILab/EAGLE, `organize_draft_results` in SGLang).
    ///
    /// `expand(path)` is the drafter: given the tokens from the root (root token first) to a node, it returns
    /// candidate next tokens with their draft log-probabilities (any order; an empty list makes the node a
    /// leaf). The tree grows level by level for `plan.steps` levels:
    /// 1. the root is expanded into its `top_k` most probable candidates (duplicate tokens keep their first,
    ///    most probable occurrence);
    /// 2. at each further level, the `top_k` nodes of the previous level with the best cumulative score
    ///    (sum of draft log-probs along the path) are the frontier beams, and each is expanded into its `top_k`
    ///    most probable candidates, which are all scored;
    /// 3. reranking: among **all** scored nodes, the best `plan.verify_tokens - 1` by cumulative score are kept,
    ///    plus the root. The kept set is ancestor-closed: nodes are ranked by the minimum score along their
    ///    path (equal to their own score when log-probs are `<= 0`, as for a normalised drafter), ties broken
    ///    by depth, so a parent always ranks before its children.
    ///
    /// The result is indexed by depth, then score (best first), then creation order, so parents precede
    /// children and each node's children are in proposal order (most probable first). Ties in score are broken
    /// by the order the drafter returned candidates and beams were created.
    ///
    /// # Errors
    /// [`Error::InvalidPlan`] for an invalid `plan`, [`Error::InvalidLogProb`] if `expand` returns a NaN or
    /// `+inf` log-probability.
    pub fn eagle2<F>(root_token: u32, plan: &Plan, mut expand: F) -> Result<Self>
    where
        F: FnMut(&[u32]) -> Vec<(u32, f32)>,
    {
        let mut trees = Self::eagle2_many(&[root_token], plan, |beams: &[Beam<'_>]| {
            Ok(beams.iter().map(|b| expand(b.tokens)).collect())
        })?;
        trees.pop().ok_or_else(|| Error::InvalidTree("no tree built".into()))
    }

    /// [`DraftTree::eagle2`] for several trees at once, expanding level by level so a drafter can score all
    /// beams of a level (of every tree) in one batched forward.
    ///
    /// `expand(beams)` gets the beams of one level, all trees together, and returns their candidates in the same
    /// order. Each [`Beam`] names its tree, its node id and its parent's (ids are stable for the whole build and
    /// count from 0 = the root in each tree, so a drafter can key per-node state on them) and the tokens from the
    /// root to it. The selection rules are exactly [`DraftTree::eagle2`]'s, per tree.
    ///
    /// # Errors
    /// As [`DraftTree::eagle2`], plus any error `expand` returns, and [`Error::ShapeMismatch`] if it returns the
    /// wrong number of candidate lists.
    pub fn eagle2_many<F>(roots: &[u32], plan: &Plan, mut expand: F) -> Result<Vec<Self>>
    where
        F: FnMut(&[Beam<'_>]) -> Result<Vec<Vec<(u32, f32)>>>,
    {
        plan.validate()?;
        let k = plan.top_k;
        // Every scored node of every tree; index 0 of each is its root.
        let mut all: Vec<Vec<Node>> =
            roots.iter().map(|&r| vec![Node { token: r, parent: None, depth: 0, score: 0.0 }]).collect();
        let mut frontiers: Vec<Vec<usize>> = vec![vec![0]; roots.len()];
        for level in 1..=plan.steps {
            let paths: Vec<(usize, usize, Vec<u32>)> = frontiers
                .iter()
                .enumerate()
                .flat_map(|(t, f)| f.iter().map(move |&n| (t, n)))
                .map(|(t, n)| (t, n, path_of(&all[t], n).into_iter().map(|i| all[t][i].token).collect()))
                .collect();
            if paths.is_empty() {
                break;
            }
            let beams: Vec<Beam<'_>> = paths
                .iter()
                .map(|(t, n, toks)| Beam { tree: *t, node: *n, parent: all[*t][*n].parent, tokens: toks })
                .collect();
            let cands_all = expand(&beams)?;
            if cands_all.len() != beams.len() {
                return Err(Error::ShapeMismatch {
                    what: "candidate lists (one per beam)",
                    expected: beams.len(),
                    got: cands_all.len(),
                });
            }
            let mut level_nodes: Vec<Vec<usize>> = vec![Vec::new(); roots.len()];
            for (&(t, beam, _), mut cands) in paths.iter().zip(cands_all) {
                for &(tok, lp) in &cands {
                    check_log_prob(tok, lp)?;
                }
                // Most probable first; the stable sort keeps the drafter's order among equal log-probs.
                cands.sort_by(|a, b| b.1.total_cmp(&a.1));
                let mut taken: Vec<u32> = Vec::with_capacity(k);
                for (tok, lp) in cands {
                    if taken.len() == k {
                        break;
                    }
                    if taken.contains(&tok) {
                        continue;
                    }
                    taken.push(tok);
                    let score = all[t][beam].score + lp;
                    level_nodes[t].push(all[t].len());
                    all[t].push(Node { token: tok, parent: Some(beam), depth: level, score });
                }
            }
            // The next frontier of each tree: the best k of this level (stable: creation order breaks ties).
            for (t, mut nodes) in level_nodes.into_iter().enumerate() {
                nodes.sort_by(|&a, &b| all[t][b].score.total_cmp(&all[t][a].score));
                nodes.truncate(k);
                frontiers[t] = nodes;
            }
        }
        Ok(all.iter().map(|a| Self::rerank(a, plan.verify_tokens)).collect())
    }

    /// Keeps the root and the best `verify_tokens - 1` scored nodes of `all` (ancestor-closed) and re-indexes
    /// them by (depth, score desc, creation order).
    fn rerank(all: &[Node], verify_tokens: usize) -> Self {
        // Path-minimum score: never larger than the parent's, so ranking by it keeps the kept set closed.
        let mut eff = vec![f32::INFINITY; all.len()];
        for i in 1..all.len() {
            let p = all[i].parent.unwrap_or(0);
            eff[i] = if all[i].score < eff[p] { all[i].score } else { eff[p] };
        }
        let mut order: Vec<usize> = (1..all.len()).collect();
        order.sort_by(|&a, &b| eff[b].total_cmp(&eff[a]).then(all[a].depth.cmp(&all[b].depth)).then(a.cmp(&b)));
        let mut kept = vec![false; all.len()];
        kept[0] = true;
        let mut n_kept = 1;
        for &i in &order {
            if n_kept >= verify_tokens {
                break;
            }
            // Enforced closure: with the ranking above a parent always comes first, so nothing is skipped.
            if kept[all[i].parent.unwrap_or(0)] {
                kept[i] = true;
                n_kept += 1;
            }
        }
        let mut sel: Vec<usize> = (1..all.len()).filter(|&i| kept[i]).collect();
        sel.sort_by(|&a, &b| {
            all[a].depth.cmp(&all[b].depth).then(all[b].score.total_cmp(&all[a].score)).then(a.cmp(&b))
        });
        let mut new_index = vec![usize::MAX; all.len()];
        new_index[0] = 0;
        let mut t = Self::new(all[0].token);
        for old in sel {
            let parent = new_index[all[old].parent.unwrap_or(0)];
            let idx = t.nodes.len();
            new_index[old] = idx;
            t.nodes.push(Node {
                token: all[old].token,
                parent: Some(parent),
                depth: all[old].depth,
                score: all[old].score,
            });
            t.children.push(vec![]);
            t.children[parent].push(idx);
        }
        t
    }

    /// Number of nodes, root included (always `>= 1`).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Always `false`: a tree holds at least its root.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The root's token (the last committed token).
    pub fn root_token(&self) -> u32 {
        self.nodes[0].token
    }

    /// All nodes in index order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Node `i`.
    ///
    /// # Errors
    /// [`Error::InvalidTree`] if `i >= len()`.
    pub fn node(&self, i: usize) -> Result<&Node> {
        self.nodes.get(i).ok_or_else(|| out_of_range(i, self.nodes.len()))
    }

    /// Each node's parent in the form `tlt_model::SeqInput::tree` takes: `None` for the root (a child of the
    /// committed prefix), otherwise an index smaller than the node's own.
    pub fn parents(&self) -> Vec<Option<usize>> {
        self.nodes.iter().map(|n| n.parent).collect()
    }

    /// Each node's token, root first.
    pub fn tokens(&self) -> Vec<u32> {
        self.nodes.iter().map(|n| n.token).collect()
    }

    /// Each node's depth (root 0); the target places node `i` at position `committed_len + depth(i)`.
    pub fn depths(&self) -> Vec<usize> {
        self.nodes.iter().map(|n| n.depth).collect()
    }

    /// Each node's cumulative draft log-probability (root 0).
    pub fn scores(&self) -> Vec<f32> {
        self.nodes.iter().map(|n| n.score).collect()
    }

    /// The deepest node's depth (0 for a root-only tree).
    pub fn max_depth(&self) -> usize {
        self.nodes.iter().map(|n| n.depth).max().unwrap_or(0)
    }

    /// The children of node `i`, in proposal order.
    ///
    /// # Errors
    /// [`Error::InvalidTree`] if `i >= len()`.
    pub fn children(&self, i: usize) -> Result<&[usize]> {
        self.children.get(i).map(Vec::as_slice).ok_or_else(|| out_of_range(i, self.nodes.len()))
    }

    /// The node indices from the root to `i`, both included.
    ///
    /// # Errors
    /// [`Error::InvalidTree`] if `i >= len()`.
    pub fn path_to(&self, i: usize) -> Result<Vec<usize>> {
        self.node(i)?;
        Ok(path_of(&self.nodes, i))
    }

    /// Whether `a` lies on the path from the root to `b` (`b` itself included): whether `b` attends to `a`
    /// under the tree mask.
    ///
    /// # Errors
    /// [`Error::InvalidTree`] if `a` or `b` is out of range.
    pub fn is_ancestor(&self, a: usize, b: usize) -> Result<bool> {
        self.node(a)?;
        self.node(b)?;
        let mut cur = Some(b);
        while let Some(c) = cur {
            if c == a {
                return Ok(true);
            }
            if c < a {
                return Ok(false); // Indices only decrease going up.
            }
            cur = self.nodes[c].parent;
        }
        Ok(false)
    }

    /// Whether `path` starts at the root and each element is a child of the previous one.
    pub fn is_root_path(&self, path: &[usize]) -> bool {
        path.first() == Some(&0)
            && path.windows(2).all(|w| self.nodes.get(w[1]).is_some_and(|n| n.parent == Some(w[0])))
    }
}

/// Whether `path` is a root path of the tree whose parents are `parents` ([`DraftTree::parents`] form, as targets
/// receive it in [`TargetInput::tree`](crate::TargetInput::tree)): it starts at node 0 and each node is a child of
/// the previous one.
pub(crate) fn is_root_path_of(parents: &[Option<usize>], path: &[usize]) -> bool {
    path.first() == Some(&0) && !parents.is_empty() && path.windows(2).all(|w| parents.get(w[1]) == Some(&Some(w[0])))
}

/// Root-to-`i` path through `parent` links (`i` must be in range).
fn path_of(nodes: &[Node], i: usize) -> Vec<usize> {
    let mut path = vec![i];
    let mut cur = nodes[i].parent;
    while let Some(p) = cur {
        path.push(p);
        cur = nodes[p].parent;
    }
    path.reverse();
    path
}

fn out_of_range(i: usize, len: usize) -> Error {
    Error::InvalidTree(format!("node {i} out of range for a tree of {len} nodes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_shape() {
        let t = DraftTree::chain(5, &[1, 2, 3]);
        assert_eq!(t.parents(), vec![None, Some(0), Some(1), Some(2)]);
        assert_eq!(t.depths(), vec![0, 1, 2, 3]);
        assert_eq!(t.tokens(), vec![5, 1, 2, 3]);
        assert_eq!(t.max_depth(), 3);
        assert!(t.is_root_path(&[0, 1, 2]));
        assert!(!t.is_root_path(&[0, 2]));
        assert!(!t.is_root_path(&[1, 2]));
        assert!(!t.is_root_path(&[]));
    }

    #[test]
    fn out_of_range_is_an_error() {
        let t = DraftTree::chain(5, &[1]);
        assert!(t.node(2).is_err());
        assert!(t.children(2).is_err());
        assert!(t.path_to(9).is_err());
        assert!(t.is_ancestor(0, 2).is_err());
        assert!(t.is_ancestor(2, 0).is_err());
        let mut t = t;
        assert!(t.push_child(7, 1, 0.0).is_err());
        assert!(matches!(t.push_child(0, 1, f32::NAN), Err(Error::InvalidLogProb { .. })));
        assert!(t.push_child(0, 1, f32::INFINITY).is_err());
        assert!(t.push_child(0, 1, f32::NEG_INFINITY).is_ok());
    }

    /// A hand-checked EAGLE-2 tree: top_k 2, 2 steps, 4 verify tokens.
    #[test]
    fn eagle2_small_example() {
        let ln = |p: f32| p.ln();
        let plan = Plan { steps: 2, top_k: 2, verify_tokens: 4 };
        let t = DraftTree::eagle2(100, &plan, |path: &[u32]| match path {
            [100] => vec![(1, ln(0.6)), (2, ln(0.3)), (3, ln(0.1))],
            [100, 1] => vec![(11, ln(0.9)), (12, ln(0.1))],
            [100, 2] => vec![(21, ln(0.5)), (22, ln(0.5))],
            _ => vec![],
        })
        .expect("valid");
        // Scores: 1:0.6 2:0.3 | 11:0.54 12:0.06 21:0.15 22:0.15. Best 3: 1 (0.6), 11 (0.54), 2 (0.3).
        assert_eq!(t.tokens(), vec![100, 1, 2, 11]);
        assert_eq!(t.parents(), vec![None, Some(0), Some(0), Some(1)]);
        assert_eq!(t.depths(), vec![0, 1, 1, 2]);
        assert!((t.scores()[3] - 0.54f32.ln()).abs() < 1e-5);
    }

    #[test]
    fn eagle2_frontier_keeps_best_beams_only() {
        // top_k 1: only the best child of each level is expanded.
        let plan = Plan { steps: 3, top_k: 1, verify_tokens: 4 };
        let mut calls = Vec::new();
        let t = DraftTree::eagle2(0, &plan, |path: &[u32]| {
            calls.push(path.to_vec());
            let last = *path.last().unwrap_or(&0);
            vec![(last + 2, -1.0), (last + 1, -0.5)]
        })
        .expect("valid");
        assert_eq!(t.tokens(), vec![0, 1, 2, 3]);
        assert_eq!(calls, vec![vec![0], vec![0, 1], vec![0, 1, 2]]);
    }

    #[test]
    fn eagle2_positive_log_probs_stay_ancestor_closed() {
        // A child scoring above its parent (positive log-prob) must not be kept without its parent.
        let plan = Plan { steps: 2, top_k: 2, verify_tokens: 2 };
        let t = DraftTree::eagle2(0, &plan, |path: &[u32]| match path.len() {
            1 => vec![(1, -5.0), (2, -6.0)],
            _ => vec![(9, 4.0)],
        })
        .expect("valid");
        assert_eq!(t.tokens(), vec![0, 1]);
    }

    #[test]
    fn eagle2_rejects_nan_and_dedupes() {
        let plan = Plan { steps: 1, top_k: 3, verify_tokens: 4 };
        assert!(DraftTree::eagle2(0, &plan, |_: &[u32]| vec![(1, f32::NAN)]).is_err());
        let t = DraftTree::eagle2(0, &plan, |_: &[u32]| vec![(1, -1.0), (1, -0.5), (2, -3.0)]).expect("valid");
        assert_eq!(t.tokens(), vec![0, 1, 2]);
        let t = DraftTree::eagle2(0, &plan, |_: &[u32]| vec![]).expect("valid");
        assert_eq!(t.len(), 1);
        assert!(DraftTree::eagle2(0, &Plan::chain(0), |_: &[u32]| vec![]).is_err());
    }
}
