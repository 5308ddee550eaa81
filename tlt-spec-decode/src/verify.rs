//! Verification of a draft tree against the target's logits: greedy acceptance and lossless tree speculative
//! sampling.
//!
//! Both verifiers take, for **every** tree node `i`, the target's logits row at that node: the distribution of
//! the token that follows the path root..=i (row 0 is the root's, i.e. the first new token's). They return the
//! accepted root path and one extra token (the bonus token after a fully accepted branch, or the correction
//! after a rejection), so every verification commits `path.len()` tokens: the drafted tokens of `path[1..]`
//! and `next_token`.

use tlt_kernels::{argmax, categorical, probs, SamplingParams, SeededRng};

use crate::{DraftTree, Error, Result};

/// The outcome of one verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// Accepted node indices from the root (root included, so never empty). These are exactly the tree nodes
    /// whose KV entries to keep (`KvCache::commit(seq, &path)`).
    pub path: Vec<usize>,
    /// The token sampled (or taken greedily) from the target at the last accepted node: the bonus token if that
    /// node is a leaf or all its children were rejected, i.e. the correction.
    pub next_token: u32,
}

impl Accepted {
    /// Number of drafted tokens accepted (`path.len() - 1`).
    pub fn accepted_drafts(&self) -> usize {
        self.path.len().saturating_sub(1)
    }

    /// The tokens this verification commits: the tokens of `path[1..]`, then `next_token`.
    ///
    /// # Errors
    /// [`Error::InvalidTree`] if `path` names a node `tree` does not have.
    pub fn committed_tokens(&self, tree: &DraftTree) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(self.path.len());
        for &i in self.path.iter().skip(1) {
            out.push(tree.node(i)?.token);
        }
        out.push(self.next_token);
        Ok(out)
    }
}

/// How the drafter chose the children of each node: what [`verify_sampling`] must assume to stay lossless.
///
/// The rows of the stochastic variants are indexed by **parent** node: row `j` is the draft distribution `q_j`
/// over the vocabulary from which the children of node `j` were drawn (it need not be normalised). Only rows of
/// nodes that have children are read; the others may be empty.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Proposal<'a> {
    /// Children were chosen deterministically given the path (top-k of a drafter, greedy chains, n-gram
    /// lookup, EAGLE-2 trees): each drafted token is a point mass. Siblings should be distinct tokens (a
    /// repeated sibling is simply rejected).
    PointMass,
    /// The children of node `j` were drawn i.i.d. (with replacement) from `rows[j]`, and each child's subtree
    /// was drafted independently given its path (SpecInfer's multi-draft setting).
    Iid(&'a [Vec<f32>]),
    /// The children of node `j` were drawn one after another from `rows[j]` without replacement (each draw
    /// from `rows[j]` with the earlier siblings removed and renormalised), each subtree drafted independently
    /// given its path.
    WithoutReplacement(&'a [Vec<f32>]),
}

/// Checks that there is one row per node, all of one non-zero width, and that every token fits it; returns the
/// vocabulary size.
fn check_rows<R: AsRef<[f32]>>(tree: &DraftTree, rows: &[R]) -> Result<usize> {
    if rows.len() != tree.len() {
        return Err(Error::ShapeMismatch {
            what: "target rows (one per tree node)",
            expected: tree.len(),
            got: rows.len(),
        });
    }
    let vocab = rows[0].as_ref().len();
    if vocab == 0 {
        return Err(Error::InvalidArgument("empty target logits row".into()));
    }
    if let Some(r) = rows.iter().find(|r| r.as_ref().len() != vocab) {
        return Err(Error::ShapeMismatch { what: "target row width", expected: vocab, got: r.as_ref().len() });
    }
    for (node, n) in tree.nodes().iter().enumerate().skip(1) {
        if n.token as usize >= vocab {
            return Err(Error::TokenOutOfVocab { node, token: n.token, vocab });
        }
    }
    Ok(vocab)
}

/// Greedy verification: from the root, repeatedly accept the first child whose token equals the argmax of the
/// target row at the current node; `next_token` is the argmax at the last accepted node.
///
/// With the target's greedy decoding this commits exactly the tokens plain greedy decoding would produce.
///
/// # Errors
/// [`Error::ShapeMismatch`] unless there is one row per node, all of one width; [`Error::TokenOutOfVocab`] for a
/// drafted token outside the rows; [`Error::Kernel`] for a NaN in a row that is read.
pub fn verify_greedy<R: AsRef<[f32]>>(tree: &DraftTree, target_rows: &[R]) -> Result<Accepted> {
    check_rows(tree, target_rows)?;
    let mut path = vec![0];
    let mut cur = 0;
    loop {
        let best = argmax(target_rows[cur].as_ref())? as u32;
        let next = tree.children(cur)?.iter().copied().find(|&c| tree.nodes()[c].token == best);
        match next {
            Some(c) => {
                path.push(c);
                cur = c;
            }
            None => return Ok(Accepted { path, next_token: best }),
        }
    }
}

/// Normalises `v` in place; returns `false` (leaving `v` unchanged) if it has no positive mass.
fn normalize(v: &mut [f64]) -> bool {
    let z: f64 = v.iter().sum();
    if !(z > 0.0 && z.is_finite()) {
        return false;
    }
    v.iter_mut().for_each(|x| *x /= z);
    true
}

/// The draft distribution at node `j`, validated and normalised.
fn draft_row(rows: &[Vec<f32>], j: usize, vocab: usize) -> Result<Vec<f64>> {
    let row = rows.get(j).ok_or(Error::ShapeMismatch {
        what: "draft rows (one per tree node)",
        expected: j + 1,
        got: rows.len(),
    })?;
    if row.len() != vocab {
        return Err(Error::ShapeMismatch { what: "draft row width", expected: vocab, got: row.len() });
    }
    if let Some(i) = row.iter().position(|&x| !(x.is_finite() && x >= 0.0)) {
        return Err(Error::InvalidArgument(format!("draft probability {i} of node {j} is {}", row[i])));
    }
    let mut q: Vec<f64> = row.iter().map(|&x| x as f64).collect();
    if !normalize(&mut q) {
        return Err(Error::InvalidArgument(format!("draft distribution of node {j} has no mass")));
    }
    Ok(q)
}

/// Lossless tree speculative sampling (recursive rejection sampling over siblings, SpecInfer / EAGLE
/// "multi-draft" verification).
///
/// At the current node (starting at the root) let `p = tlt_kernels::probs(row, params)`: the target
/// distribution after temperature, top-k and top-p, exactly as plain sampling would use it. The children
/// `t_1, t_2, ...` are tried in order, each with a fresh uniform coin `u`, against the current draft
/// distribution `q` ([`Proposal`]):
/// - accept `t_i` if `u * q(t_i) < p(t_i)`, i.e. with probability `min(1, p(t_i) / q(t_i))`, and descend into
///   it with a fresh `p` (the target row at `t_i`);
/// - otherwise set `p <- normalise(max(p - q, 0))`; for [`Proposal::WithoutReplacement`] also remove `t_i`
///   from `q` and renormalise.
///
/// If no child is accepted (or the node is a leaf), `next_token` is drawn from the current `p`: the residual
/// (the correction token) after rejections, the untouched target distribution (the bonus token) at a leaf.
///
/// **Exactness.** Each committed token is distributed exactly as the target's `p` given the committed prefix,
/// provided the drafter really produced the tree as the [`Proposal`] variant says and each child's subtree was
/// drafted independently of its siblings given its path (so it is independent of the acceptance coins):
/// - [`Proposal::Iid`]: SpecInfer's multi-step speculative sampling (Miao et al. 2024, Thm. 4.2): siblings
///   i.i.d. from `q`, `q` kept across siblings.
/// - [`Proposal::WithoutReplacement`]: recursive rejection sampling without replacement (Jeon et al. 2024):
///   after rejecting `t_i` the next sibling is distributed as `q` without the earlier siblings, and the
///   residual never puts mass on a rejected token.
/// - [`Proposal::PointMass`]: deterministic drafters (n-gram, greedy/top-k trees such as EAGLE-2). `q` is
///   one-hot on each drafted token, so the rule reduces to "accept `t_i` with probability `p(t_i)`, else zero
///   `p(t_i)` and renormalise", which is EAGLE's `evaluate_posterior` and SGLang's
///   `tree_speculative_sampling_target_only` with thresholds 1 (inverse-CDF sampling of `p` with the
///   drafted siblings first). The tree's draft scores do not matter for exactness.
///
/// With floating-point rounding, a residual can come out with no mass where exact arithmetic would have
/// accepted with certainty (`p == q`); the child is then accepted. `params.temperature == 0` gives greedy
/// verification (the target's first argmax is accepted if drafted).
///
/// # Errors
/// As [`verify_greedy`]; also [`Error::ShapeMismatch`] for draft rows that do not match the tree or vocabulary,
/// [`Error::InvalidArgument`] for a draft row with a negative or non-finite entry or no mass, or for a drafted
/// token that its draft distribution gives probability 0 (it could not have been drawn), and
/// [`Error::Kernel`] for invalid `params` or logits.
pub fn verify_sampling<R: AsRef<[f32]>>(
    tree: &DraftTree,
    target_rows: &[R],
    draft: Proposal<'_>,
    params: &SamplingParams,
    rng: &mut SeededRng,
) -> Result<Accepted> {
    let vocab = check_rows(tree, target_rows)?;
    let mut path = vec![0];
    let mut cur = 0;
    'descend: loop {
        let mut p: Vec<f64> = probs(target_rows[cur].as_ref(), params)?.into_iter().map(f64::from).collect();
        normalize(&mut p);
        let kids = tree.children(cur)?;
        let mut q = match draft {
            Proposal::PointMass => Vec::new(),
            Proposal::Iid(rows) | Proposal::WithoutReplacement(rows) => {
                if kids.is_empty() {
                    Vec::new()
                } else {
                    draft_row(rows, cur, vocab)?
                }
            }
        };
        for &child in kids {
            let t = tree.nodes()[child].token as usize;
            let qt = if matches!(draft, Proposal::PointMass) { 1.0 } else { q[t] };
            if qt <= 0.0 {
                return Err(Error::InvalidArgument(format!(
                    "node {child} drafts token {t}, which its draft distribution gives probability 0"
                )));
            }
            let u = rng.uniform();
            let mut residual = p.clone();
            if matches!(draft, Proposal::PointMass) {
                residual[t] = 0.0;
            } else {
                residual.iter_mut().zip(&q).for_each(|(r, &qi)| *r = (*r - qi).max(0.0));
            }
            if u * qt < p[t] || !normalize(&mut residual) {
                path.push(child);
                cur = child;
                continue 'descend;
            }
            p = residual;
            if matches!(draft, Proposal::WithoutReplacement(_)) {
                q[t] = 0.0;
                // With all mass drafted no further sibling can be valid; a later one then fails the check above.
                normalize(&mut q);
            }
        }
        let p32: Vec<f32> = p.iter().map(|&x| x as f32).collect();
        let next = categorical(&p32, rng.uniform())?;
        return Ok(Accepted { path, next_token: next as u32 });
    }
}

/// The randomness of one request's round: one uniform per output position, keyed by the request's stream and the
/// position alone, so the token sampled at a position does not depend on how the request got there (plain decoding
/// or any draft tree).
#[derive(Debug, Clone)]
pub struct Coins {
    stream: SeededRng,
    position: u64,
}

impl Coins {
    /// The coins of a round whose root predicts output position `position` of the request with `stream`.
    pub fn new(stream: SeededRng, position: u64) -> Self {
        Self { stream, position }
    }

    /// The uniform in `[0, 1)` of the position `depth` past the root.
    pub fn uniform(&self, depth: usize) -> f64 {
        self.stream.fork(self.position + depth as u64).uniform()
    }

    /// The request's stream.
    pub fn stream(&self) -> &SeededRng {
        &self.stream
    }

    /// The output position of the round's root.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// A sequential generator for this round (for verifiers that draw a variable number of coins).
    pub fn sequential(&self) -> SeededRng {
        self.stream.fork(self.position).fork(u64::MAX)
    }
}

/// Lossless verification of deterministic drafts by **coupling**: at every node the target's token is drawn by
/// inverse CDF of `p` (vocabulary order) with the coin of its output position, and the walk descends into the
/// child drafting that token, if any; otherwise that token is the `next_token`.
///
/// Every committed token is the inverse-CDF draw of the target's distribution with a coin used by no other
/// position, and the path to a position depends only on earlier coins, so each token is distributed exactly as the
/// target's `p` given the committed prefix. A node's children are accepted with total probability `Σ p(child)`,
/// the same as [`verify_sampling`] with [`Proposal::PointMass`]; and because the draw does not depend on the tree,
/// speculative decoding commits **the same tokens as plain decoding with the same coins**, at any temperature
/// (up to rounding differences between the logits of a verify and a decode forward that move a CDF boundary across a
/// coin). `params.temperature == 0` is [`verify_greedy`].
///
/// # Errors
/// As [`verify_greedy`]; [`Error::Kernel`] for invalid `params` or logits.
pub fn verify_coupled<R: AsRef<[f32]>>(
    tree: &DraftTree,
    target_rows: &[R],
    params: &SamplingParams,
    coins: &Coins,
) -> Result<Accepted> {
    if params.temperature == 0.0 {
        return verify_greedy(tree, target_rows);
    }
    check_rows(tree, target_rows)?;
    let (mut path, mut cur) = (vec![0], 0);
    loop {
        let p = probs(target_rows[cur].as_ref(), params)?;
        let t = categorical(&p, coins.uniform(path.len() - 1))? as u32;
        match tree.children(cur)?.iter().find(|&&c| tree.nodes()[c].token == t) {
            Some(&c) => {
                path.push(c);
                cur = c;
            }
            None => return Ok(Accepted { path, next_token: t }),
        }
    }
}

/// The acceptance rule the [`Engine`](crate::Engine) applies to each verified tree. The default,
/// [`ExactVerifier`], is lossless; the seam exists for lossy rules (e.g. typical acceptance) and for testing that
/// the engine's statistical tests catch a biased rule.
pub trait Verifier: std::fmt::Debug {
    /// Accepts a root path of `tree` given the target's logits row at every node (`rows[i]` for node `i`),
    /// drawing randomness from `coins` only.
    ///
    /// # Errors
    /// On inconsistent shapes or invalid logits/params.
    fn verify(&self, tree: &DraftTree, rows: &[&[f32]], params: &SamplingParams, coins: &Coins) -> Result<Accepted>;
}

/// Lossless verification of deterministic drafts: [`verify_coupled`] (greedy at temperature 0), so sampled
/// speculative decoding commits the tokens plain decoding would.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExactVerifier;

impl Verifier for ExactVerifier {
    fn verify(&self, tree: &DraftTree, rows: &[&[f32]], params: &SamplingParams, coins: &Coins) -> Result<Accepted> {
        verify_coupled(tree, rows, params, coins)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn onehot_logits(v: usize, hot: usize) -> Vec<f32> {
        (0..v).map(|i| if i == hot { 5.0 } else { 0.0 }).collect()
    }

    #[test]
    fn greedy_walks_matching_children() {
        // root -> {1, 2}; 2 -> {3}. Target argmax: root 2, node2 3, node3 0.
        let mut t = DraftTree::new(9);
        t.push_child(0, 1, 0.0).expect("ok");
        let b = t.push_child(0, 2, 0.0).expect("ok");
        let c = t.push_child(b, 3, 0.0).expect("ok");
        let rows = vec![onehot_logits(10, 2), onehot_logits(10, 7), onehot_logits(10, 3), onehot_logits(10, 0)];
        let a = verify_greedy(&t, &rows).expect("ok");
        assert_eq!(a.path, vec![0, b, c]);
        assert_eq!(a.next_token, 0);
        assert_eq!(a.committed_tokens(&t).expect("ok"), vec![2, 3, 0]);
        assert_eq!(a.accepted_drafts(), 2);
    }

    #[test]
    fn shape_errors() {
        let t = DraftTree::chain(0, &[1, 2]);
        let rows = vec![vec![0.0f32; 4]; 2];
        assert!(matches!(verify_greedy(&t, &rows), Err(Error::ShapeMismatch { .. })));
        let rows = vec![vec![0.0f32; 4], vec![0.0; 4], vec![0.0; 3]];
        assert!(matches!(verify_greedy(&t, &rows), Err(Error::ShapeMismatch { .. })));
        let t = DraftTree::chain(0, &[1, 7]);
        let rows = vec![vec![0.0f32; 4]; 3];
        assert!(matches!(verify_greedy(&t, &rows), Err(Error::TokenOutOfVocab { node: 2, .. })));
        let t = DraftTree::chain(0, &[1]);
        let rows = vec![vec![f32::NAN; 4]; 2];
        assert!(matches!(verify_greedy(&t, &rows), Err(Error::Kernel(_))));
        let mut rng = SeededRng::new(1);
        let rows = vec![vec![0.0f32; 4]; 2];
        let bad_q = vec![vec![-1.0f32; 4]; 2];
        let p = SamplingParams::default();
        assert!(verify_sampling(&t, &rows, Proposal::Iid(&bad_q), &p, &mut rng).is_err());
        let short_q = vec![vec![1.0f32; 4]];
        assert!(verify_sampling(&t, &rows, Proposal::Iid(&short_q), &p, &mut rng).is_ok());
        let zero_q = vec![vec![1.0f32, 0.0, 1.0, 1.0]];
        assert!(verify_sampling(&t, &rows, Proposal::Iid(&zero_q), &p, &mut rng).is_err());
        let bad_params = SamplingParams { temperature: -1.0, ..p };
        assert!(verify_sampling(&t, &rows, Proposal::PointMass, &bad_params, &mut rng).is_err());
    }

    #[test]
    fn temperature_zero_sampling_matches_greedy() {
        let t = DraftTree::chain(0, &[1, 2, 3]);
        let rows = vec![onehot_logits(6, 1), onehot_logits(6, 2), onehot_logits(6, 4), onehot_logits(6, 5)];
        let g = verify_greedy(&t, &rows).expect("ok");
        let mut rng = SeededRng::new(3);
        let s = verify_sampling(&t, &rows, Proposal::PointMass, &SamplingParams::greedy(), &mut rng).expect("ok");
        assert_eq!(g, s);
        assert_eq!(g.path, vec![0, 1, 2]);
        assert_eq!(g.next_token, 4);
    }

    #[test]
    fn certain_target_always_accepts_and_impossible_never_does() {
        // Target puts (almost) all mass on the drafted token 1 at the root; token 2 has -inf logit.
        let t = DraftTree::chain(0, &[1]);
        let rows = vec![vec![f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY], vec![0.0, 0.0, f32::NEG_INFINITY]];
        let mut rng = SeededRng::new(5);
        for _ in 0..100 {
            let a = verify_sampling(&t, &rows, Proposal::PointMass, &SamplingParams::default(), &mut rng).expect("ok");
            assert_eq!(a.path, vec![0, 1]);
            assert_ne!(a.next_token, 2);
        }
        let t = DraftTree::chain(0, &[2]);
        for _ in 0..100 {
            let a = verify_sampling(&t, &rows, Proposal::PointMass, &SamplingParams::default(), &mut rng).expect("ok");
            assert_eq!(a.path, vec![0]);
            assert_eq!(a.next_token, 1);
        }
    }
}
