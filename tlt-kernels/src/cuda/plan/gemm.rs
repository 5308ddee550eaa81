//! The cuBLAS GEMM as data: one `cublasGemmEx` call, column-major as cuBLAS reads it.

use super::*;

/// The output of a [`gemm`]: bf16 or f32 elements.
#[derive(Debug, Clone, Copy)]
pub enum GemmY {
    /// bf16 output (rounded from the f32 accumulation).
    Bf16(Buf<bf16>),
    /// f32 output.
    F32(Buf<f32>),
}

impl GemmY {
    fn len(&self) -> usize {
        match self {
            Self::Bf16(b) => b.len(),
            Self::F32(b) => b.len(),
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Self::Bf16(b) => b.addr(),
            Self::F32(b) => b.addr(),
        }
    }
}

/// One `cublasGemmEx` call, column-major as cuBLAS reads it: `C (m x n) = op(A) (m x k) · op(B) (k x n)` with bf16
/// `A` and `B`, f32 compute, `alpha = 1`, `beta = 0` (`beta = 1` with `accumulate`: `C += op(A) · op(B)`, f32 `C`
/// only), and a bf16 or f32 `C`. `op(X)` is `X` or, with `trans_*`, its
/// transpose; column-major `X` of leading dimension `ld` holds element `(i, j)` at `i + j * ld`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmEx {
    /// `op(A) = Aᵀ`.
    pub trans_a: bool,
    /// `op(B) = Bᵀ`.
    pub trans_b: bool,
    /// Rows of `C`.
    pub m: i32,
    /// Columns of `C`.
    pub n: i32,
    /// The inner dimension.
    pub k: i32,
    /// `A`'s address.
    pub a: u64,
    /// `A`'s leading dimension.
    pub lda: i32,
    /// `B`'s address.
    pub b: u64,
    /// `B`'s leading dimension.
    pub ldb: i32,
    /// `C`'s address.
    pub c: u64,
    /// `C`'s leading dimension.
    pub ldc: i32,
    /// `C` is f32 (else bf16).
    pub c_f32: bool,
    /// `beta = 1`: the product is added to `C` (f32 `C` only; the training backward's gradient sums).
    pub accumulate: bool,
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` (row-major, the layout of the CPU [`crate::gemm`]) as the cuBLAS call computing it:
/// column-major `yᵀ (n x m) = op(w) · xᵀ`, where `w` read column-major with leading dimension `k` is `wᵀ` (`k x n`)
/// and so needs `op = T`, and `x` read that way is already `xᵀ` (`k x m`).
///
/// # Errors
/// [`Error::ShapeMismatch`] for buffers that disagree with the shapes, [`Error::InvalidArgument`] for sizes beyond
/// cuBLAS's `int`.
pub fn gemm(m: usize, n: usize, k: usize, x: Buf<bf16>, w: Buf<bf16>, y: GemmY) -> Result<GemmEx> {
    check_len("x", m * k, x.len())?;
    check_len("w", n * k, w.len())?;
    check_len("y", m * n, y.len())?;
    let (mi, ni, ki) = (int("m", m)?, int("n", n)?, int("k", k)?);
    Ok(GemmEx {
        trans_a: true,
        trans_b: false,
        m: ni,
        n: mi,
        k: ki,
        a: w.addr(),
        lda: ki,
        b: x.addr(),
        ldb: ki,
        c: y.addr(),
        ldc: ni,
        c_f32: matches!(y, GemmY::F32(_)),
        accumulate: false,
    })
}

/// The input gradient of [`gemm`]'s `y = x · wᵀ`: `dx[m, k] = dy[m, n] · w[n, k]` (row-major). As cuBLAS computes
/// it: column-major `dxᵀ (k x m) = wᵀ (k x n) · dyᵀ (n x m)`, both operands read as stored (`op = N`).
///
/// # Errors
/// As [`gemm`].
pub fn gemm_dx(m: usize, n: usize, k: usize, dy: Buf<bf16>, w: Buf<bf16>, dx: GemmY) -> Result<GemmEx> {
    gemm_dx_ld(m, n, k, dy, n, w, dx)
}

/// The elements a row-major `[m, n]` view with rows `ld` apart spans (`ld >= n`).
fn strided_len(m: usize, n: usize, ld: usize) -> Result<usize> {
    if ld < n {
        return Err(Error::InvalidArgument(format!("rows {ld} apart for {n} columns")));
    }
    Ok(if m == 0 { 0 } else { (m - 1) * ld + n })
}

/// [`gemm_dx`] with `dy`'s rows `ld_dy` elements apart (columns of a wider matrix: one projection of a stacked
/// linear's output gradient).
///
/// # Errors
/// As [`gemm`], and for `ld_dy < n`.
pub fn gemm_dx_ld(
    m: usize,
    n: usize,
    k: usize,
    dy: Buf<bf16>,
    ld_dy: usize,
    w: Buf<bf16>,
    dx: GemmY,
) -> Result<GemmEx> {
    check_len("dy", strided_len(m, n, ld_dy)?, dy.len())?;
    check_len("w", n * k, w.len())?;
    check_len("dx", m * k, dx.len())?;
    let (mi, ni, ki) = (int("m", m)?, int("n", n)?, int("k", k)?);
    Ok(GemmEx {
        trans_a: false,
        trans_b: false,
        m: ki,
        n: mi,
        k: ni,
        a: w.addr(),
        lda: ki,
        b: dy.addr(),
        ldb: int("ld_dy", ld_dy)?,
        c: dx.addr(),
        ldc: ki,
        c_f32: matches!(dx, GemmY::F32(_)),
        accumulate: false,
    })
}

/// The weight gradient of [`gemm`]'s `y = x · wᵀ` over `m` rows: `dw[n, k] (+)= dy[m, n]ᵀ · x[m, k]` (row-major,
/// f32; added to `dw` with `accumulate`). As cuBLAS computes it: column-major `dwᵀ (k x n) = xᵀ (k x m) · dy (m x n)`,
/// `dy` read transposed.
///
/// # Errors
/// As [`gemm`].
pub fn gemm_dw(
    m: usize,
    n: usize,
    k: usize,
    dy: Buf<bf16>,
    x: Buf<bf16>,
    dw: Buf<f32>,
    accumulate: bool,
) -> Result<GemmEx> {
    gemm_dw_ld(m, n, k, dy, n, x, dw, accumulate)
}

/// [`gemm_dw`] with `dy`'s rows `ld_dy` elements apart (as [`gemm_dx_ld`]).
///
/// # Errors
/// As [`gemm`], and for `ld_dy < n`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_dw_ld(
    m: usize,
    n: usize,
    k: usize,
    dy: Buf<bf16>,
    ld_dy: usize,
    x: Buf<bf16>,
    dw: Buf<f32>,
    accumulate: bool,
) -> Result<GemmEx> {
    check_len("dy", strided_len(m, n, ld_dy)?, dy.len())?;
    check_len("x", m * k, x.len())?;
    check_len("dw", n * k, dw.len())?;
    let (mi, ni, ki) = (int("m", m)?, int("n", n)?, int("k", k)?);
    Ok(GemmEx {
        trans_a: false,
        trans_b: true,
        m: ki,
        n: ni,
        k: mi,
        a: x.addr(),
        lda: ki,
        b: dy.addr(),
        ldb: int("ld_dy", ld_dy)?,
        c: dw.addr(),
        ldc: ki,
        c_f32: true,
        accumulate,
    })
}
