//! The target model seam: what the engine needs from the model it verifies drafts with.

use std::ops::Range;

use tlt_kernels::{token_logprob_pmax, SamplingParams};

use crate::{Accepted, Coins, DraftTree, Error, Result, Verifier};

/// Handle of one sequence inside a [`Target`]'s state (for `tlt_model`, the `SeqId` index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqHandle(pub usize);

/// New tokens for one sequence in a batched [`Target::forward`].
#[derive(Debug, Clone, Copy)]
pub struct TargetInput<'a> {
    /// The sequence; its committed tokens are the context.
    pub seq: SeqHandle,
    /// The new tokens (at least one).
    pub tokens: &'a [u32],
    /// `None`: a causal append, committed at once (prefill). `Some(parents)`: a token tree in
    /// [`DraftTree::parents`](crate::DraftTree::parents) form, tentative until [`Target::commit`].
    pub tree: Option<&'a [Option<usize>]>,
    /// Whether to return a logits row for every new token (`false`: none, e.g. a prefill).
    pub logits: bool,
}

/// What a batched [`Target::forward`] returns: flat row-major buffers plus each input's rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TargetOutput {
    /// Width of a logits row.
    pub vocab: usize,
    /// `[rows, vocab]` logits, rows of all inputs in input order.
    pub logits: Vec<f32>,
    /// For each input, its rows in `logits` (empty when it asked for none).
    pub logit_rows: Vec<Range<usize>>,
    /// Width of a hidden-state row (0 when none were asked for).
    pub hidden_size: usize,
    /// `[tokens, hidden_size]` final-norm hidden states of every new token of every input, when asked for.
    pub hidden: Option<Vec<f32>>,
    /// For each input, its rows in `hidden`.
    pub hidden_rows: Vec<Range<usize>>,
}

impl TargetOutput {
    /// Logits row `r` of input `input` (`r` counts from the input's first row).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] if the input or row does not exist.
    pub fn logits_row(&self, input: usize, r: usize) -> Result<&[f32]> {
        let rows = self.logit_rows.get(input).ok_or(Error::ShapeMismatch {
            what: "target output inputs",
            expected: input + 1,
            got: self.logit_rows.len(),
        })?;
        if r >= rows.len() {
            return Err(Error::ShapeMismatch { what: "target logits rows", expected: r + 1, got: rows.len() });
        }
        let at = (rows.start + r) * self.vocab;
        self.logits.get(at..at + self.vocab).ok_or(Error::ShapeMismatch {
            what: "target logits buffer",
            expected: at + self.vocab,
            got: self.logits.len(),
        })
    }

    /// Hidden-state row `r` of input `input`, if hidden states were returned.
    pub fn hidden_row(&self, input: usize, r: usize) -> Option<&[f32]> {
        let rows = self.hidden_rows.get(input)?;
        if r >= rows.len() {
            return None;
        }
        let at = (rows.start + r) * self.hidden_size;
        self.hidden.as_ref()?.get(at..at + self.hidden_size)
    }
}

/// What the [`Engine`](crate::Engine) asks of a target that verifies on its side ([`Target::forward_verify`]): the
/// lossless coupled rule of [`verify_coupled`](crate::verify_coupled) with these sampling parameters, and per input
/// the coins of its round.
#[derive(Debug, Clone, Copy)]
pub struct VerifySpec<'a> {
    /// Temperature, top-k, top-p.
    pub params: &'a SamplingParams,
    /// The coins of each input's round, in input order.
    pub coins: &'a [Coins],
}

/// One input's verification: the accepted root path and the committed tokens' log-probs, largest probabilities and
/// (when asked) hidden rows, which is all that needs to leave the device.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// The accepted path and the token after it.
    pub accepted: Accepted,
    /// Log-probability of each committed token (`accepted.path.len()` of them), as in
    /// [`Finished::logprobs`](crate::Finished::logprobs).
    pub logprobs: Vec<f32>,
    /// Largest probability of the distribution each committed token was drawn from.
    pub p_max: Vec<f32>,
    /// Width of a hidden row (0 when none were asked for).
    pub hidden_size: usize,
    /// `[path.len(), hidden_size]`: the hidden row of each accepted node, when asked for.
    pub hidden: Option<Vec<f32>>,
}

impl Verified {
    /// Verifies input `input` of a forward's output on the host with `verifier`: the engine's path for targets
    /// that return logits, and the reference for targets that verify on their side.
    ///
    /// # Errors
    /// As the verifier, and [`Error::ShapeMismatch`] for an output without the rows `tree` needs.
    pub fn on_host(
        verifier: &dyn Verifier,
        tree: &DraftTree,
        out: &TargetOutput,
        input: usize,
        params: &SamplingParams,
        coins: &Coins,
    ) -> Result<Self> {
        let rows: Vec<&[f32]> = (0..tree.len()).map(|r| out.logits_row(input, r)).collect::<Result<_>>()?;
        let accepted = verifier.verify(tree, &rows, params, coins)?;
        let committed = accepted.committed_tokens(tree)?;
        let (mut logprobs, mut p_max) = (Vec::with_capacity(committed.len()), Vec::with_capacity(committed.len()));
        for (&node, &tok) in accepted.path.iter().zip(&committed) {
            let (lp, pm) = token_logprob_pmax(rows[node], tok as usize, params.temperature)?;
            logprobs.push(lp);
            p_max.push(pm);
        }
        let hidden = match out.hidden {
            Some(_) => {
                let mut rows = Vec::with_capacity(accepted.path.len() * out.hidden_size);
                for &node in &accepted.path {
                    rows.extend_from_slice(out.hidden_row(input, node).ok_or(Error::ShapeMismatch {
                        what: "target hidden rows",
                        expected: tree.len(),
                        got: out.hidden_rows.get(input).map_or(0, |r| r.len()),
                    })?);
                }
                Some(rows)
            }
            None => None,
        };
        Ok(Self { accepted, logprobs, p_max, hidden_size: if hidden.is_some() { out.hidden_size } else { 0 }, hidden })
    }

    /// Hidden row of the `k`-th accepted node, if hidden states were returned.
    pub fn hidden_row(&self, k: usize) -> Option<&[f32]> {
        self.hidden.as_ref()?.get(k * self.hidden_size..(k + 1) * self.hidden_size)
    }

    /// Checks a target's answer for `tree`: a root path of it, one log-prob and largest probability per committed
    /// token, a token in the vocabulary, hidden rows when `hidden`.
    ///
    /// # Errors
    /// [`Error::Target`] naming what is wrong.
    pub fn check(&self, tree: &DraftTree, vocab: usize, hidden: bool) -> Result<()> {
        let bad = |m: String| Err(Error::Target(format!("target-side verification: {m}")));
        let path = &self.accepted.path;
        if !tree.is_root_path(path) {
            return bad(format!("path {path:?} is not a root path of the tree"));
        }
        if self.logprobs.len() != path.len() || self.p_max.len() != path.len() {
            return bad(format!(
                "{} log-probs, {} p_max for {} tokens",
                self.logprobs.len(),
                self.p_max.len(),
                path.len()
            ));
        }
        if self.accepted.next_token as usize >= vocab {
            return bad(format!("token {} outside the vocabulary of {vocab}", self.accepted.next_token));
        }
        if hidden && (0..path.len()).any(|k| self.hidden_row(k).is_none_or(|r| r.len() != self.hidden_size)) {
            return bad("missing hidden rows".into());
        }
        Ok(())
    }
}

/// A target model driven by the [`Engine`](crate::Engine): batched forward over token trees with tentative
/// cache entries, and commit of an accepted root path. Weights are read-only (`&self`); all per-sequence state
/// lives in [`Target::State`] (the KV cache).
pub trait Target {
    /// The mutable per-batch state (the KV cache).
    type State;

    /// Width of a logits row.
    fn vocab_size(&self) -> usize;
    /// The end-of-sequence tokens (the default stop tokens).
    fn eos_ids(&self) -> Vec<u32>;
    /// The longest context (committed tokens) a sequence may reach, if bounded.
    fn max_context(&self) -> Option<usize> {
        None
    }
    /// A fresh, empty state.
    fn new_state(&self) -> Self::State;
    /// Starts an empty sequence.
    fn new_sequence(&self, state: &mut Self::State) -> SeqHandle;
    /// Frees a sequence.
    ///
    /// # Errors
    /// If `seq` is unknown.
    fn remove(&self, state: &mut Self::State, seq: SeqHandle) -> Result<()>;
    /// Rolls `seq` back to its first `len` committed tokens, dropping tentative entries.
    ///
    /// # Errors
    /// If `seq` is unknown or has fewer than `len` tokens.
    fn truncate(&self, state: &mut Self::State, seq: SeqHandle, len: usize) -> Result<()>;
    /// One batched forward. With `hidden`, also the final-norm hidden state of every new token.
    ///
    /// # Errors
    /// On bad input (unknown or repeated sequence, empty tokens, token out of vocabulary, a sequence with a
    /// pending tree); the state is then left as it was.
    fn forward(&self, state: &mut Self::State, inputs: &[TargetInput<'_>], hidden: bool) -> Result<TargetOutput>;
    /// Copies the committed state of `seq` into a new sequence (one prompt prefilled once, then shared by a
    /// group's samples). `Ok(None)` (the default) when the target cannot fork; the engine then prefills.
    ///
    /// # Errors
    /// If `seq` is unknown or has a pending tree.
    fn fork(&self, state: &mut Self::State, seq: SeqHandle) -> Result<Option<SeqHandle>> {
        let _ = (state, seq);
        Ok(None)
    }
    /// One batched forward of draft trees (every input has `tree` and `logits`) **and** their verification where
    /// the logits live, so that only [`Verified`] results cross back (a GPU target keeps the `[nodes, vocab]`
    /// logits on the device). The tentative nodes stay pending until [`Target::commit`], as after
    /// [`Target::forward`]. `Ok(None)` (the default) when the target does not verify on its side, or not with
    /// `spec.params`: it must then leave `state` untouched, and the engine calls [`Target::forward`] and verifies
    /// on the host.
    ///
    /// # Errors
    /// As [`Target::forward`].
    fn forward_verify(
        &self,
        state: &mut Self::State,
        inputs: &[TargetInput<'_>],
        hidden: bool,
        spec: VerifySpec<'_>,
    ) -> Result<Option<Vec<Verified>>> {
        let _ = (state, inputs, hidden, spec);
        Ok(None)
    }
    /// Keeps the tentative tree nodes `path` (a root path) of `seq` and drops the others.
    ///
    /// # Errors
    /// If `seq` has no pending tree or `path` is not a root path of it.
    fn commit(&self, state: &mut Self::State, seq: SeqHandle, path: &[usize]) -> Result<()>;
}

/// A [`Target`] behind a reference or a shared pointer is the target itself (a server swaps an `Arc` of the model
/// between rounds; an engine borrows one).
macro_rules! target_through {
    ($($ptr:ty),*) => {$(
        impl<T: Target + ?Sized> Target for $ptr {
            type State = T::State;
            fn vocab_size(&self) -> usize {
                (**self).vocab_size()
            }
            fn eos_ids(&self) -> Vec<u32> {
                (**self).eos_ids()
            }
            fn max_context(&self) -> Option<usize> {
                (**self).max_context()
            }
            fn new_state(&self) -> Self::State {
                (**self).new_state()
            }
            fn new_sequence(&self, state: &mut Self::State) -> SeqHandle {
                (**self).new_sequence(state)
            }
            fn remove(&self, state: &mut Self::State, seq: SeqHandle) -> Result<()> {
                (**self).remove(state, seq)
            }
            fn truncate(&self, state: &mut Self::State, seq: SeqHandle, len: usize) -> Result<()> {
                (**self).truncate(state, seq, len)
            }
            fn forward(&self, state: &mut Self::State, inputs: &[TargetInput<'_>], hidden: bool) -> Result<TargetOutput> {
                (**self).forward(state, inputs, hidden)
            }
            fn commit(&self, state: &mut Self::State, seq: SeqHandle, path: &[usize]) -> Result<()> {
                (**self).commit(state, seq, path)
            }
            fn forward_verify(
                &self,
                state: &mut Self::State,
                inputs: &[TargetInput<'_>],
                hidden: bool,
                spec: VerifySpec<'_>,
            ) -> Result<Option<Vec<Verified>>> {
                (**self).forward_verify(state, inputs, hidden, spec)
            }
            fn fork(&self, state: &mut Self::State, seq: SeqHandle) -> Result<Option<SeqHandle>> {
                (**self).fork(state, seq)
            }
        }
    )*};
}

target_through!(&T, std::sync::Arc<T>);
