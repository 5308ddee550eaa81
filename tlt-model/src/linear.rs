//! Linear layers of the inference forward: `tlt-kernels`' GEMM (reading candle's f32 storage in place, or a packed
//! Q8_0/Q4/f16 copy) for every row count, so that a row's output never depends on the rows beside it.

use candle_core::{CpuStorage, Device, Storage, Tensor};
use tlt_kernels::{gemm, MatRef, Matrix, WeightsRef};

use crate::{Error, Result};

/// Rows above which f32 linears go to candle's packed GEMM instead: never, unless the environment variable
/// `TLT_SKINNY_MAX_ROWS` sets a bound (read once).
///
/// `tlt-kernels`' GEMM computes every output with the same reduction order whatever the number of rows; candle's
/// blocks by the matrix shape. With candle above 64 rows, a request's logits depended on how many requests shared
/// its round: a sampled token at a near tie flipped between a batch of 512 and one of 128 (SmolLM2-135M, T = 0.7,
/// one request in 512), so the same request over HTTP (requests arriving over time) and in process differed. One
/// kernel for every batch makes decoding batch-invariant, and it was faster too: the 512-request rollout of `bench
/// serve` took 32-36 s against 36-40 s (2-vCPU AMD EPYC); prefills of 1,024-2,048 tokens are 6-9% slower
/// (`docs/bench/2026-11-28-serve-allocator-batch-invariance.md`).
fn skinny_max_rows() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("TLT_SKINNY_MAX_ROWS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(usize::MAX)
    })
}

/// `y = x W^T (+ b)` for `rows` rows of `x`, `weight` `[n, k]`.
pub(crate) fn linear(
    x: &[f32],
    rows: usize,
    weight: &Tensor,
    bias: Option<&Tensor>,
    packed: Option<&Matrix>,
) -> Result<Vec<f32>> {
    let (n, k) = weight.dims2()?;
    let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
    let mut y = vec![0f32; rows * n];
    if let Some(p) = packed {
        gemm(x, rows, p.view(), bias.as_deref(), &mut y)?;
        return Ok(y);
    }
    if rows > skinny_max_rows() {
        let xt = Tensor::from_slice(x, (rows, k), &Device::Cpu)?;
        let mut out = xt.matmul(&weight.t()?)?;
        if let Some(b) = bias {
            out = out.broadcast_add(&Tensor::from_vec(b, n, &Device::Cpu)?)?;
        }
        return Ok(out.flatten_all()?.to_vec1()?);
    }
    with_f32_slice(weight, |w| -> Result<()> {
        gemm(x, rows, MatRef::new(n, k, WeightsRef::F32(w))?, bias.as_deref(), &mut y)?;
        Ok(())
    })??;
    Ok(y)
}

/// Runs `f` on the contiguous f32 CPU storage of `t` without copying (holding candle's read lock, so a
/// concurrent optimizer step cannot tear the read).
pub(crate) fn with_f32_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        return Err(Error::InvalidInput(format!("inference needs f32 CPU weights, got {:?}", t.dtype())));
    };
    let (start, end) =
        layout.contiguous_offsets().ok_or_else(|| Error::InvalidInput("inference needs contiguous weights".into()))?;
    Ok(f(&data[start..end]))
}
