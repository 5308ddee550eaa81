//! # tlt-rl
//!
//! GRPO with the knobs users of verl/OpenRLHF/TRL expect, rule-based rewards and task generators, and the
//! `Trainer` that composes adaptive speculative rollouts, rewards, policy updates and online drafter training.
//!
//! **Where it sits:** depends on every crate above; used by the `examples` crate and `xtask`. See the workspace
//! README for the crate graph.

mod ceiling;
mod error;
pub mod grpo;
pub mod metrics;
pub mod microbatch;
pub mod plot;
pub mod runner;

pub mod task;
pub mod trainer;

pub use error::{Error, Result};
pub use trainer::{Environment, Mode, Observer, Trainer, TrainerConfig};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
