//! The device memory a trainer plans for before its first rollout: the rollout engine's policy (bf16 weights, the
//! KV cache, the CUDA graph pool's budget), the EAGLE drafter's forward, the frozen reference for the KL term, and
//! the update's f32 master weights, moments, gradients and activations, under the device's memory.

use std::fmt;

use serde::Serialize;
use tlt_model::cuda::train::{lora_memory, train_memory, LoraConfig, TrainOptions};
use tlt_model::LlamaConfig;

use super::config::TrainerConfig;

/// The CUDA graph pool's memory budget of the rollout engine (captured shapes' buffers and graphs).
pub(crate) const GRAPH_BUDGET: u64 = 2 << 30;

/// The KV cache positions per sequence of the rollout engine for prompts up to `prompt_room` tokens.
pub(crate) fn cache_positions(prompt_room: usize, max_new_tokens: usize) -> usize {
    prompt_room + max_new_tokens + tlt_kernels::cuda::MAX_TREE_NODES + 1
}

/// Bytes of each part of a trainer's device memory (0 for a part the run does not have).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DeviceMemoryPlan {
    /// The policy's bf16 weights (the rollout engine's, trained in place).
    pub policy_weights: u64,
    /// The rollout engine's KV cache (every running request at the longest prompt room and answer).
    pub kv_cache: u64,
    /// Positions the KV cache holds, over every sequence (`kv_cache` is their keys and values).
    pub kv_positions: u64,
    /// The CUDA graph pool's budget (captured shapes' buffers and graphs; least recently used shapes evicted).
    pub graph_pool: u64,
    /// The EAGLE drafter's bf16 weights and KV cache on the device.
    pub drafter: u64,
    /// The frozen reference policy's bf16 weights (the KL term).
    pub reference: u64,
    /// The update's f32 master weights, AdamW moments and gradients (16 bytes per weight).
    pub optimizer: u64,
    /// The update's activations for its largest micro-batch.
    pub activations: u64,
}

impl DeviceMemoryPlan {
    /// The plan of a run of `run` for a policy of `cfg` with `params` weights (for a model not built yet:
    /// [`weight_count`]) and a drafter of `drafter` bytes on the device: what [`super::Trainer::device_memory_plan`]
    /// reports for such a trainer.
    #[must_use]
    pub fn new(cfg: &LlamaConfig, params: u64, run: &TrainerConfig, drafter: u64) -> Self {
        let slots = run.prompts_per_step * run.group_size;
        let positions = cache_positions(run.max_prompt_tokens, run.max_new_tokens).next_multiple_of(256);
        let update = run.update_on_device;
        let kl = run.grpo.kl.is_some();
        Self {
            policy_weights: 2 * params,
            kv_cache: kv_bytes(cfg, slots, positions),
            kv_positions: (slots * positions) as u64,
            graph_pool: GRAPH_BUDGET,
            drafter,
            reference: if update && kl { 2 * params } else { 0 },
            optimizer: if update { 16 * params } else { 0 },
            activations: if update { train_memory(cfg, 0, &update_options(run)) as u64 } else { 0 },
        }
    }

    /// [`Self::new`] with LoRA on the device (`tlt_model::cuda::train::CudaLoraTrainer`) instead of full
    /// fine-tuning: `optimizer` is the frozen base's bf16 copy and the adapters' f32 state, `activations` the same
    /// training pass's buffers.
    #[must_use]
    pub fn with_lora(cfg: &LlamaConfig, params: u64, run: &TrainerConfig, lora: &LoraConfig, drafter: u64) -> Self {
        let mut plan = Self::new(cfg, params, run, drafter);
        if run.update_on_device {
            let opts = update_options(run);
            let trainer = lora_memory(cfg, lora, &opts) as u64;
            plan.activations = train_memory(cfg, 0, &opts) as u64;
            plan.optimizer = trainer - plan.activations;
        }
        plan
    }

    /// The sum of every part.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.policy_weights
            + self.kv_cache
            + self.graph_pool
            + self.drafter
            + self.reference
            + self.optimizer
            + self.activations
    }
}

/// The device update's buffers for `run`: room for the most tokens of one micro-batch (a sequence longer than the
/// token budget runs alone: a whole prompt and answer), checkpointed as configured, the LM head in chunks.
#[must_use]
pub fn update_options(run: &TrainerConfig) -> TrainOptions {
    let rows = run.micro_batch_tokens.max(run.max_prompt_tokens + run.max_new_tokens);
    TrainOptions { checkpoint: run.activation_checkpointing, ..TrainOptions::new(rows) }
}

/// The weights of a model of `cfg`, counted from its config as the decoder holds them (the LM head only when not
/// tied; q/k/v biases for Qwen2 or `attention_bias`; Qwen3's q/k head norms).
///
/// # Errors
/// An unknown `model_type`.
pub fn weight_count(cfg: &LlamaConfig) -> crate::Result<u64> {
    let bias = cfg.attention_bias()?;
    let (h, q, kv, inter) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
    let qkv = q + 2 * kv;
    let layer = 2 * h
        + qkv * h
        + if bias.qkv { qkv } else { 0 }
        + h * q
        + if bias.o { h } else { 0 }
        + 3 * inter * h
        + if cfg.qk_norm() { 2 * cfg.head_dim() } else { 0 };
    let head = if cfg.tie_word_embeddings { 0 } else { cfg.vocab_size * h };
    Ok((cfg.vocab_size * h + head + h + cfg.num_hidden_layers * layer) as u64)
}

/// The KV cache of `cfg` for `slots` sequences of `positions` positions, bf16 keys and values.
pub(crate) fn kv_bytes(cfg: &LlamaConfig, slots: usize, positions: usize) -> u64 {
    (slots * positions * cfg.num_hidden_layers * 2 * cfg.kv_dim() * 2) as u64
}

impl fmt::Display for DeviceMemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        let parts = [
            ("policy weights (bf16)", self.policy_weights),
            ("KV cache", self.kv_cache),
            ("graph pool (budget)", self.graph_pool),
            ("EAGLE drafter", self.drafter),
            ("reference (bf16)", self.reference),
            ("update: f32 state (LoRA: + bf16 base copy)", self.optimizer),
            ("update: activations", self.activations),
        ];
        for (name, b) in parts.iter().filter(|(_, b)| *b > 0) {
            writeln!(f, "  {name:<40} {:>8.3} GiB", gib(*b))?;
            if *name == "KV cache" {
                writeln!(f, "    {:<38} {:>8}", "positions (all sequences)", self.kv_positions)?;
            }
        }
        write!(f, "  {:<40} {:>8.3} GiB", "total", gib(self.total()))
    }
}

#[cfg(test)]
mod tests {
    use tlt_model::{Llama, LlamaConfig};

    use super::weight_count;

    /// The count from the config is the built model's, for every architecture the decoder covers.
    #[test]
    fn weight_count_is_the_built_models() {
        let mut seen = Vec::new();
        for (model_type, tied, bias) in [
            ("llama", false, false),
            ("llama", true, false),
            ("llama", false, true),
            ("qwen2", true, false),
            ("qwen3", false, false),
        ] {
            let mut cfg = LlamaConfig::tiny(40, 32, 2);
            cfg.model_type = model_type.into();
            cfg.tie_word_embeddings = tied;
            cfg.attention_bias = bias;
            if model_type == "qwen3" {
                cfg.head_dim = Some(16);
            }
            let built = Llama::random(cfg.clone(), 1).unwrap().weights().num_params() as u64;
            let counted = weight_count(&cfg).unwrap();
            assert_eq!(counted, built, "{model_type} tied {tied} bias {bias}");
            seen.push(counted);
        }
        seen.dedup();
        assert_eq!(seen.len(), 5, "every variant changes the count: {seen:?}");
    }
}
