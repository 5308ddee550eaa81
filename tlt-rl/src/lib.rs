//! # tlt-rl
//!
//! GRPO with the knobs users of verl/OpenRLHF/TRL expect, rule-based rewards and task generators, and the `Trainer` that composes adaptive speculative rollouts, rewards, policy updates and online drafter training.
//!
//! **Status:** this crate is reserved in the workspace layout and holds no code yet; its contents are
//! specified in the project's issue tracker ("tlt-rl and the reference TLT trainer") and land with that issue. It deliberately exports
//! nothing rather than placeholder code.
//!
//! **Where it sits:** depends on every crate above; used by the `examples` crate and `xtask`. See the workspace `DESIGN.md` for the crate boundaries.
