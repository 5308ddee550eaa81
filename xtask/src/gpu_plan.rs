//! The GPU plan's rules, as `cargo xtask gpu-bundle --dry-run` checks them on the calls of `run.sh` (the script's
//! header and xtask/README.md, "The GPU plan", describe the plan). A GPU is lent for 15 minutes of machine time in
//! all, its start included, and no command may run over 10 minutes: the calls the plan runs by default must fit in
//! [`PLAN_MACHINE_S`] with the start ([`START_S`]), each call within its own limit, and a call killed at any point
//! must leave every finished step's lines and logs under `$OUT`.

use std::collections::BTreeSet;

use anyhow::{bail, Result};

/// One call of the plan (`run.sh NAME`).
#[derive(Debug, Clone, Copy)]
pub struct Call {
    /// `run.sh`'s argument.
    pub name: &'static str,
    /// Whether the plan runs it by default (counted in the plan's total), else only when time is left.
    pub default: bool,
    /// The most seconds its steps may take, budgets and kill graces together.
    pub limit_s: u64,
}

/// The most seconds of steps of an optional call: it runs only in what the default calls leave.
pub const OPTIONAL_LIMIT_S: u64 = 300;

/// The calls of the plan, in order: call 1 (`all`: compile-kernels, the CUDA suites, gpu-bench on SmolLM2 and one
/// 8B shape), call 2 (`e2e`: the demo's TLT-vs-baseline comparison on the GPU with SmolLM2's real weights, from
/// `target/gpu-e2e`); then the optional calls (`extra`: the Qwen3-8B sweep; `peer`: HF transformers; `ranks`: 2
/// MPI ranks on the GPU, from `target/gpu-ranks`; `serve`: `tlt-serve` on the GPU against SD off, from
/// `target/gpu-serve`) and the sections of call 1 alone, for reruns.
pub const CALLS: [Call; 8] = [
    Call { name: "all", default: true, limit_s: 6 * 60 },
    Call { name: "e2e", default: true, limit_s: 5 * 60 },
    Call { name: "extra", default: false, limit_s: OPTIONAL_LIMIT_S },
    Call { name: "peer", default: false, limit_s: OPTIONAL_LIMIT_S },
    Call { name: "ranks", default: false, limit_s: OPTIONAL_LIMIT_S },
    Call { name: "serve", default: false, limit_s: OPTIONAL_LIMIT_S },
    Call { name: "tests", default: false, limit_s: OPTIONAL_LIMIT_S },
    Call { name: "bench", default: false, limit_s: OPTIONAL_LIMIT_S },
];

/// The most machine time of the plan's default calls, the machine's start included: 13 of the 15 minutes, the
/// rest for the weights' and the bundles' transfers and the gaps between calls.
pub const PLAN_MACHINE_S: u64 = 13 * 60;
/// What the machine's start is allowed (1-2 minutes).
pub const START_S: u64 = 120;
/// The most seconds of steps of the default calls: 11 minutes.
pub const PLAN_STEPS_S: u64 = PLAN_MACHINE_S - START_S;
/// Seconds `timeout -k` waits after its TERM before it kills a step (`kill_grace` in `run.sh`), counted per step.
pub const KILL_GRACE_S: u64 = 2;
/// At most this many lines of a call's summary (printed last, so that it survives the tool's 12,000-character tail).
pub const MAX_SUMMARY_LINES: usize = 40;
/// The line `run.sh` prints before the whole summary, at the end.
const FINAL_HEADER: &str = "== ";

/// One step's line of a call's summary: `NAME: rc CODE in SECONDS s (budget BUDGET s)`.
pub fn step_line(line: &str) -> Option<(&str, i64, u64)> {
    let (name, rest) = line.split_once(": rc ")?;
    let (rc, rest) = rest.split_once(" in ")?;
    let budget = rest.split_once("(budget ")?.1.split_once(" s)")?.0;
    Some((name, rc.parse().ok()?, budget.parse().ok()?))
}

/// The files a call leaves under `$OUT`: its archive and its summary.
fn call_files(call: &str) -> [String; 2] {
    [format!("{call}.tar.gz"), format!("{call}-summary.txt")]
}

/// The archive's name for a step's log.
fn log_entry(call: &str, step: &str) -> String {
    format!("{call}/{step}.log")
}

/// What one call of a dry run left: the file names under `$OUT`, the summary file, the entries of the archive
/// (`tar tzf`), everything the call printed, and whether it exited 0.
#[derive(Debug, Default, Clone)]
pub struct CallOutput {
    /// File names under `$OUT`.
    pub files: Vec<String>,
    /// `$OUT/CALL-summary.txt`.
    pub summary: String,
    /// The archive's entries.
    pub archived: Vec<String>,
    /// The call's stdout.
    pub stdout: String,
    /// Whether it exited 0.
    pub exit_ok: bool,
}

/// What a call's check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallReport {
    /// Its steps.
    pub steps: usize,
    /// Its failed steps.
    pub failed: usize,
    /// Its steps' budgets and kill graces, in seconds.
    pub budget_s: u64,
}

/// Seconds a call's steps may take: each one's budget and kill grace.
fn budget_s(steps: &[(&str, i64, u64)]) -> u64 {
    steps.iter().map(|s| s.2 + KILL_GRACE_S).sum()
}

/// The rules of one call that ran to its end: exactly the archive and the summary under `$OUT`; a summary of
/// 1..=[`MAX_SUMMARY_LINES`] lines, each printed as it was written (in order, before the end) and the whole printed
/// again last; every step named with its exit code and budget, its log in the archive (but a step `not run`); the
/// budgets and kill graces within the call's limit; a last `status:` line that is `ok` exactly when every step
/// exited 0 (else `FAILED:` and the failed steps, by name), matching the script's own exit status.
///
/// # Errors
/// The first rule broken.
pub fn check_call(call: &Call, out: &CallOutput) -> Result<CallReport> {
    let name = call.name;
    let want = call_files(name);
    if out.files.len() != want.len() || !want.iter().all(|w| out.files.contains(w)) {
        bail!("`{name}` left {:?} under $OUT; the plan's rule is {want:?}", out.files);
    }
    let lines: Vec<&str> = out.summary.lines().collect();
    if lines.is_empty() || lines.len() > MAX_SUMMARY_LINES {
        bail!("`{name}`'s summary has {} lines (1..={MAX_SUMMARY_LINES})", lines.len());
    }
    let printed = out.stdout.trim_end();
    let Some(before) = printed.strip_suffix(out.summary.trim_end()) else {
        bail!("`{name}` does not print its summary last");
    };
    let mut early = before.lines().filter(|l| !l.starts_with(FINAL_HEADER));
    if let Some(missing) = lines.iter().find(|l| !early.any(|e| e == **l)) {
        bail!("`{name}` did not print its summary line {missing:?} as it wrote it (in order, before the end)");
    }
    let steps: Vec<(&str, i64, u64)> = lines.iter().filter_map(|l| step_line(l)).collect();
    if steps.is_empty() {
        bail!("`{name}`'s summary names no step");
    }
    let archived: BTreeSet<&str> = out.archived.iter().map(String::as_str).collect();
    for line in &lines {
        if let Some((step, ..)) = step_line(line) {
            if !line.contains("not run") && !archived.contains(log_entry(name, step).as_str()) {
                bail!("`{name}`'s archive lacks {}", log_entry(name, step));
            }
        }
    }
    let budget = budget_s(&steps);
    if budget > call.limit_s {
        bail!(
            "`{name}`'s steps are budgeted {budget} s in all ({KILL_GRACE_S} s of kill grace each), over its {} s",
            call.limit_s
        );
    }
    let failed: Vec<&str> = steps.iter().filter(|s| s.1 != 0).map(|s| s.0).collect();
    let status = lines.last().and_then(|l| l.strip_prefix("status: ")).unwrap_or_default();
    let named: Vec<&str> = status.strip_prefix("FAILED:").map(|f| f.split_whitespace().collect()).unwrap_or_default();
    let consistent = if failed.is_empty() { status == "ok" } else { named == failed };
    if !consistent || out.exit_ok != failed.is_empty() {
        bail!(
            "`{name}`: steps {failed:?} failed, but the status line says {status:?} and the exit is ok: {}",
            out.exit_ok
        );
    }
    Ok(CallReport { steps: steps.len(), failed: failed.len(), budget_s: budget })
}

/// The plan's total: the seconds of steps of every call the plan runs by default, within [`PLAN_STEPS_S`]; the line
/// `plan total: N s of steps ...` on success.
///
/// # Errors
/// When a default call has no report or the total is over the limit.
pub fn plan_total(reports: &[(&str, CallReport)]) -> Result<String> {
    let mut total = 0;
    let mut parts = Vec::new();
    for call in CALLS.iter().filter(|c| c.default) {
        let Some((_, r)) = reports.iter().find(|(n, _)| *n == call.name) else {
            bail!("the plan's default call `{}` did not run", call.name);
        };
        total += r.budget_s;
        parts.push(format!("`{}` {} s", call.name, r.budget_s));
    }
    let line = format!(
        "plan total: {total} s of steps ({}, each step's budget and {KILL_GRACE_S} s of kill grace), limit \
         {PLAN_STEPS_S} s: with the start's {START_S} s, {} s of the {PLAN_MACHINE_S} s allowed",
        parts.join(" + "),
        total + START_S
    );
    if total > PLAN_STEPS_S {
        bail!("{line}: over the limit");
    }
    Ok(line)
}

/// The rules of a call killed halfway (its processes killed at once, as the device tool kills a command at its
/// limit), given every line it printed before it died (`seen`): it was killed before its end (no `status:` line
/// seen) after at least one step; under `$OUT` only its archive, its summary and at most the archive's half-written
/// next version; every line it printed is in the summary file, in order, from its start; every step it printed has
/// its log in the archive. A line on what was found.
///
/// # Errors
/// The first rule broken.
pub fn check_killed(call: &str, seen: &[String], out: &CallOutput) -> Result<String> {
    if seen.iter().any(|l| l.starts_with("status: ")) {
        bail!("`{call}` ended before it was killed: the control proves nothing");
    }
    let steps: Vec<&str> = seen.iter().filter_map(|l| step_line(l)).map(|s| s.0).collect();
    if steps.is_empty() {
        bail!("`{call}` was killed before any step ended: the control proves nothing");
    }
    let want = call_files(call);
    let partial = format!(".{call}.tar.gz.tmp");
    if !want.iter().all(|w| out.files.contains(w)) || out.files.iter().any(|f| !want.contains(f) && *f != partial) {
        bail!("the killed `{call}` left {:?} under $OUT; wanted {want:?} (and perhaps {partial})", out.files);
    }
    let written: Vec<&str> = out.summary.lines().collect();
    for (i, line) in seen.iter().enumerate() {
        if written.get(i) != Some(&line.as_str()) {
            bail!("the killed `{call}` printed {line:?} (line {}), which its summary under $OUT lacks", i + 1);
        }
    }
    for step in &steps {
        if !out.archived.iter().any(|a| *a == log_entry(call, step)) {
            bail!("the killed `{call}` printed step {step}'s line, but its archive lacks {}", log_entry(call, step));
        }
    }
    Ok(format!(
        "killed after {} steps ({}): their {} lines and logs are under $OUT ({} summary lines, {} archived files)",
        steps.len(),
        steps.join(", "),
        seen.len(),
        written.len(),
        out.archived.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: Call = Call { name: "c", default: true, limit_s: 200 };

    fn good() -> CallOutput {
        let summary = "device: x\nstep-a: rc 0 in 3 s (budget 100 s); ok\n  test result: ok\n\
                       step-b: rc 1 in 2 s (budget 50 s)\nstatus: FAILED: step-b\n";
        CallOutput {
            files: vec!["c.tar.gz".into(), "c-summary.txt".into()],
            summary: summary.to_string(),
            archived: vec!["c/".into(), "c/step-a.log".into(), "c/step-b.log".into()],
            stdout: format!("{summary}== c: the summary\n{summary}"),
            exit_ok: false,
        }
    }

    #[test]
    fn the_dry_runs_checks_pass_a_good_call_and_catch_each_broken_rule() {
        let g = good();
        assert_eq!(check_call(&C, &g).unwrap(), CallReport { steps: 2, failed: 1, budget_s: 154 });
        // Negative controls: each rule broken once.
        let with = |f: &dyn Fn(&mut CallOutput)| {
            let mut o = good();
            f(&mut o);
            o
        };
        let many: String = (0..41).map(|i| format!("line {i}\n")).collect::<String>() + &g.summary;
        let cases = [
            ("a third file", with(&|o| o.files.push("x".into()))),
            ("no archive", with(&|o| o.files.retain(|f| f != "c.tar.gz"))),
            ("41+ lines", with(&|o| (o.summary, o.stdout) = (many.clone(), format!("{many}{many}")))),
            ("summary not last", with(&|o| o.stdout.push_str("late output\n"))),
            ("printed only at the end", with(&|o| o.stdout = format!("== c\n{}", o.summary))),
            ("printed out of order", {
                let s = &g.summary;
                let shuffled: String = s.lines().rev().map(|l| format!("{l}\n")).collect();
                with(&|o| o.stdout = format!("{shuffled}{s}"))
            }),
            ("a log not archived", with(&|o| o.archived.retain(|a| a != "c/step-b.log"))),
            ("over budget", {
                let s = g.summary.replace("budget 100 s", "budget 147 s");
                with(&|o| (o.summary, o.stdout) = (s.clone(), format!("{s}{s}")))
            }),
            ("a failure called ok", {
                let s = g.summary.replace("status: FAILED: step-b", "status: ok");
                with(&|o| (o.summary, o.stdout) = (s.clone(), format!("{s}{s}")))
            }),
            ("exit ok despite a failure", with(&|o| o.exit_ok = true)),
            ("no step", with(&|o| (o.summary, o.stdout) = ("status: ok\n".into(), "status: ok\nstatus: ok\n".into()))),
        ];
        for (what, o) in cases {
            let e = check_call(&C, &o).expect_err(what);
            println!("negative control, {what}: {e}");
        }
        // Within the limit exactly: 146 + 50 s of budget and 2 x 2 s of grace is 200 s.
        let s = g.summary.replace("budget 100 s", "budget 146 s");
        let exact = with(&|o| (o.summary, o.stdout) = (s.clone(), format!("{s}{s}")));
        assert_eq!(check_call(&C, &exact).unwrap().budget_s, 200);
        // A step that did not run has no log.
        let s = g.summary.replace("(budget 50 s)", "(budget 50 s); not run: no weights");
        let not_run = with(&|o| {
            (o.summary, o.stdout) = (s.clone(), format!("{s}{s}"));
            o.archived.retain(|a| a != "c/step-b.log");
        });
        assert!(check_call(&C, &not_run).is_ok());
    }

    #[test]
    fn the_plan_total_counts_every_default_call_and_fails_over_eleven_minutes() {
        let r = |b| CallReport { steps: 1, failed: 0, budget_s: b };
        let line = plan_total(&[("all", r(350)), ("e2e", r(282)), ("ranks", r(1000))]).unwrap();
        assert!(line.starts_with("plan total: 632 s of steps"), "{line}");
        assert!(line.contains("752 s of the 780 s"), "{line}");
        // Negative controls: over 660 s by one second; a default call missing.
        let e = plan_total(&[("all", r(360)), ("e2e", r(301))]).expect_err("661 s");
        println!("negative control, over the plan's limit: {e}");
        assert!(plan_total(&[("all", r(360)), ("e2e", r(300))]).is_ok());
        let e = plan_total(&[("all", r(100))]).expect_err("e2e missing");
        println!("negative control, a default call missing: {e}");
        assert_eq!(PLAN_STEPS_S + START_S, 13 * 60);
        let default_limits: u64 = CALLS.iter().filter(|c| c.default).map(|c| c.limit_s).sum();
        assert!(default_limits <= PLAN_STEPS_S, "the default calls' own limits add up to {default_limits} s");
    }

    #[test]
    fn the_killed_calls_check_passes_what_finished_and_catches_what_is_lost() {
        let seen: Vec<String> = ["device: x", "step-a: rc 0 in 3 s (budget 100 s); ok", "  test result: ok"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let out = CallOutput {
            files: vec!["c.tar.gz".into(), "c-summary.txt".into(), ".c.tar.gz.tmp".into()],
            // One more line written after the last one read, before the kill.
            summary: format!("{}\nstep-b: rc 1 in 2 s (budget 50 s)\n", seen.join("\n")),
            archived: vec!["c/".into(), "c/step-a.log".into()],
            ..CallOutput::default()
        };
        assert!(check_killed("c", &seen, &out).is_ok());
        let with = |f: &dyn Fn(&mut CallOutput)| {
            let mut o = out.clone();
            f(&mut o);
            o
        };
        let mut ended = seen.clone();
        ended.push("status: ok".into());
        let cases = [
            ("nothing under $OUT", seen.clone(), CallOutput::default()),
            ("the summary written only at the end", seen.clone(), with(&|o| o.summary.clear())),
            (
                "a printed line not written",
                seen.clone(),
                with(&|o| o.summary = o.summary.replace("  test result: ok\n", "")),
            ),
            ("the log not archived", seen.clone(), with(&|o| o.archived.retain(|a| a != "c/step-a.log"))),
            ("no archive", seen.clone(), with(&|o| o.files.retain(|f| f != "c.tar.gz"))),
            ("a stray file", seen.clone(), with(&|o| o.files.push("core".into()))),
            ("the call was not killed halfway", ended, out.clone()),
            ("killed before a step ended", seen[..1].to_vec(), out.clone()),
        ];
        for (what, seen, o) in cases {
            let e = check_killed("c", &seen, &o).expect_err(what);
            println!("negative control, {what}: {e}");
        }
    }
}
