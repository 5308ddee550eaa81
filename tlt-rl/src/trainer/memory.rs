//! The device memory a trainer plans for before its first rollout: the rollout engine's policy (bf16 weights, the
//! KV cache, the CUDA graph pool's budget), the EAGLE drafter's forward, the frozen reference for the KL term, and
//! the update's f32 master weights, moments, gradients and activations, under the device's memory.

use std::fmt;

use serde::Serialize;
use tlt_model::LlamaConfig;

/// Bytes of each part of a trainer's device memory (0 for a part the run does not have).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DeviceMemoryPlan {
    /// The policy's bf16 weights (the rollout engine's, trained in place).
    pub policy_weights: u64,
    /// The rollout engine's KV cache (every running request at the longest prompt room and answer).
    pub kv_cache: u64,
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
            ("update: f32 master, moments, gradients", self.optimizer),
            ("update: activations", self.activations),
        ];
        for (name, b) in parts.iter().filter(|(_, b)| *b > 0) {
            writeln!(f, "  {name:<40} {:>8.3} GiB", gib(*b))?;
        }
        write!(f, "  {:<40} {:>8.3} GiB", "total", gib(self.total()))
    }
}
