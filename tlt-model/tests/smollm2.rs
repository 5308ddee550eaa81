//! Parity of our SmolLM2-135M-Instruct (GGUF, dequantized to f32) with llama.cpp on the same f32 weights.
//!
//! The fixture `tests/fixtures/smollm2_parity.json` is produced by `scripts/parity_fixtures.py` (run by hand).
//! The model file is fetched by `cargo xtask fetch-assets`; `cargo xtask test` passes its path in
//! `TLT_SMOLLM2_GGUF`. Without the file the test prints why it is skipped.

use std::path::PathBuf;

use serde::Deserialize;
use tlt_model::{encode, load_gguf, LogitsFor, SeqInput};

#[derive(Deserialize)]
struct Fixture {
    implementation: String,
    prompts: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    top5: Vec<Vec<(u32, f32)>>,
}

/// The GGUF (`$TLT_SMOLLM2_GGUF`, which must exist when set, else the cache's if fetched).
fn model_path() -> Option<PathBuf> {
    tlt_model::assets::smollm2_gguf_if_present().expect("the SmolLM2 GGUF")
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best }).0 as u32
}

#[test]
fn matches_llama_cpp_on_smollm2() {
    let Some(path) = model_path() else {
        println!("SKIPPED: SmolLM2 GGUF not found; run `cargo xtask fetch-assets` (or `cargo xtask test`, which sets TLT_SMOLLM2_GGUF)");
        return;
    };
    let fixture: Fixture = serde_json::from_str(include_str!("fixtures/smollm2_parity.json")).expect("fixture parses");
    let loaded = load_gguf(&path).expect("SmolLM2 loads");
    let (model, tok) = (loaded.model, loaded.tokenizer.expect("GGUF carries a tokenizer"));
    assert_eq!(encode(&tok, "The capital of France is").unwrap(), vec![504, 3575, 282, 4649, 314]);

    let (mut full_matches, mut top1_agree, mut positions) = (0, 0, 0);
    let mut max_logit_diff = 0f32;
    for case in &fixture.prompts {
        assert_eq!(encode(&tok, &case.text).unwrap(), case.prompt_ids, "tokenization of {:?}", case.text);

        // Free-running greedy decoding.
        let mut cache = model.new_cache();
        let seq = cache.add_sequence();
        let mut next = argmax(&model.prefill(&mut cache, seq, &case.prompt_ids).unwrap().to_vec1::<f32>().unwrap());
        let mut ours = vec![next];
        while ours.len() < case.greedy_ids.len() {
            next = argmax(&model.decode(&mut cache, &[(seq, next)]).unwrap().to_vec2::<f32>().unwrap()[0]);
            ours.push(next);
        }
        if ours == case.greedy_ids {
            full_matches += 1;
        } else {
            println!("greedy mismatch on {:?}:\n  ours     {ours:?}\n  llama.cpp {:?}", case.text, case.greedy_ids);
        }

        // Teacher-forced on llama.cpp's tokens: top-1 and top-5 logits at every generated position.
        let mut cache = model.new_cache();
        let seq = cache.add_sequence();
        let n = case.greedy_ids.len();
        let context: Vec<u32> = case.prompt_ids.iter().chain(&case.greedy_ids[..n - 1]).copied().collect();
        let input = SeqInput { seq, tokens: &context, tree: None, logits: LogitsFor::All };
        let logits = model.forward(&mut cache, &[input], &[]).unwrap().logits.to_vec2::<f32>().unwrap();
        for (step, row) in logits[case.prompt_ids.len() - 1..].iter().enumerate() {
            positions += 1;
            top1_agree += usize::from(argmax(row) == case.greedy_ids[step]);
            for &(id, want) in &case.top5[step] {
                max_logit_diff = max_logit_diff.max((row[id as usize] - want).abs());
            }
        }
    }
    let top1 = top1_agree as f64 / positions as f64;
    println!(
        "vs {}: greedy identical on {full_matches}/{} prompts, teacher-forced top-1 agreement {:.2}% of {positions} positions, max |logit diff| on llama.cpp's top-5 {max_logit_diff:.4}",
        fixture.implementation,
        fixture.prompts.len(),
        100.0 * top1
    );
    assert!(full_matches >= 7, "greedy continuation identical on only {full_matches}/8 prompts");

    // The shipped Q4_1/Q8_0 blocks kept for inference hold exactly the dequantized values: same logits.
    let kept = tlt_model::load_gguf_with(&path, tlt_model::GgufWeights::AsStored).unwrap().model;
    assert_eq!(kept.inference_dtype(), tlt_model::WeightDType::Q4_1);
    let case = &fixture.prompts[0];
    let run = |m: &tlt_model::Llama| {
        let mut cache = m.new_cache();
        let seq = cache.add_sequence();
        let input = SeqInput { seq, tokens: &case.prompt_ids, tree: None, logits: LogitsFor::All };
        m.forward(&mut cache, &[input], &[]).unwrap().logits.to_vec2::<f32>().unwrap()
    };
    let (a, b) = (run(&model), run(&kept));
    let diff = a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    println!("Q4_1 blocks kept for inference vs f32: max |logit diff| {diff:.5}");
    assert!(diff <= 1e-2, "kept-quantized logits differ by {diff}");
    assert!(top1 >= 0.99, "top-1 agreement {top1}");
    assert!(max_logit_diff <= 0.05, "top-5 logits differ by up to {max_logit_diff}");
}
