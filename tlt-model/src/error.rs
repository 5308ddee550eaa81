//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in `tlt-model`.
///
/// Loading errors name the file and, where there is one, the tensor involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file could not be parsed as the format it claims to be (truncated, corrupt, bogus header).
    #[error("{path}: malformed {format} file: {reason}")]
    Malformed {
        /// The file involved.
        path: PathBuf,
        /// `"gguf"`, `"safetensors"`, `"config.json"`, ...
        format: &'static str,
        /// What the parser reported.
        reason: String,
    },
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor {
        /// The checkpoint.
        path: PathBuf,
        /// The tensor's canonical (Hugging Face) name.
        name: String,
    },
    /// A tensor has the wrong shape for the configuration.
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The checkpoint.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape found in the file.
        got: Vec<usize>,
    },
    /// A tensor is stored in a dtype we do not read.
    #[error("{path}: tensor `{name}` has unsupported dtype {dtype}")]
    UnsupportedDType {
        /// The checkpoint.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// The dtype as the file names it.
        dtype: String,
    },
    /// The checkpoint describes an architecture or feature this crate does not implement.
    #[error("{path}: unsupported {what}: {value}")]
    Unsupported {
        /// The file involved.
        path: PathBuf,
        /// What is unsupported ("architecture", "rope scaling", "tokenizer model", ...).
        what: &'static str,
        /// The value found.
        value: String,
    },
    /// A configuration value is missing or out of range.
    #[error("invalid config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// The offending field (HF `config.json` name or GGUF key).
        field: String,
        /// Its value, as text.
        value: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// A forward or cache call was given inconsistent inputs.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A sequence handle does not name a live sequence of this cache.
    #[error("unknown sequence {0}")]
    UnknownSequence(usize),
    /// A sequence still has tentative tree entries that must be committed first.
    #[error("sequence {0} has uncommitted tree entries: call commit first")]
    PendingTree(usize),
    /// The accepted nodes given to `commit` do not form a root-to-node path of the pending tree.
    #[error("sequence {seq}: accepted nodes {accepted:?} are not a path from a root of the pending tree")]
    NotAPath {
        /// The sequence.
        seq: usize,
        /// The node indices given.
        accepted: Vec<usize>,
    },
    /// Building or running the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] tlt_kernels::Error),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub(crate) fn config(field: impl Into<String>, value: impl std::fmt::Display, reason: &'static str) -> Self {
        Error::InvalidConfig { field: field.into(), value: value.to_string(), reason }
    }

    pub(crate) fn malformed(path: impl Into<PathBuf>, format: &'static str, reason: impl ToString) -> Self {
        Error::Malformed { path: path.into(), format, reason: reason.to_string() }
    }
}
