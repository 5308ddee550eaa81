//! `train`'s progress: one bar per run (TLT's, the baseline's) showing the steps done of all, the phase of the
//! step in progress (rollout with its answers finished, reward, update, drafter, eval, ...), the time elapsed and
//! the time left; or nothing but the log lines, for logs that are files (CI, `tee`).

use std::io::IsTerminal;
use std::time::Duration;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use tlt_rl::trainer::Observer;

/// How `train` shows its progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProgressMode {
    /// Bars when stderr is a terminal, plain log lines otherwise.
    Auto,
    /// Bars (log lines written above them).
    Bars,
    /// Plain log lines only.
    Plain,
}

impl ProgressMode {
    /// Whether this mode draws bars here.
    pub fn bars(self) -> bool {
        match self {
            Self::Auto => std::io::stderr().is_terminal(),
            Self::Bars => true,
            Self::Plain => false,
        }
    }

    /// The flag that asks for it (a child process's command line).
    pub fn flag(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Bars => "bars",
            Self::Plain => "plain",
        }
    }
}

/// One run's bar in [`crate::progress_bars`] (none in plain mode): position = steps done, the message = what the
/// step in progress is doing.
pub struct Progress {
    bar: Option<ProgressBar>,
    step: u64,
}

impl Progress {
    /// A bar labelled `label` for a run of `steps` steps, when `mode` draws bars.
    pub fn new(label: &str, steps: u64, mode: ProgressMode) -> Self {
        if !mode.bars() {
            return Self { bar: None, step: 0 };
        }
        let style = ProgressStyle::with_template(
            "{prefix:>8} {bar:24.cyan/blue} {pos}/{len} steps [{elapsed_precise} elapsed, {left} left] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
        // indicatif's own estimate decays its rate over seconds, so a step of minutes sends it to absurd values:
        // the time left is the mean step so far times the steps left.
        .with_key("left", |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
            let left = time_left(state.elapsed(), state.pos(), state.len().unwrap_or(0));
            let _ = match left {
                Some(d) => {
                    let s = d.as_secs();
                    write!(w, "{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                }
                None => write!(w, "--:--:--"),
            };
        });
        let bar = crate::progress_bars().add(ProgressBar::new(steps).with_style(style));
        bar.set_prefix(label.to_string());
        bar.set_message("starting");
        // The clock keeps moving during a long phase.
        bar.enable_steady_tick(Duration::from_millis(500));
        Self { bar: Some(bar), step: 0 }
    }
}

impl Observer for Progress {
    fn on_round(&mut self, running: usize, finished: usize, total: usize, tokens: usize) {
        if let Some(bar) = &self.bar {
            bar.set_message(format!(
                "step {}: rollout, {finished}/{total} answers done, {running} running, {tokens} tokens",
                self.step + 1
            ));
        }
    }

    fn on_phase(&mut self, step: u64, phase: &str) {
        tracing::debug!(step, phase, rss_gb = rss_gb("VmRSS:"), peak_gb = rss_gb("VmHWM:"), "phase starts");
        let Some(bar) = &self.bar else {
            return;
        };
        // Phases inside a step name its index; those after it (checkpoint, export, eval) the steps done.
        let done = step.max(bar.position());
        if done > bar.position() {
            bar.set_position(done);
        }
        self.step = step;
        let what = match phase {
            "checkpoint" | "export" | "eval" => phase.to_string(),
            _ => format!("step {}: {phase}", step + 1),
        };
        bar.set_message(what);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            // Left on the screen, with the run's total time.
            bar.finish_with_message("done");
        }
    }
}

/// The time left after `done` of `total` steps in `elapsed`: the mean step so far times the steps left (`None`
/// before the first step ends).
pub fn time_left(elapsed: Duration, done: u64, total: u64) -> Option<Duration> {
    if done == 0 {
        return None;
    }
    let left = u32::try_from(total.saturating_sub(done)).ok()?;
    let per_step = elapsed.div_f64(done as f64);
    per_step.checked_mul(left)
}

/// A memory figure of this process from `/proc/self/status` (`VmRSS:` now, `VmHWM:` peak) in GB (Linux only).
pub fn rss_gb(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_left_is_the_mean_step_times_the_steps_left() {
        let min = Duration::from_secs(60);
        assert_eq!(time_left(3 * min, 0, 8), None, "no step done yet");
        assert_eq!(time_left(6 * min, 2, 8), Some(18 * min));
        assert_eq!(time_left(6 * min, 8, 8), Some(Duration::ZERO));
    }
}
