//! `cargo xtask bench drafter`: EAGLE-2 and EAGLE-3 drafters for SmolLM2-135M trained offline on the target's
//! own greedy responses, then speculative against plain greedy decoding at batch 1 on held-out prompts, in one
//! run. Writes `target/bench/drafter.json` and `drafter.md`.
//!
//! Also measures the drafter trainer's throughput and the preemption latency of a background trainer (pause
//! requests while it runs training steps).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use parking_lot::Mutex;
use serde::Serialize;
use tlt_drafter::online::{BackgroundTrainer, BufferConfig, FeatureSample, OnlineBuffer, WeightsSlot};
use tlt_drafter::train::{online_step_fn, train_offline, Budget, OfflineReport, OnlineStepConfig};
use tlt_drafter::{
    DrafterConfig, DrafterTrainer, Eagle2Drafter, Eagle3Drafter, FrozenTarget, RuntimeOptions, TrainConfig,
    UniformNoise, VocabMap,
};
use tlt_kernels::WeightDType;
use tlt_model::optim::{LrSchedule, ScheduleKind};
use tlt_model::Llama;
use tlt_spec_decode::Plan;
use tracing::info;

use crate::drafter_data::{cached_rollout_samples, eval_batch1, extra_fill_prompts, prompts_with_extra};
use crate::report::{self, median, Header};
use crate::sysinfo::{self, MachineInfo};

/// Options of `cargo xtask bench drafter`.
#[derive(Debug, Clone, clap::Args)]
pub struct DrafterArgs {
    /// Training wall-time budget per drafter, minutes (the budget is 20).
    #[arg(long, default_value_t = 20.0)]
    train_minutes: f64,
    /// Tokens generated per training prompt (greedy).
    #[arg(long, default_value_t = 128)]
    rollout_tokens: usize,
    /// Extra question templates (0-10) for training prompts: 24 more prompts each (held-out prompts unchanged).
    #[arg(long, default_value_t = 0)]
    extra_templates: usize,
    /// Extra topics (0-24) for training prompts: one prompt per training template each (held-out unchanged).
    #[arg(long, default_value_t = 0)]
    extra_fills: usize,
    /// Tokens generated per held-out prompt at evaluation.
    #[arg(long, default_value_t = 128)]
    eval_tokens: usize,
    /// Held-out prompts evaluated (at most 40).
    #[arg(long, default_value_t = 8)]
    eval_prompts: usize,
    /// Draft plans as `steps:top_k:verify_tokens`, comma-separated: each drafter is evaluated with each, and
    /// its headline figures are those of the fastest (the plan the rollout's bandit would settle on).
    #[arg(long, value_delimiter = ',', default_value = "4:2:8")]
    plan: Vec<String>,
    /// EAGLE-3 draft vocabulary (and EAGLE-2 hot vocabulary) size: the most frequent response tokens.
    #[arg(long, default_value_t = 8192)]
    draft_vocab: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Learning-rate shape after 20 warmup steps: `constant`, or `cosine` down to 5% of the peak at the end of
    /// the time budget (its step count estimated from the warmup steps' pace).
    #[arg(long, default_value = "constant")]
    schedule: String,
    /// EAGLE's uniform input noise on the target features (`std`; EAGLE uses 0.2; 0 = none).
    #[arg(long, default_value_t = 0.0)]
    noise_std: f64,
    /// EAGLE-2's weight of the soft cross-entropy term (TLT: 0.1). 0 trains on the feature regression alone and
    /// skips the two full-vocabulary LM-head products per step, most of a step's cost on CPU.
    #[arg(long, default_value_t = 0.1)]
    eagle2_ploss_weight: f64,
    /// Compute EAGLE-2's soft cross-entropy over the whole vocabulary instead of the hot vocabulary it drafts
    /// over (49,152 columns instead of `--draft-vocab`: several times slower on CPU).
    #[arg(long)]
    eagle2_full_vocab_loss: bool,
    /// Tokens per step of the background trainer in the preemption measurement (its micro-step bounds the
    /// latency).
    #[arg(long, default_value_t = 256)]
    online_tokens_per_step: usize,
    /// Which drafters to train, comma-separated (`eagle2`, `eagle3`).
    #[arg(long, value_delimiter = ',', default_value = "eagle2,eagle3")]
    kinds: Vec<String>,
    /// Pause requests timed for the preemption latency.
    #[arg(long, default_value_t = 20)]
    preemptions: usize,
    /// The GGUF to load (default: the cached SmolLM2-135M-Instruct, fetched if missing).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Drift test: SFT steps that change the target after the EAGLE-2 drafter is trained (0: no drift test).
    #[arg(long, default_value_t = 0)]
    drift_sft_steps: usize,
    /// Drift test: SFT learning rate.
    #[arg(long, default_value_t = 1e-4)]
    drift_lr: f64,
    /// Drift test: minutes of drafter training on the new target's rollouts.
    #[arg(long, default_value_t = 3.0)]
    drift_minutes: f64,
    /// Drift test: training prompts whose new-target rollouts the drafter recovers on.
    #[arg(long, default_value_t = 80)]
    drift_prompts: usize,
    /// `cpu` (the default): this suite measures the CPU path; a CUDA device is refused with what to run instead.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

/// Training-data figures.
#[derive(Debug, Clone, Serialize)]
pub struct DataReport {
    /// Training prompts.
    pub prompts: usize,
    /// Held-out prompts evaluated.
    pub eval_prompts: usize,
    /// Response tokens generated for training.
    pub response_tokens: usize,
    /// Seconds generating them (batch 16, greedy, hidden states recorded), or loading them from the cache.
    pub seconds: f64,
    /// Whether they were loaded from the rollout cache (generated by an earlier run with the same settings).
    pub cached: bool,
}

/// One drafter evaluated with one plan, against plain decoding measured just before it.
#[derive(Debug, Clone, Serialize)]
pub struct PlanEval {
    /// The draft plan.
    pub plan: Plan,
    /// Mean committed tokens per round on the held-out prompts (tau, bonus included).
    pub tau: f64,
    /// Drafted tokens accepted / drafted.
    pub accept_rate: f64,
    /// Speculative decode tokens/s.
    pub sd_tokens_per_s: f64,
    /// Decode time of plain over speculative decoding, same prompts, same run.
    pub speedup: f64,
    /// Share of speculative step time spent in the drafter.
    pub draft_fraction: f64,
}

/// One drafter's training and evaluation; the evaluation figures are those of its fastest plan.
#[derive(Debug, Clone, Serialize)]
pub struct DrafterResult {
    /// `eagle2` or `eagle3`.
    pub kind: String,
    /// Trainable parameters.
    pub params: usize,
    /// Training steps within the budget.
    pub steps: u64,
    /// Training seconds.
    pub train_s: f64,
    /// Window tokens per second of training.
    pub train_tokens_per_s: f64,
    /// Loss of the first and last step.
    pub loss_first: f64,
    /// Loss of the last step.
    pub loss_last: f64,
    /// Draft top-1 accuracy on the last training batch.
    pub accuracy_last: f64,
    /// Teacher-forced draft top-1 accuracy (the training metric, no input noise) on the greedy responses to
    /// the held-out prompts.
    pub heldout_accuracy: f64,
    /// The same on 8 training prompts' responses (the generalisation gap is the difference).
    pub train_accuracy: f64,
    /// The fastest plan.
    pub plan: Plan,
    /// Plain greedy decode tokens/s measured just before this drafter's evaluation.
    pub plain_tokens_per_s: f64,
    /// Mean committed tokens per round on the held-out prompts (tau, bonus included).
    pub tau: f64,
    /// Drafted tokens accepted / drafted.
    pub accept_rate: f64,
    /// Speculative decode tokens/s.
    pub sd_tokens_per_s: f64,
    /// `sd_tokens_per_s / plain_tokens_per_s` of the same run.
    pub speedup: f64,
    /// Share of speculative step time spent in the drafter.
    pub draft_fraction: f64,
    /// Speculative output = plain output on every prompt, with every plan.
    pub lossless: bool,
    /// Every plan evaluated.
    pub plans: Vec<PlanEval>,
}

/// Preemption of a background trainer.
#[derive(Debug, Clone, Serialize)]
pub struct PreemptionReport {
    /// Pause requests timed.
    pub samples: usize,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
    /// Largest latency, ms.
    pub max_ms: f64,
    /// Median training step time, ms (the bound the latency should respect).
    pub step_p50_ms: f64,
}

/// The whole `drafter.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Suite, schema version, time, commit, command line and machine.
    #[serde(flatten)]
    pub header: Header,
    /// The draft plans evaluated.
    pub plans: Vec<Plan>,
    /// Learning-rate schedule over the budget (`constant` or `cosine`).
    pub schedule: String,
    /// Training budget per drafter, minutes.
    pub train_minutes: f64,
    /// The data.
    pub data: DataReport,
    /// Plain greedy decode tokens/s at batch 1 on the held-out prompts.
    pub plain_tokens_per_s: f64,
    /// One entry per drafter.
    pub drafters: Vec<DrafterResult>,
    /// Background-trainer preemption.
    pub preemption: Option<PreemptionReport>,
    /// The drift test (EAGLE-2; `null` unless `--drift-sft-steps` > 0).
    pub drift: Option<crate::drift::DriftReport>,
}

fn parse_plan(s: &str) -> Result<Plan> {
    let v: Vec<usize> = s.split(':').map(str::parse).collect::<std::result::Result<_, _>>().context("--plan")?;
    let [steps, top_k, verify_tokens] = v[..] else { bail!("--plan must be steps:top_k:verify_tokens") };
    let plan = Plan { steps, top_k, verify_tokens };
    plan.validate()?;
    Ok(plan)
}

/// Response-token counts of `samples` over the target vocabulary.
fn response_counts(samples: &[Arc<FeatureSample>], vocab: usize) -> Vec<u64> {
    let mut counts = vec![0u64; vocab];
    for s in samples {
        for &t in &s.tokens[s.response_start..] {
            if let Some(c) = counts.get_mut(t as usize) {
                *c += 1;
            }
        }
    }
    counts
}

fn new_drafter(kind: &str, target: &Llama, vocab: &VocabMap, hot_loss: bool) -> Result<tlt_drafter::TrainableDrafter> {
    let frozen = FrozenTarget::new(target);
    Ok(match kind {
        "eagle2" => {
            let d = Eagle2Drafter::random(DrafterConfig::eagle2_from_target(target.config(), false), frozen, 1)?;
            if hot_loss {
                d.with_loss_vocab(vocab.used())?.into()
            } else {
                d.into()
            }
        }
        "eagle3" => {
            let cfg = DrafterConfig::eagle3_from_target(target.config(), vocab.draft_vocab_size());
            Eagle3Drafter::random(cfg, vocab.clone(), frozen, 1)?.into()
        }
        other => bail!("unknown drafter kind {other:?} (eagle2, eagle3)"),
    })
}

/// Runs the suite and writes `target/bench/drafter.{json,md}`.
pub fn run(args: &DrafterArgs) -> Result<()> {
    let plans: Vec<Plan> = args.plan.iter().map(|p| parse_plan(p)).collect::<Result<_>>()?;
    let timestamp = sysinfo::utc_timestamp();
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::env::smollm2_gguf()?,
    };
    let loaded = tlt_model::load_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let target = loaded.model;
    let tok = loaded.tokenizer.with_context(|| format!("{} carries no tokenizer", path.display()))?;
    let (train_text, held_text) = prompts_with_extra(args.extra_templates);
    let enc = |v: &[String]| -> Result<Vec<Vec<u32>>> {
        Ok(v.iter().map(|t| tlt_model::encode(&tok, t)).collect::<Result<_, _>>()?)
    };
    let mut train_prompts = enc(&train_text)?;
    let eval: Vec<Vec<u32>> = enc(&held_text)?.into_iter().step_by(5).take(args.eval_prompts).collect();
    let machine = MachineInfo::collect();
    info!(
        train_prompts = train_prompts.len(),
        eval_prompts = eval.len(),
        "drafter benchmark: generating training data"
    );

    let t = Instant::now();
    let cache = crate::env::cache_dir()?.join("drafter-data");
    let (mut samples, mut cached) =
        cached_rollout_samples(&cache, &path, &target, &train_prompts, args.rollout_tokens, 16)?;
    if args.extra_fills > 0 {
        // Cached apart from the base prompts, so adding topics reuses the base rollouts.
        let extra = enc(&extra_fill_prompts(args.extra_templates, args.extra_fills))?;
        let (more, more_cached) = cached_rollout_samples(&cache, &path, &target, &extra, args.rollout_tokens, 16)?;
        samples.extend(more);
        cached &= more_cached;
        train_prompts.extend(extra);
    }
    let samples: Vec<Arc<FeatureSample>> = samples.into_iter().map(Arc::new).collect();
    let data = DataReport {
        cached,
        prompts: train_prompts.len(),
        eval_prompts: eval.len(),
        response_tokens: samples.iter().map(|s| s.tokens.len() - s.response_start).sum(),
        seconds: t.elapsed().as_secs_f64(),
    };
    info!(tokens = data.response_tokens, seconds = format!("{:.0}", data.seconds), "training data ready");

    let (heldout, _) = cached_rollout_samples(&cache, &path, &target, &eval, args.eval_tokens, 16)?;
    let heldout: Vec<Arc<FeatureSample>> = heldout.into_iter().map(Arc::new).collect();
    let counts = response_counts(&samples, target.config().vocab_size);
    let eos = target.config().eos_ids();
    let vocab = VocabMap::from_counts(&counts, args.draft_vocab.min(target.config().vocab_size), &eos)?;
    let hot: Vec<u32> = vocab.used().to_vec();

    let plain = eval_batch1(&target, &eval, args.eval_tokens, None, &plans[0])?;
    let generated: usize = plain.tokens.iter().map(Vec::len).sum();
    let plain_tps = generated as f64 / plain.decode_s;
    info!(tok_s = format!("{plain_tps:.1}"), "plain decode");

    let mut cfg = TrainConfig {
        schedule: LrSchedule { warmup_steps: 20, ..LrSchedule::constant(args.lr) },
        ..TrainConfig::default()
    };
    cfg.eagle2_loss.ploss_weight = args.eagle2_ploss_weight;
    if args.noise_std > 0.0 {
        cfg.eagle2_loss.noise = Some(UniformNoise { std: args.noise_std, seed: 0 });
        cfg.eagle3_loss.noise = Some(UniformNoise { std: args.noise_std, seed: 0 });
    }
    if !matches!(args.schedule.as_str(), "constant" | "cosine") {
        bail!("--schedule must be constant or cosine, not {:?}", args.schedule);
    }
    let mut drafters = Vec::new();
    let mut last_trainer = None;
    let mut drift = None;
    for kind in &args.kinds {
        let drafter = new_drafter(kind, &target, &vocab, !args.eagle2_full_vocab_loss)?;
        let params: usize = drafter.vars()?.iter().map(|(_, v)| v.elem_count()).sum();
        let mut trainer = DrafterTrainer::new(drafter, cfg.clone())?;
        let rep = train_within(&mut trainer, &samples, kind, args)?;
        let opts = RuntimeOptions {
            layer_dtype: WeightDType::F32,
            head_dtype: WeightDType::Q8_0,
            hot_vocab: (kind == "eagle2").then(|| hot.clone()),
        };
        let heldout_accuracy = trainer.evaluate(&heldout)?.accuracy;
        let train_accuracy = trainer.evaluate(&samples[..samples.len().min(8)])?.accuracy;
        info!(kind = %kind, heldout = format!("{heldout_accuracy:.3}"), train = format!("{train_accuracy:.3}"),
              "teacher-forced top-1 accuracy");
        let rt = trainer.runtime(&opts)?;
        // Plain decoding again, just before the speculative runs: the machine drifts over a long run.
        let base = eval_batch1(&target, &eval, args.eval_tokens, None, &plans[0])?;
        let mut evals = Vec::new();
        let mut lossless = base.tokens == plain.tokens;
        for plan in &plans {
            let sd = eval_batch1(&target, &eval, args.eval_tokens, Some(&rt), plan)?;
            lossless &= sd.tokens == plain.tokens;
            let c = &sd.counters;
            let step_s = c.draft_s + c.forward_s + c.verify_s + c.commit_s;
            let e = PlanEval {
                plan: *plan,
                tau: c.mean_accept_len(),
                accept_rate: c.accepted as f64 / c.drafted.max(1) as f64,
                sd_tokens_per_s: generated as f64 / sd.decode_s,
                speedup: base.decode_s / sd.decode_s,
                draft_fraction: c.draft_s / step_s.max(1e-12),
            };
            info!(kind = %kind, plan = format!("{}:{}:{}", plan.steps, plan.top_k, plan.verify_tokens),
                  tau = format!("{:.2}", e.tau), speedup = format!("{:.2}", e.speedup), "evaluated");
            evals.push(e);
        }
        let best = evals.iter().max_by(|a, b| a.speedup.total_cmp(&b.speedup)).cloned().context("no plan")?;
        let res = DrafterResult {
            kind: kind.clone(),
            params,
            steps: rep.steps,
            train_s: rep.seconds,
            train_tokens_per_s: rep.tokens_per_s,
            loss_first: rep.first.as_ref().map_or(f64::NAN, |s| s.eval.loss),
            loss_last: rep.last.as_ref().map_or(f64::NAN, |s| s.eval.loss),
            accuracy_last: rep.last.as_ref().map_or(f64::NAN, |s| s.eval.accuracy),
            heldout_accuracy,
            train_accuracy,
            plan: best.plan,
            plain_tokens_per_s: generated as f64 / base.decode_s,
            tau: best.tau,
            accept_rate: best.accept_rate,
            sd_tokens_per_s: best.sd_tokens_per_s,
            speedup: best.speedup,
            draft_fraction: best.draft_fraction,
            lossless,
            plans: evals,
        };
        info!(kind = %kind, steps = res.steps, tau = format!("{:.2}", res.tau), speedup = format!("{:.2}", res.speedup),
              train_tok_s = format!("{:.0}", res.train_tokens_per_s), "drafter done");
        if !res.lossless {
            bail!("{kind}: speculative output differs from plain decoding");
        }
        if kind == "eagle2" && args.drift_sft_steps > 0 {
            // The drift test compares drafter quality, which the plan with the longest accepts shows best.
            let probe = res.plans.iter().max_by(|a, b| a.tau.total_cmp(&b.tau)).cloned().context("no plan")?;
            let settings = crate::drift::DriftSettings {
                sft_steps: args.drift_sft_steps,
                sft_lr: args.drift_lr,
                minutes: args.drift_minutes,
                prompts: &train_prompts[..args.drift_prompts.min(train_prompts.len())],
                eval: &eval,
                rollout_tokens: args.rollout_tokens,
                eval_tokens: args.eval_tokens,
                plan: &probe.plan,
                opts: &opts,
            };
            let d = crate::drift::run(&target, &tok, &mut trainer, probe.tau, &settings)?;
            info!(
                pre = format!("{:.2}", d.tau_pre),
                stale = format!("{:.2}", d.tau_stale),
                recovered = format!("{:.2}", d.tau_recovered),
                "drift test done"
            );
            if !d.lossless {
                bail!("drift: speculative output differs from plain decoding on the new target");
            }
            drift = Some(d);
        }
        drafters.push(res);
        last_trainer = Some(trainer);
    }

    let preemption = match last_trainer {
        Some(trainer) if args.preemptions > 0 => {
            let online = TrainConfig {
                tokens_per_step: args.online_tokens_per_step,
                window: args.online_tokens_per_step.min(512),
                row_len: args.online_tokens_per_step.min(512),
                samples_per_step: 1,
                ..cfg.clone()
            };
            let trainer = DrafterTrainer::new(trainer.into_drafter(), online)?;
            Some(measure_preemption(trainer, &samples, args.preemptions)?)
        }
        _ => None,
    };
    let report = Report {
        header: Header::new("drafter", 1, timestamp, machine),
        plans,
        schedule: args.schedule.clone(),
        train_minutes: args.train_minutes,
        data,
        plain_tokens_per_s: plain_tps,
        drafters,
        preemption,
        drift,
    };
    report::write_outputs("drafter", &report, &markdown(&report))
}

/// Trains `trainer` for the time budget with a progress bar. With `--schedule cosine`, the first
/// `warmup_steps` set the pace from which the cosine's step count is estimated.
fn train_within(
    trainer: &mut DrafterTrainer,
    samples: &[Arc<FeatureSample>],
    kind: &str,
    args: &DrafterArgs,
) -> Result<OfflineReport> {
    let budget = Duration::from_secs_f64(args.train_minutes * 60.0);
    let bar = ProgressBar::new(budget.as_secs());
    bar.set_style(ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {msg}")?);
    let t0 = Instant::now();
    let mut progress = |s: &tlt_drafter::train::StepStats| {
        bar.set_position(t0.elapsed().as_secs());
        bar.set_message(format!("{kind} step {} loss {:.4} acc {:.3}", s.step, s.eval.loss, s.eval.accuracy));
    };
    let rep = if args.schedule == "cosine" {
        let warmup = trainer.config().schedule.warmup_steps.max(1);
        let first = train_offline(trainer, samples, Budget::Steps(warmup), &mut progress)?;
        let pace = first.seconds / first.steps.max(1) as f64;
        let total_steps = warmup + ((budget.as_secs_f64() - first.seconds).max(0.0) / pace) as u64;
        trainer.set_lr_schedule(LrSchedule {
            total_steps,
            min_lr_ratio: 0.05,
            kind: ScheduleKind::Cosine,
            ..trainer.config().schedule.clone()
        })?;
        let left = budget.saturating_sub(Duration::from_secs_f64(first.seconds));
        let rest = train_offline(trainer, samples, Budget::Time(left), &mut progress)?;
        first.merge(rest)
    } else {
        train_offline(trainer, samples, Budget::Time(budget), &mut progress)?
    };
    bar.finish_and_clear();
    Ok(rep)
}

/// Runs `trainer` as a background trainer on a buffer of `samples` and times `n` pause requests, each after
/// a random-ish 50-150 ms of running.
fn measure_preemption(trainer: DrafterTrainer, samples: &[Arc<FeatureSample>], n: usize) -> Result<PreemptionReport> {
    let buffer = Arc::new(OnlineBuffer::new(BufferConfig {
        max_samples: samples.len().max(1),
        keep_steps: 2,
        ..BufferConfig::default()
    })?);
    for s in samples {
        buffer.push((**s).clone())?;
    }
    let runtime = trainer.runtime(&RuntimeOptions::default())?;
    let slot = Arc::new(WeightsSlot::new(runtime));
    let trainer = Arc::new(Mutex::new(trainer));
    let step = online_step_fn(trainer.clone(), buffer, slot, OnlineStepConfig::default())?;
    let bg = BackgroundTrainer::spawn(step, Duration::from_millis(5));
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        bg.resume();
        std::thread::sleep(Duration::from_millis(50 + (i as u64 * 37) % 100));
        lat.push(bg.pause().as_secs_f64() * 1e3);
    }
    let stats = bg.shutdown()?;
    let step_ms = if stats.steps > 0 { 1e3 * stats.busy_s / stats.steps as f64 } else { f64::NAN };
    Ok(PreemptionReport {
        samples: n,
        p50_ms: median(&lat),
        p99_ms: tlt_rl::metrics::percentile(&lat, 0.99),
        max_ms: lat.iter().copied().fold(0.0, f64::max),
        step_p50_ms: step_ms,
    })
}

fn markdown(r: &Report) -> String {
    let plan_str = |p: &Plan| format!("{}:{}:{}", p.steps, p.top_k, p.verify_tokens);
    let plans: Vec<String> = r.plans.iter().map(plan_str).collect();
    let mut s = format!(
        "# drafter: offline-trained EAGLE drafters for SmolLM2-135M (f32 target, greedy, batch 1)\n\n\
         {} training prompts, {} response tokens ({}, {:.0} s); {:.1} min training budget per drafter, {} lr \
         schedule; plans {}; {} held-out prompts; plain {:.1} tok/s at the start; {} ({} threads); commit {}; {}\n\n\
         | drafter | params | steps | train tok/s | loss first -> last | acc train / held-out | plan | tau | accept rate | plain tok/s | SD tok/s | speedup | draft share |\n\
         |---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|\n",
        r.data.prompts,
        r.data.response_tokens,
        if r.data.cached { "loaded from the cache" } else { "generated" },
        r.data.seconds,
        r.train_minutes,
        r.schedule,
        plans.join(", "),
        r.data.eval_prompts,
        r.plain_tokens_per_s,
        r.header.machine.cpu_model,
        r.header.machine.candle_threads,
        r.header.git_commit,
        r.header.timestamp,
    );
    for d in &r.drafters {
        s.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.3} -> {:.3} | {:.3} / {:.3} | {} | {:.2} | {:.2} | {:.1} | {:.1} | {:.2} | {:.3} |\n",
            d.kind,
            d.params,
            d.steps,
            d.train_tokens_per_s,
            d.loss_first,
            d.loss_last,
            d.train_accuracy,
            d.heldout_accuracy,
            plan_str(&d.plan),
            d.tau,
            d.accept_rate,
            d.plain_tokens_per_s,
            d.sd_tokens_per_s,
            d.speedup,
            d.draft_fraction
        ));
    }
    if r.plans.len() > 1 {
        s.push_str("\nEvery plan (speedup against the plain run just before the drafter's evaluations):\n\n");
        s.push_str("| drafter | plan | tau | accept rate | SD tok/s | speedup | draft share |\n|---|---|---:|---:|---:|---:|---:|\n");
        for d in &r.drafters {
            for e in &d.plans {
                s.push_str(&format!(
                    "| {} | {} | {:.2} | {:.2} | {:.1} | {:.2} | {:.3} |\n",
                    d.kind,
                    plan_str(&e.plan),
                    e.tau,
                    e.accept_rate,
                    e.sd_tokens_per_s,
                    e.speedup,
                    e.draft_fraction
                ));
            }
        }
    }
    if let Some(d) = &r.drift {
        s.push_str(&format!(
            "\nDrift (EAGLE-2): {} SFT steps (batch {}, lr {:e}, loss {:.3} -> {:.3}) changed {:.0}% of held-out greedy tokens. \
             Plan {}:{}:{}: tau {:.2} before, {:.2} stale on the new target ({:.2}x), {:.2} after {} steps / {:.0} s at lr {:e} \
             on {} tokens of its rollouts ({:.2}x): {:.0}% of the pre-drift tau (target >= 90%).\n",
            d.sft_steps,
            d.sft_batch,
            d.sft_lr,
            d.sft_loss[0],
            d.sft_loss[1],
            100.0 * d.changed_token_fraction,
            d.plan.steps,
            d.plan.top_k,
            d.plan.verify_tokens,
            d.tau_pre,
            d.tau_stale,
            d.speedup[0],
            d.tau_recovered,
            d.recovery_steps,
            d.recovery_train_s,
            d.recovery_lr,
            d.recovery_tokens,
            d.speedup[1],
            100.0 * d.recovered_ratio,
        ));
    }
    if let Some(p) = &r.preemption {
        s.push_str(&format!(
            "\nPreemption of a background trainer ({} pauses): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (median step {:.1} ms)\n",
            p.samples, p.p50_ms, p.p99_ms, p.max_ms, p.step_p50_ms
        ));
    }
    s
}
