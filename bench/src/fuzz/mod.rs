//! `cargo xtask fuzz <target> --minutes N`: a structure-aware mutation fuzzer for the loaders (GGUF, safetensors,
//! config.json, tokenizer.json, drafter checkpoints, TOML run configs).
//!
//! The parent runs a worker process (`tlt-bench fuzz-worker`) that feeds input after input to the loader and prints
//! one line per input (`<index> <outcome>`). Input `i` is a pure function of the run's seed, `i` and the seed files,
//! so any input can be rebuilt from its index. The parent records a **finding** when the worker
//! - reports a panic (caught with `catch_unwind`; the worker goes on),
//! - dies (an abort, a signal, or an allocation above the cap: [`alloc::Capped`] refuses any single allocation
//!   larger than `max(64 MiB, 16 x input)` and Rust aborts with "memory allocation of N bytes failed"),
//! - or prints nothing for `--hang-s` seconds (a hang; the worker is killed).
//!
//! After a death or a hang the parent restarts the worker after the offending index. Findings are written to
//! `target/fuzz/<target>/findings/` with the reason; the summary (`summary.json`) has the iterations, the
//! distinct outcomes reached (a coarse proxy for coverage) and every finding.

pub mod alloc;
mod targets;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
pub use targets::Target;
use tracing::{info, warn};

/// One finding: the input's index, why, and where its bytes are.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// Input index.
    pub index: u64,
    /// `panic: <message>`, `died: <status and last stderr line>` or `hang`.
    pub reason: String,
    /// The input file.
    pub file: PathBuf,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The target.
    pub target: String,
    /// The run's seed.
    pub seed: u64,
    /// Seconds fuzzed.
    pub seconds: f64,
    /// Inputs fed to the loader.
    pub iterations: u64,
    /// Seed files.
    pub seeds: usize,
    /// How often each outcome (`ok` or an error variant) was reached.
    pub outcomes: BTreeMap<String, u64>,
    /// Worker restarts after a death or a hang.
    pub restarts: u64,
    /// Every finding.
    pub findings: Vec<Finding>,
}

/// The target's command-line name (`run-toml`, ...).
fn name(target: Target) -> String {
    use clap::ValueEnum;
    target.to_possible_value().map_or_else(|| format!("{target:?}"), |v| v.get_name().to_string())
}

fn dir_of(target: Target) -> PathBuf {
    crate::env::workspace_root().join("target").join("fuzz").join(name(target))
}

/// Runs the fuzzer on `target` for `minutes`, starting from `seed`.
pub fn run(target: Target, minutes: f64, seed: u64, hang_s: u64, gguf: &Path) -> Result<Summary> {
    let root = dir_of(target);
    std::fs::create_dir_all(root.join("findings"))?;
    let seeds = targets::seeds(target, &root, gguf)?;
    let exe = std::env::current_exe()?;
    let deadline = Instant::now() + Duration::from_secs_f64(minutes * 60.0);
    let t0 = Instant::now();
    let mut summary = Summary {
        target: name(target),
        seed,
        seconds: 0.0,
        iterations: 0,
        seeds: seeds.len(),
        outcomes: BTreeMap::new(),
        restarts: 0,
        findings: Vec::new(),
    };
    let mut next = 0u64;
    while Instant::now() < deadline {
        let stderr_path = root.join("worker.stderr");
        let mut child = Command::new(&exe)
            .args(["fuzz-worker", &name(target), "--seed", &seed.to_string()])
            .args(["--from", &next.to_string()])
            .arg("--gguf")
            .arg(gguf)
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_path)?)
            .spawn()
            .context("starting the fuzz worker")?;
        let lines = spawn_reader(&mut child)?;
        let mut last: Option<u64> = None;
        let ended = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break None;
            }
            match lines.recv_timeout(Duration::from_secs(hang_s).min(left)) {
                Ok(line) => {
                    let mut parts = line.splitn(3, ' ');
                    let (Some(i), Some(kind)) = (parts.next().and_then(|s| s.parse::<u64>().ok()), parts.next()) else {
                        continue;
                    };
                    match kind {
                        "start" => last = Some(i),
                        "panic" => {
                            let msg = parts.next().unwrap_or("").to_string();
                            summary.findings.push(save(&root, &seeds, seed, i, format!("panic: {msg}"))?);
                        }
                        outcome => {
                            summary.iterations += 1;
                            *summary.outcomes.entry(outcome.to_string()).or_default() += 1;
                            last = None;
                        }
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => break Some("hang".to_string()),
                Err(mpsc::RecvTimeoutError::Timeout) => break None,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = child.wait()?;
                    let err = std::fs::read_to_string(&stderr_path).unwrap_or_default();
                    let tail = err
                        .lines()
                        .find(|l| l.contains("memory allocation of") || l.contains("panicked"))
                        .or_else(|| err.lines().find(|l| !l.trim().is_empty()))
                        .unwrap_or("")
                        .to_string();
                    break Some(format!("died: {status}: {tail}"));
                }
            }
        };
        let _ = child.kill();
        let _ = child.wait();
        match (ended, last) {
            (Some(reason), Some(i)) => {
                warn!(index = i, %reason, "finding");
                summary.findings.push(save(&root, &seeds, seed, i, reason)?);
                summary.restarts += 1;
                next = i + 1;
            }
            (Some(reason), None) => anyhow::bail!("the fuzz worker failed outside any input: {reason}"),
            (None, _) => break,
        }
    }
    summary.seconds = t0.elapsed().as_secs_f64();
    let json = serde_json::to_string_pretty(&summary)?;
    std::fs::write(root.join("summary.json"), &json)?;
    info!(iterations = summary.iterations, findings = summary.findings.len(), "fuzzing done");
    println!("{json}");
    Ok(summary)
}

/// Lines of the worker's stdout, on a channel (so the parent can wait with a timeout).
fn spawn_reader(child: &mut Child) -> Result<mpsc::Receiver<String>> {
    let out = child.stdout.take().context("worker stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok(rx)
}

/// Rebuilds input `i` and writes it to the findings directory.
fn save(root: &Path, seeds: &[targets::Seed], seed: u64, i: u64, reason: String) -> Result<Finding> {
    let (_, bytes) = targets::input(seeds, seed, i);
    let file = root.join("findings").join(format!("input-{seed}-{i}"));
    std::fs::write(&file, &bytes)?;
    std::fs::write(file.with_extension("reason"), &reason)?;
    Ok(Finding { index: i, reason, file })
}

thread_local! {
    /// Whether the worker is inside the loader (its panics are findings, reported on stdout).
    static INSIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The worker: feeds inputs `from, from + 1, ...` to the loader until killed.
pub fn worker(target: Target, seed: u64, from: u64, gguf: &Path) -> Result<()> {
    let root = dir_of(target);
    let seeds = targets::seeds(target, &root, gguf)?;
    let work = root.join(format!("work-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    // A panic inside an input is a finding, reported on stdout; any other panic is the harness's own and is printed.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if INSIDE.with(std::cell::Cell::get) {
            return;
        }
        default_hook(info);
    }));
    let stdout = std::io::stdout();
    for i in from.. {
        let (which, bytes) = targets::input(&seeds, seed, i);
        writeln!(stdout.lock(), "{i} start")?;
        alloc::set_cap((64usize << 20).max(16 * bytes.len()));
        INSIDE.with(|c| c.set(true));
        let r = std::panic::catch_unwind(|| targets::exercise(target, &seeds, which, &bytes, &work));
        INSIDE.with(|c| c.set(false));
        alloc::set_cap(0);
        let mut out = stdout.lock();
        match r {
            Ok(Ok(outcome)) => writeln!(out, "{i} {outcome}")?,
            Ok(Err(e)) => writeln!(out, "{i} harness-error {e:#}")?,
            Err(p) => {
                let msg = p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied());
                writeln!(out, "{i} panic {}", msg.unwrap_or("").replace('\n', " "))?;
                writeln!(out, "{i} panicked")?;
            }
        }
        out.flush()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed of every target gives `Ok` or a typed error through the fuzzer's own harness, under its
    /// allocation cap (a refused allocation would abort this test binary). The findings themselves are kept as
    /// regression inputs beside the loaders they broke (`tlt-model`, `tlt-drafter`, `tlt-rl`: `tests/fuzz-regressions/`).
    #[test]
    fn seeds_load_through_the_harness() {
        let gguf = std::env::var_os("TLT_SMOLLM2_GGUF").map(PathBuf::from);
        let root = std::env::temp_dir().join(format!("tlt-fuzz-seeds-{}", std::process::id()));
        let mut checked = 0;
        for target in [
            Target::Gguf,
            Target::Safetensors,
            Target::ConfigJson,
            Target::TokenizerJson,
            Target::Drafter,
            Target::RunToml,
        ] {
            let gguf = match (&gguf, matches!(target, Target::Gguf | Target::TokenizerJson)) {
                (Some(g), _) => g.clone(),
                (None, true) => {
                    println!("SKIPPED {}: its seeds come from the SmolLM2 GGUF (set TLT_SMOLLM2_GGUF)", name(target));
                    continue;
                }
                (None, false) => PathBuf::new(),
            };
            let dir = root.join(name(target));
            let seeds = targets::seeds(target, &dir, &gguf).expect("seeds");
            for (case, seed) in seeds.iter().enumerate() {
                alloc::set_cap((64usize << 20).max(16 * seed.bytes().len()));
                let r = std::panic::catch_unwind(|| {
                    targets::exercise(target, &seeds, case, seed.bytes(), &dir.join("work"))
                });
                alloc::set_cap(0);
                let outcome = r.unwrap_or_else(|_| panic!("{}: seed {case} panicked", name(target))).expect("harness");
                // A GGUF seed is the file's first 3 MiB: its weights are cut off, so the full load must fail.
                let want = if target == Target::Gguf { "load:Malformed" } else { "ok" };
                assert_eq!(outcome, want, "{}: seed {case}", name(target));
                checked += 1;
            }
        }
        let _ = std::fs::remove_dir_all(&root);
        assert!(checked >= 5, "only {checked} seeds checked");
    }
}
