//! The crate's error type.

/// Errors of the speculative-decoding API. Every public function checks its inputs and reports bad ones here
/// instead of panicking.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A [`Plan`](crate::Plan) field is out of range.
    #[error("invalid plan: {0}")]
    InvalidPlan(String),
    /// A tree operation named a node that does not exist, or a tree was built from inconsistent parts.
    #[error("invalid tree: {0}")]
    InvalidTree(String),
    /// A drafter reported a log-probability that is NaN or `+inf`.
    #[error("invalid draft log-probability {value} for token {token}")]
    InvalidLogProb {
        /// The candidate token.
        token: u32,
        /// The offending value, as text (NaN does not compare equal to itself).
        value: String,
    },
    /// A buffer has the wrong length for the tree or vocabulary it describes.
    #[error("{what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// Which argument.
        what: &'static str,
        /// The length the tree or vocabulary implies.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A drafted token id does not fit the vocabulary of the rows it is verified against.
    #[error("node {node}: token {token} is outside the vocabulary of size {vocab}")]
    TokenOutOfVocab {
        /// The tree node.
        node: usize,
        /// Its token.
        token: u32,
        /// The vocabulary size of the rows.
        vocab: usize,
    },
    /// The target model failed (its error, as text).
    #[error("target: {0}")]
    Target(String),
    /// Any other out-of-range argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A sampling primitive of `tlt-kernels` rejected its input (NaN or `+inf` logits, bad sampling params).
    #[error(transparent)]
    Kernel(#[from] tlt_kernels::Error),
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
