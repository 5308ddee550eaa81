//! Training charts, drawn with [plotters](https://docs.rs/plotters) and written as SVG and PNG.
//!
//! [`training_plots`] draws the standard set of charts for a run's [`StepMetrics`]: line charts and overlaid
//! histograms with a title, axis descriptions, a light grid, a legend when there is more than one series, and
//! ticks that fit the data (integers only on integer axes such as RL steps or counts). PNG text is rasterized
//! from Noto Sans, embedded in the binary, so no system font or font library is needed. Non-finite values are
//! skipped; empty, single-point and constant data give a (possibly empty) chart, never a panic.
//!
//! ```
//! use tlt_rl::metrics::StepMetrics;
//!
//! let dir = std::env::temp_dir().join(format!("tlt-rl-plot-doc-{}", std::process::id()));
//! let metrics: Vec<StepMetrics> =
//!     (0..3).map(|step| StepMetrics { step, reward_mean: step as f64 * 0.2, ..StepMetrics::default() }).collect();
//! let written = tlt_rl::plot::training_plots(&metrics, None, &dir)?;
//! assert_eq!(written.len(), 10);
//! assert!(std::fs::read_to_string(dir.join("reward.svg"))?.contains("Mean reward per step"));
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod axis;
mod chart;
mod compare;

pub use compare::{comparison_plots, pooled_lengths};

use std::path::{Path, PathBuf};

use axis::Scale;
use chart::{Chart, Histogram, LineChart, Series};

use crate::metrics::StepMetrics;
use crate::{Error, Result};

/// Bins of the response-length histogram.
const LENGTH_BINS: usize = 30;

/// The legend name of a run: its `mode`, or `fallback` when unset.
fn run_name(m: &[StepMetrics], fallback: &str) -> String {
    m.iter().rev().map(|s| s.mode.as_str()).find(|s| !s.is_empty()).unwrap_or(fallback).to_string()
}

/// A series of `f(step)` against the step index.
fn per_step(name: impl Into<String>, m: &[StepMetrics], f: impl Fn(&StepMetrics) -> f64) -> Series {
    Series::new(name, m.iter().map(|s| (s.step as f64, f(s))).collect())
}

/// Active requests after each decode step of the rollout of `s`.
fn active_series(name: String, s: &StepMetrics) -> Series {
    Series::steps(name, s.active_requests.iter().enumerate().map(|(i, &n)| (i as f64, n as f64)).collect())
}

/// Draws the standard charts of a run into `out_dir` (created if missing), each as `.svg` and `.png`:
///
/// - `reward`: mean reward per step (and the baseline's, when given);
/// - `response_length`: histogram of response lengths at the first and the last step, overlaid;
/// - `active_requests`: running requests per decode step within the last step's rollout (both runs when given);
/// - `accept_length`: mean accept length per step, i.e. tokens emitted per verify step of speculative decoding;
/// - `step_time`: rollout, train and total seconds per step (plus the baseline's rollout and total);
/// - `rank_times`, only for a data-parallel run (`ranks > 1` in a line): each rank's rollout seconds and its idle
///   wait for the slowest rank, per step.
///
/// The x axes of the per-step charts and of `active_requests` show integer ticks only. Empty inputs give empty
/// charts. Returns the written paths (`<chart>.svg`, `<chart>.png` for each chart, in the order above).
///
/// # Errors
/// [`Error::Io`] if the directory or a file cannot be written, [`Error::Plot`] if plotters fails to draw a chart.
pub fn training_plots(
    metrics: &[StepMetrics],
    baseline: Option<&[StepMetrics]>,
    out_dir: &Path,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let name = run_name(metrics, "run");
    let base_name = baseline.map(|b| {
        let n = run_name(b, "baseline");
        if n == name {
            format!("{n} (baseline)")
        } else {
            n
        }
    });
    let mut written = Vec::new();

    let mut reward = vec![per_step(name.as_str(), metrics, |s| s.reward_mean)];
    if let (Some(b), Some(bn)) = (baseline, &base_name) {
        reward.push(per_step(bn.as_str(), b, |s| s.reward_mean));
    }
    let chart = LineChart {
        title: "Mean reward per step".into(),
        x_label: "RL step".into(),
        y_label: "mean reward".into(),
        series: reward,
        x_scale: Scale::Integer,
        y_scale: Scale::Real,
    };
    written.extend(chart.save(&out_dir.join("reward"))?);

    let lengths = |s: &StepMetrics| s.response_lengths.iter().map(|&l| l as f64).collect::<Vec<_>>();
    let mut hist = Vec::new();
    if let Some(first) = metrics.first() {
        hist.push((format!("step {}", first.step), lengths(first)));
    }
    if let Some(last) = metrics.last().filter(|_| metrics.len() > 1) {
        hist.push((format!("step {}", last.step), lengths(last)));
    }
    let chart = Histogram {
        title: "Response length, first vs last step".into(),
        x_label: "response length (tokens)".into(),
        series: hist,
        bins: LENGTH_BINS,
    };
    written.extend(chart.save(&out_dir.join("response_length"))?);

    let mut active = Vec::new();
    if let Some(last) = metrics.last() {
        active.push(active_series(format!("{name} (step {})", last.step), last));
    }
    if let (Some(last), Some(bn)) = (baseline.and_then(|b| b.last()), &base_name) {
        active.push(active_series(format!("{bn} (step {})", last.step), last));
    }
    let chart = LineChart {
        title: "Active requests during the last rollout".into(),
        x_label: "decode step".into(),
        y_label: "running requests".into(),
        series: active,
        x_scale: Scale::Integer,
        y_scale: Scale::Integer,
    };
    written.extend(chart.save(&out_dir.join("active_requests"))?);

    let chart = LineChart {
        title: "Accept length: tokens per verify step".into(),
        x_label: "RL step".into(),
        y_label: "tokens per verify step (mean)".into(),
        series: vec![per_step(name.as_str(), metrics, |s| s.accept_len)],
        x_scale: Scale::Integer,
        y_scale: Scale::Real,
    };
    written.extend(chart.save(&out_dir.join("accept_length"))?);

    let mut times = vec![
        per_step("rollout_s", metrics, |s| s.rollout_s),
        per_step("train_s", metrics, |s| s.train_s),
        per_step("step_s", metrics, |s| s.step_s),
    ];
    if let (Some(b), Some(bn)) = (baseline, &base_name) {
        times.push(per_step(format!("{bn} rollout_s"), b, |s| s.rollout_s));
        times.push(per_step(format!("{bn} step_s"), b, |s| s.step_s));
    }
    let chart = LineChart {
        title: format!("Step time ({name})"),
        x_label: "RL step".into(),
        y_label: "seconds".into(),
        series: times,
        x_scale: Scale::Integer,
        y_scale: Scale::Real,
    };
    written.extend(chart.save(&out_dir.join("step_time"))?);

    let ranks = metrics.iter().map(|m| m.rank_rollout_s.len()).max().unwrap_or(0);
    if ranks > 1 {
        let at = |v: &[f64], r: usize| v.get(r).copied().unwrap_or(f64::NAN);
        let mut series = Vec::with_capacity(2 * ranks);
        for r in 0..ranks {
            series.push(per_step(format!("rank {r} rollout_s"), metrics, |s| at(&s.rank_rollout_s, r)));
            series.push(per_step(format!("rank {r} idle_s"), metrics, |s| at(&s.rank_idle_s, r)));
        }
        let chart = LineChart {
            title: format!("Rollout and idle time per rank ({name})"),
            x_label: "RL step".into(),
            y_label: "seconds".into(),
            series,
            x_scale: Scale::Integer,
            y_scale: Scale::Real,
        };
        written.extend(chart.save(&out_dir.join("rank_times"))?);
    }
    Ok(written)
}

#[cfg(test)]
mod tests;
