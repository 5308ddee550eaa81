//! Skinny GEMM `y[m, n] = x[m, k] · W[n, k]^T (+ bias)` for small `m`, streaming the weights once per call.

mod format;
mod kernel;
mod matrix;

use std::ops::Range;

use crate::error::check_len;
use crate::simd::{Scalar, Simd};
use crate::{default_threads, Error, Isa, Result};
use format::{Bf16, Format, F16, F32, Q4_0, Q4_1, Q8_0};
use kernel::{Dims, MR};
pub use matrix::{MatRef, Matrix, WeightDType, WeightsRef};

/// How to run a GEMM: instruction set and number of threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmConfig {
    /// Instruction set (must be available on this CPU).
    pub isa: Isa,
    /// Worker threads (1 = the calling thread only; more uses the kernels' spinning team of
    /// [`default_threads`] threads, or rayon's global pool when that is busy or smaller).
    pub threads: usize,
}

impl Default for GemmConfig {
    /// The best available ISA on all available cores. Decode-shaped GEMMs are memory-bound, and on the 2-vCPU
    /// development VM a second thread lifts the weight stream from ~12 to ~20 GB/s (measured by
    /// `cargo xtask bench kernels --threads 1,2`), while matrices too small to split stay on one thread.
    fn default() -> Self {
        Self { isa: Isa::best(), threads: default_threads() }
    }
}

/// `y = x · W^T (+ bias)` with the default configuration. `x` is `[m, k]`, `y` is `[m, n]`, row-major.
pub fn gemm(x: &[f32], m: usize, w: MatRef<'_>, bias: Option<&[f32]>, y: &mut [f32]) -> Result<()> {
    gemm_with(GemmConfig::default(), x, m, w, bias, y)
}

/// [`gemm`] with an explicit ISA and thread count.
pub fn gemm_with(
    cfg: GemmConfig,
    x: &[f32],
    m: usize,
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<()> {
    let (n, k) = (w.n(), w.k());
    check_len("x", m * k, x.len())?;
    check_len("y", m * n, y.len())?;
    if let Some(b) = bias {
        check_len("bias", n, b.len())?;
    }
    if !cfg.isa.is_available() {
        return Err(Error::IsaUnavailable(cfg.isa));
    }
    if cfg.threads == 0 {
        return Err(Error::InvalidArgument("threads must be at least 1".into()));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let d = Dims { m, n, k };
    match w.data() {
        WeightsRef::F32(s) => run::<F32>(cfg, x, s, k, y, d),
        WeightsRef::F16(s) => run::<F16>(cfg, x, s, k, y, d),
        WeightsRef::Bf16(s) => run::<Bf16>(cfg, x, s, k, y, d),
        WeightsRef::Q8_0(s) => run::<Q8_0>(cfg, x, s, k / 32, y, d),
        WeightsRef::Q4_0(s) => run::<Q4_0>(cfg, x, s, k / 32, y, d),
        WeightsRef::Q4_1(s) => run::<Q4_1>(cfg, x, s, k / 32, y, d),
    }
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(n) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
    Ok(())
}

/// Raw pointers shared with worker threads.
#[derive(Clone, Copy)]
struct Shared<E> {
    x: *const f32,
    w: *const E,
    y: *mut f32,
}
// SAFETY: workers read `x` and `w` and write disjoint column ranges of `y` while `run` waits for them.
unsafe impl<E> Send for Shared<E> {}
unsafe impl<E> Sync for Shared<E> {}

type RangeFn<E> = unsafe fn(Shared<E>, usize, Dims, Range<usize>);

/// Splits the weight rows across threads and runs the kernel for `cfg.isa` on each part.
fn run<F: Format>(cfg: GemmConfig, x: &[f32], w: &[F::Elem], row_elems: usize, y: &mut [f32], d: Dims) {
    let f: RangeFn<F::Elem> = match cfg.isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => range_avx512::<F>,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => range_avx2::<F>,
        _ => range_scalar::<F>,
    };
    let p = Shared { x: x.as_ptr(), w: w.as_ptr(), y: y.as_mut_ptr() };
    // Split on multiples of 16 rows so every part keeps full register tiles; below ~64K weights the fork/join
    // costs more than it saves.
    const MIN_WEIGHTS_PER_THREAD: usize = 1 << 15;
    let parts = cfg.threads.min(d.n.div_ceil(16)).min((d.n * d.k).div_ceil(MIN_WEIGHTS_PER_THREAD)).max(1);
    if parts == 1 {
        // SAFETY: lengths were checked by `gemm_with`; the ISA is available.
        unsafe { f(p, row_elems, d, 0..d.n) };
        return;
    }
    let per = d.n.div_ceil(parts).div_ceil(16) * 16;
    let part = |t: usize| {
        let rows = (t * per).min(d.n)..((t + 1) * per).min(d.n);
        if !rows.is_empty() {
            // SAFETY: as above; parts write disjoint columns of y.
            unsafe { f(p, row_elems, d, rows) };
        }
    };
    // The spinning team first (no sleep/wake per call); rayon when another thread holds the team or more
    // threads were asked for than it has.
    if !crate::team::Team::global().is_some_and(|team| team.run(parts, &part)) {
        rayon::scope(|s| {
            for t in 0..parts {
                s.spawn(move |_| part(t));
            }
        });
    }
}

/// Runs the kernel on weight rows `rows`. For many rows of a converted format, panels are first dequantized to
/// f32 in a small scratch buffer so the conversion is paid once per weight, not once per row block.
#[inline(always)]
unsafe fn range_generic<S: Simd, F: Format, const NR: usize, const NR1: usize>(
    p: Shared<F::Elem>,
    row_elems: usize,
    d: Dims,
    rows: Range<usize>,
) {
    unsafe {
        if d.m <= 2 {
            // One or two rows: a wider panel keeps more weight streams in flight (registers allow it).
            kernel::panel_range::<S, F, NR1>(p.x, p.w, row_elems, p.y, d, rows, true);
            return;
        }
        if !F::CONVERTS || d.m <= 2 * MR {
            kernel::panel_range::<S, F, NR>(p.x, p.w, row_elems, p.y, d, rows, true);
            return;
        }
        const PANEL: usize = 16;
        // Take the scratch buffer out of the thread-local so the kernels below run in this function (a closure
        // would not inherit its target features).
        let mut scratch = SCRATCH.take();
        scratch.resize(PANEL * d.k, 0.0);
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = (r0 + PANEL).min(rows.end);
            kernel::dequant_rows::<S, F>(p.w, row_elems, d.k, r0..r1, scratch.as_mut_ptr());
            kernel::panel_range::<S, kernel::F32Format, NR>(
                p.x,
                scratch.as_ptr(),
                d.k,
                p.y.add(r0),
                d,
                0..r1 - r0,
                false,
            );
            r0 = r1;
        }
        SCRATCH.set(scratch);
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

unsafe fn range_scalar<F: Format>(p: Shared<F::Elem>, row_elems: usize, d: Dims, rows: Range<usize>) {
    unsafe { range_generic::<Scalar, F, 4, 4>(p, row_elems, d, rows) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn range_avx2<F: Format>(p: Shared<F::Elem>, row_elems: usize, d: Dims, rows: Range<usize>) {
    unsafe { range_generic::<crate::simd::Avx2, F, 2, 4>(p, row_elems, d, rows) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn range_avx512<F: Format>(p: Shared<F::Elem>, row_elems: usize, d: Dims, rows: Range<usize>) {
    unsafe { range_generic::<crate::simd::Avx512, F, 4, 8>(p, row_elems, d, rows) }
}
