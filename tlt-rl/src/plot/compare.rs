//! The charts of a comparison that [`super::training_plots`] does not draw: the running batch of the last rollout
//! against wall-clock seconds with TLT's speculative rounds marked, accuracy per step, and the response lengths of
//! both runs (histogram and empirical CDF).

use std::path::{Path, PathBuf};

use super::axis::Scale;
use super::chart::{Chart, Histogram, LineChart, Series};
use super::{per_step, LENGTH_BINS};
use crate::metrics::StepMetrics;
use crate::{Error, Result};

/// `(start, end)` seconds of each decode step of `s`'s rollout: the recorded end times, or (in lines written
/// before they existed) the running sum of the steps' durations.
pub(crate) fn round_spans(s: &StepMetrics) -> Vec<(f64, f64)> {
    let recorded = s.round_end_s.len() == s.active_requests.len();
    let mut spans = Vec::with_capacity(s.active_requests.len());
    let mut start = 0.0;
    for i in 0..s.active_requests.len() {
        let end = if recorded { s.round_end_s[i] } else { start + s.round_seconds.get(i).copied().unwrap_or(0.0) };
        spans.push((start, end));
        start = end;
    }
    spans
}

/// The running batch of `s` as a staircase against seconds: each round's batch from its start, then 0 at the
/// end of the last round (so a run that finishes earlier visibly drops earlier).
fn batch_over_time(name: String, s: &StepMetrics) -> Series {
    let spans = round_spans(s);
    let mut points: Vec<(f64, f64)> =
        spans.iter().zip(&s.active_requests).map(|(&(start, _), &n)| (start, n as f64)).collect();
    if let Some(&(_, end)) = spans.last() {
        points.push((end, 0.0));
    }
    Series::steps(name, points)
}

/// A dot in the middle of every round of `s` that speculated, at that round's batch.
fn sd_rounds(name: String, s: &StepMetrics) -> Series {
    let points = round_spans(s)
        .iter()
        .zip(&s.active_requests)
        .zip(&s.round_sd)
        .filter(|(_, &sd)| sd)
        .map(|((&(a, b), &n), _)| (0.5 * (a + b), n as f64))
        .collect();
    Series::dots(name, points)
}

/// Every response length of a run, all steps pooled.
pub fn pooled_lengths(m: &[StepMetrics]) -> Vec<usize> {
    m.iter().flat_map(|s| s.response_lengths.iter().copied()).collect()
}

/// The empirical CDF of `values` as a staircase: the fraction of values `<= x` at each distinct `x`.
fn cdf(name: impl Into<String>, values: &[usize]) -> Series {
    let mut v = values.to_vec();
    v.sort_unstable();
    let n = v.len().max(1) as f64;
    let mut points = Vec::new();
    for (i, &x) in v.iter().enumerate() {
        if v.get(i + 1) != Some(&x) {
            if points.is_empty() {
                points.push((x as f64, 0.0));
            }
            points.push((x as f64, (i + 1) as f64 / n));
        }
    }
    Series::steps(name, points)
}

/// Draws the comparison's own charts into `out_dir` (created if missing), each as `.svg` and `.png`:
///
/// - `running_batch_seconds`: running requests during the last step's rollout of each run against wall-clock
///   seconds from the rollout's start, with a dot on every round where TLT speculated;
/// - `accuracy`: the fraction of correct answers per step, both runs;
/// - `response_length_runs`: histograms of every response length of each run (all steps pooled), overlaid;
/// - `response_length_cdf`: the same lengths' empirical CDFs.
///
/// Returns the written paths in that order.
///
/// # Errors
/// [`Error::Io`] if the directory or a file cannot be written, [`Error::Plot`] if plotters fails to draw a chart.
pub fn comparison_plots(tlt: &[StepMetrics], baseline: &[StepMetrics], out_dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let mut written = Vec::new();
    let mut batch = Vec::new();
    if let Some(last) = tlt.last() {
        batch.push(batch_over_time(format!("TLT (step {})", last.step), last));
    }
    if let Some(last) = baseline.last() {
        batch.push(batch_over_time(format!("baseline (step {})", last.step), last));
    }
    if let Some(last) = tlt.last() {
        batch.push(sd_rounds("TLT: round with SD on".into(), last));
    }
    let chart = LineChart {
        title: "Running batch during the last rollout".into(),
        x_label: "seconds from the rollout's start".into(),
        y_label: "running requests".into(),
        series: batch,
        x_scale: Scale::Real,
        y_scale: Scale::Integer,
    };
    written.extend(chart.save(&out_dir.join("running_batch_seconds"))?);

    let chart = LineChart {
        title: "Accuracy of the sampled answers per step".into(),
        x_label: "RL step".into(),
        y_label: "fraction correct".into(),
        series: vec![per_step("TLT", tlt, |s| s.accuracy), per_step("baseline", baseline, |s| s.accuracy)],
        x_scale: Scale::Integer,
        y_scale: Scale::Real,
    };
    written.extend(chart.save(&out_dir.join("accuracy"))?);

    let (lt, lb) = (pooled_lengths(tlt), pooled_lengths(baseline));
    let as_f64 = |v: &[usize]| v.iter().map(|&l| l as f64).collect::<Vec<_>>();
    let chart = Histogram {
        title: "Response lengths, all steps: TLT vs baseline".into(),
        x_label: "response length (tokens)".into(),
        series: vec![("TLT".into(), as_f64(&lt)), ("baseline".into(), as_f64(&lb))],
        bins: LENGTH_BINS,
    };
    written.extend(chart.save(&out_dir.join("response_length_runs"))?);

    let chart = LineChart {
        title: "Response lengths, all steps: empirical CDF".into(),
        x_label: "response length (tokens)".into(),
        y_label: "fraction of answers at most this long".into(),
        series: vec![cdf("TLT", &lt), cdf("baseline", &lb)],
        x_scale: Scale::Integer,
        y_scale: Scale::Real,
    };
    written.extend(chart.save(&out_dir.join("response_length_cdf"))?);
    Ok(written)
}
