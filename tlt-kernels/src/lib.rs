//! # tlt-kernels
//!
//! Hot CPU kernels for small-batch LLM inference, with run-time SIMD dispatch (AVX-512, AVX2+FMA, portable):
//!
//! - [`gemm`]: the skinny GEMM `y[m, n] = x[m, k] · W[n, k]^T (+ bias)` for `m` = 1..64 that streams each
//!   weight once per call, so verifying k drafted tokens costs about what decoding one does while memory is
//!   the bound. Weights in f32, f16, bf16 (converted in registers) and GGUF Q8_0/Q4_0/Q4_1 blocks.
//! - [`tree_attention`]: GQA softmax attention of `n` new tokens over a committed KV prefix and over each other,
//!   causally or along a token tree given by parent links (speculative verification), with an online softmax
//!   and no materialised mask.
//! - Sampling primitives: [`argmax`], [`probs`] (temperature, top-k, top-p), [`log_softmax`], [`token_logprob`], [`categorical`],
//!   [`sample`] and a deterministic, forkable [`SeededRng`].
//!
//! ```
//! use tlt_kernels::{gemm, Matrix, WeightDType};
//!
//! # fn main() -> tlt_kernels::Result<()> {
//! let (n, k, m) = (3, 64, 2);
//! let w: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 - 3.0).collect();
//! let x: Vec<f32> = (0..m * k).map(|i| (i % 5) as f32 * 0.5).collect();
//! let mut y = vec![0.0; m * n];
//! gemm(&x, m, Matrix::from_f32(n, k, &w, WeightDType::F32)?.view(), None, &mut y)?;
//! let expect: f32 = (0..k).map(|i| x[i] * w[2 * k + i]).sum();
//! assert!((y[2] - expect).abs() < 1e-4);
//! # Ok(()) }
//! ```
//!
//! - [`cuda`]: the CUDA kernels of the GPU rollout path (RoPE + cache write, tree attention, path commit, device
//!   sampling and tree acceptance) as CUDA C compiled at run time by NVRTC, their launch plans, and the device seam
//!   ([`cuda::Gpu`]) the GPU path's host code is written on, with its ordering rule. Compiled and checked in CI for
//!   sm_80 and sm_90 and executed there on the simulated device (`tlt-cuda-sim`); on an H200 once (2026-11-27).
//!
//! # Features
//! - default: CPU only. Each kernel's instruction set is picked at run time ([`Isa::best`]) or explicitly
//!   ([`GemmConfig`]), so every path is testable on one machine.
//! - `cuda`: `cuda::compile` and `cuda::CudaGpu` (the seam on a CUDA device) through `cudarc` (NVRTC, the driver and
//!   cuBLAS, loaded at run time: no toolkit needed to build; errors, never panics, without them).

mod attention;
pub mod cuda;
mod error;
mod gemm;
mod isa;
pub mod quant;
mod rng;
mod sampling;
mod simd;
mod team;
mod threads;

pub use attention::{tree_attention, tree_attention_with, AttnShape, Visibility};
pub use error::{Error, Result};
pub use gemm::{gemm, gemm_with, GemmConfig, MatRef, Matrix, WeightDType, WeightsRef};
pub use isa::Isa;
pub use rng::{SeededRng, SplitMix64};
pub use sampling::{
    argmax, categorical, log_softmax, probs, sample, token_logprob, token_logprob_pmax, SamplingParams,
};
pub use threads::default_threads;

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
