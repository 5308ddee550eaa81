//! The batched draft → verify → commit engine.

use std::time::Instant;

use tlt_kernels::SeededRng;

use crate::stop::StopStrings;
use crate::{
    Coins, DraftContext, DraftTree, Drafter, Error, ExactVerifier, HiddenStates, Plan, Result, SeqHandle, SpecParams,
    Target, TargetInput, TokenDecoder, Verified, Verifier, VerifySpec,
};

/// Identifies a request of an [`Engine`] (dense, in order of [`Engine::add_request`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub usize);

/// Identifies a group of requests that answer one prompt together (a GRPO group), as given to
/// [`Engine::add_request_in_group`] or made by [`Engine::add_group`]. Group drafters
/// ([`SuffixDrafter`](crate::SuffixDrafter)) draft from a request's siblings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct GroupId(pub u64);

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced a stop token (the last token of its output).
    Stop,
    /// Its text came to contain `params.stop[index]` (the token completing it is the last of its output).
    StopString {
        /// Which stop string.
        index: usize,
    },
    /// It reached `max_new_tokens` or the target's context limit.
    Length,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Its prompt.
    pub prompt: Vec<u32>,
    /// Generated tokens (a stop token, if any, is the last one).
    pub tokens: Vec<u32>,
    /// `logprobs[i]`: the target's log-probability of `tokens[i]` given everything before it, at the sampling
    /// temperature (1 for greedy decoding) and without top-k/top-p: the distribution a trainer recomputes, so
    /// truncated importance sampling compares like with like at any temperature.
    pub logprobs: Vec<f32>,
    /// `p_max[i]`: the largest probability of the distribution `tokens[i]` was drawn from (same temperature as
    /// `logprobs`, no top-k/top-p): what a point-mass draft of the argmax there is accepted with.
    pub p_max: Vec<f32>,
    /// Each speculative round of this request (its tree held at least one draft), in order: the index into
    /// `tokens` of the first token the round committed, and how many it committed.
    pub sd_rounds: Vec<(u32, u32)>,
    /// When recording was on ([`Engine::record_hidden`]): the target's features at every position fed, prompt
    /// included: `prompt.len() + tokens.len() - 1` rows, row `t` predicting token `t + 1` of prompt + tokens
    /// (EAGLE's pairing). [`Finished::token_hidden`] picks the row that predicted a generated token.
    pub hidden: Option<HiddenStates>,
    /// Why it ended.
    pub reason: FinishReason,
}

impl Finished {
    /// The recorded feature at the position that predicted `tokens[i]` (the previous token's position).
    pub fn token_hidden(&self, i: usize) -> Option<&[f32]> {
        self.hidden.as_ref()?.row(self.prompt.len() + i - 1)
    }
}

/// Engine counters since construction (or [`Engine::reset_counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    /// Engine rounds (one target forward each).
    pub rounds: u64,
    /// Sequence-rounds (sum over rounds of the live sequences in it).
    pub seq_rounds: u64,
    /// Drafted tokens sent for verification (tree nodes other than roots).
    pub drafted: u64,
    /// Drafted tokens accepted.
    pub accepted: u64,
    /// Tokens committed (accepted drafts + one per sequence-round, before stop truncation).
    pub committed: u64,
    /// Seconds in the drafter.
    pub draft_s: f64,
    /// Seconds in target forwards of rounds (tree verification).
    pub forward_s: f64,
    /// Seconds deciding acceptance (verification on the logits).
    pub verify_s: f64,
    /// Seconds committing: cache commit, log-probs, hidden states, bookkeeping.
    pub commit_s: f64,
    /// Seconds prefilling prompts (forks of a group's prefilled prompt included).
    pub prefill_s: f64,
    /// Prompt tokens run through the target in prefills.
    pub prefill_tokens: u64,
    /// Requests whose prompt state was forked from a sibling's instead of prefilled ([`Engine::add_group`]).
    pub prefill_forks: u64,
}

impl Counters {
    /// Mean committed tokens per sequence-round (accept length + 1 on average).
    pub fn mean_accept_len(&self) -> f64 {
        if self.seq_rounds == 0 {
            0.0
        } else {
            self.committed as f64 / self.seq_rounds as f64
        }
    }
}

#[derive(Debug)]
struct Live {
    id: RequestId,
    group: Option<GroupId>,
    /// Whether a drafter has been told of this request ([`Drafter::admit`]).
    admitted: bool,
    handle: SeqHandle,
    prompt_len: usize,
    /// Prompt + generated. The last token is the root of the next round: committed but not yet fed.
    history: Vec<u32>,
    /// Most tokens this request generates.
    max_new_tokens: usize,
    logprobs: Vec<f32>,
    p_max: Vec<f32>,
    sd_rounds: Vec<(u32, u32)>,
    /// Features of every fed position (`history.len() - 1` rows) when recording.
    hidden: Option<HiddenStates>,
    /// The request's sampling stream: position `i`'s coin is `stream.fork(i)` ([`Coins`]).
    stream: SeededRng,
}

/// Appends `rows` (flat, `width` wide) to `h`, adopting `width` while `h` is still empty.
fn append_hidden(h: &mut HiddenStates, width: usize, rows: &[f32]) -> Result<()> {
    if h.is_empty() && h.width() != width {
        *h = HiddenStates::new(width);
    }
    h.extend_flat(rows)
}

/// Runs speculative (or plain) decoding for a batch of requests against one [`Target`].
///
/// Each round ([`Engine::step`]) drafts a tree per live sequence (a root-only tree without a drafter), scores
/// all trees in **one** batched target forward, verifies each (greedy at temperature 0, otherwise lossless
/// tree speculative sampling with point-mass proposals; see [`Engine::with_verifier`]), commits the accepted
/// path in the target's cache and
/// appends the accepted tokens plus the bonus/correction token. The last committed token is kept as the next
/// round's root and not yet fed, so plain and speculative rounds are the same state machine: a drafter can be
/// switched on or off between any two rounds without re-prefilling.
///
/// ```
/// use tlt_model::{Llama, LlamaConfig};
/// use tlt_spec_decode::{Engine, NgramDrafter, Plan, SpecParams};
///
/// # fn main() -> tlt_spec_decode::Result<()> {
/// let model = Llama::random(LlamaConfig::tiny(32, 64, 2), 0).map_err(|e| tlt_spec_decode::Error::Target(e.to_string()))?;
/// let mut engine = Engine::new(&model, SpecParams::greedy(12))?;
/// engine.add_request(&[1, 2, 3, 1, 2])?;
/// engine.add_request(&[7])?;
/// engine.step(None, &Plan::chain(1))?; // a plain round
/// let mut ngram = NgramDrafter::default();
/// engine.run_to_completion(Some(&mut ngram), &Plan { steps: 4, top_k: 2, verify_tokens: 8 })?;
/// for f in engine.finished() {
///     assert_eq!(f.tokens.len(), 12);
///     assert_eq!(f.logprobs.len(), 12);
/// }
/// assert!(engine.counters().rounds >= 3);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Engine<T: Target> {
    target: T,
    state: T::State,
    params: SpecParams,
    stop: Vec<u32>,
    stop_strings: StopStrings,
    decoder: Option<Box<dyn TokenDecoder>>,
    verifier: Box<dyn Verifier>,
    /// Whether to let the target verify where its logits live ([`Target::forward_verify`]).
    verify_on_target: bool,
    record_hidden: bool,
    next_id: usize,
    /// The coin stream of the next request added, when keyed ([`Engine::key_streams_from`]); else its id.
    next_stream: Option<u64>,
    next_group: u64,
    live: Vec<Live>,
    finished: Vec<Finished>,
    counters: Counters,
}

impl<T: Target> Engine<T> {
    /// An engine with an empty batch.
    ///
    /// # Errors
    /// If `params` are invalid ([`SpecParams::validate`]).
    pub fn new(target: T, params: SpecParams) -> Result<Self> {
        params.validate()?;
        let state = target.new_state();
        let stop = params.stop_token_ids.clone().unwrap_or_else(|| target.eos_ids());
        let stop_strings = StopStrings::new(&params.stop);
        Ok(Self {
            target,
            state,
            params,
            stop,
            stop_strings,
            decoder: None,
            verifier: Box::new(ExactVerifier),
            verify_on_target: true,
            record_hidden: false,
            next_id: 0,
            next_stream: None,
            next_group: 0,
            live: Vec::new(),
            finished: Vec::new(),
            counters: Counters::default(),
        })
    }

    /// Replaces the acceptance rule (default [`ExactVerifier`], lossless). Any other rule changes the output
    /// distribution; use it knowingly. Rounds then verify on the host ([`Engine::verify_on_target`] is turned off).
    pub fn with_verifier(mut self, verifier: Box<dyn Verifier>) -> Self {
        self.verifier = verifier;
        self.verify_on_target = false;
        self
    }

    /// Whether rounds let the target verify where its logits live ([`Target::forward_verify`], on by default; only
    /// with the default [`ExactVerifier`], whose rule the target must apply). Off, or for a target that declines,
    /// the target returns every node's logits and the engine verifies on the host; the committed tokens are the
    /// same either way (up to rounding in the target's arithmetic).
    pub fn verify_on_target(&mut self, on: bool) {
        self.verify_on_target = on;
    }

    /// Sets the token decoder that stop strings ([`SpecParams::stop`]) are matched with.
    pub fn with_decoder(mut self, decoder: Box<dyn TokenDecoder>) -> Self {
        self.decoder = Some(decoder);
        self
    }

    /// Whether to record the target's hidden features (for `tlt_model::Llama` the final-norm state) at every
    /// position of requests added from now on, prompt included: returned in [`Finished::hidden`] and given to
    /// drafters ([`DraftContext::hidden`]). Feature-level drafters (EAGLE) need it.
    pub fn record_hidden(&mut self, on: bool) {
        self.record_hidden = on;
    }

    /// Keys the coin streams of the requests added from now on by `first`, `first + 1`, ... instead of their
    /// request ids: a request's sampled tokens depend only on the seed, its stream key and the target, so a
    /// data-parallel rank that decodes a shard of a step's requests keys them by their index in the whole step
    /// and commits exactly the tokens a single engine decoding all of them would.
    pub fn key_streams_from(&mut self, first: u64) {
        self.next_stream = Some(first);
    }

    /// The target.
    pub fn target(&self) -> &T {
        &self.target
    }

    /// The parameters.
    pub fn params(&self) -> &SpecParams {
        &self.params
    }

    /// The stop tokens in effect.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Zeroes the counters.
    pub fn reset_counters(&mut self) {
        self.counters = Counters::default();
    }

    /// Number of requests still generating.
    pub fn num_live(&self) -> usize {
        self.live.len()
    }

    /// Whether no request is generating.
    pub fn is_idle(&self) -> bool {
        self.live.is_empty()
    }

    /// Finished requests, in the order they finished.
    pub fn finished(&self) -> &[Finished] {
        &self.finished
    }

    /// Takes the finished requests out of the engine.
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Adds a request: prefills all of `prompt` but its last token, which becomes the root of its first round.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty prompt, a prompt that fills the target's context, a token
    /// outside the vocabulary, or stop strings without a decoder; [`Error::Target`] if the prefill fails.
    pub fn add_request(&mut self, prompt: &[u32]) -> Result<RequestId> {
        self.add_request_with_limit(prompt, self.params.max_new_tokens)
    }

    /// [`Engine::add_request`] with this request's own token limit instead of `params.max_new_tokens` (e.g. the
    /// long-tailed lengths of a rollout).
    ///
    /// # Errors
    /// As [`Engine::add_request`], and [`Error::InvalidArgument`] for `max_new_tokens == 0`.
    pub fn add_request_with_limit(&mut self, prompt: &[u32], max_new_tokens: usize) -> Result<RequestId> {
        self.add_request_in_group(prompt, max_new_tokens, None)
    }

    /// [`Engine::add_request_with_limit`] as a member of `group` (drafters see it in [`DraftContext::group`]).
    /// Group ids made by [`Engine::add_group`] count from 0; pick others for groups of your own.
    ///
    /// # Errors
    /// As [`Engine::add_request_with_limit`].
    pub fn add_request_in_group(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        group: Option<GroupId>,
    ) -> Result<RequestId> {
        self.check_request(prompt, max_new_tokens)?;
        let t0 = Instant::now();
        let handle = self.target.new_sequence(&mut self.state);
        let mut hidden = self.record_hidden.then(HiddenStates::default);
        if prompt.len() > 1 {
            let input = TargetInput { seq: handle, tokens: &prompt[..prompt.len() - 1], tree: None, logits: false };
            let out = self.target.forward(&mut self.state, &[input], hidden.is_some()).and_then(|out| {
                if let Some(h) = hidden.as_mut() {
                    let rows = out.hidden.as_deref().ok_or_else(|| {
                        Error::Target("the target returned no hidden states for a recording request".into())
                    })?;
                    append_hidden(h, out.hidden_size, rows)?;
                }
                Ok(())
            });
            if let Err(e) = out {
                let _ = self.target.remove(&mut self.state, handle);
                return Err(e);
            }
            self.counters.prefill_tokens += (prompt.len() - 1) as u64;
        }
        self.counters.prefill_s += t0.elapsed().as_secs_f64();
        Ok(self.push_live(handle, group, prompt, max_new_tokens, hidden))
    }

    /// Adds `n` requests answering the same `prompt` as one new group: the prompt is prefilled **once** and its
    /// state forked to the siblings when the target can fork ([`Target::fork`]; otherwise each is prefilled).
    /// Returns the group and its requests (consecutive ids).
    ///
    /// # Errors
    /// As [`Engine::add_request_with_limit`], and [`Error::InvalidArgument`] for `n == 0`.
    pub fn add_group(&mut self, prompt: &[u32], n: usize, max_new_tokens: usize) -> Result<(GroupId, Vec<RequestId>)> {
        let group = GroupId(self.next_group);
        let ids = self.add_to_group(group, prompt, n, max_new_tokens)?;
        Ok((group, ids))
    }

    /// Adds `n` requests answering `prompt` to `group` (a new one, or one with live members, as continuous batching
    /// admits a group's samples over several rounds). The prompt is prefilled at most once: the state of a live
    /// member with the same prompt is forked and rolled back to the prompt when the target can fork
    /// ([`Target::fork`], [`Target::truncate`]); otherwise the first new request is prefilled and forked to the rest.
    /// Returns the new requests (consecutive ids). Group ids from [`Engine::add_group`] count from 0 and are never
    /// reused by it afterwards.
    ///
    /// # Errors
    /// As [`Engine::add_request_with_limit`], and [`Error::InvalidArgument`] for `n == 0`.
    pub fn add_to_group(
        &mut self,
        group: GroupId,
        prompt: &[u32],
        n: usize,
        max_new_tokens: usize,
    ) -> Result<Vec<RequestId>> {
        if n == 0 {
            return Err(Error::InvalidArgument("a group needs at least one request".into()));
        }
        self.check_request(prompt, max_new_tokens)?;
        self.next_group = self.next_group.max(group.0.saturating_add(1));
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let t0 = Instant::now();
            // A live member with this prompt: its state holds the prompt's first `len - 1` tokens.
            let src = self
                .live
                .iter()
                .find(|s| s.group == Some(group) && s.history.starts_with(prompt) && s.prompt_len == prompt.len());
            let Some((handle, hidden)) = src.map(|s| (s.handle, s.hidden.clone())) else {
                ids.push(self.add_request_in_group(prompt, max_new_tokens, Some(group))?);
                continue;
            };
            match self.target.fork(&mut self.state, handle)? {
                Some(forked) => {
                    if let Err(e) = self.target.truncate(&mut self.state, forked, prompt.len() - 1) {
                        let _ = self.target.remove(&mut self.state, forked);
                        return Err(e);
                    }
                    let hidden = hidden.map(|mut h| {
                        h.truncate(prompt.len() - 1);
                        h
                    });
                    self.counters.prefill_s += t0.elapsed().as_secs_f64();
                    self.counters.prefill_forks += 1;
                    ids.push(self.push_live(forked, Some(group), prompt, max_new_tokens, hidden));
                }
                None => ids.push(self.add_request_in_group(prompt, max_new_tokens, Some(group))?),
            }
        }
        Ok(ids)
    }

    fn check_request(&self, prompt: &[u32], max_new_tokens: usize) -> Result<()> {
        if max_new_tokens == 0 {
            return Err(Error::InvalidArgument("max_new_tokens must be at least 1".into()));
        }
        if !self.stop_strings.is_empty() && self.decoder.is_none() {
            return Err(Error::InvalidArgument("stop strings need a token decoder (Engine::with_decoder)".into()));
        }
        if prompt.is_empty() {
            return Err(Error::InvalidArgument("empty prompt".into()));
        }
        if let Some(max) = self.target.max_context() {
            if prompt.len() >= max {
                return Err(Error::InvalidArgument(format!(
                    "prompt of {} tokens leaves no room in the target's context of {max}",
                    prompt.len()
                )));
            }
        }
        let vocab = self.target.vocab_size();
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!("prompt token {bad} >= vocabulary size {vocab}")));
        }
        Ok(())
    }

    fn push_live(
        &mut self,
        handle: SeqHandle,
        group: Option<GroupId>,
        prompt: &[u32],
        max_new_tokens: usize,
        hidden: Option<HiddenStates>,
    ) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let key = self.next_stream.unwrap_or(id.0 as u64);
        if let Some(k) = self.next_stream.as_mut() {
            *k = k.wrapping_add(1);
        }
        self.live.push(Live {
            id,
            group,
            admitted: false,
            handle,
            prompt_len: prompt.len(),
            history: prompt.to_vec(),
            max_new_tokens,
            logprobs: Vec::new(),
            p_max: Vec::new(),
            sd_rounds: Vec::new(),
            hidden,
            stream: SeededRng::new(self.params.seed).fork(key),
        });
        id
    }

    /// One round for every live request: draft (with `drafter`, else plain decoding), one batched target
    /// forward, verify, commit, stop checks. Does nothing when no request is live.
    ///
    /// # Errors
    /// [`Error::InvalidPlan`] for an invalid `plan` (when drafting), a drafter's error, a tree whose root is
    /// not the sequence's last token, or a target error. After an error the engine's requests are in an
    /// unspecified state.
    pub fn step(&mut self, drafter: Option<&mut (dyn Drafter + '_)>, plan: &Plan) -> Result<()> {
        match drafter {
            Some(d) => self.round(Some(d), Some(plan)),
            None => self.round(None, None),
        }
    }

    /// Lets `drafter` catch up with the live requests ([`Drafter::prepare`]) before a speculative round, so that
    /// round's time is its drafting, verification and commit only. The time counts as drafting
    /// ([`Counters::draft_s`]).
    ///
    /// # Errors
    /// The drafter's error, or a request without the hidden states a drafter needs.
    pub fn prepare_drafter(&mut self, drafter: &mut (dyn Drafter + '_)) -> Result<()> {
        if self.live.is_empty() {
            return Ok(());
        }
        self.admit_all(drafter);
        let t0 = Instant::now();
        let ctxs = self.contexts(drafter)?;
        let r = drafter.prepare(&ctxs);
        self.counters.draft_s += t0.elapsed().as_secs_f64();
        r
    }

    fn admit_all(&mut self, d: &mut (dyn Drafter + '_)) {
        for s in self.live.iter_mut().filter(|s| !s.admitted) {
            d.admit(&DraftContext {
                request: s.id,
                history: &s.history,
                prompt_len: s.prompt_len,
                hidden: s.hidden.as_ref(),
                group: s.group,
            });
            s.admitted = true;
        }
    }

    /// Every live request's context, checking that a drafter needing hidden states has them.
    fn contexts(&self, d: &(dyn Drafter + '_)) -> Result<Vec<DraftContext<'_>>> {
        if d.needs_hidden() {
            if let Some(s) = self.live.iter().find(|s| s.hidden.is_none()) {
                return Err(Error::InvalidArgument(format!(
                    "the drafter needs hidden states but request {} records none (Engine::record_hidden before \
                     add_request)",
                    s.id.0
                )));
            }
        }
        Ok(self
            .live
            .iter()
            .map(|s| DraftContext {
                request: s.id,
                history: &s.history,
                prompt_len: s.prompt_len,
                hidden: s.hidden.as_ref(),
                group: s.group,
            })
            .collect())
    }

    /// One round, the general form of [`Engine::step`]: with a `plan`, `drafter` drafts (a plan without a
    /// drafter is ignored); without one the round is plain, but a given `drafter` still sees the round's
    /// admissions, commits and releases, so a drafter that learns from committed tokens (a group drafter) stays
    /// current through plain phases.
    ///
    /// # Errors
    /// As [`Engine::step`].
    pub fn round(&mut self, mut drafter: Option<&mut (dyn Drafter + '_)>, plan: Option<&Plan>) -> Result<()> {
        if self.live.is_empty() {
            return Ok(());
        }
        if let Some(d) = drafter.as_deref_mut() {
            self.admit_all(d);
        }
        let plan = if drafter.is_some() { plan } else { None };
        if let Some(p) = plan {
            p.validate()?;
        }
        // Draft.
        let t0 = Instant::now();
        let trees = match (drafter.as_deref_mut(), plan) {
            (Some(d), Some(plan)) => {
                let ctxs = self.contexts(d)?;
                d.propose_batch(&ctxs, plan)?
            }
            _ => self.live.iter().map(|s| DraftTree::new(*s.history.last().unwrap_or(&0))).collect(),
        };
        if trees.len() != self.live.len() {
            return Err(Error::ShapeMismatch { what: "draft trees", expected: self.live.len(), got: trees.len() });
        }
        for (s, tree) in self.live.iter().zip(&trees) {
            let root = *s.history.last().unwrap_or(&0);
            if tree.root_token() != root {
                return Err(Error::InvalidTree(format!(
                    "draft for request {} is rooted at token {}, not at its last token {root}",
                    s.id.0,
                    tree.root_token()
                )));
            }
        }
        let t1 = Instant::now();
        self.counters.draft_s += (t1 - t0).as_secs_f64();

        // One batched forward.
        let tokens: Vec<Vec<u32>> = trees.iter().map(DraftTree::tokens).collect();
        let parents: Vec<Vec<Option<usize>>> = trees.iter().map(DraftTree::parents).collect();
        let inputs: Vec<TargetInput<'_>> = self
            .live
            .iter()
            .enumerate()
            .map(|(i, s)| TargetInput { seq: s.handle, tokens: &tokens[i], tree: Some(&parents[i]), logits: true })
            .collect();
        let want_hidden = self.live.iter().any(|s| s.hidden.is_some());
        let coins: Vec<Coins> =
            self.live.iter().map(|s| Coins::new(s.stream.clone(), (s.history.len() - s.prompt_len) as u64)).collect();
        let params = self.params.sampling;
        let on_target = if self.verify_on_target {
            let spec = VerifySpec { params: &params, coins: &coins };
            self.target.forward_verify(&mut self.state, &inputs, want_hidden, spec)?
        } else {
            None
        };
        let verified = match on_target {
            Some(v) => {
                if v.len() != trees.len() {
                    return Err(Error::ShapeMismatch { what: "verified inputs", expected: trees.len(), got: v.len() });
                }
                let vocab = self.target.vocab_size();
                for (v, tree) in v.iter().zip(&trees) {
                    v.check(tree, vocab, want_hidden)?;
                }
                self.counters.forward_s += t1.elapsed().as_secs_f64();
                v
            }
            None => {
                let out = self.target.forward(&mut self.state, &inputs, want_hidden)?;
                let t2 = Instant::now();
                self.counters.forward_s += (t2 - t1).as_secs_f64();
                let v = (trees.iter().zip(&coins).enumerate())
                    .map(|(i, (tree, c))| Verified::on_host(self.verifier.as_ref(), tree, &out, i, &params, c))
                    .collect::<Result<Vec<_>>>()?;
                self.counters.verify_s += t2.elapsed().as_secs_f64();
                v
            }
        };
        let t3 = Instant::now();

        // Commit.
        self.counters.rounds += 1;
        let mut done = Vec::new();
        for (i, (s, (tree, v))) in self.live.iter_mut().zip(trees.iter().zip(&verified)).enumerate() {
            let acc = &v.accepted;
            self.target.commit(&mut self.state, s.handle, &acc.path)?;
            self.counters.seq_rounds += 1;
            self.counters.drafted += (tree.len() - 1) as u64;
            self.counters.accepted += acc.accepted_drafts() as u64;
            let committed = acc.committed_tokens(tree)?;
            self.counters.committed += committed.len() as u64;
            let mut reason = None;
            let mut kept = 0;
            let round_start = (s.history.len() - s.prompt_len) as u32;
            for (k, &tok) in committed.iter().enumerate() {
                s.logprobs.push(v.logprobs[k]);
                s.p_max.push(v.p_max[k]);
                if let Some(h) = s.hidden.as_mut() {
                    let row = v.hidden_row(k).ok_or_else(|| {
                        Error::Target("the target returned no hidden states for a recording request".into())
                    })?;
                    append_hidden(h, v.hidden_size, row)?;
                }
                s.history.push(tok);
                kept += 1;
                let generated = s.history.len() - s.prompt_len;
                if self.stop.contains(&tok) {
                    reason = Some(FinishReason::Stop);
                } else if let Some(index) = match self.decoder.as_deref() {
                    Some(dec) => self.stop_strings.find(dec, &s.history[s.prompt_len..])?,
                    None => None,
                } {
                    reason = Some(FinishReason::StopString { index });
                } else if generated >= s.max_new_tokens
                    || self.target.max_context().is_some_and(|m| s.history.len() >= m)
                {
                    reason = Some(FinishReason::Length);
                }
                if reason.is_some() {
                    break;
                }
            }
            if tree.len() > 1 {
                s.sd_rounds.push((round_start, kept as u32));
            }
            if let Some(d) = drafter.as_deref_mut() {
                d.observe(s.id, &committed[..kept]);
            }
            if let Some(r) = reason {
                done.push((i, r));
            }
        }
        for &(i, reason) in done.iter().rev() {
            let s = self.live.remove(i);
            self.target.remove(&mut self.state, s.handle)?;
            if let Some(d) = drafter.as_deref_mut() {
                d.release(s.id);
            }
            self.finished.push(Finished {
                id: s.id,
                tokens: s.history[s.prompt_len..].to_vec(),
                prompt: {
                    let mut p = s.history;
                    p.truncate(s.prompt_len);
                    p
                },
                logprobs: s.logprobs,
                p_max: s.p_max,
                sd_rounds: s.sd_rounds,
                hidden: s.hidden,
                reason,
            });
        }
        // Keep finish order by request id within a round.
        let n = done.len();
        let len = self.finished.len();
        self.finished[len - n..].sort_by_key(|f| f.id);
        self.counters.commit_s += t3.elapsed().as_secs_f64();
        Ok(())
    }

    /// Runs rounds until no request is live.
    ///
    /// # Errors
    /// As [`Engine::step`].
    pub fn run_to_completion(&mut self, mut drafter: Option<&mut dyn Drafter>, plan: &Plan) -> Result<()> {
        while !self.live.is_empty() {
            match drafter {
                Some(ref mut d) => self.step(Some(&mut **d), plan)?,
                None => self.step(None, plan)?,
            }
        }
        Ok(())
    }
}
