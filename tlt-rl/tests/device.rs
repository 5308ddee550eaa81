//! The trainer with rollouts on a device. On the device the environment gives (in CI the simulated device,
//! `tlt-cuda-sim`'s `SimGpu`, through [`Trainer::with_gpu`]; on a GPU machine the CUDA device): TLT steps (the SD
//! gate, the bandit, suffix + EAGLE-2 drafting with the drafter's forward on the device, verification on the
//! device) sample exactly the baseline's tokens, step after step, and with the policy update on the device too
//! (its default) TLT's updated weights equal the baseline's bit for bit. With the `cuda` feature: without a driver the first rollout is an error, not a panic; with
//! one (`TLT_REQUIRE_GPU=1`), greedy evaluation on the GPU agrees with the CPU's.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use tlt_cuda_sim::Schedule;
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

/// The policy's weights, flattened in parameter order.
fn weights<E: tlt_rl::trainer::Environment>(t: &Trainer<E>) -> Vec<f32> {
    t.policy()
        .weights()
        .named_tensors()
        .iter()
        .flat_map(|(_, w)| w.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

/// TLT and baseline trainers from the same weights and seeds, rollouts and the policy update on `gpu` (the
/// default with rollouts on a device): every step samples the same tokens (SD is lossless through the scheduler
/// and the trainer on the device), TLT drafted (some rounds speculative), and the updated policies are equal bit
/// for bit. A baseline with the update on the CPU ends with other weights: the device update ran.
fn tlt_equals_baseline_on(gpu: tlt_kernels::cuda::SharedGpu) {
    let run = |mode: Mode, update_on_device: bool| {
        let cfg = TrainerConfig { mode, update_on_device, ..config(Device::Cpu) };
        let mut t = Trainer::new(model(), Sevens, cfg).unwrap().with_gpu(gpu.clone());
        let steps = (0..2)
            .map(|_| {
                let r = t.step(&mut tlt_rl::trainer::Quiet).unwrap();
                assert_eq!(r.update.optimizer_steps, 1, "one optimizer step per RL step");
                let tokens: Vec<Vec<u32>> = r.samples.iter().map(|(s, _, _)| s.tokens.clone()).collect();
                (tokens, r.metrics.sd_on_fraction, r.metrics.accept_len)
            })
            .collect::<Vec<_>>();
        (steps, weights(&t))
    };
    let ((tlt, tlt_w), (base, base_w)) = (run(Mode::Tlt, true), run(Mode::Baseline, true));
    for (k, ((t, sd_on, accept), (b, _, _))) in tlt.iter().zip(&base).enumerate() {
        println!("{}: step {k}: SD on for {sd_on:.2} of rounds, {accept:.2} tokens per round", gpu.info().name);
        assert_eq!(t, b, "{}: step {k}: TLT sampled other tokens than the baseline", gpu.info().name);
    }
    assert!(tlt.iter().any(|(_, sd_on, _)| *sd_on > 0.0), "no speculative round ran: the test proves nothing");
    let same = tlt_w.iter().zip(&base_w).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same && tlt_w.len() == base_w.len(),
        "{}: TLT's updated policy differs from the baseline's",
        gpu.info().name
    );
    assert_ne!(
        tlt_w,
        weights(&Trainer::new(model(), Sevens, config(Device::Cpu)).unwrap()),
        "the updates changed nothing"
    );
    let (_, host_w) = run(Mode::Baseline, false);
    assert_ne!(host_w, base_w, "the CPU update gave the device update's bits: did the device update run?");
}

#[test]
fn tlt_rollouts_on_the_device_sample_the_baselines_tokens() {
    let test = "tlt_rollouts_on_the_device_sample_the_baselines_tokens";
    for gpu in tlt_cuda_sim::test_devices(test, &[Schedule::Lazy, Schedule::Seeded(21)]).unwrap() {
        tlt_equals_baseline_on(gpu);
    }
}

/// A run with the update on the device, checkpointed after its first step and resumed (the device trainer rebuilt
/// from the checkpoint's f32 weights and moments), ends with the uninterrupted run's weights, bit for bit.
fn resume_on(gpu: tlt_kernels::cuda::SharedGpu) {
    let cfg = TrainerConfig { mode: Mode::Baseline, ..config(Device::Cpu) };
    let mut straight = Trainer::new(model(), Sevens, cfg.clone()).unwrap().with_gpu(gpu.clone());
    for _ in 0..2 {
        straight.step(&mut tlt_rl::trainer::Quiet).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("tlt-device-resume-{}", std::process::id()));
    let mut first = Trainer::new(model(), Sevens, cfg.clone()).unwrap().with_gpu(gpu.clone());
    first.step(&mut tlt_rl::trainer::Quiet).unwrap();
    first.save_checkpoint(&dir).unwrap();
    drop(first);
    let mut resumed = Trainer::resume(&dir, model(), Sevens, cfg).unwrap().with_gpu(gpu.clone());
    resumed.step(&mut tlt_rl::trainer::Quiet).unwrap();
    let (a, b) = (weights(&straight), weights(&resumed));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "{}: the resumed run's weights differ",
        gpu.info().name
    );
}

#[test]
fn a_device_updated_run_resumes_exactly() {
    let test = "a_device_updated_run_resumes_exactly";
    for gpu in tlt_cuda_sim::test_devices(test, &[Schedule::Seeded(5)]).unwrap() {
        resume_on(gpu);
    }
}

/// After a device update the host mirrors only the f32 weights (4 bytes per weight), not the moments: a step's
/// device-to-host traffic stays under 8 bytes per weight, where the weights and both moments were 12 (counted by
/// the simulated device); a checkpoint then reads the moments from the device (`a_device_updated_run_resumes_exactly`
/// resumes bit for bit from them).
#[test]
fn a_device_step_copies_the_weights_to_the_host_not_the_moments() {
    let sim = tlt_cuda_sim::SimGpu::new(Schedule::Lazy);
    let gpu: tlt_kernels::cuda::SharedGpu = std::sync::Arc::new(sim.clone());
    let cfg = TrainerConfig { mode: Mode::Baseline, ..config(Device::Cpu) };
    let mut t = Trainer::new(model(), Sevens, cfg).unwrap().with_gpu(gpu);
    let params = t.policy().weights().num_params() as u64;
    t.step(&mut tlt_rl::trainer::Quiet).unwrap();
    let before = sim.downloaded_bytes();
    let r = t.step(&mut tlt_rl::trainer::Quiet).unwrap();
    assert!(r.metrics.grad_norm > 0.0, "the second step updated nothing");
    let per_weight = (sim.downloaded_bytes() - before) as f64 / params as f64;
    println!("a device step downloads {per_weight:.2} bytes per weight ({params} weights)");
    assert!((4.0..8.0).contains(&per_weight), "{per_weight:.2} bytes per weight to the host in one step");
}

#[cfg(feature = "cuda")]
#[test]
fn rollouts_on_the_gpu() {
    let mut gpu = Trainer::new(model(), Sevens, config(Device::Cuda(0))).unwrap();
    if !tlt_kernels::cuda::driver_available() {
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

/// The device memory plan names every part a device run holds, and a run too large for the device is refused
/// before its first rollout, with the plan in the error.
#[test]
fn the_device_memory_plan_is_checked_before_the_first_rollout() {
    let gpu = tlt_cuda_sim::test_devices("the_device_memory_plan", &[Schedule::Lazy]).unwrap().remove(0);
    let cpu = Trainer::new(model(), Sevens, config(Device::Cpu)).unwrap();
    assert!(cpu.device_memory_plan().is_none(), "rollouts on the CPU plan no device memory");
    let t = Trainer::new(model(), Sevens, config(Device::Cpu)).unwrap().with_gpu(gpu.clone());
    let plan = t.device_memory_plan().unwrap();
    let params = t.policy().weights().num_params() as u64;
    assert_eq!(plan.policy_weights, 2 * params);
    assert_eq!(plan.optimizer, 16 * params, "f32 master weights, two moments and gradients");
    assert!(plan.kv_cache > 0 && plan.graph_pool > 0 && plan.activations > 0 && plan.drafter > 0, "{plan:?}");
    assert_eq!(plan.reference, 0, "no KL term, no reference");
    // The same plan from the config alone (what `cargo xtask memory` prints), the drafter's bytes given.
    let cfg = t.policy().config();
    assert_eq!(tlt_rl::trainer::weight_count(cfg).unwrap(), params);
    let from_config = tlt_rl::trainer::DeviceMemoryPlan::new(cfg, params, &config(Device::Cpu), plan.drafter);
    assert_eq!(from_config, plan);
    let longer = TrainerConfig { max_prompt_tokens: 4096, ..config(Device::Cpu) };
    let longer = tlt_rl::trainer::DeviceMemoryPlan::new(cfg, params, &longer, plan.drafter);
    assert!(longer.kv_cache > plan.kv_cache && longer.activations > plan.activations, "the prompt room is planned");
    let host = TrainerConfig { update_on_device: false, ..config(Device::Cpu) };
    let p = Trainer::new(model(), Sevens, host).unwrap().with_gpu(gpu.clone()).device_memory_plan().unwrap();
    assert_eq!((p.optimizer, p.activations), (0, 0), "the update on the CPU holds nothing on the device");
    // Far more sequences than the device holds: refused before the first rollout.
    let huge = TrainerConfig { prompts_per_step: 1 << 16, group_size: 64, ..config(Device::Cpu) };
    let mut big = Trainer::new(model(), Sevens, huge).unwrap().with_gpu(gpu);
    let e = big.step(&mut tlt_rl::trainer::Quiet).unwrap_err().to_string();
    assert!(e.contains("KV cache") && e.contains("device memory"), "{e}");
}

/// With rollouts on a device a prompt longer than `max_prompt_tokens` (the room the caches reserve) is an error
/// naming the field, not a failure inside the drafter's forward; at its length it runs. A Qwen3 policy with the
/// update on the device (its q/k head norms have no device backward) is refused before the first rollout.
#[test]
fn prompts_past_the_room_and_untrainable_models_are_refused_before_the_rollout() {
    let gpu = tlt_cuda_sim::test_devices("prompts_past_the_room", &[Schedule::Lazy]).unwrap().remove(0);
    let run = |room: usize| {
        let cfg = TrainerConfig { max_prompt_tokens: room, steps: 1, ..config(Device::Cpu) };
        Trainer::new(model(), Sevens, cfg).unwrap().with_gpu(gpu.clone()).step(&mut tlt_rl::trainer::Quiet).map(|_| ())
    };
    let e = run(3).unwrap_err().to_string();
    assert!(e.contains("max_prompt_tokens") && e.contains("4 tokens"), "{e}");
    run(4).unwrap();
    let mut q3 = model().config().clone();
    q3.model_type = "qwen3".into();
    let mut t = Trainer::new(Llama::random(q3, 4).unwrap(), Sevens, config(Device::Cpu)).unwrap().with_gpu(gpu);
    let e = t.step(&mut tlt_rl::trainer::Quiet).unwrap_err().to_string();
    assert!(e.contains("update_on_device") && e.contains("q/k head norms"), "{e}");
}

/// The device update against the CPU's on the same rollouts, with every term the device path maps back to rows: a
/// KL term (the reference's forward on the device), an entropy bonus (its gradient through the device's entropy),
/// two mini-batches over two epochs (the old log-probabilities from a device forward). Their statistics agree within
/// bf16 tolerance (measured on the simulated device: entropy 0.5%, pg_loss 0.1%, KL 1.6%, ratio 0.2%, grad norm 2.1%
/// apart); the weights differ (the device path ran).
fn device_update_matches_cpu_on(gpu: tlt_kernels::cuda::SharedGpu) {
    let mut cfg =
        TrainerConfig { mode: Mode::Baseline, ppo_mini_batch_size: Some(2), ppo_epochs: 2, ..config(Device::Cpu) };
    cfg.grpo.kl = Some(tlt_rl::grpo::KlConfig { coef: 0.1, ..Default::default() });
    cfg.grpo.entropy_coef = 0.01;
    cfg.optim.schedule = tlt_model::optim::LrSchedule::constant(1e-4);
    let run = |update_on_device: bool| {
        let c = TrainerConfig { update_on_device, ..cfg.clone() };
        let mut t = Trainer::new(model(), Sevens, c).unwrap().with_gpu(gpu.clone());
        let r = t.step(&mut tlt_rl::trainer::Quiet).unwrap();
        let tokens: Vec<Vec<u32>> = r.samples.iter().map(|(s, _, _)| s.tokens.clone()).collect();
        (tokens, r.update, weights(&t))
    };
    let ((ta, a, wa), (tb, b, wb)) = (run(true), run(false));
    assert_eq!(ta, tb, "the same device rollouts");
    assert_eq!((a.optimizer_steps, a.micro_batches), (b.optimizer_steps, b.micro_batches));
    assert_eq!(a.optimizer_steps, 4, "two mini-batches over two epochs");
    let close = |what: &str, x: f64, y: f64, rel: f64| {
        println!("{}: {what}: device {x:.6e}, CPU {y:.6e}", gpu.info().name);
        assert!((x - y).abs() <= rel * x.abs().max(y.abs()) + 1e-6, "{what}: device {x}, CPU {y}");
    };
    close("entropy", a.loss.entropy, b.loss.entropy, 0.02);
    close("pg_loss", a.loss.pg_loss, b.loss.pg_loss, 0.05);
    close("kl", a.loss.kl, b.loss.kl, 0.2);
    close("ratio_mean", a.loss.ratio_mean, b.loss.ratio_mean, 0.01);
    close("grad_norm", a.grad_norm, b.grad_norm, 0.05);
    assert!(a.loss.kl > 0.0 && b.loss.kl > 0.0, "the KL term was exercised");
    assert_ne!(wa, wb, "the device and CPU updates gave the same bits: did the device update run?");
}

#[test]
fn the_device_update_matches_the_cpus_with_kl_entropy_and_epochs() {
    let test = "the_device_update_matches_the_cpus_with_kl_entropy_and_epochs";
    for gpu in tlt_cuda_sim::test_devices(test, &[Schedule::Seeded(9)]).unwrap() {
        device_update_matches_cpu_on(gpu);
    }
}
