//! Chart layout: turns a chart into a [`Scene`] of pixel-space primitives that both the SVG writer and the PNG
//! rasterizer draw, so the two outputs always agree.

use super::ticks::{nice_ticks, tick_labels};
use super::{Histogram, LineChart};

/// An opaque colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    /// `#rrggbb`.
    pub(crate) fn hex(self) -> String {
        format!("#{:02x}{:02x}{:02x}", self.0, self.1, self.2)
    }
}

/// Series colours (Tableau 10), used in order and then cycled.
pub(crate) const PALETTE: [Rgb; 10] = [
    Rgb(0x1f, 0x77, 0xb4),
    Rgb(0xff, 0x7f, 0x0e),
    Rgb(0x2c, 0xa0, 0x2c),
    Rgb(0xd6, 0x27, 0x28),
    Rgb(0x94, 0x67, 0xbd),
    Rgb(0x8c, 0x56, 0x4b),
    Rgb(0xe3, 0x77, 0xc2),
    Rgb(0x7f, 0x7f, 0x7f),
    Rgb(0xbc, 0xbd, 0x22),
    Rgb(0x17, 0xbe, 0xcf),
];

pub(crate) const WHITE: Rgb = Rgb(0xff, 0xff, 0xff);
const INK: Rgb = Rgb(0x22, 0x22, 0x22);
const GRID: Rgb = Rgb(0xe4, 0xe4, 0xe4);

/// Alpha of overlaid histogram bars.
pub(crate) const BAR_ALPHA: f64 = 0.45;

/// The colour of series `i`.
pub(crate) fn color(i: usize) -> Rgb {
    PALETTE[i % PALETTE.len()]
}

/// Horizontal alignment of a text relative to its anchor point (along the text direction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Anchor {
    Start,
    Middle,
    End,
}

/// A drawing primitive in pixel coordinates (origin top-left, y down).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Prim {
    /// A filled rectangle.
    Rect { x: f64, y: f64, w: f64, h: f64, fill: Rgb },
    /// A straight line segment `width` pixels wide.
    Line { from: (f64, f64), to: (f64, f64), color: Rgb, width: u32 },
    /// One data series.
    Polyline { points: Vec<(f64, f64)>, color: Rgb, width: u32 },
    /// A dot (for series with a single point).
    Marker { at: (f64, f64), color: Rgb, radius: f64 },
    /// One histogram series: translucent rectangles `[x, y, w, h]` with an opaque outline.
    Bars { rects: Vec<[f64; 4]>, color: Rgb, alpha: f64 },
    /// Text in the 8×8 bitmap font magnified `scale` times. `at` is the anchor point on the text's centre line;
    /// `vertical` text is rotated 90° counter-clockwise (reads bottom to top).
    Text { at: (f64, f64), text: String, scale: u32, anchor: Anchor, vertical: bool, color: Rgb },
}

/// Everything to draw for one chart, in drawing order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Scene {
    pub width: u32,
    pub height: u32,
    pub prims: Vec<Prim>,
}

/// The plot rectangle and the data ranges mapped onto it.
struct Axes {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    xr: (f64, f64),
    yr: (f64, f64),
}

impl Axes {
    fn px(&self, x: f64) -> f64 {
        self.x0 + frac(x, self.xr) * (self.x1 - self.x0)
    }

    fn py(&self, y: f64) -> f64 {
        self.y1 - frac(y, self.yr) * (self.y1 - self.y0)
    }
}

/// Where `v` lies in `[lo, hi]` as a fraction, computed on halves so the widest `f64` ranges do not overflow;
/// clamped to `[-1, 2]` and `0.5` for a degenerate range, so pixel coordinates stay finite.
fn frac(v: f64, (lo, hi): (f64, f64)) -> f64 {
    let d = hi * 0.5 - lo * 0.5;
    let t = if d > 0.0 && d.is_finite() { (v * 0.5 - lo * 0.5) / d } else { 0.5 };
    if t.is_nan() {
        0.5
    } else {
        t.clamp(-1.0, 2.0)
    }
}

/// What the frame around the data needs to know.
struct Frame<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    legend: Vec<&'a str>,
    x_ticks: Vec<f64>,
    y_ticks: Vec<f64>,
}

/// Text scale for labels at this canvas size (the title is one step larger).
fn text_scale(width: u32, height: u32) -> u32 {
    if width >= 1000 && height >= 600 {
        2
    } else {
        1
    }
}

fn text(at: (f64, f64), s: &str, scale: u32, anchor: Anchor) -> Prim {
    Prim::Text { at, text: s.to_string(), scale, anchor, vertical: false, color: INK }
}

/// Lays out title, legend, axes, grid and tick labels. Returns the scene holding the background and grid (data go
/// on top of it), the axes, and the primitives to draw over the data.
fn frame(f: &Frame<'_>, width: u32, height: u32) -> (Scene, Axes, Vec<Prim>) {
    let (w, h) = (f64::from(width), f64::from(height));
    let s = text_scale(width, height);
    let ts = if width >= 480 { s + 1 } else { s };
    let (sf, ch) = (f64::from(s), 8.0 * f64::from(s));
    let pad = ch;
    let tick = 6.0 * sf;
    let chars = |t: &str| t.chars().count() as f64;
    let x_labels = tick_labels(&f.x_ticks);
    let y_labels = tick_labels(&f.y_ticks);
    let y_label_w = y_labels.iter().map(|l| chars(l)).fold(0.0, f64::max) * ch;

    let left = pad + if f.y_label.is_empty() { 0.0 } else { ch + pad } + y_label_w + tick + 4.0 * sf;
    let right = pad + x_labels.last().map_or(0.0, |l| chars(l) * ch / 2.0);
    // Legend entries: swatch, gap, name, gap; wrapped into rows across the plot width.
    let entry_w = |name: &str| ch + 4.0 * sf + chars(name) * ch + 3.0 * ch;
    let avail = (w - left - right).max(1.0);
    let mut rows: Vec<Vec<(usize, f64)>> = Vec::new();
    let mut cursor = 0.0;
    for (i, name) in f.legend.iter().enumerate() {
        let ew = entry_w(name);
        match rows.last_mut() {
            Some(row) if cursor + ew <= avail => {
                row.push((i, cursor));
                cursor += ew;
            }
            _ => {
                rows.push(vec![(i, 0.0)]);
                cursor = ew;
            }
        }
    }
    let title_h = if f.title.is_empty() { 0.0 } else { 8.0 * f64::from(ts) + pad };
    let row_h = ch + 6.0 * sf;
    let top = pad + title_h + rows.len() as f64 * row_h + pad / 2.0;
    let bottom = tick + 4.0 * sf + ch + if f.x_label.is_empty() { 0.0 } else { pad + ch } + pad;
    let x0 = left.min(w - 1.0);
    let y0 = top.min(h - 1.0);
    let axes = Axes {
        x0,
        x1: (w - right).max(x0 + 1.0),
        y0,
        y1: (h - bottom).max(y0 + 1.0),
        xr: (f.x_ticks[0], f.x_ticks[f.x_ticks.len() - 1]),
        yr: (f.y_ticks[0], f.y_ticks[f.y_ticks.len() - 1]),
    };

    let mut under = vec![Prim::Rect { x: 0.0, y: 0.0, w, h, fill: WHITE }];
    let mut over = Vec::new();
    for (&t, label) in f.y_ticks.iter().zip(&y_labels) {
        let y = axes.py(t);
        under.push(Prim::Line { from: (axes.x0, y), to: (axes.x1, y), color: GRID, width: 1 });
        over.push(Prim::Line { from: (axes.x0 - tick, y), to: (axes.x0, y), color: INK, width: 1 });
        over.push(text((axes.x0 - tick - 4.0 * sf, y), label, s, Anchor::End));
    }
    for (&t, label) in f.x_ticks.iter().zip(&x_labels) {
        let x = axes.px(t);
        under.push(Prim::Line { from: (x, axes.y0), to: (x, axes.y1), color: GRID, width: 1 });
        over.push(Prim::Line { from: (x, axes.y1), to: (x, axes.y1 + tick), color: INK, width: 1 });
        over.push(text((x, axes.y1 + tick + 4.0 * sf + ch / 2.0), label, s, Anchor::Middle));
    }
    over.push(Prim::Line { from: (axes.x0, axes.y0), to: (axes.x0, axes.y1), color: INK, width: 1 });
    over.push(Prim::Line { from: (axes.x0, axes.y1), to: (axes.x1, axes.y1), color: INK, width: 1 });
    if !f.title.is_empty() {
        over.push(text((w / 2.0, pad + 4.0 * f64::from(ts)), f.title, ts, Anchor::Middle));
    }
    if !f.x_label.is_empty() {
        over.push(text(((axes.x0 + axes.x1) / 2.0, h - pad - ch / 2.0), f.x_label, s, Anchor::Middle));
    }
    if !f.y_label.is_empty() {
        let at = (pad + ch / 2.0, (axes.y0 + axes.y1) / 2.0);
        over.push(Prim::Text {
            at,
            text: f.y_label.to_string(),
            scale: s,
            anchor: Anchor::Middle,
            vertical: true,
            color: INK,
        });
    }
    for (r, row) in rows.iter().enumerate() {
        let y = pad + title_h + r as f64 * row_h;
        for &(i, dx) in row {
            let x = axes.x0 + dx;
            over.push(Prim::Rect { x, y, w: ch, h: ch, fill: color(i) });
            over.push(text((x + ch + 4.0 * sf, y + ch / 2.0), f.legend[i], s, Anchor::Start));
        }
    }
    (Scene { width, height, prims: under }, axes, over)
}

/// `(min, max)` of the finite values, or `None` when there are none.
fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.filter(|v| v.is_finite()).fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// The finite points of a series.
fn finite(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect()
}

/// Lays out a [`LineChart`] on a `width × height` canvas.
pub(crate) fn line_chart(c: &LineChart, width: u32, height: u32) -> Scene {
    let data: Vec<Vec<(f64, f64)>> = c.series.iter().map(|s| finite(&s.points)).collect();
    let xb = bounds(data.iter().flatten().map(|p| p.0)).unwrap_or((0.0, 1.0));
    let yb = bounds(data.iter().flatten().map(|p| p.1)).unwrap_or((0.0, 1.0));
    let legend = if c.series.len() > 1 { c.series.iter().map(|s| s.name.as_str()).collect() } else { Vec::new() };
    let f = Frame {
        title: &c.title,
        x_label: &c.x_label,
        y_label: &c.y_label,
        legend,
        x_ticks: nice_ticks(xb.0, xb.1, 6),
        y_ticks: nice_ticks(yb.0, yb.1, 5),
    };
    let (mut scene, axes, over) = frame(&f, width, height);
    for (i, (series, pts)) in c.series.iter().zip(&data).enumerate() {
        if pts.is_empty() {
            continue;
        }
        let mut points = Vec::with_capacity(if series.step { 2 * pts.len() } else { pts.len() });
        for (j, &(x, y)) in pts.iter().enumerate() {
            let p = (axes.px(x), axes.py(y));
            if series.step && j > 0 {
                if let Some(&(_, prev_y)) = points.last() {
                    points.push((p.0, prev_y));
                }
            }
            points.push(p);
        }
        if pts.len() == 1 {
            scene.prims.push(Prim::Marker { at: points[0], color: color(i), radius: 3.0 });
        }
        scene.prims.push(Prim::Polyline { points, color: color(i), width: 2 });
    }
    scene.prims.extend(over);
    scene
}

/// Lays out a [`Histogram`] on a `width × height` canvas: shared bins over all series' finite values.
pub(crate) fn histogram(c: &Histogram, width: u32, height: u32) -> Scene {
    let bins = c.bins.max(1);
    let data: Vec<Vec<f64>> =
        c.series.iter().map(|(_, v)| v.iter().copied().filter(|x| x.is_finite()).collect()).collect();
    let (mut lo, mut hi) = bounds(data.iter().flatten().copied()).unwrap_or((0.0, 1.0));
    if hi - lo <= lo.abs().max(hi.abs()) * 1e-9 {
        let pad = if lo.abs() > 0.0 { lo.abs() * 0.05 } else { 0.5 };
        (lo, hi) = (lo - pad, hi + pad);
    }
    let counts: Vec<Vec<usize>> = data
        .iter()
        .map(|vals| {
            let mut counts = vec![0usize; bins];
            for &v in vals {
                let b = (frac(v, (lo, hi)) * bins as f64).floor();
                // The top edge belongs to the last bin.
                counts[(b.max(0.0) as usize).min(bins - 1)] += 1;
            }
            counts
        })
        .collect();
    let edge = |b: usize| {
        let t = b as f64 / bins as f64;
        lo * (1.0 - t) + hi * t
    };
    let max_count = counts.iter().flatten().copied().max().unwrap_or(0).max(1);
    let legend = if c.series.len() > 1 { c.series.iter().map(|s| s.0.as_str()).collect() } else { Vec::new() };
    let f = Frame {
        title: &c.title,
        x_label: &c.x_label,
        y_label: "count",
        legend,
        x_ticks: nice_ticks(lo, hi, 6),
        y_ticks: nice_ticks(0.0, max_count as f64, 5),
    };
    let (mut scene, axes, over) = frame(&f, width, height);
    for (i, (cs, vals)) in counts.iter().zip(&data).enumerate() {
        if vals.is_empty() {
            continue;
        }
        let rects = cs
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(b, &n)| {
                let (xa, xb) = (axes.px(edge(b)), axes.px(edge(b + 1)));
                let top = axes.py(n as f64);
                [xa, top, xb - xa, axes.y1 - top]
            })
            .collect();
        scene.prims.push(Prim::Bars { rects, color: color(i), alpha: BAR_ALPHA });
    }
    scene.prims.extend(over);
    scene
}
