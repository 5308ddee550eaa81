//! Continuous-batching admission: one FIFO queue of requests waiting for a place in the running batch.
//!
//! Before every step, waiting requests are admitted in submission order while the running batch is below
//! `max_running` and the step's tokens (one decode token per running request plus the prompts admitted in that
//! step) fit `step_token_budget` (SGLang's `max_running_requests` and `max_prefill_tokens`, vLLM's `max_num_seqs`
//! and `max_num_batched_tokens`). Admission stops at the first request that does not fit, so a later request never
//! overtakes an earlier one and none starves. Used by [`Rollout`](crate::Rollout) (the simulator's queue) and by
//! the trainer's real rollouts.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Error, Result};

/// The limits of a running batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionLimits {
    /// Most requests decoding at once (`>= 1`). Default 512 (fastrl's `max_running_requests`).
    pub max_running: usize,
    /// Most tokens one step may process: one per running request plus the prompts admitted in that step (`>= 1`).
    /// Default 16384.
    pub step_token_budget: usize,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self { max_running: 512, step_token_budget: 16384 }
    }
}

impl AdmissionLimits {
    /// Checks both limits.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a zero limit.
    pub fn validate(&self) -> Result<()> {
        if self.max_running == 0 {
            return Err(invalid("max_running", "must be at least 1"));
        }
        if self.step_token_budget == 0 {
            return Err(invalid("step_token_budget", "must be at least 1"));
        }
        Ok(())
    }
}

/// The FIFO of waiting requests, keyed by the caller's ids.
#[derive(Debug, Clone)]
pub struct AdmissionQueue<K> {
    limits: AdmissionLimits,
    waiting: VecDeque<(K, usize)>,
}

impl<K: Copy + PartialEq> AdmissionQueue<K> {
    /// An empty queue.
    ///
    /// # Errors
    /// If `limits` do not [validate](AdmissionLimits::validate).
    pub fn new(limits: AdmissionLimits) -> Result<Self> {
        limits.validate()?;
        Ok(Self { limits, waiting: VecDeque::new() })
    }

    /// Queues request `id` with a prompt of `prompt_tokens` tokens.
    ///
    /// # Errors
    /// [`Error::PromptOverBudget`] if the prompt could never be admitted.
    pub fn submit(&mut self, id: K, prompt_tokens: usize) -> Result<()> {
        if prompt_tokens > self.limits.step_token_budget {
            return Err(Error::PromptOverBudget { prompt_tokens, budget: self.limits.step_token_budget });
        }
        self.waiting.push_back((id, prompt_tokens));
        Ok(())
    }

    /// Admits what fits beside `running` requests, in submission order.
    pub fn admit(&mut self, running: usize) -> Vec<K> {
        let mut admitted = Vec::new();
        let mut tokens = running;
        while let Some(&(id, prompt)) = self.waiting.front() {
            if running + admitted.len() >= self.limits.max_running || tokens + prompt > self.limits.step_token_budget {
                break;
            }
            self.waiting.pop_front();
            tokens += prompt;
            admitted.push(id);
        }
        admitted
    }

    /// Drops a waiting request; `false` if it is not waiting.
    pub fn remove(&mut self, id: K) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|w| w.0 != id);
        self.waiting.len() != before
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The limits.
    pub fn limits(&self) -> AdmissionLimits {
        self.limits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn limits_and_order() {
        let mut q = AdmissionQueue::new(AdmissionLimits { max_running: 3, step_token_budget: 25 }).unwrap();
        for (id, p) in [(0, 10), (1, 10), (2, 4), (3, 1)] {
            q.submit(id, p).unwrap();
        }
        // 0 + 10 + 10 fits 25; request 2 (4 more tokens) does too, then max_running stops 3.
        assert_eq!(q.admit(0), vec![0, 1, 2]);
        assert_eq!(q.admit(3), Vec::<i32>::new());
        // Two running: one place, 2 + 1 tokens.
        assert_eq!(q.admit(2), vec![3]);
        assert!(q.is_empty());
        assert!(matches!(q.submit(9, 26), Err(Error::PromptOverBudget { .. })));
        assert!(AdmissionQueue::<u8>::new(AdmissionLimits { max_running: 0, step_token_budget: 1 }).is_err());
    }

    #[test]
    fn a_large_prompt_blocks_later_ones() {
        let mut q = AdmissionQueue::new(AdmissionLimits { max_running: 20, step_token_budget: 20 }).unwrap();
        q.submit('a', 15).unwrap();
        q.submit('b', 1).unwrap();
        // 10 running: 10 + 15 > 20, and b must not overtake a.
        assert!(q.admit(10).is_empty());
        assert!(q.remove('a'));
        assert!(!q.remove('a'));
        assert_eq!(q.admit(10), vec!['b']);
    }

    proptest! {
        /// Admission is a prefix of the waiting order, within both limits.
        #[test]
        fn admits_a_prefix_within_limits(
            prompts in proptest::collection::vec(1usize..50, 0..40),
            running in 0usize..20,
            max_running in 1usize..30,
            budget in 50usize..400,
        ) {
            let mut q = AdmissionQueue::new(AdmissionLimits { max_running, step_token_budget: budget }).unwrap();
            for (i, &p) in prompts.iter().enumerate() {
                q.submit(i, p).unwrap();
            }
            let got = q.admit(running);
            prop_assert_eq!(&got, &(0..got.len()).collect::<Vec<_>>());
            prop_assert!(got.is_empty() || running + got.len() <= max_running);
            let tokens: usize = running + got.iter().map(|&i| prompts[i]).sum::<usize>();
            prop_assert!(got.is_empty() || tokens <= budget);
            // Maximal: the next one would not fit.
            if let Some(&next) = prompts.get(got.len()) {
                prop_assert!(running + got.len() >= max_running || tokens + next > budget);
            }
        }
    }
}
