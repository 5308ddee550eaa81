//! The bounded buffer of rollout samples that online drafter training draws from.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tlt_kernels::SeededRng;
use tlt_spec_decode::{Finished, HiddenStates};

use crate::{Error, Result};

/// One rollout sequence for drafter training: its tokens and the target's features at every fed position.
#[derive(Debug, Clone, PartialEq)]
pub struct FeatureSample {
    /// Prompt followed by the response.
    pub tokens: Vec<u32>,
    /// The target's features, `tokens.len() - 1` rows: row `t` is the feature at position `t` (EAGLE's `h_t`,
    /// paired with `x_{t+1}`), as the engine records them, tokens committed in speculative rounds included.
    pub hidden: HiddenStates,
    /// Index in `tokens` of the first response token: training positions are those predicting a response token.
    pub response_start: usize,
    /// The RL step whose rollout produced it.
    pub rl_step: u64,
}

impl FeatureSample {
    /// Greedy responses of `target` to `prompts` (`batch` at a time, up to `new_tokens` each, EOS stops) with the
    /// taps of `Tap::eagle3` recorded (rows of 4H: three aux layers, then the final norm, which both drafter kinds
    /// train on), as samples in prompt order; `progress` is called with the number of prompts done after each batch.
    ///
    /// # Errors
    /// If the engine or a sample fails.
    pub fn greedy_rollouts(
        target: &tlt_model::Llama,
        prompts: &[Vec<u32>],
        new_tokens: usize,
        batch: usize,
        mut progress: impl FnMut(usize),
    ) -> Result<Vec<FeatureSample>> {
        use tlt_spec_decode::{Engine, Plan, SpecParams, TappedLlama};
        let taps = tlt_model::Tap::eagle3(target.config().num_hidden_layers);
        let mut out = Vec::with_capacity(prompts.len());
        for chunk in prompts.chunks(batch.max(1)) {
            let mut e = Engine::new(TappedLlama { model: target, taps: &taps }, SpecParams::greedy(new_tokens))?;
            e.record_hidden(true);
            for p in chunk {
                e.add_request(p)?;
            }
            e.run_to_completion(None, &Plan::chain(1))?;
            let mut fin = e.take_finished();
            fin.sort_by_key(|f| f.id);
            for f in &fin {
                out.push(FeatureSample::from_finished(f, 0)?);
            }
            progress(out.len());
        }
        Ok(out)
    }

    /// A sample from a finished engine request that recorded hidden states.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the request recorded no hidden states or their rows do not match.
    pub fn from_finished(f: &Finished, rl_step: u64) -> Result<Self> {
        let hidden = f.hidden.clone().ok_or_else(|| {
            Error::InvalidArgument("the request recorded no hidden states (Engine::record_hidden)".into())
        })?;
        let tokens: Vec<u32> = f.prompt.iter().chain(&f.tokens).copied().collect();
        let s = Self { tokens, hidden, response_start: f.prompt.len(), rl_step };
        s.validate()?;
        Ok(s)
    }

    /// Checks `hidden.len() == tokens.len() - 1` and `1 <= response_start <= tokens.len()`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the mismatch.
    pub fn validate(&self) -> Result<()> {
        if self.tokens.len() < 2 || self.hidden.len() + 1 != self.tokens.len() {
            return Err(Error::InvalidArgument(format!(
                "sample of {} tokens has {} hidden rows (want tokens - 1, at least 1)",
                self.tokens.len(),
                self.hidden.len()
            )));
        }
        if self.response_start == 0 || self.response_start > self.tokens.len() {
            return Err(Error::InvalidArgument(format!(
                "response_start {} outside 1..={}",
                self.response_start,
                self.tokens.len()
            )));
        }
        Ok(())
    }

    /// Number of training positions (positions predicting a response token).
    pub fn train_positions(&self) -> usize {
        self.tokens.len() - self.response_start
    }

    /// Bytes it holds: its tokens and its feature rows (4 bytes a value).
    pub fn bytes(&self) -> usize {
        4 * (self.tokens.len() + self.hidden.len() * self.hidden.width())
    }
}

/// Limits of an [`OnlineBuffer`] (TLT keeps the last 2 RL steps, at most a few thousand samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BufferConfig {
    /// Most samples held; the oldest go first. Default 2000.
    pub max_samples: usize,
    /// Samples of the last this many RL steps are kept (`>= 1`). Default 2.
    pub keep_steps: u64,
    /// Most tokens held (prompts and responses, every sample's); the oldest go first, and a longer sample is
    /// dropped. Default `None`: unbounded.
    pub max_tokens: Option<usize>,
    /// Most bytes held ([`FeatureSample::bytes`]: tokens and feature rows); the oldest go first, and a larger sample
    /// is dropped. Default `None`: unbounded.
    pub max_bytes: Option<usize>,
}

impl Default for BufferConfig {
    fn default() -> Self {
        Self { max_samples: 2000, keep_steps: 2, max_tokens: None, max_bytes: None }
    }
}

impl BufferConfig {
    /// Whether `tokens` and `bytes` exceed the token or byte limit.
    fn over(&self, tokens: usize, bytes: usize) -> bool {
        self.max_tokens.is_some_and(|m| tokens > m) || self.max_bytes.is_some_and(|m| bytes > m)
    }

    /// Checks both limits are positive.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.max_samples == 0 || self.keep_steps == 0 || self.max_tokens == Some(0) || self.max_bytes == Some(0) {
            return Err(Error::InvalidArgument(format!("buffer limits must be positive: {self:?}")));
        }
        Ok(())
    }
}

/// Lifetime counts of an [`OnlineBuffer`]: `pushed == held + evicted` always.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BufferStats {
    /// Samples ever pushed.
    pub pushed: u64,
    /// Samples dropped (over capacity or too old).
    pub evicted: u64,
    /// Samples held now.
    pub held: usize,
    /// Training positions held now.
    pub held_positions: usize,
    /// Tokens held now.
    pub held_tokens: usize,
    /// Bytes held now ([`FeatureSample::bytes`]).
    pub held_bytes: usize,
}

/// The contents of an [`OnlineBuffer`] ([`OnlineBuffer::parts`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BufferParts {
    /// `(id, sample)`, oldest first.
    pub items: Vec<(u64, Arc<FeatureSample>)>,
    /// The id the next push gets (= samples ever pushed).
    pub next_id: u64,
    /// The RL step last entered.
    pub step: u64,
    /// Samples dropped so far.
    pub evicted: u64,
}

#[derive(Debug, Default)]
struct Inner {
    items: VecDeque<(u64, Arc<FeatureSample>)>,
    next_id: u64,
    step: u64,
    evicted: u64,
    positions: usize,
    tokens: usize,
    bytes: usize,
}

impl Inner {
    /// Whether the held samples are within `cfg`'s limits.
    fn within(&self, cfg: &BufferConfig) -> bool {
        self.items.len() <= cfg.max_samples && !cfg.over(self.tokens, self.bytes)
    }

    fn add(&mut self, s: &FeatureSample) {
        self.positions += s.train_positions();
        self.tokens += s.tokens.len();
        self.bytes += s.bytes();
    }

    fn sub(&mut self, s: &FeatureSample) {
        self.positions -= s.train_positions();
        self.tokens -= s.tokens.len();
        self.bytes -= s.bytes();
    }
}

/// A thread-safe, bounded FIFO of rollout [`FeatureSample`]s: rollout threads push, the trainer draws. Each sample gets
/// a unique, increasing id.
#[derive(Debug)]
pub struct OnlineBuffer {
    cfg: BufferConfig,
    inner: Mutex<Inner>,
}

impl OnlineBuffer {
    /// An empty buffer.
    ///
    /// # Errors
    /// If `cfg` is invalid.
    pub fn new(cfg: BufferConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg, inner: Mutex::new(Inner::default()) })
    }

    /// The limits.
    pub fn config(&self) -> &BufferConfig {
        &self.cfg
    }

    /// Adds a sample (evicting the oldest while a limit is exceeded) and returns its id. A sample over the token or
    /// byte limit by itself is dropped at once (counted as evicted).
    ///
    /// # Errors
    /// If the sample is malformed ([`FeatureSample::validate`]).
    pub fn push(&self, sample: FeatureSample) -> Result<u64> {
        sample.validate()?;
        let mut g = self.inner.lock();
        let id = g.next_id;
        g.next_id += 1;
        if self.cfg.over(sample.tokens.len(), sample.bytes()) {
            g.evicted += 1;
            return Ok(id);
        }
        g.add(&sample);
        g.items.push_back((id, Arc::new(sample)));
        while !g.within(&self.cfg) {
            Self::pop_front(&mut g);
        }
        Ok(id)
    }

    fn pop_front(g: &mut Inner) {
        if let Some((_, s)) = g.items.pop_front() {
            g.sub(&s);
            g.evicted += 1;
        }
    }

    /// Enters RL step `step`: drops samples older than the last `keep_steps` steps (`rl_step + keep_steps <=
    /// step`).
    pub fn set_step(&self, step: u64) {
        let mut g = self.inner.lock();
        g.step = step;
        let keep = self.cfg.keep_steps;
        let before = g.items.len();
        let (kept, gone): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut g.items).into_iter().partition(|(_, s)| s.rl_step + keep > step);
        for (_, s) in &gone {
            g.sub(s);
        }
        g.items = kept;
        g.evicted += (before - g.items.len()) as u64;
    }

    /// `n` samples drawn uniformly with replacement (empty when the buffer is).
    pub fn sample(&self, n: usize, rng: &mut SeededRng) -> Vec<(u64, Arc<FeatureSample>)> {
        let g = self.inner.lock();
        if g.items.is_empty() {
            return Vec::new();
        }
        (0..n)
            .map(|_| {
                let i = ((rng.uniform() * g.items.len() as f64) as usize).min(g.items.len() - 1);
                g.items[i].clone()
            })
            .collect()
    }

    /// Ids of the samples held, oldest first.
    pub fn ids(&self) -> Vec<u64> {
        self.inner.lock().items.iter().map(|(id, _)| *id).collect()
    }

    /// Everything the buffer holds, for a checkpoint ([`super::persist`]).
    pub(crate) fn parts(&self) -> BufferParts {
        let g = self.inner.lock();
        BufferParts { items: g.items.iter().cloned().collect(), next_id: g.next_id, step: g.step, evicted: g.evicted }
    }

    /// A buffer holding `parts` (a checkpoint's), checked: ids increasing and below `next_id`, samples valid and
    /// within the limits.
    pub(crate) fn from_parts(cfg: BufferConfig, parts: BufferParts) -> Result<Self> {
        let b = Self::new(cfg)?;
        if parts.items.len() > cfg.max_samples {
            return Err(Error::InvalidArgument(format!(
                "{} samples exceed the buffer's {}",
                parts.items.len(),
                cfg.max_samples
            )));
        }
        let mut held = Inner::default();
        let mut last = None;
        for (id, s) in &parts.items {
            s.validate()?;
            if last.is_some_and(|l| l >= *id) || *id >= parts.next_id {
                return Err(Error::InvalidArgument(format!(
                    "sample id {id} out of order or not below {}",
                    parts.next_id
                )));
            }
            last = Some(*id);
            held.add(s);
        }
        if cfg.over(held.tokens, held.bytes) {
            return Err(Error::InvalidArgument(format!(
                "{} tokens and {} bytes exceed the buffer's {:?} and {:?}",
                held.tokens, held.bytes, cfg.max_tokens, cfg.max_bytes
            )));
        }
        if parts.evicted + parts.items.len() as u64 != parts.next_id {
            return Err(Error::InvalidArgument(format!(
                "{} held + {} evicted is not the {} pushed",
                parts.items.len(),
                parts.evicted,
                parts.next_id
            )));
        }
        *b.inner.lock() = Inner {
            items: parts.items.into(),
            next_id: parts.next_id,
            step: parts.step,
            evicted: parts.evicted,
            ..held
        };
        Ok(b)
    }

    /// Lifetime counts.
    pub fn stats(&self) -> BufferStats {
        let g = self.inner.lock();
        BufferStats {
            pushed: g.next_id,
            evicted: g.evicted,
            held: g.items.len(),
            held_positions: g.positions,
            held_tokens: g.tokens,
            held_bytes: g.bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize, step: u64) -> FeatureSample {
        FeatureSample {
            tokens: (0..len as u32).collect(),
            hidden: HiddenStates::from_flat(2, vec![0.5; 2 * (len - 1)]).unwrap(),
            response_start: 1,
            rl_step: step,
        }
    }

    #[test]
    fn bounded_in_tokens_and_bytes() {
        // Samples of 4 tokens and 3 rows of width 2: 16 + 24 = 40 bytes each.
        assert_eq!(sample(4, 0).bytes(), 40);
        let by_tokens = BufferConfig { max_tokens: Some(10), ..BufferConfig::default() };
        let b = OnlineBuffer::new(by_tokens).unwrap();
        for _ in 0..5 {
            b.push(sample(4, 0)).unwrap();
        }
        assert_eq!(b.ids(), vec![3, 4]);
        let s = b.stats();
        assert_eq!((s.held_tokens, s.held_bytes, s.pushed, s.evicted), (8, 80, 5, 3));
        // One sample over the limit by itself is dropped, the others stay.
        b.push(sample(11, 0)).unwrap();
        assert_eq!(b.ids(), vec![3, 4]);
        assert_eq!(b.stats().evicted, 4);
        let by_bytes = BufferConfig { max_bytes: Some(100), ..BufferConfig::default() };
        let b = OnlineBuffer::new(by_bytes).unwrap();
        for _ in 0..4 {
            b.push(sample(4, 0)).unwrap();
        }
        assert_eq!(b.ids(), vec![2, 3]);
        assert_eq!(b.stats().held_bytes, 80);
        b.set_step(5);
        assert_eq!((b.stats().held_tokens, b.stats().held_bytes), (0, 0));
        assert!(OnlineBuffer::new(BufferConfig { max_bytes: Some(0), ..BufferConfig::default() }).is_err());
    }

    #[test]
    fn bounded_fifo_with_step_window() {
        let b = OnlineBuffer::new(BufferConfig { max_samples: 3, keep_steps: 2, ..BufferConfig::default() }).unwrap();
        for i in 0..5 {
            assert_eq!(b.push(sample(4, i / 2)).unwrap(), i);
        }
        assert_eq!(b.ids(), vec![2, 3, 4]);
        assert_eq!(
            b.stats(),
            BufferStats { pushed: 5, evicted: 2, held: 3, held_positions: 9, held_tokens: 12, held_bytes: 120 }
        );
        b.set_step(2); // keeps steps 1 and 2: samples 2, 3 (step 1) and 4 (step 2)
        assert_eq!(b.ids(), vec![2, 3, 4]);
        b.set_step(3); // keeps step 2 only
        assert_eq!(b.ids(), vec![4]);
        let st = b.stats();
        assert_eq!(st.pushed, st.held as u64 + st.evicted);
        let mut rng = SeededRng::new(1);
        assert!(b.sample(5, &mut rng).iter().all(|(id, _)| *id == 4));
    }

    #[test]
    fn malformed_samples_and_configs_are_rejected() {
        let b = OnlineBuffer::new(BufferConfig::default()).unwrap();
        let mut s = sample(4, 0);
        s.response_start = 9;
        assert!(matches!(b.push(s), Err(Error::InvalidArgument(_))));
        let mut s = sample(4, 0);
        s.tokens.push(1);
        assert!(b.push(s).is_err());
        assert!(OnlineBuffer::new(BufferConfig { max_samples: 0, keep_steps: 1, ..BufferConfig::default() }).is_err());
        assert!(b.sample(3, &mut SeededRng::new(0)).is_empty());
    }
}
