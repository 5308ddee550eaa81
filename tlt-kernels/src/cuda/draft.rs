//! Launches of the drafter's kernels (`draft.cu`): the layer input built from two row sources, and the top-k
//! draft tokens of every row.

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;

use super::device::{dim, drv, int, CudaKernels};
use super::shapes::MAX_TOP_K;
use crate::error::{check_len, Error, Result};

/// One source of [`CudaKernels::concat_rows`]: `[rows, width]` f32 or bf16.
#[derive(Debug, Clone, Copy)]
pub enum RowSource<'a> {
    /// f32 rows of this width.
    F32(&'a CudaSlice<f32>, usize),
    /// bf16 rows of this width.
    Bf16(&'a CudaSlice<bf16>, usize),
}

impl RowSource<'_> {
    fn width(&self) -> usize {
        match *self {
            Self::F32(_, w) | Self::Bf16(_, w) => w,
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::F32(b, _) => b.len(),
            Self::Bf16(b, _) => b.len(),
        }
    }
}

impl CudaKernels {
    /// `out[r] = [a[r]; b[r]]` as bf16 (`out`: `[rows, wa + wb]`); without `b`, a conversion of `a` to bf16.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] / [`Error::InvalidArgument`] for buffers that disagree with the shapes,
    /// [`Error::Cuda`] when the launch fails.
    pub fn concat_rows(
        &self,
        stream: &CudaStream,
        rows: usize,
        a: RowSource<'_>,
        b: Option<RowSource<'_>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (wa, wb) = (a.width(), b.map_or(0, |b| b.width()));
        if rows == 0 || wa == 0 {
            return Err(Error::InvalidArgument(format!("concat of {rows} rows of width {wa} + {wb}")));
        }
        check_len("first source", rows * wa, a.len())?;
        if let Some(b) = b {
            check_len("second source", rows * wb, b.len())?;
        }
        check_len("out", rows * (wa + wb), out.len())?;
        let (r, wa_i, wb_i) = (int("rows", rows)?, int("width", wa)?, int("width", wb)?);
        let null: u64 = 0;
        let cfg = LaunchConfig { grid_dim: (dim("rows", rows)?, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = stream.launch_builder(self.function("concat_rows_bf16")?);
        for src in [Some(a), b] {
            match src {
                Some(RowSource::F32(s, _)) => l.arg(s).arg(&null),
                Some(RowSource::Bf16(s, _)) => l.arg(&null).arg(s),
                None => l.arg(&null).arg(&null),
            };
        }
        l.arg(out).arg(&r).arg(&wa_i).arg(&wb_i);
        // SAFETY: the arguments match the signature (exactly one non-null pointer per present source, zero device
        // pointers otherwise; an absent source has width 0 and is never read); buffers checked.
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(drv("launch concat_rows_bf16"))
    }

    /// The `k` largest logits of every row of `logits` (`[rows, vocab]` f32), in decreasing order (ties: smaller
    /// index first), and their log-probabilities under the row's softmax: `idx`, `logprob`: `[rows, k]`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `k` outside `1..=min(vocab, MAX_TOP_K)`; otherwise as
    /// [`CudaKernels::concat_rows`].
    #[allow(clippy::too_many_arguments)]
    pub fn top_k_rows(
        &self,
        stream: &CudaStream,
        rows: usize,
        vocab: usize,
        k: usize,
        logits: &CudaSlice<f32>,
        idx: &mut CudaSlice<i32>,
        logprob: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if rows == 0 || k == 0 || k > vocab || k > MAX_TOP_K {
            return Err(Error::InvalidArgument(format!(
                "top-{k} of {rows} rows of {vocab} logits (k must be in 1..={MAX_TOP_K} and <= the vocabulary)"
            )));
        }
        check_len("logits", rows * vocab, logits.len())?;
        check_len("top-k indices", rows * k, idx.len())?;
        check_len("top-k log-probs", rows * k, logprob.len())?;
        let (r, v, k_i) = (int("rows", rows)?, int("vocab", vocab)?, int("k", k)?);
        let cfg = LaunchConfig { grid_dim: (dim("rows", rows)?, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = stream.launch_builder(self.function("top_k_rows_f32")?);
        l.arg(logits).arg(idx).arg(logprob).arg(&r).arg(&v).arg(&k_i);
        // SAFETY: arguments match the signature; buffers checked; k <= TOPK_MAX and k <= V as the kernel requires.
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(drv("launch top_k_rows_f32"))
    }
}
