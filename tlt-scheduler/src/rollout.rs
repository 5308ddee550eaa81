//! The rollout request queue: continuous batching driven by an abstract step callback.
//!
//! Requests arrive in groups (GRPO: `samples` completions of one prompt) and wait in one FIFO queue. Before every
//! decode step the queue admits waiting requests in submission order while the running batch is below
//! `max_running` and the step's tokens (one decode token per running request plus the prompts being prefilled)
//! fit `step_token_budget`; admission stops at the first request that does not fit, so a later request never
//! overtakes an earlier one and no request starves. The [`SdGate`] then sees the running batch and picks the
//! phase; in the speculative phase the [`BegMab`] picks the plan. The step itself is someone else's job: the
//! caller runs it (a real engine, a cost model) and reports what each request committed, whether it hit a stop
//! token, and how long the step took; the reward goes back to the bandit.
//!
//! Two ways to drive it: stepwise ([`Rollout::next_step`] / [`Rollout::complete`]), or [`Rollout::run`] with a
//! closure.
//!
//! ```
//! use tlt_scheduler::{Phase, Rollout, RolloutConfig, StepOutcome};
//! let mut r = Rollout::new(RolloutConfig::default()).unwrap();
//! r.submit_group(12, 4, 5).unwrap(); // a prompt of 12 tokens, 4 samples, at most 5 new tokens each
//! let stats = r.run(|step| -> tlt_scheduler::Result<StepOutcome> {
//!     // Commit 2 tokens per request under SD, 1 otherwise; never stop early.
//!     let n = if step.phase == Phase::Speculative { 2 } else { 1 };
//!     Ok(StepOutcome::uniform(&step.running, n, 0.01))
//! }).unwrap();
//! assert_eq!(stats.finished, 4);
//! assert_eq!(stats.committed_tokens, 20);
//! ```

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tlt_spec_decode::Plan;

use crate::error::{invalid, Error, Result};
use crate::gate::{GateConfig, Phase, SdGate};
use crate::mab::{step_reward, BegMab, Choice, MabConfig};
use crate::queue::{AdmissionLimits, AdmissionQueue};

/// [`Rollout`] settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// Most requests decoding at once (`>= 1`). Default 512 (fastrl's `max_running_requests`).
    pub max_running: usize,
    /// Most tokens one step may process: one per running request plus the prompts admitted in that step
    /// (`>= 1`). Default 16384. Speculative tree tokens are not counted: the gate only speculates on small
    /// batches.
    pub step_token_budget: usize,
    /// The SD gate.
    pub gate: GateConfig,
    /// The plan bandit.
    pub mab: MabConfig,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self { max_running: 512, step_token_budget: 16384, gate: GateConfig::default(), mab: MabConfig::default() }
    }
}

impl RolloutConfig {
    /// The admission limits.
    pub fn limits(&self) -> AdmissionLimits {
        AdmissionLimits { max_running: self.max_running, step_token_budget: self.step_token_budget }
    }

    /// Checks the limits and the nested configs.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] / [`Error::InvalidArm`].
    pub fn validate(&self) -> Result<()> {
        if self.max_running == 0 {
            return Err(invalid("rollout.max_running", "must be at least 1"));
        }
        if self.step_token_budget == 0 {
            return Err(invalid("rollout.step_token_budget", "must be at least 1"));
        }
        self.gate.validate()?;
        self.mab.validate()
    }
}

/// A request, as the scheduler names it (unique within one [`Rollout`], in submission order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// A group of requests sampled from one prompt: the engine's [`tlt_spec_decode::GroupId`], so a
/// rollout's groups and the engine's are one id space.
pub use tlt_spec_decode::GroupId;

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FinishReason {
    /// The step reported a stop (EOS or a stop string).
    Stop,
    /// It reached `max_new_tokens`.
    Length,
    /// [`Rollout::cancel`].
    Cancelled,
}

/// A finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Its group.
    pub group: GroupId,
    /// Tokens generated.
    pub generated: usize,
    /// Why it stopped.
    pub reason: FinishReason,
    /// Step index at submission (the number of steps run before it was submitted).
    pub submitted_step: u64,
    /// Step index of its first (prefill) step, `None` if cancelled while waiting.
    pub admitted_step: Option<u64>,
    /// Index of its last step (or of the next step, if cancelled).
    pub finished_step: u64,
}

/// One decode step for the caller to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// 0-based step index.
    pub index: u64,
    /// Plain or speculative.
    pub phase: Phase,
    /// `true` when this step is the first of its phase.
    pub switched: bool,
    /// The bandit's choice (speculative steps only).
    pub choice: Option<Choice>,
    /// Requests admitted at this step (to prefill first), in submission order.
    pub admitted: Vec<RequestId>,
    /// Every request in the step, admitted ones included, in admission order.
    pub running: Vec<RequestId>,
}

impl Step {
    /// The plan of a speculative step (`None` for plain steps, and for the bandit's plain arm).
    pub fn plan(&self) -> Option<Plan> {
        self.choice.filter(|c| !c.plain).map(|c| c.plan)
    }
}

/// What one request did in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestOutcome {
    /// The request.
    pub id: RequestId,
    /// Tokens committed this step (`>= 1`; more than the request may still generate is clamped).
    pub committed: usize,
    /// It produced a stop token (it finishes with [`FinishReason::Stop`]).
    pub stopped: bool,
}

/// The caller's report of a step: one entry per running request, and the step's duration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    /// Wall (or simulated) seconds of the whole step (`> 0`, finite).
    pub seconds: f64,
    /// One entry per request of [`Step::running`], any order.
    pub requests: Vec<RequestOutcome>,
}

impl StepOutcome {
    /// Every request committed `committed` tokens and none stopped.
    pub fn uniform(running: &[RequestId], committed: usize, seconds: f64) -> Self {
        Self { seconds, requests: running.iter().map(|&id| RequestOutcome { id, committed, stopped: false }).collect() }
    }
}

/// Totals of a rollout so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutStats {
    /// Steps run.
    pub steps: u64,
    /// Of which speculative.
    pub speculative_steps: u64,
    /// Gate transitions.
    pub transitions: u64,
    /// Tokens committed in all steps.
    pub committed_tokens: u64,
    /// Sum of step seconds.
    pub seconds: f64,
    /// Requests finished (any reason).
    pub finished: u64,
    /// Largest running batch seen.
    pub max_batch: usize,
}

#[derive(Debug, Clone)]
struct Req {
    group: GroupId,
    max_new_tokens: usize,
    generated: usize,
    submitted_step: u64,
    admitted_step: Option<u64>,
}

/// The queue and its decision makers; see the [module docs](self).
#[derive(Debug)]
pub struct Rollout {
    cfg: RolloutConfig,
    gate: SdGate,
    mab: BegMab,
    reqs: HashMap<RequestId, Req>,
    waiting: AdmissionQueue<RequestId>,
    running: Vec<RequestId>,
    pending: Option<Step>,
    finished: Vec<Finished>,
    groups_open: HashMap<GroupId, usize>,
    groups_done: Vec<GroupId>,
    next_id: u64,
    next_group: u64,
    stats: RolloutStats,
}

impl Rollout {
    /// An empty rollout.
    ///
    /// # Errors
    /// If `cfg` does not [validate](RolloutConfig::validate).
    pub fn new(cfg: RolloutConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            gate: SdGate::new(cfg.gate.clone())?,
            mab: BegMab::new(cfg.mab.clone())?,
            waiting: AdmissionQueue::new(cfg.limits())?,
            cfg,
            reqs: HashMap::new(),
            running: Vec::new(),
            pending: None,
            finished: Vec::new(),
            groups_open: HashMap::new(),
            groups_done: Vec::new(),
            next_id: 0,
            next_group: 0,
            stats: RolloutStats::default(),
        })
    }

    /// Queues `samples` requests for one prompt of `prompt_tokens` tokens, each generating at most
    /// `max_new_tokens`. Returns the group and its request ids. May be called between any two steps.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `samples` or `max_new_tokens` is 0; [`Error::PromptOverBudget`] if the
    /// prompt could never be admitted.
    pub fn submit_group(
        &mut self,
        prompt_tokens: usize,
        samples: usize,
        max_new_tokens: usize,
    ) -> Result<(GroupId, Vec<RequestId>)> {
        if samples == 0 {
            return Err(invalid("submit.samples", "a group needs at least one sample"));
        }
        if max_new_tokens == 0 {
            return Err(invalid("submit.max_new_tokens", "must be at least 1"));
        }
        if prompt_tokens > self.cfg.step_token_budget {
            return Err(Error::PromptOverBudget { prompt_tokens, budget: self.cfg.step_token_budget });
        }
        let group = GroupId(self.next_group);
        self.next_group += 1;
        let mut ids = Vec::with_capacity(samples);
        for _ in 0..samples {
            let id = RequestId(self.next_id);
            self.next_id += 1;
            self.waiting.submit(id, prompt_tokens)?;
            let submitted_step = self.stats.steps;
            let req = Req { group, max_new_tokens, generated: 0, submitted_step, admitted_step: None };
            self.reqs.insert(id, req);
            ids.push(id);
        }
        self.groups_open.insert(group, samples);
        Ok((group, ids))
    }

    /// Stops a waiting or running request now (between steps); it finishes with [`FinishReason::Cancelled`].
    /// Returns `false` if the id is unknown or already finished.
    ///
    /// # Errors
    /// [`Error::Protocol`] while a step is pending.
    pub fn cancel(&mut self, id: RequestId) -> Result<bool> {
        if self.pending.is_some() {
            return Err(Error::Protocol("cancel while a step is pending"));
        }
        if !self.reqs.contains_key(&id) {
            return Ok(false);
        }
        self.waiting.remove(id);
        self.running.retain(|&r| r != id);
        self.finish(id, FinishReason::Cancelled, self.stats.steps);
        Ok(true)
    }

    /// Admits what fits and returns the next step to run, or `None` when nothing is waiting or running.
    ///
    /// # Errors
    /// [`Error::Protocol`] if the previous step has not been [completed](Rollout::complete).
    pub fn next_step(&mut self) -> Result<Option<Step>> {
        if self.pending.is_some() {
            return Err(Error::Protocol("next_step before the pending step was completed"));
        }
        let admitted = self.waiting.admit(self.running.len());
        for &id in &admitted {
            if let Some(r) = self.reqs.get_mut(&id) {
                r.admitted_step = Some(self.stats.steps);
            }
            self.running.push(id);
        }
        if self.running.is_empty() {
            return Ok(None);
        }
        let batch = self.running.len();
        let d = self.gate.observe(batch);
        let choice = (d.phase == Phase::Speculative).then(|| self.mab.select(batch));
        let step = Step {
            index: self.stats.steps,
            phase: d.phase,
            switched: d.switched,
            choice,
            admitted,
            running: self.running.clone(),
        };
        self.pending = Some(step.clone());
        Ok(Some(step))
    }

    /// Applies the outcome of the pending step: commits tokens, finishes stopped and full requests, feeds the
    /// reward to the bandit. Returns the requests that finished in this step.
    ///
    /// # Errors
    /// [`Error::Protocol`] without a pending step; [`Error::InvalidOutcome`] (the step stays pending) if the
    /// outcome misses a running request, names another, repeats one, commits 0 tokens, or has a time that is not
    /// finite and positive.
    pub fn complete(&mut self, outcome: &StepOutcome) -> Result<Vec<Finished>> {
        let Some(step) = self.pending.as_ref() else {
            return Err(Error::Protocol("complete without a pending step"));
        };
        if !outcome.seconds.is_finite() || outcome.seconds <= 0.0 {
            return Err(Error::InvalidOutcome(format!("step time {} s", outcome.seconds)));
        }
        if outcome.requests.len() != step.running.len() {
            return Err(Error::InvalidOutcome(format!(
                "{} results for {} running requests",
                outcome.requests.len(),
                step.running.len()
            )));
        }
        let mut seen = std::collections::HashSet::with_capacity(step.running.len());
        for o in &outcome.requests {
            if o.committed == 0 {
                return Err(Error::InvalidOutcome(format!("request {:?} committed no token", o.id)));
            }
            // Running = admitted and not finished (finished requests leave `reqs`).
            let running = self.reqs.get(&o.id).is_some_and(|r| r.admitted_step.is_some());
            if !running || !seen.insert(o.id) {
                return Err(Error::InvalidOutcome(format!("request {:?} is not running or repeated", o.id)));
            }
        }
        let Some(step) = self.pending.take() else {
            return Err(Error::Protocol("complete without a pending step"));
        };
        let mut committed_total = 0usize;
        let mut done = Vec::new();
        for o in &outcome.requests {
            let Some(r) = self.reqs.get_mut(&o.id) else { continue };
            let take = o.committed.min(r.max_new_tokens - r.generated);
            r.generated += take;
            committed_total += take;
            if o.stopped {
                done.push((o.id, FinishReason::Stop));
            } else if r.generated >= r.max_new_tokens {
                done.push((o.id, FinishReason::Length));
            }
        }
        if let Some(c) = &step.choice {
            let accept = committed_total as f64 / step.running.len() as f64;
            // Validated above: finite, positive time; the reward is then finite and non-negative.
            self.mab.record(c, step_reward(accept, step.running.len(), outcome.seconds))?;
        }
        let s = &mut self.stats;
        s.steps += 1;
        s.speculative_steps += u64::from(step.phase == Phase::Speculative);
        s.transitions = self.gate.transitions();
        s.committed_tokens += committed_total as u64;
        s.seconds += outcome.seconds;
        s.max_batch = s.max_batch.max(step.running.len());
        let mut finished = Vec::with_capacity(done.len());
        if !done.is_empty() {
            let gone: std::collections::HashSet<RequestId> = done.iter().map(|d| d.0).collect();
            self.running.retain(|r| !gone.contains(r));
            // Report in admission order.
            done.sort_by_key(|d| step.running.iter().position(|r| *r == d.0));
            for (id, reason) in done {
                if let Some(f) = self.finish(id, reason, step.index) {
                    finished.push(f);
                }
            }
        }
        Ok(finished)
    }

    /// Runs steps until nothing is waiting or running, calling `step_fn` for each.
    ///
    /// # Errors
    /// The first error of `step_fn` or of [`Rollout::complete`].
    pub fn run<E: From<Error>>(
        &mut self,
        mut step_fn: impl FnMut(&Step) -> std::result::Result<StepOutcome, E>,
    ) -> std::result::Result<RolloutStats, E> {
        while let Some(step) = self.next_step()? {
            let out = step_fn(&step)?;
            self.complete(&out)?;
        }
        Ok(self.stats.clone())
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason, step: u64) -> Option<Finished> {
        let r = self.reqs.remove(&id)?;
        let f = Finished {
            id,
            group: r.group,
            generated: r.generated,
            reason,
            submitted_step: r.submitted_step,
            admitted_step: r.admitted_step,
            finished_step: step,
        };
        self.finished.push(f);
        self.stats.finished += 1;
        if let Some(open) = self.groups_open.get_mut(&r.group) {
            *open -= 1;
            if *open == 0 {
                self.groups_open.remove(&r.group);
                self.groups_done.push(r.group);
            }
        }
        Some(f)
    }

    /// Every finished request so far, in finishing order.
    pub fn finished(&self) -> &[Finished] {
        &self.finished
    }

    /// Groups whose every sample has finished, in completion order.
    pub fn groups_done(&self) -> &[GroupId] {
        &self.groups_done
    }

    /// Requests waiting for admission.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests running.
    pub fn running(&self) -> &[RequestId] {
        &self.running
    }

    /// Nothing waiting, running or pending.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.pending.is_none()
    }

    /// Totals so far.
    pub fn stats(&self) -> &RolloutStats {
        &self.stats
    }

    /// The gate (its phase, transitions).
    pub fn gate(&self) -> &SdGate {
        &self.gate
    }

    /// The bandit (its medians).
    pub fn mab(&self) -> &BegMab {
        &self.mab
    }

    /// The configuration.
    pub fn config(&self) -> &RolloutConfig {
        &self.cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tlt_kernels::SplitMix64;

    fn small(max_running: usize, budget: usize) -> RolloutConfig {
        RolloutConfig {
            max_running,
            step_token_budget: budget,
            gate: GateConfig { threshold: 2, on_after: 2, off_threshold: 3, off_after: 1 },
            ..Default::default()
        }
    }

    #[test]
    fn admission_respects_limits_and_groups_complete() {
        let mut r = Rollout::new(small(3, 25)).unwrap();
        let (g0, ids0) = r.submit_group(10, 2, 3).unwrap();
        let (g1, _) = r.submit_group(10, 2, 1).unwrap();
        let s = r.next_step().unwrap().unwrap();
        // 10 + 10 fit, the third prompt would need 30 > 25.
        assert_eq!(s.admitted, ids0);
        assert!(r.next_step().is_err(), "two steps at once");
        r.complete(&StepOutcome::uniform(&s.running, 1, 0.1)).unwrap();
        let s = r.next_step().unwrap().unwrap();
        // 2 decode tokens + 10 = 12 fit, the next 10 more would make 22 <= 25, but max_running is 3.
        assert_eq!(s.admitted.len(), 1);
        assert_eq!(s.running.len(), 3);
        let mut out = StepOutcome::uniform(&s.running, 1, 0.1);
        out.requests[0].stopped = true;
        let fin = r.complete(&out).unwrap();
        assert_eq!(fin.len(), 2, "the stopped one and the 1-token one of group 1");
        assert_eq!(fin[0].reason, FinishReason::Stop);
        assert_eq!(fin[1].reason, FinishReason::Length);
        let stats = r.run(|s| -> Result<StepOutcome> { Ok(StepOutcome::uniform(&s.running, 5, 0.1)) }).unwrap();
        assert_eq!(stats.finished, 4);
        assert!(r.is_idle());
        let mut done = r.groups_done().to_vec();
        done.sort();
        assert_eq!(done, [g0, g1]);
        assert!(r.finished().iter().all(|f| f.generated <= 3));
    }

    #[test]
    fn bad_outcomes_are_rejected_and_step_stays_pending() {
        let mut r = Rollout::new(small(4, 100)).unwrap();
        r.submit_group(1, 2, 4).unwrap();
        assert!(r.complete(&StepOutcome::uniform(&[], 1, 0.1)).is_err());
        let s = r.next_step().unwrap().unwrap();
        assert!(r.complete(&StepOutcome::uniform(&s.running, 0, 0.1)).is_err());
        assert!(r.complete(&StepOutcome::uniform(&s.running, 1, f64::NAN)).is_err());
        assert!(r.complete(&StepOutcome::uniform(&s.running[..1], 1, 0.1)).is_err());
        assert!(r.complete(&StepOutcome::uniform(&[s.running[0], s.running[0]], 1, 0.1)).is_err());
        assert!(r.complete(&StepOutcome::uniform(&[RequestId(99), s.running[0]], 1, 0.1)).is_err());
        assert!(r.cancel(s.running[0]).is_err());
        r.complete(&StepOutcome::uniform(&s.running, 1, 0.1)).unwrap();
        assert!(r.cancel(s.running[0]).unwrap());
        assert!(!r.cancel(s.running[0]).unwrap());
        assert!(matches!(r.submit_group(101, 1, 1), Err(Error::PromptOverBudget { .. })));
        assert!(r.submit_group(1, 0, 1).is_err());
        assert!(r.submit_group(1, 1, 0).is_err());
    }

    #[test]
    fn gate_turns_sd_on_in_the_tail_and_bandit_gets_rewards() {
        let mut r = Rollout::new(small(8, 1000)).unwrap();
        for len in [1, 2, 4, 8, 16, 32] {
            r.submit_group(4, 1, len).unwrap();
        }
        let mut phases = Vec::new();
        r.run(|s| -> Result<StepOutcome> {
            phases.push((s.running.len(), s.phase, s.plan().map(|p| p.verify_tokens)));
            Ok(StepOutcome::uniform(&s.running, 1, 0.01))
        })
        .unwrap();
        assert_eq!(phases[0], (6, Phase::Plain, None));
        assert!(phases.iter().any(|p| p.1 == Phase::Speculative));
        assert!(phases.iter().filter(|p| p.0 > 3).all(|p| p.1 == Phase::Plain));
        // The last steps run one request: the 48-token bucket.
        assert_eq!(phases.last().unwrap().2, Some(48));
        assert!(r.mab().score(0).is_some());
    }

    proptest! {
        /// No request starves: with groups arriving during the run, random prompt lengths, commits and stops,
        /// every request is admitted in submission order and finishes, within sum(max_new_tokens) steps.
        #[test]
        fn no_request_starves(
            max_running in 1usize..12,
            budget in 1usize..200,
            groups in proptest::collection::vec((0usize..400, 1usize..6, 1usize..40, 0u64..30), 1..25),
            seed in any::<u64>(),
        ) {
            let mut r = Rollout::new(small(max_running, budget)).unwrap();
            let mut rng = SplitMix64::new(seed);
            let mut arrivals: Vec<_> = groups.into_iter().map(|(p, s, m, at)| (at, p % budget + 1, s, m)).collect();
            arrivals.sort_by_key(|a| a.0);
            let total: usize = arrivals.iter().map(|a| a.2).sum();
            let bound: u64 = arrivals.iter().map(|a| (a.2 * a.3) as u64).sum::<u64>() + 30;
            let mut next = 0;
            let mut admitted_order = Vec::new();
            loop {
                while next < arrivals.len() && arrivals[next].0 <= r.stats().steps {
                    let (_, p, s, m) = arrivals[next];
                    r.submit_group(p, s, m).unwrap();
                    next += 1;
                }
                match r.next_step().unwrap() {
                    Some(step) => {
                        admitted_order.extend(step.admitted.iter().copied());
                        prop_assert!(step.running.len() <= max_running);
                        let reqs = step.running.iter().map(|&id| RequestOutcome {
                            id, committed: 1 + rng.below(4), stopped: rng.below(20) == 0,
                        }).collect();
                        r.complete(&StepOutcome { seconds: 0.01, requests: reqs }).unwrap();
                    }
                    None if next < arrivals.len() => {
                        // Idle until the next arrival: let time pass.
                        let at = arrivals[next].0;
                        let (_, p, s, m) = arrivals[next];
                        r.submit_group(p, s, m).unwrap();
                        next += 1;
                        let _ = at;
                    }
                    None => break,
                }
                prop_assert!(r.stats().steps <= bound, "ran {} steps, bound {}", r.stats().steps, bound);
            }
            prop_assert_eq!(r.finished().len(), total);
            prop_assert!(admitted_order.windows(2).all(|w| w[0] < w[1]), "FIFO admission");
            prop_assert_eq!(admitted_order.len(), total);
        }
    }
}
