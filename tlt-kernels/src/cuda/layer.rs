//! A linear layer on a [`Gpu`]: bf16 weights, an optional bias, one planned GEMM plus the bias epilogue.

use half::bf16;

use super::gpu::{DeviceBuf, Gpu};
use super::plan::{self, Buf, GemmY};
use crate::error::Result;

/// A linear layer on the device: `w` `[out, inp]` bf16 and an optional bias `[out]`.
#[derive(Debug)]
pub struct DeviceLinear {
    /// Weights, row-major `[out, inp]`.
    pub w: DeviceBuf<bf16>,
    /// Bias.
    pub b: Option<DeviceBuf<bf16>>,
    /// Output features.
    pub out: usize,
    /// Input features.
    pub inp: usize,
}

impl DeviceLinear {
    /// Uploads `w` (`[out, inp]`, row-major f32, rounded to bf16) and `b` (`[out]`).
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] for lengths that disagree with the shape; the device's upload errors.
    pub fn upload(gpu: &dyn Gpu, w: &[f32], b: Option<&[f32]>, out: usize, inp: usize) -> Result<Self> {
        crate::error::check_len("linear weights", out * inp, w.len())?;
        let bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let b = match b {
            Some(b) => {
                crate::error::check_len("linear bias", out, b.len())?;
                Some(DeviceBuf::from_host(gpu, &bf(b))?)
            }
            None => None,
        };
        Ok(Self { w: DeviceBuf::from_host(gpu, &bf(w))?, b, out, inp })
    }

    /// Queues `y = x · wᵀ (+ b)` for `rows` rows (`x`: `[rows, inp]`, `y`: `[rows, out]`).
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] for buffers that disagree with the shapes; the device's errors.
    pub fn forward(&self, gpu: &dyn Gpu, rows: usize, x: Buf<bf16>, y: Buf<bf16>) -> Result<()> {
        gpu.gemm(&plan::gemm(rows, self.out, self.inp, x, self.w.buf(), GemmY::Bf16(y))?)?;
        if let Some(b) = &self.b {
            gpu.launch(&plan::bias_add(rows, y, b.buf())?)?;
        }
        Ok(())
    }

    /// Elements on the device (weights and bias).
    #[must_use]
    pub fn elements(&self) -> usize {
        self.w.len() + self.b.as_ref().map_or(0, DeviceBuf::len)
    }
}
