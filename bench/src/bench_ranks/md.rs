//! The markdown of `cargo xtask bench ranks`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::data::{idle_fraction, Compared, Report, Run, StepLine};

fn mean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (s, n) = xs.into_iter().fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n > 0 {
        s / n as f64
    } else {
        f64::NAN
    }
}

fn list(xs: &[f64]) -> String {
    xs.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" / ")
}

/// Imbalance of a step: the slowest rank's rollout over the mean rank's.
fn imbalance(rank_rollout_s: &[f64]) -> f64 {
    let max = rank_rollout_s.iter().copied().fold(0.0, f64::max);
    max / mean(rank_rollout_s.iter().copied())
}

fn kind(steal: Option<bool>) -> &'static str {
    match steal {
        None => "",
        Some(false) => ", stealing off",
        Some(true) => ", stealing on",
    }
}

/// Per (ranks, stealing, RL step): the runs' means of the measured figures.
fn measured_table(s: &mut String, runs: &[Run]) {
    let mut by: BTreeMap<(&str, u64), (&Run, Vec<&StepLine>)> = BTreeMap::new();
    for r in runs {
        for st in &r.steps {
            by.entry((&r.set, st.step)).or_insert_with(|| (r, Vec::new())).1.push(st);
        }
    }
    s.push_str(
        "| set | ranks | prompts x answers, batch cap | stealing | step | repeats | step s | rollout s (slowest rank) | update s | per-rank rollout s | per-rank idle s | \
         idle fraction | imbalance (max/mean rank) |\n|---|---:|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|\n",
    );
    for ((set, step), (run, v)) in &by {
        let n = v.len();
        let ranks_n = v[0].rank_rollout_s.len();
        let rr: Vec<f64> = (0..ranks_n).map(|i| mean(v.iter().map(|x| x.rank_rollout_s[i]))).collect();
        let ri: Vec<f64> = (0..ranks_n).map(|i| mean(v.iter().map(|x| x.rank_idle_s[i]))).collect();
        let roll = mean(v.iter().map(|x| x.rollout_s));
        let _ = writeln!(
            s,
            "| {set} | {} | {} x {}, {} | {} | {step} | {n} | {:.2} | {roll:.2} | {:.2} | {} | {} | {:.3} | {:.3} |",
            run.ranks,
            run.steps[0].lengths.len() / run.group_size,
            run.group_size,
            run.max_running,
            match run.steal {
                None => "n/a",
                Some(false) => "off",
                Some(true) => "on",
            },
            mean(v.iter().map(|x| x.step_s)),
            mean(v.iter().map(|x| x.train_s)),
            list(&rr),
            list(&ri),
            idle_fraction(&ri, roll),
            imbalance(&rr),
        );
    }
}

fn compared_table(s: &mut String, rows: &[&Compared]) {
    s.push_str(
        "| run | step | measured rollout s | simulated s | sim/meas | measured per-rank rollout s | simulated | measured \
         per-rank idle s | simulated | idle fraction meas / sim | groups stolen meas / sim |\n\
         |---|---:|---:|---:|---:|---|---|---|---|---|---|\n",
    );
    for c in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.2} | {:.2} | {:.3} | {} | {} | {} | {} | {:.3} / {:.3} | {} / {} |",
            c.run,
            c.step,
            c.measured_rollout_s,
            c.sim_rollout_s,
            c.makespan_ratio,
            list(&c.measured_rank_rollout_s),
            list(&c.sim_rank_rollout_s),
            list(&c.measured_rank_idle_s),
            list(&c.sim_rank_idle_s),
            c.measured_idle_fraction,
            c.sim_idle_fraction,
            c.measured_stolen_groups,
            c.sim_stolen_groups
        );
    }
    let err = mean(rows.iter().map(|c| (c.makespan_ratio - 1.0).abs()));
    let rank_err =
        mean(rows.iter().flat_map(|c| {
            c.sim_rank_rollout_s.iter().zip(&c.measured_rank_rollout_s).map(|(s, m)| (s / m - 1.0).abs())
        }));
    let _ = writeln!(
        s,
        "\nMean |sim/meas - 1|: makespan {:.1}%, per-rank rollout {:.1}% ({} steps).\n",
        100.0 * err,
        100.0 * rank_err,
        rows.len()
    );
}

/// The report as markdown.
pub fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let m = &r.header.machine;
    let _ = writeln!(
        s,
        "# ranks: data-parallel rollouts measured beside the simulator, and predicted GPU clusters\n\n{} ({} logical CPUs); \
         commit {}; {}; `{}`\n",
        m.cpu_model, m.nproc, r.header.git_commit, r.header.timestamp, r.header.command_line
    );
    s.push_str("## Measured (trainer JSONL; means over the repeats)\n\n");
    measured_table(&mut s, &r.runs);
    s.push_str(
        "\n## CPU calibration: round seconds = fixed + per-request x running requests (least squares over every \
         round)\n\n| fitted on | rounds | fixed ms | per request ms | R^2 | RMSE ms | mean round ms | tail tokens per \
         request-round (batch <= 4) | overhead s (rollout - rounds) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for c in &r.calibrations {
        let _ = writeln!(
            s,
            "| {} ({}) | {} | {:.2} | {:.3} | {:.3} | {:.2} | {:.2} | {:.3} | {:.3} |",
            c.label,
            c.files.join(", "),
            c.rounds,
            c.line.fixed_s * 1e3,
            c.line.per_token_s * 1e3,
            c.r2,
            c.rmse_s * 1e3,
            c.mean_round_s * 1e3,
            c.tail_tokens_per_request_round,
            c.overhead_s
        );
    }
    let mut groups: BTreeMap<(&str, &str), Vec<&Compared>> = BTreeMap::new();
    for c in &r.compared {
        groups.entry((&c.set, &c.calibration)).or_default().push(c);
    }
    for ((set, cal), rows) in &groups {
        let (ranks, steal) = (rows[0].ranks, rows[0].steal);
        let _ = writeln!(
            s,
            "\n## {set} ({ranks} rank(s){}): measured vs simulated with the \"{cal}\" calibration\n",
            kind(steal)
        );
        compared_table(&mut s, rows);
    }
    let g = &r.gpu;
    let _ = writeln!(
        s,
        "## PREDICTION: GPU clusters (simulated, not measured)\n\nStep costs: {}. Fitted lines (max relative error \
         over the roofline points): decode {:.3} ms + {:.4} ms/sequence ({:.1}%), verify {:.3} ms + {:.4} ms/token \
         ({:.1}%), draft forward {:.3} ms + {:.4} ms/token ({:.1}%); prefill {:.4} ms/token. Accept lengths: the \
         simulator's default `AcceptModel` (illustrative, not measured on any GPU). Settings: {}.\n",
        g.source,
        g.cost.decode.fixed_s * 1e3,
        g.cost.decode.per_token_s * 1e3,
        100.0 * g.max_rel_err[0],
        g.cost.verify.fixed_s * 1e3,
        g.cost.verify.per_token_s * 1e3,
        100.0 * g.max_rel_err[1],
        g.cost.draft.fixed_s * 1e3,
        g.cost.draft.per_token_s * 1e3,
        100.0 * g.max_rel_err[2],
        g.cost.prefill_per_token_s * 1e3,
        r.prediction_settings,
    );
    s.push_str(
        "| label | GPUs | max_running | stealing | mode | makespan s / RL step | idle fraction | speed-up over baseline | \
         speed-up from stealing | groups stolen / step |\n|---|---:|---:|---|---|---:|---:|---:|---:|---:|\n",
    );
    for p in &r.predictions {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.1} | {:.3} | {:.3} | {:.3} | {:.1} |",
            p.label,
            p.gpus,
            p.max_running,
            if p.steal { "on" } else { "off" },
            p.mode,
            p.makespan_s,
            p.idle_fraction,
            p.speedup_over_baseline,
            p.speedup_from_stealing,
            p.stolen_groups
        );
    }
    s
}
