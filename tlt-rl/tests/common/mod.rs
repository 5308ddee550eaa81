//! Shared pieces of the trainer's integration tests: a tiny seeded policy and environments on token ids.
#![allow(dead_code, clippy::unwrap_used)] // Each test file uses a subset; a panic is the failure report.

use std::collections::BTreeMap;
use std::time::Duration;

use tlt_model::{EosTokens, Llama, LlamaConfig};
use tlt_rl::task::{Score, Split};
use tlt_rl::trainer::{Environment, Prompt, Trainer};
use tlt_rl::Result;

/// Vocabulary of the tiny model.
pub const VOCAB: u32 = 32;
/// The token the reward asks for.
pub const GOOD: u32 = 7;
/// End of sequence of the tiny model.
pub const EOS: u32 = 1;

/// A tiny random Llama (hidden 64, 2 layers) with [`EOS`] as its end of sequence.
pub fn tiny_model(seed: u64) -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB as usize, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(EOS));
    Llama::random(cfg, seed).unwrap()
}

/// Prompt `pos` of `split`: 3-6 tokens derived from the data index (evaluation indices from 1,000,000).
pub fn count_prompt(split: Split, pos: u64) -> Prompt {
    let index = match split {
        Split::Train => pos,
        Split::Eval => 1_000_000 + pos,
    };
    let len = 3 + (index % 4) as usize;
    let ids = (0..len).map(|j| 2 + ((index * 7 + j as u64 * 3) % u64::from(VOCAB - 2)) as u32).collect();
    Prompt { index, ids, problem: None }
}

/// The fraction of `completion` equal to [`GOOD`], correct above one half.
pub fn count_score(completion: &[u32]) -> Score {
    let good = completion.iter().filter(|&&t| t == GOOD).count();
    let reward = good as f64 / completion.len().max(1) as f64;
    Score { reward, correct: reward > 0.5, formatted: true, timed_out: false }
}

/// [`count_prompt`]s scored by `reward(prompt index, completion)`, each scoring taking `delay` (a slow verifier),
/// and scoring of the answers to prompt `hang` taking an hour (a hung verifier).
pub struct FnEnv<F> {
    pub reward: F,
    pub delay: Duration,
    pub hang: Option<u64>,
}

impl<F: Fn(u64, &[u32]) -> Score + Send + Sync + 'static> Environment for FnEnv<F> {
    fn prompt(&self, split: Split, pos: u64) -> Result<Prompt> {
        Ok(count_prompt(split, pos))
    }

    fn score(&self, prompt: &Prompt, completion: &[u32]) -> Result<Score> {
        std::thread::sleep(self.delay);
        if self.hang == Some(prompt.index) {
            std::thread::sleep(Duration::from_secs(3600));
        }
        Ok((self.reward)(prompt.index, completion))
    }
}

/// [`count_prompt`]s scored by [`count_score`].
pub struct Count;

impl Environment for Count {
    fn prompt(&self, split: Split, pos: u64) -> Result<Prompt> {
        Ok(count_prompt(split, pos))
    }

    fn score(&self, _: &Prompt, completion: &[u32]) -> Result<Score> {
        Ok(count_score(completion))
    }
}

/// A [`FnEnv`] without delays.
pub fn fn_env<F: Fn(u64, &[u32]) -> Score + Send + Sync + 'static>(reward: F) -> FnEnv<F> {
    FnEnv { reward, delay: Duration::ZERO, hang: None }
}

/// The policy's weights by name.
pub fn weights<E: Environment>(t: &Trainer<E>) -> BTreeMap<String, Vec<f32>> {
    t.policy()
        .weights()
        .named_tensors()
        .into_iter()
        .map(|(n, w)| (n, w.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// A small run: 8 prompts × 4 answers of at most 12 tokens at T = 1, constant learning rate 3e-3, SD from the first
/// round, the drafter trained on the deterministic `Fixed` schedule (2 steps after each rollout).
pub fn base_config(mode: tlt_rl::trainer::Mode) -> tlt_rl::trainer::TrainerConfig {
    use tlt_model::optim::{LrSchedule, ScheduleKind};
    use tlt_rl::trainer::{DrafterSchedule, OptimConfig, SdConfig, TrainerConfig};
    TrainerConfig {
        mode,
        seed: 3,
        prompts_per_step: 8,
        group_size: 4,
        max_new_tokens: 12,
        temperature: 1.0,
        micro_batch_tokens: 64,
        optim: OptimConfig {
            schedule: LrSchedule {
                lr: 3e-3,
                warmup_steps: 0,
                total_steps: 0,
                min_lr_ratio: 0.0,
                kind: ScheduleKind::Constant,
            },
            ..Default::default()
        },
        sd: SdConfig {
            // Speculate from the first round so every step exercises SD.
            gate: tlt_scheduler::GateConfig { threshold: 64, on_after: 1, off_threshold: 64, off_after: 1 },
            schedule: DrafterSchedule::Fixed { steps: 2 },
            ..SdConfig::default()
        },
        ..TrainerConfig::default()
    }
}
