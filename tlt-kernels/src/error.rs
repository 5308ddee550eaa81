//! The crate's error type.

/// Errors of the kernels' public API (shape and argument checks; the kernels themselves cannot fail).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A buffer has the wrong length for the shapes given.
    #[error("{what}: expected {expected} elements, got {got}")]
    ShapeMismatch {
        /// Which argument.
        what: &'static str,
        /// The length the shapes imply.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A block-quantized matrix needs `k` to be a multiple of 32.
    #[error("block-quantized weights need k to be a multiple of 32, got {k}")]
    BlockAlignment {
        /// The inner dimension given.
        k: usize,
    },
    /// The requested instruction set is not supported by this CPU.
    #[error("instruction set {0:?} is not available on this CPU")]
    IsaUnavailable(crate::Isa),
    /// Any other out-of-range argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
