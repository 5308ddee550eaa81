//! The MPI engine across processes: `mpirun -np 2` (and 3) runs `tlt-comm-check`, which checks every collective and
//! message on every rank. Without `mpirun` on the PATH the test says SKIP (`TLT_REQUIRE_MPI=1`, set by
//! `cargo xtask test`, turns that into a failure).

use tlt_comm::launch::mpirun;

fn mpirun_found() -> bool {
    let found = tlt_comm::launch::mpirun_on_path();
    if !found && std::env::var_os("TLT_REQUIRE_MPI").is_some() {
        panic!("TLT_REQUIRE_MPI is set but `mpirun` is not on the PATH");
    }
    found
}

#[test]
fn every_operation_across_two_and_three_processes() {
    if !mpirun_found() {
        println!("SKIP every_operation_across_two_and_three_processes: no `mpirun` (install an MPI runtime)");
        return;
    }
    for n in [2, 3] {
        let out =
            mpirun(n).arg(env!("CARGO_BIN_EXE_tlt-comm-check")).output().unwrap_or_else(|e| panic!("mpirun: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        print!("{stdout}");
        assert!(out.status.success(), "mpirun -np {n} failed: {}{}", stdout, String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(stdout.contains(&format!("rank {r} of {n}: ")), "rank {r} of {n} did not report: {stdout}");
        }
    }
}

/// A rank that closes with a message nobody takes aborts the job within `DRAIN_TIMEOUT` (10 s) instead of hanging
/// it (a rank leaving on an error while the others wait elsewhere).
#[test]
fn a_rank_closing_with_an_undelivered_message_aborts_the_job() {
    if !mpirun_found() {
        println!(
            "SKIP a_rank_closing_with_an_undelivered_message_aborts_the_job: no `mpirun` (install an MPI runtime)"
        );
        return;
    }
    let t = std::time::Instant::now();
    let out = mpirun(2)
        .env("TLT_COMM_CHECK_UNDELIVERED", "1")
        .arg(env!("CARGO_BIN_EXE_tlt-comm-check"))
        .output()
        .unwrap_or_else(|e| panic!("mpirun: {e}"));
    let secs = t.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("undelivered message: mpirun returned {:?} after {secs:.1} s", out.status.code());
    assert!(!out.status.success(), "the job ended normally with an undelivered message");
    assert!(stderr.contains("aborting the MPI job"), "{stderr}");
    assert!(secs < 40.0, "took {secs:.1} s");
}

/// `mpirun -np 2 tlt-comm-check` with rank 1 late for a barrier (`late`: `stop` or milliseconds of computing) under
/// `deadlines` (`<wait ms>,<silence ms>`): (success, seconds, output).
fn late(late: &str, deadlines: &str) -> (bool, f64, String) {
    let t = std::time::Instant::now();
    let out = mpirun(2)
        .env("TLT_COMM_CHECK_LATE", late)
        .env("TLT_COMM_CHECK_DEADLINES", deadlines)
        .arg(env!("CARGO_BIN_EXE_tlt-comm-check"))
        .output()
        .unwrap_or_else(|e| panic!("mpirun: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), t.elapsed().as_secs_f64(), text)
}

/// No wait is unbounded: a rank stopped with SIGSTOP ends the job after the silence limit (2 s) with an error
/// naming it and what rank 0 waited for; a rank that computes for 4 s still answers, so the same limits let the
/// barrier complete; and a rank that computes past the wait limit (1.5 s) ends the job with an error saying it
/// answers and what it is doing.
#[test]
fn a_stopped_or_late_rank_ends_the_wait_with_an_error_naming_it() {
    if !mpirun_found() {
        println!("SKIP a_stopped_or_late_rank_ends_the_wait_with_an_error_naming_it: no `mpirun`");
        return;
    }
    let (ok, secs, text) = late("stop", "60000,2000");
    println!("rank 1 stopped: mpirun returned after {secs:.1} s:\n{text}");
    assert!(!ok, "the job survived a stopped rank:\n{text}");
    assert!(text.contains("rank 0 stopped waiting for barrier"), "{text}");
    assert!(text.contains("rank 1 has not answered for 2.0s (stopped, dead or hung"), "{text}");
    assert!(secs < 30.0, "took {secs:.1} s to end the job");

    let (ok, secs, text) = late("4000", "60000,2000");
    assert!(ok, "a busy rank that answers failed the job:\n{text}");
    assert!(text.contains("rank 0 of 2: barrier after 4.") || text.contains("rank 0 of 2: barrier after 3."), "{text}");
    println!("rank 1 computing for 4 s under a 2 s silence limit: the barrier completed ({secs:.1} s)");

    let (ok, secs, text) = late("6000", "1500,5000");
    println!("rank 1 computing past the 1.5 s wait limit: mpirun returned after {secs:.1} s:\n{text}");
    assert!(!ok, "a wait past its limit did not end the job:\n{text}");
    assert!(text.contains("rank 0 stopped waiting for barrier") && text.contains("rank 1 answers"), "{text}");
}

/// Buffers past MPI's `int` count (2^31 + 5 elements, where rsmpi panics on a whole slice) go as chunks: a
/// broadcast of bytes across two ranks and an f32 all-reduce on one (about 4.5 GiB, then 9 GiB of memory; 40 s on
/// 2 cores).
#[test]
fn buffers_past_mpis_int_count_go_as_chunks() {
    if !mpirun_found() {
        println!("SKIP buffers_past_mpis_int_count_go_as_chunks: no `mpirun`");
        return;
    }
    for (what, n) in [("bytes", 2), ("f32", 1)] {
        let out = mpirun(n)
            .env("TLT_COMM_CHECK_PAST_INT", what)
            .arg(env!("CARGO_BIN_EXE_tlt-comm-check"))
            .output()
            .unwrap_or_else(|e| panic!("mpirun: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        print!("{stdout}");
        assert!(out.status.success(), "{what} on {n} rank(s): {stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert!((0..n).all(|r| stdout.contains(&format!("rank {r} of {n}: 2147483653 {what}"))), "{stdout}");
    }
}
