//! GSM8K-format gold solutions, tokenized with SmolLM2's tokenizer and ended with the stop token as every completion
//! that stops is, all score correct through [`TextEnv`] (they scored 0/N when the completion was decoded with its
//! special tokens and the line after `####` had to parse whole: `72<|im_end|>`).
//!
//! The solutions below were written for this test in GSM8K's format (worked steps with `<<a*b=c>>` calculator
//! annotations, then `#### answer`); the tokenizer comes from the SmolLM2 GGUF (`TLT_SMOLLM2_GGUF`, set by
//! `cargo xtask test`). Without the file the test prints why it is skipped.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::path::PathBuf;

use tlt_rl::task::{ChatTemplate, JsonlTask, Split, Task};
use tlt_rl::trainer::{Environment, TextEnv};

/// (question, gold solution) pairs in GSM8K's format.
const GOLD: [(&str, &str); 16] = [
    (
        "Maya buys 3 packs of pencils with 12 pencils each and gives away 9. How many pencils does she keep?",
        "She buys 3 * 12 = <<3*12=36>>36 pencils.\nShe keeps 36 - 9 = <<36-9=27>>27 pencils.\n#### 27",
    ),
    (
        "A baker makes 48 muffins and sells them in boxes of 6 at $4 a box. How much does he earn?",
        "He fills 48 / 6 = <<48/6=8>>8 boxes.\nHe earns 8 * 4 = $<<8*4=32>>32.\n#### 32",
    ),
    (
        "Tom reads 15 pages a day for 2 weeks. How many pages does he read?",
        "Two weeks are 2 * 7 = <<2*7=14>>14 days.\nHe reads 14 * 15 = <<14*15=210>>210 pages.\n#### 210",
    ),
    (
        "A car uses 8 liters of fuel per 100 km. How many liters does it use for 350 km?",
        "It uses 350 / 100 = <<350/100=3.5>>3.5 times 8 liters.\nThat is 3.5 * 8 = <<3.5*8=28>>28 liters.\n#### 28",
    ),
    (
        "Lena has $1,250 and spends $375 on a bike and $80 on a helmet. How much is left?",
        "She spends 375 + 80 = $<<375+80=455>>455.\nShe has 1250 - 455 = $<<1250-455=795>>795 left.\n#### 795",
    ),
    (
        "A farm has 120 chickens. A quarter of them are roosters. How many hens are there?",
        "There are 120 / 4 = <<120/4=30>>30 roosters.\nSo 120 - 30 = <<120-30=90>>90 hens.\n#### 90",
    ),
    (
        "The temperature was 5 degrees and fell by 12 degrees overnight. What was it in the morning?",
        "It was 5 - 12 = <<5-12=-7>>-7 degrees.\n#### -7",
    ),
    (
        "A school orders 2,400 notebooks for 16 classes equally. How many does each class get?",
        "Each class gets 2400 / 16 = <<2400/16=150>>150 notebooks.\n#### 150",
    ),
    (
        "Sam earns $18 an hour and works 37 hours. How much does he earn?",
        "He earns 18 * 37 = $<<18*37=666>>666.\n#### 666",
    ),
    (
        "A tank holds 600 liters and is 35% full. How many liters are in it?",
        "It holds 600 * 35 / 100 = <<600*35/100=210>>210 liters.\n#### 210",
    ),
    (
        "Ana runs 4.5 km each morning for 6 days. How far does she run?",
        "She runs 4.5 * 6 = <<4.5*6=27>>27 km.\n#### 27",
    ),
    (
        "A shirt costs $40 and is on sale for 25% off. What is the sale price?",
        "The discount is 40 * 25 / 100 = $<<40*25/100=10>>10.\nThe price is 40 - 10 = $<<40-10=30>>30.\n#### 30",
    ),
    (
        "There are 7 rows of 13 chairs, and 19 chairs are empty. How many people are seated?",
        "There are 7 * 13 = <<7*13=91>>91 chairs.\nSo 91 - 19 = <<91-19=72>>72 people are seated.\n#### 72",
    ),
    ("A recipe needs 3 eggs per cake. How many eggs for 14 cakes?", "It needs 3 * 14 = <<3*14=42>>42 eggs.\n#### 42"),
    (
        "A train travels 540 km in 6 hours. What is its speed in km per hour?",
        "Its speed is 540 / 6 = <<540/6=90>>90 km per hour.\n#### 90",
    ),
    ("Ben saves $25 a week. How many weeks to save $1,000?", "He needs 1000 / 25 = <<1000/25=40>>40 weeks.\n#### 40"),
];

/// The GGUF (`$TLT_SMOLLM2_GGUF`, which must exist when set, else the cache's if fetched).
fn model_path() -> Option<PathBuf> {
    tlt_model::assets::smollm2_gguf_if_present().expect("the SmolLM2 GGUF")
}

fn jsonl() -> String {
    GOLD.iter()
        .map(|(q, a)| serde_json::json!({ "question": q, "answer": a }).to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn gsm8k_gold_solutions_ended_by_the_stop_token_score_correct() {
    let Some(path) = model_path() else {
        println!("SKIPPED: SmolLM2 GGUF not found; run `cargo xtask fetch-assets` (or `cargo xtask test`, which sets TLT_SMOLLM2_GGUF)");
        return;
    };
    let tokenizer = tlt_model::GgufFile::open(&path).unwrap().tokenizer().unwrap().unwrap();
    let stop = tokenizer.token_to_id("<|im_end|>").unwrap();
    let task = JsonlTask::from_str("gsm8k-gold", &jsonl()).unwrap();
    let n = task.len().unwrap();
    assert_eq!(n, GOLD.len() as u64);
    let env = TextEnv::new(Box::new(task), tokenizer.clone(), ChatTemplate::chatml(), None).unwrap();
    let mut correct = [0usize; 3];
    for pos in 0..n {
        let prompt = env.prompt(Split::Train, pos).unwrap();
        let gold = GOLD.iter().find(|(q, _)| prompt.problem.as_ref().unwrap().prompt.starts_with(q)).unwrap().1;
        // As generated: the solution, then the stop token; also with a full stop before it, and without it.
        for (k, text) in [gold.to_string(), format!("{gold}.")].iter().enumerate() {
            let mut ids = tlt_model::encode(&tokenizer, text).unwrap();
            let plain = env.score(&prompt, &ids).unwrap();
            ids.push(stop);
            // The stop token is really in the completion the decoder sees with special tokens kept.
            assert!(tlt_model::decode(&tokenizer, &ids).unwrap().ends_with("<|im_end|>"));
            let s = env.score(&prompt, &ids).unwrap();
            assert!(s.correct && s.formatted && (s.reward - 1.0).abs() < 1e-12, "{text:?} + <|im_end|>: {s:?}");
            assert_eq!(s, plain, "the stop token changed the score of {text:?}");
            correct[k] += usize::from(s.correct);
        }
        // Negative control: a wrong final number is formatted but wrong.
        let wrong = gold.rsplit_once("#### ").map(|(head, n)| format!("{head}#### {}1", n)).unwrap();
        let mut ids = tlt_model::encode(&tokenizer, &wrong).unwrap();
        ids.push(stop);
        let s = env.score(&prompt, &ids).unwrap();
        assert!(!s.correct && s.formatted, "{wrong:?}: {s:?}");
        correct[2] += 1;
    }
    println!("gold solutions + <|im_end|> correct: {}/{n}; with a final '.': {}/{n}", correct[0], correct[1]);
    assert_eq!(correct, [GOLD.len(); 3]);

    // A non-numeric answer after `####` (the whole line is the answer): only decoding without special tokens keeps
    // the stop token out of it.
    let task = JsonlTask::from_str(
        "frac",
        &serde_json::json!({"question": "Half?", "answer": "#### \\frac{1}{2}"}).to_string(),
    );
    let task = task.unwrap();
    let env = TextEnv::new(Box::new(task), tokenizer.clone(), ChatTemplate::chatml(), None).unwrap();
    let prompt = env.prompt(Split::Train, 0).unwrap();
    let mut ids = tlt_model::encode(&tokenizer, "So it is\n#### \\frac{1}{2}").unwrap();
    ids.push(stop);
    let s = env.score(&prompt, &ids).unwrap();
    assert!(s.correct, "{s:?}");
}
