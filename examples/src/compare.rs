//! The compact end of `train --mode compare`: TLT against the baseline per step (the step's time split, the
//! speed-ups) and whether the two runs sampled the same answers, written to `<out>/summary.txt` and printed last
//! (the GPU plan's `e2e` call prints it as its summary).

use std::io::Read;
use std::path::{Path, PathBuf};

use tlt_rl::metrics::StepMetrics;
use tlt_rl::runner::Comparison;

/// The file of [`summary`] in a comparison's output directory.
pub const SUMMARY_FILE: &str = "summary.txt";

/// Where a run of a comparison keeps its policy weights (f32 safetensors), in the order looked for: the final
/// export, then the last checkpoint.
pub const POLICY_FILES: [&str; 2] = ["export/policy/model.safetensors", "checkpoint/policy/model.safetensors"];

/// A step's seconds split into the parts that add up to its wall time: rollout, rewards (the wait for them after
/// the rollout), update, drafter (trained after the rollout), other (publication and the rest).
pub fn split(m: &StepMetrics) -> [f64; 6] {
    let parts = [m.rollout_s, m.reward_wait_s, m.train_s, m.drafter_after_s];
    let other = (m.step_s - parts.iter().sum::<f64>()).max(0.0);
    [parts[0], parts[1], parts[2], parts[3], other, m.step_s]
}

/// Whether a TLT step sampled the baseline's tokens: the same digest of every answer's tokens
/// ([`tlt_rl::metrics::tokens_digest`]), the same length for every answer and the same mean reward.
pub fn same_samples(t: &StepMetrics, b: &StepMetrics) -> bool {
    t.tokens_digest == b.tokens_digest
        && t.response_lengths == b.response_lengths
        && t.reward_mean.to_bits() == b.reward_mean.to_bits()
}

/// Whether the two runs under `out` (`tlt/`, `baseline/`) ended with bit-identical policy weights, comparing the
/// first of [`POLICY_FILES`] both have; `None` when they have none in common. With the GRPO loss on the sampled
/// tokens alone (no truncated importance sampling), identical weights after the last update mean every step
/// trained on the same tokens: one differing token changes that step's gradient.
///
/// # Errors
/// A file that exists but cannot be read.
pub fn policies_identical(out: &Path) -> std::io::Result<Option<(bool, &'static str)>> {
    for rel in POLICY_FILES {
        let (t, b) = (out.join("tlt").join(rel), out.join("baseline").join(rel));
        if t.is_file() && b.is_file() {
            return Ok(Some((files_equal(&t, &b)?, rel)));
        }
    }
    Ok(None)
}

/// Byte-for-byte equality of two files, read in chunks.
fn files_equal(a: &Path, b: &Path) -> std::io::Result<bool> {
    if std::fs::metadata(a)?.len() != std::fs::metadata(b)?.len() {
        return Ok(false);
    }
    let (mut fa, mut fb) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = fa.read(&mut ba)?;
        if n == 0 {
            return Ok(true);
        }
        fb.read_exact(&mut bb[..n])?;
        if ba[..n] != bb[..n] {
            return Ok(false);
        }
    }
}

/// The summary: one row per step (TLT/baseline seconds of each part of the step, the rollout and step speed-ups,
/// whether the step's samples matched), a row over all steps, the speed-ups beside Amdahl's bound and the tail's
/// share, what TLT's drafting did, and the token check (`policies`: [`policies_identical`]'s answer). About
/// `steps + 8` lines.
pub fn summary(cmp: &Comparison, policies: Option<(bool, &str)>) -> String {
    let (tlt, base) = (&cmp.tlt.metrics, &cmp.baseline.metrics);
    let mut s = String::from(
        "per step, seconds TLT/baseline (step = rollout + rewards waited for + update + drafter trained after the \
         rollout + other):\n| step | rollout | rewards | update | drafter | other | step | rollout x | step x | same \
         tokens |\n",
    );
    let row = |label: &str, t: [f64; 6], b: [f64; 6], same: &str| {
        let cells: Vec<String> = t.iter().zip(&b).map(|(t, b)| format!("{t:.2}/{b:.2}")).collect();
        format!(
            "| {label} | {} | {:.2}x | {:.2}x | {same} |\n",
            cells.join(" | "),
            b[0] / t[0].max(1e-9),
            b[5] / t[5].max(1e-9)
        )
    };
    let (mut tt, mut tb) = ([0.0; 6], [0.0; 6]);
    let mut same = 0;
    for (t, b) in tlt.iter().zip(base) {
        let (st, sb) = (split(t), split(b));
        for i in 0..6 {
            tt[i] += st[i];
            tb[i] += sb[i];
        }
        let ok = same_samples(t, b);
        same += usize::from(ok);
        s.push_str(&row(&t.step.to_string(), st, sb, if ok { "yes" } else { "NO" }));
    }
    let steps = tlt.len().min(base.len());
    s.push_str(&row("all", tt, tb, &format!("{same}/{steps}")));
    s.push_str(&format!(
        "TLT over baseline: rollout {:.2}x, end to end {:.2}x; Amdahl's bound from the baseline's split (rollout {:.0}% \
         of its step) {:.2}x; tail phase {:.0}% of the baseline's rollout\n",
        cmp.rollout_speedup,
        cmp.e2e_speedup,
        100.0 * cmp.rollout_share,
        cmp.amdahl_bound,
        100.0 * cmp.baseline.tail_share(),
    ));
    let n = tlt.len().max(1) as f64;
    let lens: Vec<f64> = tlt.iter().flat_map(|m| m.accept_lens.iter().copied()).collect();
    s.push_str(&format!(
        "TLT drafting: SD on {:.0}% of rounds, {:.2} tokens per speculative round, drafter trained {:.1} s in all\n",
        100.0 * tlt.iter().map(|m| m.sd_on_fraction).sum::<f64>() / n,
        lens.iter().sum::<f64>() / lens.len().max(1) as f64,
        cmp.tlt.total(|m| m.drafter_s),
    ));
    let weights = match policies {
        Some((true, rel)) => format!("final policies bit-identical ({rel}): yes"),
        Some((false, rel)) => format!("final policies bit-identical ({rel}): NO"),
        None => "final policies: not compared (neither run kept an export or a checkpoint)".to_string(),
    };
    let verdict =
        if same == steps && steps > 0 { "identical to the baseline's at every step" } else { "NOT the baseline's" };
    s.push_str(&format!(
        "tokens: {verdict} (64-bit digest of every answer's tokens, lengths and rewards equal at {same} of {steps} \
         steps); {weights}\n"
    ));
    s
}

/// Writes [`summary`] of `cmp` to `<out>/summary.txt`; returns it and the file.
///
/// # Errors
/// I/O failures.
pub fn write_summary(cmp: &Comparison, out: &Path) -> std::io::Result<(String, PathBuf)> {
    let text = summary(cmp, policies_identical(out)?);
    let path = out.join(SUMMARY_FILE);
    std::fs::write(&path, &text)?;
    Ok((text, path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tlt_rl::runner::RunOutcome;

    fn step(k: u64, rollout_s: f64, lens: Vec<usize>) -> StepMetrics {
        StepMetrics {
            step: k,
            rollout_s,
            reward_wait_s: 0.5,
            train_s: 2.0,
            drafter_after_s: 0.25,
            step_s: rollout_s + 3.0,
            response_lengths: lens,
            reward_mean: 0.5,
            ..StepMetrics::default()
        }
    }

    fn outcome(mode: &str, metrics: Vec<StepMetrics>) -> RunOutcome {
        RunOutcome { mode: mode.into(), metrics, ..RunOutcome::default() }
    }

    #[test]
    fn the_summary_splits_each_step_and_reports_the_checks() {
        let tlt = outcome("tlt", vec![step(0, 2.0, vec![3, 4]), step(1, 1.0, vec![5])]);
        let base = outcome("baseline", vec![step(0, 4.0, vec![3, 4]), step(1, 2.0, vec![6])]);
        let cmp = Comparison::new(tlt, base);
        let s = summary(&cmp, Some((true, POLICY_FILES[0])));
        println!("{s}");
        // Step 0: rollout 2/4, rewards 0.5, update 2, drafter 0.25, other 0.25, step 5/7.
        assert!(s.contains(
            "| 0 | 2.00/4.00 | 0.50/0.50 | 2.00/2.00 | 0.25/0.25 | 0.25/0.25 | 5.00/7.00 | 2.00x | 1.40x | yes |"
        ));
        assert!(s.contains("| 1 |") && s.contains("| NO |"), "step 1's lengths differ");
        assert!(s.contains("| all | 3.00/6.00 |") && s.contains("| 1/2 |"));
        assert!(s.contains("rollout 2.00x, end to end 1.33x"));
        assert!(s.contains("NOT the baseline's"), "a step that differs fails the check whatever the weights say");
        assert!(s.lines().count() <= 2 + 8 + 1);
        let same = Comparison::new(
            outcome("tlt", vec![step(0, 2.0, vec![3])]),
            outcome("baseline", vec![step(0, 4.0, vec![3])]),
        );
        assert!(summary(&same, Some((true, POLICY_FILES[0]))).contains("identical to the baseline's at every step"));
        assert!(summary(&same, None).contains("identical to the baseline's at every step"));
        // The same lengths and rewards, one token different: the digest tells them apart.
        let other = StepMetrics { tokens_digest: 7, ..step(0, 4.0, vec![3]) };
        let differ = Comparison::new(outcome("tlt", vec![step(0, 2.0, vec![3])]), outcome("baseline", vec![other]));
        assert!(summary(&differ, Some((true, POLICY_FILES[0]))).contains("NOT the baseline's"));
    }

    #[test]
    fn policies_are_compared_byte_for_byte_from_the_export_or_the_checkpoint() {
        let dir = std::env::temp_dir().join(format!("tlt-compare-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(policies_identical(&dir).unwrap(), None);
        let put = |run: &str, rel: &str, bytes: &[u8]| {
            let p = dir.join(run).join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, bytes).unwrap();
        };
        put("tlt", POLICY_FILES[1], b"abc");
        put("baseline", POLICY_FILES[1], b"abc");
        assert_eq!(policies_identical(&dir).unwrap(), Some((true, POLICY_FILES[1])));
        // The export comes first when both runs have one; one differing byte.
        let big: Vec<u8> = (0..3_000_000u32).map(|i| i as u8).collect();
        let mut other = big.clone();
        other[2_500_000] ^= 1;
        put("tlt", POLICY_FILES[0], &big);
        put("baseline", POLICY_FILES[0], &other);
        assert_eq!(policies_identical(&dir).unwrap(), Some((false, POLICY_FILES[0])));
        put("baseline", POLICY_FILES[0], &big);
        assert_eq!(policies_identical(&dir).unwrap(), Some((true, POLICY_FILES[0])));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
