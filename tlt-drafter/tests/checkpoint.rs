//! Checkpoint round trips (EAGLE-3 SGLang/vLLM format, EAGLE-2 fastrl and serving layouts) and bad checkpoints.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};
use tlt_drafter::checkpoint::{load_eagle2, load_eagle3, save_eagle2_serving};
use tlt_drafter::{
    DraftCache, DraftRuntime, DrafterConfig, Eagle2Drafter, Eagle3Drafter, Error, FrozenTarget, RuntimeOptions,
    SaveDType, VocabMap,
};
use tlt_model::{Llama, LlamaConfig};

fn eagle3(target: &Llama) -> Eagle3Drafter {
    let vocab = VocabMap::from_tokens(tokens(3, 9, 1).into_iter().flatten(), VOCAB, 12, &[2]).unwrap();
    let cfg = DrafterConfig::eagle3_from_target(target.config(), 12);
    Eagle3Drafter::random(cfg, vocab, FrozenTarget::new(target), 5).unwrap()
}

fn eagle2(target: &Llama, fc_bias: bool) -> Eagle2Drafter {
    let cfg = DrafterConfig::eagle2_from_target(target.config(), fc_bias);
    Eagle2Drafter::random(cfg, FrozenTarget::new(target), 7).unwrap()
}

/// A safetensors file as (dtype, shape, bytes) by name, for tampering.
type Raw = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read_raw(dir: &Path) -> Raw {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.iter().map(|(n, v)| (n.to_string(), (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect()
}

fn write_raw(dir: &Path, raw: &Raw) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = raw
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn read_config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

fn write_config(dir: &Path, v: &Value) {
    std::fs::write(dir.join("config.json"), serde_json::to_string(v).unwrap()).unwrap();
}

/// Copies a checkpoint, applies `f` to its tensors, and loads it as EAGLE-3.
fn tampered3(src: &Path, target: &LlamaConfig, f: impl FnOnce(&mut Raw)) -> tlt_drafter::Result<()> {
    let dir = temp_dir("tamper3");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut raw = read_raw(src);
    f(&mut raw);
    write_raw(&dir, &raw);
    let r = load_eagle3(&dir, target).map(|_| ());
    std::fs::remove_dir_all(&dir).unwrap();
    r
}

fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn eagle3_round_trips_and_matches_the_serving_layout() {
    let target = target("llama", 3);
    let d = eagle3(&target);
    let dir = temp_dir("e3");
    d.save(&dir, SaveDType::F32).unwrap();
    let back = Eagle3Drafter::load(&dir, &target).unwrap();
    assert_eq!(back.config(), d.config());
    assert_eq!(back.vocab(), d.vocab());
    for ((n, a), (_, b)) in d.weights().named_tensors().iter().zip(back.weights().named_tensors()) {
        assert_eq!(bits(a), bits(&b), "{n}");
    }

    // bf16 export: the names, dtypes and config keys SGLang and vLLM read.
    d.save(&dir, SaveDType::Bf16).unwrap();
    let raw = read_raw(&dir);
    let mut expected: Vec<&str> = vec!["d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight"];
    for p in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"] {
        expected.push(Box::leak(format!("midlayer.{p}.weight").into_boxed_str()));
    }
    for p in
        ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm"]
    {
        expected.push(Box::leak(format!("midlayer.{p}.weight").into_boxed_str()));
    }
    expected.sort_unstable();
    assert_eq!(raw.keys().map(String::as_str).collect::<Vec<_>>(), expected);
    assert_eq!(raw["d2t"].0, Dtype::I64);
    assert_eq!(raw["t2d"].0, Dtype::BOOL);
    assert_eq!(raw["t2d"].1, vec![VOCAB]);
    assert_eq!(raw["fc.weight"].1, vec![HIDDEN, 3 * HIDDEN]);
    assert_eq!(raw["midlayer.self_attn.q_proj.weight"].1, vec![HIDDEN, 2 * HIDDEN]);
    assert_eq!(raw["lm_head.weight"].1, vec![12, HIDDEN]);
    assert!(raw.iter().filter(|(n, _)| !matches!(n.as_str(), "d2t" | "t2d")).all(|(_, (dt, _, _))| *dt == Dtype::BF16));
    let c = read_config(&dir);
    assert_eq!(c["architectures"], json!(["LlamaForCausalLMEagle3"]));
    assert_eq!(c["model_type"], "llama");
    assert_eq!(c["num_hidden_layers"], 1);
    assert_eq!(c["draft_vocab_size"], 12);
    assert_eq!(c["vocab_size"], VOCAB);
    assert_eq!(c["tie_word_embeddings"], false);
    assert_eq!(c["torch_dtype"], "bfloat16");
    assert!(c["rope_theta"].is_number());
    assert!(c.get("eagle_config").is_none() && c.get("target_hidden_size").is_none(), "defaults are omitted");
    let back = Eagle3Drafter::load(&dir, &target).unwrap();
    assert_eq!(back.vocab(), d.vocab());
    let (a, b) = (d.weights().fc.weight.flatten_all().unwrap(), back.weights().fc.weight.flatten_all().unwrap());
    let err = scalar(&(a - b).unwrap().abs().unwrap().max(0).unwrap());
    assert!(err < 1e-2, "bf16 round trip error {err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An EAGLE-3 drafter of a Qwen3 target is a llama layer with the target's head_dim (8: 4 heads of 8 in a width of
/// 16), as the published Qwen3 EAGLE-3 drafters are, and round-trips.
#[test]
fn eagle3_of_a_qwen3_target_round_trips() {
    let target = target("qwen3", 3);
    let d = eagle3(&target);
    let dir = temp_dir("e3qwen3");
    d.save(&dir, SaveDType::F32).unwrap();
    let c = read_config(&dir);
    assert_eq!(
        (&c["model_type"], &c["head_dim"], &c["architectures"][0]),
        (&json!("llama"), &json!(8), &json!("LlamaForCausalLMEagle3"))
    );
    assert_eq!(read_raw(&dir)["midlayer.self_attn.q_proj.weight"].1, vec![32, 2 * HIDDEN]);
    let back = Eagle3Drafter::load(&dir, &target).unwrap();
    assert_eq!(back.config(), d.config());
    for ((n, a), (_, b)) in d.weights().named_tensors().iter().zip(back.weights().named_tensors()) {
        assert_eq!(bits(a), bits(&b), "{n}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eagle3_custom_layer_ids_are_written_for_both_engines() {
    let target = target("llama", 3);
    let mut d = eagle3(&target);
    let mut cfg = d.config().clone();
    cfg.aux_layers = Some([1, 2, 4]);
    let w = d.weights().clone();
    d = Eagle3Drafter::new(cfg, w, d.vocab().clone(), d.target().clone()).unwrap();
    let dir = temp_dir("e3ids");
    d.save(&dir, SaveDType::F32).unwrap();
    let c = read_config(&dir);
    assert_eq!(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"], json!([0, 1, 3]));
    assert_eq!(c["eagle_aux_hidden_state_layer_ids"], json!([1, 2, 4]));
    assert_eq!(load_eagle3(&dir, target.config()).unwrap().config.aux_layers, Some([1, 2, 4]));
    // Either spelling alone gives the same layers; disagreeing spellings are an error.
    let mut only_sglang = c.clone();
    only_sglang.as_object_mut().unwrap().remove("eagle_aux_hidden_state_layer_ids");
    write_config(&dir, &only_sglang);
    assert_eq!(load_eagle3(&dir, target.config()).unwrap().config.aux_layers, Some([1, 2, 4]));
    let mut bad = c.clone();
    bad["eagle_aux_hidden_state_layer_ids"] = json!([0, 1, 3]);
    write_config(&dir, &bad);
    assert!(matches!(load_eagle3(&dir, target.config()), Err(Error::InconsistentLayerIds { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_eagle3_checkpoints_give_specific_errors() {
    let target = target("llama", 3);
    let tc = target.config();
    let d = eagle3(&target);
    let dir = temp_dir("e3bad");
    d.save(&dir, SaveDType::Bf16).unwrap();
    let err = |r: tlt_drafter::Result<()>| r.err().unwrap();

    let e = err(tampered3(&dir, tc, |r| {
        r.remove("midlayer.mlp.up_proj.weight");
    }));
    assert!(matches!(&e, Error::MissingTensor { name, .. } if name == "midlayer.mlp.up_proj.weight"), "{e}");
    let e = err(tampered3(&dir, tc, |r| {
        r.remove("d2t");
    }));
    assert!(matches!(&e, Error::MissingTensor { name, .. } if name == "d2t"), "{e}");
    let e = err(tampered3(&dir, tc, |r| {
        let v = r.remove("fc.weight").unwrap();
        r.insert("model.fc.weight".into(), v);
    }));
    assert!(matches!(e, Error::UnexpectedTensor { .. }), "{e}");
    let e = err(tampered3(&dir, tc, |r| {
        let (_, s, b) = r["norm.weight"].clone();
        r.insert("norm.weight".into(), (Dtype::I16, s, b));
    }));
    assert!(matches!(&e, Error::WrongDType { name, .. } if name == "norm.weight"), "{e}");
    let e = err(tampered3(&dir, tc, |r| {
        let (_, s, b) = r["d2t"].clone();
        let ints: Vec<u8> = b.chunks(8).flat_map(|c| c[..4].to_vec()).collect();
        r.insert("d2t".into(), (Dtype::I32, s, ints));
    }));
    assert!(matches!(&e, Error::WrongDType { name, .. } if name == "d2t"), "{e}");
    let e = err(tampered3(&dir, tc, |r| {
        let (_, s, b) = r["t2d"].clone();
        r.insert("t2d".into(), (Dtype::U8, s, b));
    }));
    assert!(matches!(&e, Error::WrongDType { name, .. } if name == "t2d"), "{e}");
    // d2t pointing past the target vocabulary.
    let e = err(tampered3(&dir, tc, |r| {
        let mut d2t = d.vocab().d2t();
        d2t[11] = VOCAB as i64;
        r.get_mut("d2t").unwrap().2 = i64_bytes(&d2t);
    }));
    assert!(matches!(e, Error::InconsistentVocabMap { .. }), "{e}");
    // d2t valid on its own but disagreeing with t2d.
    let unused = (0..VOCAB as u32).find(|&i| !d.vocab().contains(i)).unwrap();
    let e = err(tampered3(&dir, tc, |r| {
        let mut used = d.vocab().used().to_vec();
        used[0] = unused;
        used.sort_unstable();
        let d2t: Vec<i64> = used.iter().enumerate().map(|(i, &u)| u as i64 - i as i64).collect();
        r.get_mut("d2t").unwrap().2 = i64_bytes(&d2t);
    }));
    assert!(matches!(e, Error::InconsistentVocabMap { .. }), "{e}");
    let e = err(tampered3(&dir, tc, |r| {
        r.get_mut("fc.weight").unwrap().1 = vec![HIDDEN * 3, HIDDEN];
    }));
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    // t2d may be absent (the engines skip it); an embedding copy is ignored.
    tampered3(&dir, tc, |r| {
        r.remove("t2d");
        let head = r["lm_head.weight"].clone();
        r.insert("embed_tokens.weight".into(), head);
    })
    .unwrap();

    // Pairing with the wrong target.
    let mut wider = LlamaConfig::tiny(VOCAB, 32, LAYERS);
    wider.intermediate_size = 24;
    assert!(matches!(load_eagle3(&dir, &wider), Err(Error::HiddenSizeMismatch { .. })));
    let bigger = LlamaConfig { vocab_size: 30, ..tc.clone() };
    assert!(matches!(load_eagle3(&dir, &bigger), Err(Error::VocabMismatch { drafter: 24, target: 30 })));
    // Wrong kind, broken files.
    assert!(matches!(load_eagle2(&dir, tc), Err(Error::WrongCheckpointKind { .. })));
    let text = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &text[..text.len() / 2]).unwrap();
    assert!(matches!(load_eagle3(&dir, tc), Err(Error::Malformed { .. })));
    std::fs::write(dir.join("config.json"), "{\"architectures\": [\"LlamaForCausalLMEagle3\"]").unwrap();
    assert!(matches!(load_eagle3(&dir, tc), Err(Error::Malformed { .. })));
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(matches!(load_eagle3(&dir, tc), Err(Error::Io { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eagle2_round_trips_in_the_fastrl_layout() {
    for (arch, bias) in [("llama", false), ("qwen2", true), ("qwen3", false)] {
        let target = target(arch, 3);
        let d = eagle2(&target, bias);
        let dir = temp_dir("e2");
        d.save(&dir, SaveDType::F32).unwrap();
        let raw = read_raw(&dir);
        assert!(raw.keys().all(|n| n.starts_with("model.fc.") || n.starts_with("model.layers.0.")), "{raw:?}");
        assert_eq!(raw.contains_key("model.fc.bias"), bias);
        assert_eq!(raw.contains_key("model.layers.0.self_attn.k_proj.bias"), arch == "qwen2");
        assert!(!raw.keys().any(|n| n.contains("embed") || n.contains("lm_head") || n.contains("input_layernorm")));
        assert_eq!(raw["model.fc.weight"].1, vec![HIDDEN, 2 * HIDDEN]);
        let c = read_config(&dir);
        assert_eq!(c["num_hidden_layers"], 1);
        assert_eq!(
            c["architectures"][0],
            if arch == "qwen2" { "Qwen2ForCausalLMEagle" } else { "LlamaForCausalLMEagle" }
        );
        // A Qwen3 target's drafter: a llama layer with the target's head_dim (8: decoupled from 16 / 4 heads).
        assert_eq!(c["model_type"], if arch == "qwen2" { "qwen2" } else { "llama" });
        assert_eq!(c["head_dim"], target.config().head_dim());
        assert_eq!(raw["model.layers.0.self_attn.q_proj.weight"].1, vec![target.config().q_dim(), HIDDEN]);
        let back = Eagle2Drafter::load(&dir, &target).unwrap();
        assert_eq!(back.config(), d.config());
        for ((n, a), (_, b)) in d.weights().named_tensors().iter().zip(back.weights().named_tensors()) {
            assert_eq!(bits(a), bits(&b), "{n}");
        }

        // The original EAGLE layout (no `model.` prefix) with frozen parts and an identity input norm included.
        let mut bare: Raw = raw.iter().map(|(n, v)| (n.trim_start_matches("model.").to_string(), v.clone())).collect();
        let norm = bare["layers.0.post_attention_layernorm.weight"].clone();
        bare.insert("layers.0.input_layernorm.weight".into(), norm);
        let (_, _, fc) = &raw["model.fc.weight"];
        bare.insert("lm_head.weight".into(), (Dtype::F32, vec![VOCAB, HIDDEN], vec![0; VOCAB * HIDDEN * 4]));
        bare.insert("embed_tokens.weight".into(), (Dtype::F32, vec![VOCAB, HIDDEN], vec![0; VOCAB * HIDDEN * 4]));
        write_raw(&dir, &bare);
        let back = load_eagle2(&dir, target.config()).unwrap();
        assert_eq!(back.config.fc_bias, bias);
        assert_eq!(
            bits(&back.weights.fc.weight),
            fc.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn eagle2_serving_export_has_bare_names_a_zero_bias_and_the_same_function() {
    let target = target("llama", 3);
    let d = eagle2(&target, false);
    let dir = temp_dir("e2serve");
    save_eagle2_serving(&d, &dir, SaveDType::F32).unwrap();
    let raw = read_raw(&dir);
    assert!(raw.keys().all(|n| n.starts_with("fc.") || n.starts_with("layers.0.")), "{raw:?}");
    assert_eq!(raw["fc.bias"].1, vec![HIDDEN]);
    assert!(raw["fc.bias"].2.iter().all(|&b| b == 0), "the added bias is zero");
    assert!(!raw.keys().any(|n| n.contains("embed") || n.contains("lm_head") || n.contains("input_layernorm")));
    let c = read_config(&dir);
    assert_eq!(c["architectures"], json!(["LlamaForCausalLMEagle", "LlamaForCausalLM"]));
    assert_eq!(c["num_hidden_layers"], 1);

    // Our loader reads it back as a drafter with a zero bias: the same outputs.
    let back = Eagle2Drafter::load(&dir, &target).unwrap();
    assert!(back.config().fc_bias);
    let toks = tokens(1, 9, 4).remove(0);
    let out = run_target(&target, std::slice::from_ref(&toks));
    let h = out.final_hidden.get(0).unwrap().to_vec2::<f32>().unwrap();
    let feats: Vec<&[f32]> = h.iter().map(Vec::as_slice).collect();
    let run = |d: &Eagle2Drafter| {
        let rt = DraftRuntime::eagle2(d, &RuntimeOptions::default()).unwrap();
        let a = rt.extend(&mut DraftCache::default(), &toks, &feats).unwrap();
        rt.logits(&a).unwrap()
    };
    let (a, b) = (run(&d), run(&back));
    assert_eq!(a.len(), b.len());
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(diff < 1e-5, "max |diff| {diff}");

    // bf16, as served: half the bytes.
    save_eagle2_serving(&d, &dir, SaveDType::Bf16).unwrap();
    assert_eq!(read_raw(&dir)["fc.weight"].0, Dtype::BF16);
    assert_eq!(read_config(&dir)["torch_dtype"], "bfloat16");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_eagle2_checkpoints_give_specific_errors() {
    let target = target("llama", 3);
    let d = eagle2(&target, true);
    let dir = temp_dir("e2bad");
    d.save(&dir, SaveDType::Bf16).unwrap();
    let raw = read_raw(&dir);
    let with = |f: &dyn Fn(&mut Raw)| {
        let mut r = raw.clone();
        f(&mut r);
        write_raw(&dir, &r);
        load_eagle2(&dir, target.config()).map(|_| ())
    };
    let e = with(&|r| {
        r.remove("model.layers.0.mlp.down_proj.weight");
    })
    .unwrap_err();
    assert!(matches!(&e, Error::MissingTensor { name, .. } if name == "model.layers.0.mlp.down_proj.weight"), "{e}");
    let e = with(&|r| {
        r.remove("model.fc.weight");
    })
    .unwrap_err();
    assert!(matches!(e, Error::MissingTensor { .. }), "{e}");
    let e = with(&|r| {
        let (_, s, b) = r["model.fc.bias"].clone();
        r.insert("model.fc.bias".into(), (Dtype::U16, s, b));
    })
    .unwrap_err();
    assert!(matches!(e, Error::WrongDType { .. }), "{e}");
    let e = with(&|r| {
        let v = r["model.fc.bias"].clone();
        r.insert("model.norm.weight".into(), v);
    })
    .unwrap_err();
    assert!(matches!(&e, Error::UnexpectedTensor { name, .. } if name == "model.norm.weight"), "{e}");
    with(&|_| {}).unwrap();
    let mut wider = LlamaConfig::tiny(VOCAB, 32, LAYERS);
    wider.intermediate_size = 24;
    assert!(matches!(load_eagle2(&dir, &wider), Err(Error::HiddenSizeMismatch { drafter: 16, target: 32, .. })));
    assert!(matches!(load_eagle3(&dir, target.config()), Err(Error::WrongCheckpointKind { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}
