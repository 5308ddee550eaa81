//! [`ToyTarget`]: a model-free [`Target`] whose next-token logits are a fixed pseudo-random function of the last
//! two tokens. It obeys the whole [`Target`] contract (batched forward over trees, tentative entries, commit,
//! truncate, fork) at the cost of a hash per logit, so the engine, the scheduler and their tests and examples run
//! without a model, a tensor library or weights.

use tlt_kernels::{argmax, categorical, probs, token_logprob_pmax};

use crate::{Accepted, Error, Result, SeqHandle, Target, TargetInput, TargetOutput, Verified, VerifySpec};

/// A deterministic toy language model over a small vocabulary: the logits after a context depend only on its
/// last two tokens (and the seed). Cheap, exact and reproducible; for tests, examples and overhead benchmarks.
///
/// ```
/// use tlt_spec_decode::{Engine, NgramDrafter, Plan, SpecParams, ToyTarget};
///
/// # fn main() -> tlt_spec_decode::Result<()> {
/// let target = ToyTarget::new(16, 7);
/// let plan = Plan { steps: 4, top_k: 1, verify_tokens: 5 };
/// let mut plain = Engine::new(&target, SpecParams::greedy(24))?;
/// plain.add_request(&[1, 2, 3])?;
/// plain.run_to_completion(None, &plan)?;
/// let mut spec = Engine::new(&target, SpecParams::greedy(24))?;
/// spec.add_request(&[1, 2, 3])?;
/// let mut ngram = NgramDrafter::default();
/// spec.run_to_completion(Some(&mut ngram), &plan)?;
/// // Greedy speculative decoding commits plain decoding's tokens.
/// assert_eq!(plain.finished()[0].tokens, spec.finished()[0].tokens);
/// assert_eq!(spec.finished()[0].tokens.len(), 24);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToyTarget {
    vocab: usize,
    seed: u64,
    hidden_size: usize,
    eos: Vec<u32>,
    verifies: bool,
}

/// One sequence of a [`ToyTarget`]'s state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToySequence {
    /// Committed tokens.
    pub tokens: Vec<u32>,
    /// A pending tree: its tokens and parents, until commit or truncate.
    pending: Option<(Vec<u32>, Vec<Option<usize>>)>,
}

/// The state of a [`ToyTarget`]: its sequences by handle (`None` once removed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToyState {
    seqs: Vec<Option<ToySequence>>,
}

impl ToyState {
    /// The sequence behind `seq`, if it exists.
    pub fn sequence(&self, seq: SeqHandle) -> Option<&ToySequence> {
        self.seqs.get(seq.0).and_then(Option::as_ref)
    }

    fn get_mut(&mut self, seq: SeqHandle) -> Result<&mut ToySequence> {
        self.seqs
            .get_mut(seq.0)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::Target(format!("unknown sequence {}", seq.0)))
    }
}

/// A well-mixed hash of a few integers: SplitMix64 steps chained over them.
fn mix(parts: &[u64]) -> u64 {
    parts.iter().fold(0x9E37_79B9_7F4A_7C15u64, |h, &p| {
        tlt_kernels::SplitMix64::new(h ^ p.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64()
    })
}

/// A value in `[-1, 1)` from a hash.
fn unit(h: u64) -> f32 {
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

impl ToyTarget {
    /// A toy model over `vocab` tokens (at least 2; smaller values are raised to 2), no end-of-sequence token,
    /// 8-wide hidden rows.
    pub fn new(vocab: usize, seed: u64) -> Self {
        Self { vocab: vocab.max(2), seed, hidden_size: 8, eos: Vec::new(), verifies: false }
    }

    /// The same model with `eos` as its end-of-sequence tokens.
    pub fn with_eos(mut self, eos: Vec<u32>) -> Self {
        self.eos = eos;
        self
    }

    /// The same model verifying on its side ([`Target::forward_verify`]) when there is no top-k/top-p: the walk of
    /// [`verify_coupled`](crate::verify_coupled) written again from contexts rather than logits rows, the way a GPU
    /// target runs it on the device, so engine tests can compare the two paths.
    pub fn verifying_on_target(mut self) -> Self {
        self.verifies = true;
        self
    }

    /// The logits after `context` (only its last two tokens matter; missing ones read as a sentinel).
    pub fn logits(&self, context: &[u32]) -> Vec<f32> {
        let (a, b) = self.last_two(context);
        (0..self.vocab as u64).map(|t| 4.0 * unit(mix(&[self.seed, 1, a, b, t]))).collect()
    }

    /// The hidden row of the last token of `context` (a function of its last two tokens).
    pub fn hidden(&self, context: &[u32]) -> Vec<f32> {
        let (a, b) = self.last_two(context);
        (0..self.hidden_size as u64).map(|d| unit(mix(&[self.seed, 2, a, b, d]))).collect()
    }

    fn last_two(&self, ctx: &[u32]) -> (u64, u64) {
        let sentinel = u64::MAX;
        let n = ctx.len();
        let a = if n >= 2 { u64::from(ctx[n - 2]) } else { sentinel };
        let b = if n >= 1 { u64::from(ctx[n - 1]) } else { sentinel };
        (a, b)
    }

    /// Checks every input before anything changes, so a bad batch leaves the state as it was.
    fn check(&self, state: &ToyState, inputs: &[TargetInput<'_>]) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for input in inputs {
            let seq =
                state.sequence(input.seq).ok_or_else(|| Error::Target(format!("unknown sequence {}", input.seq.0)))?;
            if !seen.insert(input.seq) {
                return Err(Error::Target(format!("sequence {} appears twice in one forward", input.seq.0)));
            }
            if seq.pending.is_some() {
                return Err(Error::Target(format!("sequence {} has a pending tree", input.seq.0)));
            }
            if input.tokens.is_empty() {
                return Err(Error::Target(format!("sequence {}: no new tokens", input.seq.0)));
            }
            if let Some(&t) = input.tokens.iter().find(|&&t| t as usize >= self.vocab) {
                return Err(Error::Target(format!("token {t} is outside the vocabulary of size {}", self.vocab)));
            }
            if let Some(parents) = input.tree {
                let ok = parents.len() == input.tokens.len()
                    && parents.first() == Some(&None)
                    && parents.iter().enumerate().skip(1).all(|(i, p)| p.is_some_and(|p| p < i));
                if !ok {
                    return Err(Error::InvalidTree(format!("sequence {}: bad parents {parents:?}", input.seq.0)));
                }
            }
        }
        Ok(())
    }
}

impl Target for ToyTarget {
    type State = ToyState;

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn eos_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    fn new_state(&self) -> ToyState {
        ToyState::default()
    }

    fn new_sequence(&self, state: &mut ToyState) -> SeqHandle {
        state.seqs.push(Some(ToySequence::default()));
        SeqHandle(state.seqs.len() - 1)
    }

    fn remove(&self, state: &mut ToyState, seq: SeqHandle) -> Result<()> {
        state.get_mut(seq)?;
        state.seqs[seq.0] = None;
        Ok(())
    }

    fn truncate(&self, state: &mut ToyState, seq: SeqHandle, len: usize) -> Result<()> {
        let s = state.get_mut(seq)?;
        if len > s.tokens.len() {
            return Err(Error::Target(format!("sequence {} has {} tokens, cannot keep {len}", seq.0, s.tokens.len())));
        }
        s.tokens.truncate(len);
        s.pending = None;
        Ok(())
    }

    fn forward(&self, state: &mut ToyState, inputs: &[TargetInput<'_>], hidden: bool) -> Result<TargetOutput> {
        self.check(state, inputs)?;
        let mut out = TargetOutput {
            vocab: self.vocab,
            hidden_size: if hidden { self.hidden_size } else { 0 },
            hidden: hidden.then(Vec::new),
            ..TargetOutput::default()
        };
        let (mut logit_row, mut hidden_row) = (0, 0);
        for input in inputs {
            let seq = state.get_mut(input.seq)?;
            // The context of every new token: the committed tokens, then its ancestors (a tree) or its
            // predecessors (a causal append), then itself.
            let contexts: Vec<Vec<u32>> = (0..input.tokens.len())
                .map(|i| {
                    let mut path = vec![i];
                    if let Some(parents) = input.tree {
                        while let Some(Some(p)) = parents.get(*path.last().unwrap_or(&0)) {
                            path.push(*p);
                        }
                        path.reverse();
                    } else {
                        path = (0..=i).collect();
                    }
                    seq.tokens.iter().copied().chain(path.iter().map(|&j| input.tokens[j])).collect()
                })
                .collect();
            if input.logits {
                for ctx in &contexts {
                    out.logits.extend(self.logits(ctx));
                }
                out.logit_rows.push(logit_row..logit_row + contexts.len());
                logit_row += contexts.len();
            } else {
                out.logit_rows.push(logit_row..logit_row);
            }
            if let Some(h) = out.hidden.as_mut() {
                for ctx in &contexts {
                    h.extend(self.hidden(ctx));
                }
                out.hidden_rows.push(hidden_row..hidden_row + contexts.len());
                hidden_row += contexts.len();
            }
            match input.tree {
                Some(parents) => seq.pending = Some((input.tokens.to_vec(), parents.to_vec())),
                None => seq.tokens.extend_from_slice(input.tokens),
            }
        }
        Ok(out)
    }

    fn forward_verify(
        &self,
        state: &mut ToyState,
        inputs: &[TargetInput<'_>],
        hidden: bool,
        spec: VerifySpec<'_>,
    ) -> Result<Option<Vec<Verified>>> {
        let p = spec.params;
        if !self.verifies || p.top_k.is_some() || p.top_p.is_some() {
            return Ok(None);
        }
        if spec.coins.len() != inputs.len() {
            return Err(Error::ShapeMismatch { what: "coins", expected: inputs.len(), got: spec.coins.len() });
        }
        // Validates the batch and leaves each tree pending, as a forward does.
        self.forward(state, inputs, false)?;
        let mut out = Vec::with_capacity(inputs.len());
        for (input, coins) in inputs.iter().zip(spec.coins) {
            let parents = input.tree.ok_or_else(|| Error::Target("target-side verification needs trees".into()))?;
            let seq = state.sequence(input.seq).ok_or_else(|| Error::Target("sequence vanished".into()))?;
            let mut ctx: Vec<u32> = seq.tokens.iter().copied().chain([input.tokens[0]]).collect();
            let (mut path, mut cur) = (vec![0], 0);
            let (mut logprobs, mut p_max, mut rows) = (Vec::new(), Vec::new(), Vec::new());
            loop {
                let logits = self.logits(&ctx);
                let tok = if p.temperature == 0.0 {
                    argmax(&logits)?
                } else {
                    categorical(&probs(&logits, p)?, coins.uniform(path.len() - 1))?
                };
                let (lp, pm) = token_logprob_pmax(&logits, tok, p.temperature)?;
                logprobs.push(lp);
                p_max.push(pm);
                if hidden {
                    rows.extend(self.hidden(&ctx));
                }
                let child =
                    (cur + 1..input.tokens.len()).find(|&c| parents[c] == Some(cur) && input.tokens[c] as usize == tok);
                match child {
                    Some(c) => {
                        path.push(c);
                        ctx.push(input.tokens[c]);
                        cur = c;
                    }
                    None => {
                        let accepted = Accepted { path, next_token: tok as u32 };
                        let hidden_size = if hidden { self.hidden_size } else { 0 };
                        out.push(Verified { accepted, logprobs, p_max, hidden_size, hidden: hidden.then_some(rows) });
                        break;
                    }
                }
            }
        }
        Ok(Some(out))
    }

    fn fork(&self, state: &mut ToyState, seq: SeqHandle) -> Result<Option<SeqHandle>> {
        let s = state.get_mut(seq)?;
        if s.pending.is_some() {
            return Err(Error::Target(format!("sequence {} has a pending tree", seq.0)));
        }
        let copy = ToySequence { tokens: s.tokens.clone(), pending: None };
        state.seqs.push(Some(copy));
        Ok(Some(SeqHandle(state.seqs.len() - 1)))
    }

    fn commit(&self, state: &mut ToyState, seq: SeqHandle, path: &[usize]) -> Result<()> {
        let s = state.get_mut(seq)?;
        let (tokens, parents) =
            s.pending.as_ref().ok_or_else(|| Error::Target(format!("sequence {} has no pending tree", seq.0)))?;
        if !crate::tree::is_root_path_of(parents, path) {
            return Err(Error::InvalidTree(format!("sequence {}: {path:?} is not a root path", seq.0)));
        }
        let kept: Vec<u32> = path.iter().map(|&n| tokens[n]).collect();
        s.tokens.extend(kept);
        s.pending = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(seq: SeqHandle, tokens: &'a [u32], tree: Option<&'a [Option<usize>]>) -> TargetInput<'a> {
        TargetInput { seq, tokens, tree, logits: true }
    }

    #[test]
    fn tree_rows_equal_causal_rows_and_commit_keeps_the_path() {
        let t = ToyTarget::new(10, 3);
        let mut st = t.new_state();
        let s = t.new_sequence(&mut st);
        t.forward(&mut st, &[input(s, &[1, 2], None)], false).unwrap();
        // Tree: 0 -> 1 -> 3, 0 -> 2.
        let parents = [None, Some(0), Some(0), Some(1)];
        let out = t.forward(&mut st, &[input(s, &[5, 6, 7, 8], Some(&parents))], true).unwrap();
        assert_eq!(out.logits_row(0, 3).unwrap(), t.logits(&[1, 2, 5, 6, 8]).as_slice());
        assert_eq!(out.logits_row(0, 2).unwrap(), t.logits(&[1, 2, 5, 7]).as_slice());
        assert_eq!(out.hidden_row(0, 1).unwrap(), t.hidden(&[1, 2, 5, 6]).as_slice());
        assert!(t.commit(&mut st, s, &[0, 2, 3]).is_err(), "3 is not a child of 2");
        t.commit(&mut st, s, &[0, 1, 3]).unwrap();
        assert_eq!(st.sequence(s).unwrap().tokens, [1, 2, 5, 6, 8]);
    }

    #[test]
    fn bad_batches_leave_the_state_unchanged() {
        let t = ToyTarget::new(4, 0);
        let mut st = t.new_state();
        let s = t.new_sequence(&mut st);
        let before = st.clone();
        assert!(t.forward(&mut st, &[input(s, &[], None)], false).is_err());
        assert!(t.forward(&mut st, &[input(s, &[9], None)], false).is_err());
        assert!(t.forward(&mut st, &[input(s, &[1], None), input(s, &[1], None)], false).is_err());
        assert!(t.forward(&mut st, &[input(SeqHandle(5), &[1], None)], false).is_err());
        assert!(t.forward(&mut st, &[input(s, &[1, 2], Some(&[None, Some(1)]))], false).is_err());
        assert_eq!(st, before);
        assert!(t.truncate(&mut st, s, 1).is_err());
        assert!(t.commit(&mut st, s, &[0]).is_err());
        t.remove(&mut st, s).unwrap();
        assert!(t.remove(&mut st, s).is_err());
    }

    #[test]
    fn fork_copies_committed_tokens() {
        let t = ToyTarget::new(8, 1);
        let mut st = t.new_state();
        let s = t.new_sequence(&mut st);
        t.forward(&mut st, &[input(s, &[1, 2, 3], None)], false).unwrap();
        let f = t.fork(&mut st, s).unwrap().unwrap();
        assert_eq!(st.sequence(f).unwrap().tokens, [1, 2, 3]);
        t.truncate(&mut st, f, 1).unwrap();
        assert_eq!(st.sequence(s).unwrap().tokens, [1, 2, 3]);
    }
}
