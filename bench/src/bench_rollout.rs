//! `cargo xtask bench rollout`: the long-tailed rollout, two ways. Writes `target/bench/rollout.json` and `.md`.
//!
//! 1. The cluster simulator (`tlt_scheduler::sim`) calibrated from this project's measured costs (the `spec`
//!    bench JSON: plain decode time per step at batch 1/4/16, verify forward time per round against rows
//!    verified up to 32; accept length from the `drafter` bench's best trained drafter when its JSON exists, else
//!    the `spec` bench's batch-1 oracle/n-gram runs) with the CPU gate and arms of the real run, for 8 and 64 workers on lognormal lengths (median 1k, max 32k):
//!    makespan ratios baseline/adaptive and idle fractions.
//! 2. A real CPU run: the SD gate and the BEG-MAB bandit drive `tlt_spec_decode::Engine` on SmolLM2 for a group
//!    of 32 requests with long-tailed lengths, against plain decoding of the same requests in the same run;
//!    the model-free n-gram drafter proposes (no trained drafter needed), outputs must match token for token.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use tlt_kernels::SplitMix64;
use tlt_scheduler::sim::{simulate, AcceptModel, AcceptPoint, CostModel, LengthDist, Linear, SimConfig, SimReport};
use tlt_scheduler::{AdaptiveDecoder, GateConfig, MabConfig, RolloutConfig};
use tlt_spec_decode::{Engine, NgramDrafter, Plan, SpecParams};
use tracing::info;

use crate::drafter_data::prompts;
use crate::report::{self, Header};
use crate::sysinfo::{self, MachineInfo};

/// Options of `cargo xtask bench rollout`.
#[derive(Debug, Clone, clap::Args)]
pub struct RolloutArgs {
    /// Simulated cluster sizes (workers), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,64")]
    workers: Vec<usize>,
    /// Requests per worker per RL step in the simulation.
    #[arg(long, default_value_t = 64)]
    requests_per_worker: usize,
    /// The `spec` bench JSON to calibrate from (default: `target/bench/spec.json`, else the recorded
    /// `docs/bench/2026-11-22-spec.json`).
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// Requests of the real run (one group).
    #[arg(long, default_value_t = 32)]
    real_requests: usize,
    /// Median response length of the real run, tokens.
    #[arg(long, default_value_t = 24.0)]
    real_median: f64,
    /// Longest response of the real run, tokens.
    #[arg(long, default_value_t = 256)]
    real_max: usize,
    /// Skip the real SmolLM2 run.
    #[arg(long)]
    skip_real: bool,
    /// `cpu` (the default): this suite measures the CPU path; a CUDA device is refused with what to run instead.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

/// Least-squares line `y = a + b x`.
pub(crate) fn fit(points: &[(f64, f64)]) -> Linear {
    let n = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
    Linear { fixed_s: (my - slope * mx).max(1e-6), per_token_s: slope }
}

/// What the calibration read.
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    /// The JSON read.
    pub source: String,
    /// `(batch, seconds per plain decode step)` points.
    pub decode_points: Vec<(f64, f64)>,
    /// `(rows verified, seconds per verify forward)` points.
    pub verify_points: Vec<(f64, f64)>,
    /// The fitted plain decode cost.
    pub decode: Linear,
    /// The fitted verify cost.
    pub verify: Linear,
    /// Fresh accept lengths by tree size.
    pub accept: Vec<AcceptPoint>,
    /// Measured cost of one draft forward (from `drafter.json`; `null`: the simulator's default).
    pub draft: Option<Linear>,
    /// Where they come from: a trained drafter's `drafter.json` when there is one, else the `spec` bench's
    /// oracle and n-gram runs at batch 1 (lowest tau per tree size).
    pub accept_source: String,
}

fn calibrate(path: &Path, drafter: Option<&Path>) -> Result<Calibration> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let results = v["results"].as_array().with_context(|| format!("{}: no results", path.display()))?;
    let (mut decode, mut verify, mut accept) = (BTreeMap::new(), Vec::new(), BTreeMap::new());
    for r in results {
        let batch = r["batch"].as_f64().unwrap_or(0.0);
        let plain_ms = r["plain"]["forward_ms_per_round"].as_f64().unwrap_or(f64::NAN);
        let sd_ms = r["sd"]["forward_ms_per_round"].as_f64().unwrap_or(f64::NAN);
        let vt = r["plan"]["verify_tokens"].as_f64().unwrap_or(0.0);
        let steps = r["plan"]["steps"].as_f64().unwrap_or(0.0);
        // A chain verifies steps + 1 rows per sequence; a tree at most verify_tokens.
        let rows = if r["plan"]["top_k"].as_u64() == Some(1) { steps + 1.0 } else { vt };
        if batch > 0.0 && plain_ms.is_finite() {
            decode.insert(batch as u64, plain_ms / 1e3);
        }
        // Speculation only runs on small batches (the gate); fit the verify cost where it is used, below the
        // 64-row switch to candle's GEMM that makes larger verifies a different regime.
        if batch > 0.0 && sd_ms.is_finite() && batch * rows <= 32.0 {
            verify.push((batch * rows, sd_ms / 1e3));
        }
        let tau = r["sd"]["mean_accept_len"].as_f64().unwrap_or(f64::NAN);
        if batch == 1.0 && tau.is_finite() {
            // Keep the lowest tau per tree size: the least optimistic drafter measured at that size.
            let e = accept.entry(rows as usize).or_insert(tau);
            *e = f64::min(*e, tau);
        }
    }
    if decode.is_empty() || verify.is_empty() || accept.is_empty() {
        bail!("{}: needs plain and speculative results (run `cargo xtask bench spec`)", path.display());
    }
    // A trained drafter's measured accept length beats the oracle's set ones: use it when there is one, with its
    // measured drafting time per draft forward (draft share x round time / steps; a round takes tau / (SD tok/s)
    // at batch 1).
    let mut accept_source = format!("{} (oracle and n-gram drafters, batch 1)", path.display());
    let mut draft: Option<Linear> = None;
    if let Some(d) = drafter {
        let text = std::fs::read_to_string(d).with_context(|| format!("reading {}", d.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", d.display()))?;
        let tau_of = |x: &Value| x["tau"].as_f64().unwrap_or(0.0);
        let best = v["drafters"].as_array().into_iter().flatten().max_by(|a, b| tau_of(a).total_cmp(&tau_of(b)));
        // Each drafter's headline plan (older files: one top-level plan).
        let plan_of = |b: &Value| if b["plan"].is_object() { b["plan"].clone() } else { v["plan"].clone() };
        let (vt, steps) = best.map_or((0, 0.0), |b| {
            let p = plan_of(b);
            (p["verify_tokens"].as_u64().unwrap_or(0) as usize, p["steps"].as_f64().unwrap_or(0.0))
        });
        if let Some(b) = best.filter(|b| vt > 0 && steps > 0.0 && tau_of(b) >= 1.0) {
            let tau = tau_of(b);
            accept = BTreeMap::from([(vt, tau)]);
            accept_source = format!("{} ({} drafter, batch 1)", d.display(), b["kind"].as_str().unwrap_or("?"));
            let (share, tps) = (b["draft_fraction"].as_f64(), b["sd_tokens_per_s"].as_f64());
            if let (Some(share), Some(tps)) = (share, tps.filter(|&t| t > 0.0)) {
                draft = Some(Linear { fixed_s: share * tau / tps / steps, per_token_s: 0.0 });
            }
        }
    }
    let decode_points: Vec<(f64, f64)> = decode.iter().map(|(&b, &s)| (b as f64, s)).collect();
    Ok(Calibration {
        source: path.display().to_string(),
        decode: fit(&decode_points),
        verify: fit(&verify),
        decode_points,
        verify_points: verify,
        accept: accept
            .into_iter()
            .map(|(verify_tokens, accept_len)| AcceptPoint { verify_tokens, accept_len })
            .collect(),
        accept_source,
        draft,
    })
}

/// CPU arms: chains and a small tree, sized for where SD pays on this machine (batch <= 4).
pub(crate) fn cpu_mab() -> MabConfig {
    MabConfig {
        arms: vec![Plan { steps: 6, top_k: 2, verify_tokens: 12 }, Plan::chain(4), Plan::chain(2)],
        thresholds: vec![1, 2, 3],
        epsilon: 0.1,
        window: 50,
        seed: 0,
        plain_arm: false,
        ..MabConfig::default()
    }
}

/// The gate on this CPU: the `spec` bench shows SD losing from batch 16 on and winning at batch <= 4.
pub(crate) fn cpu_gate() -> GateConfig {
    GateConfig { threshold: 4, on_after: 2, off_threshold: 6, off_after: 1 }
}

/// The real run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct RealRun {
    /// Requests and their response lengths (tokens).
    pub lengths: Vec<usize>,
    /// Plain decoding wall seconds (prefill excluded).
    pub plain_s: f64,
    /// Adaptive SD wall seconds (prefill excluded), scheduler decisions included.
    pub adaptive_s: f64,
    /// `plain_s / adaptive_s`.
    pub speedup: f64,
    /// Steps of the adaptive run, and how many speculated.
    pub steps: u64,
    /// Speculative steps.
    pub sd_steps: u64,
    /// Seconds of the adaptive run spent in speculative steps.
    pub sd_seconds: f64,
    /// Running requests before each adaptive round.
    pub active: Vec<usize>,
    /// Arms chosen: `"steps:top_k:verify_tokens"` -> count.
    pub arms: BTreeMap<String, u64>,
    /// Mean tokens committed per request per round over the whole adaptive run (plain rounds count 1).
    pub accept_len: f64,
    /// Adaptive output = plain output for every request.
    pub lossless: bool,
}

fn real_run(args: &RolloutArgs) -> Result<RealRun> {
    let path = crate::env::smollm2_gguf()?;
    let loaded = tlt_model::load_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let (model, tok) = (loaded.model, loaded.tokenizer.context("the GGUF carries no tokenizer")?);
    let (train, _) = prompts();
    let texts: Vec<&String> = train.iter().step_by(7).take(args.real_requests).collect();
    let enc: Vec<Vec<u32>> = texts.iter().map(|t| tlt_model::encode(&tok, t)).collect::<Result<_, _>>()?;
    let mut rng = SplitMix64::new(7);
    let lengths: Vec<usize> = (0..enc.len())
        .map(|_| {
            // Lognormal, sigma 1: Box-Muller on two uniforms.
            let (u1, u2) = (rng.next_f64().max(1e-12), rng.next_f64());
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            ((args.real_median * z.exp()).round() as usize).clamp(1, args.real_max)
        })
        .collect();
    let params = SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(args.real_max) };
    let new_engine = || -> Result<Engine<&tlt_model::Llama>> {
        let mut e = Engine::new(&model, params.clone())?;
        for (p, &n) in enc.iter().zip(&lengths) {
            e.add_request_with_limit(p, n)?;
        }
        Ok(e)
    };
    let outputs = |e: &mut Engine<&tlt_model::Llama>| {
        let mut f = e.take_finished();
        f.sort_by_key(|f| f.id);
        f.into_iter().map(|f| f.tokens).collect::<Vec<_>>()
    };

    let mut plain = new_engine()?;
    let t = Instant::now();
    plain.run_to_completion(None, &Plan::chain(1))?;
    let plain_s = t.elapsed().as_secs_f64();
    let plain_out = outputs(&mut plain);
    info!(seconds = format!("{plain_s:.1}"), "real run: plain decoding done");

    let mut engine = new_engine()?;
    let mut decoder = AdaptiveDecoder::new(cpu_gate(), cpu_mab())?;
    let mut ngram = NgramDrafter::default();
    let t = Instant::now();
    decoder.run(&mut engine, Some(&mut ngram))?;
    let adaptive_s = t.elapsed().as_secs_f64();
    let c = *engine.counters();
    let trace = decoder.take_trace();
    let adaptive_out = outputs(&mut engine);
    let lossless = adaptive_out == plain_out;
    if !lossless {
        bail!("adaptive SD output differs from plain decoding");
    }
    Ok(RealRun {
        lengths,
        plain_s,
        adaptive_s,
        speedup: plain_s / adaptive_s,
        steps: trace.steps,
        sd_steps: trace.sd_steps,
        sd_seconds: trace.sd_seconds,
        active: trace.active,
        accept_len: c.mean_accept_len(),
        arms: trace.arms,
        lossless,
    })
}

/// The whole `rollout.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Suite, schema version, time, commit, command line and machine.
    #[serde(flatten)]
    pub header: Header,
    /// What the simulator was calibrated with.
    pub calibration: Calibration,
    /// One simulation per cluster size.
    pub simulations: Vec<SimReport>,
    /// The real CPU run (`null` with `--skip-real`).
    pub real: Option<RealRun>,
}

/// Runs the suite and writes `target/bench/rollout.{json,md}`.
pub fn run(args: &RolloutArgs) -> Result<()> {
    let timestamp = sysinfo::utc_timestamp();
    let machine = MachineInfo::collect();
    let source = match &args.calibration {
        Some(p) => p.clone(),
        None => {
            let t = crate::env::workspace_root().join("target/bench/spec.json");
            if t.exists() {
                t
            } else {
                crate::env::workspace_root().join("docs/bench/2026-11-22-spec.json")
            }
        }
    };
    let drafter_json = crate::env::workspace_root().join("target/bench/drafter.json");
    let calibration = calibrate(&source, drafter_json.exists().then_some(drafter_json.as_path()))?;
    info!(source = %calibration.source, decode = ?calibration.decode, verify = ?calibration.verify, "calibrated");
    let mut simulations = Vec::new();
    for &w in &args.workers {
        let cfg = SimConfig {
            workers: w,
            requests_per_worker: args.requests_per_worker,
            lengths: LengthDist::LogNormal { median: 1000.0, sigma: 1.0, max: 32_000 },
            cost: CostModel { decode: calibration.decode, verify: calibration.verify, ..CostModel::default() },
            accept: AcceptModel { fresh: calibration.accept.clone(), ..AcceptModel::default() },
            rollout: RolloutConfig { gate: cpu_gate(), mab: cpu_mab(), ..RolloutConfig::default() },
            ..SimConfig::default()
        };
        let rep = simulate(&cfg)?;
        info!(workers = w, ratio = format!("{:.3}", rep.makespan_ratio_baseline_over_adaptive), "simulated");
        simulations.push(rep);
    }
    let real = if args.skip_real { None } else { Some(real_run(args)?) };
    let report = Report { header: Header::new("rollout", 1, timestamp, machine), calibration, simulations, real };
    report::write_outputs("rollout", &report, &markdown(&report))
}

fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# rollout: long-tailed rollouts, simulated (calibrated from {}) and real (SmolLM2, CPU)\n\n{} ({} threads); commit {}; {}\n\n\
         | workers | baseline/adaptive | baseline/adaptive+online | idle fraction baseline | adaptive | adaptive+online |\n|---:|---:|---:|---:|---:|---:|\n",
        r.calibration.source, r.header.machine.cpu_model, r.header.machine.candle_threads, r.header.git_commit, r.header.timestamp
    );
    for sim in &r.simulations {
        let idle: Vec<String> = sim.modes.iter().map(|m| format!("{:.3}", m.mean_idle_fraction)).collect();
        s.push_str(&format!(
            "| {} | {:.3} | {:.3} | {} |\n",
            sim.workers,
            sim.makespan_ratio_baseline_over_adaptive,
            sim.makespan_ratio_baseline_over_online,
            idle.join(" | ")
        ));
    }
    if let Some(real) = &r.real {
        s.push_str(&format!(
            "\nReal run: {} requests (lengths median {:.0}, max {}), plain {:.1} s, adaptive SD {:.1} s: speedup {:.2}; \
             {} of {} steps speculative ({:.1} s), tokens per request-round {:.2}, arms {:?}; lossless {}\n",
            real.lengths.len(),
            { let mut l = real.lengths.clone(); l.sort_unstable(); l[l.len() / 2] as f64 },
            real.lengths.iter().max().unwrap_or(&0),
            real.plain_s,
            real.adaptive_s,
            real.speedup,
            real.sd_steps,
            real.steps,
            real.sd_seconds,
            real.accept_len,
            real.arms,
            real.lossless
        ));
    }
    s
}
