//! Data-parallel GRPO on MPI (feature `mpi`), checked against one process on a tiny seeded model: 8 prompts × 4
//! sampled answers per step, two mini-batches per step.
//!
//! `mpirun -np 2` runs this very binary as the ranks (`TLT_DP_OUT` set); the parent then checks:
//! - the first step's tokens and rewards equal one rank's exactly (coins keyed by the request's index in the step),
//!   in the baseline and with TLT's group (suffix) drafting;
//! - both ranks hold the same weights bit for bit, and they agree with one rank's within a float-summation
//!   tolerance after every step (the gradients are summed per rank, then across ranks); tokens of later steps
//!   that flip because of that rounding are counted and printed;
//! - rank 1 dying at the start of step 2 makes `mpirun` return an error well within 60 s, the checkpoint rank 0
//!   wrote after step 1 is intact, and resuming it on 2 ranks ends with the uninterrupted run's weights.
//!
//! Without `mpirun` on the PATH it says SKIP (`TLT_REQUIRE_MPI=1`, set by `cargo xtask test`, makes that a failure).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests: a panic is the failure report.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use common::{base_config, tiny_model, Count};
use serde::{Deserialize, Serialize};
use tlt_comm::{Comm, SelfComm};
use tlt_rl::trainer::{DrafterChoice, Mode, Quiet, Trainer, TrainerConfig};

const STEPS: u64 = 4;

/// What a rank (or the one-process reference) saw.
#[derive(Debug, Serialize, Deserialize)]
struct RunLog {
    /// Per step: every sample's tokens (group-major over the whole step) and reward.
    tokens: Vec<Vec<Vec<u32>>>,
    rewards: Vec<Vec<f64>>,
    /// Per step: each rank's rollout seconds.
    rank_rollout_s: Vec<Vec<f64>>,
    /// The final weights by name.
    weights: BTreeMap<String, Vec<f32>>,
}

fn config(mode: &str) -> TrainerConfig {
    let mut cfg = match mode {
        "baseline" => base_config(Mode::Baseline),
        _ => base_config(Mode::Tlt),
    };
    cfg.sd.drafter = DrafterChoice::Suffix;
    cfg.ppo_mini_batch_size = Some(4);
    cfg
}

/// Runs steps up to [`STEPS`] as one rank of `comm`: resuming from `ckpt` if asked, checkpointing there after every
/// step, and (rank 1, when `die_at` says so) exiting abruptly at the start of that step.
fn run_rank(comm: Arc<dyn Comm>, mode: &str, ckpt: Option<&Path>, resume: bool, die_at: Option<u64>) -> RunLog {
    let cfg = config(mode);
    let trainer = match (resume, ckpt) {
        (true, Some(dir)) => Trainer::resume(dir, tiny_model(11), Count, cfg).unwrap(),
        _ => Trainer::new(tiny_model(11), Count, cfg).unwrap(),
    };
    let mut t = trainer.with_comm(comm.clone()).unwrap();
    let mut log = RunLog { tokens: vec![], rewards: vec![], rank_rollout_s: vec![], weights: BTreeMap::new() };
    while t.steps_done() < STEPS {
        if die_at == Some(t.steps_done()) && comm.rank() == 1 {
            eprintln!("rank 1: dying at the start of step {}", t.steps_done());
            std::process::exit(3);
        }
        let r = t.step(&mut Quiet).unwrap();
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
    let comm: Arc<dyn Comm> = Arc::new(tlt_comm::mpi::MpiComm::init().unwrap());
    let var = |k: &str| std::env::var(k).ok();
    let mode = var("TLT_DP_MODE").unwrap_or_else(|| "baseline".into());
    let ckpt = var("TLT_DP_CKPT").map(PathBuf::from);
    let die_at = var("TLT_DP_DIE_AT").map(|s| s.parse().unwrap());
    let log = run_rank(comm.clone(), &mode, ckpt.as_deref(), var("TLT_DP_RESUME").is_some(), die_at);
    let path = out.join(format!("rank{}.json", comm.rank()));
    std::fs::write(path, serde_json::to_vec(&log).unwrap()).unwrap();
}

fn mpirun_found() -> bool {
    let found = Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found && std::env::var_os("TLT_REQUIRE_MPI").is_some() {
        panic!("TLT_REQUIRE_MPI is set but `mpirun` is not on the PATH");
    }
    found
}

/// `mpirun -np 2` of this binary with `env`, results in a fresh `out`: (success, seconds, stderr).
fn mpirun(out: &Path, env: &[(&str, String)]) -> (bool, f64, String) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    let mut cmd = Command::new("mpirun");
    // Open MPI refuses root without these, and more ranks than cores without oversubscription.
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("TLT_DP_OUT", out)
        .args(["-np", "2"])
        .arg(std::env::current_exe().unwrap());
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
    let one = run_rank(Arc::new(SelfComm), mode, None, false, None);
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
    let uninterrupted = against_one_rank("baseline", &root);
    against_one_rank("tlt", &root);

    // Rank 1 dies at the start of step 2; rank 0 waits in that step's gather until mpirun ends the job.
    let ckpt = root.join("ckpt");
    let out = root.join("killed");
    let env = |extra: Vec<(&'static str, String)>| {
        let mut v = vec![("TLT_DP_MODE", "baseline".to_string()), ("TLT_DP_CKPT", ckpt.display().to_string())];
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
    let resumed = read_log(&out, 0);
    assert_eq!(resumed.tokens, uninterrupted.tokens[2..], "the resumed steps sampled other tokens");
    assert_eq!(resumed.weights, uninterrupted.weights, "the resumed run ends with other weights");
    println!("resumed from step 2 on 2 ranks: tokens and final weights equal the uninterrupted run's");
    let _ = std::fs::remove_dir_all(&root);
}
