//! The chaos harness: `train` on a tiny model, killed by `SIGKILL` at seeded points (rollout rounds, optimizer
//! micro-batches and steps, drafter steps, every step of a checkpoint write, half-written metrics lines; one rank
//! of a 2-rank MPI job), resumed (a resumed process may be killed again) until the run completes, and compared with
//! an uninterrupted run: the policy, optimizer, drafter, SD gate, data position and metrics must be the same bit for
//! bit (the drafter on its fixed schedule). The kills are real: the process raises `SIGKILL` on itself at the armed
//! point ([`tlt_model::chaos`]), so nothing is unwound or flushed. A negative control arms the earlier two-rename
//! checkpoint write, kills between its renames and shows that the harness catches the lost checkpoint.
//!
//! Size: `TLT_CHAOS_KILLS` landed kills on one rank (default 40) and `TLT_CHAOS_RANK_KILLS` on two ranks (default
//! 8; skipped without `mpirun` unless `TLT_REQUIRE_MPI` is set); `TLT_CHAOS_SEED` (default 1). `cargo xtask chaos`
//! runs it larger. Each landed kill's point and hit is printed, with the tally per phase.

mod chaos_support;

use std::collections::BTreeMap;

use chaos_support::{Fixture, Rng};

fn var(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn killed_runs_resume_to_the_uninterrupted_result() {
    let fx = Fixture::new("chaos");
    let (kills, rank_kills, seed) =
        (var("TLT_CHAOS_KILLS", 40), var("TLT_CHAOS_RANK_KILLS", 8), var("TLT_CHAOS_SEED", 1));
    let mpi = tlt_comm::launch::mpirun_on_path();
    assert!(
        mpi || std::env::var_os("TLT_REQUIRE_MPI").is_none(),
        "TLT_REQUIRE_MPI is set but `mpirun` is not on the PATH"
    );
    let mut rng = Rng(seed as u64);
    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    let (mut log, mut tried) = (Vec::new(), 0);
    for ranks in [1usize, 2] {
        let want = if ranks == 1 { kills } else { rank_kills };
        if want == 0 {
            continue;
        }
        if ranks == 2 && !mpi {
            println!("SKIP the 2-rank kills: no `mpirun` (install an MPI runtime)");
            continue;
        }
        let reference = fx.run(&format!("reference-{ranks}"), ranks);
        let expected = reference.complete().final_state();
        let mut landed = 0;
        let mut trial = 0;
        while landed < want {
            trial += 1;
            assert!(trial < 4 * want + 20, "only {landed} of {want} kills landed in {trial} trials");
            let run = fx.run(&format!("r{ranks}-t{trial}"), ranks);
            let (kills, armed) = run.complete_with_kills(&mut rng);
            tried += armed;
            if kills.is_empty() {
                continue;
            }
            let state = run.final_state();
            for k in &kills {
                *tally.entry(format!("{}{}", k.phase(), if ranks == 2 { " (2 ranks)" } else { "" })).or_default() += 1;
            }
            landed += kills.len();
            let at: Vec<String> = kills.iter().map(|k| k.to_string()).collect();
            log.push(serde_json::json!({"ranks": ranks, "trial": trial, "kills": at}));
            match chaos_support::first_difference(&expected, &state) {
                None => println!(
                    "{ranks} rank(s), trial {trial}: killed at {}; resumed to the reference, bit for bit",
                    at.join(", ")
                ),
                Some(d) => {
                    panic!("{ranks} rank(s), trial {trial}, killed at {}: the result differs: {d}", at.join(", "))
                }
            }
            run.clean();
        }
    }
    let total: usize = tally.values().sum();
    println!("{total} kills landed ({tried} armed), none lost anything: {tally:?}");
    if let Some(path) = std::env::var_os("TLT_CHAOS_REPORT") {
        let path = std::path::PathBuf::from(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let report = serde_json::json!({"seed": seed, "armed": tried, "landed": total, "per_phase": tally,
            "identical_to_uninterrupted": true, "trials": log});
        std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap()).unwrap();
    }
    let at = |p: &str| tally.iter().filter(|(k, _)| k.starts_with(p)).map(|(_, n)| n).sum::<usize>();
    if kills >= 30 {
        for phase in ["checkpoint write", "rollout", "policy update", "drafter step", "metrics append"] {
            let least = if phase == "checkpoint write" { 5 } else { 1 };
            assert!(at(phase) >= least, "fewer than {least} kills during {phase}: {tally:?}");
        }
    }
    if std::env::var_os("TLT_CHAOS_KEEP").is_none() {
        fx.clean();
    }
}

#[test]
fn the_two_rename_checkpoint_write_loses_the_checkpoint_and_is_caught() {
    let fx = Fixture::new("chaos-control");
    let run = fx.run("two-rename", 1);
    // The second checkpoint write (after step 2) dies between its renames: no `checkpoint/` is left, and nothing
    // recovers the copy moved aside. (Each checkpoint write also writes its drafter directory the same way, first:
    // the fourth pass of the point is the second checkpoint's own.)
    let out = run.train(false, Some("ckpt.two_rename=return;ckpt.two_rename.between=3*off->return"));
    let err = chaos_support::stderr(&out);
    assert!(chaos_support::killed(&out), "the control's kill did not land:\n{err}");
    let passes = format!("tlt-chaos: at ckpt.two_rename.between ({})", run.dir().join("checkpoint").display());
    assert_eq!(err.matches(&passes).count(), 2, "not killed in the second checkpoint write:\n{err}");
    assert!(!run.dir().join("checkpoint").exists(), "the two-rename write left a checkpoint");
    let out = run.train(true, Some("ckpt.two_rename=return"));
    let err = chaos_support::stderr(&out);
    assert!(!out.status.success() && err.contains("no checkpoint in"), "the lost checkpoint went unnoticed:\n{err}");
    // The same kill with today's write: the resume finds the checkpoint and completes the reference run.
    let reference = fx.run("reference", 1);
    let expected = reference.complete().final_state();
    let run = fx.run("renames", 1);
    let out = run.train(false, Some("ckpt.rename.old=3*off->return"));
    let err = chaos_support::stderr(&out);
    assert!(chaos_support::killed(&out), "{err}");
    let passes = format!("tlt-chaos: at ckpt.rename.old ({})", run.dir().join("checkpoint").display());
    assert_eq!(err.matches(&passes).count(), 2, "not killed in the second checkpoint write:\n{err}");
    assert!(!run.dir().join("checkpoint").exists(), "the checkpoint was not moved aside when the kill landed");
    let state = run.complete().final_state();
    assert_eq!(chaos_support::first_difference(&expected, &state), None);
    println!("negative control: the two-rename write killed between its renames lost the checkpoint and `--resume` refused; the same kill point in today's write resumed to the reference");
    fx.clean();
}

/// No rank hangs: rank 1 of a 2-rank job stops itself (`SIGSTOP`) in a rollout round of step 1; rank 0, waiting
/// for it, ends the job once its liveness check has gone unanswered for 3 s (`--rank-silence-s 3`), with an error
/// naming rank 1 and what rank 0 waited for, and the launcher takes the stopped rank down with it. The checkpoint
/// of step 0 is intact: `--resume` completes the run to the uninterrupted one's result, bit for bit.
#[test]
fn a_stopped_rank_ends_the_job_with_an_error_naming_it_and_the_run_resumes() {
    let mpi = tlt_comm::launch::mpirun_on_path();
    assert!(
        mpi || std::env::var_os("TLT_REQUIRE_MPI").is_none(),
        "TLT_REQUIRE_MPI is set but `mpirun` is not on the PATH"
    );
    if !mpi {
        println!("SKIP a_stopped_rank_ends_the_job_with_an_error_naming_it_and_the_run_resumes: no `mpirun`");
        return;
    }
    let fx = Fixture::new("chaos-stop");
    let reference = fx.run("reference-2", 2).complete();
    // Rank 1's rounds per step, from the uninterrupted run: stop half-way through step 1.
    let per_step = reference.hits("rollout.round") / 2 / 4;
    let expected = reference.final_state();
    let run = fx.run("stopped", 2);
    let t = std::time::Instant::now();
    let stop = format!("rollout.round={}*off->return(stop)", per_step + per_step / 2);
    let out = run.train_on(false, Some(&stop), Some(1), &["--rank-silence-s", "3"]);
    let secs = t.elapsed().as_secs_f64();
    let err = chaos_support::stderr(&out);
    assert!(!out.status.success(), "the job survived a stopped rank:\n{err}");
    assert!(err.contains("tlt-chaos: stopped at rollout.round"), "rank 1 did not stop:\n{err}");
    let line =
        err.lines().find(|l| l.contains("stopped waiting for")).unwrap_or_else(|| panic!("no wait error:\n{err}"));
    assert!(line.contains("rank 1 has not answered for 3.0s (stopped, dead or hung"), "{line}");
    let waited: f64 =
        line.split(" after ").nth(1).and_then(|s| s.split('s').next()).and_then(|s| s.parse().ok()).unwrap_or(f64::MAX);
    assert!(waited < 3.0 + 1.0 + 5.0, "rank 0 waited {waited} s (silence limit 3 s, asked after 1 s):\n{line}");
    assert!(secs < 60.0, "the job took {secs:.1} s to end");
    println!("rank 1 stopped: the job ended after {secs:.1} s with: {line}");
    assert!(run.dir().join("checkpoint").join("state.json").exists(), "no checkpoint of step 0 to resume from");
    let state = run.complete().final_state();
    assert_eq!(chaos_support::first_difference(&expected, &state), None, "the resumed run differs");
    println!("resumed after the stopped rank: the run completed to the uninterrupted result, bit for bit");
    fx.clean();
}
