//! Per-step training metrics and their JSONL log.
//!
//! One [`StepMetrics`] per RL step is appended to a JSON-lines file by [`MetricsWriter`], which flushes and fsyncs
//! every line so a crash loses at most the line being written. [`read_metrics`] reads the log back (skipping a
//! torn final line), and [`truncate_after`] rewinds it atomically when a run resumes from an earlier checkpoint.
//!
//! Non-finite floats (a `NaN` loss, an `accept_len` with no speculation) are written by `serde_json` as `null`;
//! they are read back as `NaN`.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::{Error, Result};

/// Everything recorded about one RL step (one rollout, reward, policy update and publish).
///
/// Every field has a default (`#[serde(default)]`), so log lines written by older versions, which lack newer
/// fields, still parse.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepMetrics {
    /// The RL step index (0-based).
    pub step: u64,
    /// The rollout mode: `"tlt"` (adaptive speculative rollouts) or `"baseline"` (plain decoding).
    pub mode: String,
    /// Mean reward over all samples of the step.
    #[serde(deserialize_with = "f64_or_nan")]
    pub reward_mean: f64,
    /// Population standard deviation of the rewards.
    #[serde(deserialize_with = "f64_or_nan")]
    pub reward_std: f64,
    /// Fraction of samples whose answer was correct.
    #[serde(deserialize_with = "f64_or_nan")]
    pub accuracy: f64,
    /// Fraction of samples that followed the required answer format.
    #[serde(deserialize_with = "f64_or_nan")]
    pub format_rate: f64,
    /// Median response length, tokens.
    #[serde(deserialize_with = "f64_or_nan")]
    pub response_len_p50: f64,
    /// 90th-percentile response length, tokens.
    #[serde(deserialize_with = "f64_or_nan")]
    pub response_len_p90: f64,
    /// Longest response, tokens.
    pub response_len_max: usize,
    /// Mean response length, tokens.
    #[serde(deserialize_with = "f64_or_nan")]
    pub response_len_mean: f64,
    /// Fraction of responses cut off at the length limit.
    #[serde(deserialize_with = "f64_or_nan")]
    pub truncation_rate: f64,
    /// Number of sampled responses in the step.
    pub samples: usize,
    /// Total generated tokens over all responses.
    pub rollout_tokens: usize,
    /// Wall seconds spent in the rollout (generation).
    #[serde(deserialize_with = "f64_or_nan")]
    pub rollout_s: f64,
    /// Seconds spent scoring answers, all reward workers together (see `[reward]` in the trainer config).
    #[serde(deserialize_with = "f64_or_nan")]
    pub reward_s: f64,
    /// The part of [`Self::reward_s`] that ran while the rollout was still decoding (hidden behind it).
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub reward_hidden_s: f64,
    /// Wall seconds the step waited for rewards after the rollout ended (the reward time the step paid for).
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub reward_wait_s: f64,
    /// Answers whose scoring ran past the reward deadline (scored 0).
    #[serde(default)]
    pub reward_timeouts: usize,
    /// Rollouts of the step (more than 1 only with dynamic sampling).
    #[serde(default)]
    pub gen_batches: usize,
    /// Groups trained on whose rewards were not all equal.
    #[serde(default)]
    pub informative_groups: usize,
    /// Wall seconds spent in the policy update.
    #[serde(deserialize_with = "f64_or_nan")]
    pub train_s: f64,
    /// Wall seconds spent publishing the new weights to the rollout model.
    #[serde(deserialize_with = "f64_or_nan")]
    pub publish_s: f64,
    /// Wall seconds of drafter training done during this step (during the rollout's tail, or after it).
    #[serde(deserialize_with = "f64_or_nan")]
    pub drafter_s: f64,
    /// The part of [`Self::drafter_s`] spent after the rollout ([`crate::trainer::DrafterSchedule::Fixed`]
    /// (crate::trainer::DrafterSchedule::Fixed)), outside [`Self::rollout_s`].
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub drafter_after_s: f64,
    /// Wall seconds of the whole step.
    #[serde(deserialize_with = "f64_or_nan")]
    pub step_s: f64,
    /// Fraction of rollout capacity left idle (1 − mean running requests / total requests).
    #[serde(deserialize_with = "f64_or_nan")]
    pub idle_fraction: f64,
    /// Fraction of decode steps that speculated.
    #[serde(deserialize_with = "f64_or_nan")]
    pub sd_on_fraction: f64,
    /// Mean accepted length per speculative step (tokens, including the bonus token).
    #[serde(deserialize_with = "f64_or_nan")]
    pub accept_len: f64,
    /// How many decode steps used each speculation arm (configuration name → count).
    pub arms: BTreeMap<String, u64>,
    /// Version of the drafter weights used at the end of the rollout.
    pub drafter_version: u64,
    /// Total drafter optimizer steps so far.
    pub drafter_steps: u64,
    /// Total policy loss.
    #[serde(deserialize_with = "f64_or_nan")]
    pub loss: f64,
    /// Policy-gradient part of the loss.
    #[serde(deserialize_with = "f64_or_nan")]
    pub pg_loss: f64,
    /// KL divergence to the reference policy.
    #[serde(deserialize_with = "f64_or_nan")]
    pub kl: f64,
    /// Mean token entropy of the policy.
    #[serde(deserialize_with = "f64_or_nan")]
    pub entropy: f64,
    /// Fraction of tokens whose ratio was clipped.
    #[serde(deserialize_with = "f64_or_nan")]
    pub clip_frac: f64,
    /// Mean PPO ratio `exp(logp - old_logp)` over trained tokens (1 with a single optimizer step).
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub ratio_mean: f64,
    /// Mean truncated importance-sampling weight between rollout and trainer (1 with the correction off).
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub tis_weight: f64,
    /// Optimizer steps of the update (mini-batches x epochs).
    #[serde(default)]
    pub optimizer_steps: usize,
    /// Optimizer steps skipped because the gradient norm was not finite (the weights were left unchanged).
    #[serde(default)]
    pub skipped_optimizer_steps: usize,
    /// Fraction of tokens whose loss the dual clip capped (verl `pg_clipfrac_lower`).
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub dual_clip_frac: f64,
    /// Mean `old_logp - logp` over trained tokens (verl `ppo_kl`; 0 with a single optimizer step).
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub ppo_kl: f64,
    /// Gradient norm before clipping.
    #[serde(deserialize_with = "f64_or_nan")]
    pub grad_norm: f64,
    /// Learning rate used for the update.
    #[serde(deserialize_with = "f64_or_nan")]
    pub lr: f64,
    /// Number of prompt groups whose rewards were all equal (zero advantage).
    pub zero_variance_groups: usize,
    /// Share of the rollout's decode time spent with at most the gate's threshold of requests running (the tail
    /// phase, where TLT speculates).
    #[serde(deserialize_with = "f64_or_nan")]
    pub tail_share: f64,
    /// Running requests after each decode step of the rollout.
    pub active_requests: Vec<usize>,
    /// Wall seconds of each decode step of the rollout (aligned with `active_requests`).
    #[serde(deserialize_with = "vec_f64_or_nan")]
    pub round_seconds: Vec<f64>,
    /// Tokens committed in each decode step, all requests together (aligned with `active_requests`).
    #[serde(default)]
    pub round_tokens: Vec<u64>,
    /// Wall seconds from the start of the rollout to the end of each decode step (aligned with `active_requests`):
    /// the running batch against time, where TLT's cheaper or dearer rounds show as they ran.
    #[serde(default, deserialize_with = "vec_f64_or_nan")]
    pub round_end_s: Vec<f64>,
    /// Whether each decode step speculated (aligned with `active_requests`).
    #[serde(default)]
    pub round_sd: Vec<bool>,
    /// Speculative rounds of this rollout that the bandit ran with its plain arm.
    #[serde(default)]
    pub plain_arm_steps: u64,
    /// Speculative request-rounds, their committed tokens and the argmax-chain ceiling of the same rounds
    /// ([`SdCeiling`](crate::trainer::SdCeiling)).
    #[serde(default)]
    pub sd_ceiling: crate::ceiling::SdCeiling,
    /// Seconds the drafter caught up before speculative rounds (inside `rollout_s`).
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub drafter_prepare_s: f64,
    /// Length of every response, tokens.
    pub response_lengths: Vec<usize>,
    /// [`tokens_digest`] of every response of the step, in sample order: two runs whose digests are equal sampled
    /// the same tokens (a 64-bit collision aside); 0 in lines written before it existed.
    #[serde(default)]
    pub tokens_digest: u64,
    /// Accepted length of every speculative step.
    #[serde(deserialize_with = "vec_f64_or_nan")]
    pub accept_lens: Vec<f64>,
    /// Data-parallel ranks of the run (0 in lines written before ranks existed; 1 for a one-process run). With
    /// several, the rollout's trace fields (`active_requests`, `round_seconds`, `round_tokens`, `arms`,
    /// `accept_lens`, `sd_on_fraction`, `idle_fraction`, the drafter's) are the logging rank's own, `rollout_s` is
    /// the slowest rank's, and the samples' fields (rewards, lengths, accuracy) cover every rank.
    pub ranks: usize,
    /// Each rank's rollout seconds, in rank order (empty for one rank).
    #[serde(deserialize_with = "vec_f64_or_nan")]
    pub rank_rollout_s: Vec<f64>,
    /// Each rank's wait for the slowest rank's rollout, `max(rank_rollout_s) - rank_rollout_s[r]`: the idle time
    /// TLT puts to work.
    #[serde(deserialize_with = "vec_f64_or_nan")]
    pub rank_idle_s: Vec<f64>,
    /// Groups decoded by a rank other than their owner (work stealing; 0 for one rank).
    pub stolen_groups: usize,
    /// Drafter versions that ranks installed while decoding, trained meanwhile by the trainer rank (rank 0) in its
    /// idle time (0 for one rank).
    pub drafter_swaps: u64,
    /// Seconds of the update spent summing gradients across ranks once all ranks were ready (0 for one rank).
    #[serde(deserialize_with = "f64_or_nan")]
    pub grad_sync_s: f64,
    /// Seconds of the update this rank waited for the slowest rank's backward (0 for one rank).
    #[serde(deserialize_with = "f64_or_nan")]
    pub grad_wait_s: f64,
}

/// Reads an `f64` that `serde_json` may have written as `null` (non-finite) as `NaN`.
fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// [`f64_or_nan`] for every element of a list.
fn vec_f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<f64>, D::Error> {
    let v = Vec::<Option<f64>>::deserialize(d)?;
    Ok(v.into_iter().map(|x| x.unwrap_or(f64::NAN)).collect())
}

/// Appends [`StepMetrics`] to a JSON-lines file, one object per line, durably.
///
/// Every [`write`](Self::write) flushes and fsyncs, so a crash loses at most the line being written (which
/// [`read_metrics`] then skips).
#[derive(Debug)]
pub struct MetricsWriter {
    file: File,
    path: PathBuf,
}

impl MetricsWriter {
    /// Creates (or truncates) the log at `path`, creating parent directories.
    ///
    /// # Errors
    /// [`Error::Io`] if the directory or file cannot be created.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        Self::open(path.as_ref(), false)
    }

    /// Opens the log at `path` for appending (resuming a run), creating it and its parents if missing.
    ///
    /// # Errors
    /// [`Error::Io`] if the directory or file cannot be opened.
    pub fn append(path: impl AsRef<Path>) -> Result<Self> {
        Self::open(path.as_ref(), true)
    }

    fn open(path: &Path, append: bool) -> Result<Self> {
        create_parent(path)?;
        let mut opts = OpenOptions::new();
        if append {
            opts.append(true).create(true);
        } else {
            opts.write(true).create(true).truncate(true);
        }
        let file = opts.open(path).map_err(|e| Error::io(path, e))?;
        Ok(Self { file, path: path.to_path_buf() })
    }

    /// The log file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `m` as one JSON line, then flushes and fsyncs the file.
    ///
    /// # Errors
    /// [`Error::Json`] if `m` cannot be serialised, [`Error::Io`] if writing or syncing fails.
    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let mut line = serde_json::to_string(m)?;
        line.push('\n');
        if tlt_model::chaos::fires("metrics.torn") {
            // The harness's torn append: half the line on disk, then the process dies.
            let _ = self.file.write_all(&line.as_bytes()[..line.len() / 2]).and_then(|()| self.file.sync_data());
            tlt_model::chaos::kill_now("metrics.torn");
        }
        self.file.write_all(line.as_bytes()).map_err(|e| Error::io(&self.path, e))?;
        self.file.flush().map_err(|e| Error::io(&self.path, e))?;
        self.file.sync_data().map_err(|e| Error::io(&self.path, e))
    }
}

fn create_parent(path: &Path) -> Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e)),
        _ => Ok(()),
    }
}

/// One non-blank line of a metrics log: its 1-based line number, raw text, and parse result.
struct Line<'a> {
    number: usize,
    text: &'a str,
    parsed: std::result::Result<StepMetrics, serde_json::Error>,
}

/// Parses every non-blank line of `text`; a bad final line (torn by a crash) is dropped with a warning, a bad line
/// anywhere else is an error naming its line number.
fn parse_lines<'a>(path: &Path, text: &'a str) -> Result<Vec<Line<'a>>> {
    // NUL bytes can pad the tail of a file after a crash on some filesystems.
    let is_blank = |l: &str| l.trim_matches(|c: char| c.is_whitespace() || c == '\0').is_empty();
    let mut lines: Vec<Line<'a>> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !is_blank(l))
        .map(|(i, l)| Line { number: i + 1, text: l, parsed: serde_json::from_str(l) })
        .collect();
    if let Some(last) = lines.last() {
        if let Err(e) = &last.parsed {
            tracing::warn!(
                path = %path.display(),
                line = last.number,
                error = %e,
                "skipping unparseable final metrics line (torn by a crash?)"
            );
            lines.pop();
        }
    }
    for l in &lines {
        if let Err(e) = &l.parsed {
            return Err(Error::parse(format!("{} line {}", path.display(), l.number), e.to_string()));
        }
    }
    Ok(lines)
}

fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    // A torn multi-byte character can only be at the end; decode lossily and let parsing reject it.
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Reads every [`StepMetrics`] from the JSON-lines log at `path`, in file order.
///
/// Blank lines are ignored. A final line that does not parse (a write torn by a crash) is skipped with a
/// `tracing` warning.
///
/// # Errors
/// [`Error::Io`] if the file cannot be read; [`Error::Parse`] naming the 1-based line number if any line other
/// than the last does not parse.
pub fn read_metrics(path: impl AsRef<Path>) -> Result<Vec<StepMetrics>> {
    let path = path.as_ref();
    let text = read_text(path)?;
    let lines = parse_lines(path, &text)?;
    Ok(lines.into_iter().filter_map(|l| l.parsed.ok()).collect())
}

/// Rewinds the log at `path` for a resume: keeps only lines with `step <= last_step` (and drops a torn final
/// line). Kept lines are copied verbatim.
///
/// The new contents are written to a temporary file next to `path`, fsynced, then renamed over it, so a crash
/// leaves either the old or the new log. A missing file is not an error (there is nothing to rewind).
///
/// # Errors
/// [`Error::Io`] if reading, writing or renaming fails; [`Error::Parse`] if a line other than the last does not
/// parse.
pub fn truncate_after(path: impl AsRef<Path>, last_step: u64) -> Result<()> {
    let path = path.as_ref();
    if !path.exists() {
        return Ok(());
    }
    let text = read_text(path)?;
    let mut out = String::with_capacity(text.len());
    for l in parse_lines(path, &text)? {
        if l.parsed.as_ref().is_ok_and(|m| m.step <= last_step) {
            out.push_str(l.text);
            out.push('\n');
        }
    }
    write_atomic(path, out.as_bytes())
}

/// Writes `bytes` to `path` atomically: a temporary sibling file is written and fsynced, then renamed over `path`.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    create_parent(path)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(&tmp, e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// The `q`-quantile of `xs` (`q` in `[0, 1]`, clamped), by linear interpolation between closest ranks, as
/// numpy's default `quantile`/`percentile` method. `xs` need not be sorted.
///
/// `NaN` values are ignored. Returns `0.0` for an empty input (or one that is all `NaN`, or a `NaN` `q`), so
/// metrics of an empty step stay plottable.
pub fn percentile(xs: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() || q.is_nan() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let (a, b) = (v[lo], v[hi.min(v.len() - 1)]);
    if lo == hi {
        a
    } else {
        a + (b - a) * (rank - lo as f64)
    }
}

/// Mean and population standard deviation of `xs` (`(0.0, 0.0)` when empty).
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// FNV-1a (64 bits) over every response in order, each as its length then its tokens (little-endian `u32`s): the
/// same responses give the same digest, and one changed, moved or added token changes it (a collision aside).
pub fn tokens_digest<'a>(responses: impl IntoIterator<Item = &'a [u32]>) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u32| {
        for b in x.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(PRIME);
        }
    };
    for r in responses {
        eat(u32::try_from(r.len()).unwrap_or(u32::MAX));
        r.iter().for_each(|&t| eat(t));
    }
    h
}

/// The current UTC time as RFC 3339 (`2025-01-31T12:34:56Z`), for reports and answers that carry a timestamp.
pub fn utc_timestamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        let t = utc_timestamp();
        assert!(t.len() == 20 && t.ends_with('Z') && &t[10..11] == "T", "{t}");
    }

    #[test]
    fn the_tokens_digest_tells_responses_apart() {
        let d = |r: &[&[u32]]| tokens_digest(r.iter().copied());
        let base = d(&[&[1, 2, 3], &[4]]);
        assert_eq!(base, d(&[&[1, 2, 3], &[4]]));
        assert_ne!(base, d(&[&[1, 2, 3], &[5]]), "a changed token");
        assert_ne!(base, d(&[&[1, 2], &[3, 4]]), "a token moved to the next response");
        assert_ne!(base, d(&[&[4], &[1, 2, 3]]), "responses reordered");
        assert_ne!(d(&[]), d(&[&[]]), "an empty response counts");
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tlt-rl-metrics-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn sample(step: u64) -> StepMetrics {
        StepMetrics {
            step,
            mode: "tlt".into(),
            reward_mean: 0.25 * step as f64,
            reward_std: 0.5,
            accuracy: 0.75,
            response_len_max: 17,
            arms: [("k4d6".to_string(), 12), ("off".to_string(), 3)].into_iter().collect(),
            active_requests: vec![8, 8, 5, 2, 1],
            response_lengths: vec![3, 9, 17],
            accept_lens: vec![1.0, 2.5, 4.0],
            lr: 1e-6,
            ..StepMetrics::default()
        }
    }

    #[test]
    fn metrics_jsonl_round_trip() {
        let d = tmpdir("roundtrip");
        let p = d.join("sub/metrics.jsonl");
        let mut w = MetricsWriter::create(&p).unwrap();
        let written: Vec<_> = (0..4).map(sample).collect();
        for m in &written {
            w.write(m).unwrap();
        }
        drop(w);
        assert_eq!(read_metrics(&p).unwrap(), written);
        // Append resumes after the existing lines.
        let mut w = MetricsWriter::append(&p).unwrap();
        w.write(&sample(4)).unwrap();
        assert_eq!(read_metrics(&p).unwrap().len(), 5);
        // Create truncates.
        MetricsWriter::create(&p).unwrap();
        assert!(read_metrics(&p).unwrap().is_empty());
    }

    #[test]
    fn metrics_nan_reads_back_as_nan_and_old_lines_parse() {
        let d = tmpdir("nan");
        let p = d.join("m.jsonl");
        let mut w = MetricsWriter::create(&p).unwrap();
        let m = StepMetrics { accept_len: f64::NAN, accept_lens: vec![1.0, f64::NAN], ..sample(0) };
        w.write(&m).unwrap();
        drop(w);
        let back = read_metrics(&p).unwrap();
        assert!(back[0].accept_len.is_nan());
        assert_eq!(back[0].accept_lens[0], 1.0);
        assert!(back[0].accept_lens[1].is_nan());
        // A line from an older version, missing most fields.
        std::fs::write(&p, "{\"step\":3,\"reward_mean\":0.5}\n").unwrap();
        let back = read_metrics(&p).unwrap();
        assert_eq!(back[0].step, 3);
        assert_eq!(back[0].reward_mean, 0.5);
        assert!(back[0].arms.is_empty());
    }

    #[test]
    fn metrics_truncated_last_line_is_skipped() {
        let d = tmpdir("torn");
        let p = d.join("m.jsonl");
        let mut w = MetricsWriter::create(&p).unwrap();
        w.write(&sample(0)).unwrap();
        w.write(&sample(1)).unwrap();
        drop(w);
        let full = serde_json::to_string(&sample(2)).unwrap();
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(&full.as_bytes()[..full.len() / 2]).unwrap();
        drop(f);
        let back = read_metrics(&p).unwrap();
        assert_eq!(back.iter().map(|m| m.step).collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn metrics_bad_middle_line_names_its_number() {
        let d = tmpdir("bad");
        let p = d.join("m.jsonl");
        let good = serde_json::to_string(&sample(0)).unwrap();
        std::fs::write(&p, format!("{good}\n\n{{not json\n{good}\n")).unwrap();
        let err = read_metrics(&p).unwrap_err();
        match &err {
            Error::Parse { what, .. } => assert!(what.ends_with("line 3"), "{what}"),
            e => panic!("unexpected error {e}"),
        }
        assert!(truncate_after(&p, 10).is_err());
    }

    #[test]
    fn metrics_truncate_after_keeps_the_right_lines() {
        let d = tmpdir("trunc");
        let p = d.join("m.jsonl");
        let mut w = MetricsWriter::create(&p).unwrap();
        for s in 0..6 {
            w.write(&sample(s)).unwrap();
        }
        drop(w);
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"{\"step\":6,\"mo").unwrap();
        drop(f);
        truncate_after(&p, 2).unwrap();
        let back = read_metrics(&p).unwrap();
        assert_eq!(back, (0..3).map(sample).collect::<Vec<_>>());
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.lines().count(), 3);
        assert!(text.ends_with('\n'));
        // No temp file is left behind.
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        // Missing file: nothing to do.
        truncate_after(d.join("missing.jsonl"), 0).unwrap();
    }

    #[test]
    fn metrics_percentile_matches_numpy() {
        let xs = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&xs, 0.0), 1.0);
        assert_eq!(percentile(&xs, 1.0), 4.0);
        assert_eq!(percentile(&xs, 0.5), 2.5);
        // numpy.quantile([1,2,3,4], 0.9) == 3.7
        assert!((percentile(&xs, 0.9) - 3.7).abs() < 1e-12);
        assert!((percentile(&[10.0, 20.0, 30.0], 0.25) - 15.0).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 0.3), 7.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[f64::NAN, 2.0], 0.5), 2.0);
        assert_eq!(percentile(&xs, 2.0), 4.0);
        assert_eq!(percentile(&xs, f64::NAN), 0.0);
    }

    #[test]
    fn metrics_mean_std_is_population() {
        assert_eq!(mean_std(&[]), (0.0, 0.0));
        let (m, s) = mean_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        assert_eq!(s, 2.0);
        assert_eq!(mean_std(&[3.0]), (3.0, 0.0));
    }
}
