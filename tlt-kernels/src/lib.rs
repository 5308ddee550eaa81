//! # tlt-kernels
//!
//! Hot CPU kernels with runtime SIMD dispatch: skinny GEMM for 1..64 rows (f32, f16/bf16, Q8_0/Q4 weights), tree-masked attention over a KV cache, and sampling primitives.
//!
//! **Status:** this crate is reserved in the workspace layout and holds no code yet; its contents are
//! specified in the project's issue tracker ("tlt-kernels: make verifying k tokens cost about as much as decoding one") and land with that issue. It deliberately exports
//! nothing rather than placeholder code.
//!
//! **Where it sits:** depends on candle-core (and cudarc behind `cuda`); used by `tlt-model`, `tlt-spec-decode`. See the workspace `DESIGN.md` for the crate boundaries.
