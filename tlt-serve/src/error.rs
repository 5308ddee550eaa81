//! The crate's one error enum.

/// Everything that can go wrong in `tlt-serve`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request field is wrong: a 400 naming it.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field (`sampling_params.temperature`, `input_ids[3]`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The engine failed on a request.
    #[error("engine: {0}")]
    Engine(String),
    /// The server cannot do it now (another weight update runs; requests paused in place): a 409 saying why.
    #[error("{0}")]
    Busy(String),
    /// The engine thread is gone (the server is shutting down, or it died): a 503.
    #[error("the engine thread stopped")]
    Stopped,
    /// Not allowed (a weight path outside the `--weights-dir` roots): a 403 naming the field.
    #[error("{field}: {reason}")]
    Forbidden {
        /// The field.
        field: String,
        /// Why, without anything of the file it names.
        reason: String,
    },
    /// The engine's queue is full: a 429 saying so.
    #[error("{0}")]
    Full(String),
    /// A request asks for more than the server's bounds (prompts x `n`): a 413 naming the field.
    #[error("{field}: {reason}")]
    TooLarge {
        /// The field.
        field: String,
        /// The bound.
        reason: String,
    },
    /// Loading the model or tokenizer, or the tokenizer on a prompt.
    #[error("{0}")]
    Model(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
