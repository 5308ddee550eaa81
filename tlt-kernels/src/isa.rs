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
    /// The best instruction set this CPU supports, capped by the environment variable `TLT_KERNELS_ISA`
    /// (`scalar`, `avx2` or `avx512`; read once) so that one machine can measure the narrower kernels too. An
    /// unknown value is ignored.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let best = *Self::available().last().unwrap_or(&Isa::Scalar);
            let cap = std::env::var("TLT_KERNELS_ISA").ok().and_then(|v| Self::parse(&v));
            cap.map_or(best, |c| c.min(best))
        })
    }

    /// The ISA of a [`Self::name`] (`None` for anything else).
    pub fn parse(name: &str) -> Option<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().find(|i| i.name() == name.trim().to_ascii_lowercase())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_none() {
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
        }
        assert_eq!(Isa::parse(" AVX2 "), Some(Isa::Avx2));
        assert_eq!(Isa::parse("sse4"), None);
        assert!(Isa::best().is_available());
    }
}
