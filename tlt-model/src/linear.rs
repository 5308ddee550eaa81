//! Linear layers of the inference forward: `tlt-kernels`' skinny GEMM for small row counts (reading candle's
//! f32 storage in place, or a packed Q8_0/Q4/f16 copy), candle's packed GEMM for large prefills.

use std::sync::Arc;

use candle_core::{CpuStorage, Device, Storage, Tensor};
use tlt_kernels::{gemm, MatRef, Matrix, WeightDType, WeightsRef};

use crate::model::Llama;
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

fn pack(t: &Tensor, dtype: WeightDType) -> Result<Arc<Matrix>> {
    let (n, k) = t.dims2()?;
    Ok(Arc::new(with_f32_slice(t, |w| Matrix::from_f32(n, k, w, dtype))??))
}

impl Llama {
    /// Converts every linear layer and the LM head to `dtype` for the inference forward (e.g. Q8_0 streams
    /// about a quarter of the bytes of f32). The f32 weights stay for training and saving; training does not
    /// update the packed copies, so [`Llama::make_trainable`] drops them. `WeightDType::F32` removes the packs.
    pub fn pack_for_inference(&mut self, dtype: WeightDType) -> Result<()> {
        let keep = dtype != WeightDType::F32;
        let w = self.weights_mut();
        for (_, lin) in w.linears_mut() {
            lin.packed = if keep { Some(pack(&lin.weight, dtype)?) } else { None };
        }
        w.head_packed = if keep { Some(pack(w.lm_head(), dtype)?) } else { None };
        Ok(())
    }

    /// The format the inference forward reads the linear layers in.
    pub fn inference_dtype(&self) -> WeightDType {
        self.weights()
            .layers
            .first()
            .and_then(|l| l.q_proj.packed.as_ref())
            .map_or(WeightDType::F32, |m| m.view().dtype())
    }

    /// Bytes of weights one decode step streams through the linear layers (weights and biases) and the LM head.
    pub fn weight_bytes_per_token(&self) -> usize {
        let w = self.weights();
        let bytes =
            |t: &Tensor, p: Option<&Arc<Matrix>>| -> usize { p.map_or(t.elem_count() * 4, |m| m.view().bytes()) };
        let mut total = bytes(w.lm_head(), w.head_packed.as_ref());
        for l in &w.layers {
            for lin in [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj] {
                total += bytes(&lin.weight, lin.packed.as_ref()) + lin.bias.as_ref().map_or(0, |b| b.elem_count() * 4);
            }
        }
        total
    }
}
