//! What `cargo xtask` hands this binary through the environment: the fetched assets and the cache they live in
//! (`xtask/src/assets.rs` fetches and verifies them; this crate only reads where they are), and the paths of the
//! workspace.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use anyhow::{Context, Result};
use tracing::info;

/// The SmolLM2-135M-Instruct GGUF, fetched by `cargo xtask` before it runs us.
pub const GGUF_VAR: &str = "TLT_SMOLLM2_GGUF";
/// The asset cache (`$TLT_CACHE`, else `<workspace>/.cache`, as `cargo xtask` resolves it).
pub const CACHE_VAR: &str = "TLT_CACHE";
/// Where the suites write their JSON and Markdown (default `target/bench` of the workspace they were built in).
pub const OUT_VAR: &str = "TLT_BENCH_DIR";
/// The directory of the export check's Python packages (`cargo xtask fetch-assets --python-checks`).
pub const PYEXPORT_VAR: &str = "TLT_PYEXPORT_DEPS";

/// The value of `var`, a path; an error saying to go through `cargo xtask` when it is not set.
fn path_var(var: &str, what: &str) -> Result<PathBuf> {
    match std::env::var_os(var) {
        Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
        _ => anyhow::bail!("${var} ({what}) is not set: run this through `cargo xtask`, which sets it"),
    }
}

/// The SmolLM2 GGUF (`$TLT_SMOLLM2_GGUF`).
pub fn smollm2_gguf() -> Result<PathBuf> {
    path_var(GGUF_VAR, "the SmolLM2 GGUF")
}

/// The asset cache (`$TLT_CACHE`).
pub fn cache_dir() -> Result<PathBuf> {
    path_var(CACHE_VAR, "the asset cache")
}

/// The export check's Python packages (`$TLT_PYEXPORT_DEPS`), set by `cargo xtask` when they are installed.
pub fn python_export_deps() -> Result<PathBuf> {
    path_var(
        PYEXPORT_VAR,
        "the export check's Python packages; install them with `cargo xtask fetch-assets --python-checks`",
    )
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The cargo that built us (`$CARGO`), or `cargo` from `PATH`, in the workspace root.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Runs `cmd`, returning its exit status.
pub fn run(mut cmd: Command) -> Result<ExitStatus> {
    info!(command = ?cmd, "running");
    cmd.status().with_context(|| format!("starting {:?}", cmd.get_program()))
}
