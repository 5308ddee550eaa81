//! Regression inputs from fuzzing run configs (`cargo xtask fuzz run-toml`, see `xtask/README.md`): the seed run configs and every finding
//! under `tests/fuzz-regressions/`. Each goes through what `train` does with a config before loading a model
//! (parse, validate), then the objects it configures (learning-rate schedule, SD gate and bandit, suffix
//! drafter, task environment, a trainer over a tiny policy), and must succeed (`ok-*`), fail with an error (`err-*`), or either (any other
//! name), never panic.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::path::Path;

use tlt_rl::runner::{text_env, RunConfig};
use tlt_rl::task::Split;
use tlt_rl::trainer::Environment;
use tokenizers::Tokenizer;

/// A byte-level BPE tokenizer that encodes any text (the 256 byte symbols and two control tokens).
fn tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> =
        tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet().into_iter().map(String::from).collect();
    tokens.sort();
    tokens.extend(["<|im_start|>", "<|im_end|>"].map(String::from));
    let mut token_types = vec![1; tokens.len()];
    let n = token_types.len();
    token_types[n - 2..].fill(3);
    let vocab =
        tlt_model::GgufVocab { model: "gpt2".into(), pre: "smollm".into(), tokens, merges: vec![], token_types };
    tlt_model::tokenizer_from_gguf_vocab(&vocab, Path::new("test")).unwrap()
}

fn run(text: &str, tok: &Tokenizer, policy: &tlt_model::Llama) -> Result<(), String> {
    let s = |e: &dyn std::fmt::Display| e.to_string();
    let cfg = RunConfig::from_toml(text).map_err(|e| s(&e))?;
    cfg.trainer.validate().map_err(|e| s(&e))?;
    for step in [0, 1, cfg.trainer.steps, cfg.trainer.optim.schedule.total_steps, u64::MAX] {
        assert!(!cfg.trainer.optim.schedule.lr_at(step).is_nan());
    }
    tlt_scheduler::AdaptiveDecoder::new(cfg.trainer.sd.gate.clone(), cfg.trainer.sd.mab.clone()).map_err(|e| s(&e))?;
    tlt_spec_decode::SuffixDrafter::new(cfg.trainer.sd.suffix).map_err(|e| s(&e))?;
    if cfg.task.jsonl.is_none() {
        let env = text_env(&cfg.task, tok.clone(), None).map_err(|e| s(&e))?;
        for split in [Split::Train, Split::Eval] {
            for pos in [0, 1, 7] {
                let prompt = env.prompt(split, pos).map_err(|e| s(&e))?;
                env.score(&prompt, &[1, 2, 3]).map_err(|e| s(&e))?;
            }
        }
        tlt_rl::Trainer::new(policy.clone(), env, cfg.trainer).map_err(|e| s(&e))?;
    }
    Ok(())
}

#[test]
fn run_configs_parse_and_build_or_fail_cleanly() {
    let tok = tokenizer();
    let policy = tlt_model::Llama::random(tlt_model::LlamaConfig::tiny(tok.get_vocab_size(true), 16, 1), 4).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fuzz-regressions");
    let mut files: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no regression configs");
    for path in files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // Read as bytes: a finding need not be UTF-8 (then it is an error, as `train` reports it).
        let outcome = String::from_utf8(std::fs::read(&path).unwrap())
            .map_err(|e| e.to_string())
            .and_then(|t| run(&t, &tok, &policy));
        if name.starts_with("ok-") {
            assert!(outcome.is_ok(), "{name} should be accepted: {outcome:?}");
        } else if name.starts_with("err-") {
            assert!(outcome.is_err(), "{name} should be rejected");
        }
    }
}
