//! Loading and saving checkpoints: GGUF (with q/k permutation and embedded tokenizer) and HF safetensors
//! round trips, and clear errors for malformed input.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use tlt_model::{hf_to_gguf_name, load, load_gguf, load_hf_dir, save_hf_dir, Error, Llama, LlamaConfig};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tlt-model-loading-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A tiny byte-level BPE vocabulary: the 256 byte symbols, a few merges, two control tokens.
fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> =
        tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet().into_iter().map(String::from).collect();
    tokens.sort();
    let merges = vec!["t h".to_string(), "th e".to_string(), "Ġ h".to_string(), "Ġh a".to_string()];
    tokens.extend(["th", "the", "Ġh", "Ġha"].map(String::from));
    tokens.extend(["<|im_start|>", "<|im_end|>"].map(String::from));
    let mut types = vec![1; tokens.len()];
    let n = types.len();
    types[n - 2] = 3;
    types[n - 1] = 3;
    (tokens, merges, types)
}

/// A tiny model with tied embeddings (like SmolLM2) unless `untied`.
fn tiny_model(vocab: usize, untied: bool) -> Llama {
    let mut cfg = LlamaConfig::tiny(vocab, 32, 2);
    cfg.rope_theta = 50_000.0;
    cfg.tie_word_embeddings = !untied;
    Llama::random(cfg, 5).expect("tiny model")
}

/// llama.cpp's permutation (inverse of `unpermute_rows`): GGUF row h*d + 2j + i = HF row h*d + i*d/2 + j.
fn permute(w: &Tensor, n: usize, d: usize) -> Tensor {
    let (rows, inp) = w.dims2().unwrap();
    w.reshape((n, 2, d / 2, inp)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((rows, inp)).unwrap()
}

struct GgufSpec {
    arch: &'static str,
    dtype: GgmlDType,
    /// Metadata overrides: (key, value); a `None` value removes the key.
    meta: Vec<(&'static str, Option<Value>)>,
    skip_tensor: Option<&'static str>,
    reshape_tensor: Option<&'static str>,
}

impl Default for GgufSpec {
    fn default() -> Self {
        Self { arch: "llama", dtype: GgmlDType::F32, meta: vec![], skip_tensor: None, reshape_tensor: None }
    }
}

fn write_gguf(model: &Llama, path: &Path, spec: &GgufSpec) {
    let cfg = model.config();
    let (tokens, merges, types) = tiny_vocab();
    let a = spec.arch;
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (format!("{a}.embedding_length"), Value::U32(cfg.hidden_size as u32)),
        (format!("{a}.feed_forward_length"), Value::U32(cfg.intermediate_size as u32)),
        (format!("{a}.block_count"), Value::U32(cfg.num_hidden_layers as u32)),
        (format!("{a}.attention.head_count"), Value::U32(cfg.num_attention_heads as u32)),
        (format!("{a}.attention.head_count_kv"), Value::U32(cfg.kv_heads() as u32)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_norm_eps as f32)),
        (format!("{a}.rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        (format!("{a}.context_length"), Value::U32(cfg.max_position_embeddings as u32)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.merges".into(), Value::Array(merges.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(cfg.vocab_size as u32 - 1)),
    ];
    for (key, value) in &spec.meta {
        meta.retain(|(k, _)| k != key);
        if let Some(v) = value {
            meta.push((key.to_string(), v.clone()));
        }
    }
    let mut tensors = Vec::new();
    for (name, t) in model.weights().named_tensors() {
        let gname = hf_to_gguf_name(&name).expect("known name");
        if spec.skip_tensor == Some(gname.as_str()) {
            continue;
        }
        let mut t = if spec.arch == "llama" && name.ends_with("q_proj.weight") {
            permute(&t, cfg.num_attention_heads, cfg.head_dim())
        } else if spec.arch == "llama" && name.ends_with("k_proj.weight") {
            permute(&t, cfg.kv_heads(), cfg.head_dim())
        } else {
            t
        };
        if spec.reshape_tensor == Some(gname.as_str()) {
            t = t.flatten_all().unwrap().reshape((2, ())).unwrap();
        }
        let dtype = if t.rank() == 2 { spec.dtype } else { GgmlDType::F32 };
        tensors.push((gname, QTensor::quantize(&t, dtype).expect("quantize")));
    }
    let mut f = std::fs::File::create(path).expect("create gguf");
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).expect("write gguf");
}

fn logits(model: &Llama, tokens: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    model.prefill(&mut cache, seq, tokens).unwrap().to_vec1().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn gguf_round_trip_undoes_qk_permutation_and_rebuilds_the_tokenizer() {
    let vocab = tiny_vocab().0.len();
    let dir = scratch("gguf");
    let toks = [3, 17, 200, 9, 41];
    for untied in [true, false] {
        let model = tiny_model(vocab, untied);
        let path = dir.join(format!("tiny-{untied}.gguf"));
        write_gguf(&model, &path, &GgufSpec::default());
        let loaded = load_gguf(&path).unwrap().model;
        assert_eq!(loaded.config().tie_word_embeddings, !untied, "tied exactly when output.weight is absent");
        assert_eq!(loaded.config().eos_ids(), vec![vocab as u32 - 1]);
        assert!(max_diff(&logits(&model, &toks), &logits(&loaded, &toks)) <= 1e-5);
    }
    let path = dir.join("tiny-true.gguf");
    let loaded = load_gguf(&path).unwrap();
    let tok = loaded.tokenizer.expect("embedded tokenizer");
    let ids = tlt_model::encode(&tok, "<|im_start|>the hat<|im_end|>").unwrap();
    assert_eq!(ids[0] as usize, vocab - 2);
    assert_eq!(*ids.last().unwrap() as usize, vocab - 1);
    assert_eq!(tok.id_to_token(ids[1]).unwrap(), "the");
    assert_eq!(tok.id_to_token(ids[2]).unwrap(), "Ġha");
    assert_eq!(tlt_model::decode(&tok, &ids).unwrap(), "<|im_start|>the hat<|im_end|>");
    assert_eq!(tlt_model::encode(&tok, "12").unwrap().len(), 2, "digits are split individually");
    assert!(load(&path).is_ok(), "load() dispatches on file vs directory");
}

#[test]
fn gguf_quantized_tensors_are_dequantized() {
    let vocab = tiny_vocab().0.len();
    let model = tiny_model(vocab, false);
    let dir = scratch("gguf-quant");
    for dtype in [GgmlDType::F16, GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4_1] {
        let path = dir.join(format!("{dtype:?}.gguf"));
        write_gguf(&model, &path, &GgufSpec { dtype, ..GgufSpec::default() });
        let loaded = load_gguf(&path).unwrap();
        let want = QTensor::quantize(&model.weights().layers[1].proj.down_proj.weight, dtype)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap();
        let got = &loaded.model.weights().layers[1].proj.down_proj.weight;
        let diff = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{dtype:?}");

        // Keeping the file's blocks for inference reads exactly the same values (q/k rows reordered blockwise).
        let kept = tlt_model::load_gguf_with(&path, tlt_model::GgufWeights::AsStored).unwrap().model;
        let toks = [5, 80, 2, 261];
        let (a, b) = (logits(&loaded.model, &toks), logits(&kept, &toks));
        if dtype == GgmlDType::F16 {
            assert_eq!(kept.inference_dtype(), tlt_model::WeightDType::F32, "f16 is not kept as blocks");
        } else {
            assert_ne!(kept.inference_dtype(), tlt_model::WeightDType::F32, "{dtype:?} kept");
            assert!(kept.weight_bytes_per_token() < loaded.model.weight_bytes_per_token() / 3);
        }
        assert!(max_diff(&a, &b) <= 1e-4, "{dtype:?}: {}", max_diff(&a, &b));
    }
}

#[test]
fn qwen2_gguf_is_not_unpermuted() {
    let vocab = tiny_vocab().0.len();
    let mut cfg = LlamaConfig::tiny(vocab, 32, 1);
    cfg.model_type = "qwen2".into();
    cfg.tie_word_embeddings = true;
    let model = Llama::random(cfg, 9).unwrap();
    let dir = scratch("qwen");
    let path = dir.join("q.gguf");
    write_gguf(&model, &path, &GgufSpec { arch: "qwen2", ..GgufSpec::default() });
    let loaded = load_gguf(&path).unwrap().model;
    assert_eq!(loaded.config().architecture().unwrap(), tlt_model::Architecture::Qwen2);
    let toks = [1, 2, 3];
    assert!(max_diff(&logits(&model, &toks), &logits(&loaded, &toks)) <= 1e-5);
}

#[test]
fn gguf_errors_are_specific() {
    let vocab = tiny_vocab().0.len();
    let model = tiny_model(vocab, false);
    let dir = scratch("gguf-errors");
    let good = dir.join("good.gguf");
    write_gguf(&model, &good, &GgufSpec::default());
    let bytes = std::fs::read(&good).unwrap();

    let cut = dir.join("truncated.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(load_gguf(&cut), Err(Error::Malformed { format: "gguf", .. })));
    std::fs::write(&cut, &bytes[..12]).unwrap();
    assert!(matches!(load_gguf(&cut), Err(Error::Malformed { format: "gguf", .. })));
    std::fs::write(&cut, b"not a gguf file at all").unwrap();
    assert!(matches!(load_gguf(&cut), Err(Error::Malformed { format: "gguf", .. })));
    assert!(matches!(load_gguf(&dir.join("absent.gguf")), Err(Error::Io { .. })));

    let case = |name: &str, spec: GgufSpec| {
        let p = dir.join(name);
        write_gguf(&model, &p, &spec);
        load_gguf(&p)
    };
    let r = case(
        "arch.gguf",
        GgufSpec { meta: vec![("general.architecture", Some(Value::String("gpt2".into())))], ..Default::default() },
    );
    assert!(matches!(r, Err(Error::Unsupported { what: "GGUF architecture", .. })), "{r:?}");
    let r = case(
        "type.gguf",
        GgufSpec { meta: vec![("llama.block_count", Some(Value::String("two".into())))], ..Default::default() },
    );
    assert!(matches!(r, Err(Error::Malformed { .. })), "{r:?}");
    let r = case("missing-key.gguf", GgufSpec { meta: vec![("llama.embedding_length", None)], ..Default::default() });
    assert!(matches!(&r, Err(Error::InvalidConfig { field, .. }) if field == "llama.embedding_length"), "{r:?}");
    let r = case(
        "zero-heads.gguf",
        GgufSpec { meta: vec![("llama.attention.head_count", Some(Value::U32(0)))], ..Default::default() },
    );
    assert!(matches!(r, Err(Error::InvalidConfig { .. })), "{r:?}");
    let r = case("missing-tensor.gguf", GgufSpec { skip_tensor: Some("blk.1.ffn_up.weight"), ..Default::default() });
    assert!(
        matches!(&r, Err(Error::MissingTensor { name, .. }) if name == "model.layers.1.mlp.up_proj.weight"),
        "{r:?}"
    );
    let r = case("shape.gguf", GgufSpec { reshape_tensor: Some("blk.0.attn_v.weight"), ..Default::default() });
    assert!(
        matches!(&r, Err(Error::ShapeMismatch { name, .. }) if name == "model.layers.0.self_attn.v_proj.weight"),
        "{r:?}"
    );
    let r = case(
        "tok.gguf",
        GgufSpec { meta: vec![("tokenizer.ggml.model", Some(Value::String("llama".into())))], ..Default::default() },
    );
    assert!(matches!(r, Err(Error::Unsupported { what: "tokenizer model", .. })), "{r:?}");
    let r = case(
        "merges.gguf",
        GgufSpec {
            meta: vec![("tokenizer.ggml.merges", Some(Value::Array(vec![Value::String("nospace".into())])))],
            ..Default::default()
        },
    );
    assert!(matches!(r, Err(Error::Malformed { .. })), "{r:?}");
}

#[test]
fn hf_save_load_round_trip() {
    let model = tiny_model(300, true);
    let dir = scratch("hf");
    save_hf_dir(&model, None, &dir, DType::F32).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cfg["torch_dtype"], "float32");
    // HF transformers insists on `format: pt` metadata in the safetensors header.
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
    let back = load_hf_dir(&dir).unwrap().model;
    let toks = [1, 2, 3, 250];
    assert_eq!(logits(&model, &toks), logits(&back, &toks));

    let dir16 = scratch("hf16");
    save_hf_dir(&model, None, &dir16, DType::BF16).unwrap();
    let back16 = load_hf_dir(&dir16).unwrap().model;
    assert!(max_diff(&logits(&model, &toks), &logits(&back16, &toks)) < 0.5);
}

#[test]
fn hf_sharded_checkpoints_load() {
    let model = tiny_model(100, false);
    let dir = scratch("sharded");
    let named = model.weights().named_tensors();
    let (a, b) = named.split_at(named.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)] {
        safetensors::serialize_to_file(part.iter().map(|(n, t)| (n.as_str(), t)), None, &dir.join(file)).unwrap();
        for (n, _) in part {
            map.insert(n.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::write(dir.join("config.json"), model.config().to_hf_json("float32").unwrap().to_string()).unwrap();
    let back = load_hf_dir(&dir).unwrap().model;
    assert_eq!(logits(&model, &[4, 5]), logits(&back, &[4, 5]));
}

#[test]
fn hf_errors_are_specific() {
    let model = tiny_model(100, false);
    let dir = scratch("hf-errors");
    save_hf_dir(&model, None, &dir, DType::F32).unwrap();
    let st = dir.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();

    std::fs::write(&st, &bytes[..bytes.len() - 100]).unwrap();
    assert!(matches!(load_hf_dir(&dir), Err(Error::Malformed { format: "safetensors", .. })));
    std::fs::write(&st, &bytes[..4]).unwrap();
    assert!(matches!(load_hf_dir(&dir), Err(Error::Malformed { format: "safetensors", .. })));

    // Wrong shape, unsupported dtype, missing tensor.
    let mut named = model.weights().named_tensors();
    named[1].1 = named[1].1.flatten_all().unwrap();
    safetensors::serialize_to_file(named.iter().map(|(n, t)| (n.as_str(), t)), None, &st).unwrap();
    assert!(matches!(&load_hf_dir(&dir), Err(Error::ShapeMismatch { name, .. }) if *name == named[1].0));
    let mut named = model.weights().named_tensors();
    named[2].1 = named[2].1.to_dtype(DType::I64).unwrap();
    safetensors::serialize_to_file(named.iter().map(|(n, t)| (n.as_str(), t)), None, &st).unwrap();
    assert!(matches!(&load_hf_dir(&dir), Err(Error::UnsupportedDType { name, .. }) if *name == named[2].0));
    let named = model.weights().named_tensors();
    safetensors::serialize_to_file(named[1..].iter().map(|(n, t)| (n.as_str(), t)), None, &st).unwrap();
    assert!(
        matches!(&load_hf_dir(&dir), Err(Error::MissingTensor { name, .. }) if name == "model.embed_tokens.weight")
    );

    // Bad config values and bad JSON.
    let cfg_path = dir.join("config.json");
    let mut cfg = model.config().to_hf_json("float32").unwrap();
    cfg["num_key_value_heads"] = 3.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    assert!(matches!(load_hf_dir(&dir), Err(Error::InvalidConfig { .. })));
    std::fs::write(&cfg_path, "{\"hidden_size\": ").unwrap();
    assert!(matches!(load_hf_dir(&dir), Err(Error::Malformed { format: "config.json", .. })));
    std::fs::remove_file(&cfg_path).unwrap();
    assert!(matches!(load_hf_dir(&dir), Err(Error::Io { .. })));
}
