//! The CUDA side of the kernels: CUDA C sources compiled at run time by NVRTC, their launch plans, and the device
//! seam the host code of the GPU path runs on.
//!
//! What is here without any feature: the sources ([`SOURCES`]), the NVRTC options ([`nvrtc_options`]) and the
//! parser of ptxas's resource report ([`parse_ptxas_log`]); the launch plans ([`plan`]); the device seam ([`gpu`]:
//! the [`Gpu`] trait, device buffers, pinned memory, events and graphs) and the host code written on it (the packed
//! transfers [`Staged`] and [`Fetched`], the scratch [`Recycler`], [`DeviceLinear`]). With the `cuda` feature:
//! `compile` (NVRTC only, no GPU needed: this is what CI runs for sm_80 and sm_90, failing on a compile error or a
//! register spill) and `CudaGpu`, the seam on a CUDA device through cudarc. Every entry point returns an error,
//! never panics, when the NVRTC library or the driver is missing.

#[cfg(feature = "cuda")]
mod device;
pub mod gpu;
mod layer;
#[cfg(feature = "cuda")]
mod nvrtc;
pub mod packing;
pub mod plan;
mod recycle;
mod shapes;
mod transfer;

#[cfg(feature = "cuda")]
pub use device::{driver_available, gpu_or_skip, CudaGpu, CUBLAS_WORKSPACE_BYTES};

/// Opens CUDA device `ordinal` behind the seam (`CudaGpu::open`, feature `cuda`).
///
/// # Errors
/// As `CudaGpu::open`; in a build without the `cuda` feature, [`crate::Error::CudaUnavailable`].
pub fn open_device(ordinal: usize) -> crate::Result<SharedGpu> {
    #[cfg(feature = "cuda")]
    {
        Ok(CudaGpu::open(ordinal)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(crate::Error::CudaUnavailable(format!("cuda:{ordinal}: tlt-kernels was built without the `cuda` feature")))
    }
}

/// Whether a CUDA driver library can be loaded (always `false` in a build without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
#[must_use]
pub fn driver_available() -> bool {
    false
}
pub use gpu::{DeviceBuf, DeviceMem, Elem, Gpu, GpuEvent, GpuGraph, GpuInfo, PinnedMem, SharedGpu};
pub use layer::DeviceLinear;
#[cfg(feature = "cuda")]
pub use nvrtc::{compile, compile_cached, nvrtc_available, Compiled};
pub use recycle::{Recycler, Scratch};
pub use shapes::{
    ancestor_masks, check_device_attn, CacheDims, TreeDims, MAX_GROUP, MAX_HEAD_DIM, MAX_TOP_K, MAX_TREE_NODES,
};
pub use transfer::{Fetched, Staged};

/// The header every source is compiled with (bf16 helpers, warp reductions).
pub const PRELUDE: &str = include_str!("../../cuda/prelude.cuh");

/// One CUDA C file of ours and the `extern "C"` kernels it defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// The file name under `tlt-kernels/cuda/`.
    pub file: &'static str,
    /// Its text (without the prelude).
    pub text: &'static str,
    /// The kernels it defines.
    pub kernels: &'static [&'static str],
}

impl KernelSource {
    /// The prelude followed by the file: what NVRTC compiles.
    #[must_use]
    pub fn full_source(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}\"\n{}", self.file, self.text)
    }
}

/// Every CUDA source of the crate.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "attention.cu",
        text: include_str!("../../cuda/attention.cu"),
        kernels: &[
            "rope_kv_write_bf16",
            "tree_attention_bf16",
            "attention_split_bf16",
            "qkv_rope_kv_write_bf16",
            "mma_bf16_probe",
        ],
    },
    KernelSource {
        file: "layer.cu",
        text: include_str!("../../cuda/layer.cu"),
        kernels: &[
            "embed_rows_bf16",
            "rms_norm_bf16",
            "head_rms_norm_bf16",
            "add_bf16_to_f32",
            "silu_mul_bf16",
            "bias_add_bf16",
            "fill_uniform_bf16",
            "add_rms_norm_bf16",
            "silu_mul_packed_bf16",
        ],
    },
    KernelSource { file: "skinny.cu", text: include_str!("../../cuda/skinny.cu"), kernels: &["skinny_gemm_bf16"] },
    KernelSource {
        file: "kv.cu",
        text: include_str!("../../cuda/kv.cu"),
        kernels: &["commit_path_bf16", "gather_path_rows_bf16"],
    },
    KernelSource {
        file: "draft.cu",
        text: include_str!("../../cuda/draft.cu"),
        kernels: &["concat_rows_bf16", "top_k_rows_f32"],
    },
    KernelSource {
        file: "draft_train.cu",
        text: include_str!("../../cuda/draft_train.cu"),
        kernels: &["soft_ce_f32", "soft_ce_back_f32", "smooth_l1_f32", "smooth_l1_back_f32"],
    },
    KernelSource {
        file: "sampling.cu",
        text: include_str!("../../cuda/sampling.cu"),
        kernels: &["sample_rows_f32", "tree_accept"],
    },
    KernelSource {
        file: "train.cu",
        text: include_str!("../../cuda/train.cu"),
        kernels: &[
            "rope_rows_bf16",
            "rope_rows_back_f32",
            "rms_norm_back_f32",
            "col_sum_f32",
            "silu_mul_back_bf16",
            "token_logprobs_f32",
            "token_logprobs_back_f32",
            "embed_back_f32",
            "sum_squares_f32",
            "adamw_f32",
            "cast_f32_bf16",
            "add_f32",
            "scale_f32",
            "lora_merge_bf16",
        ],
    },
    KernelSource {
        file: "train_attention.cu",
        text: include_str!("../../cuda/train_attention.cu"),
        kernels: &["train_attention_fwd_bf16", "train_attention_back_dq_bf16", "train_attention_back_dkv_bf16"],
    },
];

/// The architectures CI compiles for: Ampere (A100) and Hopper (H100/H200).
pub const CI_ARCHS: &[u32] = &[80, 90];

/// NVRTC options for compute capability `arch` (e.g. 90 for `sm_90`): a real-architecture CUBIN and C++17; with
/// `report`, ptxas's resource report in the log and `--no-cache`.
///
/// NVRTC 13 serves CUBINs it compiled before from the driver's compute cache when a driver is loaded, and a cached
/// CUBIN comes with no ptxas report: on the first GPU run the compile test found an empty sm_90 log for every kernel
/// the model tests had already compiled there ("no ptxas report for rope_kv_write_bf16"). A compile that needs the
/// report must bypass the cache; loading kernels for a device keeps it (faster start).
#[must_use]
pub fn nvrtc_options(arch: u32, report: bool) -> Vec<String> {
    let mut o =
        vec![format!("--gpu-architecture=sm_{arch}"), "--std=c++17".into(), "--extra-device-vectorization".into()];
    if report {
        o.extend(["--ptxas-options=-v".into(), "--no-cache".into()]);
    }
    o
}

/// One kernel's resources as ptxas reported them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelUsage {
    /// The kernel's (unmangled, `extern "C"`) name.
    pub name: String,
    /// The architecture it was compiled for, as ptxas names it (`sm_90`).
    pub arch: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of register spill stores (0 for a healthy kernel).
    pub spill_stores: u32,
    /// Bytes of register spill loads.
    pub spill_loads: u32,
    /// Bytes of local stack frame.
    pub stack_bytes: u32,
    /// Bytes of static shared memory.
    pub shared_bytes: u32,
}

impl KernelUsage {
    /// Whether ptxas spilled registers to local memory.
    #[must_use]
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// The number just before `unit` in `text` ("40 registers" -> 40), if any.
fn number_before(text: &str, unit: &str) -> Option<u32> {
    let at = text.find(unit)?;
    text[..at].split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty()).and_then(|s| s.parse().ok())
}

/// Parses ptxas's `-v` report (as NVRTC returns it in the program log) into one entry per kernel, in order.
///
/// The report has, per kernel: `Compiling entry function 'NAME' for 'sm_90'`, then `N bytes stack frame, N bytes
/// spill stores, N bytes spill loads`, then `Used N registers, ... N bytes smem, ...`. Lines of other shapes are
/// ignored.
#[must_use]
pub fn parse_ptxas_log(log: &str) -> Vec<KernelUsage> {
    let mut out: Vec<KernelUsage> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let mut parts = rest.split('\'');
            let name = parts.next().unwrap_or_default().to_string();
            let arch = parts.nth(1).unwrap_or_default().to_string();
            out.push(KernelUsage { name, arch, ..KernelUsage::default() });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("spill stores") {
            cur.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used") && line.contains("registers") {
            cur.registers = number_before(line, "registers").unwrap_or(0);
            cur.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'tree_attention_bf16' for 'sm_90'\n\
ptxas info    : Function properties for tree_attention_bf16\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 37504 bytes smem, 428 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'sample_rows_f32' for 'sm_90'\n\
ptxas info    : Function properties for sample_rows_f32\n\
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 255 registers, used 1 barriers, 2096 bytes smem, 400 bytes cmem[0]\n";

    #[test]
    fn ptxas_report_is_parsed_per_kernel() {
        let k = parse_ptxas_log(LOG);
        assert_eq!(k.len(), 2);
        assert_eq!(
            k[0],
            KernelUsage {
                name: "tree_attention_bf16".into(),
                arch: "sm_90".into(),
                registers: 40,
                spill_stores: 0,
                spill_loads: 0,
                stack_bytes: 0,
                shared_bytes: 37504,
            }
        );
        assert!(!k[0].spills());
        assert_eq!((k[1].registers, k[1].spill_stores, k[1].spill_loads, k[1].stack_bytes), (255, 8, 12, 16));
        assert!(k[1].spills(), "a spilling kernel must be flagged");
        assert!(parse_ptxas_log("nothing here\n").is_empty());
    }

    #[test]
    fn a_compile_for_its_report_bypasses_the_driver_cache() {
        let with = nvrtc_options(90, true);
        assert!(with.contains(&"--no-cache".to_string()) && with.contains(&"--ptxas-options=-v".to_string()));
        assert!(!nvrtc_options(90, false).iter().any(|o| o == "--no-cache" || o.starts_with("--ptxas")));
        // A cached CUBIN's log (what NVRTC 13 returned for sm_90 on the first GPU run, after the model tests had
        // compiled the same sources there) has no report: the parser finds nothing, so the compile test fails
        // loudly instead of passing a kernel it never saw.
        assert!(parse_ptxas_log("").is_empty());
    }

    #[test]
    fn every_declared_kernel_is_defined_in_its_source() {
        for s in SOURCES {
            for k in s.kernels {
                let name = format!(" {k}(");
                let defined = s.text.lines().any(|l| l.contains("extern \"C\" __global__") && l.contains(&name));
                assert!(defined, "{} does not define {k}", s.file);
            }
            let count = s.text.matches("__global__").count();
            assert_eq!(count, s.kernels.len(), "{}: kernels defined but not declared in SOURCES", s.file);
            assert!(!s.text.contains("#include"), "{}: NVRTC has no standard headers", s.file);
        }
    }
}
