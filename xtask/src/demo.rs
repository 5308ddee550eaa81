//! `cargo xtask demo`: the main job, the `train` example's `--mode compare` on its embedded config.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;

use crate::assets;
use crate::workspace::{cargo, exit_code, run, workspace_root};

/// Options of `demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Override the number of RL steps of each run.
    #[arg(long)]
    steps: Option<u64>,
    /// A run config instead of the embedded demo config.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Data-parallel ranks (MPI processes, `mpirun -np N`; the `train` binary is then built with `--features
    /// mpi`).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Where rollouts and the policy update run: `cpu`, or `cuda[:N]` (the `train` binary built with `--features
    /// cuda`, NVRTC from the pinned wheel on the library path; cuBLAS 13 and a driver from the GPU machine).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The policy: a `.gguf` file or a Hugging Face checkpoint directory (Llama, Qwen2.5, Qwen3) instead of the
    /// fetched SmolLM2-135M-Instruct GGUF.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Both runs in one process, their steps interleaved (the order alternating), instead of one after the other
    /// in fresh processes; both trainers resident at once (one rank only).
    #[arg(long)]
    interleave: bool,
}

/// `demo`: the `train` example's `--mode compare` (built with the features `args` need) into `target/demo`.
pub(crate) fn demo(args: &DemoArgs) -> Result<ExitCode> {
    let cuda = crate::workspace::is_cuda(&args.device)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => assets::fetch_assets()?,
    };
    let out = workspace_root().join("target").join("demo");
    let mut cmd = cargo();
    cmd.args(["run", "--release", "-p", "tlt-examples", "--bin", "train"]);
    let features: Vec<&str> =
        [(args.ranks > 1, "mpi"), (cuda, "cuda")].into_iter().filter(|f| f.0).map(|f| f.1).collect();
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    if cuda {
        cmd.env("LD_LIBRARY_PATH", assets::nvrtc_library_path()?);
    }
    cmd.args(["--", "--mode", "compare", "--ranks", &args.ranks.to_string(), "--device", &args.device]);
    cmd.arg("--model").arg(&model).arg("--out").arg(&out).current_dir(workspace_root());
    if args.model.is_none() {
        cmd.env("TLT_SMOLLM2_GGUF", &model);
    }
    if let Some(s) = args.steps {
        cmd.arg("--steps").arg(s.to_string());
    }
    if let Some(c) = &args.config {
        cmd.arg("--config").arg(c);
    }
    if args.interleave {
        cmd.arg("--interleave");
    }
    let _ = std::fs::remove_dir_all(&out);
    Ok(exit_code(run(cmd)?))
}
