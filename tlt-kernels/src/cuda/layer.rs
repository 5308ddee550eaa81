//! Launches of the decoder layer's element-wise and row-wise kernels (`layer.cu`) and the bf16 GEMM (cuBLAS).

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;

use super::device::{drv, CudaKernels, Ptrs};
use super::plan::{self, Buf, GemmEx, GemmY};
use crate::error::{Error, Result};

impl CudaKernels {
    /// `x[r] = table[tokens[r]]` (bf16 rows to the f32 residual stream; [`plan::embed_rows`]).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for buffers that disagree with the shapes, [`Error::Cuda`] when the launch fails.
    /// Token ids are the caller's to keep below `vocab` (the model checks them on the host).
    pub fn embed_rows(
        &self,
        stream: &CudaStream,
        rows: usize,
        width: usize,
        table: &CudaSlice<bf16>,
        tokens: &CudaSlice<i32>,
        x: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let (table, tokens, x) = (p.r(table), p.r(tokens), p.w(x));
        self.run(stream, &plan::embed_rows(rows, width, table, tokens, x)?)
    }

    /// `out = rmsnorm(x) * w` per row ([`plan::rms_norm`]).
    ///
    /// # Errors
    /// As [`CudaKernels::embed_rows`].
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        stream: &CudaStream,
        rows: usize,
        width: usize,
        eps: f32,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let (x, w, out) = (p.r(x), p.r(w), p.w(out));
        self.run(stream, &plan::rms_norm(rows, width, eps, x, w, out)?)
    }

    /// Qwen3's q/k norms ([`plan::head_rms_norm`]).
    ///
    /// # Errors
    /// As [`CudaKernels::embed_rows`].
    pub fn head_rms_norm(
        &self,
        stream: &CudaStream,
        head_dim: usize,
        eps: f32,
        x: &mut CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let (x, w) = (p.w(x), p.r(w));
        match plan::head_rms_norm(head_dim, eps, x, w)? {
            Some(l) => self.run(stream, &l),
            None => Ok(()),
        }
    }

    /// `x += y` (the residual add; [`plan::add_to_residual`]).
    ///
    /// # Errors
    /// As [`CudaKernels::embed_rows`].
    pub fn add_to_residual(&self, stream: &CudaStream, x: &mut CudaSlice<f32>, y: &CudaSlice<bf16>) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let (x, y) = (p.w(x), p.r(y));
        self.run(stream, &plan::add_to_residual(x, y)?)
    }

    /// `gate = silu(gate) * up` ([`plan::silu_mul`]).
    ///
    /// # Errors
    /// As [`CudaKernels::embed_rows`].
    pub fn silu_mul(&self, stream: &CudaStream, gate: &mut CudaSlice<bf16>, up: &CudaSlice<bf16>) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let (gate, up) = (p.w(gate), p.r(up));
        self.run(stream, &plan::silu_mul(gate, up)?)
    }

    /// `y[r] += bias` for every row of `y` ([`plan::bias_add`]).
    ///
    /// # Errors
    /// As [`CudaKernels::embed_rows`].
    pub fn bias_add(
        &self,
        stream: &CudaStream,
        rows: usize,
        y: &mut CudaSlice<bf16>,
        bias: &CudaSlice<bf16>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let (y, bias) = (p.w(y), p.r(bias));
        self.run(stream, &plan::bias_add(rows, y, bias)?)
    }

    /// Fills `out` with seeded uniform values in `[lo, hi)` ([`plan::fill_uniform`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a non-finite or empty range, [`Error::Cuda`] when the launch fails.
    pub fn fill_uniform(
        &self,
        stream: &CudaStream,
        out: &mut CudaSlice<bf16>,
        seed: u64,
        lo: f32,
        hi: f32,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let out = p.w(out);
        self.run(stream, &plan::fill_uniform(out, seed, lo, hi)?)
    }
}

/// A linear layer on the device: `w` `[out, inp]` bf16 and an optional bias `[out]`.
#[derive(Debug)]
pub struct DeviceLinear {
    /// Weights, row-major `[out, inp]`.
    pub w: CudaSlice<bf16>,
    /// Bias.
    pub b: Option<CudaSlice<bf16>>,
    /// Output features.
    pub out: usize,
    /// Input features.
    pub inp: usize,
}

impl DeviceLinear {
    /// `y = x · wᵀ (+ b)` for `rows` rows (`x`: `[rows, inp]`, `y`: `[rows, out]`); `blas` created on `stream`.
    ///
    /// # Errors
    /// As [`gemm_bf16`] and [`CudaKernels::bias_add`].
    pub fn forward(
        &self,
        kernels: &CudaKernels,
        blas: &CudaBlas,
        stream: &CudaStream,
        rows: usize,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        gemm_bf16(blas, stream, rows, self.out, self.inp, x, &self.w, y)?;
        if let Some(b) = &self.b {
            kernels.bias_add(stream, rows, y, b)?;
        }
        Ok(())
    }

    /// Elements on the device (weights and bias).
    #[must_use]
    pub fn elements(&self) -> usize {
        self.w.len() + self.b.as_ref().map_or(0, CudaSlice::len)
    }
}

/// Output element types of [`gemm_bf16`].
pub trait GemmOut: cudarc::driver::DeviceRepr + Sized {
    /// The plan's output of this type.
    fn gemm_y(b: Buf<Self>) -> GemmY;
}

impl GemmOut for bf16 {
    fn gemm_y(b: Buf<Self>) -> GemmY {
        GemmY::Bf16(b)
    }
}

impl GemmOut for f32 {
    fn gemm_y(b: Buf<Self>) -> GemmY {
        GemmY::F32(b)
    }
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` with bf16 inputs, f32 accumulation and a bf16 or f32 output (the layout of the
/// CPU [`crate::gemm`]; [`plan::gemm`]). `blas` must have been created on `stream` (the stream the buffers are used
/// on).
///
/// # Errors
/// [`Error::ShapeMismatch`] for buffers that disagree with the shapes, [`Error::InvalidArgument`] for sizes beyond
/// cuBLAS's `int`, [`Error::Cuda`] when cuBLAS fails.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16<Y: GemmOut>(
    blas: &CudaBlas,
    stream: &CudaStream,
    m: usize,
    n: usize,
    k: usize,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<Y>,
) -> Result<()> {
    let mut p = Ptrs::new(stream);
    let (x, w, y) = (p.r(x), p.r(w), p.w(y));
    run_gemm(blas, &plan::gemm(m, n, k, x, w, Y::gemm_y(y))?)
}

/// Bytes of the workspace every [`Blas`] hands cuBLAS: 32 MiB, NVIDIA's recommendation for Hopper (what
/// `CUBLAS_WORKSPACE_CONFIG=:4096:8` gives).
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLAS handle on one stream with an explicit workspace (`cublasSetWorkspace`): GEMMs recorded into a CUDA
/// graph then use memory that lives as long as the handle instead of cuBLAS's own pool. The handle is declared
/// first, so it is destroyed before its workspace is freed.
#[derive(Debug)]
pub struct Blas {
    handle: CudaBlas,
    workspace: CudaSlice<u8>,
}

impl Blas {
    /// A handle on `stream` with a workspace of [`CUBLAS_WORKSPACE_BYTES`].
    ///
    /// # Errors
    /// [`Error::Cuda`] when cuBLAS cannot be loaded or created, or the workspace cannot be allocated or set.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let handle =
            CudaBlas::new(stream.clone()).map_err(|e| Error::Cuda { op: "cublasCreate", message: format!("{e:?}") })?;
        let workspace = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES).map_err(drv("alloc cuBLAS workspace"))?;
        let (ptr, _) = workspace.device_ptr(stream);
        // SAFETY: the handle is live and bound to `stream` (cudarc set it at creation; nothing resets it later, which
        // would also reset the workspace); the workspace is a live device allocation of the stated size, owned next
        // to the handle and freed after it.
        let status = unsafe {
            blas_sys::cublasSetWorkspace_v2(*handle.handle(), ptr as *mut std::ffi::c_void, CUBLAS_WORKSPACE_BYTES)
        };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(Error::Cuda { op: "cublasSetWorkspace", message: format!("{status:?}") });
        }
        Ok(Self { handle, workspace })
    }

    /// The handle.
    #[must_use]
    pub fn cublas(&self) -> &CudaBlas {
        &self.handle
    }

    /// Bytes of its workspace.
    #[must_use]
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.len()
    }
}

/// Runs one planned `cublasGemmEx` on `blas`'s stream.
///
/// # Errors
/// [`Error::Cuda`] when cuBLAS fails.
pub fn run_gemm(blas: &CudaBlas, g: &GemmEx) -> Result<()> {
    let op =
        |t: bool| if t { blas_sys::cublasOperation_t::CUBLAS_OP_T } else { blas_sys::cublasOperation_t::CUBLAS_OP_N };
    let c_type = if g.c_f32 { blas_sys::cudaDataType::CUDA_R_32F } else { blas_sys::cudaDataType::CUDA_R_16BF };
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: a `GemmEx` from `plan::gemm`, which checked every buffer against the shapes; its addresses are live
    // device buffers on `blas`'s stream; alpha/beta are host f32 scalars, as CUBLAS_COMPUTE_32F with the default
    // host pointer mode expects.
    unsafe {
        blas::gemm_ex(
            *blas.handle(),
            op(g.trans_a),
            op(g.trans_b),
            g.m,
            g.n,
            g.k,
            (&alpha as *const f32).cast(),
            g.a as *const _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            g.lda,
            g.b as *const _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            g.ldb,
            (&beta as *const f32).cast(),
            g.c as *mut _,
            c_type,
            g.ldc,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::Cuda { op: "cublasGemmEx", message: format!("{e:?}") })
}
