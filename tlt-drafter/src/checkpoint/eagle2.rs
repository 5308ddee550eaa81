//! EAGLE-2 checkpoints in the layout of the published TLT/fastrl drafters: `model.`-prefixed keys
//! (`model.fc.weight`, optional `model.fc.bias`, `model.layers.0.*`), no input norm, no final norm, and the frozen
//! embedding and LM head left out. `config.json` is the target's HF config with `num_hidden_layers = 1`.
//!
//! The loader also reads the original EAGLE-1/2 layout (the same keys without the `model.` prefix), and ignores
//! `embed_tokens`/`lm_head` (shared with the target) and a `layers.0.input_layernorm.weight` (the identity in
//! EAGLE-2, so never used).
//!
//! [`save_eagle2_serving`] writes that original layout for the serving engines: SGLang's `LlamaForCausalLMEagle`
//! and vLLM's `EagleLlamaForCausalLM` prefix `model.` to every name but `lm_head` and skip names that are not
//! parameters without an error, so a `model.`-prefixed checkpoint would load nothing there.

use std::path::Path;

use serde_json::json;
use tlt_model::{Architecture, LlamaConfig};

use super::{
    architectures, check_layer_matches, parse_llama, read_config, write_checkpoint, Blob, SaveDType, StFile,
    EAGLE3_ARCHITECTURES,
};
use crate::config::DrafterConfig;
use crate::eagle2::{Eagle2Drafter, Eagle2Weights};
use crate::{Error, Result};

/// What [`load_eagle2`] reads: everything [`Eagle2Drafter::new`] needs besides the target.
#[derive(Debug, Clone)]
pub struct Eagle2Checkpoint {
    /// The drafter configuration (fc bias detected from the tensors), paired with the loader's target.
    pub config: DrafterConfig,
    /// The weights, as f32.
    pub weights: Eagle2Weights,
}

/// SGLang's EAGLE(-1/2) entry class for a drafter of this architecture (a drafter layer is never a Qwen3 layer:
/// [`DrafterConfig::validate`] refuses q/k norms, so that arm only keeps the match total).
fn hf_class(arch: Architecture) -> &'static str {
    match arch {
        Architecture::Llama | Architecture::Qwen3 => "LlamaForCausalLMEagle",
        Architecture::Qwen2 => "Qwen2ForCausalLMEagle",
    }
}

/// Writes `drafter` to `dir` in the fastrl/TLT EAGLE-2 layout with float weights in `dtype` (fastrl: bf16).
pub fn save_eagle2(drafter: &Eagle2Drafter, dir: &Path, dtype: SaveDType) -> Result<()> {
    let cfg = drafter.config();
    let mut config = cfg.llama.to_hf_json(dtype.torch_dtype())?;
    if let Some(obj) = config.as_object_mut() {
        obj.insert("architectures".into(), json!([hf_class(cfg.llama.architecture()?)]));
        obj.insert("num_hidden_layers".into(), json!(1));
        obj.insert("tie_word_embeddings".into(), json!(false));
    }
    let mut tensors = Vec::new();
    for (name, t) in drafter.weights().named_tensors() {
        tensors.push((name, Blob::float(&t, dtype)?));
    }
    write_checkpoint(dir, tensors, &config)
}

/// `architectures` of a serving export: SGLang resolves the first it knows (`LlamaForCausalLMEagle`); vLLM's
/// `method: "eagle"` prefixes `Eagle` to each and takes the first it knows (`EagleLlamaForCausalLM`).
fn serving_architectures(arch: Architecture) -> [&'static str; 2] {
    match arch {
        Architecture::Llama | Architecture::Qwen3 => ["LlamaForCausalLMEagle", "LlamaForCausalLM"],
        Architecture::Qwen2 => ["Qwen2ForCausalLMEagle", "Qwen2ForCausalLM"],
    }
}

/// Writes `drafter` to `dir` in the original EAGLE-1/2 layout the serving engines load (`--speculative-algorithm
/// EAGLE` in SGLang, `speculative_config={"method": "eagle", ...}` in vLLM): bare names (`fc.weight`, `fc.bias`,
/// `layers.0.*`), no input norm, no embedding and no LM head (both engines share the target's). SGLang's `fc`
/// always has a bias, which would keep its random initialisation if the checkpoint had none, so a drafter
/// without one is written with a zero `fc.bias` (vLLM's `fc` has no bias and skips it: the same function).
/// [`load_eagle2`] reads the result back (as a drafter with a zero bias).
pub fn save_eagle2_serving(drafter: &Eagle2Drafter, dir: &Path, dtype: SaveDType) -> Result<()> {
    let cfg = drafter.config();
    let mut config = cfg.llama.to_hf_json(dtype.torch_dtype())?;
    if let Some(obj) = config.as_object_mut() {
        obj.insert("architectures".into(), json!(serving_architectures(cfg.llama.architecture()?)));
        obj.insert("num_hidden_layers".into(), json!(1));
        obj.insert("tie_word_embeddings".into(), json!(false));
    }
    let mut tensors = Vec::new();
    for (name, t) in drafter.weights().named_tensors() {
        let bare = name.strip_prefix("model.").unwrap_or(&name).to_string();
        tensors.push((bare, Blob::float(&t, dtype)?));
    }
    if drafter.weights().fc.bias.is_none() {
        let zero = candle_core::Tensor::zeros(cfg.hidden_size(), candle_core::DType::F32, &candle_core::Device::Cpu)?;
        tensors.push(("fc.bias".into(), Blob::float(&zero, dtype)?));
    }
    write_checkpoint(dir, tensors, &config)
}

/// Reads an EAGLE-2 checkpoint from `dir` for `target`, checking the pairing (hidden size, vocabulary) and every
/// tensor's presence, shape and dtype. Whether `fc` has a bias is read from the tensors.
pub fn load_eagle2(dir: &Path, target: &LlamaConfig) -> Result<Eagle2Checkpoint> {
    let (cfg_path, value) = read_config(dir)?;
    let archs = architectures(&value);
    if archs.iter().any(|a| EAGLE3_ARCHITECTURES.contains(&a.as_str())) || value.get("draft_vocab_size").is_some() {
        return Err(Error::WrongCheckpointKind { path: cfg_path, expected: "EAGLE-2", found: format!("{archs:?}") });
    }
    let llama = parse_llama(&cfg_path, &value)?;
    check_layer_matches(&llama, target)?;
    let st = StFile::open(dir.join("model.safetensors"))?;
    let prefix = if st.index.contains_key("model.fc.weight") {
        "model."
    } else if st.index.contains_key("fc.weight") {
        ""
    } else {
        return Err(Error::MissingTensor { path: st.path.clone(), name: "model.fc.weight".into() });
    };
    let mut config = DrafterConfig::eagle2_from_target(target, st.index.contains_key(&format!("{prefix}fc.bias")));
    config.llama = llama;
    config.llama.num_hidden_layers = 1;
    config.validate()?;

    let expected: Vec<String> = Eagle2Weights::expected_shapes(&config)
        .into_iter()
        .map(|(n, _)| format!("{prefix}{}", n.trim_start_matches("model.")))
        .collect();
    let ignored = [
        format!("{prefix}embed_tokens.weight"),
        "lm_head.weight".to_string(),
        format!("{prefix}layers.0.input_layernorm.weight"),
    ];
    if let Some(name) = st.index.keys().find(|n| !expected.contains(n) && !ignored.contains(n)) {
        return Err(Error::UnexpectedTensor { path: st.path.clone(), name: name.clone() });
    }
    let weights = Eagle2Weights::from_source(&config, prefix, &mut |name, shape| st.required(name, shape))?;
    Ok(Eagle2Checkpoint { config, weights })
}

impl Eagle2Drafter {
    /// Loads an EAGLE-2 checkpoint from `dir` for `target` (see [`load_eagle2`]), in f32, sharing the target's
    /// embedding and LM head.
    pub fn load(dir: &Path, target: &tlt_model::Llama) -> Result<Self> {
        let ck = load_eagle2(dir, target.config())?;
        Self::new(ck.config, ck.weights, crate::FrozenTarget::new(target))
    }

    /// Saves in the fastrl/TLT layout (see [`save_eagle2`]).
    pub fn save(&self, dir: &Path, dtype: SaveDType) -> Result<()> {
        save_eagle2(self, dir, dtype)
    }
}
