//! Facts recorded next to every benchmark figure: the machine, the commit, the time, and a memory-bandwidth probe.

use std::process::Command;
use std::time::Instant;

use serde::Serialize;

/// The machine a benchmark ran on.
#[derive(Debug, Clone, Serialize)]
pub struct MachineInfo {
    /// `model name` from `/proc/cpuinfo` (`"unknown"` elsewhere).
    pub cpu_model: String,
    /// Logical CPUs available to this process (`nproc`).
    pub nproc: usize,
    /// `RAYON_NUM_THREADS` as set in the environment, if it was.
    pub rayon_num_threads: Option<String>,
    /// Threads candle's CPU kernels use (`RAYON_NUM_THREADS` when set, else all logical CPUs).
    pub candle_threads: usize,
    /// `target_arch` and `target_os` of this build.
    pub target: String,
}

impl MachineInfo {
    /// Reads the facts of the current machine.
    pub fn collect() -> Self {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        Self {
            cpu_model,
            nproc: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            rayon_num_threads: std::env::var("RAYON_NUM_THREADS").ok(),
            candle_threads: candle_core::utils::get_num_threads(),
            target: format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS),
        }
    }
}

/// `git rev-parse HEAD` of the workspace, with `-dirty` when the work tree has changes; `"unknown"` without git.
pub fn git_commit() -> String {
    let root = crate::env::workspace_root();
    let run = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(&root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "HEAD"]) {
        Some(head) => {
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        None => "unknown".into(),
    }
}

pub use tlt_rl::metrics::utc_timestamp;

/// How the read bandwidth of a bench run was measured (recorded in its JSON).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Probe {
    /// What it does.
    pub method: &'static str,
    /// Buffer size, MiB.
    pub buffer_mib: usize,
    /// Passes; the best is kept.
    pub passes: usize,
    /// Threads.
    pub threads: usize,
}

impl Probe {
    /// Runs [`read_bandwidth_gbs`] with 5 passes on `threads` threads; returns GB/s and the description.
    pub fn run(mib: usize, threads: usize) -> (f64, Probe) {
        let probe = Probe {
            method: "sum of an f32 buffer, 16 accumulators, best pass",
            buffer_mib: mib.max(512),
            passes: 5,
            threads,
        };
        (read_bandwidth_gbs(mib, probe.passes, threads), probe)
    }
}

/// A STREAM-style read-bandwidth probe, in GB/s (10^9 bytes per second).
///
/// Sums a `mib` MiB f32 buffer (at least 512 MiB, far larger than any cache), split across `threads` scoped
/// threads, with 16 independent accumulators so the loop vectorizes and is bound by memory, not by the add
/// latency; returns the best of `reps` passes (wall time of the slowest thread). Use the thread count of the
/// kernel it is the yardstick for.
pub fn read_bandwidth_gbs(mib: usize, reps: usize, threads: usize) -> f64 {
    let n = mib.max(512) * (1 << 20) / std::mem::size_of::<f32>();
    let buf: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let part = n.div_ceil(threads.max(1));
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        std::thread::scope(|s| {
            for chunk in buf.chunks(part) {
                s.spawn(move || std::hint::black_box(sum_f32(std::hint::black_box(chunk))));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * std::mem::size_of::<f32>()) as f64 / best / 1e9
}

fn sum_f32(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = xs.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_matches_naive() {
        let xs: Vec<f32> = (0..1000).map(|i| (i % 5) as f32).collect();
        assert_eq!(sum_f32(&xs), xs.iter().sum::<f32>());
    }
}
