//! Per-engine generation parameters.

use serde::{Deserialize, Serialize};
use tlt_kernels::SamplingParams;

use crate::{Error, Result};

/// Serde mirror of `tlt_kernels::SamplingParams`.
#[derive(Serialize, Deserialize)]
#[serde(remote = "SamplingParams")]
struct SamplingParamsDef {
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
}

/// How the [`Engine`](crate::Engine) generates: sampling, length, stop tokens and strings, seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SpecParams {
    /// Temperature / top-k / top-p of the target distribution (temperature 0 = greedy). Default: temperature 1.
    #[serde(with = "SamplingParamsDef")]
    pub sampling: SamplingParams,
    /// Most new tokens per request (`>= 1`). Default 512.
    pub max_new_tokens: usize,
    /// Tokens that end a request (kept in its output). `None` (default): the target's end-of-sequence tokens.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Strings that end a request once the generated text contains one (the token completing it is kept).
    /// Needs a [`TokenDecoder`](crate::TokenDecoder) ([`Engine::with_decoder`](crate::Engine::with_decoder)).
    pub stop: Vec<String>,
    /// Seed of the sampling streams (each request forks its own stream by request id). Default 0.
    pub seed: u64,
}

impl Default for SpecParams {
    fn default() -> Self {
        Self {
            sampling: SamplingParams::default(),
            max_new_tokens: 512,
            stop_token_ids: None,
            stop: Vec::new(),
            seed: 0,
        }
    }
}

impl SpecParams {
    /// Greedy decoding of up to `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self { sampling: SamplingParams::greedy(), max_new_tokens, ..Self::default() }
    }

    /// Checks the sampling ranges (temperature finite and `>= 0`, `top_k >= 1`, `0 < top_p <= 1`) and
    /// `max_new_tokens >= 1` and non-empty stop strings.
    ///
    /// # Errors
    /// [`Error::Kernel`] for bad sampling params, [`Error::InvalidArgument`] for `max_new_tokens == 0` or an
    /// empty stop string.
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()?;
        if self.max_new_tokens == 0 {
            return Err(Error::InvalidArgument("max_new_tokens must be at least 1".into()));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(Error::InvalidArgument("stop strings must not be empty".into()));
        }
        Ok(())
    }
}
