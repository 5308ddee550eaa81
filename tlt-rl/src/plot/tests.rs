use super::*;

fn decode(png_bytes: &[u8]) -> (u32, u32, Vec<u8>) {
    let dec = png::Decoder::new(png_bytes);
    let mut reader = dec.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

fn distinct_colours(rgb: &[u8]) -> usize {
    let mut set = std::collections::BTreeSet::new();
    for p in rgb.chunks_exact(3) {
        set.insert((p[0], p[1], p[2]));
    }
    set.len()
}

fn two_series() -> LineChart {
    LineChart {
        title: "Reward <tlt> & \"baseline\"".into(),
        x_label: "step".into(),
        y_label: "reward".into(),
        series: vec![
            Series::new("tlt", (0..20).map(|i| (i as f64, (i as f64 / 3.0).sin())).collect()),
            Series::steps("baseline", (0..20).map(|i| (i as f64, i as f64 * 0.05)).collect()),
        ],
    }
}

fn degenerate_charts() -> Vec<LineChart> {
    let one = |points: Vec<(f64, f64)>| LineChart {
        title: "t".into(),
        x_label: String::new(),
        y_label: String::new(),
        series: vec![Series::new("s", points)],
    };
    vec![
        LineChart::default(),
        one(vec![]),
        one(vec![(1.0, 2.0)]),
        one(vec![(f64::NAN, 1.0), (2.0, f64::INFINITY), (f64::NEG_INFINITY, f64::NAN)]),
        one(vec![(0.0, 5.0), (1.0, 5.0), (2.0, 5.0)]),
        one(vec![(3.0, 0.0), (3.0, 1.0)]),
        one(vec![(0.0, 1e300), (1.0, -1e300)]),
        one(vec![(0.0, -f64::MAX), (1.0, f64::MAX)]),
        one(vec![(0.0, 1.0), (1e-300, 1.0 + 1e-15)]),
    ]
}

#[test]
fn plot_svg_structure() {
    let chart = two_series();
    let svg = chart.to_svg();
    assert!(svg.starts_with("<svg"));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("Reward &lt;tlt&gt; &amp; &quot;baseline&quot;"));
    assert!(!svg.contains("<tlt>"));
    assert_eq!(svg.matches("<polyline").count(), 2);
    // Legend entries for both series.
    assert!(svg.contains(">tlt</text>") && svg.contains(">baseline</text>"));
    // Single series: no legend.
    let single = LineChart { series: vec![chart.series[0].clone()], ..chart.clone() };
    let svg = single.to_svg();
    assert_eq!(svg.matches("<polyline").count(), 1);
    assert!(!svg.contains(">tlt</text>"));
    // Balanced tags for the elements with content.
    assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
}

#[test]
fn plot_step_series_holds_values() {
    let chart = LineChart {
        series: vec![Series::steps("a", vec![(0.0, 0.0), (1.0, 1.0), (2.0, 0.0)])],
        ..LineChart::default()
    };
    let svg = chart.to_svg();
    let line = svg.lines().find(|l| l.starts_with("<polyline")).unwrap();
    let points = line.split("points=\"").nth(1).unwrap();
    assert_eq!(points.split_whitespace().count(), 5);
}

#[test]
fn plot_png_decodes_to_size_and_has_content() {
    let chart = two_series();
    for (w, h) in [(640, 400), (1200, 750), (64, 64), (333, 211)] {
        let bytes = chart.to_png(w, h).unwrap();
        let (dw, dh, rgb) = decode(&bytes);
        assert_eq!((dw, dh), (w, h));
        assert_eq!(rgb.len(), (w * h * 3) as usize);
        assert!(distinct_colours(&rgb) > 2, "{w}x{h}");
    }
    // Both series colours appear.
    let (_, _, rgb) = decode(&chart.to_png(640, 400).unwrap());
    for c in &scene::PALETTE[..2] {
        assert!(rgb.chunks_exact(3).any(|p| p == [c.0, c.1, c.2]), "{c:?}");
    }
    assert!(chart.to_png(10, 400).is_err());
    assert!(chart.to_png(400, 100_000).is_err());
}

#[test]
fn plot_degenerate_line_charts_do_not_panic() {
    for chart in degenerate_charts() {
        let svg = chart.to_svg();
        assert!(svg.starts_with("<svg"), "{chart:?}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{chart:?}\n{svg}");
        let (w, h, rgb) = decode(&chart.to_png(200, 120).unwrap());
        assert_eq!((w, h), (200, 120));
        assert!(distinct_colours(&rgb) > 1);
    }
    // A single point is drawn as a marker.
    let chart = &degenerate_charts()[2];
    assert!(chart.to_svg().contains("<circle"));
}

#[test]
fn plot_histogram_overlaid() {
    let h = Histogram {
        title: "lengths <&>".into(),
        x_label: "tokens".into(),
        series: vec![
            ("first".into(), (0..100).map(|i| (i % 37) as f64).collect()),
            ("last".into(), (0..100).map(|i| 20.0 + (i % 53) as f64).collect()),
        ],
        bins: 20,
    };
    let svg = h.to_svg();
    assert!(svg.starts_with("<svg") && svg.contains("lengths &lt;&amp;&gt;"));
    assert_eq!(svg.matches("<path").count(), 2);
    assert!(svg.contains("fill-opacity"));
    let (w, hh, rgb) = decode(&h.to_png(500, 300).unwrap());
    assert_eq!((w, hh), (500, 300));
    assert!(distinct_colours(&rgb) > 3);
}

#[test]
fn plot_histogram_counts_every_value() {
    let values: Vec<f64> = vec![0.0, 1.0, 1.0, 2.0, 10.0];
    let h = Histogram { series: vec![("a".into(), values)], bins: 5, ..Histogram::default() };
    let s = scene::histogram(&h, 400, 300);
    let bars = s.prims.iter().find_map(|p| match p {
        scene::Prim::Bars { rects, .. } => Some(rects.clone()),
        _ => None,
    });
    // Bins [0,2) [2,4) ... [8,10]: 0,1,1 | 2 | 10 → three non-empty bins.
    assert_eq!(bars.unwrap().len(), 3);
}

#[test]
fn plot_degenerate_histograms_do_not_panic() {
    let cases: Vec<Vec<(String, Vec<f64>)>> = vec![
        vec![],
        vec![("e".into(), vec![])],
        vec![("one".into(), vec![7.0])],
        vec![("const".into(), vec![3.0; 50]), ("zero".into(), vec![0.0; 5])],
        vec![("nan".into(), vec![f64::NAN, f64::INFINITY])],
        vec![("wide".into(), vec![-f64::MAX, f64::MAX])],
    ];
    for series in cases {
        for bins in [0, 1, 30] {
            let h = Histogram { title: "h".into(), x_label: "x".into(), series: series.clone(), bins };
            let svg = h.to_svg();
            assert!(svg.starts_with("<svg"));
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
            let (w, hh, _) = decode(&h.to_png(128, 96).unwrap());
            assert_eq!((w, hh), (128, 96));
        }
    }
}

#[test]
fn plot_save_writes_both_files() {
    let dir = std::env::temp_dir().join(format!("tlt-rl-plot-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = dir.join("nested/chart.v1");
    two_series().save(&base).unwrap();
    let svg = std::fs::read_to_string(dir.join("nested/chart.v1.svg")).unwrap();
    assert!(svg.starts_with("<svg"));
    let (w, h, _) = decode(&std::fs::read(dir.join("nested/chart.v1.png")).unwrap());
    assert_eq!((w, h), (DEFAULT_WIDTH, DEFAULT_HEIGHT));
    assert_eq!(std::fs::read_dir(dir.join("nested")).unwrap().count(), 2, "no temp files left");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn run(mode: &str, steps: u64) -> Vec<StepMetrics> {
    (0..steps)
        .map(|s| StepMetrics {
            step: s,
            mode: mode.into(),
            reward_mean: s as f64 * 0.1,
            accept_len: if mode == "tlt" { 2.0 + s as f64 * 0.2 } else { f64::NAN },
            rollout_s: 10.0 - s as f64 * 0.5,
            train_s: 2.0,
            step_s: 13.0 - s as f64 * 0.5,
            active_requests: (0..40).map(|i| 32usize.saturating_sub(i)).collect(),
            response_lengths: (0..32).map(|i| 10 + i * (s as usize + 1)).collect(),
            ..StepMetrics::default()
        })
        .collect()
}

#[test]
fn plot_training_plots_writes_all_charts() {
    let dir = std::env::temp_dir().join(format!("tlt-rl-plot-training-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let tlt = run("tlt", 6);
    let base = run("baseline", 6);
    let paths = training_plots(&tlt, Some(&base), &dir).unwrap();
    assert_eq!(paths.len(), 10);
    for stem in ["reward", "response_length", "active_requests", "accept_length", "step_time"] {
        for ext in ["svg", "png"] {
            let p = dir.join(format!("{stem}.{ext}"));
            assert!(paths.contains(&p), "{p:?}");
            assert!(std::fs::metadata(&p).unwrap().len() > 100);
        }
    }
    let reward = std::fs::read_to_string(dir.join("reward.svg")).unwrap();
    assert_eq!(reward.matches("<polyline").count(), 2);
    assert!(reward.contains(">baseline</text>"));
    let hist = std::fs::read_to_string(dir.join("response_length.svg")).unwrap();
    assert_eq!(hist.matches("<path").count(), 2);
    let times = std::fs::read_to_string(dir.join("step_time.svg")).unwrap();
    assert_eq!(times.matches("<polyline").count(), 5);

    // Without a baseline, and with no metrics at all.
    let paths = training_plots(&tlt[..1], None, &dir.join("one")).unwrap();
    assert_eq!(paths.len(), 10);
    let paths = training_plots(&[], None, &dir.join("empty")).unwrap();
    assert_eq!(paths.len(), 10);
    std::fs::remove_dir_all(&dir).unwrap();
}
