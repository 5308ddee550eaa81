//! The comparison as one page a browser opens: `<out>/report.html`, self-contained (inline CSS), with the charts
//! of `<out>/plots/` beside it as relative `<img>` links: the summary table (reward and held-out accuracy before
//! and after, the step-time split, TLT's speed-up by phase, Amdahl's bound, peak memory), the running batch in
//! seconds with TLT's speculative rounds marked, accept length, reward and accuracy per step, the step split, the
//! two runs' response lengths and their two-sample test, then the console's report and per-step summary.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use tlt_rl::runner::{Comparison, RunOutcome};

use crate::lengths::LengthComparison;

/// The page's file in a comparison's output directory.
pub const REPORT_FILE: &str = "report.html";

/// The names of the split's parts, as [`crate::compare::split`] orders them.
const PARTS: [&str; 6] = ["rollout", "rewards waited for", "update", "drafter after the rollout", "other", "step"];

/// The charts on the page, in order: (file stem under `plots/`, caption).
const FIGURES: [(&str, &str); 8] = [
    (
        "running_batch_seconds",
        "Running requests during the last rollout against wall-clock seconds from its start; dots mark the rounds \
         where TLT speculated. A line that reaches zero earlier finished its rollout earlier.",
    ),
    ("accept_length", "TLT's tokens per verify step (accept length), mean per RL step."),
    ("reward", "Mean reward of the sampled answers per RL step."),
    ("accuracy", "Fraction of the sampled answers that were correct, per RL step."),
    ("step_time", "Seconds per RL step: rollout, update and the whole step, both runs."),
    ("response_length_runs", "Every answer's length, all steps pooled: TLT's run over the baseline's."),
    ("response_length_cdf", "The same lengths as empirical CDFs: identical runs draw one line over the other."),
    ("active_requests", "The last rollout's running requests per decode round (rounds, not seconds)."),
];

/// How the two runs shared the machine, for the page's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Both in one process, step by step, the order alternating.
    Interleaved,
    /// TLT's run, then the baseline's, each in a fresh process.
    Sequential,
}

impl Schedule {
    /// A sentence for the report.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Interleaved => {
                "interleaved: both runs in one process, step by step, the order alternating each step, so a drift \
                 of the machine over time falls on both"
            }
            Self::Sequential => {
                "sequential: TLT's run, then the baseline's, each in a fresh process (a drift of the machine falls on \
                 one run only)"
            }
        }
    }
}

/// Escapes `s` for HTML text and attribute values.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// `before -> after` of a held-out figure, or a dash without an evaluation.
fn eval(o: &RunOutcome, f: impl Fn(&tlt_rl::trainer::Evaluation) -> f64) -> String {
    match (&o.before, &o.after) {
        (Some(b), Some(a)) => format!("{:.3} &rarr; {:.3}", f(b), f(a)),
        _ => "&ndash;".into(),
    }
}

/// Each part of the step summed over a run's steps.
fn totals(o: &RunOutcome) -> [f64; 6] {
    let mut t = [0.0; 6];
    for m in &o.metrics {
        for (acc, v) in t.iter_mut().zip(crate::compare::split(m)) {
            *acc += v;
        }
    }
    t
}

const CSS: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1180px;margin:24px auto;\
padding:0 16px;color:#1b1b1b;line-height:1.45}h1{font-size:1.6em;margin-bottom:4px}h2{font-size:1.2em;\
margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}.meta{color:#555}table{border-collapse:collapse;\
margin:8px 0 16px}th,td{border:1px solid #ccc;padding:4px 10px;text-align:right}th{background:#f3f3f3}\
td:first-child,th:first-child{text-align:left}.ok{background:#e8f5e9;border:1px solid #66bb6a;padding:10px 14px;\
border-radius:6px}.bad{background:#ffebee;border:2px solid #e53935;padding:10px 14px;border-radius:6px;\
font-weight:bold;font-size:1.1em}figure{margin:16px 0 28px}figure img{width:100%;max-width:1100px;\
border:1px solid #eee}figcaption{color:#444;font-size:.95em}pre{background:#f7f7f7;padding:10px;overflow-x:auto;\
font-size:12px;white-space:pre-wrap}";

/// The page for `cmp`: `lengths` is the two runs' length test, `summary` the per-step text
/// ([`crate::compare::summary`]), `plots` the chart directory relative to the page.
pub fn html(cmp: &Comparison, lengths: &LengthComparison, schedule: Schedule, summary: &str, plots: &str) -> String {
    let (t, b) = (&cmp.tlt, &cmp.baseline);
    let steps = t.metrics.len().min(b.metrics.len());
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>TLT vs baseline: GRPO demo \
         report</title><style>{CSS}</style></head><body>\n<h1>TLT vs plain rollouts: GRPO demo report</h1>\n<p \
         class=\"meta\">{steps} RL steps per run, the same seeds; schedule: {}.</p>\n",
        esc(schedule.describe())
    );
    let (lt, lb) = (totals(t), totals(b));
    s.push_str("<h2>Summary</h2>\n<table><tr><th></th><th>TLT</th><th>baseline</th></tr>\n");
    let mut row = |name: &str, a: String, c: String| {
        let _ = writeln!(s, "<tr><td>{name}</td><td>{a}</td><td>{c}</td></tr>");
    };
    row("held-out reward, before &rarr; after", eval(t, |e| e.reward_mean), eval(b, |e| e.reward_mean));
    row("held-out accuracy, before &rarr; after", eval(t, |e| e.accuracy), eval(b, |e| e.accuracy));
    let per_step =
        |o: &RunOutcome, f: fn(&tlt_rl::metrics::StepMetrics) -> f64| match (o.metrics.first(), o.metrics.last()) {
            (Some(a), Some(z)) => format!("{:.3} &rarr; {:.3}", f(a), f(z)),
            _ => "&ndash;".into(),
        };
    row("sampled reward, first &rarr; last step", per_step(t, |m| m.reward_mean), per_step(b, |m| m.reward_mean));
    let pct = |v: &[f64; 6], i: usize| format!("{:.1} s ({:.0}%)", v[i], 100.0 * v[i] / v[5].max(1e-9));
    for (i, part) in PARTS.iter().enumerate().take(5) {
        row(&format!("time in {part}"), pct(&lt, i), pct(&lb, i));
    }
    row("time in all steps", format!("{:.1} s", lt[5]), format!("{:.1} s", lb[5]));
    let gb = |o: &RunOutcome| o.peak_rss_gb.map_or("&ndash;".into(), |g| format!("{g:.2} GB"));
    row("peak resident memory (process)", gb(t), gb(b));
    s.push_str("</table>\n<table><tr><th>TLT's speed-up over the baseline</th><th>baseline s / TLT s</th></tr>\n");
    for (i, part) in PARTS.iter().enumerate() {
        let ratio = if lt[i] > 1e-9 { format!("{:.2}x", lb[i] / lt[i]) } else { "&ndash;".into() };
        let _ = writeln!(s, "<tr><td>{part}</td><td>{ratio}</td></tr>");
    }
    let _ = writeln!(
        s,
        "<tr><td>Amdahl's bound: 1 / ((1 - R) + R / S), R = {:.0}% rollout share, S = {:.2}x</td><td>{:.2}x</td></tr>",
        100.0 * cmp.rollout_share,
        cmp.rollout_speedup,
        cmp.amdahl_bound
    );
    s.push_str("</table>\n<h2>Response lengths: two-sample test</h2>\n");
    let class = if lengths.identical { "ok" } else { "bad" };
    let _ = writeln!(s, "<p class=\"{class}\">{}</p>", esc(&lengths.verdict()));
    if !lengths.per_step.is_empty() {
        s.push_str("<table><tr><th>step</th><th>D</th><th>p</th><th>n (TLT / baseline)</th></tr>\n");
        for (step, k) in &lengths.per_step {
            let _ = writeln!(
                s,
                "<tr><td>{step}</td><td>{:.4}</td><td>{:.4}</td><td>{} / {}</td></tr>",
                k.d, k.p, k.n.0, k.n.1
            );
        }
        s.push_str("</table>\n");
    }
    s.push_str("<h2>Charts</h2>\n");
    for (stem, caption) in FIGURES {
        let _ = writeln!(
            s,
            "<figure><img src=\"{}/{stem}.png\" alt=\"{stem}\"><figcaption>{}</figcaption></figure>",
            esc(plots),
            esc(caption)
        );
    }
    let _ = write!(
        s,
        "<h2>Console report</h2>\n<pre>{}</pre>\n<h2>Per step</h2>\n<pre>{}</pre>\n</body></html>\n",
        esc(&cmp.report()),
        esc(summary)
    );
    s
}

/// Writes [`html`] to `<out>/report.html`, the charts expected in `<out>/plots/`; returns the file.
///
/// # Errors
/// I/O failures.
pub fn write_html(
    cmp: &Comparison,
    lengths: &LengthComparison,
    schedule: Schedule,
    summary: &str,
    out: &Path,
) -> std::io::Result<PathBuf> {
    let path = out.join(REPORT_FILE);
    std::fs::write(&path, html(cmp, lengths, schedule, summary, "plots"))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tlt_rl::metrics::StepMetrics;

    #[test]
    fn the_page_holds_the_table_the_test_and_every_chart() {
        let step = |lens: Vec<usize>, rollout_s| StepMetrics {
            rollout_s,
            step_s: rollout_s + 1.0,
            train_s: 1.0,
            response_lengths: lens,
            ..StepMetrics::default()
        };
        let out = |mode: &str, m| RunOutcome { mode: mode.into(), metrics: vec![m], ..RunOutcome::default() };
        let cmp = Comparison::new(out("tlt", step(vec![3, 4], 2.0)), out("baseline", step(vec![3, 4], 4.0)));
        let lengths = LengthComparison::new(&cmp.tlt.metrics, &cmp.baseline.metrics);
        let page = html(&cmp, &lengths, Schedule::Interleaved, "a <b> row", "plots");
        assert!(page.starts_with("<!DOCTYPE html>") && page.ends_with("</html>\n"));
        assert!(page.contains("schedule: interleaved"), "the schedule is named");
        assert!(page.contains("<td>rollout</td><td>2.00x</td>"), "{page}");
        assert!(page.contains("class=\"ok\">response lengths: identical (2 answers"));
        assert!(page.contains("a &lt;b&gt; row"), "text is escaped");
        for (stem, _) in FIGURES {
            assert!(page.contains(&format!("<img src=\"plots/{stem}.png\"")), "{stem}");
        }
        let differ = Comparison::new(out("tlt", step(vec![3, 4], 2.0)), out("baseline", step(vec![30, 40], 4.0)));
        let lengths = LengthComparison::new(&differ.tlt.metrics, &differ.baseline.metrics);
        let page = html(&differ, &lengths, Schedule::Sequential, "", "plots");
        assert!(page.contains("class=\"bad\">response lengths: DIFFER") && page.contains("schedule: sequential"));
    }
}
