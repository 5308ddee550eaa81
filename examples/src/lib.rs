//! Shared bits of the example programs (`generate`, `train`): where the default model lives, logging, the
//! data-parallel launch (MPI ranks), the compact end of `train --mode compare` ([`compare`]), its response-length
//! test ([`lengths`]) and its HTML page ([`report`]), and the progress bars that logging writes around
//! ([`progress_bars`]).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

pub mod compare;
pub mod lengths;
pub mod progress;
pub mod ranks;
pub mod report;

/// The progress bars of this process, once [`progress_bars`] made them.
static BARS: std::sync::OnceLock<indicatif::MultiProgress> = std::sync::OnceLock::new();

/// The process's one set of progress bars on stderr: log lines ([`init_logging`]) are written above them (the
/// bars hidden while a line is written), so neither tears the other.
pub fn progress_bars() -> &'static indicatif::MultiProgress {
    BARS.get_or_init(indicatif::MultiProgress::new)
}

/// `tracing` to stderr, filtered by `RUST_LOG` (default `info`), coloured on a terminal; each line prefixed by
/// `[rank r/n] ` when this process is one of several MPI ranks ([`ranks::launched`]).
pub fn init_logging() {
    let prefix: Arc<str> = match ranks::launched() {
        Some((rank, size)) if size > 1 => format!("[rank {rank}/{size}] ").into(),
        _ => "".into(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(move || Prefixed { prefix: prefix.clone(), line: Vec::new() })
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// One log event, written to stderr in one piece after `prefix` when dropped (the formatter writes an event
/// through a fresh writer).
struct Prefixed {
    prefix: Arc<str>,
    line: Vec<u8>,
}

impl Write for Prefixed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.line.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Prefixed {
    fn drop(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let mut out = Vec::with_capacity(self.prefix.len() + self.line.len());
        out.extend_from_slice(self.prefix.as_bytes());
        out.extend_from_slice(&self.line);
        // Logging has nowhere to report its own failure.
        let write = || {
            let _ = std::io::stderr().lock().write_all(&out);
        };
        match BARS.get() {
            Some(bars) => bars.suspend(write),
            None => write(),
        }
    }
}

pub use tlt_model::assets::SMOLLM2_GGUF;

/// The default model: `$TLT_SMOLLM2_GGUF`, else under `$TLT_CACHE`, else under `<workspace>/.cache`.
pub fn default_model() -> PathBuf {
    tlt_model::assets::smollm2_gguf()
}

/// The workspace README's Rust examples, compiled and run as doc tests (what a new user copies must work).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
