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
