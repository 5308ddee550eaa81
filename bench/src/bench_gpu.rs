//! `cargo xtask bench decode|spec --device cuda[:N]`: the GPU suites. Builds `gpu-bench` (tlt-examples with
//! `--features cuda`; no CUDA toolkit needed to build) and runs it per architecture with NVRTC from the pinned wheel on
//! the library path (`cargo xtask` puts it there for a CUDA `--device`; cuBLAS 13 must be installed on the GPU
//! machine): batched decode with and without CUDA graphs
//! against the measured copy bandwidth, verify-k over decode-1, and the engine on the device with a perfect oracle
//! drafter at several tokens per round. JSON and markdown per architecture in `target/bench/`.

use std::process::Command;

use anyhow::{bail, Context, Result};
use tracing::info;

/// Whether `device` names a CUDA device (`cuda` or `cuda:N`); an error for anything but those and `cpu`.
pub fn is_cuda(device: &str) -> Result<bool> {
    device.parse::<tlt_model::Device>().map(tlt_model::Device::is_cuda).map_err(anyhow::Error::msg)
}

/// Runs `gpu-bench` on `device` for each of `archs`, with `extra` arguments.
pub fn run(device: &str, archs: &[&str], extra: &[&str]) -> Result<()> {
    let status = crate::env::cargo()
        .args(["build", "--release", "-p", "tlt-examples", "--features", "cuda", "--bin", "gpu-bench"])
        .status()
        .context("cargo build gpu-bench")?;
    if !status.success() {
        bail!("building gpu-bench failed");
    }
    let root = crate::env::workspace_root();
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    for arch in archs {
        let json = out_dir.join(format!("gpu-{arch}.json"));
        info!(arch, device, json = %json.display(), "gpu-bench");
        let out = Command::new(root.join("target/release/gpu-bench"))
            .args(["--arch", arch, "--device", device, "--out"])
            .arg(&json)
            .args(extra)
            .output()
            .context("running gpu-bench")?;
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        if !out.status.success() {
            bail!("gpu-bench --arch {arch} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::fs::write(out_dir.join(format!("gpu-{arch}.md")), text.as_bytes())?;
    }
    Ok(())
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
    }
}
