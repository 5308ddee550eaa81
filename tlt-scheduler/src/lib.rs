//! # tlt-scheduler
//!
//! Tensor-free long-tail rollout scheduling for TLT: every decision is a pure function of counters (batch
//! sizes, accept lengths, step times), so it is property-tested and reused as-is by the cluster simulator.
//!
//! - [`Rollout`]: the request queue. Continuous batching under a running-batch cap and a per-step token budget,
//!   GRPO groups of samples per prompt, per-request stop and cancellation, strict FIFO admission (no request
//!   starves). It hands each decode step to the caller (an engine, a cost model) as a [`Step`] and takes back a
//!   [`StepOutcome`]; [`Rollout::run`] drives it with a closure.
//! - [`SdGate`]: the phase signal. SD turns on once the running batch has stayed `<= threshold` for `on_after`
//!   steps and off once it has stayed above `off_threshold` for `off_after` steps (hysteresis: no flapping).
//!   The engine switches plans between rounds, so no re-prefill is needed (fastrl re-prefills everything).
//! - [`BegMab`]: BEG multi-armed bandit over [`Plan`](tlt_spec_decode::Plan) arms. Batch-size buckets map to
//!   tree sizes (defaults `[1, 2, 5, 21]` → 48/32/16/8 tokens); ε-greedy inside a bucket on the median reward
//!   (committed tokens per second, [`step_reward`]) over a sliding window; unseen arms first; seeded.
//! - [`bucket`]: the BEG group of a batch (rounding down); padding up to a captured batch size is
//!   `tlt_cudagraph::BucketPolicy`.
//! - [`sim`]: a discrete-event simulator of `W` workers decoding long-tailed lengths with a calibratable
//!   cost model; [`sim::simulate`] takes a serde [`sim::SimConfig`] and returns a serde [`sim::SimReport`]
//!   comparing plain decoding, adaptive SD, and adaptive SD with an online drafter, optionally with work
//!   stealing between workers ([`sim::SimConfig::steal`]).
//!
//! ```
//! use tlt_scheduler::{Phase, Rollout, RolloutConfig, StepOutcome};
//!
//! let mut rollout = Rollout::new(RolloutConfig::default()).unwrap();
//! rollout.submit_group(32, 8, 64).unwrap(); // one prompt of 32 tokens, 8 samples, <= 64 new tokens each
//! let stats = rollout
//!     .run(|step| -> tlt_scheduler::Result<StepOutcome> {
//!         // A real caller runs `step.plan()` (speculative) or plain decoding on `step.running`.
//!         let per_request = if step.phase == Phase::Speculative { 3 } else { 1 };
//!         Ok(StepOutcome::uniform(&step.running, per_request, 0.02))
//!     })
//!     .unwrap();
//! assert_eq!(stats.finished, 8);
//! assert!(stats.speculative_steps > 0); // 8 <= 32 for 10 steps: the gate turned SD on
//! ```
//!
//! - [`AdaptiveDecoder`]: the gate and the bandit driving a `tlt_spec_decode::Engine` round by round, with a
//!   [`DecodeTrace`] of what they decided (the rollout of `tlt-rl`'s trainer and the `rollout` bench use it).
//!
//! **Not here yet:** KV-budget admission with preemption, and CPU re-tuning of the bandit defaults by
//! measurement.
//!
//! **Where it sits:** depends on `tlt-spec-decode` without its default features (the `Engine`, `Plan` and the
//! `Target`/`Drafter` traits: no model, no tensors), `tlt-kernels` (its seeded [`SplitMix64`](tlt_kernels::SplitMix64)),
//! `tlt-cudagraph` (the capture-size ladder the simulator pads to), serde and thiserror; used by `tlt-rl`.
//! Idle-worker drafter training lives with the drafter (`tlt_drafter::online`), which the trainer drives.

pub mod adaptive;
pub mod bucket;
mod error;
pub mod gate;
pub mod mab;
pub mod queue;
pub mod rollout;
pub mod sim;

pub use adaptive::{AdaptiveDecoder, DecodeTrace, DecoderState};
pub use error::{Error, Result};
pub use gate::{GateConfig, GateDecision, GateState, Phase, SdGate};
pub use mab::{step_reward, BegMab, Choice, ChoiceReason, MabConfig, MabState, MabStatistic};
pub use queue::{AdmissionLimits, AdmissionQueue};
pub use rollout::{
    FinishReason, Finished, GroupId, RequestId, RequestOutcome, Rollout, RolloutConfig, RolloutStats, Step, StepOutcome,
};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
