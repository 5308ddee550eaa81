//! `train --mode compare` interleaves the two runs in one process by default: on a tiny seeded model, TLT's and
//! the baseline's runs sample the same tokens step by step interleaved as each does alone (digest of every
//! answer's tokens and every length), and a run with another seed does not (the check can fail).

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::path::PathBuf;

use tlt_model::{EosTokens, Llama, LlamaConfig};
use tlt_rl::metrics::StepMetrics;
use tlt_rl::runner::{run, run_interleaved, EvalSpec, RunConfig, RunDir};
use tlt_rl::task::{Score, Split};
use tlt_rl::trainer::{
    DrafterChoice, DrafterSchedule, Environment, ExportConfig, Mode, Prompt, Quiet, SdConfig, Trainer, TrainerConfig,
};

const VOCAB: u32 = 32;

fn tiny_model() -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB as usize, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(1));
    Llama::random(cfg, 3).unwrap()
}

/// Prompts of 3-6 tokens; reward = fraction of generated tokens equal to 7.
struct Env;

impl Environment for Env {
    fn prompt(&self, split: Split, pos: u64) -> tlt_rl::Result<Prompt> {
        let index = if split == Split::Train { pos } else { 1_000_000 + pos };
        let len = 3 + (index % 4) as usize;
        let ids = (0..len).map(|j| 2 + ((index * 7 + j as u64 * 3) % u64::from(VOCAB - 2)) as u32).collect();
        Ok(Prompt { index, ids, problem: None })
    }

    fn score(&self, _prompt: &Prompt, completion: &[u32]) -> tlt_rl::Result<Score> {
        let reward = completion.iter().filter(|&&t| t == 7).count() as f64 / completion.len().max(1) as f64;
        Ok(Score { reward, correct: reward > 0.5, formatted: true, timed_out: false })
    }
}

fn run_config(seed: u64) -> RunConfig {
    let mut sd = SdConfig {
        drafter: DrafterChoice::Eagle2,
        schedule: DrafterSchedule::Fixed { steps: 2 },
        ..SdConfig::default()
    };
    // Speculate at every batch size, so that TLT's rounds really draft and verify.
    sd.gate.threshold = 64;
    sd.gate.on_after = 1;
    sd.gate.off_threshold = 64;
    sd.gate.off_after = 1;
    let trainer = TrainerConfig {
        seed,
        steps: 3,
        prompts_per_step: 4,
        group_size: 4,
        max_new_tokens: 12,
        micro_batch_tokens: 64,
        sd,
        ..TrainerConfig::default()
    };
    RunConfig {
        trainer,
        eval: EvalSpec { prompts: 0, max_new_tokens: 8 },
        checkpoint_every: 0,
        export: ExportConfig { at_end: false, at_checkpoints: false, ..ExportConfig::default() },
        ..RunConfig::default()
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tlt-interleaved-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn trainer(cfg: &RunConfig, mode: Mode) -> Trainer<Env> {
    Trainer::new(tiny_model(), Env, TrainerConfig { mode, ..cfg.trainer.clone() }).unwrap()
}

/// Each step's token digest and lengths.
fn tokens(m: &[StepMetrics]) -> Vec<(u64, Vec<usize>)> {
    m.iter().map(|s| (s.tokens_digest, s.response_lengths.clone())).collect()
}

fn alone(cfg: &RunConfig, mode: Mode, tag: &str) -> Vec<(u64, Vec<usize>)> {
    let dir = temp_dir(tag);
    let out = run(&mut trainer(cfg, mode), cfg, &RunDir(dir.clone()), &mut Quiet).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    tokens(&out.metrics)
}

#[test]
fn interleaved_runs_sample_the_tokens_each_run_samples_alone() {
    let cfg = run_config(5);
    let (da, db) = (temp_dir("tlt"), temp_dir("baseline"));
    let (mut ta, mut tb) = (trainer(&cfg, Mode::Tlt), trainer(&cfg, Mode::Baseline));
    let (oa, ob) =
        run_interleaved((&mut ta, &RunDir(da.clone()), &mut Quiet), (&mut tb, &RunDir(db.clone()), &mut Quiet), &cfg)
            .unwrap();
    let interleaved_tlt = tokens(&oa.metrics);
    assert_eq!(interleaved_tlt.len(), 3);
    assert!(interleaved_tlt.iter().all(|(d, l)| *d != 0 && !l.is_empty()), "{interleaved_tlt:?}");
    assert!(oa.metrics.iter().any(|m| m.sd_on_fraction > 0.0), "TLT's rollouts speculated");
    // The per-round trace the report draws: one end time and one SD flag per round, in order.
    for m in &oa.metrics {
        assert_eq!(m.round_end_s.len(), m.active_requests.len());
        assert_eq!(m.round_sd.len(), m.active_requests.len());
        assert!(m.round_end_s.windows(2).all(|w| w[0] <= w[1]) && m.round_sd.iter().any(|&sd| sd));
    }
    assert_eq!(interleaved_tlt, tokens(&ob.metrics), "TLT and the baseline, interleaved");
    assert_eq!(interleaved_tlt, alone(&cfg, Mode::Tlt, "tlt-alone"), "TLT interleaved vs alone");
    assert_eq!(interleaved_tlt, alone(&cfg, Mode::Baseline, "baseline-alone"), "baseline alone");
    // Negative control: another seed samples other tokens, and the comparison sees it.
    assert_ne!(interleaved_tlt, alone(&run_config(6), Mode::Baseline, "other-seed"));
    for d in [da, db] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
