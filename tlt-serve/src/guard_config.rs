//! The server's access and resource bounds ([`GuardConfig`]), in a module of their own: the shared state holds
//! them and the guard middleware applies them to that state, so neither of those two modules imports the other
//! for them. `tlt_serve::guard::GuardConfig` re-exports it.

use std::time::Duration;

/// Default for [`GuardConfig::max_queued`].
pub const DEFAULT_MAX_QUEUED: usize = 16_384;
/// Default for [`GuardConfig::max_batch`].
pub const DEFAULT_MAX_BATCH: usize = 8_192;

/// The server's access and resource bounds.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// Required as `Authorization: Bearer KEY` on every route but `/health*` and `/metrics`; `None`: open (SGLang's
    /// default).
    pub api_key: Option<String>,
    /// The only directories `/update_weights_from_disk` may load from (canonicalised at start; symlinks resolved).
    /// Empty (the default): every update from disk is refused.
    pub weights_dirs: Vec<std::path::PathBuf>,
    /// Most requests waiting for the engine (queued, not yet decoding); past it a request is a 429. Default
    /// [`DEFAULT_MAX_QUEUED`].
    pub max_queued: usize,
    /// Most samples one request may ask for (prompts x `n`); past it a 413. Default [`DEFAULT_MAX_BATCH`].
    pub max_batch: usize,
    /// A request not answered within this is aborted and answered 504 (`/update_weights_from_disk` excepted; a
    /// stream's time counts until its first event). `None` (the default): no limit.
    pub request_timeout: Option<Duration>,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            weights_dirs: Vec::new(),
            max_queued: DEFAULT_MAX_QUEUED,
            max_batch: DEFAULT_MAX_BATCH,
            request_timeout: None,
        }
    }
}
