//! Rewards overlapped with the rollout: answers are scored as they finish, on worker threads, so a slow verifier's
//! time hides behind decoding; a hung verifier costs its deadline, never the step; a panicking one is an error.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::time::{Duration, Instant};

use common::{base_config, count_score, fn_env, tiny_model, FnEnv};
use tlt_rl::task::Score;
use tlt_rl::trainer::{Mode, Quiet, ScoringConfig, StepReport, Trainer, TrainerConfig};
use tlt_rl::Error;

/// 32 answers of up to 64 tokens admitted 4 at a time, so answers finish throughout the rollout (continuous
/// batching), as a long-tail rollout's do.
fn waves(workers: usize) -> TrainerConfig {
    let mut cfg = base_config(Mode::Baseline);
    cfg.max_new_tokens = 64;
    cfg.micro_batch_tokens = 256;
    cfg.rollout.max_running = 4;
    cfg.scoring = ScoringConfig { workers, ..ScoringConfig::default() };
    cfg
}

fn one_step(cfg: TrainerConfig, delay: Duration) -> StepReport {
    let env = FnEnv { reward: |_, c: &[u32]| count_score(c), delay, hang: None };
    // A wider, deeper tiny model, so the rollout lasts long enough to hide a verifier behind it.
    let mut model = tlt_model::LlamaConfig::tiny(common::VOCAB as usize, 128, 4);
    model.eos_token_id = Some(tlt_model::EosTokens::One(common::EOS));
    let policy = tlt_model::Llama::random(model, 8).unwrap();
    Trainer::new(policy, env, cfg).unwrap().step(&mut Quiet).unwrap()
}

/// The generation part of a step: the rollout plus the wait for rewards after it.
fn generation_s(r: &StepReport) -> f64 {
    r.metrics.rollout_s + r.metrics.reward_wait_s
}

/// A slow verifier (a sleep per answer, sized so that scoring every answer takes as long as the rollout) on one
/// worker: the step's generation takes about max(rollout, rewards), not their sum as when every answer is scored
/// after the rollout (`workers = 0`). Same rewards either way.
#[test]
fn a_slow_verifier_hides_behind_decoding() {
    let rollout = (0..3).map(|_| one_step(waves(1), Duration::ZERO).metrics.rollout_s).fold(f64::INFINITY, f64::min);
    let delay = Duration::from_secs_f64((rollout / 32.0).clamp(0.0005, 0.05));
    let mut pairs = Vec::new();
    for _ in 0..3 {
        let serial = one_step(waves(0), delay);
        let overlapped = one_step(waves(1), delay);
        let rs = |r: &StepReport| r.samples.iter().map(|(_, _, x)| *x).collect::<Vec<_>>();
        assert_eq!(rs(&serial), rs(&overlapped), "scoring order changed the rewards");
        pairs.push((serial, overlapped));
    }
    for (s, o) in &pairs {
        let (ms, mo) = (&s.metrics, &o.metrics);
        println!(
            "delay {:.1} ms: serial rollout {:.3} s + rewards {:.3} s = {:.3} s; overlapped rollout {:.3} s, \
             rewards {:.3} s ({:.0}% hidden), generation {:.3} s",
            delay.as_secs_f64() * 1e3,
            ms.rollout_s,
            ms.reward_wait_s,
            generation_s(s),
            mo.rollout_s,
            mo.reward_s,
            100.0 * mo.reward_hidden_s / mo.reward_s.max(1e-9),
            generation_s(o),
        );
        assert!(ms.reward_hidden_s == 0.0 && ms.reward_wait_s >= 0.9 * 32.0 * delay.as_secs_f64(), "{ms:?}");
        assert!(mo.reward_s >= 0.9 * 32.0 * delay.as_secs_f64());
    }
    // The median pair: overlapped generation within 40% of max(rollout, rewards) (the last wave's rewards, an
    // eighth of them, can only start when it finishes).
    let mut to_max: Vec<f64> =
        pairs.iter().map(|(_, o)| generation_s(o) / o.metrics.rollout_s.max(o.metrics.reward_s)).collect();
    to_max.sort_by(f64::total_cmp);
    // Well under the sum, measured two ways that a loaded machine cannot fake: within one step (its generation
    // against its own rollout plus its rewards, the serial cost of the same work), and across steps by the fastest
    // of each kind (load only adds time). The median of per-pair ratios was asserted until a CI run on a loaded
    // 2-core machine decoded one serial step 1.6x faster than its overlapped twin (0.153 s against 0.247 s): 0.86.
    let mut to_own_sum: Vec<f64> =
        pairs.iter().map(|(_, o)| generation_s(o) / (o.metrics.rollout_s + o.metrics.reward_s)).collect();
    to_own_sum.sort_by(f64::total_cmp);
    let fastest = |f: fn(&(StepReport, StepReport)) -> &StepReport| {
        pairs.iter().map(|p| generation_s(f(p))).fold(f64::INFINITY, f64::min)
    };
    let to_serial = fastest(|p| &p.1) / fastest(|p| &p.0);
    println!(
        "median: overlapped / max(rollout, rewards) = {:.2}; overlapped / (its rollout + its rewards) = {:.2}; \
         fastest overlapped / fastest serial = {to_serial:.2}",
        to_max[1], to_own_sum[1]
    );
    assert!(to_max[1] < 1.4, "overlapped generation is {:.2}x max(rollout, rewards)", to_max[1]);
    assert!(to_own_sum[1] < 0.8, "overlapped generation is {:.2}x its rollout plus its rewards", to_own_sum[1]);
    assert!(to_serial < 0.8, "the fastest overlapped generation is {to_serial:.2}x the fastest serial one");
    // The median pair's share of hidden reward time (the smallest of the three was asserted until a CI run on a
    // loaded 2-core machine decoded one step twice as fast as the others and hid 32% behind it, 86-88% in the
    // other two pairs; the medians above already set the bar).
    let mut hidden: Vec<f64> = pairs.iter().map(|(_, o)| o.metrics.reward_hidden_s / o.metrics.reward_s).collect();
    hidden.sort_by(f64::total_cmp);
    assert!(hidden[1] > 0.5, "only {:.0}% of the reward time was hidden (median pair)", 100.0 * hidden[1]);
}

/// A verifier that hangs on one prompt's answers: each costs its deadline on a worker, which is then replaced; the
/// step finishes with those answers scored as timed out (reward 0) and counted.
#[test]
fn a_hung_verifier_costs_its_deadline_not_the_step() {
    let mut cfg = base_config(Mode::Baseline);
    cfg.scoring = ScoringConfig { workers: 2, timeout_s: 0.3 };
    let env = FnEnv { reward: |_, c: &[u32]| count_score(c), delay: Duration::ZERO, hang: Some(3) };
    let mut t = Trainer::new(tiny_model(8), env, cfg.clone()).unwrap();
    let t0 = Instant::now();
    let r = t.step(&mut Quiet).unwrap();
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(r.metrics.reward_timeouts, cfg.group_size, "{:?}", r.metrics);
    for (s, score, reward) in &r.samples {
        let hung = s.group == 3;
        assert_eq!(score.timed_out, hung);
        if hung {
            assert_eq!((*score, *reward), (Score::TIMED_OUT, 0.0));
        }
    }
    assert!(secs < 20.0, "the step took {secs:.1} s");
    // The pool replaced its workers: the next step scores normally (prompt 3 is not in it).
    let r = t.step(&mut Quiet).unwrap();
    assert_eq!(r.metrics.reward_timeouts, 0);
}

/// A verifier that panics is an error of the step (the trainer stops), not a crash of the process.
#[test]
fn a_panicking_verifier_is_an_error() {
    let env = fn_env(|index, c: &[u32]| if index == 2 { panic!("verifier bug") } else { count_score(c) });
    let mut t = Trainer::new(tiny_model(8), env, base_config(Mode::Baseline)).unwrap();
    let e = t.step(&mut Quiet).unwrap_err();
    assert!(e.to_string().contains("panicked") && e.to_string().contains("verifier bug"), "{e}");
    assert!(matches!(t.step(&mut Quiet), Err(Error::Stopped(_))));
}
