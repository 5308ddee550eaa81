//! The update's guards on a tiny seeded model: a non-finite gradient norm skips the optimizer step, a group of one
//! answer trains as verl trains it, dynamic sampling fills the batch with informative groups (and stops at its
//! bound), equal-reward groups are kept by default and cost no compute.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use common::{base_config, count_score, fn_env, tiny_model, weights};
use tlt_rl::task::Score;
use tlt_rl::trainer::{DynamicSampling, Mode, Quiet, Trainer, TrainerConfig};

/// Rewards so large that the loss overflows f32 (advantages of about ±1e300 without std normalisation): the gradient
/// norm is not finite, the optimizer step is skipped and counted, and the weights stay exactly as they were
/// (before the fix AdamW ran with a NaN or infinite norm and wrote NaN into every weight); the step's loss statistics
/// leave it out and its `grad_norm` is NaN.
#[test]
fn a_non_finite_gradient_norm_skips_the_step_and_leaves_the_weights() {
    let env = fn_env(|_, c: &[u32]| {
        let s = count_score(c);
        Score { reward: if s.reward > 0.0 { 1e300 } else { 0.0 }, ..s }
    });
    let mut cfg = base_config(Mode::Baseline);
    cfg.grpo.std_norm = false;
    cfg.group_size = 8;
    let mut t = Trainer::new(tiny_model(3), env, cfg).unwrap();
    let before = weights(&t);
    let r = t.step(&mut Quiet).unwrap();
    let m = &r.metrics;
    assert!(m.informative_groups > 0, "no group had reward variance: the test needs one ({m:?})");
    assert_eq!((m.optimizer_steps, m.skipped_optimizer_steps), (0, 1), "{m:?}");
    // The skipped step's loss is left out of the step's statistics (it merged a NaN before), and the gradient norm
    // says that no finite one was seen (it read 0 before).
    assert!(m.loss.is_finite() && m.pg_loss.is_finite(), "{m:?}");
    assert!(m.grad_norm.is_nan(), "{m:?}");
    let after = weights(&t);
    assert!(after.values().flatten().all(|x| x.is_finite()), "non-finite weights");
    assert!(after == before, "a skipped step moved the weights");
    // The run goes on.
    t.step(&mut Quiet).unwrap();
}

/// `group_size = 1`: verl's mean 0 and std 1, so each answer's advantage is its reward and the policy learns
/// (before, every group of one had advantage 0 and was dropped: no update ever happened).
#[test]
fn groups_of_one_answer_train_as_verl_does() {
    let cfg = TrainerConfig { group_size: 1, prompts_per_step: 16, ..base_config(Mode::Baseline) };
    let mut t = Trainer::new(tiny_model(5), fn_env(|_, c: &[u32]| count_score(c)), cfg).unwrap();
    let before = weights(&t);
    let r = t.step(&mut Quiet).unwrap();
    assert_eq!(r.update.sequences, 16);
    assert!(r.metrics.optimizer_steps == 1 && r.metrics.grad_norm > 0.0, "{:?}", r.metrics);
    assert_eq!(r.metrics.zero_variance_groups, 0);
    assert!(weights(&t) != before, "a group of one must train");
    // Dynamic sampling needs variance inside a group: refused with a clear error.
    let cfg = TrainerConfig {
        group_size: 1,
        dynamic_sampling: Some(DynamicSampling::default()),
        ..base_config(Mode::Baseline)
    };
    let e = cfg.validate().unwrap_err();
    assert!(e.to_string().contains("group_size"), "{e}");
}

/// Prompts of odd data index always score 0 (their groups carry no signal); even ones score the fraction of
/// good tokens. By default every group is kept (verl): the update trains on all 32 answers. With dynamic
/// sampling the odd groups are set aside and a second rollout of 8 more prompts fills the batch with 8
/// informative groups; bounded to one rollout, the step trains on the informative groups it has.
#[test]
fn dynamic_sampling_fills_the_batch_with_informative_groups() {
    let reward = |index: u64, c: &[u32]| if index % 2 == 1 { Score::ZERO } else { count_score(c) };

    let mut keep = Trainer::new(tiny_model(7), fn_env(reward), base_config(Mode::Baseline)).unwrap();
    let r = keep.step(&mut Quiet).unwrap();
    assert_eq!((r.update.sequences, r.metrics.gen_batches), (32, 1));
    assert!(r.metrics.zero_variance_groups >= 4, "odd prompts are zero-variance: {:?}", r.metrics);

    let cfg =
        TrainerConfig { dynamic_sampling: Some(DynamicSampling { max_gen_batches: 4 }), ..base_config(Mode::Baseline) };
    let mut dyn_t = Trainer::new(tiny_model(7), fn_env(reward), cfg.clone()).unwrap();
    let r = dyn_t.step(&mut Quiet).unwrap();
    let m = &r.metrics;
    assert!(m.gen_batches >= 2, "one rollout cannot hold 8 informative groups: {m:?}");
    assert_eq!(m.informative_groups, 8, "{m:?}");
    assert_eq!(r.update.sequences, 8 * 4, "exactly a batch of informative groups is trained on");
    assert_eq!(m.samples, m.gen_batches * 32);
    assert!(m.samples / 4 - m.zero_variance_groups >= 8, "found fewer informative groups than it trained on: {m:?}");
    // The next step draws after every prompt this one used (the data position moved by whole rollouts).
    let r2 = dyn_t.step(&mut Quiet).unwrap();
    assert_eq!(r2.samples[0].0.prompt, common::count_prompt(tlt_rl::task::Split::Train, 8 * m.gen_batches as u64).ids);

    // Bounded to one rollout: trains on the informative groups found.
    let cfg = TrainerConfig { dynamic_sampling: Some(DynamicSampling { max_gen_batches: 1 }), ..cfg };
    let mut bounded = Trainer::new(tiny_model(7), fn_env(reward), cfg).unwrap();
    let r = bounded.step(&mut Quiet).unwrap();
    assert_eq!(r.metrics.gen_batches, 1);
    assert!(r.metrics.informative_groups < 8 && r.metrics.informative_groups > 0, "{:?}", r.metrics);
    assert_eq!(r.update.sequences, r.metrics.informative_groups * 4);
}

/// Groups whose rewards are all equal are kept (verl) but cost no forward or backward: their answers' advantage is 0,
/// so with no KL or entropy term they add exactly nothing to the gradient and only count in the token-mean divisor.
/// The weights equal, to float rounding, those of a run that does compute them (a KL term with coefficient 0 makes
/// every answer contribute), with fewer micro-batches; a step where no answer contributes still takes its optimizer
/// step with zero gradients (AdamW's weight decay acts), as verl's would.
#[test]
fn equal_reward_groups_count_in_the_divisor_at_no_compute() {
    // Odd prompts always score 0: their groups have equal rewards.
    let reward = |index: u64, c: &[u32]| if index % 2 == 1 { Score::ZERO } else { count_score(c) };
    let run = |kl: bool| {
        let mut cfg = base_config(Mode::Baseline);
        cfg.micro_batch_tokens = 32;
        if kl {
            cfg.grpo.kl = Some(tlt_rl::grpo::KlConfig { coef: 0.0, ..Default::default() });
        }
        let mut t = Trainer::new(tiny_model(7), fn_env(reward), cfg).unwrap();
        let r = t.step(&mut Quiet).unwrap();
        (weights(&t), r)
    };
    let (skip, rs) = run(false);
    let (all, ra) = run(true);
    assert!(rs.metrics.zero_variance_groups >= 4, "{:?}", rs.metrics);
    assert_eq!(rs.update.sequences, ra.update.sequences);
    assert!(
        rs.update.micro_batches < ra.update.micro_batches,
        "{} vs {}",
        rs.update.micro_batches,
        ra.update.micro_batches
    );
    let mut worst = 0f32;
    for (name, a) in &skip {
        for (x, y) in a.iter().zip(&all[name]) {
            worst = worst.max((x - y).abs() / x.abs().max(1e-3));
        }
    }
    println!("skipping zero-advantage answers: weights within {worst:e} (relative) of computing them");
    assert!(worst < 1e-4, "weights differ by {worst} relative");
    assert!(skip != weights(&Trainer::new(tiny_model(7), fn_env(reward), base_config(Mode::Baseline)).unwrap()));

    // Every answer scores 0: no answer contributes, and the optimizer step still happens (weight decay).
    let mut t = Trainer::new(tiny_model(7), fn_env(|_, _: &[u32]| Score::ZERO), base_config(Mode::Baseline)).unwrap();
    let before = weights(&t);
    let r = t.step(&mut Quiet).unwrap();
    assert_eq!((r.metrics.optimizer_steps, r.update.micro_batches), (1, 0), "{:?}", r.update);
    assert!(weights(&t) != before, "a zero-gradient AdamW step still decays the weights");
}
