//! `cargo xtask check-export`: runs `scripts/check_export_parity.py` on what TLT exports, with the Python packages
//! `cargo xtask fetch-assets --python-checks` installs (torch, transformers, speculators).
//!
//! This side writes the dump the script reads: `manifest.json`, the inputs TLT ran and TLT's outputs. For the
//! policy (an HF directory, e.g. `train`'s `export/policy`): greedy tokens and last-position prefill logits of 8
//! prompts. For a drafter (EAGLE-2 or EAGLE-3, paired with an HF `--target`): a prompt and its greedy response run
//! through the target with the EAGLE taps recorded, and the drafter's layer outputs ("final hidden states") and
//! draft logits at every position, computed by `tlt_drafter::DraftRuntime` in f32.
//!
//! `--tiny` builds the inputs instead, in seconds: a tiny seeded model trained one TLT step and exported by
//! `Trainer::export` (policy + EAGLE-2 drafter), and a seeded EAGLE-3 drafter for it. `cargo xtask test` runs that
//! when the packages are installed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde_json::json;
use tlt_drafter::checkpoint::{save_eagle3, EAGLE3_ARCHITECTURES};
use tlt_drafter::{
    DraftCache, DraftRuntime, DrafterConfig, Eagle2Drafter, Eagle3Drafter, FrozenTarget, RuntimeOptions, SaveDType,
    VocabMap,
};
use tlt_model::{EosTokens, Llama, LlamaConfig, Tap, WeightDType};
use tlt_rl::task::{Score, Split};
use tlt_rl::trainer::{
    DrafterChoice, DrafterSchedule, Environment, ExportConfig, Prompt, Quiet, SdConfig, Trainer, TrainerConfig,
};
use tlt_spec_decode::{Engine, Plan, SpecParams, TappedLlama};

/// Arguments of `cargo xtask check-export`.
#[derive(Debug, clap::Args)]
pub struct CheckExportArgs {
    /// An exported policy (HF directory) to compare with transformers (greedy tokens, logits, tokenizer).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// An exported EAGLE-2/EAGLE-3 drafter directory to compare with speculators / transformers.
    #[arg(long, requires = "target")]
    pub drafter: Option<PathBuf>,
    /// The HF directory of the model the drafter drafts for (its embedding, LM head and config).
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Build a tiny seeded policy and drafters instead (seconds; what `cargo xtask test` runs).
    #[arg(long, conflicts_with_all = ["policy", "drafter"])]
    pub tiny: bool,
    /// Greedy tokens per policy prompt.
    #[arg(long, default_value_t = 32)]
    pub new_tokens: usize,
    /// Where the dump goes.
    #[arg(long, default_value = "target/export-check")]
    pub out: PathBuf,
}

/// Prompts of the policy check (chat-wrapped when the tokenizer has ChatML tokens).
const PROMPTS: [&str; 8] = [
    "What is 15 + 27?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Compute 9 - 4 and explain.",
    "Give a synonym for happy.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
];

/// Runs the check; fails when the packages are missing or a comparison fails.
pub fn run(args: &CheckExportArgs) -> Result<()> {
    let py = crate::env::python_export_deps()?;
    let out = &args.out;
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut manifest = serde_json::Map::new();
    if args.tiny {
        tiny(out, args.new_tokens, &mut manifest)?;
    } else {
        if let Some(p) = &args.policy {
            manifest.insert("policy".into(), dump_policy(p, out, args.new_tokens)?);
        }
        if let (Some(d), Some(t)) = (&args.drafter, &args.target) {
            let target = tlt_model::load_hf_dir(t).with_context(|| format!("loading {}", t.display()))?;
            let (kind, entry) = dump_drafter(d, t, &target.model, target.tokenizer.as_ref(), out)?;
            manifest.insert(kind.into(), entry);
        }
        if manifest.is_empty() {
            bail!("nothing to check: pass --policy and/or --drafter with --target, or --tiny");
        }
    }
    std::fs::write(out.join("manifest.json"), serde_json::to_string_pretty(&manifest)?)?;
    run_script(&py, out)
}

/// Runs the script on `dump` with `py` on `PYTHONPATH`.
pub fn run_script(py: &Path, dump: &Path) -> Result<()> {
    let script = crate::env::workspace_root().join("scripts").join("check_export_parity.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .arg(&script)
        .arg(dump)
        .env("PYTHONPATH", py)
        .status()
        .with_context(|| format!("running {python} {}", script.display()))?;
    if !status.success() {
        bail!("{} failed ({status}); details in {}", script.display(), dump.join("result.json").display());
    }
    Ok(())
}

fn save(path: &Path, tensors: BTreeMap<String, Tensor>) -> Result<()> {
    let map: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&map, path).with_context(|| format!("writing {}", path.display()))
}

/// Greedy tokens (batch 1, the engine's plain path) and the last-position prefill logits of `prompt`.
fn greedy(model: &Llama, prompt: &[u32], new_tokens: usize) -> Result<(Vec<u32>, Tensor)> {
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    let logits = model.prefill(&mut cache, seq, prompt)?;
    let mut e = Engine::new(model, SpecParams::greedy(new_tokens))?;
    e.add_request(prompt)?;
    e.run_to_completion(None, &Plan::chain(1))?;
    let tokens = e.take_finished().pop().map(|f| f.tokens).unwrap_or_default();
    Ok((tokens, logits))
}

/// Dumps the policy check of the HF directory `dir`.
fn dump_policy(dir: &Path, out: &Path, new_tokens: usize) -> Result<serde_json::Value> {
    let loaded = tlt_model::load_hf_dir(dir).with_context(|| format!("loading {}", dir.display()))?;
    let model = loaded.model;
    let (texts, prompts): (Vec<String>, Vec<Vec<u32>>) = match &loaded.tokenizer {
        Some(tok) => {
            let chat = tok.token_to_id("<|im_start|>").is_some();
            let texts: Vec<String> = PROMPTS
                .iter()
                .map(|p| {
                    if chat {
                        format!("<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n")
                    } else {
                        p.to_string()
                    }
                })
                .collect();
            let ids = texts.iter().map(|t| tlt_model::encode(tok, t)).collect::<Result<_, _>>()?;
            (texts, ids)
        }
        None => (Vec::new(), synthetic_prompts(model.config().vocab_size)),
    };
    let mut logits = BTreeMap::new();
    let mut outs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (tokens, l) = greedy(&model, p, new_tokens)?;
        logits.insert(format!("p{i}"), l);
        outs.push(tokens);
    }
    save(&out.join("policy_logits.safetensors"), logits)?;
    Ok(json!({
        "dir": std::path::absolute(dir)?, "prompts": prompts, "texts": texts, "greedy": outs,
        "max_new_tokens": new_tokens, "eos": model.config().eos_ids(), "logits": "policy_logits.safetensors",
        "chat": chat_renderings(dir)?, "chat_users": PROMPTS,
    }))
}

/// The prompts rendered as one user message by the chat template of `dir/tokenizer_config.json` (our minijinja
/// renderer), for comparison with transformers' `apply_chat_template`; empty without a template.
fn chat_renderings(dir: &Path) -> Result<Vec<String>> {
    let Ok(text) = std::fs::read_to_string(dir.join("tokenizer_config.json")) else { return Ok(Vec::new()) };
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let Some(t) = tlt_rl::task::ChatTemplate::from_tokenizer_config(&v)? else { return Ok(Vec::new()) };
    PROMPTS.iter().map(|p| Ok(t.prompt(None, p)?)).collect()
}

/// Eight token-id prompts of 4-11 tokens for a model without a tokenizer.
fn synthetic_prompts(vocab: usize) -> Vec<Vec<u32>> {
    (0..8u32).map(|i| (0..4 + i).map(|j| 2 + (i * 13 + j * 7) % (vocab as u32 - 2)).collect()).collect()
}

/// Dumps the check of the drafter in `dir` paired with `target` (loaded from `target_dir`); returns the
/// manifest key (`eagle2`/`eagle3`) and entry.
fn dump_drafter(
    dir: &Path,
    target_dir: &Path,
    target: &Llama,
    tok: Option<&tokenizers::Tokenizer>,
    out: &Path,
) -> Result<(&'static str, serde_json::Value)> {
    let text =
        std::fs::read_to_string(dir.join("config.json")).with_context(|| format!("reading {}", dir.display()))?;
    let cfg: serde_json::Value = serde_json::from_str(&text)?;
    let eagle3 = cfg["architectures"]
        .as_array()
        .is_some_and(|a| a.iter().any(|x| x.as_str().is_some_and(|s| EAGLE3_ARCHITECTURES.contains(&s))));
    let opts = RuntimeOptions { layer_dtype: WeightDType::F32, head_dtype: WeightDType::F32, hot_vocab: None };
    let mut tensors = BTreeMap::new();
    let rt = if eagle3 {
        let d = Eagle3Drafter::load(dir, target)?;
        tensors.insert("d2t".into(), Tensor::new(d.vocab().d2t(), &Device::Cpu)?);
        DraftRuntime::eagle3(&d, &opts)?
    } else {
        DraftRuntime::eagle2(&Eagle2Drafter::load(dir, target)?, &opts)?
    };
    // A prompt and the target's greedy response, with every position's taps (three aux layers, final norm).
    let prompt = match tok {
        Some(t) => {
            tlt_model::encode(t, "<|im_start|>user\nExplain why the sky is blue.<|im_end|>\n<|im_start|>assistant\n")?
        }
        None => synthetic_prompts(target.config().vocab_size).remove(7),
    };
    let taps = Tap::eagle3(target.config().num_hidden_layers);
    let mut e = Engine::new(TappedLlama { model: target, taps: &taps }, SpecParams::greedy(40))?;
    e.record_hidden(true);
    e.add_request(&prompt)?;
    e.run_to_completion(None, &Plan::chain(1))?;
    let f = e.take_finished().pop().context("no response")?;
    let hidden = f.hidden.context("no hidden states")?;
    let tokens: Vec<u32> = prompt.iter().chain(&f.tokens).copied().collect();
    let n = tokens.len() - 1;
    let rows: Vec<&[f32]> = (0..n).map(|t| hidden.row(t).context("missing row")).collect::<Result<_>>()?;
    let feats: Vec<&[f32]> = rows.iter().map(|r| rt.feature_of(r)).collect::<Result<_, _>>()?;
    let a = rt.extend(&mut DraftCache::default(), &tokens, &feats)?;
    let logits = rt.logits(&a)?;
    let h = rt.hidden_size();
    let width = feats[0].len();
    let flat: Vec<f32> = feats.iter().flat_map(|r| r.iter().copied()).collect();
    let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    tensors.insert("input_ids".into(), Tensor::new(ids, &Device::Cpu)?);
    tensors.insert(if eagle3 { "aux" } else { "feature" }.into(), Tensor::from_vec(flat, (n, width), &Device::Cpu)?);
    tensors.insert("hidden".into(), Tensor::from_vec(a, (n, h), &Device::Cpu)?);
    let v = logits.len() / n;
    tensors.insert("logits".into(), Tensor::from_vec(logits, (n, v), &Device::Cpu)?);
    let kind = if eagle3 { "eagle3" } else { "eagle2" };
    let file = format!("{kind}.safetensors");
    save(&out.join(&file), tensors)?;
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    Ok((kind, json!({ "drafter": abs(dir), "target": abs(target_dir), "inputs": file })))
}

/// A token-level task for the tiny fixture: reward = fraction of generated tokens equal to 7.
struct TinyEnv;

impl Environment for TinyEnv {
    fn prompt(&self, split: Split, pos: u64) -> tlt_rl::Result<Prompt> {
        let index = if split == Split::Train { pos } else { 1_000_000 + pos };
        let ids = (0..4 + index % 3).map(|j| 2 + ((index * 7 + j * 3) % 60) as u32).collect();
        Ok(Prompt { index, ids, problem: None })
    }

    fn score(&self, _prompt: &Prompt, completion: &[u32]) -> tlt_rl::Result<Score> {
        let reward = completion.iter().filter(|&&t| t == 7).count() as f64 / completion.len().max(1) as f64;
        Ok(Score { reward, correct: reward > 0.5, formatted: true, timed_out: false })
    }
}

/// The tiny fixture: one TLT step on a seeded 8-layer model, exported; plus a seeded EAGLE-3 drafter.
fn tiny(out: &Path, new_tokens: usize, manifest: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    let mut cfg = LlamaConfig::tiny(64, 64, 8);
    cfg.eos_token_id = Some(EosTokens::One(1));
    let model = Llama::random(cfg, 7)?;
    let tcfg = TrainerConfig {
        steps: 1,
        prompts_per_step: 4,
        group_size: 4,
        max_new_tokens: 8,
        micro_batch_tokens: 64,
        sd: SdConfig {
            drafter: DrafterChoice::Eagle2,
            schedule: DrafterSchedule::Fixed { steps: 2 },
            ..SdConfig::default()
        },
        ..TrainerConfig::default()
    };
    let mut t = Trainer::new(model, TinyEnv, tcfg)?;
    t.step(&mut Quiet)?;
    let exp = t.export(&out.join("export"), &ExportConfig::default())?;
    let policy = exp.policy();
    let drafter = exp.drafter_dir().context("the TLT run exported no drafter")?;
    manifest.insert("policy".into(), dump_policy(&policy, out, new_tokens)?);
    let target = tlt_model::load_hf_dir(&policy)?.model;
    manifest.insert("eagle2".into(), dump_drafter(&drafter, &policy, &target, None, out)?.1);
    let tokens = synthetic_prompts(64).concat();
    let vocab = VocabMap::from_tokens(tokens, 64, 32, &[1])?;
    let d3 = Eagle3Drafter::random(
        DrafterConfig::eagle3_from_target(target.config(), 32),
        vocab,
        FrozenTarget::new(&target),
        3,
    )?;
    let e3 = out.join("eagle3");
    save_eagle3(&d3, &e3, SaveDType::Bf16)?;
    manifest.insert("eagle3".into(), dump_drafter(&e3, &policy, &target, None, out)?.1);
    t.shutdown()?;
    Ok(())
}
