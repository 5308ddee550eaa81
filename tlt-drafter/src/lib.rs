//! # tlt-drafter
//!
//! EAGLE-2 and EAGLE-3 draft models that train continuously on the target's hidden states harvested from rollouts, with hot-swapped versioned weights and SGLang/vLLM-compatible checkpoints.
//!
//! **Status:** this crate is reserved in the workspace layout and holds no code yet; its contents are
//! specified in the project's issue tracker ("tlt-drafter: EAGLE drafters that train online from rollouts") and land with that issue. It deliberately exports
//! nothing rather than placeholder code.
//!
//! **Where it sits:** depends on `tlt-model`, `tlt-spec-decode`, candle-nn; used by `tlt-rl`. See the workspace `DESIGN.md` for the crate boundaries.
