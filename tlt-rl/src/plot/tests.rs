use plotters::coord::ranged1d::Ranged;

use super::axis::{self, Axis};
use super::chart::{DEFAULT_HEIGHT, DEFAULT_WIDTH, PALETTE};
use super::*;

const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a];

/// Width and height from the IHDR chunk, which must come first.
fn ihdr_size(png: &[u8]) -> (u32, u32) {
    assert!(png.len() > 24, "{} bytes", png.len());
    assert_eq!(png[..8], PNG_SIGNATURE);
    assert_eq!(&png[12..16], b"IHDR");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&png[16..20]), be(&png[20..24]))
}

/// Decodes an RGB8 PNG into `(width, height, pixels)`.
fn decode(png_bytes: &[u8]) -> (u32, u32, Vec<u8>) {
    let mut reader = png::Decoder::new(png_bytes).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

fn distinct_colours(rgb: &[u8]) -> usize {
    rgb.chunks_exact(3).map(|p| (p[0], p[1], p[2])).collect::<std::collections::BTreeSet<_>>().len()
}

/// Pixels darker than mid grey: text, and little else (series use colours, the grid is light).
fn dark_pixels(rgb: &[u8]) -> usize {
    rgb.chunks_exact(3).filter(|p| p.iter().all(|&c| c < 60)).count()
}

/// The text of every `<text>` element of an SVG.
fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_string()))
        .collect()
}

fn line_chart(series: Vec<Series>) -> LineChart {
    LineChart {
        title: "Reward <tlt> & \"baseline\"".into(),
        x_label: "RL step".into(),
        y_label: "reward".into(),
        series,
        x_scale: Scale::Integer,
        y_scale: Scale::Real,
    }
}

fn two_series() -> LineChart {
    line_chart(vec![
        Series::new("tlt", (0..20).map(|i| (i as f64, (i as f64 / 3.0).sin())).collect()),
        Series::steps("baseline", (0..20).map(|i| (i as f64, i as f64 * 0.05)).collect()),
    ])
}

fn degenerate_charts() -> Vec<LineChart> {
    let one = |points: Vec<(f64, f64)>| line_chart(vec![Series::new("s", points)]);
    vec![
        line_chart(vec![]),
        one(vec![]),
        one(vec![(1.0, 2.0)]),
        one(vec![(f64::NAN, 1.0), (2.0, f64::INFINITY), (f64::NEG_INFINITY, f64::NAN)]),
        one(vec![(0.0, 5.0), (1.0, 5.0), (2.0, 5.0)]),
        one(vec![(3.0, 0.0), (3.0, 1.0)]),
        one(vec![(0.0, 1e300), (1.0, -1e300)]),
        one(vec![(0.0, -f64::MAX), (1.0, f64::MAX)]),
        one(vec![(-f64::MAX, 0.0), (f64::MAX, 1.0)]),
        one(vec![(0.0, 1.0), (1e-300, 1.0 + 1e-15)]),
        one(vec![(0.0, 1e-300), (1.0, 2e-300)]),
        one(vec![(1e15, 0.0), (1e15 + 3.0, 1.0)]),
        one(vec![(1e17, 0.0), (2e17, 1.0)]),
    ]
}

#[test]
fn plot_integer_ticks_for_few_steps() {
    // Three RL steps: plotters' float ticks would include 0.5 and 1.5; the integer axis must not.
    let real = axis::ticks(0.0, 2.0, Scale::Real, axis::MAX_TICKS);
    assert!(real.iter().any(|t| t.fract() != 0.0), "{real:?}");
    assert_eq!(axis::ticks(0.0, 2.0, Scale::Integer, axis::MAX_TICKS), [0.0, 1.0, 2.0]);

    let steps = |n: u64| Axis::fit((0..n).map(|s| s as f64), Scale::Integer, 0.0, false);
    assert_eq!(steps(3).ticks(), [0.0, 1.0, 2.0]);
    assert_eq!(steps(2).ticks(), [0.0, 1.0]);
    // A single step is widened to its neighbours, still on integers.
    assert_eq!(steps(1).ticks(), [-1.0, 0.0, 1.0]);
    for n in 1..300 {
        let axis = steps(n);
        let t = axis.ticks();
        assert!((1..=axis::MAX_TICKS).contains(&t.len()), "{n}: {t:?}");
        assert!(t.iter().all(|v| v.fract() == 0.0), "{n}: {t:?}");
        assert!(t.windows(2).all(|w| w[0] < w[1]), "{n}: {t:?}");
        assert!(t.iter().all(|&v| !axis.label(v).contains(['.', 'e'])), "{n}: {t:?}");
    }
    assert_eq!(steps(101).ticks(), [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
    // Counts from zero: integer ticks too.
    let counts = Axis::fit([0.0, 3.0], Scale::Integer, 0.05, true);
    assert_eq!(counts.ticks(), [0.0, 1.0, 2.0, 3.0]);
    assert_eq!(Axis::fit([0.0, 0.0], Scale::Integer, 0.05, true).ticks(), [0.0, 1.0]);
}

#[test]
fn plot_real_ticks_and_labels() {
    let a = Axis::fit([0.0, 1.0], Scale::Real, 0.0, false);
    assert_eq!(a.ticks().iter().map(|&t| a.label(t)).collect::<Vec<_>>(), ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
    let a = Axis::fit([0.0, 100.0], Scale::Real, 0.0, false);
    assert_eq!(a.ticks().iter().map(|&t| a.label(t)).collect::<Vec<_>>(), ["0", "20", "40", "60", "80", "100"]);
    let a = Axis::new(0.0, 4e6, Scale::Real);
    assert!(a.ticks().iter().skip(1).all(|&t| a.label(t).contains('e')), "{:?}", a.ticks());
    // Degenerate and non-finite inputs still give an ordered, finite axis.
    for values in [vec![], vec![f64::NAN], vec![5.0, 5.0], vec![-f64::MAX, f64::MAX], vec![f64::INFINITY, 1.0]] {
        let a = Axis::fit(values.clone(), Scale::Real, 0.05, false);
        let r = a.range();
        assert!(r.start.is_finite() && r.end.is_finite() && r.start < r.end, "{values:?} {r:?}");
        assert!(!a.ticks().is_empty(), "{values:?}");
        assert!(a.ticks().iter().all(|t| r.start <= *t && *t <= r.end), "{values:?} {:?}", a.ticks());
    }
}

#[test]
fn plot_png_signature_size_and_content() {
    let chart = two_series();
    for (w, h) in [(640, 400), (1200, 750), (64, 64), (333, 211)] {
        let bytes = chart.to_png(w, h).unwrap();
        assert_eq!(ihdr_size(&bytes), (w, h));
        let (dw, dh, rgb) = decode(&bytes);
        assert_eq!((dw, dh), (w, h));
        assert!(distinct_colours(&rgb) > 2, "{w}x{h}");
    }
    let (_, _, rgb) = decode(&chart.to_png(640, 400).unwrap());
    // Both series colours appear, and text (title, ticks, legend) is drawn in dark pixels.
    for c in &PALETTE[..2] {
        assert!(rgb.chunks_exact(3).any(|p| p == [c.0, c.1, c.2]), "{c:?}");
    }
    // Text is rasterized from the embedded font: the title alone adds hundreds of dark pixels.
    let untitled = LineChart { title: String::new(), ..chart.clone() };
    let dark = |c: &LineChart| dark_pixels(&decode(&c.to_png(640, 400).unwrap()).2);
    let (with, without) = (dark(&chart), dark(&untitled));
    assert!(with > without + 300, "{with} vs {without}");
    assert!(without > 100, "tick labels and axis descriptions: {without}");
    assert!(matches!(chart.to_png(10, 400), Err(Error::InvalidArgument(_))));
    assert!(matches!(chart.to_png(400, 100_000), Err(Error::InvalidArgument(_))));
    assert!(matches!(chart.to_svg(0, 0), Err(Error::InvalidArgument(_))));
}

#[test]
fn plot_svg_titles_names_and_legend() {
    let chart = two_series();
    let svg = chart.to_svg(DEFAULT_WIDTH, DEFAULT_HEIGHT).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    let texts = svg_texts(&svg);
    assert!(texts.contains(&"Reward &lt;tlt&gt; &amp; &quot;baseline&quot;".to_string()), "{texts:?}");
    assert!(!svg.contains("<tlt>"));
    for t in ["RL step", "reward", "tlt", "baseline"] {
        assert!(texts.iter().any(|s| s == t), "{t}: {texts:?}");
    }
    // The x axis (steps 0..19) is labelled with integers only (the y axis, -1..1, with halves).
    assert!(texts.windows(4).any(|w| w == ["0", "5", "10", "15"]), "{texts:?}");
    assert!(texts.windows(3).any(|w| w == ["-0.5", "0", "0.5"]), "{texts:?}");
    // A single series: no legend.
    let single = line_chart(vec![chart.series[0].clone()]);
    let texts = svg_texts(&single.to_svg(DEFAULT_WIDTH, DEFAULT_HEIGHT).unwrap());
    assert!(!texts.iter().any(|s| s == "tlt"), "{texts:?}");
}

#[test]
fn plot_step_series_holds_values() {
    let s = Series::steps("a", vec![(0.0, 0.0), (1.0, 1.0), (f64::NAN, 3.0), (2.0, 0.0)]);
    assert_eq!(s.path(), [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (2.0, 1.0), (2.0, 0.0)]);
}

#[test]
fn plot_degenerate_line_charts_do_not_panic() {
    for chart in degenerate_charts() {
        let svg = chart.to_svg(400, 250).unwrap();
        assert!(svg.starts_with("<svg"), "{chart:?}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{chart:?}\n{svg}");
        let png = chart.to_png(200, 120).unwrap();
        assert_eq!(ihdr_size(&png), (200, 120));
        assert!(distinct_colours(&decode(&png).2) > 1);
    }
}

fn histogram(series: Vec<(String, Vec<f64>)>, bins: usize) -> Histogram {
    Histogram { title: "lengths <&>".into(), x_label: "tokens".into(), series, bins }
}

#[test]
fn plot_histogram_bins_count_every_value() {
    // Integer values 0..=10 in 5 bins of width 3: [0,3) [3,6) [6,9) [9,12).
    let h = histogram(vec![("a".into(), vec![0.0, 1.0, 1.0, 2.0, 10.0, f64::NAN])], 5);
    let b = h.bins().unwrap();
    assert!(b.integer);
    assert_eq!((b.lo, b.width), (0.0, 3.0));
    assert_eq!(b.counts, [vec![4, 0, 0, 1]]);
    // Real values: `bins` equal bins, the maximum in the last one.
    let h = histogram(vec![("a".into(), vec![0.0, 0.5, 1.0]), ("b".into(), vec![0.25])], 2);
    let b = h.bins().unwrap();
    assert!(!b.integer);
    assert_eq!(b.counts, [vec![1, 2], vec![1, 0]]);
    assert!(histogram(vec![("e".into(), vec![f64::NAN])], 5).bins().is_none());
}

#[test]
fn plot_histogram_overlaid() {
    let h = histogram(
        vec![
            ("first".into(), (0..100).map(|i| (i % 37) as f64).collect()),
            ("last".into(), (0..100).map(|i| 20.0 + (i % 53) as f64).collect()),
        ],
        20,
    );
    let svg = h.to_svg(DEFAULT_WIDTH, DEFAULT_HEIGHT).unwrap();
    let texts = svg_texts(&svg);
    for t in ["lengths &lt;&amp;&gt;", "tokens", "count", "first", "last"] {
        assert!(texts.iter().any(|s| s == t), "{t}: {texts:?}");
    }
    assert!(svg.contains("opacity=\"0.45\""), "translucent bars");
    let png = h.to_png(500, 300).unwrap();
    assert_eq!(ihdr_size(&png), (500, 300));
    assert!(distinct_colours(&decode(&png).2) > 3);
}

#[test]
fn plot_degenerate_histograms_do_not_panic() {
    let cases: Vec<Vec<(String, Vec<f64>)>> = vec![
        vec![],
        vec![("e".into(), vec![])],
        vec![("one".into(), vec![7.0])],
        vec![("half".into(), vec![0.5])],
        vec![("const".into(), vec![3.0; 50]), ("zero".into(), vec![0.0; 5])],
        vec![("nan".into(), vec![f64::NAN, f64::INFINITY])],
        vec![("wide".into(), vec![-f64::MAX, f64::MAX])],
        vec![("wide int".into(), vec![0.0, 1e18])],
    ];
    for series in cases {
        for bins in [0, 1, 30, usize::MAX] {
            let h = histogram(series.clone(), bins);
            let svg = h.to_svg(300, 200).unwrap();
            assert!(svg.starts_with("<svg"));
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
            assert_eq!(ihdr_size(&h.to_png(128, 96).unwrap()), (128, 96));
        }
    }
}

#[test]
fn plot_save_writes_both_files() {
    let dir = std::env::temp_dir().join(format!("tlt-rl-plot-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let paths = two_series().save(&dir.join("nested/chart.v1")).unwrap();
    assert_eq!(paths, [dir.join("nested/chart.v1.svg"), dir.join("nested/chart.v1.png")]);
    let svg = std::fs::read_to_string(&paths[0]).unwrap();
    assert!(svg.starts_with("<svg"));
    assert_eq!(ihdr_size(&std::fs::read(&paths[1]).unwrap()), (DEFAULT_WIDTH, DEFAULT_HEIGHT));
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
            active_requests: (0..40).map(|i| 32usize.saturating_sub(i + 4 * s as usize)).collect(),
            response_lengths: (0..32).map(|i| 10 + i * (s as usize + 1)).collect(),
            ..StepMetrics::default()
        })
        .collect()
}

const CHARTS: [&str; 5] = ["reward", "response_length", "active_requests", "accept_length", "step_time"];

#[test]
fn plot_training_plots_writes_all_charts() {
    let dir = std::env::temp_dir().join(format!("tlt-rl-plot-training-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (tlt, base) = (run("tlt", 3), run("baseline", 3));
    let paths = training_plots(&tlt, Some(&base), &dir).unwrap();
    assert_eq!(paths.len(), 10);
    for stem in CHARTS {
        let svg = dir.join(format!("{stem}.svg"));
        let png = dir.join(format!("{stem}.png"));
        assert!(paths.contains(&svg) && paths.contains(&png), "{stem}");
        assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"), "{stem}");
        assert_eq!(ihdr_size(&std::fs::read(&png).unwrap()), (DEFAULT_WIDTH, DEFAULT_HEIGHT), "{stem}");
    }
    let texts = |stem: &str| svg_texts(&std::fs::read_to_string(dir.join(format!("{stem}.svg"))).unwrap());
    let reward = texts("reward");
    for t in ["Mean reward per step", "RL step", "tlt", "baseline"] {
        assert!(reward.iter().any(|s| s == t), "{t}: {reward:?}");
    }
    // Three steps: the step axis shows 0, 1, 2 and nothing in between.
    for t in ["0", "1", "2"] {
        assert!(reward.iter().any(|s| s == t), "{t}: {reward:?}");
    }
    assert!(!reward.iter().any(|s| s == "0.5" || s == "1.5"), "{reward:?}");
    // TLT and the baseline share the active-requests chart.
    let active = texts("active_requests");
    assert!(
        active.iter().any(|s| s == "tlt (step 2)") && active.iter().any(|s| s == "baseline (step 2)"),
        "{active:?}"
    );
    let hist = texts("response_length");
    assert!(hist.iter().any(|s| s == "step 0") && hist.iter().any(|s| s == "step 2"), "{hist:?}");
    let accept = texts("accept_length");
    assert!(accept.iter().any(|s| s.starts_with("Accept length")), "{accept:?}");
    let times = texts("step_time");
    for t in ["rollout_s", "train_s", "step_s", "baseline rollout_s", "baseline step_s"] {
        assert!(times.iter().any(|s| s == t), "{t}: {times:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_data_parallel_run_gets_a_chart_of_each_ranks_rollout_and_idle_time() {
    let dir = std::env::temp_dir().join(format!("tlt-rl-plot-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut two = run("tlt", 3);
    for m in &mut two {
        m.ranks = 2;
        m.rank_rollout_s = vec![6.0, 9.0];
        m.rank_idle_s = vec![3.0, 0.0];
    }
    let paths = training_plots(&two, None, &dir).unwrap();
    assert_eq!(paths.len(), 12, "the five charts and rank_times");
    let texts = svg_texts(&std::fs::read_to_string(dir.join("rank_times.svg")).unwrap());
    for t in ["rank 0 rollout_s", "rank 0 idle_s", "rank 1 rollout_s", "rank 1 idle_s"] {
        assert!(texts.iter().any(|s| s == t), "{t}: {texts:?}");
    }
    let one = training_plots(&run("tlt", 3), None, &dir.join("one")).unwrap();
    assert_eq!(one.len(), 10, "no rank chart for one rank");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plot_training_plots_empty_and_single_step() {
    let dir = std::env::temp_dir().join(format!("tlt-rl-plot-empty-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let one = run("tlt", 1);
    let empty_rollout = [StepMetrics { reward_mean: f64::NAN, ..StepMetrics::default() }];
    for (name, metrics, baseline) in [
        ("empty", &[][..], None),
        ("empty-both", &[][..], Some(&[][..])),
        ("one", &one[..], None),
        ("nan", &empty_rollout[..], Some(&one[..])),
    ] {
        let paths = training_plots(metrics, baseline, &dir.join(name)).unwrap();
        assert_eq!(paths.len(), 10, "{name}");
        for p in &paths {
            assert!(std::fs::metadata(p).unwrap().len() > 100, "{p:?}");
        }
        if metrics.is_empty() {
            for stem in CHARTS {
                let texts = svg_texts(&std::fs::read_to_string(dir.join(name).join(format!("{stem}.svg"))).unwrap());
                assert!(texts.iter().any(|s| s == "no data"), "{stem}: {texts:?}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
