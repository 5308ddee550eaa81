//! Launches of the drafter's kernels (`draft.cu`): the layer input built from two row sources, and the top-k
//! draft tokens of every row.

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use super::device::{CudaKernels, Ptrs};
use super::plan::{self, RowBuf};
use crate::error::Result;

/// One source of [`CudaKernels::concat_rows`]: `[rows, width]` f32 or bf16.
#[derive(Debug, Clone, Copy)]
pub enum RowSource<'a> {
    /// f32 rows of this width.
    F32(&'a CudaSlice<f32>, usize),
    /// bf16 rows of this width.
    Bf16(&'a CudaSlice<bf16>, usize),
}

impl<'a> RowSource<'a> {
    fn buf(self, p: &mut Ptrs<'a>) -> RowBuf {
        match self {
            Self::F32(b, w) => RowBuf::F32(p.r(b), w),
            Self::Bf16(b, w) => RowBuf::Bf16(p.r(b), w),
        }
    }
}

impl CudaKernels {
    /// `out[r] = [a[r]; b[r]]` as bf16 ([`plan::concat_rows`]).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) / [`Error::InvalidArgument`](crate::Error::InvalidArgument) for buffers that disagree with the shapes,
    /// [`Error::Cuda`](crate::Error::Cuda) when the launch fails.
    pub fn concat_rows(
        &self,
        stream: &CudaStream,
        rows: usize,
        a: RowSource<'_>,
        b: Option<RowSource<'_>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let mut p = Ptrs::new(stream);
        let (a, b) = (a.buf(&mut p), b.map(|b| b.buf(&mut p)));
        let out = p.w(out);
        self.run(stream, &plan::concat_rows(rows, a, b, out)?)
    }

    /// The `k` largest logits of every row of `logits` and their log-probabilities ([`plan::top_k_rows`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for `k` outside `1..=min(vocab, MAX_TOP_K)`; otherwise as
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
        let mut p = Ptrs::new(stream);
        let (logits, idx, logprob) = (p.r(logits), p.w(idx), p.w(logprob));
        self.run(stream, &plan::top_k_rows(rows, vocab, k, logits, idx, logprob)?)
    }
}
