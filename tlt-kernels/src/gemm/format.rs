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
    /// Bytes of one 32-element chunk of a row.
    const CHUNK_BYTES: usize;
    /// Whether the kernel should software-prefetch the next panel (helps the converting formats, whose
    /// slower compute leaves the hardware prefetcher behind; hurts plain f32).
    const PREFETCH: bool = true;
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
    const CHUNK_BYTES: usize = 128;
    // Both 64-byte lines of a 128-byte chunk are prefetched. Measured with `cargo xtask bench kernels` on a 2-vCPU
    // EPYC (AVX-512, and AVX2 through TLT_KERNELS_ISA=avx2), LM head 576x49152: m=1 4.34 -> 4.25 ms and m=8
    // 7.31 -> 6.04 ms on AVX-512; m=1 5.8-7.0 -> 5.2-5.7 ms on AVX2 (three interleaved runs each). An earlier
    // version prefetched only the first line of each chunk and measured no gain.
    const PREFETCH: bool = true;
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
    const CHUNK_BYTES: usize = 64;
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
    const CHUNK_BYTES: usize = 64;
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
    F16_TO_F32[b as usize]
}

/// Every f16 bit pattern widened to f32, computed at compile time: block scales become one broadcast load
/// instead of an insert + convert + broadcast on the vector ports.
static F16_TO_F32: [f32; 1 << 16] = {
    let mut t = [0f32; 1 << 16];
    let mut i = 0;
    while i < (1 << 16) {
        t[i] = f16_to_f32_const(i as u16);
        i += 1;
    }
    t
};

const fn f16_to_f32_const(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1F) as u32;
    let man = (h & 0x3FF) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: normalise the mantissa.
            let mut e = 127 - 15 + 1;
            let mut m = man;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | ((e as u32) << 23) | ((m & 0x3FF) << 13)
        }
    } else if exp == 0x1F {
        sign | 0x7F80_0000 | (man << 13)
    } else {
        sign | ((exp + 127 - 15) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

unsafe impl Format for Q8_0 {
    type Elem = BlockQ8_0;
    const CHUNK_BYTES: usize = 34;
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
    const CHUNK_BYTES: usize = 18;
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
    const CHUNK_BYTES: usize = 20;
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

#[cfg(test)]
mod tests {
    #[test]
    fn f16_table_matches_half() {
        for b in 0..=u16::MAX {
            let (want, got) = (half::f16::from_bits(b).to_f32(), super::f16_bits(b));
            assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()), "{b:#x}");
        }
    }
}
