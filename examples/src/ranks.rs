//! Data-parallel launch: whether this process is one of several MPI ranks (from the launcher's environment, before
//! MPI is initialised), its communicator, its share of the cores, and re-launching a program under `mpirun`.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tlt_comm::Comm;

/// Set on the ranks a program re-launched under `mpirun` ([`relaunch`]), so they do not re-launch again.
const RELAUNCHED: &str = "TLT_MPI_RELAUNCHED";

/// Reads a rank or size variable that a launcher sets: Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`), MPICH's Hydra
/// and Slurm's `srun` with PMI (`PMI_*`).
fn var(names: &[&str]) -> Option<usize> {
    names.iter().find_map(|n| std::env::var(n).ok()?.parse().ok())
}

/// `(rank, size)` when a launcher started this process as an MPI rank; `None` for a plain process.
pub fn launched() -> Option<(usize, usize)> {
    let size = var(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])?;
    let rank = var(&["OMPI_COMM_WORLD_RANK", "PMI_RANK"]).unwrap_or(0);
    Some((rank, size))
}

/// Ranks sharing this machine (Open MPI and MPICH say; else the job's size).
fn local_ranks() -> usize {
    var(&["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]).or_else(|| launched().map(|(_, n)| n)).unwrap_or(1).max(1)
}

/// Gives this rank its share of the machine's cores for the tensor thread pools (`RAYON_NUM_THREADS`, which
/// candle reads, unless already set), so that ranks × threads fit the cores. Call first thing in `main`, before
/// any thread starts.
pub fn share_cores() {
    if launched().is_none() || std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let threads = (cores / local_ranks()).max(1);
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
}

/// The job this process is a rank of: MPI (feature `mpi`) when a launcher started it, its waits bounded by
/// `deadlines`, else one rank.
///
/// # Errors
/// MPI fails to initialise; or a launcher started several ranks of a binary built without `--features mpi`.
pub fn communicator(deadlines: tlt_comm::Deadlines) -> Result<Arc<dyn Comm>> {
    let _ = deadlines;
    match launched() {
        #[cfg(feature = "mpi")]
        Some(_) => Ok(Arc::new(tlt_comm::mpi::MpiComm::init_with(deadlines).context("initialising MPI")?)),
        #[cfg(not(feature = "mpi"))]
        Some((_, size)) if size > 1 => {
            bail!("launched as one of {size} MPI ranks, but this binary was built without `--features mpi`")
        }
        _ => Ok(Arc::new(tlt_comm::SelfComm)),
    }
}

/// With `ranks > 1` and not already a rank: runs this program again as `ranks` MPI processes (`mpirun -np ranks`,
/// the same arguments) and returns its exit status; `None` when this process should run itself.
///
/// # Errors
/// No `mpirun` on the PATH (install an MPI runtime, e.g. Debian's `openmpi-bin`), or a binary built without
/// `--features mpi`.
pub fn relaunch(ranks: usize) -> Result<Option<std::process::ExitStatus>> {
    if ranks <= 1 || std::env::var_os(RELAUNCHED).is_some() || launched().is_some() {
        return Ok(None);
    }
    if !cfg!(feature = "mpi") {
        bail!("--ranks {ranks} needs a build with `--features mpi` (MPI ranks)");
    }
    if !tlt_comm::launch::mpirun_on_path() {
        bail!("--ranks {ranks} runs `mpirun`, which is not on the PATH: install an MPI runtime (Debian: openmpi-bin)");
    }
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut cmd = tlt_comm::launch::mpirun(ranks);
    cmd.env(RELAUNCHED, "1").arg(exe).args(std::env::args_os().skip(1));
    tracing::info!(ranks, "re-launching under mpirun");
    Ok(Some(cmd.status().context("running mpirun")?))
}
