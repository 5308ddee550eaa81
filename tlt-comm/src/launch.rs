//! Starting ranks with `mpirun` (Open MPI's or MPICH's): the command and whether it is there. Used by programs
//! that re-launch themselves as several ranks and by the tests that run MPI jobs.

use std::process::Command;

/// Whether an `mpirun` runs from the `PATH`.
pub fn mpirun_on_path() -> bool {
    Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// `mpirun -np <ranks>`, ready for the program and its arguments. Open MPI refuses more ranks than cores without
/// oversubscription, and root (containers, CI) without an explicit opt-in: both are given, as Open MPI 4 and 5
/// (PRRTE) read them (MPICH ignores them).
pub fn mpirun(ranks: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.env("OMPI_MCA_rmaps_base_oversubscribe", "1").env("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe");
    if is_root() {
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    cmd.args(["-np", &ranks.to_string()]);
    cmd
}

/// Whether this process runs as root (Linux: `/proc/self/status`; elsewhere false).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}
