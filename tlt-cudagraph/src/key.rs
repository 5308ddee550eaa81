//! What a graph is captured for: the phase, the (padded) batch size and the tree shape.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The kind of forward a graph replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GraphPhase {
    /// One drafter forward over the tree frontier (`top_k` tokens per request), depending on `(steps, top_k)`.
    Draft,
    /// The target's tree-masked forward over `verify_tokens` nodes per request, depending on the tree size only.
    Verify,
    /// The target's plain one-token decode forward.
    Decode,
}

/// The tree dimensions that matter to a phase; the others are zero, so arms that differ only in what a phase
/// does not depend on share its graphs (every arm with 16 verify tokens shares the 16-token verify graphs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct TreeShape {
    /// Draft depth (draft graphs only).
    pub steps: usize,
    /// Frontier width (draft graphs only).
    pub top_k: usize,
    /// Tree nodes verified per request (verify graphs only).
    pub verify_tokens: usize,
}

/// The key of one captured graph.
///
/// ```
/// use tlt_cudagraph::{GraphKey, GraphPhase};
/// let k = GraphKey::verify(5, 16);
/// assert_eq!((k.phase, k.batch, k.shape.verify_tokens, k.shape.steps), (GraphPhase::Verify, 5, 16, 0));
/// assert_eq!(k.tokens(), 80);
/// assert_eq!(k.with_batch(8).batch, 8);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GraphKey {
    /// The forward kind.
    pub phase: GraphPhase,
    /// Requests in the batch (after padding, for a captured graph).
    pub batch: usize,
    /// The tree dimensions the phase depends on.
    pub shape: TreeShape,
}

impl GraphKey {
    /// A plain decode step over `batch` requests.
    pub fn decode(batch: usize) -> Self {
        Self { phase: GraphPhase::Decode, batch, shape: TreeShape::default() }
    }

    /// A tree verification of `verify_tokens` nodes per request.
    pub fn verify(batch: usize, verify_tokens: usize) -> Self {
        Self { phase: GraphPhase::Verify, batch, shape: TreeShape { verify_tokens, ..TreeShape::default() } }
    }

    /// One draft forward of a `steps`-deep, `top_k`-wide tree.
    pub fn draft(batch: usize, steps: usize, top_k: usize) -> Self {
        Self { phase: GraphPhase::Draft, batch, shape: TreeShape { steps, top_k, verify_tokens: 0 } }
    }

    /// The same key for another batch size.
    #[must_use]
    pub fn with_batch(self, batch: usize) -> Self {
        Self { batch, ..self }
    }

    /// Tokens the forward processes: `batch` × (1, `verify_tokens` or `top_k`).
    pub fn tokens(&self) -> usize {
        let per = match self.phase {
            GraphPhase::Decode => 1,
            GraphPhase::Verify => self.shape.verify_tokens,
            GraphPhase::Draft => self.shape.top_k,
        };
        self.batch.saturating_mul(per)
    }
}

impl fmt::Display for GraphKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.shape;
        match self.phase {
            GraphPhase::Decode => write!(f, "decode[b={}]", self.batch),
            GraphPhase::Verify => write!(f, "verify[b={}, t={}]", self.batch, s.verify_tokens),
            GraphPhase::Draft => write!(f, "draft[b={}, s={}, k={}]", self.batch, s.steps, s.top_k),
        }
    }
}
