//! Instruction sets the kernels dispatch on at run time.

/// A SIMD instruction set a kernel can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust (8-wide arrays the compiler may vectorise with the baseline ISA). Always available.
    Scalar,
    /// AVX2 with FMA and F16C (8 f32 lanes).
    Avx2,
    /// AVX-512 F/BW/VL (16 f32 lanes).
    Avx512,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn best() -> Isa {
        *Self::available().last().unwrap_or(&Isa::Scalar)
    }

    /// Every instruction set this CPU supports, slowest first (always starts with [`Isa::Scalar`]).
    pub fn available() -> Vec<Isa> {
        let mut out = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                out.push(Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("fma")
            {
                out.push(Isa::Avx512);
            }
        }
        out
    }

    /// Whether this CPU can run kernels built for `self`.
    pub fn is_available(self) -> bool {
        Self::available().contains(&self)
    }

    /// A short lowercase name (`scalar`, `avx2`, `avx512`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}
