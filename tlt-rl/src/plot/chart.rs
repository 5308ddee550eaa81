//! The two chart kinds, drawn with plotters on any backend: [`LineChart`] and [`Histogram`], each rendered as an
//! SVG document or an RGB PNG.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;

use super::axis::{Axis, Scale, MAX_TICKS};
use crate::metrics::write_atomic;
use crate::{Error, Result};

/// Width of the charts written by [`Chart::save`], in pixels.
pub(crate) const DEFAULT_WIDTH: u32 = 1200;
/// Height of the charts written by [`Chart::save`], in pixels.
pub(crate) const DEFAULT_HEIGHT: u32 = 750;
/// Smallest side accepted by [`Chart::to_png`] and [`Chart::to_svg`].
pub(crate) const MIN_SIDE: u32 = 64;
/// Largest side accepted by [`Chart::to_png`] and [`Chart::to_svg`].
pub(crate) const MAX_SIDE: u32 = 8192;

/// The font family every text is drawn in; [`ensure_font`] registers the embedded font under this name.
const FONT: &str = "sans-serif";

/// Series colours, in order (colour-blind friendly, after Okabe & Ito).
pub(crate) const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(230, 159, 0),
    RGBColor(0, 0, 0),
];

/// What plotters' drawing calls return on backend `DB`.
type Drawn<T, DB> = Result<T, DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// A chart context with our axes on both sides.
type Plot<'a, DB> = ChartContext<'a, DB, Cartesian2d<Axis, Axis>>;

/// Registers Noto Sans (embedded in the binary) with plotters once, so that text is measured and rasterized
/// without any system font.
fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_ok());
    if ok {
        Ok(())
    } else {
        Err(Error::plot("font", "the embedded Noto Sans font could not be parsed"))
    }
}

/// One named line of a [`LineChart`].
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Series {
    /// Legend name.
    pub name: String,
    /// `(x, y)` points, drawn in order; points with a non-finite coordinate are skipped.
    pub points: Vec<(f64, f64)>,
    /// Draw as a step function (hold each `y` until the next `x`) instead of straight segments.
    pub step: bool,
    /// Draw each point as a dot and no line (marks on another series, such as the rounds where SD ran).
    pub dots: bool,
}

impl Series {
    /// A series drawn with straight segments.
    pub(crate) fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self { name: name.into(), points, step: false, dots: false }
    }

    /// A series drawn as dots, one per point, unconnected.
    pub(crate) fn dots(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self { name: name.into(), points, step: false, dots: true }
    }

    /// A series drawn as a step function.
    pub(crate) fn steps(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self { name: name.into(), points, step: true, dots: false }
    }

    /// The finite points, expanded into a staircase for a step series.
    pub(super) fn path(&self) -> Vec<(f64, f64)> {
        let finite: Vec<_> = self.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
        if !self.step {
            return finite;
        }
        let mut path = Vec::with_capacity(finite.len() * 2);
        for (i, &(x, y)) in finite.iter().enumerate() {
            if i > 0 {
                path.push((x, finite[i - 1].1));
            }
            path.push((x, y));
        }
        path
    }
}

/// A line chart of one or more [`Series`] on shared axes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LineChart {
    /// Title above the chart.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label beside the y axis.
    pub y_label: String,
    /// The lines, coloured in palette order.
    pub series: Vec<Series>,
    /// Values the x axis shows (integer for step indices).
    pub x_scale: Scale,
    /// Values the y axis shows (integer for counts).
    pub y_scale: Scale,
}

/// Overlaid histograms of one or more named value sets, with shared bins spanning all finite values.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Histogram {
    /// Title above the chart.
    pub title: String,
    /// Label under the x axis (the y axis is "count").
    pub x_label: String,
    /// `(name, values)` per series, drawn translucent in palette order; non-finite values are skipped.
    pub series: Vec<(String, Vec<f64>)>,
    /// Number of bins (0 is treated as 1, at most 1000).
    pub bins: usize,
}

/// Text and spacing sizes, in pixels, scaled with the picture (text less than linearly, to stay readable).
struct Sizes {
    title: f64,
    desc: f64,
    tick: f64,
    margin: u32,
    stroke: u32,
    /// Length of a legend's sample line or box.
    mark: u32,
}

impl Sizes {
    fn new((w, h): (u32, u32)) -> Self {
        let s =
            (f64::from(w) / f64::from(DEFAULT_WIDTH)).min(f64::from(h) / f64::from(DEFAULT_HEIGHT)).clamp(0.05, 4.0);
        let text = s.sqrt();
        Self {
            title: 32.0 * text,
            desc: 22.0 * text,
            tick: 18.0 * text,
            margin: (16.0 * s).round().max(2.0) as u32,
            stroke: (2.5 * s).round().max(1.0) as u32,
            mark: (36.0 * text).round() as u32,
        }
    }

    /// Room left of the plot for the y tick labels (`widest` characters) and the rotated y description.
    fn y_label_area(&self, widest: usize) -> u32 {
        (self.tick * 0.6 * widest as f64 + self.desc * 1.6 + 12.0 * self.tick / 18.0).round() as u32
    }

    /// Room under the plot for the x tick labels and the x description.
    fn x_label_area(&self) -> u32 {
        (self.tick * 1.6 + self.desc * 1.6).round() as u32
    }
}

/// A chart that plotters can draw on any backend.
pub(crate) trait Chart {
    /// The chart's title, also used in error messages.
    fn title(&self) -> &str;

    /// Draws the chart onto `root`.
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn<(), DB>;

    /// The chart as a standalone SVG document of `width` × `height`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a side outside [`MIN_SIDE`]`..=`[`MAX_SIDE`], [`Error::Plot`] if plotters
    /// fails.
    fn to_svg(&self, width: u32, height: u32) -> Result<String> {
        check_size(width, height)?;
        ensure_font()?;
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
            self.draw(&root).and_then(|()| root.present()).map_err(|e| Error::plot(self.title(), e.to_string()))?;
        }
        Ok(svg)
    }

    /// The chart as an RGB8 PNG of `width` × `height` pixels.
    ///
    /// # Errors
    /// As [`Chart::to_svg`], and [`Error::Plot`] if the PNG cannot be encoded.
    fn to_png(&self, width: u32, height: u32) -> Result<Vec<u8>> {
        check_size(width, height)?;
        ensure_font()?;
        let mut rgb = vec![0u8; width as usize * height as usize * 3];
        {
            let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
            self.draw(&root).and_then(|()| root.present()).map_err(|e| Error::plot(self.title(), e.to_string()))?;
        }
        encode_png(&rgb, width, height).map_err(|e| Error::plot(self.title(), format!("png encoding: {e}")))
    }

    /// Writes `<path>.svg` and `<path>.png` at [`DEFAULT_WIDTH`] × [`DEFAULT_HEIGHT`], each atomically
    /// (temporary file, then rename), creating parent directories; returns both paths.
    ///
    /// # Errors
    /// As [`Chart::to_png`], and [`Error::Io`] if a file cannot be written.
    fn save(&self, path: &Path) -> Result<[PathBuf; 2]> {
        let svg = self.to_svg(DEFAULT_WIDTH, DEFAULT_HEIGHT)?;
        let png = self.to_png(DEFAULT_WIDTH, DEFAULT_HEIGHT)?;
        let (svg_path, png_path) = (with_ext(path, "svg"), with_ext(path, "png"));
        write_atomic(&svg_path, svg.as_bytes())?;
        write_atomic(&png_path, &png)?;
        Ok([svg_path, png_path])
    }
}

fn check_size(width: u32, height: u32) -> Result<()> {
    let ok = |s: u32| (MIN_SIDE..=MAX_SIDE).contains(&s);
    if ok(width) && ok(height) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "chart size {width}x{height} out of range: each side must be in {MIN_SIDE}..={MAX_SIDE}"
        )))
    }
}

fn encode_png(rgb: &[u8], width: u32, height: u32) -> std::result::Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(out)
}

/// `path` with `.ext` appended to its file name (unlike `with_extension`, dots already in the name are kept).
fn with_ext(path: &Path, ext: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

/// A legend entry's sample: a line (of a line chart) or a filled box (of a histogram).
enum Swatch {
    Line(ShapeStyle),
    Box(ShapeStyle),
}

/// Fills `root`, draws the title and splits the rest into the plot and, for more than one legend entry, a
/// legend column on the right (so that the legend never hides data); draws the legend there.
fn layout<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    sizes: &Sizes,
    title: &str,
    legend: &[(&str, Swatch)],
) -> Drawn<DrawingArea<DB, Shift>, DB> {
    root.fill(&WHITE)?;
    let body = root.margin(sizes.margin / 2, 0, 0, 0).titled(title, (FONT, sizes.title))?;
    if legend.len() < 2 {
        return Ok(body);
    }
    let text = TextStyle::from((FONT, sizes.tick)).pos(Pos::new(HPos::Left, VPos::Center));
    let mut widest = 0;
    for (name, _) in legend {
        widest = widest.max(body.estimate_text_size(name, &text)?.0);
    }
    let (w, _) = body.dim_in_pixel();
    let column = (widest + sizes.mark + sizes.margin * 3).min(w / 3);
    let (plot, side) = body.split_horizontally(w - column);
    let (m, mark) = (sizes.margin as i32, sizes.mark as i32);
    let line = (sizes.tick * 1.6).round() as i32;
    for (i, (name, swatch)) in legend.iter().enumerate() {
        let y = m + line * i as i32 + line / 2;
        match swatch {
            Swatch::Line(style) => side.draw(&PathElement::new(vec![(0, y), (mark, y)], *style))?,
            Swatch::Box(style) => side.draw(&Rectangle::new([(0, y - line / 3), (mark, y + line / 3)], *style))?,
        }
        side.draw(&Text::new(name.to_string(), (mark + m / 2, y), text.clone()))?;
    }
    Ok(plot)
}

/// Lays out the axes, the grid and tick labels on `area`; returns the chart to draw series on.
fn frame<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    sizes: &Sizes,
    (x, y): (Axis, Axis),
    (x_desc, y_desc): (&str, &str),
) -> Drawn<Plot<'a, DB>, DB> {
    let widest = y.ticks().iter().map(|&t| y.label(t).chars().count()).max().unwrap_or(1);
    let mut chart = ChartBuilder::on(area)
        .margin(sizes.margin)
        // Room for the half of the last x tick label that sticks out.
        .margin_right(sizes.margin + (sizes.tick * 1.5).round() as u32)
        .x_label_area_size(sizes.x_label_area())
        .y_label_area_size(sizes.y_label_area(widest))
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_labels(MAX_TICKS)
        .y_labels(MAX_TICKS)
        .label_style((FONT, sizes.tick))
        .axis_desc_style((FONT, sizes.desc))
        .bold_line_style(RGBColor(225, 225, 225))
        .axis_style(RGBColor(90, 90, 90))
        .draw()?;
    Ok(chart)
}

/// Writes "no data" in the middle of the plotting area.
fn no_data<DB: DrawingBackend>(chart: &Plot<'_, DB>, sizes: &Sizes) -> Drawn<(), DB> {
    let area = chart.plotting_area().strip_coord_spec();
    let (w, h) = area.dim_in_pixel();
    let style =
        TextStyle::from((FONT, sizes.desc)).color(&RGBColor(120, 120, 120)).pos(Pos::new(HPos::Center, VPos::Center));
    area.draw(&Text::new("no data", (w as i32 / 2, h as i32 / 2), style))
}

impl Chart for LineChart {
    fn title(&self) -> &str {
        &self.title
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn<(), DB> {
        let sizes = Sizes::new(root.dim_in_pixel());
        let styles: Vec<ShapeStyle> =
            (0..self.series.len()).map(|i| PALETTE[i % PALETTE.len()].stroke_width(sizes.stroke)).collect();
        let legend: Vec<_> =
            self.series.iter().zip(&styles).map(|(s, &st)| (s.name.as_str(), Swatch::Line(st))).collect();
        let area = layout(root, &sizes, &self.title, &legend)?;
        let paths: Vec<Vec<(f64, f64)>> = self.series.iter().map(Series::path).collect();
        let all = || paths.iter().flatten().copied();
        let x = Axis::fit(all().map(|p| p.0), self.x_scale, 0.0, false);
        let from_zero = self.y_scale == Scale::Integer;
        let y = Axis::fit(all().map(|p| p.1), self.y_scale, 0.05, from_zero);
        let mut chart = frame(&area, &sizes, (x, y), (&self.x_label, &self.y_label))?;
        if all().next().is_none() {
            no_data(&chart, &sizes)?;
        }
        for ((path, &style), series) in paths.iter().zip(&styles).zip(&self.series) {
            if series.dots {
                let r = sizes.stroke + 2;
                chart.draw_series(path.iter().map(|p| Circle::new(*p, r, style.color.filled())))?;
            } else if let [p] = path.as_slice() {
                chart.draw_series(std::iter::once(Circle::new(*p, sizes.stroke * 2 + 2, style.color.filled())))?;
            } else {
                chart.draw_series(LineSeries::new(path.iter().copied(), style))?;
            }
        }
        Ok(())
    }
}

/// Shared bins of a [`Histogram`]: `(left edge, width, count per series)` per bin, and whether all values are
/// integers (then bins have integer width and edges).
pub(crate) struct Bins {
    /// Left edge of the first bin.
    pub lo: f64,
    /// Width of every bin.
    pub width: f64,
    /// `counts[series][bin]`.
    pub counts: Vec<Vec<usize>>,
    /// All values are integers.
    pub integer: bool,
}

impl Histogram {
    /// Bins every finite value of every series; `None` when there is none.
    pub(crate) fn bins(&self) -> Option<Bins> {
        const LIMIT: f64 = f64::MAX / 4.0;
        let finite = || self.series.iter().flat_map(|(_, v)| v.iter().copied()).filter(|v| v.is_finite());
        let (lo, hi) = finite()
            .map(|v| v.clamp(-LIMIT, LIMIT))
            .fold(None, |acc: Option<(f64, f64)>, v| Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v)))))?;
        let integer = finite().all(|v| v.fract() == 0.0);
        let n = self.bins.clamp(1, 1000);
        let (lo, width, n) = if integer {
            // Integer values: bins [lo + k·w, lo + (k+1)·w) of integer width w ≥ 1 covering lo..=hi.
            let values = hi - lo + 1.0;
            let w = (values / n as f64).ceil().max(1.0);
            (lo, w, ((values / w).ceil() as usize).clamp(1, n))
        } else if hi > lo {
            (lo, (hi - lo) / n as f64, n)
        } else {
            (lo - 0.5, 1.0, 1)
        };
        let counts = self
            .series
            .iter()
            .map(|(_, values)| {
                let mut c = vec![0usize; n];
                for v in values.iter().filter(|v| v.is_finite()) {
                    let k = ((v.clamp(-LIMIT, LIMIT) - lo) / width).floor();
                    c[(k.max(0.0) as usize).min(n - 1)] += 1;
                }
                c
            })
            .collect();
        Some(Bins { lo, width, counts, integer })
    }
}

impl Chart for Histogram {
    fn title(&self) -> &str {
        &self.title
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn<(), DB> {
        let sizes = Sizes::new(root.dim_in_pixel());
        let colours: Vec<RGBColor> = (0..self.series.len()).map(|i| PALETTE[i % PALETTE.len()]).collect();
        let fill = |c: &RGBColor| c.mix(0.45).filled();
        let legend: Vec<_> =
            self.series.iter().zip(&colours).map(|((n, _), c)| (n.as_str(), Swatch::Box(fill(c)))).collect();
        let area = layout(root, &sizes, &self.title, &legend)?;
        let bins = self.bins();
        let (x, y) = match &bins {
            Some(b) => {
                let n = b.counts.first().map_or(1, Vec::len) as f64;
                let scale = if b.integer { Scale::Integer } else { Scale::Real };
                let top = b.counts.iter().flatten().max().copied().unwrap_or(0);
                (Axis::new(b.lo, b.lo + b.width * n, scale), Axis::fit([0.0, top as f64], Scale::Integer, 0.05, true))
            }
            None => (Axis::new(0.0, 1.0, Scale::Integer), Axis::new(0.0, 1.0, Scale::Integer)),
        };
        let mut chart = frame(&area, &sizes, (x, y), (&self.x_label, "count"))?;
        let Some(b) = bins else {
            return no_data(&chart, &sizes);
        };
        for (counts, colour) in b.counts.iter().zip(&colours) {
            let bars = counts.iter().enumerate().filter(|(_, &n)| n > 0).flat_map(|(k, &n)| {
                let corners = [(b.lo + k as f64 * b.width, 0.0), (b.lo + (k + 1) as f64 * b.width, n as f64)];
                [Rectangle::new(corners, fill(colour)), Rectangle::new(corners, colour.stroke_width(1))]
            });
            chart.draw_series(bars)?;
        }
        Ok(())
    }
}
