//! Regression inputs from fuzzing the loaders (`cargo xtask fuzz gguf|safetensors|config-json|tokenizer-json`,
//! see `xtask/README.md`): seed files and findings, under `tests/fuzz-regressions/<kind>/`.
//! Each input must load (`ok-*`), fail with an error (`err-*`), or either (any other name), and never panic.
//! A `_<name>` file is the fixed companion of that target's inputs (the `config.json` beside fuzzed weights, the
//! weights beside a fuzzed `config.json`).
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::path::{Path, PathBuf};

use tlt_model::{decode, encode, load_gguf_with, load_hf_dir, load_tokenizer_json, GgufWeights};

fn dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fuzz-regressions").join(target)
}

/// The inputs of `target` (files ending in `.ext`, fixed `_` files left out), sorted.
fn cases(target: &str, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir(target))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext) && !name(p).starts_with('_'))
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no {target} regression inputs");
    out
}

fn name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

/// Checks the outcome against the input's name.
fn check(path: &Path, outcome: Result<(), String>) {
    let name = name(path);
    if name.starts_with("ok-") {
        assert!(outcome.is_ok(), "{name} should load: {outcome:?}");
    } else if name.starts_with("err-") {
        assert!(outcome.is_err(), "{name} should be rejected");
    }
}

/// A scratch directory holding `files` (name, source path).
fn scratch(tag: &str, files: &[(&str, &Path)]) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tlt-model-fuzz-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for (name, src) in files {
        std::fs::copy(src, d.join(name)).unwrap();
    }
    d
}

#[test]
fn gguf_inputs_load_or_fail_cleanly() {
    for p in cases("gguf", "gguf") {
        for mode in [GgufWeights::F32, GgufWeights::AsStored] {
            check(&p, load_gguf_with(&p, mode).map(drop).map_err(|e| e.to_string()));
        }
    }
}

#[test]
fn safetensors_inputs_load_or_fail_cleanly() {
    let config = dir("safetensors").join("_config.json");
    for p in cases("safetensors", "safetensors") {
        let d = scratch("st", &[("config.json", &config), ("model.safetensors", &p)]);
        check(&p, load_hf_dir(&d).map(drop).map_err(|e| e.to_string()));
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn config_inputs_load_or_fail_cleanly() {
    let weights = dir("config").join("_model.safetensors");
    for p in cases("config", "json") {
        let d = scratch("cfg", &[("config.json", &p), ("model.safetensors", &weights)]);
        check(&p, load_hf_dir(&d).map(drop).map_err(|e| e.to_string()));
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn tokenizer_inputs_load_and_encode_or_fail_cleanly() {
    const SAMPLE: &str = "<|im_start|>user\nWhat is 12+30? Ünïcödé 😀\t  the end<|im_end|>";
    for p in cases("tokenizer", "json") {
        let outcome = load_tokenizer_json(&p).and_then(|tok| {
            let ids = encode(&tok, SAMPLE)?;
            decode(&tok, &ids).map(drop)
        });
        check(&p, outcome.map_err(|e| e.to_string()));
    }
}

/// GGUF bytes with one metadata entry `key`: an array of `n` zero `u8`s (v3 layout, no tensors).
fn gguf_with_u8_array(key: &str, n: usize) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata entries
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key.as_bytes());
    b.extend(9u32.to_le_bytes()); // array
    b.extend(0u32.to_le_bytes()); // of u8
    b.extend((n as u64).to_le_bytes());
    b.resize(b.len() + n, 0);
    b
}

#[test]
fn gguf_metadata_that_parses_far_larger_than_the_file_is_rejected() {
    // 4 M one-byte elements: candle would hold them as 32-byte values (128 MiB for a 4 MiB file).
    let d = scratch("expand", &[]);
    let big = d.join("big.gguf");
    std::fs::write(&big, gguf_with_u8_array("x", 4 << 20)).unwrap();
    let err = load_gguf_with(&big, GgufWeights::F32).unwrap_err().to_string();
    assert!(err.contains("metadata values would take"), "{err}");
    // A small array is fine (the file then fails for lack of an architecture, not its metadata).
    let small = d.join("small.gguf");
    std::fs::write(&small, gguf_with_u8_array("x", 1000)).unwrap();
    let err = load_gguf_with(&small, GgufWeights::F32).unwrap_err().to_string();
    assert!(err.contains("general.architecture"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}
