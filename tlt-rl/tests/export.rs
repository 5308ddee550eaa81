//! The run's byproduct on a tiny seeded model: the runner exports the policy (HF directory) and its drafter (EAGLE,
//! serving layout) at the end and, when asked, at every checkpoint, and both reload with our own loaders; the run's
//! identity (`run.json`) refuses a resume with other data or scoring.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::path::{Path, PathBuf};

use tlt_drafter::checkpoint::load_eagle2;
use tlt_drafter::SaveDType;
use tlt_model::{EosTokens, Llama, LlamaConfig};
use tlt_rl::runner::{run, EvalSpec, RunConfig, RunDir, TaskSpec};
use tlt_rl::task::{Score, Split};
use tlt_rl::trainer::{
    DrafterChoice, DrafterSchedule, Environment, ExportConfig, Mode, Prompt, Quiet, SdConfig, Trainer, TrainerConfig,
    EXPORT_DRAFTER_DIR, EXPORT_POLICY_DIR, SERVE_FILE,
};
use tlt_rl::Result;
use tlt_scheduler::GateConfig;

const VOCAB: u32 = 32;

fn tiny_model(seed: u64) -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB as usize, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(1));
    Llama::random(cfg, seed).unwrap()
}

/// Prompts of 3-6 tokens; reward = fraction of generated tokens equal to 7.
struct Env;

impl Environment for Env {
    fn prompt(&self, split: Split, pos: u64) -> Result<Prompt> {
        let index = if split == Split::Train { pos } else { 1_000_000 + pos };
        let len = 3 + (index % 4) as usize;
        let ids = (0..len).map(|j| 2 + ((index * 7 + j as u64 * 3) % u64::from(VOCAB - 2)) as u32).collect();
        Ok(Prompt { index, ids, problem: None })
    }

    fn score(&self, _prompt: &Prompt, completion: &[u32]) -> Result<Score> {
        let reward = completion.iter().filter(|&&t| t == 7).count() as f64 / completion.len().max(1) as f64;
        Ok(Score { reward, correct: reward > 0.5, formatted: true, timed_out: false })
    }
}

fn run_config(mode: Mode, export: ExportConfig) -> RunConfig {
    let trainer = TrainerConfig {
        mode,
        seed: 5,
        steps: 2,
        prompts_per_step: 4,
        group_size: 4,
        max_new_tokens: 8,
        micro_batch_tokens: 64,
        sd: SdConfig {
            drafter: DrafterChoice::Eagle2,
            gate: GateConfig { threshold: 64, on_after: 1, off_threshold: 64, off_after: 1 },
            schedule: DrafterSchedule::Fixed { steps: 2 },
            ..SdConfig::default()
        },
        ..TrainerConfig::default()
    };
    RunConfig {
        trainer,
        eval: EvalSpec { prompts: 0, max_new_tokens: 8 },
        checkpoint_every: 1,
        export,
        ..RunConfig::default()
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tlt-export-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The config as written to `config.json` (a reloaded config names the derived `head_dim`).
fn hf(c: &LlamaConfig) -> serde_json::Value {
    c.to_hf_json("float32").unwrap()
}

fn tensors(m: &Llama) -> Vec<(String, Vec<f32>)> {
    m.weights().named_tensors().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap())).collect()
}

/// The drafter weights of a checkpoint directory, by bare name.
fn drafter_weights(dir: &Path, target: &LlamaConfig) -> Vec<(String, Vec<f32>)> {
    let ck = load_eagle2(dir, target).unwrap();
    let mut w = ck.weights.clone();
    w.entries_mut()
        .into_iter()
        .filter(|(n, _)| !n.ends_with("fc.bias"))
        .map(|(n, t)| (n.trim_start_matches("model.").to_string(), t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect()
}

#[test]
fn tlt_run_exports_policy_and_drafter_at_the_end_and_at_checkpoints() {
    let dir = temp_dir("tlt");
    let export = ExportConfig { at_checkpoints: true, drafter_dtype: SaveDType::F32, ..ExportConfig::default() };
    let cfg = run_config(Mode::Tlt, export);
    let mut t = Trainer::new(tiny_model(3), Env, cfg.trainer.clone()).unwrap();
    let out = run(&mut t, &cfg, &RunDir(dir.clone()), &mut Quiet).unwrap();
    let exp = dir.join("export");
    assert_eq!(out.export.as_deref(), Some(exp.as_path()));

    // The policy reloads with tlt-model's HF loader, bit for bit (f32).
    let policy = tlt_model::load_hf_dir(&exp.join(EXPORT_POLICY_DIR)).unwrap();
    assert_eq!(hf(policy.model.config()), hf(t.policy().config()));
    assert_eq!(tensors(&policy.model), tensors(t.policy()));
    assert!(policy.tokenizer.is_none(), "a token-level environment has no tokenizer to export");

    // The drafter reloads with tlt-drafter's EAGLE-2 loader and equals the one the final checkpoint holds.
    let drafter = exp.join(EXPORT_DRAFTER_DIR);
    let ck = load_eagle2(&drafter, t.policy().config()).unwrap();
    let bias = ck.weights.fc.bias.as_ref().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(bias.iter().all(|&b| b == 0.0), "the serving layout carries a zero fc bias");
    let checkpointed = dir.join("checkpoint").join("drafter").join("drafter");
    assert_eq!(drafter_weights(&drafter, t.policy().config()), drafter_weights(&checkpointed, t.policy().config()));
    let serve = std::fs::read_to_string(exp.join(SERVE_FILE)).unwrap();
    assert!(serve.contains("--speculative-algorithm EAGLE "), "{serve}");
    assert!(serve.contains(&format!("{}", std::path::absolute(&drafter).unwrap().display())), "{serve}");

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode =
            std::fs::metadata(exp.join(EXPORT_POLICY_DIR).join("model.safetensors")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644, "exported files are readable by a serving engine running as another user");
    }

    // One export per checkpoint, each complete.
    for step in 1..=2 {
        let e = RunDir(dir.clone()).step_export(step);
        let p = tlt_model::load_hf_dir(&e.join(EXPORT_POLICY_DIR)).unwrap();
        assert_eq!(hf(p.model.config()), hf(t.policy().config()));
        load_eagle2(&e.join(EXPORT_DRAFTER_DIR), t.policy().config()).unwrap();
        assert!(std::fs::read_to_string(e.join(SERVE_FILE)).unwrap().contains(&format!("after {step} RL steps")));
    }
    // The last checkpoint's export is the final one.
    let last = tlt_model::load_hf_dir(&RunDir(dir.clone()).step_export(2).join(EXPORT_POLICY_DIR)).unwrap();
    assert_eq!(tensors(&last.model), tensors(t.policy()));

    // The default drafter dtype is bf16 (what the engines serve), and it still loads.
    let bf16 = dir.join("bf16");
    let e = t.export(&bf16, &ExportConfig::default()).unwrap();
    assert_eq!(e.drafter_dir(), Some(bf16.join(EXPORT_DRAFTER_DIR)));
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bf16.join(EXPORT_DRAFTER_DIR).join("config.json")).unwrap())
            .unwrap();
    assert_eq!(c["torch_dtype"], "bfloat16");
    load_eagle2(&bf16.join(EXPORT_DRAFTER_DIR), t.policy().config()).unwrap();
    t.shutdown().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn baseline_run_exports_the_policy_alone_at_the_end_only() {
    let dir = temp_dir("base");
    let cfg = run_config(Mode::Baseline, ExportConfig::default());
    let mut t = Trainer::new(tiny_model(4), Env, cfg.trainer.clone()).unwrap();
    let out = run(&mut t, &cfg, &RunDir(dir.clone()), &mut Quiet).unwrap();
    let exp = out.export.unwrap();
    let policy = tlt_model::load_hf_dir(&exp.join(EXPORT_POLICY_DIR)).unwrap();
    assert_eq!(tensors(&policy.model), tensors(t.policy()));
    assert!(!exp.join(EXPORT_DRAFTER_DIR).exists());
    assert!(std::fs::read_to_string(exp.join(SERVE_FILE)).unwrap().contains("NGRAM"));
    assert!(!dir.join("exports").exists(), "no per-checkpoint exports unless asked");

    // Exports can be turned off.
    let off = ExportConfig { at_end: false, ..ExportConfig::default() };
    let cfg = RunConfig { export: off, ..run_config(Mode::Baseline, ExportConfig::default()) };
    let dir2 = temp_dir("off");
    let mut t = Trainer::new(tiny_model(4), Env, cfg.trainer.clone()).unwrap();
    assert!(run(&mut t, &cfg, &RunDir(dir2.clone()), &mut Quiet).unwrap().export.is_none());
    assert!(!dir2.join("export").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&dir2).unwrap();
}

/// A resumed run whose data or scoring changed since its checkpoint is refused with the changes named (the data
/// seed; the JSONL file's bytes); `allow_changed_task` resumes it, and the resumed run evaluates before its first
/// step.
#[test]
fn a_resume_with_changed_data_is_refused_unless_allowed() {
    let dir = temp_dir("identity");
    let jsonl = dir.with_extension("jsonl");
    std::fs::write(&jsonl, "{\"question\": \"1 + 1?\", \"answer\": \"#### 2\"}\n").unwrap();
    let mut cfg = run_config(Mode::Baseline, ExportConfig { at_end: false, ..ExportConfig::default() });
    cfg.trainer.steps = 1;
    cfg.eval.prompts = 2;
    cfg.task.jsonl = Some(jsonl.clone());
    let mut t = Trainer::new(tiny_model(3), Env, cfg.trainer.clone()).unwrap();
    run(&mut t, &cfg, &RunDir(dir.clone()), &mut Quiet).unwrap();
    let resumed = |cfg: &RunConfig| {
        let mut more = cfg.clone();
        more.trainer.steps = 2;
        let mut t = Trainer::resume(&dir.join("checkpoint"), tiny_model(3), Env, more.trainer.clone()).unwrap();
        run(&mut t, &more, &RunDir(dir.clone()), &mut Quiet)
    };
    let seed = RunConfig { task: TaskSpec { seed: 9, ..cfg.task.clone() }, ..cfg.clone() };
    let e = resumed(&seed).unwrap_err().to_string();
    assert!(e.contains("task.seed: 0 -> 9") && e.contains("--allow-changed-task"), "{e}");
    std::fs::write(&jsonl, "{\"question\": \"2 + 2?\", \"answer\": \"#### 4\"}\n").unwrap();
    let e = resumed(&cfg).unwrap_err().to_string();
    assert!(e.contains("jsonl_sha256") && !e.contains("task.seed"), "{e}");
    let out = resumed(&RunConfig { allow_changed_task: true, ..cfg.clone() }).unwrap();
    assert_eq!(out.metrics.len(), 2, "the checkpoint's step and the resumed one");
    assert!(out.before.is_some(), "a resumed run evaluates before its first step");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&jsonl);
}
