//! # tlt-spec-decode
//!
//! Model-agnostic speculative decoding: `Target`/`Drafter` traits, EAGLE-2 dynamic draft trees, n-gram drafting, greedy and lossless tree speculative sampling, and the batched draft-verify-commit engine.
//!
//! **Status:** this crate is reserved in the workspace layout and holds no code yet; its contents are
//! specified in the project's issue tracker ("tlt-spec-decode: lossless tree speculative decoding, batched") and land with that issue. It deliberately exports
//! nothing rather than placeholder code.
//!
//! **Where it sits:** depends on `tlt-kernels`, candle-core; used by `tlt-drafter`, `tlt-rl`. See the workspace `DESIGN.md` for the crate boundaries.
