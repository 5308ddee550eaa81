//! `cargo xtask bench|roofline|fuzz|check-export`: commands of `tlt-bench` (`bench/`), the crate that links the
//! model crates, run as a process with the same arguments, so that `cargo xtask` itself builds from light crates
//! only.
//!
//! This side does what needs no model code: it fetches the assets the command reads and hands their paths over in
//! the environment (`bench/src/env.rs` reads them), puts NVRTC on the library path for a CUDA `--device`, and
//! builds `tlt-bench` with the features of the release tests (`--workspace --features <all>`), so that after
//! `cargo xtask test` only the `tlt-bench` binary itself is compiled.

use std::ffi::OsString;
use std::process::{Command, ExitCode, ExitStatus};

use anyhow::{bail, Context, Result};

use crate::assets;
use crate::workspace::{all_features, cargo, exit_code, workspace_root};

/// Where `tlt-bench` finds the SmolLM2 GGUF (`bench/src/env.rs`'s `GGUF_VAR`; the tests read it too).
const GGUF_VAR: &str = "TLT_SMOLLM2_GGUF";
/// Where `tlt-bench` finds the asset cache (`bench/src/env.rs`'s `CACHE_VAR`).
const CACHE_VAR: &str = "TLT_CACHE";
/// Where `tlt-bench` finds the export check's Python packages (`bench/src/env.rs`'s `PYEXPORT_VAR`).
const PYEXPORT_VAR: &str = "TLT_PYEXPORT_DEPS";

/// The suites that read the SmolLM2 GGUF, and whether a `--model` of theirs replaces it.
const GGUF_SUITES: [(&str, bool); 8] = [
    ("decode", true),
    ("spec", true),
    ("drafter", true),
    ("llamacpp", true),
    ("rollout", false),
    ("group", false),
    ("serve", false),
    ("e2e", false),
];

/// `cargo xtask <command> <args>`: `tlt-bench <command> <args>`, with its exit status.
pub fn forward(command: &str, args: Vec<String>) -> Result<ExitCode> {
    let mut all = vec![command.to_string()];
    all.extend(args);
    Ok(exit_code(run(&all)?))
}

/// Builds `tlt-bench` and runs it with `args` (its command first) and the environment the command needs.
pub fn run(args: &[String]) -> Result<ExitStatus> {
    // `candle-ref`: the decode and llama.cpp suites' reference, which the test build leaves out.
    run_with(args, &format!("{},tlt-bench/candle-ref", all_features()))
}

/// [`run`] built with the release tests' features (no `candle-ref`: no suite that needs it), so that `cargo xtask
/// test` compiles nothing but the binary.
pub fn run_as_tested(args: &[String]) -> Result<ExitStatus> {
    run_with(args, &all_features())
}

fn run_with(args: &[String], features: &str) -> Result<ExitStatus> {
    let env = environment(args)?;
    let status = cargo()
        .args(["build", "--release", "--quiet", "--workspace", "--bin", "tlt-bench"])
        .args(["--features", features])
        .status()
        .context("cargo build tlt-bench")?;
    if !status.success() {
        bail!("building tlt-bench failed");
    }
    let exe = workspace_root().join("target/release/tlt-bench");
    let mut cmd = Command::new(&exe);
    cmd.args(args).current_dir(workspace_root()).envs(env);
    cmd.status().with_context(|| format!("starting {}", exe.display()))
}

/// The variables `tlt-bench` reads for `args`: the cache always, the GGUF (fetched) for the commands that read it,
/// NVRTC's library path for a CUDA device, the Python packages for `check-export` when installed. Nothing is
/// fetched for `--help`.
fn environment(args: &[String]) -> Result<Vec<(&'static str, OsString)>> {
    let mut env = vec![(CACHE_VAR, assets::cache_dir().into_os_string())];
    if args.iter().any(|a| a == "--help" || a == "-h") {
        return Ok(env);
    }
    if needs_gguf(args) {
        env.push((GGUF_VAR, assets::fetch_assets()?.into_os_string()));
    }
    if let Some(device) = flag_value(args, "--device") {
        // An unknown name is `tlt-bench`'s to report, with its own message.
        if crate::workspace::is_cuda(device).unwrap_or(false) {
            env.push(("LD_LIBRARY_PATH", assets::nvrtc_library_path()?));
        }
    }
    if args.first().is_some_and(|c| c == "check-export") {
        if let Some(dir) = assets::python_export_deps(false)? {
            env.push((PYEXPORT_VAR, dir.into_os_string()));
        }
    }
    Ok(env)
}

/// Whether the command of `args` reads the SmolLM2 GGUF: `fuzz` (its seeds), and the suites of [`GGUF_SUITES`]
/// unless their `--model` names another file.
fn needs_gguf(args: &[String]) -> bool {
    match args {
        [command, ..] if command == "fuzz" => true,
        [command, suite, rest @ ..] if command == "bench" => GGUF_SUITES
            .iter()
            .any(|(s, replaceable)| s == suite && !(*replaceable && flag_value(rest, "--model").is_some())),
        _ => false,
    }
}

/// The value of `--flag V` or `--flag=V` in `args` (the last one given, as clap reads it).
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let mut value = None;
    for (i, a) in args.iter().enumerate() {
        if a == flag {
            value = args.get(i + 1).map(String::as_str);
        } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            value = Some(v);
        }
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_gguf_is_fetched_for_the_commands_that_read_it() {
        assert!(needs_gguf(&words("fuzz gguf --minutes 1")));
        assert!(needs_gguf(&words("bench decode --batches 1")));
        assert!(!needs_gguf(&words("bench decode --model /m.gguf")));
        assert!(!needs_gguf(&words("bench spec --model=/m.gguf")));
        assert!(needs_gguf(&words("bench e2e --model /m.gguf")), "e2e has no --model: the flag is not its");
        assert!(!needs_gguf(&words("bench kernels")));
        assert!(!needs_gguf(&words("bench ranks")));
        assert!(!needs_gguf(&words("roofline")));
        assert!(!needs_gguf(&words("bench")));
    }

    #[test]
    fn flag_values() {
        assert_eq!(flag_value(&words("bench decode --device cuda:1"), "--device"), Some("cuda:1"));
        assert_eq!(flag_value(&words("bench decode --device=cuda"), "--device"), Some("cuda"));
        assert_eq!(flag_value(&words("bench decode --device cpu --device cuda"), "--device"), Some("cuda"));
        assert_eq!(flag_value(&words("bench decode --devices 2"), "--device"), None);
        assert_eq!(flag_value(&words("bench decode --device"), "--device"), None);
    }
}
