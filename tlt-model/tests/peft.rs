//! LoRA adapters as PEFT directories: `save_peft_dir` writes what `peft` loads onto the base model
//! (`scripts/check_peft_adapter.py`: PEFT's logits, and its `merge_and_unload`'s, equal tlt-model's forward of the
//! merged weights within 1e-4; the base alone is far from them), and `merge_peft` refuses tensors that are not the
//! model's adapters.
//!
//! The interpreter is `$TLT_PYTHON` or `python3`; without one that imports `torch`, `transformers` and `peft` the
//! Python part says `skipped: <why>` and passes, unless `TLT_REQUIRE_PYTHON_CHECK` is set (`cargo xtask test` sets
//! it after installing them), which makes that a failure.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::path::Path;
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use tlt_model::cuda::train::{lora_params, LoraConfig, PeftTensor};
use tlt_model::peft::{merge_peft, save_peft_dir};
use tlt_model::{save_hf_dir, Llama, LlamaConfig};

const LORA: LoraConfig = LoraConfig { rank: 4, alpha: 8.0 };

fn base(model_type: &str) -> Llama {
    let mut cfg = LlamaConfig::tiny(64, 32, 2);
    cfg.model_type = model_type.into();
    cfg.intermediate_size = 48;
    cfg.tie_word_embeddings = model_type == "qwen2";
    Llama::random(cfg, 3).unwrap()
}

fn adapters(model: &Llama, seed: u64) -> Vec<PeftTensor> {
    let mut rng = tlt_kernels::SplitMix64::new(seed);
    lora_params(model.config(), LORA.rank)
        .into_iter()
        .map(|p| {
            let v = (0..p.range.len()).map(|_| ((rng.next_f64() - 0.5) * 0.3) as f32).collect();
            (p.name, p.shape, v)
        })
        .collect()
}

fn logits(model: &Llama, ids: &[u32]) -> Vec<f32> {
    let t = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
    model.forward_train(&t).unwrap().flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap()
}

fn python() -> Result<String, String> {
    let py = std::env::var("TLT_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&py)
        .args(["-c", "import torch, transformers, peft"])
        .output()
        .map_err(|e| format!("cannot run `{py}` ({e}); set TLT_PYTHON"))?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "`{py}` cannot import torch, transformers and peft ({})",
            why.lines().last().unwrap_or("")
        ));
    }
    Ok(py)
}

fn check(model_type: &str, py: &str, root: &Path) {
    let model = base(model_type);
    let tensors = adapters(&model, 9);
    let merged = merge_peft(&model, &LORA, &tensors).unwrap();
    let ids: Vec<u32> = vec![1, 5, 9, 2, 33, 7, 60, 4];
    let want = logits(&merged, &ids);
    assert_ne!(want, logits(&model, &ids), "the adapters changed nothing");
    let (base_dir, adapter_dir) = (root.join(format!("{model_type}-base")), root.join(format!("{model_type}-lora")));
    save_hf_dir(&model, None, &base_dir, DType::F32).unwrap();
    save_peft_dir(&adapter_dir, &LORA, &tensors, &base_dir.display().to_string()).unwrap();
    let expected = root.join(format!("{model_type}-expected.json"));
    let json = serde_json::json!({ "ids": ids, "logits": want, "r": LORA.rank, "alpha": LORA.alpha });
    std::fs::write(&expected, serde_json::to_vec(&json).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check_peft_adapter.py");
    let out = Command::new(py).arg(script).arg(&base_dir).arg(&adapter_dir).arg(&expected).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!(
        "{model_type}: {}",
        text.lines().filter(|l| l.starts_with("peft") || l.starts_with("FAIL")).collect::<Vec<_>>().join("\n")
    );
    assert!(out.status.success(), "{model_type}: the PEFT check failed:\n{text}");
}

#[test]
fn peft_loads_the_adapters_and_gives_the_merged_logits() {
    let py = match python() {
        Ok(py) => py,
        Err(why) if std::env::var_os("TLT_REQUIRE_PYTHON_CHECK").is_none() => {
            println!("skipped: {why}");
            return;
        }
        Err(why) => panic!("TLT_REQUIRE_PYTHON_CHECK is set but {why}"),
    };
    let root = std::env::temp_dir().join(format!("tlt-peft-{}", std::process::id()));
    for model_type in ["llama", "qwen2"] {
        check(model_type, &py, &root);
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn merging_refuses_what_is_not_the_models_adapters() {
    let model = base("llama");
    let mut tensors = adapters(&model, 1);
    assert!(merge_peft(&model, &LORA, &tensors).is_ok());
    let mut extra = tensors.clone();
    extra.push(("base_model.model.lm_head.lora_A.weight".into(), [4, 32], vec![0.0; 128]));
    assert!(merge_peft(&model, &LORA, &extra).is_err(), "an adapter of a module the model has none of");
    tensors[1].1 = [4, 1];
    assert!(merge_peft(&model, &LORA, &tensors).is_err(), "a B of the wrong shape");
    let lone: Vec<PeftTensor> = adapters(&model, 1).into_iter().take(1).collect();
    assert!(merge_peft(&model, &LORA, &lone).is_err(), "lora_A without lora_B");
}
