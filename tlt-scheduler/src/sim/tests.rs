//! The simulator's tests.

use tlt_spec_decode::Plan;

use super::*;

fn small() -> SimConfig {
    SimConfig {
        workers: 4,
        requests_per_worker: 16,
        group_size: 4,
        lengths: LengthDist::LogNormal { median: 150.0, sigma: 1.0, max: 3000 },
        rl_steps: 3,
        ..SimConfig::default()
    }
}

#[test]
fn defaults_validate_and_roundtrip() {
    let cfg = SimConfig::default();
    cfg.validate().unwrap();
    let json = serde_json::to_string(&cfg).unwrap();
    assert_eq!(serde_json::from_str::<SimConfig>(&json).unwrap(), cfg);
    assert_eq!(serde_json::from_str::<SimConfig>("{}").unwrap(), cfg);
    let bad = [
        SimConfig { workers: 0, ..small() },
        SimConfig { lengths: LengthDist::Replay { lengths: vec![3, 0] }, ..small() },
        SimConfig { lengths: LengthDist::LogNormal { median: 0.5, sigma: 1.0, max: 9 }, ..small() },
        SimConfig { cost: CostModel { noise: 1.0, ..CostModel::default() }, ..small() },
        SimConfig { accept: AcceptModel { staleness_decay: 0.0, ..AcceptModel::default() }, ..small() },
        SimConfig { prompt_tokens: 1 << 20, ..small() },
    ];
    for b in bad {
        assert!(simulate(&b).is_err(), "{b:?}");
    }
}

#[test]
fn accept_model_interpolates_decays_and_caps() {
    let m = AcceptModel::default();
    let p = |verify_tokens| Plan { steps: 8, top_k: 4, verify_tokens };
    assert!((m.accept_len(&p(8), 0.0) - 2.4).abs() < 1e-12);
    assert!((m.accept_len(&p(24), 0.0) - 3.1).abs() < 1e-12);
    assert!((m.accept_len(&p(100), 0.0) - 3.5).abs() < 1e-12);
    assert!((m.accept_len(&p(4), 0.0) - 2.4).abs() < 1e-12);
    assert!((m.accept_len(&p(48), 2.0) - (1.0 + 2.5 * 0.85 * 0.85)).abs() < 1e-12);
    assert_eq!(m.accept_len(&Plan::chain(1), 0.0), 2.0);
}

#[test]
fn harvest_integrates_idle_workers() {
    assert_eq!(harvest(&[1.0, 2.0, 4.0], 4.0, usize::MAX), 1.0 + 2.0 * 2.0);
    assert_eq!(harvest(&[1.0, 2.0, 4.0], 4.0, 1), 3.0);
    assert_eq!(harvest(&[4.0], 4.0, 1), 0.0);
}

#[test]
fn deterministic_paired_and_sensible() {
    let cfg = small();
    let a = simulate(&cfg).unwrap();
    assert_eq!(a, simulate(&cfg).unwrap(), "seeded runs repeat exactly");
    let [base, sd, online] = [&a.modes[0], &a.modes[1], &a.modes[2]];
    // Same work in every mode.
    for i in 0..cfg.rl_steps {
        assert_eq!(base.rl_steps[i].tokens, sd.rl_steps[i].tokens);
        assert_eq!(base.rl_steps[i].tokens, online.rl_steps[i].tokens);
        assert_eq!(base.rl_steps[i].speculative_steps, 0);
        assert!(sd.rl_steps[i].speculative_steps > 0);
    }
    assert!(a.makespan_ratio_baseline_over_adaptive > 1.0, "{a:#?}");
    // A stale drafter accepts less; the online one stays fresher and is at least as fast.
    assert!(sd.rl_steps[2].mean_accept_len < sd.rl_steps[0].mean_accept_len);
    assert!(online.rl_steps[2].staleness < sd.rl_steps[2].staleness);
    assert!(online.harvested_train_s > 0.0 && sd.harvested_train_s == 0.0);
    assert!(a.makespan_ratio_baseline_over_online >= a.makespan_ratio_baseline_over_adaptive);
    for m in &a.modes {
        for r in &m.rl_steps {
            assert!((0.0..1.0).contains(&r.idle_fraction));
            assert!(r.worker_finish_s.iter().all(|&f| f <= r.makespan_s));
        }
    }
}

#[test]
fn replayed_lengths_are_used_exactly() {
    let cfg = SimConfig {
        workers: 2,
        requests_per_worker: 3,
        group_size: 2,
        lengths: LengthDist::Replay { lengths: vec![5, 10, 100] },
        rl_steps: 1,
        ..SimConfig::default()
    };
    let r = simulate(&cfg).unwrap();
    assert_eq!(r.modes[0].rl_steps[0].tokens, 2 * (5 + 10 + 100));
    // Plain decoding: one step per token of the longest request (100) on each worker.
    assert_eq!(r.modes[0].rl_steps[0].steps, 100 + 100);
}

/// Four workers of four groups each (8 requests per group, one group decoding at a time), worker 0's groups 20x
/// longer than the others'.
fn skewed(steal: bool) -> SimConfig {
    let mut lengths = vec![400; 32];
    lengths.extend(vec![20; 96]);
    SimConfig {
        workers: 4,
        requests_per_worker: 32,
        group_size: 8,
        lengths: LengthDist::Replay { lengths },
        rl_steps: 1,
        rollout: RolloutConfig { max_running: 8, ..RolloutConfig::default() },
        steal,
        ..SimConfig::default()
    }
}

#[test]
fn stealing_balances_a_skewed_workload_without_losing_work() {
    let (off, on) = (simulate(&skewed(false)).unwrap(), simulate(&skewed(true)).unwrap());
    for (a, b) in off.modes.iter().zip(&on.modes) {
        let (a, b) = (&a.rl_steps[0], &b.rl_steps[0]);
        // Same work: every request finishes exactly once, every token is generated once.
        assert_eq!(a.tokens, 32 * 400 + 96 * 20);
        assert_eq!(b.tokens, a.tokens);
        assert_eq!((a.requests_finished, b.requests_finished), (128, 128));
        assert_eq!(a.stolen_groups, 0);
        assert!(b.stolen_groups > 0, "{b:?}");
        assert!(b.makespan_s < 0.6 * a.makespan_s, "{} vs {}", b.makespan_s, a.makespan_s);
        assert!(b.idle_fraction < a.idle_fraction, "{} vs {}", b.idle_fraction, a.idle_fraction);
    }
}

#[test]
fn stealing_is_lossless_and_inert_where_nothing_can_move() {
    // Random lengths, tight batches: the same tokens and requests with and without stealing.
    let tight =
        |steal| SimConfig { rollout: RolloutConfig { max_running: 8, ..RolloutConfig::default() }, steal, ..small() };
    let (off, on) = (simulate(&tight(false)).unwrap(), simulate(&tight(true)).unwrap());
    for (a, b) in off.modes.iter().zip(&on.modes) {
        for (x, y) in a.rl_steps.iter().zip(&b.rl_steps) {
            assert_eq!(x.tokens, y.tokens);
            assert_eq!(x.requests_finished, 64);
            assert_eq!(y.requests_finished, 64);
        }
    }
    // One worker has no one to steal from: stealing changes nothing, down to the last bit.
    let one = |steal| SimConfig { workers: 1, ..tight(steal) };
    assert_eq!(simulate(&one(false)).unwrap(), simulate(&one(true)).unwrap());
    // Everything starts at once with the default batch cap: nothing is left to steal.
    let wide = simulate(&SimConfig { steal: true, ..small() }).unwrap();
    assert_eq!(wide, simulate(&small()).unwrap());
}

/// Many workers, one group decoding at a time, long-tailed lengths: a stolen group stays with its thief (as in the
/// trainer), so no group moves twice, every request still finishes once, and stealing does not lengthen the
/// rollout. (When thieves' stolen groups could be stolen again, 2,048 groups moved 3,049 times here; when a thief
/// took half of every worker's queue at once, it became the tail.)
#[test]
fn a_stolen_group_moves_once() {
    let cfg = SimConfig {
        workers: 256,
        requests_per_worker: 64,
        group_size: 8,
        lengths: LengthDist::LogNormal { median: 150.0, sigma: 1.0, max: 3000 },
        rl_steps: 1,
        rollout: RolloutConfig { max_running: 8, ..RolloutConfig::default() },
        steal: true,
        ..SimConfig::default()
    };
    let r = simulate(&cfg).unwrap();
    let off = simulate(&SimConfig { steal: false, ..cfg }).unwrap();
    let groups = 256 * 64 / 8;
    for (m, o) in r.modes.iter().zip(&off.modes) {
        let (s, o) = (&m.rl_steps[0], &o.rl_steps[0]);
        assert_eq!(s.requests_finished, 256 * 64);
        assert!(s.stolen_groups > 0, "{s:?}");
        assert!(s.stolen_groups <= groups, "{} moves of {groups} groups", s.stolen_groups);
        // One victim per request: a thief takes at most half of one worker's queue, so it never becomes a
        // tail far longer than the rollout without stealing.
        eprintln!("{:?}: makespan {:.1} s with stealing, {:.1} s without", m.mode, s.makespan_s, o.makespan_s);
        assert!(s.makespan_s <= 1.05 * o.makespan_s, "{} s with stealing vs {} s without", s.makespan_s, o.makespan_s);
    }
}
