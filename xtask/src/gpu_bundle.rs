//! `cargo xtask gpu-bundle`: the CUDA tests and the GPU benchmark built here (no toolkit needed), stripped, with a
//! script that runs them on a GPU machine that has a driver and NVRTC/cuBLAS 13 but no Rust toolchain (the lent H100:
//! PyTorch cu130's `nvidia-*` wheels or the CUDA toolkit provide the libraries). Send `target/gpu-bundle` there and
//! run `gpu-bundle/run.sh`; results land in `$OUT` (or `gpu-bundle/out`). With `--weights`, SmolLM2's GGUF is also
//! split into parts sent by earlier calls ([`split_weights`]), which `run.sh` reassembles for the real-weights tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use tracing::{info, warn};

/// What `run.sh` does on the GPU machine.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# The CUDA tests (TLT_REQUIRE_GPU=1: a missing driver fails them) and the decode benchmark, on a GPU machine with no
# Rust toolchain. Libraries: NVRTC 13 and cuBLAS 13 from the Python environment's nvidia-* wheels or the toolkit.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
dirs = set()
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for name in ("libnvrtc.so.13", "libcublas.so.13", "libcublasLt.so.13"):
        for so in glob.glob(os.path.join(base, "nvidia", "**", name), recursive=True):
            dirs.add(os.path.dirname(so))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export TLT_REQUIRE_GPU=1 TLT_REQUIRE_NVRTC=1 RUST_BACKTRACE=1
# SmolLM2's real weights, sent in parts by earlier calls (`cargo xtask gpu-bundle --weights`): reassembled and checked.
parts=$(ls "$here"/../gpu-weights/part-*/smollm2.gguf.part 2>/dev/null | sort -V)
if [ -n "$parts" ]; then
    gguf="$here/../gpu-weights/SmolLM2-135M-Instruct.Q4_1.gguf"
    cat $parts > "$gguf"
    if echo "$(cat "$here"/../gpu-weights/part-1/sha256)  $gguf" | sha256sum -c - > "$out/weights.txt" 2>&1; then
        export TLT_SMOLLM2_GGUF="$gguf" TLT_REQUIRE_SMOLLM2=1
    else
        echo "SmolLM2 parts do not reassemble to the expected file (see $out/weights.txt)"
    fi
fi
{ nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; ldconfig -p | grep -E 'libcuda.so|nvrtc|cublas'; } > "$out/env.txt" 2>&1
status=0
for t in "$here"/bin/test-*; do
    echo "== $(basename "$t")"
    "$t" --nocapture --test-threads=1 > "$out/$(basename "$t").log" 2>&1 || { status=1; echo "FAILED (see $out/$(basename "$t").log)"; }
    grep -E "^test |test result" "$out/$(basename "$t").log"
done
for arch in ${ARCHS:-smollm2-135m llama3-8b}; do
    echo "== gpu-bench $arch"
    "$here/bin/gpu-bench" --arch "$arch" --out "$out/decode-$arch.json" > "$out/decode-$arch.md" 2>&1 || status=1
    cat "$out/decode-$arch.md"
done
# The peer: HF transformers + PyTorch on the same GPU (eager generate, static cache + torch.compile).
for arch in ${HF_ARCHS:-smollm2-135m}; do
    echo "== transformers $arch"
    python3 "$here/hf_decode_bench.py" --arch "$arch" --batches "${HF_BATCHES:-1,64}" --out "$out/hf-$arch.json" > "$out/hf-$arch.md" 2>&1 || status=1
    cat "$out/hf-$arch.md"
done
exit $status
"#;

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
    // Test executables, found from cargo's JSON messages.
    let mut tests = cargo();
    tests
        .args(["test", "--release", "--no-run", "--message-format=json", "--features", crate::CUDA_FEATURES])
        .args(crate::cuda_package_args())
        .args(["--test", "cuda"])
        .stderr(Stdio::inherit());
    let out = tests.output().context("cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the CUDA test executables failed");
    }
    let mut copied = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(exe), Some(pkg)) = (msg["executable"].as_str(), msg["package_id"].as_str()) else { continue };
        let name = crate::CUDA_PACKAGES.into_iter().find(|p| pkg.contains(p)).unwrap_or("x");
        copied.push((PathBuf::from(exe), bin.join(format!("test-{name}"))));
    }
    if copied.len() != crate::CUDA_PACKAGES.len() {
        bail!("expected {} CUDA test executables, found {}", crate::CUDA_PACKAGES.len(), copied.len());
    }
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
    std::fs::copy(root.join("scripts/hf_decode_bench.py"), dir.join("hf_decode_bench.py"))?;
    let run = dir.join("run.sh");
    std::fs::write(&run, RUN_SH)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755))?;
    }
    let bytes: u64 = copied.iter().filter_map(|(_, to)| std::fs::metadata(to).ok()).map(|m| m.len()).sum();
    info!(dir = %dir.display(), mb = bytes / 1_000_000, "GPU bundle ready: send it and run gpu-bundle/run.sh");
    Ok(dir)
}
