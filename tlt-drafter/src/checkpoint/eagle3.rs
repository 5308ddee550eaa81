//! EAGLE-3 checkpoints exactly as SGLang (`LlamaForCausalLMEagle3`) and vLLM (`Eagle3LlamaForCausalLM`) load
//! them: bare tensor names (`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` int64, `t2d`
//! bool), no embedding, and `config.json` = HF `LlamaConfig` + `architectures: ["LlamaForCausalLMEagle3"]`,
//! `draft_vocab_size`, legacy `rope_theta`/`rope_scaling`, `tie_word_embeddings: false`.

use std::path::Path;

use serde_json::{json, Value};
use tlt_model::LlamaConfig;

use super::{architectures, check_layer_matches, parse_llama, read_config, write_checkpoint, Blob, SaveDType, StFile};
use crate::config::{default_aux_layers, DrafterConfig, DrafterKind};
use crate::eagle3::{Eagle3Drafter, Eagle3Weights};
use crate::vocab::VocabMap;
use crate::{Error, Result};

/// `architectures` values SGLang and vLLM accept for an EAGLE-3 Llama drafter; the first is what we write.
pub const EAGLE3_ARCHITECTURES: [&str; 2] = ["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"];

/// What [`load_eagle3`] reads: everything [`Eagle3Drafter::new`] needs besides the target.
#[derive(Debug, Clone)]
pub struct Eagle3Checkpoint {
    /// The drafter configuration, paired with the target given to the loader.
    pub config: DrafterConfig,
    /// The weights, as f32.
    pub weights: Eagle3Weights,
    /// The draft vocabulary (identity if the checkpoint has no `d2t` and a full-size head).
    pub vocab: VocabMap,
}

/// The `config.json` object of an EAGLE-3 export.
fn config_json(cfg: &DrafterConfig, dtype: SaveDType) -> Result<Value> {
    let mut v = cfg.llama.to_hf_json(dtype.torch_dtype())?;
    if let Some(obj) = v.as_object_mut() {
        obj.insert("architectures".into(), json!([EAGLE3_ARCHITECTURES[0]]));
        obj.insert("num_hidden_layers".into(), json!(1));
        obj.insert("tie_word_embeddings".into(), json!(false));
        obj.insert("draft_vocab_size".into(), json!(cfg.draft_vocab_size));
        if cfg.target_hidden_size != cfg.hidden_size() {
            obj.insert("target_hidden_size".into(), json!(cfg.target_hidden_size));
        }
        if let Some(layers) = cfg.aux_layers {
            if layers != default_aux_layers(cfg.target_num_hidden_layers) {
                // SGLang reads eagle_config ids as "output of layer k" (+1 when capturing), vLLM reads the
                // top-level ids as "input of layer k": write both so either engine taps the same tensors.
                if let Some(&zero) = layers.iter().find(|&&l| l == 0) {
                    return Err(Error::config("aux_layers", zero, "the embedding (input of layer 0) has no SGLang id"));
                }
                let sglang: Vec<usize> = layers.iter().map(|l| l - 1).collect();
                obj.insert(
                    "eagle_config".into(),
                    json!({"eagle_aux_hidden_state_layer_ids": sglang, "use_aux_hidden_state": true}),
                );
                obj.insert("eagle_aux_hidden_state_layer_ids".into(), json!(layers));
            }
        }
    }
    Ok(v)
}

/// Writes `drafter` to `dir` in the SGLang/vLLM EAGLE-3 format with float weights in `dtype` (use
/// [`SaveDType::Bf16`] for serving). Layer ids are written only when they differ from the engines' defaults.
pub fn save_eagle3(drafter: &Eagle3Drafter, dir: &Path, dtype: SaveDType) -> Result<()> {
    let cfg = drafter.config();
    let config = config_json(cfg, dtype)?;
    let mut tensors = Vec::new();
    for (name, t) in drafter.weights().named_tensors() {
        tensors.push((name, Blob::float(&t, dtype)?));
    }
    tensors.push(("d2t".into(), Blob::i64s(&drafter.vocab().d2t())));
    tensors.push(("t2d".into(), Blob::bools(&drafter.vocab().t2d())));
    write_checkpoint(dir, tensors, &config)
}

fn usize_field(path: &Path, v: &Value, key: &str) -> Result<Option<usize>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::malformed(path, "config.json", format!("`{key}` must be a non-negative integer"))),
    }
}

fn layer_ids(path: &Path, v: Option<&Value>) -> Result<Option<Vec<i64>>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_i64().ok_or_else(|| Error::malformed(path, "config.json", "layer ids must be integers")))
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(_) => Err(Error::malformed(path, "config.json", "layer ids must be an array")),
    }
}

/// The tapped layers ("input of layer i") named by a config, or `None` for the defaults.
fn aux_layers(path: &Path, v: &Value) -> Result<Option<[usize; 3]>> {
    let vllm = layer_ids(path, v.get("eagle_aux_hidden_state_layer_ids"))?;
    let sglang = layer_ids(path, v.get("eagle_config").and_then(|c| c.get("eagle_aux_hidden_state_layer_ids")))?;
    let ids: Vec<i64> = match (&vllm, &sglang) {
        (None, None) => return Ok(None),
        (Some(a), Some(b)) => {
            if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| Some(*x) != y.checked_add(1)) {
                return Err(Error::InconsistentLayerIds { path: path.into(), sglang: b.clone(), vllm: a.clone() });
            }
            a.clone()
        }
        (Some(a), None) => a.clone(),
        (None, Some(b)) => b
            .iter()
            .map(|x| x.checked_add(1).ok_or_else(|| Error::malformed(path, "config.json", "layer id out of range")))
            .collect::<Result<_>>()?,
    };
    let ids: Vec<usize> = ids
        .iter()
        .map(|&i| usize::try_from(i).map_err(|_| Error::malformed(path, "config.json", "negative layer id")))
        .collect::<Result<_>>()?;
    let arr: [usize; 3] = ids
        .try_into()
        .map_err(|_| Error::malformed(path, "config.json", "EAGLE-3 needs exactly three aux layer ids"))?;
    Ok(Some(arr))
}

/// Reads an EAGLE-3 checkpoint from `dir` for `target`, checking the pairing (hidden size, vocabulary, layer
/// ids), every tensor's presence, shape and dtype, and the consistency of `d2t` and `t2d`. `t2d` may be absent
/// (serving engines skip it), as may both maps when the draft vocabulary is the full vocabulary. An
/// `embed_tokens.weight` is ignored: the drafter uses the target's embedding.
pub fn load_eagle3(dir: &Path, target: &LlamaConfig) -> Result<Eagle3Checkpoint> {
    let (cfg_path, value) = read_config(dir)?;
    let archs = architectures(&value);
    if !archs.iter().any(|a| EAGLE3_ARCHITECTURES.contains(&a.as_str())) {
        return Err(Error::WrongCheckpointKind { path: cfg_path, expected: "EAGLE-3", found: format!("{archs:?}") });
    }
    let llama = parse_llama(&cfg_path, &value)?;
    let target_hidden = usize_field(&cfg_path, &value, "target_hidden_size")?.unwrap_or(llama.hidden_size);
    if target_hidden != target.hidden_size {
        return Err(Error::HiddenSizeMismatch {
            what: "target_hidden_size",
            drafter: target_hidden,
            target: target.hidden_size,
        });
    }
    check_layer_matches(&llama, target)?;
    let draft_vocab_size = usize_field(&cfg_path, &value, "draft_vocab_size")?.unwrap_or(llama.vocab_size);
    let aux = aux_layers(&cfg_path, &value)?.unwrap_or_else(|| default_aux_layers(target.num_hidden_layers));
    let config = DrafterConfig {
        kind: DrafterKind::Eagle3,
        target_hidden_size: target_hidden,
        target_num_hidden_layers: target.num_hidden_layers,
        fc_bias: false,
        draft_vocab_size,
        aux_layers: Some(aux),
        llama,
    };
    config.validate()?;

    let st = StFile::open(dir.join("model.safetensors"))?;
    let expected = Eagle3Weights::expected_shapes(&config);
    for name in st.index.keys() {
        let known =
            expected.iter().any(|(n, _)| n == name) || matches!(name.as_str(), "d2t" | "t2d" | "embed_tokens.weight");
        if !known {
            return Err(Error::UnexpectedTensor { path: st.path.clone(), name: name.clone() });
        }
    }
    let weights = Eagle3Weights::from_source(&config, &mut |name, shape| st.required(name, shape))?;

    let v = config.vocab_size();
    let d2t = st.i64s("d2t", draft_vocab_size)?;
    let t2d = st.bools("t2d", v)?;
    let vocab = match d2t {
        Some(d2t) => VocabMap::from_d2t(&d2t, t2d.as_deref(), v)?,
        None if draft_vocab_size == v => {
            if t2d.as_ref().is_some_and(|m| m.iter().any(|b| !b)) {
                return Err(Error::InconsistentVocabMap { reason: "no d2t, but t2d excludes target ids".into() });
            }
            VocabMap::identity(v)
        }
        None => return Err(Error::MissingTensor { path: st.path.clone(), name: "d2t".into() }),
    };
    Ok(Eagle3Checkpoint { config, weights, vocab })
}

impl Eagle3Drafter {
    /// Loads an EAGLE-3 checkpoint from `dir` for `target` (see [`load_eagle3`]), in f32, sharing the target's
    /// embedding and LM head.
    pub fn load(dir: &Path, target: &tlt_model::Llama) -> Result<Self> {
        let ck = load_eagle3(dir, target.config())?;
        Self::new(ck.config, ck.weights, ck.vocab, crate::FrozenTarget::new(target))
    }

    /// Saves in the SGLang/vLLM format (see [`save_eagle3`]).
    pub fn save(&self, dir: &Path, dtype: SaveDType) -> Result<()> {
        save_eagle3(self, dir, dtype)
    }
}
