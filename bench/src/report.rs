//! Helpers every benchmark suite shares: medians, the invocation, and writing `target/bench/<suite>.{json,md}`.

use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::sysinfo::MachineInfo;
use tracing::info;

/// The fields every `target/bench/<suite>.json` starts with.
#[derive(Debug, Clone, Serialize)]
pub struct Header {
    /// The suite's name.
    pub suite: &'static str,
    /// Bumped when fields change meaning.
    pub schema_version: u32,
    /// UTC start time, RFC 3339.
    pub timestamp: String,
    /// Commit of the workspace (`-dirty` with local changes).
    pub git_commit: String,
    /// How the suite was invoked.
    pub command_line: String,
    /// The machine.
    pub machine: MachineInfo,
}

impl Header {
    /// The header of a run of `suite` that started at `timestamp` on `machine`, with this commit and command line.
    pub fn new(suite: &'static str, schema_version: u32, timestamp: String, machine: MachineInfo) -> Self {
        Self {
            suite,
            schema_version,
            timestamp,
            git_commit: crate::sysinfo::git_commit(),
            command_line: command_line(),
            machine,
        }
    }
}

/// Median of `xs` (mean of the two middle values for an even count; NaN when empty).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// How the suite was invoked: `cargo xtask` followed by our arguments.
pub fn command_line() -> String {
    std::iter::once("cargo xtask".to_string()).chain(std::env::args().skip(1)).collect::<Vec<_>>().join(" ")
}

/// Writes `<suite>.json` (pretty-printed `report`) and `<suite>.md` (`table`) into `$TLT_BENCH_DIR`, else
/// `target/bench`.
pub fn write_outputs(suite: &str, report: &impl Serialize, table: &str) -> Result<()> {
    let dir = std::env::var_os(crate::env::OUT_VAR)
        .map_or_else(|| crate::env::workspace_root().join("target").join("bench"), std::path::PathBuf::from);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = serde_json::to_string_pretty(report)?;
    write(&dir.join(format!("{suite}.json")), &json)?;
    write(&dir.join(format!("{suite}.md")), table)?;
    info!(dir = %dir.display(), "wrote {suite}.json and {suite}.md");
    Ok(())
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
