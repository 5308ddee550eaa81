//! A minimal SIMD vocabulary the kernels are written in once, instantiated per instruction set.
//!
//! Every method is `#[inline(always)]` so that a generic kernel called from a `#[target_feature]` entry
//! point compiles to that instruction set.

/// Operations on a vector of `LANES` f32.
///
/// # Safety
/// Implementations use instructions of their ISA: call them only from code running on a CPU that has it
/// (the dispatchers check with [`crate::Isa::available`]). Pointer arguments must be valid for the number
/// of elements read.
pub(crate) unsafe trait Simd: Copy {
    /// f32 lanes per vector.
    const LANES: usize;
    /// The vector type.
    type V: Copy;
    /// All zeros.
    unsafe fn zero() -> Self::V;
    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self::V;
    /// `LANES` f32 from `p` (unaligned).
    unsafe fn load(p: *const f32) -> Self::V;
    /// Stores `LANES` f32 to `p` (unaligned).
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a * b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `a + b`.
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b`.
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise maximum.
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// Sum of all lanes.
    unsafe fn reduce_add(v: Self::V) -> f32;
    /// Maximum of all lanes.
    unsafe fn reduce_max(v: Self::V) -> f32;
    /// Hints the cache line at `p` into L1 (never faults, whatever `p` is).
    unsafe fn prefetch(p: *const u8);
    /// `LANES` IEEE half floats from `p`, widened.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    /// `LANES` bfloat16 from `p`, widened.
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// `LANES` signed bytes from `p`, converted.
    unsafe fn load_i8(p: *const i8) -> Self::V;
    /// The low nibbles of `LANES` bytes from `p`, as 0..=15.
    unsafe fn load_lo_nibbles(p: *const u8) -> Self::V;
    /// The high nibbles of `LANES` bytes from `p`, as 0..=15.
    unsafe fn load_hi_nibbles(p: *const u8) -> Self::V;
}

/// Portable 8-lane implementation on arrays.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

unsafe impl Simd for Scalar {
    const LANES: usize = 8;
    type V = [f32; 8];

    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        unsafe { std::ptr::read_unaligned(p as *const [f32; 8]) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        unsafe { std::ptr::write_unaligned(p as *mut [f32; 8], v) }
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i].max(b[i]))
    }
    #[inline(always)]
    unsafe fn reduce_add(v: Self::V) -> f32 {
        ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]))
    }
    #[inline(always)]
    unsafe fn reduce_max(v: Self::V) -> f32 {
        v.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self::V {
        let h = unsafe { std::ptr::read_unaligned(p as *const [u16; 8]) };
        h.map(|b| half::f16::from_bits(b).to_f32())
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self::V {
        let h = unsafe { std::ptr::read_unaligned(p as *const [u16; 8]) };
        h.map(|b| f32::from_bits((b as u32) << 16))
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self::V {
        let b = unsafe { std::ptr::read_unaligned(p as *const [i8; 8]) };
        b.map(|x| x as f32)
    }
    #[inline(always)]
    unsafe fn load_lo_nibbles(p: *const u8) -> Self::V {
        let b = unsafe { std::ptr::read_unaligned(p as *const [u8; 8]) };
        b.map(|x| (x & 0x0F) as f32)
    }
    #[inline(always)]
    unsafe fn load_hi_nibbles(p: *const u8) -> Self::V {
        let b = unsafe { std::ptr::read_unaligned(p as *const [u8; 8]) };
        b.map(|x| (x >> 4) as f32)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Simd;
    use std::arch::x86_64::*;

    /// AVX2 + FMA + F16C, 8 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    unsafe impl Simd for Avx2 {
        const LANES: usize = 8;
        type V = __m256;

        #[inline(always)]
        unsafe fn zero() -> Self::V {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self::V {
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self::V {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: Self::V) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn max(a: Self::V, b: Self::V) -> Self::V {
            unsafe { _mm256_max_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn reduce_add(v: Self::V) -> f32 {
            unsafe {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
                _mm_cvtss_f32(s)
            }
        }
        #[inline(always)]
        unsafe fn reduce_max(v: Self::V) -> f32 {
            unsafe {
                let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
                _mm_cvtss_f32(s)
            }
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> Self::V {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Self::V {
            unsafe {
                let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
            }
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> Self::V {
            unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
        }
        #[inline(always)]
        unsafe fn load_lo_nibbles(p: *const u8) -> Self::V {
            unsafe {
                let w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0x0F)))
            }
        }
        #[inline(always)]
        unsafe fn load_hi_nibbles(p: *const u8) -> Self::V {
            unsafe {
                let w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4))
            }
        }
    }

    /// AVX-512 F/BW/VL, 16 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512;

    unsafe impl Simd for Avx512 {
        const LANES: usize = 16;
        type V = __m512;

        #[inline(always)]
        unsafe fn zero() -> Self::V {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self::V {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self::V {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: Self::V) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn max(a: Self::V, b: Self::V) -> Self::V {
            unsafe { _mm512_max_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn reduce_add(v: Self::V) -> f32 {
            unsafe { _mm512_reduce_add_ps(v) }
        }
        #[inline(always)]
        unsafe fn reduce_max(v: Self::V) -> f32 {
            unsafe { _mm512_reduce_max_ps(v) }
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> Self::V {
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Self::V {
            unsafe {
                let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
                _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))
            }
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> Self::V {
            unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))) }
        }
        #[inline(always)]
        unsafe fn load_lo_nibbles(p: *const u8) -> Self::V {
            unsafe {
                let w = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(0x0F)))
            }
        }
        #[inline(always)]
        unsafe fn load_hi_nibbles(p: *const u8) -> Self::V {
            unsafe {
                let w = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4))
            }
        }
    }
}
