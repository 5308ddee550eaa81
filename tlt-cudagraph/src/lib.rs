//! # tlt-cudagraph
//!
//! Pools of pre-captured execution graphs keyed by (phase, batch bucket, tree shape), for the speculative
//! decoding engine's draft, verify and plain-decode forwards.
//!
//! - [`GraphKey`]: phase ([`GraphPhase::Draft`] / [`GraphPhase::Verify`] / [`GraphPhase::Decode`]), padded
//!   batch and the [`TreeShape`] dimensions that phase depends on (verify graphs depend on the tree size only,
//!   draft graphs on `(steps, top_k)` only, so arms share graphs as in fastrl's decoupled runners).
//! - [`BucketPolicy`]: the captured batch sizes (SGLang's ladder by default) and the pure padding function.
//! - [`GraphPool`]: graphs under one byte budget with least-recently-used eviction and [`PoolStats`] (hits,
//!   misses, captures, evictions, bytes in use and peak, eager fallbacks by reason).
//! - [`Executor`]: `run(key, io)`. [`EagerExecutor`] calls the forward every time (CPU);
//!   [`GraphExecutor`] pads the batch, captures on first use through a [`GraphBackend`], replays after, and
//!   falls back to eager with a recorded [`FallbackReason`] when the batch is too large, the graph cannot fit
//!   the budget, or capture failed (a failed key is not retried).
//! - [`gpu::capture`] and [`gpu::GpuGraphBackend`]: stream capture and graph replay on a device behind the seam
//!   (`tlt_kernels::cuda::Gpu`): a CUDA device, or the simulated device that runs them in CI.
//!
//! ```
//! use tlt_cudagraph::{BucketPolicy, Captured, Executor, GraphBackend, GraphExecutor, GraphKey, RunMode};
//!
//! // A stand-in backend whose "graph" is the key it recorded; replay runs the same forward.
//! fn forward(k: &GraphKey, out: &mut Vec<usize>) -> tlt_cudagraph::Result<()> {
//!     out.push(k.tokens());
//!     Ok(())
//! }
//! struct Recorder;
//! impl GraphBackend<Vec<usize>> for Recorder {
//!     type Graph = GraphKey;
//!     fn capture(&mut self, k: &GraphKey, _: &mut Vec<usize>) -> tlt_cudagraph::Result<Captured<GraphKey>> {
//!         Ok(Captured { graph: *k, bytes: 64 * k.tokens() as u64 })
//!     }
//!     fn replay(&mut self, g: &GraphKey, _: &GraphKey, out: &mut Vec<usize>) -> tlt_cudagraph::Result<()> {
//!         forward(g, out)
//!     }
//! }
//! let mut ex = GraphExecutor::new(Recorder, forward, BucketPolicy::ladder(32), 1 << 20).unwrap();
//! let mut out = Vec::new();
//! assert_eq!(ex.run(&GraphKey::verify(9, 16), &mut out).unwrap().mode, RunMode::Captured); // padded to 10
//! assert_eq!(ex.run(&GraphKey::verify(10, 16), &mut out).unwrap().mode, RunMode::Replayed);
//! assert!(matches!(ex.run(&GraphKey::decode(40), &mut out).unwrap().mode, RunMode::Eager(Some(_))));
//! assert_eq!(out, [160, 160, 40]);
//! assert_eq!(ex.stats().bytes_in_use, 64 * 160);
//! ```
//!
//! **Where it sits:** depends on serde, thiserror, tlt-kernels (the device seam; no candle); used by `tlt-model`
//! (`CudaLlama`'s shapes), `tlt-scheduler`, `tlt-rl`.

mod bucket;
mod error;
mod executor;
mod key;
mod pool;
mod shapes;

pub mod gpu;

pub use bucket::BucketPolicy;
pub use error::{BoxError, Error, Result};
pub use executor::{Captured, EagerExecutor, Executor, GraphBackend, GraphExecutor, RunInfo, RunMode};
pub use key::{GraphKey, GraphPhase, TreeShape};
pub use pool::{FallbackReason, GraphPool, PoolStats, Rejected};
pub use shapes::{ShapeCache, ShapeEntry, ShapePlan, ShapeStats};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
