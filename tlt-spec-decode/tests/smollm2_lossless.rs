//! Greedy lossless speculative decoding on SmolLM2-135M-Instruct: for 16 prompts at batch 4 (4 of them at batch 1)
//! and drafters {none, n-gram tree, oracle chain, oracle tree}, the engine's output is token for token plain greedy
//! decoding through `tlt_model::Llama::prefill/decode`.
//!
//! The model file is fetched by `cargo xtask fetch-assets`; `cargo xtask test` passes its path in
//! `TLT_SMOLLM2_GGUF`. Without the file the test prints why it is skipped.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod engine_common;

use std::path::PathBuf;
use std::time::Instant;

use engine_common::{greedy_reference, greedy_reference_batch, run_batches};
use tlt_model::{encode, load_gguf};
use tlt_spec_decode::{Drafter, Engine, HybridDrafter, NgramDrafter, Plan, SpecParams, SuffixConfig, SuffixDrafter};

/// New tokens per prompt: 128; `TLT_SPEC_LOSSLESS_TOKENS`
/// overrides it for quicker local runs.
fn new_tokens() -> usize {
    std::env::var("TLT_SPEC_LOSSLESS_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(128)
}

/// The GGUF (`$TLT_SMOLLM2_GGUF`, which must exist when set, else the cache's if fetched).
fn model_path() -> Option<PathBuf> {
    tlt_model::assets::smollm2_gguf_if_present().expect("the SmolLM2 GGUF")
}

fn chat(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

fn prompt_texts() -> Vec<String> {
    vec![
        chat("What is the capital of France?"),
        chat("Write a haiku about the sea."),
        chat("Explain what a hash map is in two sentences."),
        chat("List the first ten prime numbers."),
        chat(
            "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
        ),
        chat("Rewrite this list in upper case: apple, banana, cherry, date, elderberry, fig, grape."),
        chat("Count from 1 to 30, separated by commas."),
        chat("Translate 'good morning, how are you?' into Spanish and French."),
        "The capital of France is".into(),
        "Once upon a time, in a small village by the river,".into(),
        "def fibonacci(n):\n    if n < 2:\n        return n\n".into(),
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,".into(),
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,".into(),
        "Q: What is 12 + 7?\nA: 19\nQ: What is 23 + 5?\nA: 28\nQ: What is 40 + 2?\nA:".into(),
        "<ul>\n  <li>red</li>\n  <li>green</li>\n  <li>blue</li>\n".into(),
        "The mitochondria is the powerhouse of the cell. The mitochondria".into(),
    ]
}

/// The prompts (by index) that batch 1 runs: a chat question, a repetition, a story and a few-shot prompt.
const BATCH_ONE: [usize; 4] = [0, 4, 9, 13];

/// SmolLM2 and the 16 encoded prompts, or `None` (after printing why the test is skipped) without the model file.
fn model_and_prompts() -> Option<(tlt_model::Llama, Vec<Vec<u32>>)> {
    let Some(path) = model_path() else {
        println!("SKIPPED: SmolLM2 GGUF not found; run `cargo xtask fetch-assets` (or `cargo xtask test`, which sets TLT_SMOLLM2_GGUF)");
        return None;
    };
    let loaded = load_gguf(&path).expect("SmolLM2 loads");
    let (model, tok) = (loaded.model, loaded.tokenizer.expect("GGUF carries a tokenizer"));
    let prompts: Vec<Vec<u32>> = prompt_texts().iter().map(|t| encode(&tok, t).unwrap()).collect();
    Some((model, prompts))
}

#[test]
fn greedy_speculative_decoding_is_lossless_on_smollm2() {
    let Some((model, prompts)) = model_and_prompts() else { return };
    assert_eq!(prompts.len(), 16);
    let eos = model.config().eos_ids();
    let t0 = Instant::now();
    let n = new_tokens();
    let refs = greedy_reference_batch(&model, &prompts, n, &eos);
    // The batched reference is plain decoding too: spot-check it against one-sequence decoding.
    assert_eq!(refs[0], greedy_reference(&model, &prompts[0], n, &eos));
    println!("reference: {:.1}s", t0.elapsed().as_secs_f64());
    // The oracle drafts from the plain greedy continuation (corrupting every 3rd token); requests stop on EOS.
    let params = SpecParams::greedy(n);
    let ngram_plan = Plan { steps: 4, top_k: 2, verify_tokens: 8 };
    let tree_plan = Plan { steps: 6, top_k: 2, verify_tokens: 10 };
    // Batch 4 runs every prompt; batch 1, three quarters of the test's time when it ran all 16, runs a chat
    // prompt, a repetition, a story and a few-shot one (the prompts at BATCH_ONE).
    for (batch, picked) in [(1, BATCH_ONE.to_vec()), (4, (0..prompts.len()).collect::<Vec<_>>())] {
        let ps: Vec<Vec<u32>> = picked.iter().map(|&k| prompts[k].clone()).collect();
        let rs: Vec<Vec<u32>> = picked.iter().map(|&k| refs[k].clone()).collect();
        let mut ngram = NgramDrafter::default();
        let t = Instant::now();
        let runs = [
            ("plain", run_batches(&model, &params, &ps, batch, None, &Plan::chain(1), None, false)),
            ("ngram", run_batches(&model, &params, &ps, batch, Some(&mut ngram), &ngram_plan, None, false)),
            ("oracle chain", run_batches(&model, &params, &ps, batch, None, &Plan::chain(6), Some(&rs), false)),
            ("oracle tree", run_batches(&model, &params, &ps, batch, None, &tree_plan, Some(&rs), true)),
        ];
        println!("batch {batch} ({} prompts): {:.1}s", ps.len(), t.elapsed().as_secs_f64());
        for (name, (fin, accepted)) in &runs {
            println!("  {name}: {accepted} drafts accepted");
            if *name != "plain" {
                assert!(*accepted > 0, "{name} at batch {batch} accepted no drafts");
            }
            assert_eq!(fin.len(), ps.len());
            for (f, &k) in fin.iter().zip(&picked) {
                assert_eq!(f.tokens, refs[k], "{name}, batch {batch}, prompt {k}: {:?}", prompt_texts()[k]);
            }
        }
    }
}

/// Group drafting on SmolLM2: the 16 prompts, each answered by a GRPO group of G = 8 (prefilled once, forked),
/// drafted from the siblings by the suffix drafter alone and merged with the n-gram drafter (hybrid), 4 groups
/// per engine: every sample equals plain greedy decoding of its prompt (the first 64 tokens, or
/// `TLT_SPEC_LOSSLESS_TOKENS` if smaller).
#[test]
fn greedy_group_drafting_is_lossless_on_smollm2() {
    let Some((model, prompts)) = model_and_prompts() else { return };
    let eos = model.config().eos_ids();
    let n = new_tokens().min(64);
    let refs = greedy_reference_batch(&model, &prompts, n, &eos);
    let g = 8;
    for hybrid in [false, true] {
        let t = Instant::now();
        let mut accepted = 0;
        for chunk in prompts.chunks(4).enumerate() {
            let (c, ps) = chunk;
            let mut engine = Engine::new(&model, SpecParams::greedy(n)).unwrap();
            for p in ps {
                engine.add_group(p, g, n).unwrap();
            }
            let suffix = SuffixDrafter::new(SuffixConfig::default()).unwrap();
            let (mut d, plan): (Box<dyn Drafter>, Plan) = if hybrid {
                (
                    Box::new(HybridDrafter::new(suffix, NgramDrafter::default())),
                    Plan { steps: 4, top_k: 2, verify_tokens: 6 },
                )
            } else {
                (Box::new(suffix), Plan::chain(4))
            };
            engine.run_to_completion(Some(d.as_mut()), &plan).unwrap();
            accepted += engine.counters().accepted;
            let mut fin = engine.take_finished();
            fin.sort_by_key(|f| f.id);
            assert_eq!(fin.len(), ps.len() * g);
            for (i, f) in fin.iter().enumerate() {
                let k = c * 4 + i / g;
                assert_eq!(f.tokens, refs[k], "hybrid {hybrid}, prompt {k}, sample {}", i % g);
            }
        }
        println!("group drafting (hybrid {hybrid}): {accepted} drafts accepted, {:.1}s", t.elapsed().as_secs_f64());
        assert!(accepted > 0);
    }
}
