//! # tlt-scheduler
//!
//! Tensor-free long-tail rollout scheduling: continuous batching, the SD gate with hysteresis, BEG-MAB tree-shape selection, idle-worker coordination and a cluster simulator.
//!
//! **Status:** this crate is reserved in the workspace layout and holds no code yet; its contents are
//! specified in the project's issue tracker ("tlt-scheduler and tlt-cudagraph: the adaptive rollout engine's brain and its graph pool") and land with that issue. It deliberately exports
//! nothing rather than placeholder code.
//!
//! **Where it sits:** depends on crossbeam, parking_lot; used by `tlt-rl`. See the workspace `DESIGN.md` for the crate boundaries.
