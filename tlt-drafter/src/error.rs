//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in `tlt-drafter`.
///
/// Checkpoint errors name the directory or file and, where there is one, the tensor involved, so a bad
/// checkpoint is reported precisely instead of being half-loaded.
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
    /// A file could not be parsed as the format it claims to be.
    #[error("{path}: malformed {format}: {reason}")]
    Malformed {
        /// The file involved.
        path: PathBuf,
        /// `"safetensors"`, `"config.json"`.
        format: &'static str,
        /// What the parser reported.
        reason: String,
    },
    /// A configuration value is missing, out of range, or inconsistent with another.
    #[error("invalid drafter config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: String,
        /// Its value, as text.
        value: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// The checkpoint is not of the kind asked for (e.g. `architectures` names no EAGLE-3 class).
    #[error("{path}: not a {expected} checkpoint: {found}")]
    WrongCheckpointKind {
        /// The checkpoint directory.
        path: PathBuf,
        /// What the loader expected.
        expected: &'static str,
        /// What it found.
        found: String,
    },
    /// A tensor the drafter needs is not in the checkpoint.
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor {
        /// The checkpoint file.
        path: PathBuf,
        /// The tensor's name in the checkpoint.
        name: String,
    },
    /// The checkpoint holds a tensor the format does not define (serving engines would silently skip it).
    #[error("{path}: unexpected tensor `{name}`")]
    UnexpectedTensor {
        /// The checkpoint file.
        path: PathBuf,
        /// The tensor's name.
        name: String,
    },
    /// A tensor has the wrong shape for the configuration.
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The checkpoint file.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape found in the file.
        got: Vec<usize>,
    },
    /// A tensor is stored in a dtype the format does not allow for it (e.g. `d2t` not int64).
    #[error("{path}: tensor `{name}` has dtype {got}, expected {expected}")]
    WrongDType {
        /// The checkpoint file.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// The dtype(s) allowed, as safetensors names them.
        expected: &'static str,
        /// The dtype found.
        got: String,
    },
    /// The drafter's hidden size does not match the target it is paired with.
    #[error("drafter {what} is {drafter} but the target's hidden size is {target}")]
    HiddenSizeMismatch {
        /// Which drafter size (`hidden_size`, `target_hidden_size`).
        what: &'static str,
        /// The drafter's value.
        drafter: usize,
        /// The target's hidden size.
        target: usize,
    },
    /// The drafter's (full) vocabulary does not match the target's.
    #[error("drafter vocab_size is {drafter} but the target's is {target}")]
    VocabMismatch {
        /// The drafter's `vocab_size`.
        drafter: usize,
        /// The target's `vocab_size`.
        target: usize,
    },
    /// The reduced-vocabulary maps are inconsistent (d2t out of range or unsorted, t2d disagreeing with d2t).
    #[error("inconsistent draft vocabulary map: {reason}")]
    InconsistentVocabMap {
        /// What is wrong.
        reason: String,
    },
    /// The two spellings of the EAGLE-3 layer ids in `config.json` (SGLang's `eagle_config` and vLLM's top-level
    /// key) name different target layers.
    #[error(
        "{path}: eagle_config.eagle_aux_hidden_state_layer_ids {sglang:?} (+1) disagree with \
             eagle_aux_hidden_state_layer_ids {vllm:?}"
    )]
    InconsistentLayerIds {
        /// The `config.json` file.
        path: PathBuf,
        /// SGLang's ids (output of layer `k`).
        sglang: Vec<i64>,
        /// vLLM's ids (input of layer `k`).
        vllm: Vec<i64>,
    },
    /// A training batch is inconsistent with itself or with the drafter.
    #[error("invalid batch: {field}: {reason}")]
    InvalidBatch {
        /// The offending batch field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// Any other out-of-range argument (online buffer samples, trainer state).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The data-parallel gradient sum ([`DrafterTrainer::step_with`](crate::DrafterTrainer::step_with)'s reduce)
    /// failed.
    #[error("summing drafter gradients across trainers: {0}")]
    Reduce(String),
    /// An error from `tlt-model`.
    #[error(transparent)]
    Model(#[from] tlt_model::Error),
    /// An error from `tlt-spec-decode`.
    #[error(transparent)]
    SpecDecode(#[from] tlt_spec_decode::Error),
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

    pub(crate) fn malformed(path: impl Into<PathBuf>, format: &'static str, reason: impl ToString) -> Self {
        Error::Malformed { path: path.into(), format, reason: reason.to_string() }
    }

    /// A shared optimizer's config error (`tlt_model::optim`) as this crate's [`Error::InvalidConfig`].
    pub(crate) fn from_model_config(e: tlt_model::Error) -> Self {
        match e {
            tlt_model::Error::InvalidConfig { field, value, reason } => Error::InvalidConfig { field, value, reason },
            e => Error::Model(e),
        }
    }

    pub(crate) fn config(field: &str, value: impl std::fmt::Display, reason: &'static str) -> Self {
        Error::InvalidConfig { field: field.into(), value: value.to_string(), reason }
    }

    pub(crate) fn batch(field: &'static str, reason: impl ToString) -> Self {
        Error::InvalidBatch { field, reason: reason.to_string() }
    }
}
