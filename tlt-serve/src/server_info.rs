//! `GET /get_server_info` and `GET /server_info`: SGLang's server arguments as this server really runs, with the
//! names SGLang gives them, for the clients that read them at start-up:
//! - slime's external-engine start-up (`slime/backends/sglang_utils/external.py`, `sglang_engine.py`): it asks
//!   `/server_info` first, then `/get_server_info`, reads the topology (`tp_size`, `pp_size`, `ep_size`,
//!   `moe_dp_size`, `num_gpus`, `disaggregation_mode`, `encoder_only`) and asserts the arguments it would have
//!   launched SGLang with (`enable_memory_saver`, and `dtype` with `--fp16`);
//! - sglang-router, which reads `model_path`, `tp_size` and `dp_size` when a worker registers;
//! - TRL 1.16's `VLLMClient.get_server_info`, which reads the answer's `vllm_config` (vLLM's development endpoint):
//!   `weight_transfer_config` (null: no weight-transfer engine is served, so TRL's NCCL weight sync refuses to start
//!   with its own message) and `model_config.logprobs_mode`.
//!
//! Every value is what the server does, not what a client hopes for: one process on one device (tensor, data,
//! pipeline and expert parallelism 1), no memory saver, the device's activations, the model's context, the KV pool
//! it sized, and the bandit's arms.

use serde_json::{json, Value};
use tlt_kernels::WeightDType;

/// What the server runs with, to report.
#[derive(Debug, Clone)]
pub struct RunningArgs<'a> {
    /// The model's path (its name in answers).
    pub model_path: &'a str,
    /// Whether a tokenizer was loaded (SGLang's `skip_tokenizer_init` is its negation).
    pub has_tokenizer: bool,
    /// The format the inference forward reads the linear layers in.
    pub weight_dtype: WeightDType,
    /// The model's context (prompt plus output).
    pub context_length: usize,
    /// The vocabulary size.
    pub vocab_size: usize,
    /// Most requests decoding at once.
    pub max_running_requests: usize,
    /// The KV pool.
    pub pool: crate::pool::Pool,
    /// The device (`cpu`, `cuda:N`, `sim`).
    pub device: String,
    /// The activations' and the KV cache's element type.
    pub dtype: &'static str,
    /// SGLang's `speculative_algorithm` (`None`: no speculation).
    pub speculative_algorithm: Option<&'static str>,
    /// The bandit's buckets and arms ([`crate::decode::bandit_arms`]), with speculation.
    pub bandit: Option<Value>,
}

/// SGLang's name of the weights' storage format (`quantization`): none for f32, f16 and bf16 weights (a dtype, not
/// a quantization), GGUF's block names otherwise.
fn quantization(d: WeightDType) -> Option<&'static str> {
    match d {
        WeightDType::F32 | WeightDType::F16 | WeightDType::Bf16 => None,
        WeightDType::Q8_0 => Some("q8_0"),
        WeightDType::Q4_0 => Some("q4_0"),
        WeightDType::Q4_1 => Some("q4_1"),
    }
}

/// The weights' storage format, by name.
fn weight_dtype(d: WeightDType) -> &'static str {
    match d {
        WeightDType::F32 => "float32",
        WeightDType::F16 => "float16",
        WeightDType::Bf16 => "bfloat16",
        WeightDType::Q8_0 => "q8_0",
        WeightDType::Q4_0 => "q4_0",
        WeightDType::Q4_1 => "q4_1",
    }
}

/// The server arguments, as SGLang's `/get_server_info` names them, plus TRL's `vllm_config` and the bandit's arms
/// (`speculative_bandit`). `dtype` is the activations' (`float32` on the CPU, whatever the weights' storage, which
/// `weight_dtype` and `quantization` give; `bfloat16` on a device). `max_total_tokens` is the KV pool's tokens,
/// the bound the caches really have (a request waits until the pool holds its prompt and `max_new_tokens`).
pub fn server_args(a: &RunningArgs<'_>) -> Value {
    let max_total_tokens = a.pool.tokens;
    // TRL reads `model_config.logprobs_mode`: the served log-probs are after temperature scaling (penalties other
    // than the neutral ones are refused; top-k/top-p are not applied to them, as SGLang's default), which is what
    // vLLM's `processed_logprobs` gives for TRL's sampling (top-k and top-p off).
    let vllm_config = json!({
        "model_config": {"model": a.model_path, "max_model_len": a.context_length, "dtype": a.dtype,
            "logprobs_mode": "processed_logprobs"},
        "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1, "pipeline_parallel_size": 1},
        "weight_transfer_config": null,
    });
    json!({
        "model_path": a.model_path,
        "tokenizer_path": a.model_path,
        "served_model_name": a.model_path,
        "skip_tokenizer_init": !a.has_tokenizer,
        "load_format": "auto",
        "trust_remote_code": false,
        "is_embedding": false,
        "dtype": a.dtype,
        "weight_dtype": weight_dtype(a.weight_dtype),
        "quantization": quantization(a.weight_dtype),
        "kv_cache_dtype": a.dtype,
        "context_length": a.context_length,
        "vocab_size": a.vocab_size,
        "device": a.device,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "moe_dp_size": 1,
        "nnodes": 1,
        "node_rank": 0,
        "base_gpu_id": 0,
        "gpu_id_step": 1,
        "dist_init_addr": null,
        "enable_memory_saver": false,
        "disaggregation_mode": "null",
        "encoder_only": false,
        "enable_return_routed_experts": false,
        "enable_metrics": true,
        "max_running_requests": a.max_running_requests,
        "max_total_tokens": max_total_tokens,
        "chunked_prefill_size": -1,
        "speculative_algorithm": a.speculative_algorithm,
        "speculative_bandit": a.bandit,
        "kv_pool": {"tokens": a.pool.tokens, "sequences": a.pool.sequences, "bytes_per_token": a.pool.token_bytes},
        "internal_states": [{"max_total_num_tokens": max_total_tokens,
            "max_running_requests": a.max_running_requests}],
        "version": env!("CARGO_PKG_VERSION"),
        "engine": "tlt-serve",
        "vllm_config": vllm_config,
    })
}
