//! Linear layers of the inference forward: `tlt-kernels`' skinny GEMM for small row counts (reading candle's
//! f32 storage in place, or a packed Q8_0/Q4/f16 copy), candle's packed GEMM for large prefills.

use candle_core::{CpuStorage, Device, Storage, Tensor};
use tlt_kernels::{gemm, MatRef, Matrix, WeightsRef};

use crate::{Error, Result};

/// Above this many rows candle's packed GEMM (compute-bound regime) beats weight streaming.
pub(crate) const SKINNY_MAX_ROWS: usize = 64;

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
    if rows > SKINNY_MAX_ROWS {
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
