//! Runs `scripts/check_eagle_export.py` (SGLang/vLLM loader expectations, in Python with `safetensors` and
//! `numpy`) on EAGLE-3 exports of a tiny drafter.
//!
//! The interpreter is `$TLT_PYTHON` or `python3` on `PATH`; `PYTHONPATH` is honoured (inherited). Without an
//! interpreter that imports `safetensors` and `numpy` the test prints `skipped: <why>` and passes, unless
//! `TLT_REQUIRE_PYTHON_CHECK` is set (CI sets it after installing the packages), in which case it fails.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use tlt_drafter::{DrafterConfig, Eagle3Drafter, FrozenTarget, SaveDType, VocabMap};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check_eagle_export.py")
}

/// The interpreter to use, or why there is none.
fn python() -> Result<String, String> {
    let py = std::env::var("TLT_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&py)
        .args(["-c", "import safetensors, numpy"])
        .output()
        .map_err(|e| format!("cannot run `{py}` ({e}); set TLT_PYTHON"))?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        let last = why.lines().last().unwrap_or("import failed");
        return Err(format!("`{py}` cannot import safetensors and numpy ({last}); install them or set PYTHONPATH"));
    }
    Ok(py)
}

fn run(py: &str, dir: &Path) -> (bool, String) {
    let out = Command::new(py)
        .arg(script())
        .arg(dir)
        .args(["--target-vocab-size", &VOCAB.to_string(), "--target-hidden-size", &HIDDEN.to_string()])
        .args(["--target-num-layers", &LAYERS.to_string()])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn eagle3_exports_pass_the_python_loader_check() {
    let py = match python() {
        Ok(py) => py,
        Err(why) if std::env::var_os("TLT_REQUIRE_PYTHON_CHECK").is_none() => {
            eprintln!("skipped: {why}");
            println!("skipped: {why}");
            return;
        }
        Err(why) => panic!("TLT_REQUIRE_PYTHON_CHECK is set but {why}"),
    };
    let target = target("llama", 3);
    let vocab = VocabMap::from_tokens(tokens(3, 9, 1).into_iter().flatten(), VOCAB, 12, &[2]).unwrap();
    let cfg = DrafterConfig::eagle3_from_target(target.config(), 12);
    let d = Eagle3Drafter::random(cfg, vocab, FrozenTarget::new(&target), 5).unwrap();
    let dir = temp_dir("py");
    for dtype in [SaveDType::Bf16, SaveDType::F16, SaveDType::F32] {
        d.save(&dir, dtype).unwrap();
        let (ok, text) = run(&py, &dir);
        assert!(ok && text.starts_with("OK:"), "{dtype:?} export rejected:\n{text}");
    }
    // Custom layer ids (both engine spellings) pass too.
    let mut cfg = d.config().clone();
    cfg.aux_layers = Some([1, 2, 3]);
    let custom = Eagle3Drafter::new(cfg, d.weights().clone(), d.vocab().clone(), d.target().clone()).unwrap();
    custom.save(&dir, SaveDType::Bf16).unwrap();
    let (ok, text) = run(&py, &dir);
    assert!(ok, "custom layer ids rejected:\n{text}");

    // The script catches what the engines would silently mis-load.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let mut one_engine = config.clone();
    one_engine.as_object_mut().unwrap().remove("eagle_aux_hidden_state_layer_ids");
    std::fs::write(dir.join("config.json"), one_engine.to_string()).unwrap();
    let (ok, text) = run(&py, &dir);
    assert!(!ok && text.contains("one engine only"), "{text}");
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();

    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> =
        st.iter().map(|(n, v)| (format!("model.{n}"), v)).collect();
    safetensors::serialize_to_file(tensors.clone(), None, &dir.join("model.safetensors")).unwrap();
    let (ok, text) = run(&py, &dir);
    assert!(!ok && text.contains("names must be bare"), "{text}");
    tensors = st.iter().map(|(n, v)| (n.to_string(), v)).filter(|(n, _)| n != "midlayer.hidden_norm.weight").collect();
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
    let (ok, text) = run(&py, &dir);
    assert!(!ok && text.contains("midlayer.hidden_norm.weight: missing"), "{text}");

    // Inconsistent vocabulary maps: unsorted d2t targets, and a t2d that marks an extra id.
    let used = d.vocab().used();
    let mut swapped = d.vocab().d2t();
    swapped.swap(0, 1);
    swapped[0] += 1;
    swapped[1] -= 1; // draft 0 -> used[1], draft 1 -> used[0]
    let d2t_bytes: Vec<u8> = swapped.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut t2d_bytes: Vec<u8> = d.vocab().t2d().iter().map(|&b| u8::from(b)).collect();
    let unused = (0..VOCAB).find(|&j| t2d_bytes[j] == 0).unwrap();
    t2d_bytes[unused] = 1;
    assert!(used[0] < used[1]);
    for (name, bytes, expect) in [("d2t", &d2t_bytes, "strictly increasing"), ("t2d", &t2d_bytes, "t2d marks 13 ids")] {
        let tensors: Vec<(String, safetensors::tensor::TensorView)> = st
            .iter()
            .map(|(n, v)| {
                let v = if n == name {
                    safetensors::tensor::TensorView::new(v.dtype(), v.shape().to_vec(), bytes).unwrap()
                } else {
                    v
                };
                (n.to_string(), v)
            })
            .collect();
        safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
        let (ok, text) = run(&py, &dir);
        assert!(!ok && text.contains(expect), "{name}: {text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
