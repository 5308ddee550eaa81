//! The crate's error type.

/// Errors of the kernels' public API: shape and argument checks (the CPU kernels themselves cannot fail), and the
/// CUDA path's library, compile and launch failures.
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
    /// The CUDA path cannot run here: the crate was built without the `cuda` feature, or the NVRTC or driver
    /// library could not be loaded.
    #[error("CUDA is unavailable: {0}")]
    CudaUnavailable(String),
    /// NVRTC rejected one of our CUDA sources.
    #[error("NVRTC could not compile {file} for sm_{arch}: {log}")]
    CudaCompile {
        /// The source file.
        file: &'static str,
        /// The compute capability.
        arch: u32,
        /// NVRTC's log.
        log: String,
    },
    /// A CUDA driver or NVRTC call failed.
    #[error("CUDA call `{op}` failed: {message}")]
    Cuda {
        /// The call.
        op: &'static str,
        /// The library's error text.
        message: String,
    },
    /// Any other out-of-range argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Fails with [`Error::ShapeMismatch`] unless a buffer has the length its shapes imply.
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::ShapeMismatch { what, expected, got })
    }
}
