//! `cargo package` in `cargo xtask test`: every crate of the workspace packs into a `.crate` whose dependencies
//! resolve (the workspace's crates through cargo's local overlay of each other), and the crates whose build reads
//! files (tlt-kernels hands its CUDA sources to tlt-cuda-sim's build script through `links` metadata) build from
//! their packages. The other crates are not rebuilt from their packages: that would be a second full build of the
//! workspace in CI, and their sources read nothing outside their own directories (`include_str!` of their own
//! READMEs and kernels).

use std::process::Command;

use anyhow::{bail, Context, Result};
use tracing::info;

/// The crates verified by building them from their packages.
const VERIFIED: [&str; 2] = ["tlt-kernels", "tlt-cuda-sim"];

/// Runs `cargo package --workspace --no-verify`, then `cargo package` with its build for [`VERIFIED`].
pub fn check(cargo: impl Fn() -> Command) -> Result<()> {
    let mut all = cargo();
    all.args(["package", "--workspace", "--no-verify", "--allow-dirty", "--quiet"]);
    run(all, "cargo package --workspace --no-verify")?;
    let mut built = cargo();
    built.args(["package", "--allow-dirty", "--quiet"]).args(VERIFIED.iter().flat_map(|p| ["-p", p]));
    run(built, "cargo package (built from the packages)")?;
    info!(verified = ?VERIFIED, "every crate packages; the crates whose build reads files build from their packages");
    Ok(())
}

fn run(mut cmd: Command, what: &str) -> Result<()> {
    info!(command = ?cmd, "running");
    let status = cmd.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} failed");
    }
    Ok(())
}
