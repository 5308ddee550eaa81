//! [`Scene`] → SVG text (hand-written XML).

use std::fmt::Write;

use super::scene::{Anchor, Prim, Scene};

/// SVG font size for the 8×8 bitmap font at `scale` (a monospace advance is about 0.6 em, matching 8 px).
fn font_size(scale: u32) -> f64 {
    f64::from(scale) * 8.0 / 0.6
}

/// Escapes text for XML content and attribute values; control characters XML forbids become `?`.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push('?'),
            c => out.push(c),
        }
    }
    out
}

/// Renders `scene` as a standalone SVG document.
pub(crate) fn render(scene: &Scene) -> String {
    let mut out = String::new();
    // Writing to a `String` cannot fail.
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="monospace">"#,
        w = scene.width,
        h = scene.height
    );
    for p in &scene.prims {
        let _ = match p {
            Prim::Rect { x, y, w, h, fill } => {
                writeln!(out, r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{}"/>"#, fill.hex())
            }
            Prim::Line { from, to, color, width } => writeln!(
                out,
                r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="{width}"/>"#,
                from.0,
                from.1,
                to.0,
                to.1,
                color.hex()
            ),
            Prim::Polyline { points, color, width } => {
                let pts: Vec<String> = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
                writeln!(
                    out,
                    r#"<polyline fill="none" stroke="{}" stroke-width="{width}" stroke-linejoin="round" points="{}"/>"#,
                    color.hex(),
                    pts.join(" ")
                )
            }
            Prim::Marker { at, color, radius } => {
                writeln!(out, r#"<circle cx="{:.1}" cy="{:.1}" r="{radius:.1}" fill="{}"/>"#, at.0, at.1, color.hex())
            }
            Prim::Bars { rects, color, alpha } => {
                let d: Vec<String> =
                    rects.iter().map(|[x, y, w, h]| format!("M{x:.1} {y:.1}h{w:.1}v{h:.1}h{:.1}Z", -w)).collect();
                let c = color.hex();
                writeln!(
                    out,
                    r#"<path d="{}" fill="{c}" fill-opacity="{alpha}" stroke="{c}" stroke-width="1"/>"#,
                    d.join(" ")
                )
            }
            Prim::Text { at, text, scale, anchor, vertical, color } => {
                let anchor = match anchor {
                    Anchor::Start => "start",
                    Anchor::Middle => "middle",
                    Anchor::End => "end",
                };
                let rotate = if *vertical {
                    format!(r#" transform="rotate(-90 {:.1} {:.1})""#, at.0, at.1)
                } else {
                    String::new()
                };
                writeln!(
                    out,
                    r#"<text x="{:.1}" y="{:.1}" font-size="{:.1}" text-anchor="{anchor}" dominant-baseline="central" fill="{}"{rotate}>{}</text>"#,
                    at.0,
                    at.1,
                    font_size(*scale),
                    color.hex(),
                    escape(text)
                )
            }
        };
    }
    out.push_str("</svg>\n");
    out
}
