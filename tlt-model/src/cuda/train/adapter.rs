//! The gradients of low-rank adapters on a linear layer (LoRA), added in the layer's backward: each adapter's
//! `A`, `B` (bf16 copies) and f32 gradient buffers over the rows of its projection ([`LinearLora::grads`]).

use half::bf16;
use tlt_kernels::cuda::plan::{self, Buf, GemmY};
use tlt_kernels::cuda::Gpu;

use crate::Result;

/// One adapter of a linear whose output rows `lo..lo + rows` are one HF projection (q/k/v and gate/up are stacked in
/// the decoder's buffers): `A [r, inp]`, `B [rows, r]` (bf16 copies the GEMMs read) and their f32 gradients.
#[derive(Debug, Clone, Copy)]
pub struct LoraSlot {
    /// The first output row of the projection in the stacked linear.
    pub lo: usize,
    /// Its output rows.
    pub rows: usize,
    /// `A`, bf16.
    pub a: Buf<bf16>,
    /// `B`, bf16.
    pub b: Buf<bf16>,
    /// `A`'s gradient (f32, of the unscaled product; the step scales it).
    pub da: Buf<f32>,
    /// `B`'s gradient, likewise.
    pub db: Buf<f32>,
}

/// The adapters of one (stacked) linear: up to three projections.
#[derive(Debug, Clone, Copy)]
pub struct LinearLora {
    /// Rank.
    pub rank: usize,
    /// The projections' adapters, in row order.
    pub slots: [Option<LoraSlot>; 3],
    /// `[cap, rank]` bf16 scratch for `X · Aᵀ`.
    pub u: Buf<bf16>,
    /// `[cap, rank]` bf16 scratch for `dY · B`.
    pub v: Buf<bf16>,
}

impl LinearLora {
    /// Adds the adapters' gradients of `y[t, out] = x[t, inp] · W'ᵀ` from the output gradient `dy` and the input `x`
    /// (the products without the scale `s`): `dB += dYᵀ · (X · Aᵀ)`, `dA += (dY · B)ᵀ · X`, each projection on its
    /// columns of `dy`.
    ///
    /// # Errors
    /// [`crate::Error::Kernel`] when the device fails; shape errors of the GEMM plans.
    pub(super) fn grads(
        &self,
        g: &dyn Gpu,
        t: usize,
        out: usize,
        inp: usize,
        dy: Buf<bf16>,
        x: Buf<bf16>,
    ) -> Result<()> {
        let r = self.rank;
        let (u, v) = (self.u.slice(0..t * r)?, self.v.slice(0..t * r)?);
        for s in self.slots.iter().flatten() {
            let dys = dy.slice(s.lo..s.lo + (t - 1) * out + s.rows)?;
            g.gemm(&plan::gemm(t, r, inp, x, s.a, GemmY::Bf16(u))?)?;
            g.gemm(&plan::gemm_dw_ld(t, s.rows, r, dys, out, u, s.db, true)?)?;
            g.gemm(&plan::gemm_dx_ld(t, s.rows, r, dys, out, s.b, GemmY::Bf16(v))?)?;
            g.gemm(&plan::gemm_dw(t, r, inp, v, x, s.da, true)?)?;
        }
        Ok(())
    }
}

/// The adapters of one decoder layer's four linears.
#[derive(Debug, Clone, Copy)]
pub struct LayerLora {
    /// q, k, v (stacked).
    pub qkv: LinearLora,
    /// The attention output.
    pub o: LinearLora,
    /// Gate and up (stacked).
    pub gate_up: LinearLora,
    /// Down.
    pub down: LinearLora,
}
