//! Seeded random initialisation, for tests, examples and tiny models.

use candle_core::{Device, Tensor};
use tlt_kernels::SeededRng;

use crate::config::LlamaConfig;
use crate::model::Llama;
use crate::weights::{LlamaWeights, TensorSource};
use crate::Result;

/// Standard normal by Box-Muller from the shared seeded generator.
fn normal(rng: &mut SeededRng) -> f64 {
    let u1 = rng.uniform().max(f64::MIN_POSITIVE);
    let u2 = rng.uniform();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Produces random tensors for whatever name is asked: norms (q/k head norms too) near 1, matrices ~ N(0, 1/fan_in),
/// embeddings ~ N(0, 1), biases ~ N(0, 0.1).
struct RandomSource {
    rng: SeededRng,
    cfg: LlamaConfig,
}

impl TensorSource for RandomSource {
    fn path(&self) -> &std::path::Path {
        "<random>".as_ref()
    }

    fn get(&mut self, name: &str) -> Result<Option<Tensor>> {
        let cfg = &self.cfg;
        let (h, q, kv, ffn, v) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size, cfg.vocab_size);
        let head_norm = name.ends_with("q_norm.weight") || name.ends_with("k_norm.weight");
        let (shape, mean, std): (Vec<usize>, f64, f64) = if head_norm {
            (vec![cfg.head_dim()], 1.0, 0.1)
        } else if name.ends_with("norm.weight") {
            (vec![h], 1.0, 0.1)
        } else if name.ends_with(".bias") {
            let out = match name.rsplit('.').nth(1).unwrap_or("") {
                "q_proj" => q,
                "o_proj" => h,
                _ => kv,
            };
            (vec![out], 0.0, 0.1)
        } else if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            (vec![v, h], 0.0, 1.0)
        } else {
            let (out, inp) = match name.rsplit('.').nth(1).unwrap_or("") {
                "q_proj" => (q, h),
                "k_proj" | "v_proj" => (kv, h),
                "o_proj" => (h, q),
                "gate_proj" | "up_proj" => (ffn, h),
                "down_proj" => (h, ffn),
                _ => return Ok(None),
            };
            (vec![out, inp], 0.0, 1.0 / (inp as f64).sqrt())
        };
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| (mean + std * normal(&mut self.rng)) as f32).collect();
        Ok(Some(Tensor::from_vec(data, shape, &Device::Cpu)?))
    }
}

impl Llama {
    /// A model with seeded random weights (same seed, same weights, on every machine).
    pub fn random(cfg: LlamaConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let mut src = RandomSource { rng: SeededRng::new(seed), cfg: cfg.clone() };
        let weights = LlamaWeights::load(&cfg, &mut src)?;
        Llama::new(cfg, weights)
    }
}
