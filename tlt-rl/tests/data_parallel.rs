//! Data-parallel GRPO on MPI (feature `mpi`), checked against one process on a tiny seeded model: 8 prompts × 4
//! sampled answers per step, two mini-batches per step.
//!
//! `mpirun -np 2` runs this very binary as the ranks (`TLT_DP_OUT` set); the parent then checks:
//! - the first step's tokens and rewards equal one rank's exactly (coins keyed by the request's index in the step),
//!   in the baseline and with TLT's group (suffix) drafting;
//! - both ranks hold the same weights bit for bit, and they agree with one rank's within a float-summation
//!   tolerance after every step (the gradients are summed per rank, then across ranks); tokens of later steps
//!   that flip because of that rounding are counted and printed;
//! - with rank 1 held back (each of its rounds waits until rank 0 has decoded its own share: slow by the order of
//!   events, whatever the machine's speed) and one group decoding at a time per rank, rank 0 takes groups rank 1
//!   has not started in every step, rank 1 runs fewer rounds than without stealing, and the tokens and
//!   weights equal the balanced run's;
//! - on 3 ranks with rank 1 held back, the others steal from it (one victim per request) in every step, and step 0's
//!   tokens are the 2-rank run's;
//! - with the online EAGLE-2 drafter on the tail schedule and rank 1 held back (then 20 ms per round), rank 0
//!   trains the drafter once its share is decoded and rank 1 installs new versions mid-rollout in every step; both ranks end each step on the same version, and the tokens
//!   and policy are the plain run's;
//! - with the EAGLE-2 drafter on a fixed schedule (every drafter step at the step's end; ranks balanced), both
//!   ranks take them together (gradients all-reduced): rank 1, which never trains alone, ends every step with rank 0's step
//!   count and version, and the tokens and policy are the plain run's;
//! - on a GPU (`TLT_DP_DEVICE=<ordinal>`, with tlt-rl's `cuda` feature; the GPU bundle's `ranks` call runs it, and
//!   only it): both ranks roll out on that one device, plainly and then with the EAGLE scenario above, and agree in
//!   tokens and policy; rank 1 uploads drafter versions it received over MPI to the device mid-rollout and drafts
//!   with them;
//! - rank 1 dying at the start of step 2 (TLT with suffix drafting) makes `mpirun` return an error well within
//!   60 s, the checkpoint rank 0 wrote after step 1 is intact and holds both ranks' SD gate and bandit, and resuming
//!   it on 2 ranks gives each rank its own and ends with the uninterrupted run's tokens and weights.
//!
//! Without `mpirun` on the PATH it says SKIP (`TLT_REQUIRE_MPI=1`, set by `cargo xtask test`, makes that a failure).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests: a panic is the failure report.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{base_config, tiny_model, Count};
use serde::{Deserialize, Serialize};
use tlt_comm::{Comm, SelfComm};
use tlt_rl::trainer::{DrafterChoice, DrafterSchedule, Mode, Observer, Quiet, Trainer, TrainerConfig};

const STEPS: u64 = 4;

/// What a rank (or the one-process reference) saw.
#[derive(Debug, Serialize, Deserialize)]
struct RunLog {
    /// Per step: every sample's tokens (group-major over the whole step) and reward.
    tokens: Vec<Vec<Vec<u32>>>,
    rewards: Vec<Vec<f64>>,
    /// Per step: each rank's rollout seconds.
    rank_rollout_s: Vec<Vec<f64>>,
    /// Per step: groups decoded by a rank other than their owner.
    stolen: Vec<usize>,
    /// Per step: drafter versions installed mid-rollout (all ranks), and this rank's drafter version at its end.
    swaps: Vec<u64>,
    drafter_version: Vec<u64>,
    /// Per step: this rank's drafter trainer's steps at the step's end.
    drafter_steps: Vec<u64>,
    /// Per step: this rank's engine rounds (of its own groups and those it stole).
    rounds: Vec<usize>,
    /// Per step: EAGLE weight versions this rank had uploaded to its rollout device by the step's end (0 on the CPU).
    device_uploads: Vec<u64>,
    /// The final weights by name.
    weights: BTreeMap<String, Vec<f32>>,
}

/// The run's settings: the mode, for the skewed runs one group decoding at a time per rank (`max_running` = group
/// size, so the rest of a rank's groups wait in its queue), whether ranks steal queued groups, and the CUDA device
/// the rollouts run on (none: the CPU).
#[derive(Debug, Clone, Copy)]
struct Setup<'a> {
    mode: &'a str,
    one_group_at_a_time: bool,
    steal: bool,
    device: Option<usize>,
}

fn config(setup: Setup) -> TrainerConfig {
    let mut cfg = match setup.mode {
        "baseline" => base_config(Mode::Baseline),
        _ => base_config(Mode::Tlt),
    };
    cfg.sd.drafter = DrafterChoice::Suffix;
    if setup.mode.starts_with("eagle") {
        // The online EAGLE-2 drafter, a version published after every drafter step, trained in rank 0's idle time
        // (the tail schedule).
        cfg.sd.drafter = DrafterChoice::Eagle2;
        cfg.sd.publish_every = 1;
        cfg.sd.schedule = DrafterSchedule::Tail;
    }
    if setup.mode == "eagle-joint" {
        // A fixed schedule across ranks: all 64 drafter steps at the step's end, every rank taking them together.
        cfg.sd.schedule = DrafterSchedule::Fixed { steps: 64 };
    }
    cfg.ppo_mini_batch_size = Some(4);
    if setup.one_group_at_a_time {
        cfg.rollout.max_running = cfg.group_size;
    }
    cfg.steal_queued_groups = setup.steal;
    if let Some(ordinal) = setup.device {
        cfg.device = tlt_model::Device::Cuda(ordinal);
    }
    cfg
}

/// Rank 1, made the slow rank by the order of events rather than by the machine's speed: each of its rounds waits
/// until rank 0 has decoded its own share of the step (rank 0's [`Marks`] file), then takes `extra` more.
struct Held {
    dir: PathBuf,
    step: u64,
    extra: Duration,
}

impl Observer for Held {
    fn on_phase(&mut self, step: u64, phase: &str) {
        if phase == "rollout" {
            self.step = step;
        }
    }

    fn on_round(&mut self, _: usize, _: usize, _: usize, _: usize) {
        let mark = self.dir.join(format!("rank0-share-{}", self.step));
        let t = Instant::now();
        while !mark.exists() {
            assert!(t.elapsed() < Duration::from_secs(300), "rank 0 never finished its share of step {}", self.step);
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(self.extra);
    }
}

/// Rank 0: marks (a file) the end of its own share's decoding in each step: the last round of the step's first
/// rollout job, where every request of the job has finished.
struct Marks {
    dir: PathBuf,
    step: Option<u64>,
    marked: bool,
}

impl Observer for Marks {
    fn on_phase(&mut self, step: u64, phase: &str) {
        if phase == "rollout" && self.step != Some(step) {
            (self.step, self.marked) = (Some(step), false);
        }
    }

    fn on_round(&mut self, _: usize, finished: usize, total: usize, _: usize) {
        if let (Some(step), false, true) = (self.step, self.marked, finished == total) {
            std::fs::write(self.dir.join(format!("rank0-share-{step}")), b"").unwrap();
            self.marked = true;
        }
    }
}

/// How a rank runs: checkpoint directory, resume from it, the step at whose start rank 1 exits, and whether rank 1
/// is held back ([`Held`]: the directory of rank 0's marks, and rank 1's extra delay per round).
#[derive(Debug, Default)]
struct RankOpts {
    ckpt: Option<PathBuf>,
    resume: bool,
    die_at: Option<u64>,
    held: Option<(PathBuf, Duration)>,
}

/// Runs steps up to [`STEPS`] as one rank of `comm`: resuming from the checkpoint if asked, checkpointing after every
/// step, and (rank 1, when asked) exiting abruptly at the start of a step or taking longer per round.
fn run_rank(comm: Arc<dyn Comm>, setup: Setup, opts: &RankOpts) -> RunLog {
    let cfg = config(setup);
    let (ckpt, resume, die_at) = (opts.ckpt.as_deref(), opts.resume, opts.die_at);
    let trainer = match (resume, ckpt) {
        (true, Some(dir)) => Trainer::resume(dir, tiny_model(11), Count, cfg).unwrap(),
        _ => Trainer::new(tiny_model(11), Count, cfg).unwrap(),
    };
    let mut t = trainer.with_comm(comm.clone()).unwrap();
    if let (true, Some(dir)) = (resume, ckpt) {
        // Each rank resumes its own SD gate and bandit, which the checkpoint keeps by rank.
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(tlt_rl::trainer::STATE_FILE)).unwrap()).unwrap();
        let saved = state["rank_decoders"].as_array().unwrap();
        assert_eq!(saved.len(), comm.size(), "one gate and bandit state per rank");
        assert_eq!(serde_json::to_value(t.decoder_state()).unwrap(), saved[comm.rank()], "rank {}", comm.rank());
        println!(
            "rank {} resumed its own gate and bandit (the ranks' saved states differ: {})",
            comm.rank(),
            saved[0] != saved[1]
        );
    }
    let mut log = RunLog {
        tokens: vec![],
        rewards: vec![],
        rank_rollout_s: vec![],
        stolen: vec![],
        swaps: vec![],
        drafter_version: vec![],
        drafter_steps: vec![],
        rounds: vec![],
        device_uploads: vec![],
        weights: BTreeMap::new(),
    };
    let mut obs: Box<dyn Observer> = match (&opts.held, comm.rank()) {
        (Some((dir, extra)), 1) => Box::new(Held { dir: dir.clone(), step: 0, extra: *extra }),
        (Some((dir, _)), 0) => Box::new(Marks { dir: dir.clone(), step: None, marked: false }),
        _ => Box::new(Quiet),
    };
    while t.steps_done() < STEPS {
        if die_at == Some(t.steps_done()) && comm.rank() == 1 {
            eprintln!("rank 1: dying at the start of step {}", t.steps_done());
            std::process::exit(3);
        }
        let r = t.step(obs.as_mut()).unwrap();
        log.stolen.push(r.metrics.stolen_groups);
        log.swaps.push(r.metrics.drafter_swaps);
        log.drafter_version.push(r.metrics.drafter_version);
        log.drafter_steps.push(r.metrics.drafter_steps);
        log.rounds.push(r.metrics.active_requests.len());
        log.device_uploads.push(t.drafter_device_uploads());
        log.tokens.push(r.samples.iter().map(|(s, _, _)| s.tokens.clone()).collect());
        log.rewards.push(r.samples.iter().map(|(_, _, w)| *w).collect());
        log.rank_rollout_s.push(r.metrics.rank_rollout_s.clone());
        assert_eq!(r.metrics.ranks, comm.size());
        if let Some(dir) = ckpt {
            t.save_checkpoint(dir).unwrap();
        }
    }
    log.weights = common::weights(&t);
    log
}

/// The rank side: under `mpirun`, with the scenario in the environment.
fn rank_main(out: &Path) {
    let mpi = tlt_comm::mpi::MpiComm::init().unwrap();
    let var = |k: &str| std::env::var(k).ok();
    if let Some(n) = var("TLT_DP_MAX_COUNT") {
        mpi.set_max_count(n.parse().unwrap()).unwrap();
    }
    let comm: Arc<dyn Comm> = Arc::new(mpi);
    let mode = var("TLT_DP_MODE").unwrap_or_else(|| "baseline".into());
    let setup = Setup {
        mode: &mode,
        one_group_at_a_time: var("TLT_DP_SKEW").is_some(),
        steal: var("TLT_DP_NOSTEAL").is_none(),
        device: var("TLT_DP_DEVICE").map(|s| s.parse().unwrap()),
    };
    let opts = RankOpts {
        ckpt: var("TLT_DP_CKPT").map(PathBuf::from),
        resume: var("TLT_DP_RESUME").is_some(),
        die_at: var("TLT_DP_DIE_AT").map(|s| s.parse().unwrap()),
        held: var("TLT_DP_SKEW").map(|ms| (out.to_path_buf(), Duration::from_millis(ms.parse().unwrap()))),
    };
    let log = run_rank(comm.clone(), setup, &opts);
    let path = out.join(format!("rank{}.json", comm.rank()));
    std::fs::write(path, serde_json::to_vec(&log).unwrap()).unwrap();
}

fn mpirun_found() -> bool {
    let found = tlt_comm::launch::mpirun_on_path();
    if !found && std::env::var_os("TLT_REQUIRE_MPI").is_some() {
        panic!("TLT_REQUIRE_MPI is set but `mpirun` is not on the PATH");
    }
    found
}

/// `mpirun -np 2` of this binary with `env`, results in a fresh `out`: (success, seconds, stderr).
fn mpirun(out: &Path, env: &[(&str, String)]) -> (bool, f64, String) {
    mpirun_n(2, out, env)
}

/// [`mpirun`] with `ranks` ranks.
fn mpirun_n(ranks: usize, out: &Path, env: &[(&str, String)]) -> (bool, f64, String) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    let mut cmd = tlt_comm::launch::mpirun(ranks);
    cmd.env("TLT_DP_OUT", out).arg(std::env::current_exe().unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t = Instant::now();
    let o = cmd.output().unwrap();
    let err = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    (o.status.success(), t.elapsed().as_secs_f64(), err)
}

fn read_log(out: &Path, rank: usize) -> RunLog {
    serde_json::from_slice(&std::fs::read(out.join(format!("rank{rank}.json"))).unwrap()).unwrap()
}

/// Largest |a - b| over all weights, and the largest |a|.
fn weight_gap(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> (f32, f32) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let (mut gap, mut scale) = (0f32, 0f32);
    for (k, x) in a {
        for (p, q) in x.iter().zip(&b[k]) {
            gap = gap.max((p - q).abs());
            scale = scale.max(p.abs());
        }
    }
    (gap, scale)
}

/// Tokens that differ between two runs' steps (positions compared up to the shorter answer, plus the length
/// difference).
fn flips(a: &[Vec<u32>], b: &[Vec<u32>]) -> usize {
    a.iter().zip(b).map(|(x, y)| x.iter().zip(y).filter(|(p, q)| p != q).count() + x.len().abs_diff(y.len())).sum()
}

/// Two ranks against one, in `mode`.
fn against_one_rank(mode: &str, root: &Path) -> RunLog {
    let setup = Setup { mode, one_group_at_a_time: false, steal: true, device: None };
    let one = run_rank(Arc::new(SelfComm), setup, &RankOpts::default());
    let out = root.join(mode);
    let (ok, secs, err) = mpirun(&out, &[("TLT_DP_MODE", mode.to_string())]);
    assert!(ok, "mpirun -np 2 ({mode}) failed:\n{err}");
    let (r0, r1) = (read_log(&out, 0), read_log(&out, 1));
    assert_eq!(one.tokens[0], r0.tokens[0], "{mode}: step 0's tokens differ from one rank's");
    assert_eq!(one.rewards[0], r0.rewards[0], "{mode}: step 0's rewards differ from one rank's");
    assert_eq!(r0.tokens, r1.tokens, "{mode}: the ranks gathered different samples");
    assert_eq!(r0.weights, r1.weights, "{mode}: the ranks' weights differ (they apply the same update)");
    let (gap, scale) = weight_gap(&one.weights, &r0.weights);
    let step_flips: Vec<usize> = (0..STEPS as usize).map(|s| flips(&one.tokens[s], &r0.tokens[s])).collect();
    let total: usize = one.tokens.iter().flatten().map(Vec::len).sum();
    println!(
        "{mode}: 2 ranks vs 1 over {STEPS} steps (mpirun {secs:.1} s): max |weight gap| {gap:.3e} (largest weight \
         {scale:.3}); token flips per step {step_flips:?} of {total} tokens; rank rollout seconds {:?}",
        r0.rank_rollout_s
    );
    assert_eq!(step_flips[0], 0);
    // Float summation order only: AdamW's steps of lr = 3e-3 per weight bound how far any weight can move, and
    // rounding moves them by far less. 1e-4 is 1/30 of one optimizer step's move.
    assert!(gap < 1e-4, "{mode}: weights {gap:e} away from one rank's");
    assert_eq!(r0.rank_rollout_s[0].len(), 2, "each rank's rollout time is logged");
    r0
}

/// The 2-rank baseline again with MPI messages cut into chunks of 1,000 elements (the gradient all-reduce of this
/// model is tens of chunks; a model past 2^31 weights needs chunks to run at all): the same samples and weights,
/// bit for bit, as the run in one message per collective (on two ranks a sum does not depend on the chunking).
fn chunked_messages_change_nothing(root: &Path, whole: &RunLog) {
    let out = root.join("chunked");
    let env = [("TLT_DP_MODE", "baseline".to_string()), ("TLT_DP_MAX_COUNT", "1000".to_string())];
    let (ok, secs, err) = mpirun(&out, &env);
    assert!(ok, "mpirun -np 2 (chunks of 1,000) failed:\n{err}");
    let r0 = read_log(&out, 0);
    let weights: usize = r0.weights.values().map(Vec::len).sum();
    assert!(weights > 10 * 1000, "{weights} weights: the gradient fits in few chunks");
    assert_eq!(r0.tokens, whole.tokens, "chunked collectives sampled other tokens");
    assert_eq!(r0.weights, whole.weights, "chunked collectives ended with other weights");
    println!(
        "chunks of 1,000 elements ({weights} weights, mpirun {secs:.1} s): the same tokens and weights, bit for bit"
    );
}

/// Rank 1's delay per round (ms) once rank 0 has finished its share, in the stealing tests. With none, a 2-core
/// machine loaded by other work once let rank 1 run through its queued groups before rank 0's request for work
/// reached it: one step of four stole nothing ([1, 2, 0, 1]).
const HELD_MS: u64 = 5;

/// Rollout imbalance of a run: per step, the slowest rank's rollout time over the mean.
fn imbalance(log: &RunLog) -> Vec<f64> {
    log.rank_rollout_s.iter().map(|r| r.iter().copied().fold(0.0, f64::max) / (r.iter().sum::<f64>() / 2.0)).collect()
}

/// Rank 1 held back ([`Held`]: its rounds wait until rank 0 has decoded its own share) and each rank decoding one
/// group at a time: without stealing rank 0 idles while rank 1's queued groups wait; with it rank 0 takes them in
/// every step, so rank 1 decodes fewer groups (fewer engine rounds: counted, not timed), and the
/// tokens and weights stay those of the balanced run (coins keyed by request, gradients by the groups' owners).
/// Once released, rank 1 takes [`HELD_MS`] per round, so its queue outlasts rank 0's request for work.
fn stealing_is_lossless(root: &Path, balanced: &RunLog) {
    let mut runs = Vec::new();
    for steal in [false, true] {
        let out = root.join(format!("skew-steal-{steal}"));
        let mut env = vec![("TLT_DP_SKEW", HELD_MS.to_string())];
        if !steal {
            env.push(("TLT_DP_NOSTEAL", "1".into()));
        }
        let (ok, secs, err) = mpirun(&out, &env);
        assert!(ok, "mpirun -np 2 (skewed, steal {steal}) failed:\n{err}");
        let (r0, r1) = (read_log(&out, 0), read_log(&out, 1));
        assert_eq!(r0.tokens, balanced.tokens, "skewed (steal {steal}): other tokens than the balanced run's");
        assert_eq!(r0.weights, balanced.weights, "skewed (steal {steal}): other weights than the balanced run's");
        assert_eq!(r0.weights, r1.weights);
        let imb = imbalance(&r0);
        let makespan: Vec<f64> = r0.rank_rollout_s.iter().map(|r| r.iter().copied().fold(0.0, f64::max)).collect();
        println!(
            "skewed, steal {steal} (mpirun {secs:.1} s): groups stolen per step {:?}; rank 1's rounds per step {:?}; \
             rollout makespan per step {makespan:.3?} s; imbalance (slowest / mean rank's decoding) {imb:.2?}; rank \
             rollout seconds {:.3?}",
            r0.stolen, r1.rounds, r0.rank_rollout_s
        );
        runs.push((r0.stolen.clone(), r1.rounds.clone()));
    }
    let (no_steal, steal) = (&runs[0], &runs[1]);
    assert!(no_steal.0.iter().all(|&n| n == 0), "nothing is stolen when stealing is off");
    assert!(steal.0.iter().all(|&n| n > 0), "a rank out of work takes queued groups every step: {:?}", steal.0);
    // Rank 1 decodes fewer of its groups, one at a time: fewer rounds over the run (a step's stolen group may be
    // one that needs no round: every answer ending at its first token).
    let total = |v: &[usize]| v.iter().sum::<usize>();
    assert!(
        total(&steal.1) < total(&no_steal.1),
        "stealing did not lighten rank 1's rollout: its rounds per step {:?} vs {:?}",
        steal.1,
        no_steal.1
    );
}

/// Three ranks (8 groups: 3, 3 and 2), rank 1 held back ([`Held`]) and one group decoding at a time: the
/// others steal from it, each asking one rank at a time. Every step moves groups, the three ranks hold the same
/// weights, step 0's tokens are the 2-rank balanced run's (coins keyed by request), and the weights stay within
/// float-summation distance of it.
fn three_ranks_steal(root: &Path, balanced: &RunLog) {
    let out = root.join("three-ranks");
    let (ok, secs, err) = mpirun_n(3, &out, &[("TLT_DP_SKEW", HELD_MS.to_string())]);
    assert!(ok, "mpirun -np 3 (skewed) failed:\n{err}");
    let logs: Vec<RunLog> = (0..3).map(|r| read_log(&out, r)).collect();
    let (gap, _) = weight_gap(&balanced.weights, &logs[0].weights);
    println!(
        "3 ranks, rank 1 held back (mpirun {secs:.1} s): groups stolen per step {:?}; rank rollout seconds {:.3?}; max \
         |weight gap| to 2 ranks {gap:.3e}",
        logs[0].stolen, logs[0].rank_rollout_s
    );
    assert!(logs[0].stolen.iter().all(|&n| n > 0), "a step without stealing: {:?}", logs[0].stolen);
    assert!(logs.iter().all(|l| l.weights == logs[0].weights), "the three ranks' weights differ");
    assert!(logs.iter().all(|l| l.rank_rollout_s[0].len() == 3));
    assert_eq!(logs[0].tokens[0], balanced.tokens[0], "step 0's tokens depend on the rank count");
    assert!(gap < 1e-4, "weights {gap:e} away from 2 ranks'");
}

/// Rank 1 held back ([`Held`], then 20 ms more per round) and no stealing, with the online EAGLE-2 drafter (tail
/// schedule): rank 0 decodes its share,
/// then trains the drafter on the features of both ranks while rank 1 still decodes; rank 1 hot-swaps the versions
/// mid-rollout; both ranks end every step on the same drafter version, and the tokens and policy are those of the
/// `plain` run (speculation is lossless, and the drafter never touches the update). `env` adds to the scenario's
/// (the device); returns both ranks' logs.
fn idle_rank_trains_the_drafter(out: &Path, plain: &RunLog, env: &[(&str, String)]) -> (RunLog, RunLog) {
    // Rank 0 finishes its share before rank 1's second round in every step (the hold: an order of events); the
    // 20 ms per round that follow leave rank 1 rounds in which to receive rank 0's first versions (a drafter step
    // of this model takes well under a millisecond).
    let mut env = env.to_vec();
    env.extend([("TLT_DP_MODE", "eagle".to_string()), ("TLT_DP_SKEW", "20".into()), ("TLT_DP_NOSTEAL", "1".into())]);
    let (ok, secs, err) = mpirun(out, &env);
    assert!(ok, "mpirun -np 2 (eagle) failed:\n{err}");
    let (r0, r1) = (read_log(out, 0), read_log(out, 1));
    println!(
        "eagle, rank 1 held back (mpirun {secs:.1} s): drafter versions installed mid-rollout per step {:?}; drafter \
         version at each step's end [rank 0] {:?} [rank 1] {:?}; rank rollout seconds {:.3?}",
        r0.swaps, r0.drafter_version, r1.drafter_version, r0.rank_rollout_s
    );
    assert!(r0.swaps.iter().all(|&n| n > 0), "rank 1 hot-swapped no version in some step: {:?}", r0.swaps);
    assert_eq!(r0.drafter_version, r1.drafter_version, "the ranks end a step on different drafter versions");
    assert!(r0.drafter_version.windows(2).all(|w| w[1] > w[0]), "the drafter is trained every step");
    assert_eq!(r0.tokens, plain.tokens, "the drafted run sampled other tokens");
    assert_eq!(r0.weights, plain.weights, "the drafted run's policy differs");
    assert_eq!(r0.weights, r1.weights);
    (r0, r1)
}

/// The online EAGLE-2 drafter on a fixed schedule of 64 drafter steps per RL step, all at the step's end (ranks
/// balanced): both ranks take them together, each a share of every batch with the gradients all-reduced. Rank 1, which never
/// trains alone, counts as many drafter steps as rank 0 at every step's end (it joined rank 0's trainer and stepped
/// with it); both end on the same version, and the tokens and policy are the plain run's.
fn ranks_train_the_drafter_together(root: &Path, plain: &RunLog) {
    let out = root.join("eagle-joint");
    let (ok, secs, err) = mpirun(&out, &[("TLT_DP_MODE", "eagle-joint".to_string())]);
    assert!(ok, "mpirun -np 2 (eagle-joint) failed:\n{err}");
    let (r0, r1) = (read_log(&out, 0), read_log(&out, 1));
    println!(
        "eagle, 64 drafter steps per RL step, all at the step's end (mpirun {secs:.1} s): drafter steps at each step's \
         end [rank 0] {:?} [rank 1] {:?}; versions {:?}",
        r0.drafter_steps, r1.drafter_steps, r0.drafter_version
    );
    assert!(r0.drafter_steps.iter().enumerate().all(|(k, &n)| n == 64 * (k as u64 + 1)), "{:?}", r0.drafter_steps);
    assert_eq!(r1.drafter_steps, r0.drafter_steps, "rank 1 did not take the owed drafter steps with rank 0");
    assert_eq!(r0.drafter_version, r1.drafter_version, "the ranks end a step on different drafter versions");
    assert_eq!(r0.tokens, plain.tokens, "the drafted run sampled other tokens");
    assert_eq!(r0.weights, plain.weights, "the drafted run's policy differs");
    assert_eq!(r0.weights, r1.weights);
}

/// Both ranks roll out on CUDA device `ordinal` (one GPU takes both: no NCCL between them), the drafter trained on
/// rank 0's CPU and its weights sent over MPI: against the same two ranks decoding plainly on the device, the drafted
/// run commits the same tokens and policy, and rank 1 uploads versions it received mid-rollout to the device and
/// drafts with them (more than one upload per step: the step's first version, then at least one received).
#[cfg(feature = "cuda")]
fn on_the_device(root: &Path, ordinal: usize) {
    if !tlt_kernels::cuda::gpu_or_skip("data_parallel on the device").unwrap() {
        return;
    }
    let dev = [("TLT_DP_DEVICE", ordinal.to_string())];
    let out = root.join("device-plain");
    let (ok, secs, err) = mpirun(&out, &dev);
    assert!(ok, "mpirun -np 2 (plain, on cuda:{ordinal}) failed:\n{err}");
    let plain = read_log(&out, 0);
    assert_eq!(plain.tokens, read_log(&out, 1).tokens);
    println!("plain on cuda:{ordinal} (mpirun {secs:.1} s): rank rollout seconds {:.3?}", plain.rank_rollout_s);
    let (_, r1) = idle_rank_trains_the_drafter(&root.join("device-eagle"), &plain, &dev);
    let per_step: Vec<u64> =
        std::iter::once(r1.device_uploads[0]).chain(r1.device_uploads.windows(2).map(|w| w[1] - w[0])).collect();
    println!("rank 1's drafter weight uploads to cuda:{ordinal} per step: {per_step:?}");
    assert!(per_step.iter().all(|&n| n >= 2), "rank 1 drafted with no received version on the device: {per_step:?}");
}

/// Without the `cuda` feature there is no device scenario.
#[cfg(not(feature = "cuda"))]
fn on_the_device(_: &Path, ordinal: usize) {
    panic!("TLT_DP_DEVICE={ordinal} needs tlt-rl's `cuda` feature (this build has none)");
}

fn main() {
    if let Some(out) = std::env::var_os("TLT_DP_OUT") {
        rank_main(Path::new(&out));
        return;
    }
    if !mpirun_found() {
        println!("SKIP data_parallel: no `mpirun` (install an MPI runtime)");
        return;
    }
    let root = std::env::temp_dir().join(format!("tlt-dp-{}", std::process::id()));
    if let Some(ordinal) = std::env::var("TLT_DP_DEVICE").ok().map(|s| s.parse().unwrap()) {
        // The GPU bundle's `ranks` call: the device scenario only (the CPU ones run in CI).
        on_the_device(&root, ordinal);
        let _ = std::fs::remove_dir_all(&root);
        return;
    }
    let uninterrupted = against_one_rank("baseline", &root);
    chunked_messages_change_nothing(&root, &uninterrupted);
    against_one_rank("tlt", &root);
    stealing_is_lossless(&root, &uninterrupted);
    three_ranks_steal(&root, &uninterrupted);
    let (r0, _) = idle_rank_trains_the_drafter(&root.join("eagle"), &uninterrupted, &[]);
    assert!(r0.device_uploads.iter().all(|&n| n == 0), "nothing is uploaded to a device on the CPU");
    ranks_train_the_drafter_together(&root, &uninterrupted);

    // Rank 1 dies at the start of step 2; rank 0 waits in that step's gather until mpirun ends the job.
    let ckpt = root.join("ckpt");
    let out = root.join("killed");
    let env = |extra: Vec<(&'static str, String)>| {
        let mut v = vec![("TLT_DP_MODE", "tlt".to_string()), ("TLT_DP_CKPT", ckpt.display().to_string())];
        v.extend(extra);
        v
    };
    let (ok, secs, err) = mpirun(&out, &env(vec![("TLT_DP_DIE_AT", "2".into())]));
    assert!(!ok, "the job survived a dead rank:\n{err}");
    assert!(secs < 60.0, "the job took {secs:.1} s to stop after a rank died");
    println!("a rank died at step 2: mpirun returned an error after {secs:.1} s:\n{err}");
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.join(tlt_rl::trainer::STATE_FILE)).unwrap()).unwrap();
    assert_eq!(state["step"], 2, "the last checkpoint is step 1's: {state}");
    let (ok, _, err) = mpirun(&out, &env(vec![("TLT_DP_RESUME", "1".into())]));
    assert!(ok, "resuming on 2 ranks failed:\n{err}");
    print!("{}", err.lines().filter(|l| l.contains("resumed its own")).map(|l| format!("{l}\n")).collect::<String>());
    let resumed = read_log(&out, 0);
    assert_eq!(resumed.tokens, uninterrupted.tokens[2..], "the resumed steps sampled other tokens");
    assert_eq!(resumed.weights, uninterrupted.weights, "the resumed run ends with other weights");
    println!("resumed from step 2 on 2 ranks: tokens and final weights equal the uninterrupted run's");
    let _ = std::fs::remove_dir_all(&root);
}
