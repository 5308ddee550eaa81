//! The dependency graph the crate READMEs promise, checked from `cargo tree` (run by `cargo xtask test`): the
//! scheduler is free of tensors and models, and `tlt-spec-decode` without its default features (the Llama
//! adapter) is model-agnostic and still builds.

use std::process::Command;

use anyhow::{bail, Context, Result};
use tracing::info;

/// Which crates may not appear below which package (with which `cargo tree` arguments).
const RULES: &[(&str, &[&str], &[&str])] = &[
    ("tlt-scheduler", &[], &["candle-core", "candle-nn", "tlt-model", "tokenizers"]),
    ("tlt-spec-decode", &["--no-default-features"], &["candle-core", "tlt-model", "tokenizers"]),
    ("tlt-spec-decode", &[], &["cudarc"]),
    ("tlt-drafter", &[], &["cudarc"]),
    ("tlt-kernels", &[], &["candle-core", "tlt-model", "tokenizers", "cudarc"]),
    ("tlt-kernels", &["--features", "cuda"], &["candle-core", "tlt-model", "tokenizers"]),
    ("tlt-cudagraph", &[], &["candle-core", "tlt-model", "tokenizers"]),
];

/// The package names in `cargo tree` output (normal, build and dev edges), one per line.
fn tree(cargo: impl Fn() -> Command, package: &str, extra: &[&str]) -> Result<Vec<String>> {
    let mut cmd = cargo();
    cmd.args(["tree", "--prefix", "none", "--format", "{p}", "-p", package]).args(extra);
    let out = cmd.output().with_context(|| format!("running cargo tree -p {package}"))?;
    if !out.status.success() {
        bail!("cargo tree -p {package} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect())
}

/// Fails naming the first forbidden dependency found; then checks that `tlt-spec-decode` builds (with clippy)
/// without its default features.
pub fn check(cargo: impl Fn() -> Command) -> Result<()> {
    for (package, extra, forbidden) in RULES {
        let names = tree(&cargo, package, extra)?;
        if let Some(bad) = names.iter().find(|n| forbidden.contains(&n.as_str())) {
            bail!("{package} {} depends on {bad}: its README promises it does not", extra.join(" "));
        }
        info!(package, ?extra, deps = names.len(), "dependency graph as documented");
    }
    let status = cargo()
        .args(["clippy", "-p", "tlt-spec-decode", "--no-default-features", "--all-targets", "--", "-D", "warnings"])
        .status()
        .context("running clippy on tlt-spec-decode without default features")?;
    if !status.success() {
        bail!("tlt-spec-decode does not build cleanly without its default features");
    }
    Ok(())
}
