//! Weight matrices `[n, k]` (out × in) in the formats the kernels read.

use crate::quant::{quantize_rows, BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};
use crate::{Error, Result};

/// Storage format of a weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightDType {
    /// f32.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// GGUF Q8_0 blocks.
    Q8_0,
    /// GGUF Q4_0 blocks.
    Q4_0,
    /// GGUF Q4_1 blocks.
    Q4_1,
}

impl WeightDType {
    /// Bytes a row of `k` elements occupies.
    pub fn row_bytes(self, k: usize) -> usize {
        match self {
            Self::F32 => 4 * k,
            Self::F16 | Self::Bf16 => 2 * k,
            Self::Q8_0 => k / QK * 34,
            Self::Q4_0 => k / QK * 18,
            Self::Q4_1 => k / QK * 20,
        }
    }

    /// Whether the format stores 32-element blocks (so `k` must be a multiple of 32).
    pub fn is_blocked(self) -> bool {
        matches!(self, Self::Q8_0 | Self::Q4_0 | Self::Q4_1)
    }
}

/// Borrowed weight storage.
#[derive(Debug, Clone, Copy)]
pub enum WeightsRef<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 bit patterns.
    F16(&'a [u16]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
    /// Q8_0 blocks.
    Q8_0(&'a [BlockQ8_0]),
    /// Q4_0 blocks.
    Q4_0(&'a [BlockQ4_0]),
    /// Q4_1 blocks.
    Q4_1(&'a [BlockQ4_1]),
}

impl WeightsRef<'_> {
    fn dtype(&self) -> WeightDType {
        match self {
            Self::F32(_) => WeightDType::F32,
            Self::F16(_) => WeightDType::F16,
            Self::Bf16(_) => WeightDType::Bf16,
            Self::Q8_0(_) => WeightDType::Q8_0,
            Self::Q4_0(_) => WeightDType::Q4_0,
            Self::Q4_1(_) => WeightDType::Q4_1,
        }
    }

    fn stored_len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::F16(s) | Self::Bf16(s) => s.len(),
            Self::Q8_0(s) => s.len(),
            Self::Q4_0(s) => s.len(),
            Self::Q4_1(s) => s.len(),
        }
    }
}

/// A validated view of an `[n, k]` weight matrix (row `j` holds the weights of output `j`).
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    n: usize,
    k: usize,
    data: WeightsRef<'a>,
}

impl<'a> MatRef<'a> {
    /// Checks that `data` holds exactly `n` rows of `k` elements.
    pub fn new(n: usize, k: usize, data: WeightsRef<'a>) -> Result<Self> {
        let dtype = data.dtype();
        if dtype.is_blocked() && !k.is_multiple_of(QK) {
            return Err(Error::BlockAlignment { k });
        }
        let expected = if dtype.is_blocked() { n * k / QK } else { n * k };
        if data.stored_len() != expected {
            return Err(Error::ShapeMismatch { what: "weights", expected, got: data.stored_len() });
        }
        Ok(Self { n, k, data })
    }

    /// Output features (rows).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features (columns).
    pub fn k(&self) -> usize {
        self.k
    }

    /// The storage.
    pub fn data(&self) -> WeightsRef<'a> {
        self.data
    }

    /// The storage format.
    pub fn dtype(&self) -> WeightDType {
        self.data.dtype()
    }

    /// Bytes of weights a GEMM with this matrix streams.
    pub fn bytes(&self) -> usize {
        self.dtype().row_bytes(self.k) * self.n
    }
}

#[derive(Debug, Clone)]
enum Owned {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Bf16(Vec<u16>),
    Q8_0(Vec<BlockQ8_0>),
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
}

/// An owned `[n, k]` weight matrix in any supported format.
#[derive(Debug, Clone)]
pub struct Matrix {
    n: usize,
    k: usize,
    data: Owned,
}

impl Matrix {
    /// Converts row-major f32 weights `[n, k]` to `dtype` (quantizing with llama.cpp's reference rounding).
    pub fn from_f32(n: usize, k: usize, w: &[f32], dtype: WeightDType) -> Result<Self> {
        if w.len() != n * k {
            return Err(Error::ShapeMismatch { what: "weights", expected: n * k, got: w.len() });
        }
        if dtype.is_blocked() && !k.is_multiple_of(QK) {
            return Err(Error::BlockAlignment { k });
        }
        let data = match dtype {
            WeightDType::F32 => Owned::F32(w.to_vec()),
            WeightDType::F16 => Owned::F16(w.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect()),
            WeightDType::Bf16 => Owned::Bf16(w.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect()),
            WeightDType::Q8_0 => Owned::Q8_0(quantize_rows(w)),
            WeightDType::Q4_0 => Owned::Q4_0(quantize_rows(w)),
            WeightDType::Q4_1 => Owned::Q4_1(quantize_rows(w)),
        };
        Ok(Self { n, k, data })
    }

    /// Wraps already-quantized Q8_0 blocks (e.g. read from GGUF).
    pub fn from_q8_0(n: usize, k: usize, blocks: Vec<BlockQ8_0>) -> Result<Self> {
        MatRef::new(n, k, WeightsRef::Q8_0(&blocks))?;
        Ok(Self { n, k, data: Owned::Q8_0(blocks) })
    }

    /// Wraps already-quantized Q4_0 blocks.
    pub fn from_q4_0(n: usize, k: usize, blocks: Vec<BlockQ4_0>) -> Result<Self> {
        MatRef::new(n, k, WeightsRef::Q4_0(&blocks))?;
        Ok(Self { n, k, data: Owned::Q4_0(blocks) })
    }

    /// Wraps already-quantized Q4_1 blocks.
    pub fn from_q4_1(n: usize, k: usize, blocks: Vec<BlockQ4_1>) -> Result<Self> {
        MatRef::new(n, k, WeightsRef::Q4_1(&blocks))?;
        Ok(Self { n, k, data: Owned::Q4_1(blocks) })
    }

    /// A borrowed view for [`crate::gemm`].
    pub fn view(&self) -> MatRef<'_> {
        let data = match &self.data {
            Owned::F32(v) => WeightsRef::F32(v),
            Owned::F16(v) => WeightsRef::F16(v),
            Owned::Bf16(v) => WeightsRef::Bf16(v),
            Owned::Q8_0(v) => WeightsRef::Q8_0(v),
            Owned::Q4_0(v) => WeightsRef::Q4_0(v),
            Owned::Q4_1(v) => WeightsRef::Q4_1(v),
        };
        MatRef { n: self.n, k: self.k, data }
    }

    /// The weights as f32 (dequantized), row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        use crate::quant::dequantize_blocks;
        match &self.data {
            Owned::F32(v) => v.clone(),
            Owned::F16(v) => v.iter().map(|b| half::f16::from_bits(*b).to_f32()).collect(),
            Owned::Bf16(v) => v.iter().map(|b| half::bf16::from_bits(*b).to_f32()).collect(),
            Owned::Q8_0(v) => dequantize_blocks(v),
            Owned::Q4_0(v) => dequantize_blocks(v),
            Owned::Q4_1(v) => dequantize_blocks(v),
        }
    }

    /// Row `j` as f32.
    pub fn row_f32(&self, j: usize) -> Vec<f32> {
        self.to_f32()[j * self.k..(j + 1) * self.k].to_vec()
    }
}
