//! The adaptor that drives a [`tlt_spec_decode::Engine`] with the [`SdGate`] and the [`BegMab`]: before every
//! round the gate sees the running batch; in the speculative phase the bandit picks the plan and is rewarded
//! with the committed tokens per second of that round. Everything it decided is kept in a [`DecodeTrace`].
//!
//! ```
//! use tlt_scheduler::{AdaptiveDecoder, GateConfig, MabConfig};
//! use tlt_spec_decode::{Engine, NgramDrafter, SpecParams, ToyTarget};
//!
//! let model = ToyTarget::new(32, 0);
//! let mut engine = Engine::new(&model, SpecParams::greedy(16)).unwrap();
//! engine.add_request(&[1, 2, 3, 1, 2]).unwrap();
//! let mut decoder = AdaptiveDecoder::new(GateConfig::default(), MabConfig::default()).unwrap();
//! let mut ngram = NgramDrafter::default();
//! decoder.run(&mut engine, Some(&mut ngram as &mut dyn tlt_spec_decode::Drafter)).unwrap();
//! let trace = decoder.take_trace();
//! assert_eq!(trace.steps as usize, trace.active.len());
//! assert_eq!(trace.round_seconds.len(), trace.active.len());
//! assert!(trace.sd_steps > 0); // one request is below the default threshold
//! ```

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tlt_spec_decode::{Drafter, Engine, Target};

use crate::error::Result;
use crate::gate::{GateConfig, GateState, Phase, SdGate};
use crate::mab::{BegMab, MabConfig, MabState};

/// What an [`AdaptiveDecoder`] did, round by round.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DecodeTrace {
    /// Rounds run.
    pub steps: u64,
    /// Speculative rounds.
    pub sd_steps: u64,
    /// Wall seconds of all rounds (prefill included, as the engine does it inside its first round).
    pub seconds: f64,
    /// Wall seconds of speculative rounds.
    pub sd_seconds: f64,
    /// Running requests before each round.
    pub active: Vec<usize>,
    /// Wall seconds of each round (aligned with [`Self::active`]).
    #[serde(default)]
    pub round_seconds: Vec<f64>,
    /// Tokens committed in each round, all requests together, before stop truncation (aligned with
    /// [`Self::active`]).
    #[serde(default)]
    pub round_tokens: Vec<u64>,
    /// Mean tokens committed per request in each speculative round.
    pub accept_lens: Vec<f64>,
    /// Arms chosen, as `"steps:top_k:verify_tokens"` (prefixed `"kind/"` with named drafter kinds) -> rounds.
    pub arms: BTreeMap<String, u64>,
    /// Rounds in the speculative phase where the bandit chose its plain arm (counted as plain rounds).
    pub plain_arm_steps: u64,
    /// Seconds the drafter spent catching up before speculative rounds ([`Engine::prepare_drafter`]), inside
    /// the rounds' wall time but outside the bandit's measurement of its arms.
    #[serde(default)]
    pub prepare_seconds: f64,
}

impl DecodeTrace {
    /// Share of the rounds' wall time spent in rounds that started with at most `batch` running requests (the
    /// tail phase below a gate threshold of `batch`; 0 without rounds).
    pub fn tail_share(&self, batch: usize) -> f64 {
        let all: f64 = self.round_seconds.iter().sum();
        let tail: f64 = self.active.iter().zip(&self.round_seconds).filter(|&(&a, _)| a <= batch).map(|(_, s)| s).sum();
        if all > 0.0 {
            tail / all
        } else {
            0.0
        }
    }

    /// Fraction of rounds that speculated (0 without rounds).
    pub fn sd_fraction(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.sd_steps as f64 / self.steps as f64
        }
    }

    /// Appends the rounds of `other` (a later rollout of the same step) to this trace.
    pub fn append(&mut self, other: DecodeTrace) {
        self.steps += other.steps;
        self.sd_steps += other.sd_steps;
        self.seconds += other.seconds;
        self.sd_seconds += other.sd_seconds;
        self.active.extend(other.active);
        self.round_seconds.extend(other.round_seconds);
        self.round_tokens.extend(other.round_tokens);
        self.accept_lens.extend(other.accept_lens);
        for (arm, n) in other.arms {
            *self.arms.entry(arm).or_default() += n;
        }
        self.plain_arm_steps += other.plain_arm_steps;
        self.prepare_seconds += other.prepare_seconds;
    }

    /// Mean of [`Self::accept_lens`] (0 without speculative rounds).
    pub fn mean_accept_len(&self) -> f64 {
        if self.accept_lens.is_empty() {
            0.0
        } else {
            self.accept_lens.iter().sum::<f64>() / self.accept_lens.len() as f64
        }
    }
}

/// Drives engine rounds with the SD gate and the plan bandit.
#[derive(Debug, Clone)]
pub struct AdaptiveDecoder {
    gate: SdGate,
    mab: BegMab,
    trace: DecodeTrace,
}

impl AdaptiveDecoder {
    /// A decoder with a fresh gate and bandit.
    ///
    /// # Errors
    /// If either config is invalid.
    pub fn new(gate: GateConfig, mab: MabConfig) -> Result<Self> {
        Ok(Self { gate: SdGate::new(gate)?, mab: BegMab::new(mab)?, trace: DecodeTrace::default() })
    }

    /// A decoder that never speculates (the baseline; the bandit is never consulted).
    ///
    /// # Errors
    /// Never in practice (the default bandit config is valid).
    pub fn plain() -> Result<Self> {
        Self::new(GateConfig::never(), MabConfig::default())
    }

    /// One engine round: plain when the gate says so or `drafter` is `None`, otherwise the bandit's plan.
    /// Returns the phase the round ran in.
    ///
    /// # Errors
    /// The engine's error, or a bandit bookkeeping error.
    pub fn step<T: Target>(
        &mut self,
        engine: &mut Engine<T>,
        drafter: Option<&mut (dyn Drafter + '_)>,
    ) -> Result<Phase> {
        let batch = engine.num_live();
        let phase = self.gate.observe(batch).phase;
        self.trace.active.push(batch);
        let committed0 = engine.counters().committed;
        let t = Instant::now();
        let phase = match (phase, drafter) {
            (Phase::Speculative, Some(drafter)) => {
                let choice = self.mab.select(batch);
                if !choice.plain && choice.drafter < drafter.kinds() {
                    // The drafter's catch-up on what was committed while it did not draft (after the bulk
                    // phase: every running request's whole history) is not the chosen arm's cost: it runs
                    // outside the arm's timing (the round's wall time in the trace still includes it).
                    drafter.select_kind(choice.drafter);
                    let t_prep = Instant::now();
                    engine.prepare_drafter(&mut *drafter)?;
                    self.trace.prepare_seconds += t_prep.elapsed().as_secs_f64();
                }
                let t_arm = Instant::now();
                let before = *engine.counters();
                if choice.plain {
                    engine.round(Some(drafter), None)?;
                    self.mab.record_step(&choice, 1.0, batch, t_arm.elapsed().as_secs_f64().max(1e-9))?;
                    let secs = t.elapsed().as_secs_f64();
                    self.trace.plain_arm_steps += 1;
                    self.trace.steps += 1;
                    self.trace.seconds += secs;
                    self.trace.round_seconds.push(secs);
                    self.trace.round_tokens.push(engine.counters().committed - committed0);
                    return Ok(Phase::Plain);
                }
                if choice.drafter >= drafter.kinds() {
                    return Err(crate::error::invalid(
                        "mab.drafters",
                        format!(
                            "the bandit chose drafter kind {} of a drafter with {}",
                            choice.drafter,
                            drafter.kinds()
                        ),
                    ));
                }
                drafter.select_kind(choice.drafter);
                engine.round(Some(drafter), Some(&choice.plan))?;
                let secs = t_arm.elapsed().as_secs_f64();
                let after = engine.counters();
                let rounds = (after.seq_rounds - before.seq_rounds).max(1);
                let accept = (after.committed - before.committed) as f64 / rounds as f64;
                self.mab.record_step(&choice, accept, batch, secs.max(1e-9))?;
                *self.trace.arms.entry(self.mab.arm_name(choice.arm)).or_default() += 1;
                self.trace.accept_lens.push(accept);
                self.trace.sd_steps += 1;
                self.trace.sd_seconds += t.elapsed().as_secs_f64();
                Phase::Speculative
            }
            (_, drafter) => {
                // The drafter still sees the commits (a group drafter keeps its index current).
                engine.round(drafter, None)?;
                Phase::Plain
            }
        };
        let secs = t.elapsed().as_secs_f64();
        self.trace.steps += 1;
        self.trace.seconds += secs;
        self.trace.round_seconds.push(secs);
        self.trace.round_tokens.push(engine.counters().committed - committed0);
        Ok(phase)
    }

    /// Runs rounds until the engine is idle.
    ///
    /// # Errors
    /// As [`Self::step`].
    pub fn run<T: Target>(
        &mut self,
        engine: &mut Engine<T>,
        mut drafter: Option<&mut (dyn Drafter + '_)>,
    ) -> Result<()> {
        while !engine.is_idle() {
            self.step(engine, drafter.as_deref_mut())?;
        }
        Ok(())
    }

    /// The trace so far.
    pub fn trace(&self) -> &DecodeTrace {
        &self.trace
    }

    /// Takes the trace and starts a new one; the gate is reset (a new rollout starts plain), the bandit keeps
    /// what it learned.
    pub fn take_trace(&mut self) -> DecodeTrace {
        self.gate.reset();
        std::mem::take(&mut self.trace)
    }

    /// Takes the trace so far and starts a new one, the gate and the bandit left as they are: a server's rollout
    /// never ends, and draining keeps its trace from growing without bound.
    pub fn drain_trace(&mut self) -> DecodeTrace {
        std::mem::take(&mut self.trace)
    }

    /// The gate.
    pub fn gate(&self) -> &SdGate {
        &self.gate
    }

    /// The bandit.
    pub fn mab(&self) -> &BegMab {
        &self.mab
    }

    /// The gate's and the bandit's state, for a checkpoint (the trace is per rollout and not part of it).
    pub fn state(&self) -> DecoderState {
        DecoderState { gate: self.gate.state(), mab: self.mab.state() }
    }

    /// Continues from `state` (a checkpoint of a decoder with these configurations).
    ///
    /// # Errors
    /// As [`BegMab::restore`]; the decoder is then unchanged.
    pub fn restore(&mut self, state: &DecoderState) -> Result<()> {
        self.mab.restore(&state.mab)?;
        self.gate.restore(state.gate);
        Ok(())
    }
}

/// An [`AdaptiveDecoder`]'s learned state: the gate and the bandit ([`AdaptiveDecoder::state`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecoderState {
    /// The SD gate.
    pub gate: GateState,
    /// The plan bandit.
    pub mab: MabState,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_share_weights_rounds_by_their_seconds() {
        let trace =
            DecodeTrace { active: vec![8, 5, 2, 1], round_seconds: vec![4.0, 3.0, 2.0, 1.0], ..DecodeTrace::default() };
        assert!((trace.tail_share(2) - 0.3).abs() < 1e-12);
        assert!((trace.tail_share(8) - 1.0).abs() < 1e-12);
        assert_eq!(trace.tail_share(0), 0.0);
        assert_eq!(DecodeTrace::default().tail_share(4), 0.0);
    }
}
