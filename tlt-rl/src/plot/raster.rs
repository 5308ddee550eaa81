//! [`Scene`] → PNG: a small RGB rasterizer (Bresenham lines, 8×8 bitmap text) encoded with `png`.

use font8x8::legacy::BASIC_LEGACY;

use super::scene::{Anchor, Prim, Rgb, Scene, WHITE};
use crate::{Error, Result};

/// An RGB8 pixel buffer.
struct Canvas {
    w: i64,
    h: i64,
    px: Vec<u8>,
}

/// Pixel coordinate for `v`, pulled into a band around the canvas so loops stay short for wild inputs.
fn coord(v: f64, size: i64) -> i64 {
    // `as` saturates and maps NaN to 0.
    (v.round() as i64).clamp(-size, 2 * size)
}

impl Canvas {
    fn new(w: u32, h: u32) -> Self {
        let (w, h) = (i64::from(w), i64::from(h));
        let n = (w * h * 3) as usize;
        let mut px = vec![0u8; n];
        for p in px.chunks_exact_mut(3) {
            p.copy_from_slice(&[WHITE.0, WHITE.1, WHITE.2]);
        }
        Self { w, h, px }
    }

    /// Blends `c` at `alpha` onto pixel `(x, y)`; off-canvas pixels are ignored.
    fn blend(&mut self, x: i64, y: i64, c: Rgb, alpha: f64) {
        if x < 0 || y < 0 || x >= self.w || y >= self.h {
            return;
        }
        let i = ((y * self.w + x) * 3) as usize;
        let a = alpha.clamp(0.0, 1.0);
        for (k, v) in [c.0, c.1, c.2].into_iter().enumerate() {
            let old = f64::from(self.px[i + k]);
            self.px[i + k] = (old + (f64::from(v) - old) * a).round() as u8;
        }
    }

    /// Fills the pixels whose centres fall in the rectangle.
    fn fill_rect(&mut self, x: f64, y: f64, w: f64, h: f64, c: Rgb, alpha: f64) {
        let (xa, xb) = (coord(x.min(x + w), self.w).max(0), coord(x.max(x + w), self.w).min(self.w));
        let (ya, yb) = (coord(y.min(y + h), self.h).max(0), coord(y.max(y + h), self.h).min(self.h));
        for py in ya..yb {
            for px in xa..xb {
                self.blend(px, py, c, alpha);
            }
        }
    }

    /// A `width`-pixel line by Bresenham's algorithm, thickened across its major direction.
    fn line(&mut self, from: (f64, f64), to: (f64, f64), c: Rgb, width: u32) {
        let (mut x, mut y) = (coord(from.0, self.w), coord(from.1, self.h));
        let (x1, y1) = (coord(to.0, self.w), coord(to.1, self.h));
        let (dx, dy) = ((x1 - x).abs(), -(y1 - y).abs());
        let (sx, sy) = (if x < x1 { 1 } else { -1 }, if y < y1 { 1 } else { -1 });
        let thick = i64::from(width.max(1));
        let lo = -(thick - 1) / 2;
        let horizontalish = dx >= -dy;
        let mut err = dx + dy;
        loop {
            for o in lo..lo + thick {
                if horizontalish {
                    self.blend(x, y + o, c, 1.0);
                } else {
                    self.blend(x + o, y, c, 1.0);
                }
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    fn disc(&mut self, at: (f64, f64), r: f64, c: Rgb) {
        let r = r.clamp(0.5, 64.0);
        let (cx, cy) = (coord(at.0, self.w), coord(at.1, self.h));
        let ri = r.ceil() as i64;
        for y in -ri..=ri {
            for x in -ri..=ri {
                if ((x * x + y * y) as f64) <= r * r {
                    self.blend(cx + x, cy + y, c, 1.0);
                }
            }
        }
    }

    /// Draws `text` in the 8×8 font magnified `scale` times; see [`Prim::Text`] for `at` and `vertical`.
    fn text(&mut self, at: (f64, f64), text: &str, scale: u32, anchor: Anchor, vertical: bool, c: Rgb) {
        let s = i64::from(scale.clamp(1, 8));
        let len = text.chars().count() as i64 * 8 * s;
        let back = match anchor {
            Anchor::Start => 0,
            Anchor::Middle => len / 2,
            Anchor::End => len,
        };
        let (ax, ay) = (coord(at.0, self.w), coord(at.1, self.h));
        for (k, ch) in text.chars().enumerate() {
            let glyph = BASIC_LEGACY[if ch.is_ascii() { ch as usize } else { '?' as usize }];
            for (r, row) in glyph.iter().enumerate() {
                for i in 0..8 {
                    if row >> i & 1 == 0 {
                        continue;
                    }
                    let along = k as i64 * 8 * s + i * s - back;
                    let across = r as i64 * s - 4 * s;
                    // Horizontal: along → +x, across → +y. Vertical (rotated CCW): along → −y, across → +x.
                    let (x, y) = if vertical { (ax + across, ay - along - s) } else { (ax + along, ay + across) };
                    for yy in y..y + s {
                        for xx in x..x + s {
                            self.blend(xx, yy, c, 1.0);
                        }
                    }
                }
            }
        }
    }

    fn draw(&mut self, p: &Prim) {
        match p {
            Prim::Rect { x, y, w, h, fill } => self.fill_rect(*x, *y, *w, *h, *fill, 1.0),
            Prim::Line { from, to, color, width } => self.line(*from, *to, *color, *width),
            Prim::Polyline { points, color, width } => {
                for seg in points.windows(2) {
                    self.line(seg[0], seg[1], *color, *width);
                }
            }
            Prim::Marker { at, color, radius } => self.disc(*at, *radius, *color),
            Prim::Bars { rects, color, alpha } => {
                for &[x, y, w, h] in rects {
                    self.fill_rect(x, y, w, h, *color, *alpha);
                    let (x1, y1) = (x + w, y + h);
                    for (a, b) in [((x, y1), (x, y)), ((x, y), (x1, y)), ((x1, y), (x1, y1))] {
                        self.line(a, b, *color, 1);
                    }
                }
            }
            Prim::Text { at, text, scale, anchor, vertical, color } => {
                self.text(*at, text, *scale, *anchor, *vertical, *color);
            }
        }
    }

    fn encode(&self) -> Result<Vec<u8>> {
        let png_err = |e: png::EncodingError| Error::InvalidArgument(format!("png encoding failed: {e}"));
        let mut out = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut out, self.w as u32, self.h as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut writer = enc.write_header().map_err(png_err)?;
            writer.write_image_data(&self.px).map_err(png_err)?;
            writer.finish().map_err(png_err)?;
        }
        Ok(out)
    }
}

/// Rasterizes `scene` and encodes it as an RGB8 PNG.
pub(crate) fn render(scene: &Scene) -> Result<Vec<u8>> {
    let mut canvas = Canvas::new(scene.width, scene.height);
    for p in &scene.prims {
        canvas.draw(p);
    }
    canvas.encode()
}
