//! GGUF block-quantized weight formats, bit-compatible with llama.cpp (`block_q8_0`, `block_q4_0`,
//! `block_q4_1`), with scalar reference (de)quantization.

use half::f16;

/// Elements per quantization block (all formats here).
pub const QK: usize = 32;

/// 32 weights as `d * q` with an f16 scale `d` and signed bytes `q` (34 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Quants.
    pub qs: [i8; QK],
}

/// 32 weights as `d * (q - 8)`, 4-bit `q`; byte `j` holds element `j` (low nibble) and `j + 16` (high) (18 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Packed nibbles.
    pub qs: [u8; QK / 2],
}

/// 32 weights as `d * q + m`, 4-bit `q`, nibble layout as [`BlockQ4_0`] (20 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Offset, f16 bits.
    pub m: u16,
    /// Packed nibbles.
    pub qs: [u8; QK / 2],
}

/// A block format: byte size, parsing from GGUF bytes, reference quantization and dequantization.
pub trait QuantBlock: Copy + Send + Sync + 'static {
    /// Bytes per block in GGUF files.
    const BYTES: usize;
    /// Parses one block from exactly [`Self::BYTES`] little-endian bytes.
    fn from_bytes(b: &[u8]) -> Self;
    /// Quantizes 32 values (llama.cpp's reference rounding).
    fn quantize(x: &[f32; QK]) -> Self;
    /// Dequantizes to 32 values.
    fn dequantize(&self) -> [f32; QK];
}

fn h(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

fn nibbles(qs: &[u8; QK / 2]) -> [u8; QK] {
    std::array::from_fn(|i| if i < QK / 2 { qs[i] & 0x0F } else { qs[i - QK / 2] >> 4 })
}

fn pack(q: &[u8; QK]) -> [u8; QK / 2] {
    std::array::from_fn(|j| q[j] | (q[j + QK / 2] << 4))
}

impl QuantBlock for BlockQ8_0 {
    const BYTES: usize = 34;
    fn from_bytes(b: &[u8]) -> Self {
        Self { d: u16::from_le_bytes([b[0], b[1]]), qs: std::array::from_fn(|i| b[2 + i] as i8) }
    }
    fn quantize(x: &[f32; QK]) -> Self {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        Self { d: f16::from_f32(d).to_bits(), qs: x.map(|v| (v * id).round() as i8) }
    }
    fn dequantize(&self) -> [f32; QK] {
        let d = h(self.d);
        self.qs.map(|q| q as f32 * d)
    }
}

impl QuantBlock for BlockQ4_0 {
    const BYTES: usize = 18;
    fn from_bytes(b: &[u8]) -> Self {
        Self { d: u16::from_le_bytes([b[0], b[1]]), qs: std::array::from_fn(|i| b[2 + i]) }
    }
    fn quantize(x: &[f32; QK]) -> Self {
        let max = x.iter().copied().fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = x.map(|v| ((v * id + 8.5) as i32).clamp(0, 15) as u8);
        Self { d: f16::from_f32(d).to_bits(), qs: pack(&q) }
    }
    fn dequantize(&self) -> [f32; QK] {
        let d = h(self.d);
        nibbles(&self.qs).map(|q| (q as f32 - 8.0) * d)
    }
}

impl QuantBlock for BlockQ4_1 {
    const BYTES: usize = 20;
    fn from_bytes(b: &[u8]) -> Self {
        Self {
            d: u16::from_le_bytes([b[0], b[1]]),
            m: u16::from_le_bytes([b[2], b[3]]),
            qs: std::array::from_fn(|i| b[4 + i]),
        }
    }
    fn quantize(x: &[f32; QK]) -> Self {
        let min = x.iter().copied().fold(f32::INFINITY, f32::min);
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = x.map(|v| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8);
        Self { d: f16::from_f32(d).to_bits(), m: f16::from_f32(min).to_bits(), qs: pack(&q) }
    }
    fn dequantize(&self) -> [f32; QK] {
        let (d, m) = (h(self.d), h(self.m));
        nibbles(&self.qs).map(|q| q as f32 * d + m)
    }
}

/// Quantizes a row-major `[rows, cols]` matrix (`cols` a multiple of 32) block by block.
pub fn quantize_rows<B: QuantBlock>(x: &[f32]) -> Vec<B> {
    x.chunks_exact(QK).map(|c| B::quantize(c.try_into().expect("chunk of 32"))).collect()
}

/// Dequantizes blocks back to f32.
pub fn dequantize_blocks<B: QuantBlock>(blocks: &[B]) -> Vec<f32> {
    blocks.iter().flat_map(|b| b.dequantize()).collect()
}

/// Parses GGUF block bytes; `None` if the length is not a whole number of blocks.
pub fn blocks_from_bytes<B: QuantBlock>(bytes: &[u8]) -> Option<Vec<B>> {
    bytes.len().is_multiple_of(B::BYTES).then(|| bytes.chunks_exact(B::BYTES).map(B::from_bytes).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<B: QuantBlock>(tol: f32) {
        let x: [f32; QK] = std::array::from_fn(|i| ((i * 7919) % 61) as f32 / 30.0 - 1.0);
        let y = B::quantize(&x).dequantize();
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= tol, "{a} vs {b}");
        }
    }

    #[test]
    fn quantization_round_trips_within_a_step() {
        round_trip::<BlockQ8_0>(1.0 / 127.0);
        round_trip::<BlockQ4_0>(1.0 / 8.0 + 1e-3);
        round_trip::<BlockQ4_1>(2.0 / 15.0);
    }

    #[test]
    fn nibble_layout_matches_llama_cpp() {
        let b = BlockQ4_0 { d: f16::from_f32(1.0).to_bits(), qs: std::array::from_fn(|j| (j as u8) | (15 << 4)) };
        let y = b.dequantize();
        assert_eq!(y[3], 3.0 - 8.0);
        assert_eq!(y[16 + 3], 15.0 - 8.0);
        let bytes: Vec<u8> = [b.d.to_le_bytes().as_slice(), b.qs.as_slice()].concat();
        assert_eq!(BlockQ4_0::from_bytes(&bytes), b);
    }
}
