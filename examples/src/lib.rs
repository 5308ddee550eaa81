//! Shared bits of the example programs (`generate`, `train`): where the default model lives, logging.

use std::io::IsTerminal;
use std::path::PathBuf;

/// `tracing` to stderr, filtered by `RUST_LOG` (default `info`), coloured on a terminal.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

pub use tlt_model::assets::SMOLLM2_GGUF;

/// The default model: `$TLT_SMOLLM2_GGUF`, else under `$TLT_CACHE`, else under `<workspace>/.cache`.
pub fn default_model() -> PathBuf {
    tlt_model::assets::smollm2_gguf()
}
