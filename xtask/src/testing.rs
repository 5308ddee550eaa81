//! `test`, `test-cuda` and `chaos`: the workspace's test commands.

use std::process::{Command, ExitCode};

use anyhow::{Context, Result};
use tracing::warn;

use crate::workspace::{
    all_features, cargo, cuda_package_args, exit_code, run, workspace_root, CUDA_FEATURES, CUDA_TEST_TARGETS,
};
use crate::{assets, bench, gpu_bundle, graph, package};

/// `test`: formatting, clippy, rustdoc, the graph and package checks (unless `no_lint`), then every test of the
/// workspace (see the crate's documentation); `args` go to the test runner.
pub fn test(gpu: bool, no_lint: bool, args: &[String]) -> Result<ExitCode> {
    let all = all_features();
    if !no_lint {
        // Formatting and clippy first: both are fast next to the release build, and CI should fail on them.
        let mut fmt = cargo();
        fmt.args(["fmt", "--all", "--check"]);
        let code = run(fmt)?;
        if !code.success() {
            return Ok(exit_code(code));
        }
        // Clippy once as the workspace builds and once with the CUDA and MPI code its features leave off (the
        // code under `cfg(not(feature))` and under `cfg(feature)`); rustdoc's link checks (broken and private
        // intra-doc links) once, with every feature: it documents a superset. The whole workspace is selected each
        // time, so the dependencies resolve (and build) alike.
        // The second pass adds `tlt-bench/candle-ref` (the decode and llama.cpp suites), which the tests leave out.
        let lint_all = format!("{all},tlt-bench/candle-ref");
        for features in [None, Some(lint_all.as_str())] {
            let mut clippy = cargo();
            clippy.args(["clippy", "--workspace", "--all-targets"]);
            if let Some(f) = features {
                clippy.args(["--features", f]);
            }
            clippy.args(["--", "-D", "warnings"]);
            let code = run(clippy)?;
            if !code.success() {
                return Ok(exit_code(code));
            }
        }
        let mut doc = cargo();
        doc.env("RUSTDOCFLAGS", "-D warnings").args(["doc", "--no-deps", "--workspace", "--features", &all]);
        let code = run(doc)?;
        if !code.success() {
            return Ok(exit_code(code));
        }
        graph::check(cargo)?;
        package::check(cargo)?;
    }
    let gguf = assets::fetch_assets()?;
    // Every release build below uses the same features (CUDA and MPI on), so the workspace compiles once: the
    // CUDA code runs against the simulated device (no driver here) and NVRTC compiles the kernels; the MPI tests
    // run under `mpirun`.
    let nvrtc = assets::nvrtc_library_path()?;
    let env = |cmd: &mut Command| {
        cmd.env("TLT_SMOLLM2_GGUF", &gguf).env("LD_LIBRARY_PATH", &nvrtc).env("TLT_REQUIRE_NVRTC", "1");
        // The runners run one test (or rank) per core: one kernel thread each (tlt-kernels' spinning team, rayon's
        // pool under candle), else two teams of all the cores spin on the same cores waiting for each other's
        // descheduled helpers. Tests that exercise several threads set their count explicitly.
        cmd.env("TLT_NUM_THREADS", "1").env("RAYON_NUM_THREADS", "1");
        if gpu {
            cmd.env("TLT_REQUIRE_GPU", "1");
        }
    };
    // Doc tests first (nextest does not run them), so the runner's summary of all other tests comes last.
    let mut doc = cargo();
    doc.args(["test", "--release", "--workspace", "--features", &all, "--doc"]);
    env(&mut doc);
    let code = run(doc)?;
    if !code.success() {
        return Ok(exit_code(code));
    }
    let nextest = cargo().args(["nextest", "--version"]).output().is_ok_and(|o| o.status.success());
    let mut cmd = cargo();
    if nextest {
        // The MPI tests run below under `cargo test` (one is a custom harness nextest cannot list).
        cmd.args(["nextest", "run", "--release", "--workspace", "--features", &all]);
        cmd.args(["-E", "not (binary(mpi) | binary(data_parallel) | binary(nccl) | binary(chaos))"]);
    } else {
        warn!("cargo-nextest is not installed; falling back to `cargo test`");
        cmd.args(["test", "--release", "--workspace", "--features", &all]);
        cmd.args(["--lib", "--bins", "--tests", "--exclude", "tlt-comm"]);
    }
    cmd.args(args);
    env(&mut cmd);
    // The Python checks (the EAGLE export, the frameworks' clients, torch's store) run with their packages
    // installed and required: a failed install fails the test command rather than letting their tests skip.
    let dir = assets::python_check_deps().context("installing the Python checks' packages")?;
    let mut paths = vec![dir];
    paths.extend(
        std::env::var_os("PYTHONPATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default(),
    );
    cmd.env("PYTHONPATH", std::env::join_paths(paths)?).env("TLT_REQUIRE_PYTHON_CHECK", "1");
    let code = run(cmd)?;
    if !code.success() {
        return Ok(exit_code(code));
    }
    // The export parity check needs torch, transformers and speculators (~6 GB): run only when installed.
    match assets::python_export_deps(false)? {
        Some(_) => {
            let out = workspace_root().join("target").join("export-check-tiny");
            let mut args = vec!["check-export".to_string(), "--tiny".into(), "--new-tokens".into(), "16".into()];
            args.extend(["--out".to_string(), out.display().to_string()]);
            let code = bench::run(&args)?;
            if !code.success() {
                eprintln!("error: export parity check: `tlt-bench check-export --tiny` failed ({code})");
                return Ok(ExitCode::FAILURE);
            }
        }
        None => println!(
            "SKIP export parity check (scripts/check_export_parity.py: transformers/speculators loading of exported \
             policies and drafters): its Python packages are not installed; fetch them with `{}`",
            assets::EXPORT_CHECK_FETCH
        ),
    }
    // The rollout server on the simulated device, small: HTTP against in process on the device, every output equal
    // to its twin and to SD off's (the suite fails otherwise).
    let serve = ["serve", "--device", "sim", "--prompts", "4", "--samples", "4", "--max-new-tokens", "48"];
    let serve_rest = ["--min-new-tokens", "4", "--repeats", "1", "--sd", "off,gated,always", "--concurrent", "16"];
    let args: Vec<String> = ["bench"].iter().chain(&serve).chain(&serve_rest).map(|a| a.to_string()).collect();
    let code = bench::run_as_tested(&args)?;
    if !code.success() {
        eprintln!("error: `cargo xtask {}` failed ({code})", args.join(" "));
        return Ok(ExitCode::FAILURE);
    }
    // The MPI engine across processes (`mpirun -np 2` and 3), data-parallel GRPO on 2 ranks against one (a missing
    // MPI runtime fails here rather than skipping), NCCL's error without a driver, and the chaos harness at its
    // default size (it kills ranks of 2-rank jobs): the build above, linked.
    let mut mpi = cargo();
    mpi.args(["test", "--release", "--workspace", "--features", &all]);
    mpi.args(["--test", "mpi", "--test", "data_parallel", "--test", "nccl", "--test", "chaos", "--", "--nocapture"]);
    mpi.env("TLT_REQUIRE_MPI", "1");
    env(&mut mpi);
    let code = run(mpi)?;
    if !code.success() {
        return Ok(exit_code(code));
    }
    // The GPU plan's calls, with their GPU steps stubbed (gpu-bench on the simulated device, as the release tests
    // above built it; tlt-bench's serve suite there, as built for the run above): the device tool's file and output
    // rules and the plan's budgets hold.
    let root = workspace_root();
    let (bench, train) = (root.join("target/release/gpu-bench"), root.join("target/release/train"));
    if let Err(e) = gpu_bundle::dry_run(&root, &bench, &train, &root.join("target/release/tlt-bench"), &gguf) {
        eprintln!("error: gpu-bundle dry run: {e:#}");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// `chaos`: the chaos harness (`examples/tests/chaos.rs`) at the asked size, with every feature (`train` has its
/// kill points), MPI required; the tally goes to `target/chaos/report.json`.
pub fn chaos(kills: usize, rank_kills: usize, seed: u64) -> Result<ExitCode> {
    let report = workspace_root().join("target").join("chaos").join("report.json");
    let mut cmd = cargo();
    cmd.args(["test", "--release", "--workspace", "--features", &all_features(), "--test", "chaos"]);
    cmd.args(["--", "--nocapture", "--test-threads", "1"]);
    cmd.env("TLT_CHAOS_KILLS", kills.to_string()).env("TLT_CHAOS_RANK_KILLS", rank_kills.to_string());
    cmd.env("TLT_CHAOS_SEED", seed.to_string()).env("TLT_CHAOS_REPORT", &report).env("TLT_REQUIRE_MPI", "1");
    let code = run(cmd)?;
    if code.success() {
        println!("chaos report: {}", report.display());
    }
    Ok(exit_code(code))
}

/// `test-cuda`: the CUDA path's tests alone, with the CUDA features: NVRTC compiles of our kernels for sm_80 and
/// sm_90 with no spills, and the device tests of every package on the CUDA device when a driver loads (with `gpu`,
/// a missing driver fails them), else on the simulated device.
pub fn cuda_tests(gpu: bool) -> Result<ExitCode> {
    let lib_path = assets::nvrtc_library_path()?;
    let mut cuda = cargo();
    cuda.args(["test", "--release"])
        .args(cuda_package_args())
        .args(["--features", CUDA_FEATURES])
        .args(CUDA_TEST_TARGETS.iter().flat_map(|t| ["--test", t]))
        .args(["--", "--nocapture"])
        .env("LD_LIBRARY_PATH", lib_path)
        .env("TLT_REQUIRE_NVRTC", "1");
    if gpu {
        cuda.env("TLT_REQUIRE_GPU", "1");
    }
    Ok(exit_code(run(cuda)?))
}
