//! What the verifiers share: their [`Verdict`] and the [`Deadline`] that bounds their parsing and evaluation. It
//! imports nothing of the task module, so the verifiers (`answer`, `expr`, `countdown_verify`) and the scoring in
//! `task/mod.rs` that calls them all import it without importing each other.

use std::time::{Duration, Instant};

/// What a verifier concluded, before it is turned into a [`Score`](super::Score).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// No answer in the required format.
    Unformatted,
    /// A formatted but wrong (or unparsable) answer.
    Wrong,
    /// A formatted, correct answer.
    Correct,
    /// The deadline passed.
    TimedOut,
}

/// The deadline passed (the error of deadline-checked helpers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimedOut;

/// A deadline checked from inside parser and evaluator loops (the clock is read every 64 ticks, the first included).
#[derive(Debug, Clone)]
pub(crate) struct Deadline {
    end: Option<Instant>,
    ticks: u32,
    expired: bool,
}

impl Deadline {
    /// No deadline.
    pub(crate) fn none() -> Self {
        Self { end: None, ticks: 0, expired: false }
    }

    /// `ms` milliseconds from now (0: already expired at the first check).
    pub(crate) fn after_ms(ms: u64) -> Self {
        Self { end: Instant::now().checked_add(Duration::from_millis(ms)), ticks: 0, expired: false }
    }

    /// One step of work: `Err(TimedOut)` once the deadline has passed.
    pub(crate) fn tick(&mut self) -> std::result::Result<(), TimedOut> {
        if !self.expired {
            if let Some(end) = self.end {
                if self.ticks.is_multiple_of(64) && Instant::now() >= end {
                    self.expired = true;
                }
                self.ticks = self.ticks.wrapping_add(1);
            }
        }
        if self.expired {
            Err(TimedOut)
        } else {
            Ok(())
        }
    }
}
