//! The trainer end to end on a tiny seeded model: GRPO learns a trivially learnable reward, TLT rollouts are
//! lossless (greedy and sampled: identical completions and weights with the default settings), a run killed
//! between steps or mid-step resumes exactly (metrics, policy and drafter). The update's guards are in `guards.rs`,
//! scoring overlapped with the rollout in `scoring.rs`.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::collections::BTreeMap;
use std::sync::Mutex;

use tlt_rl::grpo::{GrpoConfig, MeanLevel};
use tlt_rl::metrics::StepMetrics;
use tlt_rl::task::{Score, Split};
use tlt_rl::trainer::{
    DrafterChoice, DrafterSchedule, Environment, Mode, Prompt, Quiet, Trainer, TrainerConfig, WarmupConfig,
};
use tlt_rl::{Error, Result};
use tlt_scheduler::GateConfig;

mod common;

use common::{base_config, count_prompt, count_score, tiny_model};

/// [`count_prompt`]s scored by [`count_score`]. With `fail_at` set, scoring fails once at that prompt index (a crash
/// mid-step).
struct CountEnv {
    fail_at: Mutex<Option<u64>>,
}

impl CountEnv {
    fn new() -> Self {
        Self { fail_at: Mutex::new(None) }
    }
}

impl Environment for CountEnv {
    fn prompt(&self, split: Split, pos: u64) -> Result<Prompt> {
        Ok(count_prompt(split, pos))
    }

    fn score(&self, prompt: &Prompt, completion: &[u32]) -> Result<Score> {
        {
            let mut fail = self.fail_at.lock().unwrap();
            if *fail == Some(prompt.index) {
                *fail = None;
                return Err(Error::InvalidArgument("injected crash".into()));
            }
        }
        Ok(count_score(completion))
    }
}

fn weights(t: &Trainer<CountEnv>) -> BTreeMap<String, Vec<f32>> {
    common::weights(t)
}

/// The metrics that do not depend on wall time. With `arms`, the bandit's choices and what they committed are
/// kept too: they are deterministic when every batch bucket holds one arm (the default bandit), since the SD gate
/// counts running requests, not seconds.
fn timeless(m: &StepMetrics, arms: bool) -> String {
    let mut m = m.clone();
    for x in [
        &mut m.rollout_s,
        &mut m.reward_s,
        &mut m.reward_hidden_s,
        &mut m.reward_wait_s,
        &mut m.train_s,
        &mut m.publish_s,
        &mut m.drafter_s,
        &mut m.drafter_after_s,
        &mut m.drafter_prepare_s,
        &mut m.step_s,
    ] {
        *x = 0.0;
    }
    if !arms {
        m.plain_arm_steps = 0;
        m.round_tokens.clear();
        m.accept_len = 0.0;
        m.accept_lens.clear();
        m.arms.clear();
    }
    // Wall-clock shares and per-round times.
    m.tail_share = 0.0;
    m.round_seconds.clear();
    m.round_end_s.clear();
    serde_json::to_string(&m).unwrap()
}

#[test]
fn grpo_raises_a_trivially_learnable_reward() {
    let cfg = TrainerConfig { prompts_per_step: 8, group_size: 8, ..base_config(Mode::Baseline) };
    let mut t = Trainer::new(tiny_model(11), CountEnv::new(), cfg).unwrap();
    let rewards: Vec<f64> = (0..12).map(|_| t.step(&mut Quiet).unwrap().metrics.reward_mean).collect();
    println!("reward per step: {rewards:.3?}");
    let first = rewards[..2].iter().sum::<f64>() / 2.0;
    let last = rewards[rewards.len() - 2..].iter().sum::<f64>() / 2.0;
    assert!(last > first + 0.3, "reward did not rise: {first:.3} -> {last:.3}");
}

/// Completions, rollout log-probabilities, final weights and metrics of two greedy steps.
struct GreedyRun {
    outs: Vec<Vec<Vec<u32>>>,
    logprobs: Vec<f32>,
    weights: BTreeMap<String, Vec<f32>>,
    metrics: Vec<StepMetrics>,
}

fn greedy_run(mode: Mode, drafters: &[DrafterChoice]) -> GreedyRun {
    let mut cfg = base_config(mode);
    cfg.temperature = 0.0;
    match drafters {
        [one] => cfg.sd.drafter = *one,
        many => cfg.sd.drafters = many.to_vec(),
    }
    // Greedy groups are identical: a batch-level baseline keeps the advantages non-zero.
    cfg.grpo = GrpoConfig { mean_level: MeanLevel::Batch, ..GrpoConfig::default() };
    let mut t = Trainer::new(tiny_model(5), CountEnv::new(), cfg).unwrap();
    let mut run = GreedyRun { outs: Vec::new(), logprobs: Vec::new(), weights: BTreeMap::new(), metrics: Vec::new() };
    for _ in 0..2 {
        let r = t.step(&mut Quiet).unwrap();
        run.outs.push(r.samples.iter().map(|(s, _, _)| s.tokens.clone()).collect());
        run.logprobs.extend(r.samples.iter().flat_map(|(s, _, _)| s.logprobs.iter().copied()));
        run.metrics.push(r.metrics);
    }
    run.weights = weights(&t);
    run
}

#[test]
fn greedy_tlt_equals_baseline_completions_and_weights() {
    let base = greedy_run(Mode::Baseline, &[DrafterChoice::Eagle2]);
    use DrafterChoice::{Eagle2, Hybrid, Ngram, Suffix};
    for drafters in [&[Eagle2][..], &[Ngram], &[Suffix], &[Hybrid], &[Suffix, Ngram, Hybrid]] {
        let run = greedy_run(Mode::Tlt, drafters);
        let drafter = drafters.to_vec();
        let m = &run.metrics;
        let sd: Vec<f64> = m.iter().map(|m| m.sd_on_fraction).collect();
        assert!(sd.iter().all(|&f| f > 0.5), "{drafter:?}: SD was not on: {sd:?}");
        assert_eq!(run.outs, base.outs, "{drafter:?}: completions differ");
        assert!(m.iter().all(|m| m.grad_norm > 0.0), "no update happened");
        for (name, a) in &base.weights {
            assert!(run.weights[name] == *a, "{drafter:?}: weight `{name}` differs after 2 steps");
        }
        if drafter.iter().any(|d| d.has_eagle()) {
            assert!(m[1].drafter_steps > 0, "the online drafter never trained");
        }
        if drafter.len() > 1 {
            // The bandit's arms carry the drafter kind.
            let kinds: std::collections::BTreeSet<&str> =
                m.iter().flat_map(|m| m.arms.keys()).filter_map(|a| a.split('/').next()).collect();
            assert!(kinds.len() >= 2 && kinds.iter().all(|k| ["suffix", "ngram", "hybrid"].contains(k)), "{kinds:?}");
        }
        let diff = run.logprobs.iter().zip(&base.logprobs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("{drafter:?}: rollout log-probabilities differ from plain decoding by at most {diff:e}");
        assert!(diff < 1e-4, "{drafter:?}: rollout log-probabilities differ by {diff}");
    }
}

/// Two-sample Kolmogorov-Smirnov statistic and its asymptotic p-value.
fn ks(a: &[f64], b: &[f64]) -> (f64, f64) {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let (mut i, mut j, mut d) = (0, 0, 0f64);
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / a.len() as f64 - j as f64 / b.len() as f64).abs());
    }
    let n = (a.len() * b.len()) as f64 / (a.len() + b.len()) as f64;
    let lambda = (n.sqrt() + 0.12 + 0.11 / n.sqrt()) * d;
    if lambda < 0.2 {
        // The Kolmogorov series does not converge this close to 0, where the p-value is 1 to 1e-10.
        return (d, 1.0);
    }
    let p = (1..=100).map(|k| 2.0 * (-1f64).powi(k - 1) * (-2.0 * (k as f64 * lambda).powi(2)).exp()).sum::<f64>();
    (d, p.clamp(0.0, 1.0))
}

#[test]
fn ks_test_detects_a_shift() {
    let a: Vec<f64> = (0..300).map(|i| (i % 17) as f64).collect();
    let b: Vec<f64> = (0..300).map(|i| (i % 17) as f64 + 8.0).collect();
    assert!(ks(&a, &b).1 < 1e-6);
    assert!(ks(&a, &a).1 > 0.99);
}

#[test]
fn sampled_tlt_rollouts_match_baseline_distribution() {
    let run = |mode: Mode| {
        let mut cfg = base_config(mode);
        cfg.prompts_per_step = 32;
        cfg.group_size = 8;
        cfg.max_new_tokens = 16;
        cfg.seed = if mode == Mode::Tlt { 100 } else { 200 };
        cfg.sd.gate = GateConfig { threshold: 512, on_after: 1, off_threshold: 512, off_after: 1 };
        // A peakier distribution makes the n-gram drafts of the tiny model's repetitive outputs acceptable.
        cfg.temperature = 0.4;
        cfg.sd.drafter = DrafterChoice::Ngram;
        let mut t = Trainer::new(tiny_model(9), CountEnv::new(), cfg).unwrap();
        let r = t.step(&mut Quiet).unwrap();
        let rewards: Vec<f64> = r.samples.iter().map(|(_, _, x)| *x).collect();
        let lens: Vec<f64> = r.samples.iter().map(|(s, _, _)| s.tokens.len() as f64).collect();
        (rewards, lens, r.metrics)
    };
    let (rb, lb, _) = run(Mode::Baseline);
    let (rt, lt, mt) = run(Mode::Tlt);
    assert!(rb.len() >= 256 && rt.len() >= 256);
    assert!(mt.sd_on_fraction > 0.5 && mt.accept_len > 1.0, "SD did not run: {mt:?}");
    let (dr, pr) = ks(&rb, &rt);
    let (dl, pl) = ks(&lb, &lt);
    println!("rewards: D {dr:.3} p {pr:.3}; lengths: D {dl:.3} p {pl:.3}; accept length {:.2}", mt.accept_len);
    assert!(pr > 0.01 && pl > 0.01, "distributions differ: reward p {pr}, length p {pl}");
}

/// Lossless updates with the default GRPO settings: sampled TLT rollouts (T = 1 and 0.7) commit the baseline's
/// tokens with the same seed, for every drafter, and three steps end at the same weights bit for bit. The drafter
/// trains on the default tail schedule (timing-dependent: it changes drafts, never tokens or the policy). With
/// truncated importance sampling on, the rollout's own log-probabilities enter the loss: they are plain decoding's
/// bits (the verify rows equal the decode rows), so the weights still equal the baseline's. The control: TIS on
/// against off moves the weights (the ratio is 1 only to the rounding between the rollout's and the trainer's
/// forwards), so the comparison would see rollout log-probs that differ in their last bits.
#[test]
fn sampled_tlt_updates_equal_the_baselines_bit_for_bit_with_the_defaults() {
    assert_eq!(GrpoConfig::default().tis_cap, None, "TIS must be off by default");
    let run = |mode: Mode, drafter: DrafterChoice, temperature: f64, tis: Option<f64>| {
        let mut cfg = base_config(mode);
        cfg.temperature = temperature;
        cfg.sd.drafter = drafter;
        cfg.sd.schedule = DrafterSchedule::default();
        cfg.grpo.tis_cap = tis;
        let mut t = Trainer::new(tiny_model(6), CountEnv::new(), cfg).unwrap();
        let mut outs = Vec::new();
        let mut accept = 0.0;
        for _ in 0..3 {
            let r = t.step(&mut Quiet).unwrap();
            accept += r.metrics.accept_len;
            outs.push(r.samples.into_iter().map(|(s, _, _)| s.tokens).collect::<Vec<_>>());
        }
        (outs, weights(&t), accept)
    };
    for temperature in [1.0, 0.7] {
        let (base_outs, base_w, _) = run(Mode::Baseline, DrafterChoice::Ngram, temperature, None);
        for drafter in [DrafterChoice::Ngram, DrafterChoice::Hybrid] {
            let (outs, w, accept) = run(Mode::Tlt, drafter, temperature, None);
            assert!(accept > 3.0, "T={temperature} {drafter:?}: SD barely ran ({accept})");
            assert_eq!(outs, base_outs, "T={temperature} {drafter:?}: completions differ");
            assert!(w == base_w, "T={temperature} {drafter:?}: weights differ");
        }
    }
    // With TIS on, the rollout's log-probabilities enter the loss, and they are the baseline's bits.
    let (base_outs, base_w, _) = run(Mode::Baseline, DrafterChoice::Ngram, 0.7, Some(2.0));
    let (outs, w, accept) = run(Mode::Tlt, DrafterChoice::Ngram, 0.7, Some(2.0));
    assert!(accept > 3.0, "TIS: SD barely ran ({accept})");
    assert_eq!(outs, base_outs);
    assert!(w == base_w, "with TIS the rollout's log-probabilities reached the weights differently");
    let (_, untruncated_w, _) = run(Mode::Baseline, DrafterChoice::Ngram, 0.7, None);
    assert!(untruncated_w != base_w, "control: TIS on and off gave the same weights, so log-probs are not seen");
}

/// Continuous batching: with at most 3 samples running (of 32) the rollout admits the rest as others finish, and
/// since each sample's coins depend only on its id and position, it commits exactly the tokens of the rollout that
/// runs all 32 at once, in both modes; the running batch never exceeds the limit.
#[test]
fn continuous_batching_commits_the_same_tokens_within_the_limit() {
    let run = |mode: Mode, max_running: usize| {
        let mut cfg = base_config(mode);
        cfg.rollout.max_running = max_running;
        let mut t = Trainer::new(tiny_model(6), CountEnv::new(), cfg).unwrap();
        let r = t.step(&mut Quiet).unwrap();
        let tokens: Vec<Vec<u32>> = r.samples.into_iter().map(|(s, _, _)| s.tokens).collect();
        (tokens, r.metrics)
    };
    for mode in [Mode::Baseline, Mode::Tlt] {
        let (all, m_all) = run(mode, 512);
        let (few, m_few) = run(mode, 3);
        assert_eq!(all, few, "{mode:?}: completions differ");
        assert_eq!(few.len(), 32);
        // Fewer running samples: more, smaller rounds.
        assert!(m_few.round_tokens.len() > m_all.round_tokens.len(), "{mode:?}: no more rounds with 3 running");
        if mode == Mode::Baseline {
            // Plain rounds commit one token per running sample: never more than 3.
            assert!(m_few.round_tokens.iter().all(|&t| t <= 3), "{mode:?}: {:?}", m_few.round_tokens);
        }
    }
    let e = TrainerConfig::from_toml("[rollout]\nmax_running = 0\n").unwrap_err();
    assert!(e.to_string().contains("max_running"), "{e}");
}

/// The drafter's state as checkpointed: its trainer's tensors (weights, moments) and its sample buffer.
fn drafter_files(t: &Trainer<CountEnv>, dir: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
    let _ = std::fs::remove_dir_all(dir);
    t.save_checkpoint(dir).unwrap();
    let drafter = dir.join(tlt_rl::trainer::DRAFTER_DIR);
    let mut files = if drafter.exists() { tensor_files(&drafter) } else { BTreeMap::new() };
    if let Ok(b) = std::fs::read(dir.join(tlt_rl::trainer::DRAFTER_BUFFER_FILE)) {
        files.insert("buffer".into(), b);
    }
    files
}

/// A sampled (T = 0.7) run killed between steps, or mid-step (scoring crashes after the rollout fed the drafter's
/// buffer and the bandit), resumes from its last checkpoint to the uninterrupted run's metrics (the bandit's arms
/// and accept lengths included), policy weights and drafter (weights, moments and sample buffer), with the default
/// `keep_steps` (2: the buffer spans steps, so it must be checkpointed). The drafter trains on the deterministic
/// `Fixed` schedule: the default tail schedule trains for as long as the tail lasts in wall time, which no run
/// reproduces. Negative control: a checkpoint whose buffer was emptied resumes to a different drafter.
#[test]
fn a_run_killed_between_or_mid_step_resumes_exactly() {
    let dir = std::env::temp_dir().join(format!("tlt-rl-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for mode in [Mode::Baseline, Mode::Tlt] {
        let mut cfg = base_config(mode);
        cfg.temperature = 0.7;
        assert_eq!(cfg.sd.buffer.keep_steps, tlt_drafter::online::BufferConfig::default().keep_steps);
        assert_eq!(cfg.sd.drafter, DrafterChoice::default());
        assert!(matches!(cfg.sd.schedule, DrafterSchedule::Fixed { .. }));
        let fresh = || Trainer::new(tiny_model(2), CountEnv::new(), cfg.clone()).unwrap();
        let mut full = fresh();
        let full_m: Vec<String> = (0..4).map(|_| timeless(&full.step(&mut Quiet).unwrap().metrics, true)).collect();
        let full_d = drafter_files(&full, &dir.join("full"));
        if mode == Mode::Tlt {
            assert!(full_d.contains_key("buffer") && full_d.len() > 2, "{:?}", full_d.keys().collect::<Vec<_>>());
        }

        // Killed between steps 2 and 3.
        let ckpt = dir.join(format!("{mode:?}-between"));
        let mut part = fresh();
        let mut got: Vec<String> = (0..2).map(|_| timeless(&part.step(&mut Quiet).unwrap().metrics, true)).collect();
        part.save_checkpoint(&ckpt).unwrap();
        drop(part);
        let mut resumed = Trainer::resume(&ckpt, tiny_model(2), CountEnv::new(), cfg.clone()).unwrap();
        assert_eq!(resumed.steps_done(), 2);
        got.extend((0..2).map(|_| timeless(&resumed.step(&mut Quiet).unwrap().metrics, true)));
        assert_eq!(got, full_m, "{mode:?}: metrics differ after a resume between steps");
        assert!(weights(&resumed) == weights(&full), "{mode:?}: policy differs after a resume between steps");
        assert!(drafter_files(&resumed, &dir.join("r1")) == full_d, "{mode:?}: drafter differs (between steps)");

        // Killed mid-step: step 2 crashes while scoring, after its rollout fed the drafter and the bandit.
        let ckpt = dir.join(format!("{mode:?}-mid"));
        let mut part = fresh();
        let mut got = vec![timeless(&part.step(&mut Quiet).unwrap().metrics, true)];
        part.save_checkpoint(&ckpt).unwrap();
        *part.env().fail_at.lock().unwrap() = Some(cfg.prompts_per_step as u64 + 3);
        let e = part.step(&mut Quiet).unwrap_err();
        assert!(e.to_string().contains("injected crash"), "{e}");
        // The failed trainer refuses to go on or to checkpoint a state that is no step boundary.
        assert!(matches!(part.step(&mut Quiet), Err(Error::Stopped(ref why)) if why.contains("step 1 failed")));
        assert!(matches!(part.save_checkpoint(&dir.join("never")), Err(Error::Stopped(_))));
        drop(part);
        let mut resumed = Trainer::resume(&ckpt, tiny_model(2), CountEnv::new(), cfg.clone()).unwrap();
        assert_eq!(resumed.steps_done(), 1);
        got.extend((0..3).map(|_| timeless(&resumed.step(&mut Quiet).unwrap().metrics, true)));
        assert_eq!(got, full_m, "{mode:?}: metrics differ after a resume mid-step");
        assert!(weights(&resumed) == weights(&full), "{mode:?}: policy differs after a resume mid-step");
        assert!(drafter_files(&resumed, &dir.join("r2")) == full_d, "{mode:?}: drafter differs (mid-step)");

        if mode == Mode::Tlt {
            // Negative control: the same checkpoint with its drafter buffer emptied.
            let empty = tlt_drafter::online::OnlineBuffer::new(cfg.sd.buffer).unwrap();
            empty.save(&ckpt.join(tlt_rl::trainer::DRAFTER_BUFFER_FILE)).unwrap();
            let mut r = Trainer::resume(&ckpt, tiny_model(2), CountEnv::new(), cfg.clone()).unwrap();
            for _ in 0..3 {
                r.step(&mut Quiet).unwrap();
            }
            assert!(weights(&r) == weights(&full), "the buffer shapes drafts, never the policy");
            assert!(drafter_files(&r, &dir.join("r3")) != full_d, "an emptied buffer should change the drafter");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Several optimizer steps per RL step (mini-batches x epochs) move the PPO ratio away from 1 so clipping acts;
/// one step (the negative control) keeps it at exactly 1 with nothing clipped.
#[test]
fn ppo_epochs_and_mini_batches_move_the_ratio_and_clip() {
    let mut one = Trainer::new(tiny_model(5), CountEnv::new(), base_config(Mode::Baseline)).unwrap();
    let m = one.step(&mut Quiet).unwrap().metrics;
    assert_eq!((m.optimizer_steps, m.ratio_mean, m.clip_frac, m.ppo_kl), (1, 1.0, 0.0, 0.0), "{m:?}");

    let mut cfg = base_config(Mode::Baseline);
    cfg.ppo_mini_batch_size = Some(2);
    cfg.ppo_epochs = 3;
    cfg.optim.schedule.lr = 3e-2;
    let mut many = Trainer::new(tiny_model(5), CountEnv::new(), cfg.clone()).unwrap();
    let r = many.step(&mut Quiet).unwrap();
    let m = r.metrics;
    // Every group is kept (verl's default): 8 prompts in mini-batches of 2, three epochs.
    assert_eq!(r.update.sequences, cfg.prompts_per_step * cfg.group_size);
    assert_eq!(m.optimizer_steps, 3 * cfg.prompts_per_step / 2, "{m:?}");
    assert!((m.ratio_mean - 1.0).abs() > 1e-4, "ratio never moved: {}", m.ratio_mean);
    assert!(m.ppo_kl.abs() > 1e-6 && m.ppo_kl.is_finite(), "ppo_kl {}", m.ppo_kl);
    assert!(m.clip_frac > 0.0, "nothing clipped with lr 3e-2 over {} steps", m.optimizer_steps);
    // Deterministic: the same seed gives the same shuffles and weights.
    let mut again = Trainer::new(tiny_model(5), CountEnv::new(), cfg).unwrap();
    again.step(&mut Quiet).unwrap();
    assert!(weights(&again) == weights(&many));
    assert!(TrainerConfig { ppo_epochs: 0, ..TrainerConfig::default() }.validate().is_err());
    assert!(TrainerConfig { ppo_mini_batch_size: Some(0), ..TrainerConfig::default() }.validate().is_err());
    let e = TrainerConfig {
        top_p: 0.9,
        grpo: GrpoConfig { tis_cap: Some(2.0), ..GrpoConfig::default() },
        ..TrainerConfig::default()
    }
    .validate()
    .unwrap_err();
    assert!(e.to_string().contains("tis_cap"), "{e}");
    // Mini-batches of equal size: the mini-batch must divide the batch.
    let e = TrainerConfig { prompts_per_step: 8, ppo_mini_batch_size: Some(3), ..TrainerConfig::default() }
        .validate()
        .unwrap_err();
    assert!(e.to_string().contains("ppo_mini_batch_size") && e.to_string().contains("divide"), "{e}");
}

#[test]
fn bad_configs_and_checkpoints_are_clear_errors() {
    let bad = TrainerConfig { group_size: 0, ..TrainerConfig::default() };
    let e = Trainer::new(tiny_model(1), CountEnv::new(), bad).unwrap_err();
    assert!(e.to_string().contains("group_size"), "{e}");
    let e = TrainerConfig::from_toml("[sd]\ndrafters = [\"suffix\", \"hybrid\", \"suffix\"]\n").unwrap_err();
    assert!(e.to_string().contains("sd.drafters") && e.to_string().contains("twice"), "{e}");
    let e = TrainerConfig::from_toml("mode = \"tlt\"\nnot_a_key = 1\n").unwrap_err();
    assert!(e.to_string().contains("not_a_key"), "{e}");
    let cfg = TrainerConfig::from_toml(&TrainerConfig::default().to_toml().unwrap()).unwrap();
    assert_eq!(cfg, TrainerConfig::default());
    // The rollout device: parsed, written back, and a bad name is an error naming it.
    let cfg = TrainerConfig::from_toml("device = \"cuda:1\"\n").unwrap();
    assert_eq!(cfg.device, tlt_model::Device::Cuda(1));
    assert_eq!(TrainerConfig::from_toml(&cfg.to_toml().unwrap()).unwrap(), cfg);
    let e = TrainerConfig::from_toml("device = \"gpu\"\n").unwrap_err();
    assert!(e.to_string().contains("gpu"), "{e}");
    if !cfg!(feature = "cuda") {
        let e = Trainer::new(tiny_model(1), CountEnv::new(), cfg).unwrap_err();
        assert!(e.to_string().contains("no CUDA"), "{e}");
    }
    let missing = std::env::temp_dir().join("tlt-rl-no-such-checkpoint");
    let e = Trainer::resume(&missing, tiny_model(1), CountEnv::new(), TrainerConfig::default()).unwrap_err();
    assert!(matches!(e, Error::Checkpoint { .. }), "{e}");
}

#[test]
fn kl_to_the_reference_and_entropy_bonus_enter_the_update() {
    let mut cfg = base_config(Mode::Baseline);
    cfg.grpo.kl = Some(tlt_rl::grpo::KlConfig { coef: 0.1, estimator: tlt_rl::grpo::KlEstimator::K3 });
    cfg.grpo.entropy_coef = 0.01;
    let mut t = Trainer::new(tiny_model(4), CountEnv::new(), cfg).unwrap();
    let first = t.step(&mut Quiet).unwrap().metrics;
    // Before any update the policy is the reference: KL is 0 (to rounding).
    assert!(first.kl.abs() < 1e-6, "kl {}", first.kl);
    assert!(first.entropy > 0.0, "entropy {}", first.entropy);
    let later: Vec<f64> = (0..3).map(|_| t.step(&mut Quiet).unwrap().metrics.kl).collect();
    assert!(later.iter().all(|&k| k > 0.0 && k.is_finite()), "kl after updates: {later:?}");
}

/// Every `.safetensors` file under `dir`, by relative path.
fn tensor_files(dir: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "safetensors") {
                out.insert(p.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn drafter_warm_up_trains_caches_and_reloads() {
    let root = std::env::temp_dir().join(format!("tlt-rl-warmup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut cfg = base_config(Mode::Tlt);
    cfg.sd.drafter = DrafterChoice::Eagle2;
    cfg.sd.warmup = WarmupConfig {
        prompts: 3,
        samples_per_prompt: 2,
        max_new_tokens: 8,
        max_steps: Some(4),
        cache_dir: Some(root.join("cache")),
        ..WarmupConfig::default()
    };
    let fresh = |seed: u64, cfg: &TrainerConfig| Trainer::new(tiny_model(seed), CountEnv::new(), cfg.clone()).unwrap();
    let drafter_files = |t: &Trainer<CountEnv>, name: &str| {
        let dir = root.join(name);
        t.save_checkpoint(&dir).unwrap();
        tensor_files(&dir.join(tlt_rl::trainer::DRAFTER_DIR))
    };

    // Baseline mode and model-free drafters do nothing.
    assert!(fresh(0, &TrainerConfig { mode: Mode::Baseline, ..cfg.clone() })
        .warm_up_drafter(&mut Quiet)
        .unwrap()
        .is_none());
    let mut suffix = cfg.clone();
    suffix.sd.drafter = DrafterChoice::Suffix;
    assert!(fresh(0, &suffix).warm_up_drafter(&mut Quiet).unwrap().is_none());

    let cold = drafter_files(&fresh(0, &cfg), "cold");
    let mut a = fresh(0, &cfg);
    let ra = a.warm_up_drafter(&mut Quiet).unwrap().unwrap();
    assert!(!ra.cached && ra.samples == 6 && ra.tokens > 0 && ra.steps == 4, "{ra:?}");
    assert!(ra.loss[0].is_finite() && ra.loss[1].is_finite());
    let warm = drafter_files(&a, "a");
    assert_eq!(warm.keys().collect::<Vec<_>>(), cold.keys().collect::<Vec<_>>());
    assert_ne!(warm, cold, "the warm-up changed nothing");

    // The same policy, prompts and settings: loaded from the cache, the same weights.
    let mut b = fresh(0, &cfg);
    let rb = b.warm_up_drafter(&mut Quiet).unwrap().unwrap();
    assert!(rb.cached && rb.key == ra.key && rb.steps == 0, "{rb:?}");
    assert_eq!(drafter_files(&b, "b"), warm);

    // Another policy or other settings: another key, trained anew.
    let rc = fresh(1, &cfg).warm_up_drafter(&mut Quiet).unwrap().unwrap();
    assert!(!rc.cached && rc.key != ra.key);
    let mut longer = cfg.clone();
    longer.sd.warmup.max_steps = Some(5);
    let rd = fresh(0, &longer).warm_up_drafter(&mut Quiet).unwrap().unwrap();
    assert!(!rd.cached && rd.key != ra.key && rd.steps == 5);

    // After the first step there is nothing to warm up.
    let mut e = fresh(0, &cfg);
    e.step(&mut Quiet).unwrap();
    assert!(e.warm_up_drafter(&mut Quiet).unwrap().is_none());

    // A warmed-up TLT run stays lossless: greedy completions equal the baseline's.
    let greedy = |mode: Mode| {
        let c = TrainerConfig { mode, temperature: 0.0, ..cfg.clone() };
        let mut t = fresh(0, &c);
        t.warm_up_drafter(&mut Quiet).unwrap();
        t.step(&mut Quiet).unwrap().samples.into_iter().map(|(s, _, _)| s.tokens).collect::<Vec<_>>()
    };
    assert_eq!(greedy(Mode::Tlt), greedy(Mode::Baseline));
    let _ = std::fs::remove_dir_all(&root);
}
