//! The model-free group drafter: one [`SuffixIndex`] per GRPO group over the group's streams (each sibling's
//! prompt + committed tokens, and optionally earlier answers to the same prompt), drafting the continuations
//! seen after the longest match of a request's recent tokens, as a frequency-ranked tree.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::calibrate::{Calibration, Pending};
use super::index::{Occurrence, SuffixIndex};
use crate::{DraftContext, DraftTree, Drafter, Error, GroupId, Plan, RequestId, Result};

/// [`SuffixDrafter`] settings (the names follow SuffixDecoding and vLLM's `suffix` speculative method).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SuffixConfig {
    /// Shortest match (in tokens) worth drafting from (`>= 1`). Default 2.
    pub min_match: usize,
    /// SuffixDecoding's match-length rule: a draft is at most `ceil(match_factor × match length)` tokens deep
    /// (and at most the plan's `steps`). `> 0`. Default 1.0.
    pub match_factor: f32,
    /// A node is drafted only if its empirical probability (the share of the match's occurrences continuing with
    /// its path) is at least this, in `[0, 1]`. Default 0.1.
    pub min_prob: f32,
    /// A node is drafted only if the measured acceptance of nodes with its empirical probability (see
    /// [`Calibration`]) is at least this, in `[0, 1]`: the share of a verify row's cost a drafted token must be
    /// expected to repay. 0 turns calibration off. Default 0.
    pub min_accept: f32,
    /// Occurrences of the match read per proposal (`>= 1`), newer first. Default 64.
    pub max_occurrences: usize,
    /// Earlier answers (prompt + response) remembered per prompt and added to a new group of that prompt
    /// (0: off). Default 0.
    pub history_per_prompt: usize,
    /// Prompts whose answers are remembered (oldest forgotten first). Default 4096.
    pub history_prompts: usize,
    /// Length-aware budgets (the idea of DAS, distribution-aware speculative decoding for RL rollouts: spend the
    /// verify budget on the requests expected to run long), in tokens; 0 turns it off (the default). When at least two answer lengths of the request's prompt are
    /// known (finished siblings, remembered answers), a request whose expected remaining length (the median of
    /// `L - ℓ` over the known lengths `L` above its current response length `ℓ`) is below this horizon is expected
    /// to end soon: its tree gets half the plan's verify tokens and at most that many levels. A request past every
    /// known length, or of a prompt with fewer known lengths, is the tail (or unknown) and keeps the whole plan.
    pub das_horizon: usize,
}

impl Default for SuffixConfig {
    fn default() -> Self {
        Self {
            min_match: 2,
            match_factor: 1.0,
            min_prob: 0.1,
            min_accept: 0.0,
            max_occurrences: 64,
            history_per_prompt: 0,
            history_prompts: 4096,
            das_horizon: 0,
        }
    }
}

impl SuffixConfig {
    /// Checks every field's range.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if self.min_match == 0 {
            return Err(Error::InvalidArgument("suffix min_match must be at least 1".into()));
        }
        if !(self.match_factor > 0.0 && self.match_factor.is_finite()) {
            return Err(Error::InvalidArgument(format!("suffix match_factor {} must be > 0", self.match_factor)));
        }
        if !(0.0..=1.0).contains(&self.min_prob) {
            return Err(Error::InvalidArgument(format!("suffix min_prob {} is outside [0, 1]", self.min_prob)));
        }
        if !(0.0..=1.0).contains(&self.min_accept) {
            return Err(Error::InvalidArgument(format!("suffix min_accept {} is outside [0, 1]", self.min_accept)));
        }
        if self.max_occurrences == 0 {
            return Err(Error::InvalidArgument("suffix max_occurrences must be at least 1".into()));
        }
        Ok(())
    }
}

/// What a [`SuffixDrafter`] did since construction (or [`SuffixDrafter::reset_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SuffixStats {
    /// Proposals made.
    pub proposals: u64,
    /// Proposals with at least one drafted token.
    pub drafted: u64,
    /// Sum of match lengths over proposals.
    pub match_len_sum: u64,
    /// Tokens appended to the indexes (prompts included).
    pub appended: u64,
    /// Seconds spent appending and proposing (the index's whole cost).
    pub seconds: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Group(GroupId),
    Solo(RequestId),
}

#[derive(Debug)]
struct Group {
    index: SuffixIndex,
    live: usize,
    /// Response lengths of the prompt's known answers (remembered ones and finished siblings).
    lengths: Vec<usize>,
}

/// DAS's per-request budget (see [`SuffixConfig::das_horizon`]): `Some((verify_tokens, steps))` for a request
/// expected to end within `horizon` tokens, `None` for one that keeps the whole plan.
fn das_budget(known: &[usize], response_len: usize, horizon: usize, plan: &Plan) -> Option<(usize, usize)> {
    if horizon == 0 || known.len() < 2 {
        return None;
    }
    let mut rest: Vec<usize> = known.iter().filter(|&&l| l > response_len).map(|&l| l - response_len).collect();
    if rest.is_empty() {
        return None; // Past every known answer: the tail.
    }
    rest.sort_unstable();
    let remaining = rest[(rest.len() - 1) / 2];
    (remaining < horizon).then(|| (plan.verify_tokens.div_ceil(2).max(1), remaining.clamp(1, plan.steps)))
}

#[derive(Debug, Clone, Copy)]
struct Member {
    key: Key,
    stream: usize,
    prompt_len: usize,
}

/// FNV-1a over the prompt's tokens: the key under which its answers are remembered.
fn prompt_key(prompt: &[u32]) -> u64 {
    prompt.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        t.to_le_bytes().iter().fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
    })
}

/// Drafts from a request's group: SuffixDecoding (arXiv 2411.04975) over the group's siblings, as Seer (arXiv
/// 2511.14617) does for GRPO groups.
///
/// Requests added to an [`Engine`](crate::Engine) with a [`GroupId`] share one index; a request without one gets
/// its own (per-request SuffixDecoding: prompt lookup with a frequency-ranked tree). Each request's stream is its
/// prompt followed by every token it commits ([`Drafter::observe`]); a finished sibling's stream stays in the
/// index until the whole group is released. With [`SuffixConfig::history_per_prompt`] the finished answers are
/// also remembered across rollouts (the drafter is meant to live as long as the trainer) and seed the index of
/// the next group with the same prompt.
///
/// A proposal is a deterministic function of the request's history and the drafter's state (its siblings'
/// committed tokens), so point-mass verification keeps it lossless. The tree: find the longest suffix of the
/// request's stream that occurs (in any stream of the group) followed by a token; read the continuations after
/// up to [`SuffixConfig::max_occurrences`] of its occurrences; every distinct continuation prefix becomes a
/// candidate node with empirical probability `count(prefix) / occurrences`; nodes are taken best-first (most
/// probable first, so the tree is ancestor-closed) while they reach [`SuffixConfig::min_prob`], the depth limit
/// `min(plan.steps, ceil(match_factor × match length))`, `plan.top_k` children per node and `plan.verify_tokens`
/// nodes. Edge log-probabilities are `ln(count(child) / count(parent))`, so a node's score is the log of its
/// empirical probability (comparable with a model drafter's in [`HybridDrafter`](crate::HybridDrafter)).
///
/// ```
/// use tlt_spec_decode::{DraftContext, Drafter, GroupId, Plan, RequestId, SuffixDrafter};
///
/// # fn main() -> tlt_spec_decode::Result<()> {
/// let mut d = SuffixDrafter::default();
/// let g = Some(GroupId(7));
/// let prompt = [1, 2, 3];
/// let ctx = |request, history| DraftContext { request, history, prompt_len: 3, hidden: None, group: g };
/// d.admit(&ctx(RequestId(0), &prompt));
/// d.admit(&ctx(RequestId(1), &prompt));
/// // Sibling 0 commits "10 11 12 13"; sibling 1 has committed "10 11" so far.
/// d.observe(RequestId(0), &[10, 11, 12, 13]);
/// d.observe(RequestId(1), &[10, 11]);
/// let tree = d.propose(&ctx(RequestId(1), &[1, 2, 3, 10, 11]), &Plan::chain(4))?;
/// assert_eq!(tree.tokens(), vec![11, 12, 13]);
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct SuffixDrafter {
    cfg: SuffixConfig,
    groups: HashMap<Key, Group>,
    members: HashMap<RequestId, Member>,
    history: HashMap<u64, VecDeque<Vec<u32>>>,
    history_order: VecDeque<u64>,
    stats: SuffixStats,
    calibration: Calibration,
    pending: HashMap<RequestId, Pending>,
}

/// A candidate node: its empirical probability, then its trie index (lower first on ties, for determinism).
#[derive(Debug, Clone, Copy)]
struct Cand {
    prob: f32,
    trie: usize,
    parent: usize,
}

impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> Ordering {
        self.prob.total_cmp(&o.prob).then_with(|| o.trie.cmp(&self.trie))
    }
}

#[derive(Debug, Clone)]
struct TrieNode {
    token: u32,
    count: u32,
    children: Vec<usize>,
}

impl SuffixDrafter {
    /// A drafter with these settings.
    ///
    /// # Errors
    /// If `cfg` is invalid ([`SuffixConfig::validate`]).
    pub fn new(cfg: SuffixConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg, ..Self::default() })
    }

    /// The settings.
    pub fn config(&self) -> &SuffixConfig {
        &self.cfg
    }

    /// The counters.
    pub fn stats(&self) -> &SuffixStats {
        &self.stats
    }

    /// Measured acceptance of the nodes proposed so far, by empirical probability (kept across rollouts).
    pub fn calibration(&self) -> &Calibration {
        &self.calibration
    }

    /// Zeroes the counters.
    pub fn reset_stats(&mut self) {
        self.stats = SuffixStats::default();
    }

    /// Groups with an index now.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// Remembered earlier answers, all prompts together.
    pub fn num_remembered(&self) -> usize {
        self.history.values().map(VecDeque::len).sum()
    }

    /// Remembers `answer` (prompt + response) for later groups of `prompt` (no-op when history is off).
    pub fn remember(&mut self, prompt: &[u32], answer: &[u32]) {
        if self.cfg.history_per_prompt == 0 {
            return;
        }
        let key = prompt_key(prompt);
        if !self.history.contains_key(&key) {
            self.history_order.push_back(key);
            while self.history_order.len() > self.cfg.history_prompts.max(1) {
                if let Some(old) = self.history_order.pop_front() {
                    self.history.remove(&old);
                }
            }
        }
        let list = self.history.entry(key).or_default();
        list.push_back(answer.to_vec());
        while list.len() > self.cfg.history_per_prompt {
            list.pop_front();
        }
    }

    fn register(&mut self, ctx: &DraftContext<'_>) -> Result<Member> {
        if let Some(m) = self.members.get(&ctx.request) {
            return Ok(*m);
        }
        let t = Instant::now();
        let key = ctx.group.map_or(Key::Solo(ctx.request), Key::Group);
        let prompt = ctx.history.get(..ctx.prompt_len).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "prompt length {} exceeds the history of {} tokens",
                ctx.prompt_len,
                ctx.history.len()
            ))
        })?;
        let group = match self.groups.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let mut index = SuffixIndex::new();
                let mut lengths = Vec::new();
                if let Some(old) = self.history.get(&prompt_key(prompt)) {
                    for answer in old {
                        index.add_stream(answer);
                        lengths.push(answer.len().saturating_sub(prompt.len()));
                        self.stats.appended += answer.len() as u64;
                    }
                }
                e.insert(Group { index, live: 0, lengths })
            }
        };
        group.live += 1;
        let stream = group.index.add_stream(ctx.history);
        self.stats.appended += ctx.history.len() as u64;
        let m = Member { key, stream, prompt_len: ctx.prompt_len };
        self.members.insert(ctx.request, m);
        self.stats.seconds += t.elapsed().as_secs_f64();
        Ok(m)
    }

    /// The draft tree for a registered member whose stream equals its history.
    fn tree(&self, m: Member, root: u32, plan: &Plan) -> Result<(DraftTree, usize, Pending)> {
        let mut pending = Pending::default();
        let mut tree = DraftTree::new(root);
        let Some(group) = self.groups.get(&m.key) else { return Ok((tree, 0, pending)) };
        let ix = &group.index;
        let (state, match_len) = ix.continuation_state(m.stream)?;
        if match_len < self.cfg.min_match {
            return Ok((tree, match_len, pending));
        }
        let stream_len = ix.stream(m.stream)?.len();
        let response_len = stream_len.saturating_sub(m.prompt_len);
        let (budget, steps) = das_budget(&group.lengths, response_len, self.cfg.das_horizon, plan)
            .unwrap_or((plan.verify_tokens, plan.steps));
        let depth = ((self.cfg.match_factor * match_len as f32).ceil() as usize).clamp(1, steps);
        let occ: Vec<Occurrence> = ix.occurrences(state, self.cfg.max_occurrences);
        if occ.is_empty() {
            return Ok((tree, match_len, pending));
        }
        // The trie of continuations with counts; node 0 is the root.
        let mut trie = vec![TrieNode { token: root, count: occ.len() as u32, children: Vec::new() }];
        for o in &occ {
            let mut cur = 0;
            for &tok in ix.continuation(*o, depth) {
                let next = trie[cur].children.iter().copied().find(|&c| trie[c].token == tok);
                cur = match next {
                    Some(c) => c,
                    None => {
                        trie.push(TrieNode { token: tok, count: 0, children: Vec::new() });
                        let c = trie.len() - 1;
                        trie[cur].children.push(c);
                        c
                    }
                };
                trie[cur].count += 1;
            }
        }
        let total = occ.len() as f32;
        let mut heap = BinaryHeap::new();
        let push_children = |heap: &mut BinaryHeap<Cand>, trie: &[TrieNode], t: usize, parent: usize| {
            for &c in &trie[t].children {
                heap.push(Cand { prob: trie[c].count as f32 / total, trie: c, parent });
            }
        };
        push_children(&mut heap, &trie, 0, 0);
        let mut map = vec![0usize]; // tree node -> trie node
        while let Some(c) = heap.pop() {
            if tree.len() >= budget || c.prob < self.cfg.min_prob {
                break;
            }
            if self.cfg.min_accept > 0.0 && self.calibration.estimate(c.prob) < self.cfg.min_accept {
                // Best-first: every later candidate is at most as probable (bins are not monotone in general,
                // so this is a cut, not a skip).
                break;
            }
            if tree.children(c.parent)?.len() >= plan.top_k {
                continue;
            }
            let parent_count = trie[map[c.parent]].count as f32;
            let lp = (trie[c.trie].count as f32 / parent_count).ln();
            let node = tree.push_child(c.parent, trie[c.trie].token, lp)?;
            pending.nodes.push((c.parent, trie[c.trie].token, c.prob));
            map.push(c.trie);
            push_children(&mut heap, &trie, c.trie, node);
        }
        Ok((tree, match_len, pending))
    }
}

impl Drafter for SuffixDrafter {
    fn admit(&mut self, ctx: &DraftContext<'_>) {
        // An inconsistent context (prompt longer than history) is reported again at `propose`.
        let _ = self.register(ctx);
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
        plan.validate()?;
        let Some(&root) = ctx.history.last() else {
            return Err(Error::InvalidArgument("suffix drafting needs a non-empty history".into()));
        };
        let m = self.register(ctx)?;
        let t = Instant::now();
        // Catch up with tokens committed while this drafter was not told (robustness; the engine observes).
        let group = self.groups.get_mut(&m.key).ok_or_else(|| Error::InvalidArgument("unknown group".into()))?;
        let seen = group.index.stream(m.stream)?;
        let have = seen.len();
        if !ctx.history.starts_with(seen) {
            return Err(Error::InvalidArgument(format!(
                "request {}'s history disagrees with the tokens the suffix drafter observed",
                ctx.request.0
            )));
        }
        group.index.extend(m.stream, &ctx.history[have..])?;
        self.stats.appended += (ctx.history.len() - have) as u64;
        let (tree, match_len, pending) = self.tree(m, root, plan)?;
        if pending.nodes.is_empty() {
            self.pending.remove(&ctx.request);
        } else {
            self.pending.insert(ctx.request, pending);
        }
        self.stats.proposals += 1;
        self.stats.drafted += u64::from(tree.len() > 1);
        self.stats.match_len_sum += match_len as u64;
        self.stats.seconds += t.elapsed().as_secs_f64();
        Ok(tree)
    }

    fn observe(&mut self, request: RequestId, committed: &[u32]) {
        if let Some(p) = self.pending.remove(&request) {
            p.settle(committed, &mut self.calibration);
        }
        let Some(m) = self.members.get(&request).copied() else { return };
        let t = Instant::now();
        if let Some(g) = self.groups.get_mut(&m.key) {
            if g.index.extend(m.stream, committed).is_ok() {
                self.stats.appended += committed.len() as u64;
            }
        }
        self.stats.seconds += t.elapsed().as_secs_f64();
    }

    fn release(&mut self, request: RequestId) {
        self.pending.remove(&request);
        let Some(m) = self.members.remove(&request) else { return };
        let Some(g) = self.groups.get_mut(&m.key) else { return };
        g.live = g.live.saturating_sub(1);
        let answer = g.index.stream(m.stream).map(<[u32]>::to_vec).unwrap_or_default();
        g.lengths.push(answer.len().saturating_sub(m.prompt_len));
        if g.live == 0 {
            self.groups.remove(&m.key);
        }
        if answer.len() > m.prompt_len {
            self.remember(&answer[..m.prompt_len], &answer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn das_halves_the_budget_only_of_requests_expected_to_end_soon() {
        let plan = Plan { steps: 6, top_k: 2, verify_tokens: 12 };
        // Known answers of 10, 20 and 200 tokens; a request at 15 tokens: the survivors end 5 and 185 tokens
        // later, lower median 5 < 32: half the verify tokens, at most 5 levels.
        assert_eq!(das_budget(&[10, 20, 200], 15, 32, &plan), Some((6, 5)));
        // At 150 tokens only the 200-token answer is longer: 50 more expected, not below the horizon.
        assert_eq!(das_budget(&[10, 20, 200], 150, 32, &plan), None);
        // Past every known answer: the tail keeps the whole plan.
        assert_eq!(das_budget(&[10, 20, 200], 250, 32, &plan), None);
        // Off, or fewer than two known lengths: the whole plan.
        assert_eq!(das_budget(&[10, 20, 200], 15, 0, &plan), None);
        assert_eq!(das_budget(&[20], 15, 32, &plan), None);
        // One level at least, one node at least.
        assert_eq!(das_budget(&[16, 16], 15, 32, &Plan::chain(1)), Some((1, 1)));
    }
}
