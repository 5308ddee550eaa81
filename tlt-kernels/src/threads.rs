//! The kernels' default thread count, read by the GEMM, the attention and the spinning team that runs them (a
//! module of its own so that the team does not import the GEMM for it).

/// The default GEMM and attention thread count (cached): `TLT_NUM_THREADS` when set to a positive number (as
/// `RAYON_NUM_THREADS` and `OMP_NUM_THREADS` do for their pools), else the number of cores. A test runner that runs
/// one test process per core sets it to 1: two spinning teams of all the cores on the same cores wait on each
/// other's descheduled helpers.
pub fn default_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        threads_from_env(std::env::var("TLT_NUM_THREADS").ok().as_deref(), cores)
    })
}

/// `TLT_NUM_THREADS`'s value if it is a positive number, else `cores` (an unset, empty, zero or malformed value
/// falls back: a wrong setting must not make the kernels fail).
fn threads_from_env(value: Option<&str>, cores: usize) -> usize {
    value.and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or(cores)
}

#[cfg(test)]
mod tests {
    use super::threads_from_env;

    #[test]
    fn tlt_num_threads_overrides_the_core_count_only_when_positive() {
        assert_eq!(threads_from_env(Some("1"), 8), 1);
        assert_eq!(threads_from_env(Some(" 3 "), 8), 3);
        assert_eq!(threads_from_env(None, 8), 8);
        for bad in ["", "0", "-2", "two"] {
            assert_eq!(threads_from_env(Some(bad), 8), 8, "{bad:?}");
        }
    }
}
