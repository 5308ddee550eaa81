//! The crate's error type.

/// A boxed error from the code a pool runs (the model's eager forward, a recorder).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in `tlt-cudagraph`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration field is out of range.
    #[error("invalid config `{field}`: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A device call failed.
    #[error("CUDA driver call `{op}` failed: {message}")]
    Driver {
        /// The operation (`"begin_capture"`, `"launch"`...).
        op: &'static str,
        /// The driver's error text.
        message: String,
    },
    /// Stream capture ended without a graph (nothing was recorded, or the capture was invalidated).
    #[error("stream capture of {key} produced no graph")]
    EmptyCapture {
        /// The key being captured, as text.
        key: String,
    },
    /// The work the executor runs (eager forward, graph recorder) failed.
    #[error("execution failed: {0}")]
    Run(#[source] BoxError),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
