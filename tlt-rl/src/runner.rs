//! Running a whole training job: a [`RunConfig`] (task + trainer + evaluation, TOML), metrics as JSONL, atomic
//! checkpoints, `--resume`, plots, and the TLT-vs-baseline comparison behind `cargo xtask demo` and the `e2e`
//! bench.

use std::path::PathBuf;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use crate::metrics::{read_metrics, truncate_after, MetricsWriter, StepMetrics};
use crate::task::{builtin_with, ArithmeticConfig, ChatTemplate, JsonlTask, RewardConfig, Task, WordConfig};
use crate::trainer::{
    Environment, Evaluation, ExportConfig, Mode, Observer, TextEnv, Trainer, TrainerConfig, WarmupReport, STATE_FILE,
};
use crate::{Error, Result};

/// Which task a run trains on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskSpec {
    /// A built-in generator (`"arithmetic"`, `"countdown"`, `"word"`), ignored when `jsonl` is set. Default
    /// arithmetic.
    pub name: String,
    /// Seed of the generator, and of a file dataset's held-out split and shuffling.
    pub seed: u64,
    /// A GSM8K/MATH-style JSONL file (`question`, `answer`) instead of a generator.
    pub jsonl: Option<PathBuf>,
    /// Problems of a file dataset held out for evaluation, never trained on (at least `eval.prompts`; generators
    /// evaluate on their own index range). Default 64.
    pub held_out: u64,
    /// A system message (default: the chat template's own).
    pub system: Option<String>,
    /// The arithmetic generator's settings (its `seed` is replaced by [`Self::seed`]).
    pub arithmetic: ArithmeticConfig,
    /// The word-problem generator's settings (its `seed` is replaced by [`Self::seed`]).
    pub word: WordConfig,
    /// Rewards.
    pub reward: RewardConfig,
}

impl Default for TaskSpec {
    fn default() -> Self {
        Self {
            name: "arithmetic".into(),
            seed: 0,
            jsonl: None,
            held_out: 64,
            system: None,
            arithmetic: ArithmeticConfig::default(),
            word: WordConfig::default(),
            reward: RewardConfig::default(),
        }
    }
}

/// Greedy evaluation before and after training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSpec {
    /// Prompts (0: no evaluation). Default 16.
    pub prompts: usize,
    /// Most new tokens. Default 128.
    pub max_new_tokens: usize,
}

impl Default for EvalSpec {
    fn default() -> Self {
        Self { prompts: 16, max_new_tokens: 128 }
    }
}

/// A training job.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// The task.
    pub task: TaskSpec,
    /// The trainer.
    pub trainer: TrainerConfig,
    /// Evaluation.
    pub eval: EvalSpec,
    /// Checkpoint every this many steps (0: never). Default 0.
    pub checkpoint_every: u64,
    /// Exporting the policy and its drafter for serving (default: at the end of the run only).
    pub export: ExportConfig,
    /// Resume even where the run's data or scoring ([`RunIdentity`]) differ from its checkpoint's (`train
    /// --allow-changed-task`; never read from a config file).
    #[serde(skip)]
    pub allow_changed_task: bool,
}

/// What decides a run's data and scoring: its [`TaskSpec`] (generator or file, seed, held-out split, system
/// message, rewards), the SHA-256 of a file dataset's bytes, and the evaluation prompts. Saved as `run.json` in the
/// run directory when a run starts; a resumed run whose identity differs is refused ([`Session::start`]), since it
/// would reorder the data or move held-out problems into training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunIdentity {
    /// The task.
    pub task: TaskSpec,
    /// SHA-256 (hex) of the JSONL file's bytes, for a file dataset.
    pub jsonl_sha256: Option<String>,
    /// Evaluation prompts.
    pub eval_prompts: usize,
}

impl RunIdentity {
    /// The identity of `cfg` (reads the JSONL file, if any).
    ///
    /// # Errors
    /// An unreadable JSONL file.
    pub fn of(cfg: &RunConfig) -> Result<Self> {
        use sha2::Digest as _;
        let jsonl_sha256 = match &cfg.task.jsonl {
            Some(p) => {
                let bytes = std::fs::read(p).map_err(|e| Error::io(p, e))?;
                Some(sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect())
            }
            None => None,
        };
        Ok(Self { task: cfg.task.clone(), jsonl_sha256, eval_prompts: cfg.eval.prompts })
    }

    /// Every setting of `self` that `other` changes, as `path: old -> new` (empty: the same run).
    #[must_use]
    pub fn differences(&self, other: &Self) -> Vec<String> {
        fn walk(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
            match (a, b) {
                (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
                    let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                    for k in keys {
                        let null = serde_json::Value::Null;
                        let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                        walk(&p, x.get(k).unwrap_or(&null), y.get(k).unwrap_or(&null), out);
                    }
                }
                _ if a != b => out.push(format!("{path}: {a} -> {b}")),
                _ => {}
            }
        }
        let mut out = Vec::new();
        let (a, b) = (serde_json::to_value(self), serde_json::to_value(other));
        if let (Ok(a), Ok(b)) = (a, b) {
            walk("", &a, &b, &mut out);
        }
        out
    }
}

impl RunConfig {
    /// Parses TOML (unknown keys are errors) and validates.
    ///
    /// # Errors
    /// [`Error::Parse`] or the trainer config's validation error.
    pub fn from_toml(text: &str) -> Result<Self> {
        let cfg: Self = toml::from_str(text).map_err(|e| Error::parse("run config (TOML)", e.to_string()))?;
        cfg.trainer.validate()?;
        Ok(cfg)
    }
}

/// The environment of `spec`: its task behind `tokenizer` and the chat template (`template` source from the
/// tokenizer config or GGUF metadata; ChatML without one).
///
/// # Errors
/// An unknown task, an unreadable JSONL file or a bad template.
pub fn text_env(spec: &TaskSpec, tokenizer: Tokenizer, template: Option<&str>) -> Result<TextEnv> {
    let task: Box<dyn Task> = match &spec.jsonl {
        Some(path) => Box::new(JsonlTask::open(path)?.with_reward(spec.reward.clone())?),
        None => builtin_with(&spec.name, spec.seed, &spec.arithmetic, &spec.word, spec.reward.clone())?,
    };
    let token = |id: &str| if tokenizer.token_to_id(id).is_some() { id.to_string() } else { String::new() };
    let template = match template {
        Some(src) => ChatTemplate::from_jinja(src, &token("<|endoftext|>"), &token("<|im_end|>"))?,
        None => ChatTemplate::chatml(),
    };
    TextEnv::new(task, tokenizer, template, spec.system.clone())?.with_split(spec.held_out, spec.seed)
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunOutcome {
    /// TLT or baseline.
    pub mode: String,
    /// Every step's metrics, resumed ones included.
    pub metrics: Vec<StepMetrics>,
    /// Evaluation before the first step of this process (`None` when resumed or disabled).
    pub before: Option<Evaluation>,
    /// Evaluation after the last step.
    pub after: Option<Evaluation>,
    /// Wall seconds of this process's steps.
    pub seconds: f64,
    /// The final export (policy + drafter), when the run wrote one.
    #[serde(default)]
    pub export: Option<PathBuf>,
    /// The drafter warm-up before the first step (`None`: none ran in this process). Its time is not in any
    /// step's: it is TLT's offline stage, done once per model, task and settings and cached.
    #[serde(default)]
    pub warmup: Option<WarmupReport>,
    /// Peak resident memory (GB) of the process that ran it, where the caller measured it.
    #[serde(default)]
    pub peak_rss_gb: Option<f64>,
}

impl RunOutcome {
    /// Sum of a per-step field over the steps.
    pub fn total(&self, f: impl Fn(&StepMetrics) -> f64) -> f64 {
        self.metrics.iter().map(f).sum()
    }

    /// The tail phase's share of rollout time over all steps (each step's [`StepMetrics::tail_share`] weighted by
    /// its rollout seconds).
    pub fn tail_share(&self) -> f64 {
        self.total(|m| m.tail_share * m.rollout_s) / self.total(|m| m.rollout_s).max(1e-9)
    }
}

/// Where a run writes: `metrics.jsonl`, `checkpoint/`, `plots/`, `export/` (and `exports/step-<n>/`).
#[derive(Debug, Clone)]
pub struct RunDir(pub PathBuf);

impl RunDir {
    /// The metrics file.
    pub fn metrics(&self) -> PathBuf {
        self.0.join("metrics.jsonl")
    }
    /// The metrics file rank `rank` of a data-parallel run writes: [`Self::metrics`] for rank 0 (whose lines hold
    /// the whole step's samples and every rank's rollout time), `ranks/rank-<r>.jsonl` for the others (the same
    /// lines with their own rollout traces).
    pub fn metrics_of(&self, rank: usize) -> PathBuf {
        match rank {
            0 => self.metrics(),
            r => self.0.join("ranks").join(format!("rank-{r}.jsonl")),
        }
    }
    /// The run's [`RunIdentity`] (`run.json`).
    pub fn identity(&self) -> PathBuf {
        self.0.join("run.json")
    }
    /// The checkpoint directory.
    pub fn checkpoint(&self) -> PathBuf {
        self.0.join("checkpoint")
    }
    /// The plots directory.
    pub fn plots(&self) -> PathBuf {
        self.0.join("plots")
    }
    /// The final export (policy + drafter).
    pub fn export(&self) -> PathBuf {
        self.0.join("export")
    }
    /// The export written with the checkpoint after step `step` ([`ExportConfig::at_checkpoints`]).
    pub fn step_export(&self, step: u64) -> PathBuf {
        self.0.join("exports").join(format!("step-{step:06}"))
    }
    /// Whether a checkpoint exists.
    pub fn has_checkpoint(&self) -> bool {
        self.checkpoint().join(STATE_FILE).exists()
    }
    /// Brings the checkpoint directory to a complete state after a kill ([`tlt_model::recover_dir`]: an interrupted
    /// write finished or undone) and returns whether a checkpoint exists.
    ///
    /// # Errors
    /// File-system failures.
    pub fn recover_checkpoint(&self) -> Result<bool> {
        tlt_model::recover_dir(&self.checkpoint())?;
        Ok(self.has_checkpoint())
    }
}

/// A run in progress: its metrics file, outcome so far and clock. [`run`] drives one to the end; a comparison
/// interleaves two ([`run_interleaved`]).
pub struct Session {
    cfg: RunConfig,
    dir: RunDir,
    writer: MetricsWriter,
    out: RunOutcome,
    seconds: f64,
}

impl Session {
    /// Opens `dir` for `trainer`: a fresh run warms its drafter up ([`Trainer::warm_up_drafter`]), evaluates, saves
    /// its [`RunIdentity`] and starts `metrics.jsonl`; a resumed one (steps done > 0) is refused when its identity
    /// differs from the saved one (unless [`RunConfig::allow_changed_task`]: then the new one is saved), keeps the
    /// metrics file's lines up to its checkpoint, appends, and evaluates before its first step too. In a data-parallel run every rank opens a session: rank 0 evaluates, exports and writes
    /// `metrics.jsonl`, the others their own lines ([`RunDir::metrics_of`]).
    ///
    /// # Errors
    /// I/O, warm-up or evaluation failures.
    pub fn start<E: Environment>(
        trainer: &mut Trainer<E>,
        cfg: &RunConfig,
        dir: &RunDir,
        obs: &mut dyn Observer,
    ) -> Result<Self> {
        std::fs::create_dir_all(&dir.0).map_err(|e| Error::io(&dir.0, e))?;
        let mode = match trainer.config().mode {
            Mode::Tlt => "tlt",
            Mode::Baseline => "baseline",
        };
        let mut out = RunOutcome { mode: mode.into(), ..RunOutcome::default() };
        let metrics = dir.metrics_of(trainer.rank());
        if let Some(parent) = metrics.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let identity = RunIdentity::of(cfg)?;
        let writer = if trainer.steps_done() > 0 {
            Self::check_identity(&identity, cfg, dir)?;
            truncate_after(&metrics, trainer.steps_done().saturating_sub(1))?;
            out.metrics = read_metrics(&metrics)?;
            if cfg.eval.prompts > 0 && trainer.rank() == 0 {
                obs.on_phase(trainer.steps_done(), "eval");
                out.before = Some(trainer.evaluate(Self::eval_range(cfg), cfg.eval.max_new_tokens)?);
            }
            MetricsWriter::append(&metrics)?
        } else {
            out.warmup = trainer.warm_up_drafter(obs)?;
            if let Some(w) = &out.warmup {
                tracing::info!(
                    cached = w.cached,
                    samples = w.samples,
                    tokens = w.tokens,
                    steps = w.steps,
                    generate_s = format!("{:.1}", w.generate_s),
                    train_s = format!("{:.1}", w.train_s),
                    accuracy = format!("{:.2} -> {:.2}", w.accuracy[0], w.accuracy[1]),
                    "drafter warmed up"
                );
            }
            if cfg.eval.prompts > 0 && trainer.rank() == 0 {
                obs.on_phase(0, "eval");
                out.before = Some(trainer.evaluate(Self::eval_range(cfg), cfg.eval.max_new_tokens)?);
            }
            MetricsWriter::create(&metrics)?
        };
        if trainer.rank() == 0 {
            let (path, tmp) = (dir.identity(), dir.0.join("run.json.tmp"));
            std::fs::write(&tmp, serde_json::to_string_pretty(&identity)?).map_err(|e| Error::io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        }
        Ok(Self { cfg: cfg.clone(), dir: dir.clone(), writer, out, seconds: 0.0 })
    }

    /// A resumed run's identity against the saved one: differences are an error listing them, unless allowed.
    fn check_identity(identity: &RunIdentity, cfg: &RunConfig, dir: &RunDir) -> Result<()> {
        let path = dir.identity();
        let saved = match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str::<RunIdentity>(&text)
                .map_err(|e| Error::parse(path.display().to_string(), e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!(path = %path.display(), "resuming a run without a saved identity: saving this one");
                return Ok(());
            }
            Err(e) => return Err(Error::io(&path, e)),
        };
        let diff = saved.differences(identity);
        if diff.is_empty() {
            return Ok(());
        }
        if cfg.allow_changed_task {
            tracing::warn!(changes = %diff.join("; "), "resuming with changed data or scoring, as allowed");
            return Ok(());
        }
        Err(Error::InvalidConfig {
            field: "task".into(),
            reason: format!(
                "the run in {} was checkpointed with other data or scoring: {} (resume with the saved settings, or \
                 pass --allow-changed-task to resume anyway)",
                dir.0.display(),
                diff.join("; ")
            ),
        })
    }

    fn eval_range(cfg: &RunConfig) -> std::ops::Range<u64> {
        0..cfg.eval.prompts as u64
    }

    /// Whether `trainer` has steps left.
    pub fn pending<E: Environment>(&self, trainer: &Trainer<E>) -> bool {
        trainer.steps_done() < self.cfg.trainer.steps
    }

    /// One step: metrics line, log line, checkpoint when due.
    ///
    /// # Errors
    /// Step or I/O failures (the last checkpoint stays valid).
    pub fn step<E: Environment>(&mut self, trainer: &mut Trainer<E>, obs: &mut dyn Observer) -> Result<()> {
        let t = Instant::now();
        let report = trainer.step(obs)?;
        self.writer.write(&report.metrics)?;
        let m = &report.metrics;
        tracing::info!(
            mode = self.out.mode,
            step = m.step,
            reward = format!("{:.3}", m.reward_mean),
            rollout_s = format!("{:.1}", m.rollout_s),
            train_s = format!("{:.1}", m.train_s),
            sd_on = format!("{:.2}", m.sd_on_fraction),
            "step done"
        );
        self.out.metrics.push(report.metrics);
        let n = trainer.steps_done();
        let every = self.cfg.checkpoint_every;
        if every > 0 && (n.is_multiple_of(every) || n == self.cfg.trainer.steps) {
            obs.on_phase(n, "checkpoint");
            trainer.save_checkpoint(&self.dir.checkpoint())?;
            if self.cfg.export.at_checkpoints && trainer.rank() == 0 {
                obs.on_phase(n, "export");
                trainer.export(&self.dir.step_export(n), &self.cfg.export)?;
            }
        }
        self.seconds += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Exports the policy and its drafter ([`ExportConfig::at_end`]), evaluates after the last step and returns
    /// the outcome.
    ///
    /// # Errors
    /// Export or evaluation failures.
    pub fn finish<E: Environment>(mut self, trainer: &Trainer<E>, obs: &mut dyn Observer) -> Result<RunOutcome> {
        self.out.seconds = self.seconds;
        if trainer.rank() > 0 {
            // Rank 0 exports and evaluates the policy every rank holds.
            return Ok(self.out);
        }
        if self.cfg.export.at_end {
            obs.on_phase(trainer.steps_done(), "export");
            self.out.export = Some(trainer.export(&self.dir.export(), &self.cfg.export)?.dir);
        }
        if self.cfg.eval.prompts > 0 {
            obs.on_phase(trainer.steps_done(), "eval");
            self.out.after = Some(trainer.evaluate(Self::eval_range(&self.cfg), self.cfg.eval.max_new_tokens)?);
        }
        Ok(self.out)
    }
}

/// Runs `trainer` until it has done `cfg.trainer.steps` steps: evaluation first (fresh runs), one metrics line
/// per step (fsync'ed), a checkpoint every `checkpoint_every` steps and at the end (with an export when
/// [`ExportConfig::at_checkpoints`]), then the final export and evaluation.
/// A resumed trainer continues the metrics file from its checkpoint's step.
///
/// # Errors
/// Any step, I/O or evaluation failure (the last checkpoint stays valid).
pub fn run<E: Environment>(
    trainer: &mut Trainer<E>,
    cfg: &RunConfig,
    dir: &RunDir,
    obs: &mut dyn Observer,
) -> Result<RunOutcome> {
    let mut session = Session::start(trainer, cfg, dir, obs)?;
    while session.pending(trainer) {
        session.step(trainer, obs)?;
    }
    session.finish(trainer, obs)
}

/// Runs two trainers step by step, alternating which goes first (`a` on even steps): both see the same machine
/// state on average, so a first-run warm-up (allocator growth, page faults: the first update of a process took
/// 27-89% longer than the same update later, measured on the 2-vCPU VM) or drift of the machine over time does
/// not bias one side. Returns both outcomes.
///
/// # Errors
/// As [`run`].
pub fn run_interleaved<A: Environment, B: Environment>(
    a: (&mut Trainer<A>, &RunDir, &mut dyn Observer),
    b: (&mut Trainer<B>, &RunDir, &mut dyn Observer),
    cfg: &RunConfig,
) -> Result<(RunOutcome, RunOutcome)> {
    let (ta, da, oa) = a;
    let (tb, db, ob) = b;
    let mut sa = Session::start(ta, cfg, da, oa)?;
    let mut sb = Session::start(tb, cfg, db, ob)?;
    let mut k = 0u64;
    while sa.pending(ta) || sb.pending(tb) {
        if k.is_multiple_of(2) {
            if sa.pending(ta) {
                sa.step(ta, oa)?;
            }
            if sb.pending(tb) {
                sb.step(tb, ob)?;
            }
        } else {
            if sb.pending(tb) {
                sb.step(tb, ob)?;
            }
            if sa.pending(ta) {
                sa.step(ta, oa)?;
            }
        }
        k += 1;
    }
    Ok((sa.finish(ta, oa)?, sb.finish(tb, ob)?))
}

/// TLT against the baseline: the same config and seeds (run one after the other in fresh processes by the `train`
/// example, or interleaved with [`run_interleaved`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    /// The TLT run.
    pub tlt: RunOutcome,
    /// The baseline run.
    pub baseline: RunOutcome,
    /// Baseline rollout seconds / TLT rollout seconds, over all steps.
    pub rollout_speedup: f64,
    /// Baseline step seconds / TLT step seconds, over all steps.
    pub e2e_speedup: f64,
    /// Per step: baseline rollout seconds / TLT rollout seconds.
    pub rollout_speedup_per_step: Vec<f64>,
    /// The baseline's rollout share of its step time, `R`.
    #[serde(default)]
    pub rollout_share: f64,
    /// The end-to-end speed-up Amdahl's law allows from the measured split: `1 / ((1 - R) + R / S)` with `S` the
    /// rollout speed-up (the end-to-end figure if nothing but the rollout changed between the runs).
    #[serde(default)]
    pub amdahl_bound: f64,
}

impl Comparison {
    /// Builds the ratios.
    pub fn new(tlt: RunOutcome, baseline: RunOutcome) -> Self {
        let ratio = |f: &dyn Fn(&StepMetrics) -> f64| baseline.total(f) / tlt.total(f).max(1e-9);
        let rollout_speedup = ratio(&|m| m.rollout_s);
        let e2e_speedup = ratio(&|m| m.step_s);
        let rollout_speedup_per_step =
            tlt.metrics.iter().zip(&baseline.metrics).map(|(t, b)| b.rollout_s / t.rollout_s.max(1e-9)).collect();
        let rollout_share = baseline.total(|m| m.rollout_s) / baseline.total(|m| m.step_s).max(1e-9);
        let amdahl_bound = amdahl(rollout_share, rollout_speedup);
        Self { tlt, baseline, rollout_speedup, e2e_speedup, rollout_speedup_per_step, rollout_share, amdahl_bound }
    }

    /// A short human-readable report.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, name: &str, o: &RunOutcome| {
            let eval = |e: &Option<Evaluation>| {
                e.as_ref().map_or("-".to_string(), |e| format!("{:.3} (acc {:.2})", e.reward_mean, e.accuracy))
            };
            let (r, t, d) = (o.total(|m| m.rollout_s), o.total(|m| m.train_s), o.total(|m| m.drafter_s));
            let da = o.total(|m| m.drafter_after_s);
            let all = o.total(|m| m.step_s).max(1e-9);
            s.push_str(&format!(
                "{name:<9} reward {} -> {} | step time {all:.1} s: rollout {:.0}%, update {:.0}%, drafter after the \
                 rollout {:.0}%, other {:.0}% | drafter trained {d:.1} s{}\n",
                eval(&o.before),
                eval(&o.after),
                100.0 * r / all,
                100.0 * t / all,
                100.0 * da / all,
                100.0 * (all - r - t - da) / all,
                o.peak_rss_gb.map_or(String::new(), |gb| format!(" | peak RSS {gb:.2} GB")),
            ));
        };
        line(&mut s, "TLT", &self.tlt);
        line(&mut s, "baseline", &self.baseline);
        if let Some(w) = &self.tlt.warmup {
            if w.cached {
                s.push_str(&format!(
                    "drafter warm-up: loaded from the cache ({:.1} s; key {:.12})\n",
                    w.other_s, w.key
                ));
            } else {
                s.push_str(&format!(
                    "drafter warm-up (before RL, not in the step times; cached for the next run): {} answers, {} tokens \
                     generated in {:.1} s, {} drafter steps in {:.1} s, top-1 accuracy {:.2} -> {:.2}\n",
                    w.samples, w.tokens, w.generate_s, w.steps, w.train_s, w.accuracy[0], w.accuracy[1]
                ));
            }
        }
        if let (Some(b), Some(a)) = (&self.tlt.before, &self.tlt.after) {
            let (d, se) = accuracy_change(b, a);
            s.push_str(&format!(
                "held-out accuracy (greedy, the same {} prompts before and after), TLT run: {:.3} -> {:.3}, change \
                 {d:+.3} (paired standard error {se:.3}: {})\n",
                a.prompts,
                b.accuracy,
                a.accuracy,
                if d > se { "larger than its standard error" } else { "NOT larger than its standard error" },
            ));
        }
        s.push_str(&format!(
            "tail phase (rounds with at most the gate's threshold of requests running): {:.0}% of the baseline's \
             rollout time, {:.0}% of TLT's\n",
            100.0 * self.baseline.tail_share(),
            100.0 * self.tlt.tail_share(),
        ));
        let mut ceil = crate::trainer::SdCeiling::default();
        for m in &self.tlt.metrics {
            ceil.merge(&m.sd_ceiling);
        }
        if ceil.rounds > 0 {
            let c = |i| ceil.ceiling(i);
            s.push_str(&format!(
                "drafters: {:.2} tokens per verify step over {} speculative request-rounds; the argmax-chain \
                 ceiling of the same rounds is {:.2} at depth 4 ({:.0}% of it reached; {:.2} at depth 2, {:.2} at \
                 depth 6)\n",
                ceil.tokens_per_step(),
                ceil.rounds,
                c(1),
                100.0 * ceil.tokens_per_step() / c(1).max(1e-9),
                c(0),
                c(2),
            ));
        }
        let sd = self.tlt.metrics.iter().map(|m| m.sd_on_fraction).sum::<f64>() / self.tlt.metrics.len().max(1) as f64;
        let lens: Vec<f64> = self.tlt.metrics.iter().flat_map(|m| m.accept_lens.iter().copied()).collect();
        let acc = lens.iter().sum::<f64>() / lens.len().max(1) as f64;
        s.push_str(&format!(
            "TLT over baseline: rollout {:.2}x, end to end {:.2}x (SD on {:.0}% of rounds, mean accept length {acc:.2} over speculative rounds)\n",
            self.rollout_speedup,
            self.e2e_speedup,
            100.0 * sd,
        ));
        s.push_str(&format!(
            "Amdahl: the rollout is R = {:.0}% of the baseline's step, so a rollout speed-up of S = {:.2}x allows \
             1 / ((1 - R) + R / S) = {:.2}x end to end if nothing else changed; measured {:.2}x (the difference is \
             the update and the other phases running at different speeds in the two runs)\n",
            100.0 * self.rollout_share,
            self.rollout_speedup,
            self.amdahl_bound,
            self.e2e_speedup,
        ));
        // The chain of bounds behind those figures: SD runs only in the gate's tail phase, so even a free tail
        // caps the rollout speed-up, and the rollout's share caps the step's.
        let tail = self.baseline.tail_share();
        let free_tail = 1.0 / (1.0 - tail).max(1e-9);
        s.push_str(&format!(
            "Bounds: speculation runs only while at most the gate's threshold of requests run, {:.0}% of the \
             baseline's rollout, so even a free tail phase allows a rollout speed-up of at most 1 / (1 - {:.2}) = \
             {:.2}x, and so at most {:.2}x end to end; an infinitely fast rollout would allow 1 / (1 - R) = {:.2}x\n",
            100.0 * tail,
            tail,
            free_tail,
            amdahl(self.rollout_share, free_tail),
            1.0 / (1.0 - self.rollout_share).max(1e-9),
        ));
        s
    }
}

/// The change of held-out accuracy from `before` to `after` and its standard error. Both evaluations answer
/// the same prompts greedily, so the change is the mean of the per-prompt differences `d_i = after_i - before_i`
/// (each -1, 0 or 1) and its standard error is the paired one, `sd(d) / sqrt(n)` with the sample standard
/// deviation (McNemar's setting: only prompts whose verdict flipped contribute). Without per-prompt verdicts of
/// equal length (older summaries) it falls back to two independent binomial proportions,
/// `sqrt(p1 (1 - p1) / n1 + p2 (1 - p2) / n2)`.
pub fn accuracy_change(before: &Evaluation, after: &Evaluation) -> (f64, f64) {
    let n = before.correct.len();
    if n >= 2 && after.correct.len() == n {
        let d: Vec<f64> = before
            .correct
            .iter()
            .zip(&after.correct)
            .map(|(&b, &a)| f64::from(u8::from(a)) - f64::from(u8::from(b)))
            .collect();
        let mean = d.iter().sum::<f64>() / n as f64;
        let var = d.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1) as f64;
        return (mean, (var / n as f64).sqrt());
    }
    let var = |e: &Evaluation| e.accuracy * (1.0 - e.accuracy) / e.prompts.max(1) as f64;
    (after.accuracy - before.accuracy, (var(before) + var(after)).sqrt())
}

/// Amdahl's law: the whole's speed-up when a share `r` of the time is sped up `s` times.
pub fn amdahl(r: f64, s: f64) -> f64 {
    1.0 / ((1.0 - r) + r / s.max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amdahl_bound_hand_computed() {
        assert!((amdahl(0.85, 2.0) - 1.0 / 0.575).abs() < 1e-12);
        assert!((amdahl(0.21, 0.84) - 1.0 / (0.79 + 0.25)).abs() < 1e-12);
        assert_eq!(amdahl(0.0, 5.0), 1.0);
        assert_eq!(amdahl(1.0, 3.0), 3.0);
        // Baseline: 6 s of rollout in a 10 s step; TLT: 3 s of rollout in a 9 s step (its update ran slower).
        let out = |rollout_s: f64, step_s: f64| RunOutcome {
            metrics: vec![StepMetrics { rollout_s, step_s, ..StepMetrics::default() }],
            ..RunOutcome::default()
        };
        let c = Comparison::new(out(3.0, 9.0), out(6.0, 10.0));
        assert!((c.rollout_share - 0.6).abs() < 1e-12 && (c.rollout_speedup - 2.0).abs() < 1e-12);
        assert!((c.amdahl_bound - 1.0 / 0.7).abs() < 1e-12, "{}", c.amdahl_bound);
        assert!((c.e2e_speedup - 10.0 / 9.0).abs() < 1e-12);
        assert!(c.report().contains("allows 1 / ((1 - R) + R / S) = 1.43x"), "{}", c.report());
    }

    #[test]
    fn accuracy_change_and_tail_share_hand_computed() {
        let e = |accuracy| Evaluation { prompts: 64, accuracy, ..Evaluation::default() };
        let (d, se) = accuracy_change(&e(0.25), &e(0.5));
        assert!((d - 0.25).abs() < 1e-12);
        // sqrt(0.25 * 0.75 / 64 + 0.5 * 0.5 / 64) = sqrt(0.4375 / 64)
        assert!((se - (0.4375f64 / 64.0).sqrt()).abs() < 1e-12, "{se}");
        // Steps of 10 s (tail 20%) and 30 s (tail 60%) of rollout: (2 + 18) / 40.
        let m = |rollout_s, tail_share| StepMetrics { rollout_s, tail_share, ..StepMetrics::default() };
        let o = RunOutcome { metrics: vec![m(10.0, 0.2), m(30.0, 0.6)], ..RunOutcome::default() };
        assert!((o.tail_share() - 0.5).abs() < 1e-12);
        let with_eval = RunOutcome { before: Some(e(0.25)), after: Some(e(0.5)), ..o.clone() };
        // Paired: 8 prompts, 3 turned right, 1 turned wrong: d = (3 - 1) / 8, sample variance of
        // {1, 1, 1, -1, 0, 0, 0, 0} around 0.25 = (3 * 0.5625 + 1.5625 + 4 * 0.0625) / 7.
        let verdicts = |v: [u8; 8]| Evaluation {
            prompts: 8,
            accuracy: f64::from(v.iter().sum::<u8>()) / 8.0,
            correct: v.iter().map(|&x| x == 1).collect(),
            ..Evaluation::default()
        };
        let (d, se) = accuracy_change(&verdicts([0, 0, 0, 1, 1, 0, 1, 0]), &verdicts([1, 1, 1, 0, 1, 0, 1, 0]));
        assert!((d - 0.25).abs() < 1e-12);
        let var = (3.0 * 0.5625 + 1.5625 + 4.0 * 0.0625) / 7.0;
        assert!((se - (var / 8.0f64).sqrt()).abs() < 1e-12, "{se}");
        let report = Comparison::new(with_eval, o).report();
        assert!(report.contains("0.250 -> 0.500, change +0.250 (paired standard error 0.083: larger"), "{report}");
        assert!(report.contains("50% of the baseline's rollout time"), "{report}");
        assert!(report.contains("a rollout speed-up of at most 1 / (1 - 0.50) = 2.00x"), "{report}");
    }
}
