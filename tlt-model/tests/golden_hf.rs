//! Golden tests against Hugging Face transformers, without Python: tiny random checkpoints and what transformers
//! 5.19 (float32, eager attention, CPU) computed on them, written by `scripts/golden_hf.py` into
//! `tests/fixtures/golden/<case>/` (`config.json`, `model.safetensors`, `golden.json`). Cases: Qwen3 with a
//! decoupled head_dim (tied; and untied with `attention_bias`), Qwen2 (q/k/v biases), Llama with Llama-3 RoPE
//! scaling at positions past `original_max_position_embeddings`.
//!
//! Each checkpoint is loaded with the HF loader and must reproduce transformers' logits and greedy tokens through
//! plain batched decode, tree verification of draft chains (with a rejected branch, then commit), and the training
//! forward (plain and activation-checkpointed). Negative controls show the tolerance has power.
//!
//! Tolerance: `max |ours - hf| <= 1e-5 * max(1, max |hf|)` per row. Both sides compute in float32 on the same
//! weights and differ only in summation order (BLAS vs our kernels, softmax and norm reductions: float32 rounding,
//! ~1e-7 relative per operation) plus the fixture's rounding to 1e-6; measured worst cases are 3e-7..8e-7 on
//! every path, so the bound leaves >10x headroom for other CPUs' kernels, while a wrong operation misses by
//! 0.3..0.7 (the negative controls: > 1e4 times the bound).
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;
use tlt_model::{load_gguf, load_hf_dir, save_hf_dir, Llama, LogitsFor, SeqId, SeqInput};

/// Relative tolerance (see the module docs).
const TOL: f32 = 1e-5;

/// What `scripts/golden_hf.py` recorded for one checkpoint.
#[derive(Debug, Deserialize)]
struct Golden {
    hf_class: String,
    prompts: Vec<Vec<u32>>,
    greedy: Vec<Vec<u32>>,
    logits: Vec<Rows>,
}

/// Teacher-forced logits of `tokens` (a prompt and its greedy continuation but the last) at `positions`.
#[derive(Debug, Deserialize)]
struct Rows {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    rows: Vec<Vec<f32>>,
}

impl Rows {
    /// transformers' logits at `pos`, if recorded.
    fn at(&self, pos: usize) -> Option<&[f32]> {
        self.positions.iter().position(|&p| p == pos).map(|i| self.rows[i].as_slice())
    }
}

fn dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden").join(case)
}

fn golden(case: &str) -> Golden {
    let path = dir(case).join("golden.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn load(case: &str) -> Llama {
    load_hf_dir(&dir(case)).unwrap().model
}

/// `max |ours - hf| / max(1, max |hf|)`.
fn rel_diff(ours: &[f32], hf: &[f32]) -> f32 {
    assert_eq!(ours.len(), hf.len());
    let scale = hf.iter().fold(1f32, |m, x| m.max(x.abs()));
    ours.iter().zip(hf).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().unwrap()
}

/// Compares every recorded row with `ours(sequence, position)` where it returns one; the worst relative diff.
fn compare_teacher_forced(g: &Golden, what: &str, mut ours: impl FnMut(usize, usize) -> Option<Vec<f32>>) -> f32 {
    let mut worst = 0f32;
    for (s, r) in g.logits.iter().enumerate() {
        for &p in &r.positions {
            if let Some(row) = ours(s, p) {
                let d = rel_diff(&row, r.at(p).unwrap());
                assert!(d <= TOL, "{what}: sequence {s} position {p}: relative diff {d:.2e} > {TOL:e}");
                worst = worst.max(d);
            }
        }
    }
    worst
}

/// Prefill of all prompts in one batched forward, then 16 batched single-token decode steps on the argmax:
/// the greedy tokens must be transformers', and every decode step's logits at a recorded position match.
fn batched_decode(model: &Llama, g: &Golden) -> f32 {
    let mut cache = model.new_cache();
    let seqs: Vec<SeqId> = g.prompts.iter().map(|_| cache.add_sequence()).collect();
    let inputs: Vec<SeqInput> = seqs
        .iter()
        .zip(&g.prompts)
        .map(|(&seq, p)| SeqInput { seq, tokens: p, tree: None, logits: LogitsFor::Last })
        .collect();
    let mut last = rows(&model.forward(&mut cache, &inputs, &[]).unwrap().logits);
    let mut worst = 0f32;
    let n_new = g.greedy[0].len();
    for step in 0..n_new {
        let mut batch = Vec::new();
        for (s, row) in last.iter().enumerate() {
            let pos = g.prompts[s].len() - 1 + step;
            if let Some(hf) = g.logits[s].at(pos) {
                let d = rel_diff(row, hf);
                assert!(d <= TOL, "decode: sequence {s} position {pos}: relative diff {d:.2e}");
                worst = worst.max(d);
            }
            let tok = argmax(row);
            assert_eq!(tok, g.greedy[s][step], "decode: sequence {s} greedy token {step}");
            batch.push((seqs[s], tok));
        }
        if step + 1 < n_new {
            last = rows(&model.decode(&mut cache, &batch).unwrap());
        }
    }
    worst
}

/// The speculative path: after the prompt, the greedy continuation is verified as two draft chains (the first
/// with a wrong three-node branch beside it), each committed along its chain. Every chain node's argmax is the
/// next greedy token, and its logits match transformers' at recorded positions.
fn tree_verify(model: &Llama, g: &Golden) -> f32 {
    let mut worst = 0f32;
    for (s, prompt) in g.prompts.iter().enumerate() {
        let (n, greedy) = (prompt.len(), &g.greedy[s]);
        let mut cache = model.new_cache();
        let seq = cache.add_sequence();
        let first = model.prefill(&mut cache, seq, prompt).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(argmax(&first), greedy[0]);
        let split = greedy.len() / 2;
        // Chains of greedy[..split] and greedy[split..len - 1]: node i predicts the token after it.
        for (start, end) in [(0, split), (split, greedy.len() - 1)] {
            let chain = &greedy[start..end];
            let mut tokens = chain.to_vec();
            let mut parents: Vec<Option<usize>> = (0..chain.len()).map(|i| i.checked_sub(1)).collect();
            if start == 0 {
                // A rejected branch off node 1: wrong tokens the chain must not see.
                let wrong = (greedy[2] + 1) % model.config().vocab_size as u32;
                tokens.extend([wrong, wrong, wrong]);
                parents.extend([Some(1), Some(chain.len()), Some(chain.len() + 1)]);
            }
            let logits = rows(&model.verify_tree(&mut cache, seq, &tokens, &parents).unwrap());
            for (i, row) in logits.iter().take(chain.len()).enumerate() {
                let k = start + i; // node i holds greedy[k] at position n + k
                assert_eq!(argmax(row), greedy[k + 1], "verify: sequence {s} node {i}");
                if let Some(hf) = g.logits[s].at(n + k) {
                    let d = rel_diff(row, hf);
                    assert!(d <= TOL, "verify: sequence {s} position {}: relative diff {d:.2e}", n + k);
                    worst = worst.max(d);
                }
            }
            let path: Vec<usize> = (0..chain.len()).collect();
            cache.commit(seq, &path).unwrap();
            assert_eq!(cache.len(seq).unwrap(), n + end);
        }
    }
    worst
}

/// The differentiable training forward (all sequences in one right-padded batch) and its checkpointed variant.
fn training_forward(model: &Llama, g: &Golden) -> f32 {
    let len = g.logits.iter().map(|r| r.tokens.len()).max().unwrap();
    let mut ids = Vec::with_capacity(g.logits.len() * len);
    for r in &g.logits {
        ids.extend(r.tokens.iter().copied());
        ids.extend(std::iter::repeat_n(0, len - r.tokens.len()));
    }
    let ids = Tensor::from_vec(ids, (g.logits.len(), len), &Device::Cpu).unwrap();
    let plain = model.forward_train(&ids).unwrap().to_dtype(DType::F32).unwrap();
    let (hidden, _) = model.forward_train_hidden_checkpointed(&ids).unwrap();
    let ck = hidden.broadcast_matmul(&model.weights().lm_head().t().unwrap()).unwrap();
    let mut worst = 0f32;
    for (what, logits) in [("training forward", &plain), ("checkpointed training forward", &ck)] {
        let d = compare_teacher_forced(g, what, |s, p| Some(logits.get(s).unwrap().get(p).unwrap().to_vec1().unwrap()));
        worst = worst.max(d);
    }
    worst
}

/// Teacher-forced prefill logits of every recorded sequence (one forward each, all rows).
fn prefill_rows(model: &Llama, g: &Golden) -> Vec<Vec<Vec<f32>>> {
    g.logits
        .iter()
        .map(|r| {
            let mut cache = model.new_cache();
            let seq = cache.add_sequence();
            let input = SeqInput { seq, tokens: &r.tokens, tree: None, logits: LogitsFor::All };
            rows(&model.forward(&mut cache, &[input], &[]).unwrap().logits)
        })
        .collect()
}

/// The worst relative diff of `model`'s prefill logits over every recorded row (no assertion).
fn worst_prefill_diff(model: &Llama, g: &Golden) -> f32 {
    let ours = prefill_rows(model, g);
    let mut worst = 0f32;
    for (s, r) in g.logits.iter().enumerate() {
        for (i, &p) in r.positions.iter().enumerate() {
            worst = worst.max(rel_diff(&ours[s][p], &r.rows[i]));
        }
    }
    worst
}

/// Every check of one case; prints the worst relative diff of each path.
fn check_case(case: &str, training: bool) {
    let g = golden(case);
    let model = load(case);
    assert_eq!(model.config().architecture().unwrap().hf_class(), g.hf_class);
    let ours = prefill_rows(&model, &g);
    let prefill = compare_teacher_forced(&g, "prefill", |s, p| Some(ours[s][p].clone()));
    let decode = batched_decode(&model, &g);
    let verify = tree_verify(&model, &g);
    let train = if training { training_forward(&model, &g) } else { f32::NAN };
    println!("{case}: worst relative diff: prefill {prefill:.2e}, decode {decode:.2e}, verify {verify:.2e}, training {train:.2e}");
}

#[test]
fn qwen3_tied_matches_transformers() {
    check_case("qwen3_tied", true);
}

#[test]
fn qwen3_with_attention_bias_matches_transformers() {
    let model = load("qwen3_bias");
    let bias = model.weights().layers[0].proj.o_proj.bias.as_ref().map(Tensor::dims);
    assert_eq!(bias, Some(&[32][..]), "attention_bias puts a bias on o_proj too");
    check_case("qwen3_bias", true);
}

#[test]
fn qwen2_matches_transformers() {
    check_case("qwen2", true);
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    let g = golden("llama3");
    assert!(g.logits.iter().any(|r| r.tokens.len() > 32), "sequences run past original_max_position_embeddings");
    check_case("llama3", true);
}

/// The tolerance has power: the Qwen3 checkpoint without its q/k norms (as a Llama of the same shapes), and the
/// Llama-3 checkpoint without its RoPE scaling, miss transformers' logits by far more than the tolerance.
#[test]
fn negative_controls_fail_the_tolerance() {
    let qwen3 = load("qwen3_tied");
    let mut cfg = qwen3.config().clone();
    cfg.model_type = "llama".into();
    let mut weights = qwen3.weights().clone();
    for layer in &mut weights.layers {
        layer.qk_norm = None;
    }
    let no_qk_norm = Llama::new(cfg, weights).unwrap();
    let d = worst_prefill_diff(&no_qk_norm, &golden("qwen3_tied"));
    println!("qwen3_tied without q/k norms: worst relative diff {d:.2e}");
    assert!(d > 100.0 * TOL, "without q/k norms: {d:.2e}");

    let llama3 = load("llama3");
    let mut cfg = llama3.config().clone();
    cfg.rope_scaling = None;
    let unscaled = Llama::new(cfg, llama3.weights().clone()).unwrap();
    let d = worst_prefill_diff(&unscaled, &golden("llama3"));
    println!("llama3 without rope scaling: worst relative diff {d:.2e}");
    assert!(d > 100.0 * TOL, "without rope scaling: {d:.2e}");
}

/// `save_hf_dir` of the loaded Qwen3 writes a `config.json` naming Qwen3 with its head_dim, and the q/k norms under
/// HF's names; reloading gives bit-identical logits. The saved directories stay in `target/tmp/golden-hf-export/`
/// for `scripts/golden_hf.py --check-export`, which loads them in transformers.
#[test]
fn qwen3_save_hf_dir_round_trips() {
    for case in ["qwen3_tied", "qwen3_bias"] {
        let model = load(case);
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("golden-hf-export").join(case);
        let _ = std::fs::remove_dir_all(&out);
        save_hf_dir(&model, None, &out, DType::F32).unwrap();
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["model_type"], "qwen3");
        assert_eq!(cfg["architectures"][0], "Qwen3ForCausalLM");
        assert_eq!(cfg["head_dim"], 16);
        assert_eq!(cfg["attention_bias"], case == "qwen3_bias");
        let names = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
        assert!(names.contains_key("model.layers.1.self_attn.q_norm.weight"));
        assert!(names.contains_key("model.layers.1.self_attn.k_norm.weight"));
        let reloaded = load_hf_dir(&out).unwrap().model;
        assert_eq!(reloaded.config(), model.config());
        let g = golden(case);
        assert_eq!(prefill_rows(&reloaded, &g), prefill_rows(&model, &g), "{case}: reloaded logits differ");
    }
}

/// The same Qwen3 weights as llama.cpp names them in a GGUF (arch `qwen3`, `attn_q_norm`/`attn_k_norm`, head
/// width from `attention.key_length`, no q/k permutation) give the safetensors model's logits and greedy tokens.
#[test]
fn qwen3_gguf_matches_the_safetensors_checkpoint() {
    let path = dir("qwen3_tied").with_extension("gguf");
    let gguf = load_gguf(&path).unwrap().model;
    let hf = load("qwen3_tied");
    let (a, b) = (gguf.config(), hf.config());
    assert_eq!(a.architecture().unwrap(), tlt_model::Architecture::Qwen3);
    assert_eq!((a.head_dim(), a.kv_heads(), a.tie_word_embeddings), (16, 2, true));
    assert_eq!((a.head_dim(), a.q_dim(), a.kv_dim()), (b.head_dim(), b.q_dim(), b.kv_dim()));
    let g = golden("qwen3_tied");
    let (x, y) = (prefill_rows(&gguf, &g), prefill_rows(&hf, &g));
    // Identical f32 weights and the same inference path; the metadata's epsilon is config.json's rounded to f32,
    // which is what the inference path uses anyway (measured: bit-identical logits).
    let d = x.iter().flatten().zip(y.iter().flatten()).fold(0f32, |m, (p, q)| m.max(rel_diff(p, q)));
    println!("qwen3_tied GGUF vs safetensors: worst relative diff {d:.2e}");
    assert!(d <= 1e-6, "GGUF vs safetensors: {d:.2e}");
    batched_decode(&gguf, &g);
}
