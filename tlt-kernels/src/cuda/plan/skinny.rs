//! The batch-invariant GEMM of the decode and verify shapes (`skinny_gemm_bf16`, `cuda/skinny.cu`): `y = a · wᵀ`
//! on the tensor cores with each output element's reduction over K in one order whatever the number of rows, and
//! the layer's element-wise work fused in (an RMSNorm prologue; a bias, residual-add, SwiGLU or f32 epilogue).
//! cuBLAS picks its tiling and split-K from the shape, so a row's bits there depend on the rows beside it; this
//! kernel is what makes a decode row, the same row beside 63 others and the same position as a verify tree's node
//! agree bit for bit.

use super::*;

/// Threads per block of [`skinny_gemm`].
pub const SKINNY_THREADS: u32 = 256;

/// Weight rows (output features) per block; SwiGLU: half of them gate rows, half the matching up rows.
pub const SKINNY_COLS: usize = 32;

/// Rows of `a` per block (4 tiles of 16): more rows take more blocks along the grid's y axis.
pub const SKINNY_ROWS: usize = 64;

/// The K split of every plan: warp `w` of a block's 8 sums the 32-wide K steps `s` with `s % 8 == w`, then the
/// warps' sums are added in warp order. A constant: the order of a row's reduction never depends on M.
pub const SKINNY_K_GROUPS: usize = 8;

/// The input rows of [`skinny_gemm`].
#[derive(Debug, Clone, Copy)]
pub enum SkinnyIn {
    /// bf16 rows `[m, k]`, used as they are.
    Bf16(Buf<bf16>),
    /// f32 rows `[m, k]` (the residual stream), RMS-normalised by the prologue: `a = bf16(x · rsqrt(mean(x²) + eps)
    /// · weight)`; with `out`, the normalised rows are also stored there (`[m, k]` bf16).
    Norm {
        /// The f32 rows.
        x: Buf<f32>,
        /// The norm's weight `[k]`.
        weight: Buf<bf16>,
        /// The norm's epsilon.
        eps: f32,
        /// Where to store the normalised rows, if anywhere.
        out: Option<Buf<bf16>>,
    },
}

/// The output of [`skinny_gemm`] (its epilogue).
#[derive(Debug, Clone, Copy)]
pub enum SkinnyOut {
    /// `y = bf16(a · wᵀ)` `[m, n]`, with a bias `[n]`: `bf16(bf16(a · wᵀ) + b)` (the rounding of a cuBLAS GEMM
    /// followed by [`bias_add`]).
    Bf16 {
        /// The output.
        y: Buf<bf16>,
        /// The bias.
        bias: Option<Buf<bf16>>,
    },
    /// `x += bf16(a · wᵀ)` (f32 `[m, n]`): the residual add. `x` must not be the prologue's input.
    AddF32(Buf<f32>),
    /// `act = silu(g) · u` (`[m, n / 2]` bf16) with `g = bf16(a · w[c]ᵀ)` and `u = bf16(a · w[n / 2 + c]ᵀ)`: the
    /// packed gate/up projection and its SwiGLU, as [`silu_mul_packed`] computes it.
    SwiGlu(Buf<bf16>),
    /// `y = a · wᵀ` in f32 `[m, n]` (logits).
    F32(Buf<f32>),
}

/// Whether [`skinny_gemm`] takes an inner dimension of `k` (16-byte loads: a multiple of 8).
#[must_use]
pub fn skinny_takes(k: usize) -> bool {
    k > 0 && k.is_multiple_of(8)
}

/// `y = a · wᵀ` for `m` rows of `a` (`[m, k]`) and `w` `[n, k]` bf16, batch-invariantly, with the prologue and
/// epilogue `input` and `out` name.
///
/// # Errors
/// [`Error::ShapeMismatch`] for buffers that disagree with the shapes, [`Error::InvalidArgument`] for a `k` the
/// kernel does not take ([`skinny_takes`]), an odd `n` with [`SkinnyOut::SwiGlu`], a residual add onto the prologue's
/// own input, or sizes past a launch.
pub fn skinny_gemm(m: usize, n: usize, k: usize, input: SkinnyIn, w: Buf<bf16>, out: SkinnyOut) -> Result<Launch> {
    skinny_gemm_split(m, n, k, input, w, out, SKINNY_K_GROUPS)
}

/// [`skinny_gemm`] with the K split over `k_groups` warps (1, 2, 4 or 8) instead of [`SKINNY_K_GROUPS`]: the
/// tests' negative control (a split chosen from M must break their batch-invariance checks). Not for production
/// plans.
///
/// # Errors
/// As [`skinny_gemm`]; also for another `k_groups`.
pub fn skinny_gemm_split(
    m: usize,
    n: usize,
    k: usize,
    input: SkinnyIn,
    w: Buf<bf16>,
    out: SkinnyOut,
    k_groups: usize,
) -> Result<Launch> {
    if ![1, 2, 4, 8].contains(&k_groups) {
        return Err(Error::InvalidArgument(format!("skinny GEMM over {k_groups} K groups (1, 2, 4 or 8)")));
    }
    if m == 0 || n == 0 || !skinny_takes(k) {
        return Err(Error::InvalidArgument(format!("skinny GEMM of {m} x {n} x {k} (K must be a multiple of 8)")));
    }
    check_len("w", n * k, w.len())?;
    let (a, x, weight, a_out, eps) = match input {
        SkinnyIn::Bf16(a) => {
            check_len("a", m * k, a.len())?;
            (a.arg(), null(), null(), null(), 0.0)
        }
        SkinnyIn::Norm { x, weight, eps, out } => {
            check_len("x", m * k, x.len())?;
            check_len("norm weight", k, weight.len())?;
            if let Some(o) = out {
                check_len("normalised rows", m * k, o.len())?;
            }
            (null(), x.arg(), weight.arg(), out.map_or_else(null, |o| o.arg()), eps)
        }
    };
    let (mode, y, bias, tiles) = match out {
        SkinnyOut::Bf16 { y, bias } => {
            check_len("y", m * n, y.len())?;
            if let Some(b) = bias {
                check_len("bias", n, b.len())?;
            }
            (0, y.arg(), bias.map_or_else(null, |b| b.arg()), n.div_ceil(SKINNY_COLS))
        }
        SkinnyOut::AddF32(y) => {
            check_len("y", m * n, y.len())?;
            if let SkinnyIn::Norm { x, .. } = input {
                if x.addr() == y.addr() {
                    return Err(Error::InvalidArgument("a residual add onto the prologue's own rows".into()));
                }
            }
            (1, y.arg(), null(), n.div_ceil(SKINNY_COLS))
        }
        SkinnyOut::SwiGlu(y) => {
            if !n.is_multiple_of(2) {
                return Err(Error::InvalidArgument(format!("SwiGLU over {n} packed gate/up rows (odd)")));
            }
            check_len("act", m * n / 2, y.len())?;
            (2, y.arg(), null(), (n / 2).div_ceil(SKINNY_COLS / 2))
        }
        SkinnyOut::F32(y) => {
            check_len("y", m * n, y.len())?;
            (3, y.arg(), null(), n.div_ceil(SKINNY_COLS))
        }
    };
    let row_blocks = m.div_ceil(SKINNY_ROWS);
    if row_blocks > 65_535 {
        return Err(Error::InvalidArgument(format!("{m} rows need {row_blocks} row blocks (grid.y <= 65,535)")));
    }
    let args = vec![
        a,
        x,
        weight,
        a_out,
        w.arg(),
        bias,
        y,
        i32_arg("m", m)?,
        i32_arg("n", n)?,
        i32_arg("k", k)?,
        Arg::F32(eps),
        Arg::I32(mode),
        i32_arg("k_groups", k_groups)?,
    ];
    let grid = [dim("column tiles", tiles)?, dim("row blocks", row_blocks)?, 1];
    Ok(Launch::new("skinny_gemm_bf16", grid, SKINNY_THREADS, args))
}

/// What a [`skinny_gemm`] launch computes, read back from its arguments (the roofline's cost model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkinnyShape {
    /// Rows.
    pub m: usize,
    /// Weight rows.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// The input is f32 rows normalised by the prologue.
    pub norm: bool,
    /// The normalised rows are also stored.
    pub stores_rows: bool,
    /// The epilogue: 0 bf16, 1 residual add, 2 SwiGLU, 3 f32.
    pub mode: i32,
}

impl SkinnyShape {
    /// The shape of `launch`, if it is a [`skinny_gemm`].
    #[must_use]
    pub fn of(launch: &Launch) -> Option<Self> {
        if launch.kernel != "skinny_gemm_bf16" {
            return None;
        }
        let int = |i: usize| match launch.args.get(i) {
            Some(Arg::I32(v)) => usize::try_from(*v).ok(),
            _ => None,
        };
        let ptr = |i: usize| matches!(launch.args.get(i), Some(Arg::Ptr(p)) if *p != 0);
        let mode = match launch.args.get(11) {
            Some(Arg::I32(v)) => *v,
            _ => return None,
        };
        Some(Self { m: int(7)?, n: int(8)?, k: int(9)?, norm: ptr(1), stores_rows: ptr(3), mode })
    }

    /// Bytes the launch moves from and to device memory: the weights once, the input rows once per row block (the
    /// column tiles' re-reads of the same rows are served by L2 and not counted), the output (read and written
    /// for the residual add).
    #[must_use]
    pub fn bytes(&self) -> f64 {
        let (m, n, k) = (self.m as f64, self.n as f64, self.k as f64);
        let input = if self.norm { m * k * 4.0 + k * 2.0 } else { m * k * 2.0 };
        let stored = if self.stores_rows { m * k * 2.0 } else { 0.0 };
        let output = match self.mode {
            0 => m * n * 2.0,
            1 => m * n * 8.0,
            2 => m * n,
            _ => m * n * 4.0,
        };
        n * k * 2.0 + input + stored + output
    }

    /// Floating-point operations (the products' multiply-adds).
    #[must_use]
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_check_shapes_and_tile_the_grid() {
        let bf = |n| Buf::<bf16>::new(0x10_0000, n);
        let f = |n| Buf::<f32>::new(0x20_0000, n);
        let l = skinny_gemm(65, 100, 64, SkinnyIn::Bf16(bf(65 * 64)), bf(6400), SkinnyOut::F32(f(6500))).unwrap();
        assert_eq!((l.grid, l.block), ([4, 2, 1], [256, 1, 1]));
        let s = SkinnyShape::of(&l).unwrap();
        assert_eq!((s.m, s.n, s.k, s.norm, s.mode), (65, 100, 64, false, 3));
        let glu = skinny_gemm(1, 64, 64, SkinnyIn::Bf16(bf(64)), bf(64 * 64), SkinnyOut::SwiGlu(bf(32))).unwrap();
        assert_eq!(glu.grid, [2, 1, 1], "16 gate columns (and their up rows) a block");
        let norm = SkinnyIn::Norm { x: f(64), weight: bf(64), eps: 1e-5, out: None };
        assert!(skinny_gemm(1, 8, 64, norm, bf(8 * 64), SkinnyOut::AddF32(Buf::new(0x30_0000, 8))).is_ok());
        let e = skinny_gemm(1, 64, 64, norm, bf(64 * 64), SkinnyOut::AddF32(f(64))).unwrap_err();
        assert!(e.to_string().contains("own rows"), "{e}");
        assert!(skinny_gemm(1, 8, 12, SkinnyIn::Bf16(bf(12)), bf(96), SkinnyOut::F32(f(8))).is_err(), "K % 8");
        assert!(skinny_gemm(1, 7, 8, SkinnyIn::Bf16(bf(8)), bf(56), SkinnyOut::SwiGlu(bf(3))).is_err(), "odd n");
        assert!(skinny_gemm(2, 8, 8, SkinnyIn::Bf16(bf(8)), bf(64), SkinnyOut::F32(f(16))).is_err(), "short a");
        assert!(skinny_gemm_split(1, 8, 8, SkinnyIn::Bf16(bf(8)), bf(64), SkinnyOut::F32(f(8)), 3).is_err());
        let big = 65_536 * SKINNY_ROWS;
        let e = skinny_gemm(big, 8, 8, SkinnyIn::Bf16(bf(big * 8)), bf(64), SkinnyOut::F32(f(big * 8))).unwrap_err();
        assert!(e.to_string().contains("grid.y"), "{e}");
    }
}
