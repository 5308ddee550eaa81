//! # tlt-spec-decode
//!
//! Model-agnostic speculative decoding for TLT rollouts. This is the model-free core: a round drafts a token
//! tree, the target scores every node in one tree-masked forward, and a verifier decides which root path to
//! keep plus one extra token.
//!
//! - [`Plan`]: the round's shape (`steps`, `top_k`, `verify_tokens`), as chosen by the scheduler's bandit.
//! - [`DraftTree`]: node 0 is the last committed token (not yet fed to the target), every other node has a
//!   smaller-indexed parent. Builders: [`DraftTree::chain`], [`DraftTree::eagle2`] (EAGLE-2 dynamic tree from a
//!   drafter callback), [`DraftTree::push_child`], and [`NgramDrafter::propose`] (prompt lookup).
//! - [`verify_greedy`] and [`verify_sampling`] (lossless tree speculative sampling under temperature, top-k and
//!   top-p, exact for the drafting schemes named by [`Proposal`]) return an [`Accepted`] path and next token.
//!
//! On top of that core sits the batched [`Engine`] (draft → one target forward → verify → commit, per-request
//! stop, log-probs and hidden states of committed tokens), generic over the [`Target`] and [`Drafter`] seams;
//! `tlt_model::Llama` implements [`Target`] with its `KvCache` as the state, [`NgramDrafter`] implements
//! [`Drafter`].
//!
//! [`DraftTree::parents`] is exactly `tlt_model::SeqInput::tree`, and [`Accepted::path`] is exactly what
//! `tlt_model::KvCache::commit` keeps. The sampling primitives ([`SamplingParams`], [`SeededRng`]) are
//! `tlt-kernels`' own, re-exported.
//!
//! ```
//! use tlt_spec_decode::{verify_sampling, DraftTree, Plan, Proposal, SamplingParams, SeededRng};
//!
//! # fn main() -> tlt_spec_decode::Result<()> {
//! // A toy drafter over a 4-token vocabulary that always proposes "previous + 1" (likely) or "previous + 2".
//! let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
//! let tree = DraftTree::eagle2(0, &plan, |path: &[u32]| {
//!     let last = *path.last().unwrap_or(&0);
//!     vec![((last + 1) % 4, (0.7f32).ln()), ((last + 2) % 4, (0.2f32).ln())]
//! })?;
//! assert_eq!(tree.len(), 6);
//! assert_eq!(tree.tokens()[..4], [0, 1, 2, 2]);
//! // The target agrees with the drafter everywhere: logits favour "token + 1".
//! let rows: Vec<Vec<f32>> =
//!     tree.tokens().iter().map(|&t| (0..4).map(|v| if v == (t + 1) % 4 { 4.0 } else { 0.0 }).collect()).collect();
//! let mut rng = SeededRng::new(42);
//! let acc = verify_sampling(&tree, &rows, Proposal::PointMass, &SamplingParams::default(), &mut rng)?;
//! assert!(tree.is_root_path(&acc.path));
//! let committed = acc.committed_tokens(&tree)?;
//! assert_eq!(committed.len(), acc.path.len());
//! # Ok(()) }
//! ```

#[cfg(feature = "llama")]
pub mod cuda;
pub mod device_verify;
mod drafter;
mod engine;
mod error;
mod hidden;
mod ids;
#[cfg(feature = "llama")]
mod llama;
mod ngram;
mod oracle;
mod params;
mod plan;
mod stop;
mod suffix;
mod target;
mod toy;
mod tree;
mod verify;

pub use drafter::{DraftContext, Drafter, DrafterSet};
pub use engine::{Counters, Engine, FinishReason, Finished};
pub use error::{Error, Result};
pub use hidden::HiddenStates;
pub use ids::{GroupId, RequestId};
#[cfg(feature = "llama")]
pub use llama::TappedLlama;
pub use ngram::NgramDrafter;
pub use oracle::{Corruption, OracleDrafter};
pub use params::SpecParams;
pub use plan::Plan;
pub use stop::TokenDecoder;
pub use suffix::{
    merge_trees, Calibration, HybridDrafter, Occurrence, StateId, SuffixConfig, SuffixDrafter, SuffixIndex, SuffixStats,
};
pub use target::{SeqHandle, Target, TargetInput, TargetOutput, Verified, VerifySpec};
pub use tlt_kernels::{SamplingParams, SeededRng};
pub use toy::ToyTarget;
pub use tree::{Beam, DraftTree, Node};
pub use verify::{verify_coupled, verify_greedy, verify_sampling, Accepted, Coins, ExactVerifier, Proposal, Verifier};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
