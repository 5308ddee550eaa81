//! How each weight format yields SIMD vectors of f32 weights, 32 elements (one "chunk") at a time.

use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};
use crate::simd::Simd;

/// A weight storage format the kernels stream.
///
/// # Safety
/// `row` must point at a row of at least `chunks * 32` elements (or `chunks` blocks).
pub(crate) unsafe trait Format: Copy + Send + Sync + 'static {
    /// Element (or block) type of a row.
    type Elem: Copy + Send + Sync;
    /// Whether elements need converting to f32 (everything but f32 itself).
    const CONVERTS: bool = true;
    /// Vector `j` (of `32 / LANES`) of chunk `c` of `row`, as f32.
    unsafe fn load<S: Simd>(row: *const Self::Elem, c: usize, j: usize) -> S::V;
    /// Element `i` of `row` as f32 (for tails and references).
    unsafe fn get(row: *const Self::Elem, i: usize) -> f32;
}

#[derive(Clone, Copy)]
pub(crate) struct F32;
#[derive(Clone, Copy)]
pub(crate) struct F16;
#[derive(Clone, Copy)]
pub(crate) struct Bf16;
#[derive(Clone, Copy)]
pub(crate) struct Q8_0;
#[derive(Clone, Copy)]
pub(crate) struct Q4_0;
#[derive(Clone, Copy)]
pub(crate) struct Q4_1;

unsafe impl Format for F32 {
    type Elem = f32;
    const CONVERTS: bool = false;
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const f32, c: usize, j: usize) -> S::V {
        unsafe { S::load(row.add(c * QK + j * S::LANES)) }
    }
    #[inline(always)]
    unsafe fn get(row: *const f32, i: usize) -> f32 {
        unsafe { *row.add(i) }
    }
}

unsafe impl Format for F16 {
    type Elem = u16;
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const u16, c: usize, j: usize) -> S::V {
        unsafe { S::load_f16(row.add(c * QK + j * S::LANES)) }
    }
    #[inline(always)]
    unsafe fn get(row: *const u16, i: usize) -> f32 {
        half::f16::from_bits(unsafe { *row.add(i) }).to_f32()
    }
}

unsafe impl Format for Bf16 {
    type Elem = u16;
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const u16, c: usize, j: usize) -> S::V {
        unsafe { S::load_bf16(row.add(c * QK + j * S::LANES)) }
    }
    #[inline(always)]
    unsafe fn get(row: *const u16, i: usize) -> f32 {
        f32::from_bits((unsafe { *row.add(i) } as u32) << 16)
    }
}

#[inline(always)]
fn f16_bits(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

unsafe impl Format for Q8_0 {
    type Elem = BlockQ8_0;
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const BlockQ8_0, c: usize, j: usize) -> S::V {
        unsafe {
            let b = &*row.add(c);
            S::mul(S::load_i8(b.qs.as_ptr().add(j * S::LANES)), S::splat(f16_bits(b.d)))
        }
    }
    #[inline(always)]
    unsafe fn get(row: *const BlockQ8_0, i: usize) -> f32 {
        let b = unsafe { &*row.add(i / QK) };
        b.qs[i % QK] as f32 * f16_bits(b.d)
    }
}

/// Nibbles `j * LANES ..` of a 32-element block: the low nibbles of bytes 0..16 are elements 0..16,
/// the high nibbles elements 16..32.
#[inline(always)]
unsafe fn nibble_vec<S: Simd>(qs: &[u8; QK / 2], j: usize) -> S::V {
    let e = j * S::LANES;
    unsafe {
        if e < QK / 2 {
            S::load_lo_nibbles(qs.as_ptr().add(e))
        } else {
            S::load_hi_nibbles(qs.as_ptr().add(e - QK / 2))
        }
    }
}

unsafe impl Format for Q4_0 {
    type Elem = BlockQ4_0;
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const BlockQ4_0, c: usize, j: usize) -> S::V {
        unsafe {
            let b = &*row.add(c);
            let d = f16_bits(b.d);
            S::fma(nibble_vec::<S>(&b.qs, j), S::splat(d), S::splat(-8.0 * d))
        }
    }
    #[inline(always)]
    unsafe fn get(row: *const BlockQ4_0, i: usize) -> f32 {
        let b = unsafe { &*row.add(i / QK) };
        let e = i % QK;
        let q = if e < QK / 2 { b.qs[e] & 0x0F } else { b.qs[e - QK / 2] >> 4 };
        (q as f32 - 8.0) * f16_bits(b.d)
    }
}

unsafe impl Format for Q4_1 {
    type Elem = BlockQ4_1;
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const BlockQ4_1, c: usize, j: usize) -> S::V {
        unsafe {
            let b = &*row.add(c);
            S::fma(nibble_vec::<S>(&b.qs, j), S::splat(f16_bits(b.d)), S::splat(f16_bits(b.m)))
        }
    }
    #[inline(always)]
    unsafe fn get(row: *const BlockQ4_1, i: usize) -> f32 {
        let b = unsafe { &*row.add(i / QK) };
        let e = i % QK;
        let q = if e < QK / 2 { b.qs[e] & 0x0F } else { b.qs[e - QK / 2] >> 4 };
        q as f32 * f16_bits(b.d) + f16_bits(b.m)
    }
}
