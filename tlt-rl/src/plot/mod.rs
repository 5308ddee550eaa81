//! Dependency-free training charts: line charts and overlaid histograms, written as SVG (hand-written XML) and
//! PNG (a small built-in rasterizer with an 8×8 bitmap font, encoded by `png`).
//!
//! Both outputs come from one layout, so they agree: "nice" ticks (1, 2 or 5 × 10^k, see [`nice_ticks`]) with
//! labels and a light grid, a title, axis labels, a legend when there is more than one series, and a fixed
//! palette of distinct colours. Non-finite points are skipped; empty, single-point and constant data render
//! without panicking. [`training_plots`] draws the standard set of charts for a run's [`StepMetrics`].
//!
//! ```
//! use tlt_rl::plot::{LineChart, Series};
//!
//! let chart = LineChart {
//!     title: "reward".into(),
//!     x_label: "step".into(),
//!     y_label: "mean reward".into(),
//!     series: vec![Series::new("tlt", vec![(0.0, 0.1), (1.0, 0.4), (2.0, 0.5)])],
//! };
//! let svg = chart.to_svg();
//! assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
//! let png = chart.to_png(320, 200)?;
//! assert_eq!(&png[1..4], b"PNG");
//! # Ok::<(), tlt_rl::Error>(())
//! ```

mod raster;
mod scene;
mod svg;
mod ticks;

use std::path::{Path, PathBuf};

pub use ticks::nice_ticks;

use crate::metrics::{write_atomic, StepMetrics};
use crate::{Error, Result};

/// Width of the SVG, and of the PNG written by `save`, in pixels.
pub const DEFAULT_WIDTH: u32 = 1200;
/// Height of the SVG, and of the PNG written by `save`, in pixels.
pub const DEFAULT_HEIGHT: u32 = 750;
/// Smallest PNG side accepted by `to_png`.
pub const MIN_SIDE: u32 = 64;
/// Largest PNG side accepted by `to_png`.
pub const MAX_SIDE: u32 = 8192;

/// One named line of a [`LineChart`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// `(x, y)` points, drawn in order; points with a non-finite coordinate are skipped.
    pub points: Vec<(f64, f64)>,
    /// Draw as a step function (hold each `y` until the next `x`) instead of straight segments.
    pub step: bool,
}

impl Series {
    /// A series drawn with straight segments.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self { name: name.into(), points, step: false }
    }

    /// A series drawn as a step function.
    pub fn steps(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self { name: name.into(), points, step: true }
    }

    /// A series of `ys` against their index `0, 1, 2, …`.
    pub fn from_ys(name: impl Into<String>, ys: impl IntoIterator<Item = f64>) -> Self {
        Self::new(name, ys.into_iter().enumerate().map(|(i, y)| (i as f64, y)).collect())
    }
}

/// A line chart of one or more [`Series`] on shared axes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LineChart {
    /// Title above the chart.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label beside the y axis.
    pub y_label: String,
    /// The lines, coloured in palette order.
    pub series: Vec<Series>,
}

/// Overlaid histograms of one or more named value sets, with shared bins spanning all finite values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Title above the chart.
    pub title: String,
    /// Label under the x axis (the y axis is "count").
    pub x_label: String,
    /// `(name, values)` per series, drawn translucent in palette order; non-finite values are skipped.
    pub series: Vec<(String, Vec<f64>)>,
    /// Number of bins (0 is treated as 1).
    pub bins: usize,
}

fn check_size(width: u32, height: u32) -> Result<()> {
    let ok = |s: u32| (MIN_SIDE..=MAX_SIDE).contains(&s);
    if ok(width) && ok(height) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "png size {width}x{height} out of range: each side must be in {MIN_SIDE}..={MAX_SIDE}"
        )))
    }
}

/// `path` with `.ext` appended to its file name (unlike `with_extension`, dots already in the name are kept).
fn with_ext(path: &Path, ext: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

/// Writes `<path>.svg` and `<path>.png` (at the default size), each atomically; returns both paths.
fn save_scene(path: &Path, svg: String, png: Vec<u8>) -> Result<[PathBuf; 2]> {
    let (svg_path, png_path) = (with_ext(path, "svg"), with_ext(path, "png"));
    write_atomic(&svg_path, svg.as_bytes())?;
    write_atomic(&png_path, &png)?;
    Ok([svg_path, png_path])
}

macro_rules! chart_outputs {
    ($ty:ty, $layout:path) => {
        impl $ty {
            /// The chart as a standalone SVG document of [`DEFAULT_WIDTH`] × [`DEFAULT_HEIGHT`].
            pub fn to_svg(&self) -> String {
                svg::render(&$layout(self, DEFAULT_WIDTH, DEFAULT_HEIGHT))
            }

            /// The chart as an RGB8 PNG of `width` × `height` pixels.
            ///
            /// # Errors
            /// [`Error::InvalidArgument`] if a side is outside [`MIN_SIDE`]`..=`[`MAX_SIDE`].
            pub fn to_png(&self, width: u32, height: u32) -> Result<Vec<u8>> {
                check_size(width, height)?;
                raster::render(&$layout(self, width, height))
            }

            /// Writes `<path_without_ext>.svg` and `<path_without_ext>.png` (at the default size), each
            /// atomically (temporary file, then rename), creating parent directories.
            ///
            /// # Errors
            /// [`Error::Io`] if a file cannot be written.
            pub fn save(&self, path_without_ext: impl AsRef<Path>) -> Result<()> {
                self.save_paths(path_without_ext.as_ref()).map(|_| ())
            }

            fn save_paths(&self, path: &Path) -> Result<[PathBuf; 2]> {
                save_scene(path, self.to_svg(), self.to_png(DEFAULT_WIDTH, DEFAULT_HEIGHT)?)
            }
        }
    };
}

chart_outputs!(LineChart, scene::line_chart);
chart_outputs!(Histogram, scene::histogram);

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
/// - `accept_length`: mean accepted length per step;
/// - `step_time`: rollout, train and total seconds per step (plus the baseline's rollout and total).
///
/// Empty inputs give empty charts. Returns the written paths.
///
/// # Errors
/// [`Error::Io`] if the directory or a file cannot be written.
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
        y_label: "reward".into(),
        series: reward,
    };
    written.extend(chart.save_paths(&out_dir.join("reward"))?);

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
    written.extend(chart.save_paths(&out_dir.join("response_length"))?);

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
    };
    written.extend(chart.save_paths(&out_dir.join("active_requests"))?);

    let chart = LineChart {
        title: "Mean accepted length per step".into(),
        x_label: "RL step".into(),
        y_label: "accepted tokens / speculative step".into(),
        series: vec![per_step(name.as_str(), metrics, |s| s.accept_len)],
    };
    written.extend(chart.save_paths(&out_dir.join("accept_length"))?);

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
    };
    written.extend(chart.save_paths(&out_dir.join("step_time"))?);
    Ok(written)
}

#[cfg(test)]
mod tests;
