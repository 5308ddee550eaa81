//! `cargo xtask bench spec`: speculative against plain decoding of SmolLM2-135M (f32, greedy) through the same
//! `tlt_spec_decode::Engine`, side by side in one run. Writes `target/bench/spec.json` and `spec.md`.
//!
//! Two workloads, each at every batch size:
//! - `oracle`: chat prompts; an [`OracleDrafter`] proposes the target's own greedy continuation (taken from the
//!   plain run of the same repeat) as a chain of `steps` tokens, each position wrong with probability `rate`,
//!   which sets the mean accept length (tau ~ 2, 4, 6 by default).
//! - `ngram`: prompts that ask to repeat or continue their own context; the model-free [`NgramDrafter`].
//!
//! Stop tokens are off, so every request generates exactly `--new-tokens` tokens in both modes, and every
//! speculative output must equal the plain one token for token (the suite fails otherwise).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tlt_model::Llama;
use tlt_spec_decode::{
    Corruption, Counters, Drafter, Engine, NgramDrafter, OracleDrafter, Plan, RequestId, SpecParams,
};
use tracing::info;

use crate::report::{self, median, Header};
use crate::sysinfo::{self, MachineInfo};

/// Options of `cargo xtask bench spec`.
#[derive(Debug, Clone, clap::Args)]
pub struct SpecArgs {
    /// Batch sizes, comma-separated (at most 16: the number of prompts per workload).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    batches: Vec<usize>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Repeats of every (batch, workload); medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Oracle configurations as `steps:rate` (chain length, per-position corruption probability).
    #[arg(long, value_delimiter = ',', default_value = "2:0.3,4:0.1,4:0.07,6:0.04")]
    oracle: Vec<String>,
    /// N-gram plan as `steps:top_k:verify_tokens`.
    #[arg(long, default_value = "6:2:12")]
    ngram_plan: String,
    /// The GGUF to load (default: the cached SmolLM2-135M-Instruct, fetched if missing).
    #[arg(long)]
    model: Option<PathBuf>,
    /// `cpu` (this suite), or `cuda[:N]`: speculative decoding on the GPU instead (`gpu-bench` on the SmolLM2-135M
    /// and Llama-3-8B shapes: verify-k over decode-1 and the engine on the device with a perfect oracle drafter at
    /// tau = 2, 4, 6, batch 1).
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn chat(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

/// Open-ended chat prompts for the oracle workload.
const CHAT_PROMPTS: [&str; 16] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash map is in two sentences.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short story about a robot who learns to paint.",
    "How do I make a cup of tea?",
    "What are the planets of the solar system?",
    "Summarize the plot of Romeo and Juliet.",
    "What is photosynthesis?",
    "Give me a recipe for pancakes.",
    "Explain recursion to a child.",
    "What should I pack for a weekend hiking trip?",
    "Why do we have seasons?",
];

/// Prompts that repeat their own context, for the n-gram workload.
fn ngram_prompts() -> Vec<String> {
    let lists = [
        ["apple", "banana", "cherry", "date", "elderberry", "fig", "grape"],
        ["red", "orange", "yellow", "green", "blue", "indigo", "violet"],
        ["Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Prague"],
        ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    ];
    let asks = [
        "Repeat this list exactly, one item per line:",
        "Rewrite this list in upper case, one item per line:",
        "Write this list again, numbering each item:",
        "Copy this list twice, separated by commas:",
    ];
    let mut out = Vec::new();
    for ask in asks {
        for items in &lists {
            out.push(chat(&format!("{ask}\n{}", items.join("\n"))));
        }
    }
    out
}

/// One engine run's figures.
#[derive(Debug, Clone)]
struct Run {
    decode_s: f64,
    tokens: Vec<Vec<u32>>,
    counters: Counters,
}

/// Runs `prompts` through one engine to completion (prefill excluded from `decode_s`).
fn run_engine(
    model: &Llama,
    prompts: &[Vec<u32>],
    n: usize,
    drafter: Option<&mut dyn Drafter>,
    plan: &Plan,
) -> Result<Run> {
    let params = SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(n) };
    let mut engine = Engine::new(model, params)?;
    for p in prompts {
        engine.add_request(p)?;
    }
    engine.reset_counters();
    let t = Instant::now();
    engine.run_to_completion(drafter, plan)?;
    let decode_s = t.elapsed().as_secs_f64();
    let mut fin = engine.take_finished();
    fin.sort_by_key(|f| f.id);
    Ok(Run { decode_s, tokens: fin.into_iter().map(|f| f.tokens).collect(), counters: *engine.counters() })
}

/// Median figures of one mode (plain or speculative) over the repeats.
#[derive(Debug, Clone, Serialize)]
pub struct ModeResult {
    /// Generated tokens per second of decode time (prefill excluded).
    pub tokens_per_s: f64,
    /// Every repeat's tokens per second, in run order.
    pub tokens_per_s_runs: Vec<f64>,
    /// Engine rounds per run (one target forward each).
    pub rounds: u64,
    /// Mean tokens committed per sequence-round (tau, the bonus token included; 1 for plain decoding).
    pub mean_accept_len: f64,
    /// Drafted tokens accepted / drafted tokens sent for verification (0 for plain decoding).
    pub draft_accept_rate: f64,
    /// Median target-forward time per round, milliseconds.
    pub forward_ms_per_round: f64,
    /// Fraction of engine step time outside target forwards: drafting, verification, commit (median).
    pub overhead_fraction: f64,
    /// Fraction of step time in the drafter (median).
    pub draft_fraction: f64,
    /// Fraction of step time deciding acceptance (median).
    pub verify_fraction: f64,
    /// Fraction of step time committing: cache commit, log-probs, bookkeeping (median).
    pub commit_fraction: f64,
}

fn summarize(runs: &[Run], generated: usize) -> ModeResult {
    let m = |f: &dyn Fn(&Run) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
    let step = |c: &Counters| c.draft_s + c.forward_s + c.verify_s + c.commit_s;
    let tokens_per_s_runs: Vec<f64> = runs.iter().map(|r| generated as f64 / r.decode_s).collect();
    ModeResult {
        tokens_per_s: median(&tokens_per_s_runs),
        tokens_per_s_runs,
        rounds: runs.first().map_or(0, |r| r.counters.rounds),
        mean_accept_len: m(&|r| r.counters.mean_accept_len()),
        draft_accept_rate: m(&|r| r.counters.accepted as f64 / r.counters.drafted.max(1) as f64),
        forward_ms_per_round: m(&|r| 1e3 * r.counters.forward_s / r.counters.rounds.max(1) as f64),
        overhead_fraction: m(&|r| (step(&r.counters) - r.counters.forward_s) / step(&r.counters)),
        draft_fraction: m(&|r| r.counters.draft_s / step(&r.counters)),
        verify_fraction: m(&|r| r.counters.verify_s / step(&r.counters)),
        commit_fraction: m(&|r| r.counters.commit_s / step(&r.counters)),
    }
}

/// One drafter configuration at one batch size against plain decoding of the same prompts.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// `"oracle"` or `"ngram"`.
    pub workload: &'static str,
    /// The drafter and its settings.
    pub drafter: String,
    /// Requests decoded together.
    pub batch: usize,
    /// The plan of every speculative round.
    pub plan: Plan,
    /// Plain decoding through the same engine.
    pub plain: ModeResult,
    /// Speculative decoding.
    pub sd: ModeResult,
    /// Median over repeats of `sd tokens/s / plain tokens/s` of the same repeat.
    pub speedup: f64,
    /// `sd.forward_ms_per_round / plain.forward_ms_per_round`: what a verification round costs in plain steps.
    pub verify_cost_ratio: f64,
    /// `sd.mean_accept_len / verify_cost_ratio`: the speedup with zero overhead outside the forwards.
    pub forward_bound_speedup: f64,
    /// Every speculative output equalled the plain one (the suite fails otherwise).
    pub lossless: bool,
}

/// The headline checks of the issue.
#[derive(Debug, Clone, Serialize)]
pub struct Targets {
    /// The oracle configuration whose tau is closest to 4, at batch 1.
    pub oracle_tau4_batch1: Option<String>,
    /// Its speedup (target >= 2.5).
    pub oracle_tau4_batch1_speedup: Option<f64>,
    /// Its tau.
    pub oracle_tau4_batch1_tau: Option<f64>,
    /// Largest speculative overhead fraction over all comparisons (target <= 0.10).
    pub max_overhead_fraction: f64,
    /// `oracle_tau4_batch1_speedup >= 2.5`.
    pub speedup_target_met: bool,
    /// `max_overhead_fraction <= 0.10`.
    pub overhead_target_met: bool,
}

/// The workload description.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    /// The GGUF file.
    pub model_path: String,
    /// Weights as the forward reads them.
    pub dtype: &'static str,
    /// Tokens generated per request.
    pub new_tokens: usize,
    /// Prompt token counts of the oracle workload.
    pub oracle_prompt_tokens: Vec<usize>,
    /// Prompt token counts of the n-gram workload.
    pub ngram_prompt_tokens: Vec<usize>,
    /// Token choice.
    pub sampling: &'static str,
}

/// The whole `spec.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Suite, schema version, time, commit, command line and machine.
    #[serde(flatten)]
    pub header: Header,
    /// The workload.
    pub workload: Workload,
    /// Repeats per comparison.
    pub repeats: usize,
    /// One entry per (workload, drafter configuration, batch size).
    pub results: Vec<Comparison>,
    /// The targets.
    pub targets: Targets,
}

fn parse_oracle(s: &str) -> Result<(usize, f64)> {
    let (a, b) = s.split_once(':').with_context(|| format!("--oracle entry {s:?} is not steps:rate"))?;
    let steps: usize = a.trim().parse().with_context(|| format!("--oracle steps in {s:?}"))?;
    let rate: f64 = b.trim().parse().with_context(|| format!("--oracle rate in {s:?}"))?;
    if steps == 0 || !(0.0..=1.0).contains(&rate) {
        bail!("--oracle entry {s:?}: steps must be positive and rate in [0, 1]");
    }
    Ok((steps, rate))
}

fn parse_plan(s: &str) -> Result<Plan> {
    let parts: Vec<usize> = s
        .split(':')
        .map(|p| p.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("--ngram-plan {s:?} is not steps:top_k:verify_tokens"))?;
    let [steps, top_k, verify_tokens] = parts[..] else {
        bail!("--ngram-plan {s:?} is not steps:top_k:verify_tokens");
    };
    let plan = Plan { steps, top_k, verify_tokens };
    plan.validate()?;
    Ok(plan)
}

/// A workload: its name, its prompts, the drafter configurations run on it.
type WorkloadSpec<'a> = (&'static str, &'a [Vec<u32>], Vec<Config>);

/// A drafter configuration of the suite.
enum Config {
    Oracle { steps: usize, rate: f64 },
    Ngram(Plan),
}

impl Config {
    fn name(&self) -> String {
        match self {
            Config::Oracle { steps, rate } => format!("oracle chain steps={steps} rate={rate}"),
            Config::Ngram(p) => format!("ngram min=1 max=3 plan={}:{}:{}", p.steps, p.top_k, p.verify_tokens),
        }
    }

    fn plan(&self) -> Plan {
        match self {
            Config::Oracle { steps, .. } => Plan::chain(*steps),
            Config::Ngram(p) => *p,
        }
    }
}

/// Runs the suite and writes `target/bench/spec.{json,md}`.
pub fn run(args: &SpecArgs) -> Result<()> {
    if crate::bench_gpu::is_cuda(&args.device)? {
        return crate::bench_gpu::run(&args.device, &["smollm2-135m", "llama3-8b"], &["--batches", "1"]);
    }
    if args.batches.is_empty() || args.batches.iter().any(|&b| b == 0 || b > CHAT_PROMPTS.len()) {
        bail!("--batches must list batch sizes in 1..={}", CHAT_PROMPTS.len());
    }
    if args.new_tokens == 0 || args.repeats == 0 {
        bail!("--new-tokens and --repeats must be positive");
    }
    let oracles: Vec<(usize, f64)> = args.oracle.iter().map(|s| parse_oracle(s)).collect::<Result<_>>()?;
    let ngram_plan = parse_plan(&args.ngram_plan)?;
    let timestamp = sysinfo::utc_timestamp();
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::env::smollm2_gguf()?,
    };
    let loaded = tlt_model::load_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let model = loaded.model;
    let tokenizer = loaded.tokenizer.with_context(|| format!("{} carries no tokenizer", path.display()))?;
    let encode = |t: &str| tlt_model::encode(&tokenizer, t);
    let oracle_prompts: Vec<Vec<u32>> = CHAT_PROMPTS.iter().map(|p| encode(&chat(p))).collect::<Result<_, _>>()?;
    let ngram_prompts: Vec<Vec<u32>> = ngram_prompts().iter().map(|p| encode(p)).collect::<Result<_, _>>()?;
    let machine = MachineInfo::collect();
    info!(model = %path.display(), threads = machine.candle_threads, "spec benchmark");

    let workloads: [WorkloadSpec<'_>; 2] = [
        ("oracle", &oracle_prompts, oracles.iter().map(|&(steps, rate)| Config::Oracle { steps, rate }).collect()),
        ("ngram", &ngram_prompts, vec![Config::Ngram(ngram_plan)]),
    ];
    let runs_total: usize =
        args.batches.len() * args.repeats * workloads.iter().map(|(_, _, c)| 1 + c.len()).sum::<usize>();
    let bar = ProgressBar::new(runs_total as u64);
    bar.set_style(ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} runs {msg}")?);
    let n = args.new_tokens;
    let mut results = Vec::new();
    for &b in &args.batches {
        for (workload, prompts, configs) in &workloads {
            let prompts = &prompts[..b];
            let mut plain = Vec::new();
            let mut sd: Vec<Vec<Run>> = vec![Vec::new(); configs.len()];
            let mut lossless = vec![true; configs.len()];
            for r in 0..args.repeats {
                bar.set_message(format!("batch {b}, {workload}, plain, run {}/{}", r + 1, args.repeats));
                let base = run_engine(&model, prompts, n, None, &Plan::chain(1))?;
                bar.inc(1);
                for (k, cfg) in configs.iter().enumerate() {
                    bar.set_message(format!("batch {b}, {workload}, {}, run {}/{}", cfg.name(), r + 1, args.repeats));
                    let run = match cfg {
                        Config::Oracle { rate, .. } => {
                            let vocab = model.config().vocab_size;
                            let mut o = OracleDrafter::new(vocab, Corruption::Rate { rate: *rate, seed: 17 }, false)?;
                            for (i, (p, t)) in prompts.iter().zip(&base.tokens).enumerate() {
                                o.insert(RequestId(i), p.len(), t.clone());
                            }
                            run_engine(&model, prompts, n, Some(&mut o), &cfg.plan())?
                        }
                        Config::Ngram(plan) => {
                            run_engine(&model, prompts, n, Some(&mut NgramDrafter::default()), plan)?
                        }
                    };
                    lossless[k] &= run.tokens == base.tokens;
                    sd[k].push(run);
                    bar.inc(1);
                }
                plain.push(base);
            }
            let generated = b * n;
            let plain_res = summarize(&plain, generated);
            for (k, cfg) in configs.iter().enumerate() {
                if !lossless[k] {
                    bail!("{} at batch {b}: speculative output differs from plain decoding", cfg.name());
                }
                let sd_res = summarize(&sd[k], generated);
                let ratios: Vec<f64> = plain.iter().zip(&sd[k]).map(|(p, s)| p.decode_s / s.decode_s).collect();
                let verify_cost_ratio = sd_res.forward_ms_per_round / plain_res.forward_ms_per_round;
                let cmp = Comparison {
                    workload,
                    drafter: cfg.name(),
                    batch: b,
                    plan: cfg.plan(),
                    speedup: median(&ratios),
                    forward_bound_speedup: sd_res.mean_accept_len / verify_cost_ratio,
                    verify_cost_ratio,
                    plain: plain_res.clone(),
                    sd: sd_res,
                    lossless: true,
                };
                bar.suspend(|| {
                    info!(
                        batch = b,
                        drafter = %cmp.drafter,
                        plain_tok_s = format!("{:.1}", cmp.plain.tokens_per_s),
                        sd_tok_s = format!("{:.1}", cmp.sd.tokens_per_s),
                        tau = format!("{:.2}", cmp.sd.mean_accept_len),
                        speedup = format!("{:.2}", cmp.speedup),
                        overhead = format!("{:.3}", cmp.sd.overhead_fraction),
                        "comparison done"
                    )
                });
                results.push(cmp);
            }
        }
    }
    bar.finish_and_clear();
    let tau4 = results
        .iter()
        .filter(|c| c.workload == "oracle" && c.batch == 1)
        .min_by(|a, b| (a.sd.mean_accept_len - 4.0).abs().total_cmp(&(b.sd.mean_accept_len - 4.0).abs()));
    let max_overhead = results.iter().map(|c| c.sd.overhead_fraction).fold(0.0, f64::max);
    let targets = Targets {
        oracle_tau4_batch1: tau4.map(|c| c.drafter.clone()),
        oracle_tau4_batch1_speedup: tau4.map(|c| c.speedup),
        oracle_tau4_batch1_tau: tau4.map(|c| c.sd.mean_accept_len),
        max_overhead_fraction: max_overhead,
        speedup_target_met: tau4.is_some_and(|c| c.speedup >= 2.5),
        overhead_target_met: max_overhead <= 0.10,
    };
    let report = Report {
        header: Header::new("spec", 1, timestamp, machine),
        workload: Workload {
            model_path: path.display().to_string(),
            dtype: "f32",
            new_tokens: n,
            oracle_prompt_tokens: oracle_prompts.iter().map(Vec::len).collect(),
            ngram_prompt_tokens: ngram_prompts.iter().map(Vec::len).collect(),
            sampling: "greedy, stop tokens off",
        },
        repeats: args.repeats,
        results,
        targets,
    };
    report::write_outputs("spec", &report, &markdown(&report))
}

/// The markdown summary table.
fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# spec: speculative vs plain decoding (SmolLM2-135M, f32, greedy)\n\n\
         {} new tokens per request, {} repeats (medians); {} ({} threads); commit {}; {}\n\n\
         | workload | drafter | batch | plain tok/s | SD tok/s | speedup | tau | accept rate | verify cost (plain steps) \
         | forward-bound speedup | overhead | draft | verify | commit |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        r.workload.new_tokens,
        r.repeats,
        r.header.machine.cpu_model,
        r.header.machine.candle_threads,
        r.header.git_commit,
        r.header.timestamp,
    );
    for c in &r.results {
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
            c.workload,
            c.drafter,
            c.batch,
            c.plain.tokens_per_s,
            c.sd.tokens_per_s,
            c.speedup,
            c.sd.mean_accept_len,
            c.sd.draft_accept_rate,
            c.verify_cost_ratio,
            c.forward_bound_speedup,
            c.sd.overhead_fraction,
            c.sd.draft_fraction,
            c.sd.verify_fraction,
            c.sd.commit_fraction,
        ));
    }
    let t = &r.targets;
    s.push_str(&format!(
        "\nTargets: oracle tau~4 at batch 1 ({}): speedup {} (>= 2.5: {}); max overhead fraction {:.3} (<= 0.10: {})\n",
        t.oracle_tau4_batch1.as_deref().unwrap_or("none"),
        t.oracle_tau4_batch1_speedup.map_or("n/a".into(), |x| format!("{x:.2}")),
        t.speedup_target_met,
        t.max_overhead_fraction,
        t.overhead_target_met,
    ));
    s
}
