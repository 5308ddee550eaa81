//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in `tlt-rl`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range or inconsistent.
    #[error("invalid config `{field}`: {reason}")]
    InvalidConfig {
        /// The offending field (dotted path).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A function argument is malformed (shapes, lengths, empty inputs).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A dataset, answer or template could not be parsed.
    #[error("parse error in {what}: {reason}")]
    Parse {
        /// What was being parsed (a file and line, a template name).
        what: String,
        /// Why it failed.
        reason: String,
    },
    /// A checkpoint is missing, incomplete or does not match the run.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] tlt_model::Error),
    /// The speculative-decoding engine failed.
    #[error(transparent)]
    SpecDecode(#[from] tlt_spec_decode::Error),
    /// The drafter failed.
    #[error(transparent)]
    Drafter(#[from] tlt_drafter::Error),
    /// The scheduler failed.
    #[error(transparent)]
    Scheduler(#[from] tlt_scheduler::Error),
    /// A chart could not be drawn (plotters failed) or encoded.
    #[error("plot `{chart}`: {reason}")]
    Plot {
        /// The chart's title (or what was being set up).
        chart: String,
        /// What went wrong.
        reason: String,
    },
    /// A trainer refuses to go on after a failed step (the reason says which and why); resume from its last
    /// checkpoint.
    #[error("the trainer stopped: {0}")]
    Stopped(String),
    /// Communication between data-parallel ranks failed.
    #[error(transparent)]
    Comm(#[from] tlt_comm::Error),
    /// JSON (de)serialisation failed.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::InvalidConfig`].
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidConfig { field: field.into(), reason: reason.into() }
    }

    /// An [`Error::Parse`].
    pub fn parse(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Parse { what: what.into(), reason: reason.into() }
    }

    /// An [`Error::Plot`].
    pub fn plot(chart: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Plot { chart: chart.into(), reason: reason.into() }
    }

    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}
