//! # tlt-cudagraph
//!
//! Pools of pre-captured execution graphs keyed by (phase, batch bucket, tree shape), with eager fallback, a shared memory budget and LRU eviction.
//!
//! **Status:** this crate is reserved in the workspace layout and holds no code yet; its contents are
//! specified in the project's issue tracker ("tlt-scheduler and tlt-cudagraph: the adaptive rollout engine's brain and its graph pool") and land with that issue. It deliberately exports
//! nothing rather than placeholder code.
//!
//! **Where it sits:** depends on cudarc (optional, behind `cuda`); used by `tlt-spec-decode`, `tlt-rl`. See the workspace `DESIGN.md` for the crate boundaries.
