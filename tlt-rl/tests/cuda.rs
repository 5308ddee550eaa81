//! The trainer with rollouts on a CUDA device (`--features cuda`). Without a driver: the first rollout is an error,
//! not a panic. With one (`TLT_REQUIRE_GPU=1` from `cargo xtask test-cuda --gpu`): greedy evaluation on the GPU
//! agrees with the CPU's, and TLT steps run with the policy's weights synced to the device after every update.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use tlt_kernels::cuda::driver_available;
use tlt_model::{Device, EosTokens, Llama, LlamaConfig};
use tlt_rl::task::{Score, Split};
use tlt_rl::trainer::{Environment, Mode, Prompt, Trainer, TrainerConfig};
use tlt_rl::Result;

/// Prompts of 4 tokens; reward = fraction of token 7 in the answer.
struct Sevens;

impl Environment for Sevens {
    fn prompt(&self, split: Split, pos: u64) -> Result<Prompt> {
        let index = pos + if split == Split::Eval { 1 << 20 } else { 0 };
        Ok(Prompt { index, ids: (0..4).map(|j| 2 + ((index * 5 + j * 3) % 30) as u32).collect(), problem: None })
    }

    fn score(&self, _prompt: &Prompt, completion: &[u32]) -> Result<Score> {
        let reward = completion.iter().filter(|&&t| t == 7).count() as f64 / completion.len().max(1) as f64;
        Ok(Score { reward, correct: reward > 0.5, formatted: true, timed_out: false })
    }
}

fn model() -> Llama {
    let mut cfg = LlamaConfig::tiny(32, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(1));
    Llama::random(cfg, 4).unwrap()
}

fn config(device: Device) -> TrainerConfig {
    TrainerConfig {
        mode: Mode::Tlt,
        prompts_per_step: 4,
        group_size: 4,
        max_new_tokens: 16,
        device,
        ..TrainerConfig::default()
    }
}

#[test]
fn rollouts_on_the_gpu() {
    let mut gpu = Trainer::new(model(), Sevens, config(Device::Cuda(0))).unwrap();
    if !driver_available() {
        let e = gpu.evaluate(0..4, 8).unwrap_err();
        assert!(e.to_string().contains("CUDA is unavailable"), "{e}");
    }
    if !tlt_kernels::cuda::gpu_or_skip("rollouts_on_the_gpu (its GPU part)").unwrap() {
        return;
    }
    let cpu = Trainer::new(model(), Sevens, config(Device::Cpu)).unwrap();
    let (a, b) = (cpu.evaluate(0..16, 16).unwrap(), gpu.evaluate(0..16, 16).unwrap());
    // Greedy on bf16 weights may flip a near-tie; the lengths of 16 answers stay close.
    assert!((a.mean_len - b.mean_len).abs() <= 2.0, "cpu {a:?} gpu {b:?}");
    for _ in 0..2 {
        let r = gpu.step(&mut tlt_rl::trainer::Quiet).unwrap();
        assert_eq!(r.samples.len(), 16);
        assert!(r.samples.iter().all(|(s, _, _)| s.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0)));
    }
}
