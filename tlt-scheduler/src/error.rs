//! The crate's error type.

/// Everything that can go wrong in `tlt-scheduler`: invalid configurations and misuse of the stepwise APIs.
/// Decisions themselves (gate, bandit, admission) never fail.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration field is out of range; `field` names it (`"mab.epsilon"`), `reason` says why.
    #[error("invalid config `{field}`: {reason}")]
    InvalidConfig {
        /// The offending field, dotted path.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A bandit arm is not a valid [`Plan`](tlt_spec_decode::Plan).
    #[error("invalid arm {index}: {source}")]
    InvalidArm {
        /// Index of the arm in the configuration.
        index: usize,
        /// The plan's own validation error.
        #[source]
        source: tlt_spec_decode::Error,
    },
    /// A request can never be admitted: its prompt alone exceeds the per-step token budget.
    #[error("request prompt of {prompt_tokens} tokens exceeds the per-step token budget of {budget}")]
    PromptOverBudget {
        /// Prompt length.
        prompt_tokens: usize,
        /// The configured budget.
        budget: usize,
    },
    /// The engine driven by [`AdaptiveDecoder`](crate::AdaptiveDecoder) failed.
    #[error("engine: {0}")]
    Engine(#[from] tlt_spec_decode::Error),
    /// A step outcome does not match the step it answers (unknown request, zero tokens committed, NaN time...).
    #[error("invalid step outcome: {0}")]
    InvalidOutcome(String),
    /// The stepwise rollout API was called out of order (an outcome without a pending step, or two steps at once).
    #[error("rollout protocol misuse: {0}")]
    Protocol(&'static str),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig { field, reason: reason.into() }
}
