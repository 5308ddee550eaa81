//! What every command shares: the workspace's root and cargo, running a child command and passing on its exit
//! code, the device names, and the feature sets and packages of the optional CUDA and MPI code. It imports no other
//! module of this crate, so that the commands import it and main.rs only parses the command line and dispatches.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};

use anyhow::{bail, Context, Result};
use tracing::info;

/// Whether `device` names a CUDA device (`cuda` or `cuda:N`); an error for anything but those and `cpu`. The
/// names `tlt_model::Device` parses, which `tlt-bench` checks again; this crate does not link `tlt-model`.
pub fn is_cuda(device: &str) -> Result<bool> {
    match device.split_once(':') {
        None if device == "cpu" => Ok(false),
        None if device == "cuda" => Ok(true),
        Some(("cuda", n)) if n.parse::<usize>().is_ok() => Ok(true),
        _ => bail!("device must be cpu, cuda or cuda:N, got {device:?}"),
    }
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The cargo that runs us (`$CARGO`), or `cargo` from `PATH`.
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

/// Maps a child's exit status to ours (a signal becomes 1).
pub fn exit_code(status: ExitStatus) -> ExitCode {
    match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    }
}

/// Every feature of the workspace's optional code: CUDA (with `tlt-examples`') and MPI/NCCL.
pub fn all_features() -> String {
    format!("{CUDA_FEATURES},tlt-examples/cuda,{MPI_FEATURES},tlt-examples/failpoints")
}

/// The test targets of the CUDA path: the NVRTC and GPU-kernel tests (`cuda`), and the device tests of the host
/// code (`device`, `gpu`), which run on the CUDA device when a driver loads, else on the simulated one.
pub const CUDA_TEST_TARGETS: [&str; 3] = ["cuda", "device", "gpu"];

/// The features that turn the CUDA code on, for the packages that have it.
pub const CUDA_FEATURES: &str =
    "tlt-kernels/cuda,tlt-cudagraph/cuda,tlt-model/cuda,tlt-spec-decode/cuda,tlt-drafter/cuda,tlt-rl/cuda,tlt-serve/cuda";

/// The features that turn the MPI and NCCL engines on, and data-parallel training with them.
pub const MPI_FEATURES: &str = "tlt-comm/mpi,tlt-comm/nccl,tlt-rl/mpi,tlt-examples/mpi";

/// The packages with CUDA code (each has a `cuda` test target).
pub const CUDA_PACKAGES: [&str; 7] =
    ["tlt-kernels", "tlt-cudagraph", "tlt-model", "tlt-spec-decode", "tlt-drafter", "tlt-rl", "tlt-serve"];

/// `-p P` for every package of [`CUDA_PACKAGES`].
pub fn cuda_package_args() -> Vec<&'static str> {
    CUDA_PACKAGES.iter().flat_map(|p| ["-p", p]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        assert!(!is_cuda("cpu").unwrap());
        assert!(is_cuda("cuda").unwrap());
        assert!(is_cuda("cuda:1").unwrap());
        assert!(is_cuda("cuda:x").is_err());
        assert!(is_cuda("gpu").is_err());
        assert!(is_cuda("cpu:0").is_err());
    }
}
