//! Launches of the decoder layer's element-wise and row-wise kernels (`layer.cu`) and the bf16 GEMM (cuBLAS).

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::device::{dim, drv, int, CudaKernels};
use crate::error::{check_len, Error, Result};

/// Blocks for a grid-stride loop over `n` elements (256 threads each).
fn stride_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl CudaKernels {
    /// `x[r] = table[tokens[r]]` (bf16 rows to the f32 residual stream); `table`: `[vocab, width]`.
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
        if width == 0 || !table.len().is_multiple_of(width) {
            return Err(Error::InvalidArgument(format!("embedding table of {} for width {width}", table.len())));
        }
        check_len("tokens", rows, tokens.len())?;
        check_len("x", rows * width, x.len())?;
        let (r, w) = (int("rows", rows)?, int("width", width)?);
        let cfg = LaunchConfig { grid_dim: (dim("rows", rows)?, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(self.function("embed_rows_bf16")?);
        b.arg(table).arg(tokens).arg(x).arg(&r).arg(&w);
        // SAFETY: arguments match the signature; buffers checked; token ids checked by the caller.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch embed_rows_bf16"))
    }

    /// `out = rmsnorm(x) * w` per row (`x` f32 `[rows, width]`, `w` bf16 `[width]`, `out` bf16).
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
        check_len("x", rows * width, x.len())?;
        check_len("norm weight", width, w.len())?;
        check_len("out", rows * width, out.len())?;
        let (r, wd) = (int("rows", rows)?, int("width", width)?);
        let cfg = LaunchConfig { grid_dim: (dim("rows", rows)?, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(self.function("rms_norm_bf16")?);
        b.arg(x).arg(w).arg(out).arg(&r).arg(&wd).arg(&eps);
        // SAFETY: arguments match the signature; buffers checked.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch rms_norm_bf16"))
    }

    /// Qwen3's q/k norms: every `head_dim`-wide vector of `x` (bf16 `[vectors, head_dim]`, in place) becomes
    /// `rmsnorm(x) * w` (`w` bf16 `[head_dim]`, f32 math).
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
        check_len("norm weight", head_dim, w.len())?;
        if head_dim == 0 || !x.len().is_multiple_of(head_dim) {
            return Err(Error::InvalidArgument(format!("{} elements are not vectors of {head_dim}", x.len())));
        }
        let vectors = x.len() / head_dim;
        if vectors == 0 {
            return Ok(());
        }
        let (n, d) = (int("vectors", vectors)?, int("head_dim", head_dim)?);
        let per_block = 256 / 32;
        let blocks = dim("blocks", vectors.div_ceil(per_block))?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(self.function("head_rms_norm_bf16")?);
        b.arg(x).arg(w).arg(&n).arg(&d).arg(&eps);
        // SAFETY: arguments match the signature; `x` holds `vectors * head_dim` elements, `w` `head_dim`.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch head_rms_norm_bf16"))
    }

    /// `x += y` (the residual add; `x` f32, `y` bf16, same length).
    ///
    /// # Errors
    /// As [`CudaKernels::embed_rows`].
    pub fn add_to_residual(&self, stream: &CudaStream, x: &mut CudaSlice<f32>, y: &CudaSlice<bf16>) -> Result<()> {
        check_len("y", x.len(), y.len())?;
        let n = x.len() as u64;
        let cfg = stride_cfg(x.len());
        let mut b = stream.launch_builder(self.function("add_bf16_to_f32")?);
        b.arg(x).arg(y).arg(&n);
        // SAFETY: arguments match the signature; both buffers hold n elements.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch add_bf16_to_f32"))
    }

    /// `gate = silu(gate) * up` (bf16, same length).
    ///
    /// # Errors
    /// As [`CudaKernels::embed_rows`].
    pub fn silu_mul(&self, stream: &CudaStream, gate: &mut CudaSlice<bf16>, up: &CudaSlice<bf16>) -> Result<()> {
        check_len("up", gate.len(), up.len())?;
        let n = gate.len() as u64;
        let cfg = stride_cfg(gate.len());
        let mut b = stream.launch_builder(self.function("silu_mul_bf16")?);
        b.arg(gate).arg(up).arg(&n);
        // SAFETY: arguments match the signature; both buffers hold n elements.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch silu_mul_bf16"))
    }

    /// `y[r] += bias` for every row of `y` (`[rows, cols]`, bf16).
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
        let cols = bias.len();
        check_len("y", rows * cols, y.len())?;
        let (r, c) = (int("rows", rows)?, int("cols", cols)?);
        let cfg = stride_cfg(y.len());
        let mut b = stream.launch_builder(self.function("bias_add_bf16")?);
        b.arg(y).arg(bias).arg(&r).arg(&c);
        // SAFETY: arguments match the signature; buffers checked.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch bias_add_bf16"))
    }

    /// Fills `out` with seeded uniform values in `[lo, hi)` (a hash of the seed and the index: the same on every
    /// device), for synthetic weights generated where they are used.
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
        if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
            return Err(Error::InvalidArgument(format!("uniform range [{lo}, {hi})")));
        }
        let n = out.len() as u64;
        let cfg = stride_cfg(out.len());
        let mut b = stream.launch_builder(self.function("fill_uniform_bf16")?);
        b.arg(out).arg(&n).arg(&seed).arg(&lo).arg(&hi);
        // SAFETY: arguments match the signature; the kernel writes exactly n elements.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv("launch fill_uniform_bf16"))
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
pub trait GemmOut: cudarc::driver::DeviceRepr {
    /// cuBLAS's name for the type.
    const CUDA_TYPE: blas_sys::cudaDataType;
}

impl GemmOut for bf16 {
    const CUDA_TYPE: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_16BF;
}

impl GemmOut for f32 {
    const CUDA_TYPE: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_32F;
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` with bf16 inputs, f32 accumulation and a bf16 or f32 output (the layout of the
/// CPU [`crate::gemm`]). `blas` must have been created on `stream` (the stream the buffers are used on).
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
    check_len("x", m * k, x.len())?;
    check_len("w", n * k, w.len())?;
    check_len("y", m * n, y.len())?;
    let (mi, ni, ki) = (int("m", m)?, int("n", n)?, int("k", k)?);
    let (xp, _gx) = x.device_ptr(stream);
    let (wp, _gw) = w.device_ptr(stream);
    let (yp, _gy) = y.device_ptr_mut(stream);
    let (alpha, beta) = (1.0f32, 0.0f32);
    // Column-major view: yᵀ (n x m) = wᵀᵀ (n x k, i.e. w read transposed) · xᵀ (k x m).
    // SAFETY: the pointers are live device buffers of the checked sizes on `blas`'s stream; alpha/beta are host
    // f32 scalars, as CUBLAS_COMPUTE_32F with the default host pointer mode expects.
    unsafe {
        blas::gemm_ex(
            *blas.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            ni,
            mi,
            ki,
            (&alpha as *const f32).cast(),
            wp as *const _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            ki,
            xp as *const _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            ki,
            (&beta as *const f32).cast(),
            yp as *mut _,
            Y::CUDA_TYPE,
            ni,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::Cuda { op: "cublasGemmEx", message: format!("{e:?}") })
}
