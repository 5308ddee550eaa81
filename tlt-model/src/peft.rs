//! LoRA adapters as PEFT writes them: a directory of `adapter_config.json` and `adapter_model.safetensors`
//! (tensors named `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`), which `peft`'s
//! `PeftModel.from_pretrained(base, dir)` loads onto the base model; and the merge `W + (alpha / r) · B · A` of such
//! adapters into a model on the CPU (what PEFT's `merge_and_unload` gives).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::cuda::train::{LoraConfig, PeftTensor};
use crate::hf::{atomic_write, write_dir_atomic};
use crate::{Error, Llama, Result};

/// The modules the adapters sit on (every linear of a decoder layer), as PEFT's `target_modules` names them.
pub const TARGET_MODULES: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// PEFT's `adapter_config.json` for adapters of `lora` on [`TARGET_MODULES`] of the base `base_model` (a path or hub
/// name, as PEFT records it).
#[must_use]
pub fn adapter_config(lora: &LoraConfig, base_model: &str) -> serde_json::Value {
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": TARGET_MODULES,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
    })
}

/// Writes `tensors` (every adapter, PEFT-named: [`crate::cuda::train::CudaLoraTrainer::peft_named`]) of `lora` as a
/// PEFT adapter directory at `dir`, atomically, f32.
///
/// # Errors
/// [`Error::InvalidInput`] for a tensor whose values do not fill its shape; I/O errors.
pub fn save_peft_dir(dir: &Path, lora: &LoraConfig, tensors: &[PeftTensor], base_model: &str) -> Result<()> {
    lora.validate()?;
    let named = tensors
        .iter()
        .map(|(n, shape, v)| {
            if shape[0] * shape[1] != v.len() {
                return Err(Error::InvalidInput(format!("`{n}`: {} values for a {shape:?} tensor", v.len())));
            }
            Ok((n.clone(), Tensor::from_vec(v.clone(), (shape[0], shape[1]), &Device::Cpu)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let config = serde_json::to_string_pretty(&adapter_config(lora, base_model))
        .map_err(|e| Error::InvalidInput(e.to_string()))?;
    write_dir_atomic(dir, |tmp| -> Result<()> {
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        atomic_write(&tmp.join("adapter_model.safetensors"), |f| {
            safetensors::serialize_to_file(named.iter().map(|(n, t)| (n.as_str(), t)), Some(meta), f)
                .map_err(|e| Error::malformed(f, "safetensors", e))
        })?;
        atomic_write(&tmp.join("adapter_config.json"), |f| std::fs::write(f, &config).map_err(|e| Error::io(f, e)))
    })
}

/// `model` with every adapter of `tensors` merged in f32: each linear's weight `W + (alpha / r) · B · A`.
///
/// # Errors
/// [`Error::InvalidInput`] for a tensor name that is not an adapter of one of the model's linears, a shape that
/// does not fit, or a linear with `lora_A` but no `lora_B` (or the reverse).
pub fn merge_peft(model: &Llama, lora: &LoraConfig, tensors: &[PeftTensor]) -> Result<Llama> {
    lora.validate()?;
    let find = |name: &str| tensors.iter().find(|(n, _, _)| n == name);
    let mut w = model.weights().clone();
    let mut used = 0;
    for (l, layer) in w.layers.iter_mut().enumerate() {
        for (module, lin) in layer.proj.named_mut() {
            let name = |which: &str| format!("base_model.model.model.layers.{l}.{module}.{which}.weight");
            let (a, b) = match (find(&name("lora_A")), find(&name("lora_B"))) {
                (Some(a), Some(b)) => (a, b),
                (None, None) => continue,
                _ => return Err(Error::InvalidInput(format!("layer {l} {module}: lora_A without lora_B or back"))),
            };
            let t = |(n, s, v): &PeftTensor| -> Result<Tensor> {
                if s[0] * s[1] != v.len() {
                    return Err(Error::InvalidInput(format!("`{n}`: {} values for a {s:?} tensor", v.len())));
                }
                Ok(Tensor::from_vec(v.clone(), (s[0], s[1]), &Device::Cpu)?)
            };
            let delta = (t(b)?.matmul(&t(a)?)? * lora.scale())?;
            if delta.dims() != lin.weight.dims() {
                return Err(Error::InvalidInput(format!(
                    "layer {l} {module}: B·A is {:?}, the weight {:?}",
                    delta.dims(),
                    lin.weight.dims()
                )));
            }
            lin.weight = (lin.weight.to_dtype(DType::F32)? + delta)?;
            lin.packed = None;
            used += 2;
        }
    }
    if used != tensors.len() {
        return Err(Error::InvalidInput(format!(
            "{} of {} tensors are not adapters of this model",
            tensors.len() - used,
            tensors.len()
        )));
    }
    Llama::new(model.config().clone(), w)
}
