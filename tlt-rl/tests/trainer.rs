//! The trainer end to end on a tiny seeded model: GRPO learns a trivially learnable reward, TLT rollouts are
//! lossless (greedy: identical completions and weights; sampling: indistinguishable distributions), and a run
//! killed mid-step resumes bit for bit.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::cell::Cell;
use std::collections::BTreeMap;

use tlt_model::optim::{LrSchedule, ScheduleKind};
use tlt_model::{EosTokens, Llama, LlamaConfig};
use tlt_rl::grpo::{GrpoConfig, MeanLevel};
use tlt_rl::metrics::StepMetrics;
use tlt_rl::task::{Score, Split};
use tlt_rl::trainer::{
    DrafterChoice, DrafterSchedule, Environment, Mode, Prompt, Quiet, SdConfig, Trainer, TrainerConfig, WarmupConfig,
};
use tlt_rl::{Error, Result};
use tlt_scheduler::GateConfig;

const VOCAB: u32 = 32;
/// The token the reward asks for.
const GOOD: u32 = 7;
/// End of sequence of the tiny model.
const EOS: u32 = 1;

fn tiny_model(seed: u64) -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB as usize, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(EOS));
    Llama::random(cfg, seed).unwrap()
}

/// Prompts of 3-6 tokens from the data index; reward = fraction of generated tokens equal to [`GOOD`]. With
/// `fail_at` set, scoring fails once at that prompt index (a crash mid-step).
struct CountEnv {
    fail_at: Cell<Option<u64>>,
}

impl CountEnv {
    fn new() -> Self {
        Self { fail_at: Cell::new(None) }
    }
}

impl Environment for CountEnv {
    fn prompt(&self, split: Split, pos: u64) -> Result<Prompt> {
        let index = match split {
            Split::Train => pos,
            Split::Eval => 1_000_000 + pos,
        };
        let len = 3 + (index % 4) as usize;
        let ids = (0..len).map(|j| 2 + ((index * 7 + j as u64 * 3) % u64::from(VOCAB - 2)) as u32).collect();
        Ok(Prompt { index, ids, problem: None })
    }

    fn score(&self, prompt: &Prompt, completion: &[u32]) -> Result<Score> {
        if self.fail_at.get() == Some(prompt.index) {
            self.fail_at.set(None);
            return Err(Error::InvalidArgument("injected crash".into()));
        }
        let good = completion.iter().filter(|&&t| t == GOOD).count();
        let reward = good as f64 / completion.len().max(1) as f64;
        Ok(Score { reward, correct: reward > 0.5, formatted: true, timed_out: false })
    }
}

fn base_config(mode: Mode) -> TrainerConfig {
    TrainerConfig {
        mode,
        seed: 3,
        prompts_per_step: 8,
        group_size: 4,
        max_new_tokens: 12,
        temperature: 1.0,
        micro_batch_tokens: 64,
        optim: tlt_rl::trainer::OptimConfig {
            schedule: LrSchedule {
                lr: 3e-3,
                warmup_steps: 1,
                total_steps: 0,
                min_lr_ratio: 0.0,
                kind: ScheduleKind::Constant,
            },
            ..Default::default()
        },
        sd: SdConfig {
            // Speculate from the first round so every step exercises SD.
            gate: GateConfig { threshold: 64, on_after: 1, off_threshold: 64, off_after: 1 },
            schedule: DrafterSchedule::Fixed { steps: 2 },
            ..SdConfig::default()
        },
        ..TrainerConfig::default()
    }
}

fn weights(t: &Trainer<CountEnv>) -> BTreeMap<String, Vec<f32>> {
    t.policy()
        .weights()
        .named_tensors()
        .into_iter()
        .map(|(n, w)| (n, w.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// The metrics that do not depend on wall time (the bandit's arms and hence accept lengths do).
fn deterministic(m: &StepMetrics) -> String {
    let mut m = m.clone();
    for x in [
        &mut m.rollout_s,
        &mut m.reward_s,
        &mut m.train_s,
        &mut m.publish_s,
        &mut m.drafter_s,
        &mut m.drafter_after_s,
        &mut m.drafter_prepare_s,
        &mut m.step_s,
    ] {
        *x = 0.0;
    }
    m.plain_arm_steps = 0;
    m.round_tokens.clear();
    m.accept_len = 0.0;
    m.accept_lens.clear();
    m.arms.clear();
    // Wall-clock shares and per-round times.
    m.tail_share = 0.0;
    m.round_seconds.clear();
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
    // Greedy groups are identical: a batch-level baseline keeps the advantages non-zero. The trainer recomputes
    // every log-probability it trains on; the rollout's own (for the IS correction) come from different kernels
    // under SD (verify rows vs decode rows), equal only to rounding, so the correction is off here.
    cfg.grpo = GrpoConfig {
        mean_level: MeanLevel::Batch,
        drop_zero_variance_groups: false,
        tis_cap: None,
        ..GrpoConfig::default()
    };
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

/// Sampled TLT rollouts (T = 1 and 0.7) commit the baseline's tokens with the same seed, for every drafter, so two
/// steps end at the same weights (the IS correction is off: the rollout's own log-probabilities differ between
/// verify and decode forwards by rounding).
#[test]
fn sampled_tlt_commits_the_baselines_tokens_and_weights() {
    for temperature in [1.0, 0.7] {
        let run = |mode: Mode, drafter: DrafterChoice| {
            let mut cfg = base_config(mode);
            cfg.temperature = temperature;
            cfg.sd.drafter = drafter;
            cfg.grpo.tis_cap = None;
            let mut t = Trainer::new(tiny_model(6), CountEnv::new(), cfg).unwrap();
            let mut outs = Vec::new();
            let mut accept = 0.0;
            for _ in 0..2 {
                let r = t.step(&mut Quiet).unwrap();
                accept += r.metrics.accept_len;
                outs.push(r.samples.into_iter().map(|(s, _, _)| s.tokens).collect::<Vec<_>>());
            }
            (outs, weights(&t), accept)
        };
        let (base_outs, base_w, _) = run(Mode::Baseline, DrafterChoice::Ngram);
        for drafter in [DrafterChoice::Ngram, DrafterChoice::Hybrid] {
            let (outs, w, accept) = run(Mode::Tlt, drafter);
            assert!(accept > 2.0, "T={temperature} {drafter:?}: SD barely ran ({accept})");
            assert_eq!(outs, base_outs, "T={temperature} {drafter:?}: completions differ");
            assert!(w == base_w, "T={temperature} {drafter:?}: weights differ");
        }
    }
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

#[test]
fn a_run_killed_mid_step_resumes_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("tlt-rl-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for mode in [Mode::Baseline, Mode::Tlt] {
        // Sampled (T = 1) in both modes: coupled verification makes TLT's tokens independent of the drafts, so the
        // bandit's wall-time choices do not matter. The drafter's buffer keeps only the current step (it is not
        // checkpointed); the drafts it shapes change speed, not tokens.
        let mut cfg = base_config(mode);
        assert_eq!(cfg.temperature, 1.0);
        cfg.sd.buffer.keep_steps = 1;
        let mut full = Trainer::new(tiny_model(2), CountEnv::new(), cfg.clone()).unwrap();
        let full_m: Vec<String> = (0..3).map(|_| deterministic(&full.step(&mut Quiet).unwrap().metrics)).collect();

        let ckpt = dir.join(format!("{mode:?}"));
        let env = CountEnv::new();
        let mut part = Trainer::new(tiny_model(2), env, cfg.clone()).unwrap();
        let mut got = vec![deterministic(&part.step(&mut Quiet).unwrap().metrics)];
        part.save_checkpoint(&ckpt).unwrap();
        // Step 2 crashes while scoring (after its rollout), and the process "dies".
        part.env().fail_at.set(Some(cfg.prompts_per_step as u64 + 3));
        assert!(part.step(&mut Quiet).is_err());
        drop(part);

        let mut resumed = Trainer::resume(&ckpt, tiny_model(2), CountEnv::new(), cfg.clone()).unwrap();
        assert_eq!(resumed.steps_done(), 1);
        got.extend((0..2).map(|_| deterministic(&resumed.step(&mut Quiet).unwrap().metrics)));
        assert_eq!(got, full_m, "{mode:?}: metrics differ after resume");
        assert!(weights(&resumed) == weights(&full), "{mode:?}: weights differ after resume");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Several optimizer steps per RL step (mini-batches x epochs) move the PPO ratio away from 1 so clipping acts;
/// one step (the negative control) keeps it at exactly 1 with nothing clipped.
#[test]
fn ppo_epochs_and_mini_batches_move_the_ratio_and_clip() {
    let mut one = Trainer::new(tiny_model(5), CountEnv::new(), base_config(Mode::Baseline)).unwrap();
    let m = one.step(&mut Quiet).unwrap().metrics;
    assert_eq!((m.optimizer_steps, m.ratio_mean, m.clip_frac), (1, 1.0, 0.0), "{m:?}");

    let mut cfg = base_config(Mode::Baseline);
    cfg.ppo_mini_batch_size = Some(2);
    cfg.ppo_epochs = 3;
    cfg.optim.schedule.lr = 3e-2;
    let mut many = Trainer::new(tiny_model(5), CountEnv::new(), cfg.clone()).unwrap();
    let r = many.step(&mut Quiet).unwrap();
    let m = r.metrics;
    let groups = cfg.prompts_per_step - m.zero_variance_groups;
    let per_epoch = (groups * cfg.group_size).div_ceil(2 * cfg.group_size);
    assert_eq!(m.optimizer_steps, 3 * per_epoch, "{m:?}");
    assert!((m.ratio_mean - 1.0).abs() > 1e-4, "ratio never moved: {}", m.ratio_mean);
    assert!(m.clip_frac > 0.0, "nothing clipped with lr 3e-2 over {} steps", m.optimizer_steps);
    // Deterministic: the same seed gives the same shuffles and weights.
    let mut again = Trainer::new(tiny_model(5), CountEnv::new(), cfg).unwrap();
    again.step(&mut Quiet).unwrap();
    assert!(weights(&again) == weights(&many));
    assert!(TrainerConfig { ppo_epochs: 0, ..TrainerConfig::default() }.validate().is_err());
    assert!(TrainerConfig { ppo_mini_batch_size: Some(0), ..TrainerConfig::default() }.validate().is_err());
    let e = TrainerConfig { top_p: 0.9, ..TrainerConfig::default() }.validate().unwrap_err();
    assert!(e.to_string().contains("tis_cap"), "{e}");
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
