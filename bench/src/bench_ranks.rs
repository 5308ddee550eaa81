//! `cargo xtask bench ranks`: the cluster simulator (`tlt_scheduler::sim`) calibrated on measured data-parallel
//! trainer runs, then used to predict GPU clusters. Writes `target/bench/ranks.json` and `.md`.
//!
//! 1. **Measured.** Reads the trainer's per-step metrics (JSONL, one line per RL step) of runs with 1 and 2 ranks
//!    (`rep*-ranks*.jsonl`) and, when present, runs with work stealing off and on (`steal-*.jsonl`: `off` or `on`
//!    in the file name).
//! 2. **Calibrated.** A least-squares line `round seconds = fixed + per_request x running requests` over every
//!    engine round of the 1-rank runs (2 tensor threads), and a second one over the 2-rank runs' logging rank (1
//!    thread per rank, the other rank busy beside it); R^2 and RMSE say how good each is. The CPU rollout mixes
//!    plain and speculative rounds (the gate turns SD on at batch <= 4), so each round costs the fitted line at its
//!    batch and, once the simulator's gate is on, commits the measured tokens per request-round of the
//!    small-batch rounds (a chain arm whose verify costs what the line says). Time outside the rounds (prompt
//!    prefill, setup) is the measured mean of `rollout_s - sum(round_seconds)`, added to every worker.
//! 3. **Simulated, same workload.** The measured response lengths replayed per step with the trainer's group to
//!    rank assignment (contiguous shards), noise 0: per step the rollout makespan and each rank's rollout and idle
//!    seconds beside the measured ones, and their ratio.
//! 4. **Predicted** (labelled PREDICTION, nothing measured): 8, 64 and 512 GPUs decoding a Qwen2.5-7B (shapes from
//!    the TLT recipe) with lognormal lengths (median 1,000, sigma 1, the recipe's 32,768-token cap), step costs
//!    from the H100 kernel roofline of `cargo xtask roofline` (lines fitted over its predicted steps), the
//!    simulator's default (illustrative) accept model: baseline, adaptive SD and adaptive SD with the online
//!    drafter, with and without stealing, at the recipe's batch cap (512) and at a tight one.
//!
//! Not modelled: the policy update (`train_s`), the all-gather and the gradient all-reduce, the steal messages'
//! latency (a grant is instant in the simulator, the trainer answers between rounds), and memory.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tlt_model::LlamaConfig;
use tlt_scheduler::sim::{simulate, AcceptModel, AcceptPoint, CostModel, LengthDist, Linear, SimConfig};
use tlt_scheduler::{MabConfig, RolloutConfig};
use tlt_spec_decode::Plan;
use tracing::info;

use tlt_model::device_step::roofline::{self, Hardware};

use crate::bench_rollout::{cpu_gate, cpu_mab, fit};
use crate::report::{self, Header};
use crate::sysinfo::{self, MachineInfo};

mod data;
mod md;

use data::{idle_fraction, Compared, GpuCost, Prediction, Report, RoundFit, Run, StepLine};

/// Options of `cargo xtask bench ranks`.
#[derive(Debug, Clone, clap::Args)]
pub struct RanksArgs {
    /// Folder of the trainer's JSONL metrics (`rep*-ranks*.jsonl`, optionally `steal-*.jsonl`).
    #[arg(long, default_value = "docs/bench/2026-11-26-ranks")]
    dir: PathBuf,
    /// GRPO group size of a measured run whose metrics do not tell it (they do when every group is counted as
    /// informative or zero-variance).
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    /// Predicted cluster sizes (GPUs, one worker each).
    #[arg(long, value_delimiter = ',', default_value = "8,64,512")]
    gpus: Vec<usize>,
    /// Requests per GPU per RL step in the predictions (the recipe: 64 prompts x 8 on 8 GPUs).
    #[arg(long, default_value_t = 64)]
    requests_per_gpu: usize,
    /// RL steps per prediction (the drafter's staleness evolves across them).
    #[arg(long, default_value_t = 4)]
    rl_steps: usize,
    /// The tight batch cap of the stealing predictions (the recipe's 512 starts every group at once; 8, one
    /// group of 8 at a time, as the stealing runs).
    #[arg(long, default_value_t = 8)]
    tight_max_running: usize,
    /// KV length every predicted decode step attends to (the roofline's cost grows with it).
    #[arg(long, default_value_t = 4096)]
    context: usize,
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().into_iter().flatten().filter_map(Value::as_f64).collect()
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array().into_iter().flatten().filter_map(Value::as_u64).map(|x| x as usize).collect()
}

fn read_run(path: &Path, group_size: usize) -> Result<Run> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let (mut steps, mut stolen_groups) = (Vec::new(), Vec::new());
    let (mut ranks, mut group_size) = (1, group_size);
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let v: Value = serde_json::from_str(line).with_context(|| format!("{}:{}", path.display(), i + 1))?;
        ranks = v["ranks"].as_u64().unwrap_or(1).max(1) as usize;
        stolen_groups.push(v["stolen_groups"].as_u64().unwrap_or(0));
        let groups = v["informative_groups"].as_u64().unwrap_or(0) + v["zero_variance_groups"].as_u64().unwrap_or(0);
        let samples = v["samples"].as_u64().unwrap_or(0);
        if i == 0 && groups > 0 && samples.is_multiple_of(groups) {
            group_size = (samples / groups) as usize;
        }
        let rollout_s = v["rollout_s"].as_f64().unwrap_or(f64::NAN);
        let (mut rr, mut ri) = (f64s(&v["rank_rollout_s"]), f64s(&v["rank_idle_s"]));
        if rr.is_empty() {
            (rr, ri) = (vec![rollout_s], vec![0.0]);
        }
        let (active, secs, toks) =
            (usizes(&v["active_requests"]), f64s(&v["round_seconds"]), usizes(&v["round_tokens"]));
        if active.len() != secs.len() || active.len() != toks.len() {
            bail!("{name} step {i}: round arrays of different lengths");
        }
        steps.push(StepLine {
            step: v["step"].as_u64().unwrap_or(i as u64),
            step_s: v["step_s"].as_f64().unwrap_or(f64::NAN),
            rollout_s,
            train_s: v["train_s"].as_f64().unwrap_or(f64::NAN),
            rank_rollout_s: rr,
            rank_idle_s: ri,
            lengths: usizes(&v["response_lengths"]),
            rounds: active.into_iter().zip(secs).zip(toks).map(|((a, s), t)| (a, s, t)).collect(),
        });
    }
    let Some(first) = steps.first() else { bail!("{name}: no steps") };
    if !first.lengths.len().is_multiple_of(ranks * group_size) {
        bail!(
            "{name}: {} samples do not split into {ranks} equal shards of groups of {group_size}",
            first.lengths.len()
        );
    }
    // The logging rank: the shard whose tokens the logged rounds add up to (closest).
    let shard = first.lengths.len() / ranks;
    let logged: usize = first.rounds.iter().map(|r| r.2).sum();
    let logging_rank = (0..ranks)
        .min_by_key(|&r| first.lengths[r * shard..(r + 1) * shard].iter().sum::<usize>().abs_diff(logged))
        .unwrap_or(0);
    let steal = name.starts_with("steal").then(|| !name.contains("nosteal") && !name.contains("off"));
    let stem = name.trim_end_matches(".jsonl");
    let is_rep = |p: &&str| p.len() > 3 && p.starts_with("rep") && p[3..].bytes().all(|b| b.is_ascii_digit());
    let set = stem.split('-').filter(|p| !is_rep(p)).collect::<Vec<_>>().join("-");
    let max_running = steps.iter().flat_map(|s| s.rounds.iter().map(|r| r.0)).max().unwrap_or(1).max(1);
    Ok(Run { name, set, ranks, group_size, max_running, steal, logging_rank, stolen_groups, steps })
}

fn fit_rounds(label: &str, runs: &[&Run]) -> Result<RoundFit> {
    let rounds: Vec<(usize, f64, usize)> = runs.iter().flat_map(|r| &r.steps).flat_map(|s| s.rounds.clone()).collect();
    if rounds.len() < 2 {
        bail!("{label}: no rounds to fit");
    }
    let pts: Vec<(f64, f64)> = rounds.iter().map(|&(a, s, _)| (a as f64, s)).collect();
    let line = fit(&pts);
    let mean = pts.iter().map(|p| p.1).sum::<f64>() / pts.len() as f64;
    let ss_res: f64 = pts.iter().map(|&(x, y)| (y - line.fixed_s - line.per_token_s * x).powi(2)).sum();
    let ss_tot: f64 = pts.iter().map(|&(_, y)| (y - mean).powi(2)).sum();
    let threshold = cpu_gate().threshold;
    let (tail_tok, tail_req) =
        rounds.iter().filter(|r| r.0 <= threshold).fold((0usize, 0usize), |(t, a), r| (t + r.2, a + r.0));
    let overheads: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.steps.iter().map(move |s| (r.logging_rank, s)))
        .map(|(lr, s)| {
            s.rank_rollout_s.get(lr).copied().unwrap_or(s.rollout_s) - s.rounds.iter().map(|r| r.1).sum::<f64>()
        })
        .collect();
    Ok(RoundFit {
        label: label.into(),
        files: runs.iter().map(|r| r.name.clone()).collect(),
        rounds: rounds.len(),
        line,
        r2: 1.0 - ss_res / ss_tot,
        rmse_s: (ss_res / pts.len() as f64).sqrt(),
        mean_round_s: mean,
        tail_tokens_per_request_round: if tail_req > 0 { tail_tok as f64 / tail_req as f64 } else { 1.0 },
        overhead_s: overheads.iter().sum::<f64>() / overheads.len().max(1) as f64,
    })
}

/// The simulator set up for a measured run: this CPU's fitted rounds, the trainer's gate, and speculative rounds
/// that cost the line and commit the measured tail tokens per request-round.
fn cpu_sim(f: &RoundFit, run: &Run) -> SimConfig {
    let tau = f.tail_tokens_per_request_round.max(1.0);
    let k = ((tau - 1.0).ceil() as usize).max(1);
    let plan = Plan::chain(k);
    let mut cost = CostModel {
        decode: f.line,
        verify: Linear { fixed_s: f.line.fixed_s, per_token_s: f.line.per_token_s / (k + 1) as f64 },
        draft: Linear { fixed_s: 0.0, per_token_s: 0.0 },
        prefill_per_token_s: 0.0,
        noise: 0.0,
        ..CostModel::default()
    };
    cost.graphs.batch_sizes.clear();
    let per_step = run.steps[0].lengths.len();
    SimConfig {
        workers: run.ranks,
        requests_per_worker: per_step / run.ranks,
        group_size: run.group_size,
        prompt_tokens: 1,
        lengths: LengthDist::Replay { lengths: run.steps.iter().flat_map(|s| s.lengths.clone()).collect() },
        rl_steps: run.steps.len(),
        rollout: RolloutConfig {
            max_running: run.max_running,
            gate: cpu_gate(),
            mab: MabConfig { arms: vec![plan], thresholds: vec![1], epsilon: 0.0, plain_arm: false, ..cpu_mab() },
            ..RolloutConfig::default()
        },
        cost,
        accept: AcceptModel {
            fresh: vec![AcceptPoint { verify_tokens: k + 1, accept_len: tau }],
            staleness_decay: 1.0,
            ..AcceptModel::default()
        },
        steal: run.steal.unwrap_or(false),
        ..SimConfig::default()
    }
}

fn compare(f: &RoundFit, run: &Run) -> Result<Vec<Compared>> {
    let rep = simulate(&cpu_sim(f, run))?;
    // Adaptive SD: the trainer's gate, the measured tail tokens per request-round.
    let sim = &rep.modes[1];
    Ok(run
        .steps
        .iter()
        .zip(&sim.rl_steps)
        .zip(&run.stolen_groups)
        .map(|((m, s), &stolen)| {
            let rank: Vec<f64> = s.worker_finish_s.iter().map(|t| t + f.overhead_s).collect();
            let makespan = s.makespan_s + f.overhead_s;
            let idle: Vec<f64> = rank.iter().map(|t| makespan - t).collect();
            Compared {
                run: run.name.clone(),
                set: run.set.clone(),
                ranks: run.ranks,
                steal: run.steal,
                calibration: f.label.clone(),
                step: m.step,
                measured_step_s: m.step_s,
                measured_rollout_s: m.rollout_s,
                measured_train_s: m.train_s,
                measured_rank_rollout_s: m.rank_rollout_s.clone(),
                measured_rank_idle_s: m.rank_idle_s.clone(),
                makespan_ratio: makespan / m.rollout_s,
                measured_idle_fraction: idle_fraction(&m.rank_idle_s, m.rollout_s),
                sim_idle_fraction: idle_fraction(&idle, makespan),
                sim_rollout_s: makespan,
                sim_rank_rollout_s: rank,
                sim_rank_idle_s: idle,
                sim_stolen_groups: s.stolen_groups,
                measured_stolen_groups: stolen,
            }
        })
        .collect())
}

/// Qwen2.5-7B's shapes (the TLT recipe's model): hidden 3584, FFN 18944, 28 layers, 28 heads, 4 KV heads,
/// vocabulary 152064, untied head.
fn qwen7b(layers: usize) -> LlamaConfig {
    let mut c = LlamaConfig::tiny(152_064, 3584, layers);
    c.model_type = "qwen2".into();
    c.intermediate_size = 18_944;
    c.num_attention_heads = 28;
    c.num_key_value_heads = Some(4);
    c.head_dim = Some(128);
    c
}

fn max_rel_err(line: &Linear, pts: &[(f64, f64)]) -> f64 {
    pts.iter().map(|&(x, y)| ((line.fixed_s + line.per_token_s * x) / y - 1.0).abs()).fold(0.0, f64::max)
}

fn gpu_cost(context: usize) -> Result<GpuCost> {
    let (target, draft) = (qwen7b(28), qwen7b(1));
    let s = |cfg: &LlamaConfig, b, n| {
        roofline::step("Qwen2.5-7B", cfg, Hardware::H100, b, n, context).map(|c| c.seconds).map_err(anyhow::Error::from)
    };
    let decode_points: Vec<(f64, f64)> =
        [1, 2, 4, 8, 16, 32, 64, 128, 256].iter().map(|&b| Ok((b as f64, s(&target, b, 1)?))).collect::<Result<_>>()?;
    let mut verify_points = Vec::new();
    for b in [1, 2, 4, 8] {
        for n in [8, 16, 32, 48] {
            verify_points.push(((b * n) as f64, s(&target, b, n)?));
        }
    }
    let mut draft_points = Vec::new();
    for b in [1, 2, 4, 8, 16] {
        for k in [1, 4] {
            draft_points.push(((b * k) as f64, s(&draft, b, k)?));
        }
    }
    let (decode, verify, draft_line) = (fit(&decode_points), fit(&verify_points), fit(&draft_points));
    let cost = CostModel {
        decode,
        verify,
        draft: draft_line,
        prefill_per_token_s: verify.per_token_s,
        ..CostModel::default()
    };
    Ok(GpuCost {
        source: format!(
            "`cargo xtask roofline`'s model (tlt_model::device_step::roofline: H100 SXM {:.2} TB/s, {:.0} dense bf16 \
             TFLOP/s, {:.0} us launch floor) applied to Qwen2.5-7B shapes at context {context}; the draft is one such \
             layer plus the head",
            Hardware::H100.bytes_per_s / 1e12,
            Hardware::H100.flops / 1e12,
            roofline::LAUNCH_FLOOR_S * 1e6
        ),
        max_rel_err: [
            max_rel_err(&decode, &decode_points),
            max_rel_err(&verify, &verify_points),
            max_rel_err(&draft_line, &draft_points),
        ],
        decode_points,
        verify_points,
        draft_points,
        cost,
    })
}

fn predict(a: &RanksArgs, cost: &CostModel) -> Result<Vec<Prediction>> {
    let mut out = Vec::new();
    for &gpus in &a.gpus {
        for max_running in [RolloutConfig::default().max_running, a.tight_max_running] {
            let mut no_steal: Vec<f64> = Vec::new();
            for steal in [false, true] {
                let cfg = SimConfig {
                    workers: gpus,
                    requests_per_worker: a.requests_per_gpu,
                    group_size: 8,
                    prompt_tokens: 1024,
                    lengths: LengthDist::LogNormal { median: 1000.0, sigma: 1.0, max: 32_768 },
                    rl_steps: a.rl_steps,
                    rollout: RolloutConfig { max_running, ..RolloutConfig::default() },
                    cost: cost.clone(),
                    steal,
                    ..SimConfig::default()
                };
                let t = std::time::Instant::now();
                let rep = simulate(&cfg)?;
                info!(gpus, max_running, steal, seconds = format!("{:.1}", t.elapsed().as_secs_f64()), "predicted");
                let base = rep.modes[0].total_makespan_s;
                for (i, m) in rep.modes.iter().enumerate() {
                    let n = m.rl_steps.len() as f64;
                    if !steal {
                        no_steal.push(m.total_makespan_s);
                    }
                    out.push(Prediction {
                        label: "PREDICTION",
                        gpus,
                        max_running,
                        steal,
                        mode: format!("{:?}", m.mode),
                        makespan_s: m.total_makespan_s / n,
                        idle_fraction: m.mean_idle_fraction,
                        speedup_over_baseline: base / m.total_makespan_s,
                        speedup_from_stealing: no_steal[i] / m.total_makespan_s,
                        stolen_groups: m.rl_steps.iter().map(|r| r.stolen_groups as f64).sum::<f64>() / n,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Runs the suite and writes `target/bench/ranks.{json,md}`.
pub fn run(a: &RanksArgs) -> Result<()> {
    let timestamp = sysinfo::utc_timestamp();
    let machine = MachineInfo::collect();
    let dir = if a.dir.is_absolute() { a.dir.clone() } else { crate::env::workspace_root().join(&a.dir) };
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        // The runs this suite models: plain ranks and stealing (the folder also holds other runs' metrics).
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("rep") || n.starts_with("steal"))
        })
        .collect();
    paths.sort();
    let runs: Vec<Run> = paths.iter().map(|p| read_run(p, a.group_size)).collect::<Result<_>>()?;
    let plain = |r: usize| runs.iter().filter(|x| x.steal.is_none() && x.ranks == r).collect::<Vec<_>>();
    let one = fit_rounds("1 rank, 2 threads", &plain(1))?;
    let two = fit_rounds("2 ranks, 1 thread each (logging rank)", &plain(2))?;
    info!(one = ?one.line, r2 = one.r2, two = ?two.line, r2_two = two.r2, "calibrated");
    let mut compared = Vec::new();
    for run in &runs {
        compared.extend(compare(&one, run)?);
        if run.ranks > 1 {
            compared.extend(compare(&two, run)?);
        }
    }
    let gpu = gpu_cost(a.context)?;
    info!(decode = ?gpu.cost.decode, verify = ?gpu.cost.verify, draft = ?gpu.cost.draft, "GPU costs from the roofline");
    let predictions = predict(a, &gpu.cost)?;
    let report = Report {
        header: Header::new("ranks", 1, timestamp, machine),
        runs,
        calibrations: vec![one, two],
        compared,
        gpu,
        prediction_settings: format!(
            "lognormal lengths (median 1,000, sigma 1, cap 32,768), prompts of 1,024 tokens, groups of 8, {} requests \
             per GPU per RL step, {} RL steps (means per step), seed 0, TLT's default gate and BEG-MAB arms, graphs \
             padded to SGLang's ladder to 32, the simulator's default noise (5%)",
            a.requests_per_gpu, a.rl_steps
        ),
        predictions,
    };
    report::write_outputs("ranks", &report, &md::markdown(&report))
}
