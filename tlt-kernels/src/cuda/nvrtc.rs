//! Compiling our CUDA sources with NVRTC, loaded at run time (no toolkit and no GPU needed).

use std::ffi::{c_char, CString};

use cudarc::nvrtc::{result, sys};

use super::{nvrtc_options, parse_ptxas_log, KernelSource, KernelUsage};
use crate::error::{Error, Result};

/// Whether the NVRTC library (`libnvrtc.so.13` on `LD_LIBRARY_PATH`) can be loaded. Never panics.
#[must_use]
pub fn nvrtc_available() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and drops what it opened.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// One source compiled for one architecture.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The source file.
    pub file: &'static str,
    /// The compute capability (90 for `sm_90`).
    pub arch: u32,
    /// The CUBIN image (loadable with `cuModuleLoadData`).
    pub cubin: Vec<u8>,
    /// NVRTC's log (warnings and ptxas's resource report).
    pub log: String,
    /// Per-kernel resources parsed from the log (empty for a cached compile).
    pub kernels: Vec<KernelUsage>,
}

fn log_text(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn nvrtc_err(op: &'static str) -> impl Fn(result::NvrtcError) -> Error {
    move |e| Error::Cuda { op, message: format!("{e:?}") }
}

/// Compiles `source` for compute capability `arch` (e.g. 80, 90) to a CUBIN, with ptxas's resource report
/// (bypassing NVRTC's cache: see [`nvrtc_options`]).
///
/// # Errors
/// [`Error::CudaUnavailable`] when NVRTC cannot be loaded, [`Error::CudaCompile`] (with NVRTC's log) when the source
/// does not compile, [`Error::Cuda`] when an NVRTC call fails otherwise.
pub fn compile(source: &KernelSource, arch: u32) -> Result<Compiled> {
    compile_with(source, arch, true)
}

/// As [`compile`], but NVRTC may serve the CUBIN from the driver's cache, with no report ([`Compiled::kernels`]
/// may then be empty): for loading kernels on a device.
///
/// # Errors
/// As [`compile`].
pub fn compile_cached(source: &KernelSource, arch: u32) -> Result<Compiled> {
    compile_with(source, arch, false)
}

fn compile_with(source: &KernelSource, arch: u32, report: bool) -> Result<Compiled> {
    if !nvrtc_available() {
        return Err(Error::CudaUnavailable(
            "the NVRTC library (libnvrtc.so.13) could not be loaded; put its directory on LD_LIBRARY_PATH \
             (`cargo xtask test` fetches it from the nvidia-cuda-nvrtc wheel)"
                .into(),
        ));
    }
    let text = CString::new(source.full_source())
        .map_err(|_| Error::InvalidArgument(format!("{}: the source contains a NUL byte", source.file)))?;
    let name = CString::new(source.file)
        .map_err(|_| Error::InvalidArgument(format!("{}: the file name contains a NUL byte", source.file)))?;
    let prog = result::create_program(&text, Some(&name)).map_err(nvrtc_err("nvrtcCreateProgram"))?;
    let out = (|| {
        // SAFETY: `prog` was created above and is destroyed only after this closure.
        let compiled = unsafe { result::compile_program(prog, &nvrtc_options(arch, report)) };
        // SAFETY: as above.
        let log = log_text(&unsafe { result::get_program_log(prog) }.map_err(nvrtc_err("nvrtcGetProgramLog"))?);
        if let Err(e) = compiled {
            return Err(Error::CudaCompile { file: source.file, arch, log: format!("{e:?}: {log}") });
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; NVRTC writes the size, then exactly that many bytes.
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(nvrtc_err("nvrtcGetCUBINSize"))?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` holds `size` bytes, as NVRTC asked.
        unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }.result().map_err(nvrtc_err("nvrtcGetCUBIN"))?;
        let kernels = parse_ptxas_log(&log);
        Ok(Compiled { file: source.file, arch, cubin, log, kernels })
    })();
    // SAFETY: `prog` is not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}
