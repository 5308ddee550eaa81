//! `cargo xtask bench group`: group drafting on real GRPO-style rollouts of SmolLM2-135M. Writes
//! `target/bench/group.json` and `.md`.
//!
//! For each temperature, `--prompts` problems of the trainer's arithmetic task (chat template, seeded) are answered
//! `--group-size` times each, every prompt one engine group (prefilled once, forked to its siblings), by:
//! plain decoding; the self n-gram drafter; the suffix drafter over the group; the suffix drafter whose index was
//! also seeded with a previous rollout's answers to the same prompts ("history"); the same with DAS's length-aware
//! budgets (`--das-horizon`, `SuffixConfig::das_horizon`); and the adaptive rollout (SD gate
//! and BEG-MAB choosing per batch bucket among plain, suffix+history and n-gram with the CPU plans). The fixed-plan
//! runs speculate every round. Each round's running batch, seconds and committed tokens are recorded and split by
//! running batch size. The ceiling: the target's own probabilities along the plain run's samples (teacher-forced),
//! the expected tokens per step of an argmax-chain drafter `1 + Σ_{i≤k} Π_{j<i} p_max`.

use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use tlt_drafter::{DrafterTrainer, EagleProposer, RuntimeOptions};
use tlt_model::Llama;
use tlt_rl::task::{builtin, ChatTemplate};
use tlt_scheduler::AdaptiveDecoder;
use tlt_spec_decode::{
    Drafter, DrafterSet, Engine, GroupId, HybridDrafter, NgramDrafter, Plan, SamplingParams, SpecParams, SuffixConfig,
    SuffixDrafter, Target, TargetInput,
};
use tracing::info;

use crate::bench_rollout::{cpu_gate, cpu_mab};
use crate::report::{self, Header};
use crate::sysinfo::{self, MachineInfo};

/// Options of `cargo xtask bench group`.
#[derive(Debug, Clone, clap::Args)]
pub struct GroupArgs {
    /// Samples per prompt (the GRPO group size G).
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    /// Prompts per rollout.
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Sampling temperatures, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1.0,0.7")]
    temperatures: Vec<f64>,
    /// Most new tokens per sample.
    #[arg(long, default_value_t = 384)]
    max_new_tokens: usize,
    /// The fixed plan of the non-adaptive speculative runs, `steps:top_k:verify_tokens`.
    #[arg(long, default_value = "6:2:12")]
    plan: String,
    /// `SuffixConfig::min_accept` of the suffix drafters (0: no acceptance calibration).
    #[arg(long, default_value_t = 0.0)]
    suffix_min_accept: f32,
    /// `SuffixConfig::das_horizon` of the `suffix+history+das` run (length-aware budgets; 0 skips that run).
    #[arg(long, default_value_t = 32)]
    das_horizon: usize,
    /// Seed of the task's problems and of the sampling streams.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A trained EAGLE drafter for this model (a `DrafterTrainer` checkpoint directory, e.g. the trainer's warm-up
    /// cache entry under `target/warm-cache/<key>`): adds the `eagle` and `hybrid` (suffix + EAGLE in one tree)
    /// runs, and the hybrid as a drafter kind of the adaptive run.
    #[arg(long)]
    eagle: Option<std::path::PathBuf>,
    /// Plain and adaptive rollouts run this many times each, alternating (plain, adaptive, plain, ...) after the
    /// drafter runs, so the adaptive speed-ups get medians over pairs measured side by side (this VM's run-to-run
    /// spread is ~10%). 1: the single pair of the table.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// `cpu` (the default): this suite measures the CPU path; a CUDA device is refused with what to run instead.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

/// Running-batch buckets the rounds are split by (inclusive upper bounds).
const BUCKETS: [(usize, usize); 4] = [(1, 1), (2, 4), (5, 8), (9, usize::MAX)];

/// Rounds of one run that fell in one running-batch bucket.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BucketStats {
    /// Smallest running batch of the bucket.
    pub min_batch: usize,
    /// Largest (`usize::MAX` printed as open).
    pub max_batch: usize,
    /// Rounds.
    pub rounds: u64,
    /// Sequence-rounds (a sequence verified in a round).
    pub seq_rounds: u64,
    /// Tokens committed.
    pub tokens: u64,
    /// Wall seconds of these rounds.
    pub seconds: f64,
}

impl BucketStats {
    fn tokens_per_step(&self) -> f64 {
        self.tokens as f64 / self.seq_rounds.max(1) as f64
    }
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-12)
    }
}

/// One rollout by one drafter.
#[derive(Debug, Clone, Serialize)]
pub struct RunStats {
    /// `none`, `ngram`, `suffix`, `suffix+history`, `suffix+history+das`, `eagle`, `hybrid` or `adaptive`.
    pub drafter: String,
    /// Wall seconds of the decode rounds (prefill excluded).
    pub seconds: f64,
    /// Tokens generated.
    pub tokens: u64,
    /// Tokens committed per sequence-round over the whole rollout (speculative and plain rounds).
    pub tokens_per_step: f64,
    /// Tokens committed per sequence-round in speculative rounds only (0 without them).
    pub tokens_per_sd_step: f64,
    /// Throughput over the whole rollout / plain's.
    pub speedup: f64,
    /// Throughput while at most 4 requests run / plain's in the same phase (0 if plain had no such phase).
    pub speedup_tail: f64,
    /// Per running-batch bucket.
    pub buckets: Vec<BucketStats>,
    /// Per exact running batch (index = requests running before the round; index 0 unused).
    pub by_live: Vec<BucketStats>,
    /// Throughput ratio on plain's workload: the time plain spent at each running batch, divided by this run's
    /// throughput ratio to plain at that batch (its bucket's ratio where it has fewer than 3 rounds there).
    /// Runs sample different completions (lossless sampling draws other random numbers), so their length
    /// profiles differ; this compares them on one profile.
    pub speedup_matched: f64,
    /// [`RunStats::speedup_matched`] over the rounds with at most 4 running.
    pub speedup_tail_matched: f64,
    /// Seconds in the suffix index (appends and proposals), suffix drafters only.
    pub index_s: f64,
    /// Index seconds per round / plain decode seconds per round at the largest running batches.
    pub index_cost_frac: f64,
    /// Adaptive run: arms chosen (`kind/steps:top_k:verify` -> rounds).
    pub arms: std::collections::BTreeMap<String, u64>,
    /// Tokens per speculative request-round and the argmax-chain ceiling of the very same rounds at depth 2, 4, 6
    /// (`tlt_rl::trainer::SdCeiling`: `p_max` read along the committed tokens).
    pub sd_ceiling: tlt_rl::trainer::SdCeiling,
    /// Engine seconds: drafting, target forwards, acceptance, commits (the engine's counters).
    pub draft_s: f64,
    /// See [`RunStats::draft_s`].
    pub forward_s: f64,
    /// See [`RunStats::draft_s`].
    pub verify_s: f64,
    /// See [`RunStats::draft_s`].
    pub commit_s: f64,
}

/// One temperature.
#[derive(Debug, Clone, Serialize)]
pub struct TempReport {
    /// Sampling temperature.
    pub temperature: f64,
    /// Argmax-chain ceiling of tokens per step at depth 2, 4 and 6 (`[k, value]`), from the plain samples.
    pub ceiling: Vec<(usize, f64)>,
    /// Mean p_max of the target at this temperature along the plain samples.
    pub mean_p_max: f64,
    /// Response lengths of the plain run: p50, p90, max.
    pub length_p50_p90_max: [usize; 3],
    /// The runs, plain first.
    pub runs: Vec<RunStats>,
    /// With `--repeats`: each (plain, adaptive) pair's speed-up over the whole rollout and over the <= 4-running
    /// phase, the table's pair first.
    pub adaptive_pairs: Vec<(f64, f64)>,
    /// With `--repeats` and `--das-horizon`: per repeat pair, suffix+history seconds / suffix+history+das seconds
    /// (both commit the same tokens: same seed, and DAS changes only the trees).
    pub das_pairs: Vec<f64>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct GroupReport {
    /// Common header.
    #[serde(flatten)]
    pub header: Header,
    /// Samples per prompt.
    pub group_size: usize,
    /// Prompts per rollout.
    pub prompts: usize,
    /// Most new tokens per sample.
    pub max_new_tokens: usize,
    /// The fixed plan of non-adaptive speculative runs.
    pub plan: Plan,
    /// Prefill of all groups with sharing (`add_group`), seconds.
    pub prefill_shared_s: f64,
    /// Prefill of every sample on its own, seconds.
    pub prefill_separate_s: f64,
    /// `1 - shared / separate`, against the ideal `(G - 1) / G`.
    pub prefill_saved_frac: f64,
    /// Per temperature.
    pub temperatures: Vec<TempReport>,
}

fn parse_plan(s: &str) -> Result<Plan> {
    let v: Vec<usize> = s.split(':').map(str::parse).collect::<Result<_, _>>().context("plan is steps:top_k:verify")?;
    anyhow::ensure!(v.len() == 3, "plan is steps:top_k:verify_tokens, got {s}");
    let p = Plan { steps: v[0], top_k: v[1], verify_tokens: v[2] };
    p.validate()?;
    Ok(p)
}

/// How a run drafts.
enum How<'a> {
    Plain,
    Fixed(&'a mut dyn Drafter, Plan),
    Adaptive(&'a mut dyn Drafter, &'a mut AdaptiveDecoder),
}

/// Every sample of a rollout: (prompt length, prompt + response).
type Samples = Vec<(usize, Vec<u32>)>;

/// Decodes `prompts` × `g` to completion, recording every round. Returns the stats and the samples.
fn rollout(
    model: &Llama,
    prompts: &[Vec<u32>],
    g: usize,
    params: &SpecParams,
    name: &str,
    how: How<'_>,
) -> Result<(RunStats, Samples)> {
    let mut engine = Engine::new(model, params.clone())?;
    engine.record_hidden(match &how {
        How::Plain => false,
        How::Fixed(d, _) | How::Adaptive(d, _) => d.needs_hidden(),
    });
    for p in prompts {
        engine.add_group(p, g, params.max_new_tokens)?;
    }
    let mut by_live: Vec<BucketStats> =
        (0..=prompts.len() * g).map(|b| BucketStats { min_batch: b, max_batch: b, ..BucketStats::default() }).collect();
    let (mut sd_tokens, mut sd_seq_rounds) = (0u64, 0u64);
    let mut arms = Default::default();
    let mut how = how;
    let t_all = Instant::now();
    while !engine.is_idle() {
        let live = engine.num_live();
        let before = *engine.counters();
        let t = Instant::now();
        match &mut how {
            How::Plain => engine.round(None, None)?,
            How::Fixed(d, plan) => engine.round(Some(&mut **d), Some(plan))?,
            How::Adaptive(d, dec) => {
                dec.step(&mut engine, Some(&mut **d))?;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let c = engine.counters();
        let b = by_live.get_mut(live).context("live count above the batch")?;
        b.rounds += 1;
        b.seq_rounds += c.seq_rounds - before.seq_rounds;
        b.tokens += c.committed - before.committed;
        b.seconds += secs;
        if c.drafted > before.drafted || matches!(how, How::Fixed(..)) {
            sd_tokens += c.committed - before.committed;
            sd_seq_rounds += c.seq_rounds - before.seq_rounds;
        }
    }
    let seconds = t_all.elapsed().as_secs_f64();
    let buckets = BUCKETS
        .iter()
        .map(|&(lo, hi)| {
            let sum = BucketStats { min_batch: lo, max_batch: hi, ..BucketStats::default() };
            by_live.iter().filter(|x| x.min_batch >= lo && x.min_batch <= hi).fold(sum, |mut a, x| {
                a.rounds += x.rounds;
                a.seq_rounds += x.seq_rounds;
                a.tokens += x.tokens;
                a.seconds += x.seconds;
                a
            })
        })
        .collect();
    if let How::Adaptive(_, dec) = &mut how {
        arms = dec.take_trace().arms;
    }
    let c = *engine.counters();
    let mut f = engine.take_finished();
    f.sort_by_key(|f| f.id);
    let mut sd_ceiling = tlt_rl::trainer::SdCeiling::default();
    for x in &f {
        sd_ceiling.add(&x.p_max, &x.sd_rounds);
    }
    let tokens: u64 = f.iter().map(|f| f.tokens.len() as u64).sum();
    let samples = f.into_iter().map(|f| (f.prompt.len(), [f.prompt, f.tokens].concat())).collect();
    let stats = RunStats {
        drafter: name.into(),
        seconds,
        tokens,
        tokens_per_step: c.mean_accept_len(),
        tokens_per_sd_step: sd_tokens as f64 / sd_seq_rounds.max(1) as f64,
        speedup: 0.0,
        speedup_tail: 0.0,
        buckets,
        by_live,
        speedup_matched: 0.0,
        speedup_tail_matched: 0.0,
        index_s: 0.0,
        index_cost_frac: 0.0,
        arms,
        sd_ceiling,
        draft_s: c.draft_s,
        forward_s: c.forward_s,
        verify_s: c.verify_s,
        commit_s: c.commit_s,
    };
    Ok((stats, samples))
}

/// Teacher-forced p_max at temperature `t` along each sample's response.
fn p_max_along(model: &Llama, samples: &[(usize, Vec<u32>)], t: f32) -> Result<Vec<Vec<f32>>> {
    let params = SamplingParams { temperature: t, top_k: None, top_p: None };
    let mut out = Vec::new();
    for (plen, seq) in samples {
        let mut state = model.new_state();
        let h = model.new_sequence(&mut state);
        let input = TargetInput { seq: h, tokens: seq, tree: None, logits: true };
        let o = Target::forward(model, &mut state, &[input], false)?;
        let mut v = Vec::new();
        for r in plen - 1..seq.len() - 1 {
            let p = tlt_kernels::probs(o.logits_row(0, r)?, &params)?;
            v.push(p.iter().copied().fold(0.0f32, f32::max));
        }
        out.push(v);
    }
    Ok(out)
}

/// Mean over positions of `1 + Σ_{i=1..k} Π_{j<i} p_max(t + j)`.
fn chain_ceiling(pmax: &[Vec<f32>], k: usize) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for v in pmax {
        for t in 0..v.len() {
            let (mut prod, mut e) = (1.0f64, 1.0f64);
            for i in 0..k {
                let Some(&p) = v.get(t + i) else { break };
                prod *= f64::from(p);
                e += prod;
            }
            sum += e;
            n += 1;
        }
    }
    sum / n.max(1) as f64
}

fn percentile(mut v: Vec<usize>, q: f64) -> usize {
    v.sort_unstable();
    v.get(((v.len().saturating_sub(1)) as f64 * q).round() as usize).copied().unwrap_or(0)
}

/// `r`'s throughput ratio to `plain` on plain's running-batch profile, over running batches `<= max_live`
/// (see [`RunStats::speedup_matched`]); 0 when plain has no rounds there.
fn matched_speedup(plain: &RunStats, r: &RunStats, max_live: usize) -> f64 {
    let bucket_ratio = |b: usize| -> f64 {
        let find = |s: &RunStats| s.buckets.iter().find(|x| b >= x.min_batch && b <= x.max_batch).cloned();
        match (find(plain), find(r)) {
            (Some(p), Some(x)) if p.tokens > 0 && x.tokens > 0 => x.tokens_per_s() / p.tokens_per_s(),
            _ => 1.0,
        }
    };
    let (mut t_plain, mut t_run) = (0.0, 0.0);
    for (b, p) in plain.by_live.iter().enumerate().filter(|(b, p)| *b >= 1 && *b <= max_live && p.tokens > 0) {
        let ratio = match r.by_live.get(b) {
            Some(x) if x.rounds >= 3 && x.tokens > 0 => x.tokens_per_s() / p.tokens_per_s(),
            _ => bucket_ratio(b),
        };
        t_plain += p.seconds;
        t_run += p.seconds / ratio;
    }
    if t_run > 0.0 {
        t_plain / t_run
    } else {
        0.0
    }
}

fn tail_throughput(r: &RunStats) -> f64 {
    let (tok, s) =
        r.buckets.iter().filter(|b| b.max_batch <= 4).fold((0u64, 0.0), |a, b| (a.0 + b.tokens, a.1 + b.seconds));
    tok as f64 / s.max(1e-12)
}

/// Runs the suite.
///
/// # Errors
/// On a model, engine or I/O error.
pub fn run(args: &GroupArgs) -> Result<()> {
    let machine = MachineInfo::collect();
    let timestamp = sysinfo::utc_timestamp();
    let plan = parse_plan(&args.plan)?;
    let path = crate::env::smollm2_gguf()?;
    let loaded = tlt_model::load_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let (model, tok) = (loaded.model, loaded.tokenizer.context("the GGUF carries no tokenizer")?);
    let task = builtin("arithmetic", args.seed)?;
    let template = ChatTemplate::chatml();
    let mut prompts = Vec::new();
    for i in 0..args.prompts as u64 {
        let text = template.prompt(None, &task.problem(i)?.prompt)?;
        prompts.push(tlt_model::encode(&tok, &text)?);
    }
    let g = args.group_size;

    // Prefill: shared (one prefill per group, forks) against every sample on its own.
    let params0 = SpecParams { max_new_tokens: args.max_new_tokens, ..SpecParams::default() };
    let mut shared = Engine::new(&model, params0.clone())?;
    for p in &prompts {
        shared.add_group(p, g, args.max_new_tokens)?;
    }
    let mut separate = Engine::new(&model, params0)?;
    for (i, p) in prompts.iter().enumerate() {
        for _ in 0..g {
            separate.add_request_in_group(p, args.max_new_tokens, Some(GroupId(i as u64)))?;
        }
    }
    let (ps, pp) = (shared.counters().prefill_s, separate.counters().prefill_s);
    drop((shared, separate));
    info!(shared = format!("{ps:.2}s"), separate = format!("{pp:.2}s"), "prefill");

    let mut temps = Vec::new();
    for &temperature in &args.temperatures {
        let sampling = SamplingParams { temperature: temperature as f32, top_k: None, top_p: None };
        let params =
            SpecParams { sampling, max_new_tokens: args.max_new_tokens, seed: args.seed, ..SpecParams::default() };
        let (mut plain, samples) = rollout(&model, &prompts, g, &params, "none", How::Plain)?;
        info!(temperature, seconds = format!("{:.1}", plain.seconds), "plain rollout");
        let pmax = p_max_along(&model, &samples, temperature as f32)?;
        let flat: Vec<f32> = pmax.iter().flatten().copied().collect();
        let mean_p_max = flat.iter().map(|&p| f64::from(p)).sum::<f64>() / flat.len().max(1) as f64;
        let ceiling: Vec<(usize, f64)> = [2, 4, 6].iter().map(|&k| (k, chain_ceiling(&pmax, k))).collect();
        let lens: Vec<usize> = samples.iter().map(|(pl, s)| s.len() - pl).collect();
        let length = [percentile(lens.clone(), 0.5), percentile(lens.clone(), 0.9), percentile(lens, 1.0)];

        let mut runs = Vec::new();
        let mut ngram = NgramDrafter::default();
        runs.push(rollout(&model, &prompts, g, &params, "ngram", How::Fixed(&mut ngram, plan))?.0);
        let suffix_cfg = SuffixConfig { min_accept: args.suffix_min_accept, ..SuffixConfig::default() };
        let mut suffix = SuffixDrafter::new(suffix_cfg)?;
        let (mut r, _) = rollout(&model, &prompts, g, &params, "suffix", How::Fixed(&mut suffix, plan))?;
        r.index_s = suffix.stats().seconds;
        runs.push(r);
        // History: an earlier rollout's answers (another seed) to the same prompts seed each group's index.
        let hist_cfg = SuffixConfig { history_per_prompt: g, ..suffix_cfg };
        let mut hist = SuffixDrafter::new(hist_cfg)?;
        let warm = SpecParams { seed: args.seed + 1_000, ..params.clone() };
        rollout(&model, &prompts, g, &warm, "warm", How::Fixed(&mut hist, plan))?;
        hist.reset_stats();
        let (mut r, _) = rollout(&model, &prompts, g, &params, "suffix+history", How::Fixed(&mut hist, plan))?;
        r.index_s = hist.stats().seconds;
        runs.push(r);
        // The same with DAS's length-aware budgets (the history also gives the prompt's answer lengths). With
        // repeats, a second suffix+history drafter that saw the same rollouts is DAS's partner in the pairs below.
        let mut das_pair = None;
        if args.das_horizon > 0 {
            let mut das = SuffixDrafter::new(SuffixConfig { das_horizon: args.das_horizon, ..hist_cfg })?;
            rollout(&model, &prompts, g, &warm, "warm", How::Fixed(&mut das, plan))?;
            das.reset_stats();
            let (mut r, _) = rollout(&model, &prompts, g, &params, "suffix+history+das", How::Fixed(&mut das, plan))?;
            r.index_s = das.stats().seconds;
            runs.push(r);
            if args.repeats > 1 {
                let mut partner = SuffixDrafter::new(hist_cfg)?;
                rollout(&model, &prompts, g, &warm, "warm", How::Fixed(&mut partner, plan))?;
                rollout(&model, &prompts, g, &params, "warm", How::Fixed(&mut partner, plan))?;
                das_pair = Some((partner, das));
            }
        }
        // The adaptive rollout: gate + bandit over {plain, suffix+history, n-gram}; history from the runs above.
        // In training the bandit's estimates carry from one RL step's rollout to the next, so one earlier
        // adaptive rollout (another seed) warms it here, and only the rollout after it is measured.
        let mut mab = cpu_mab();
        mab.drafters = vec!["suffix".into(), "ngram".into()];
        mab.plain_arm = true;
        let mut kinds: Vec<Box<dyn Drafter>> = vec![Box::new(hist), Box::new(NgramDrafter::default())];
        if let Some(dir) = &args.eagle {
            let eagle = || -> Result<EagleProposer> {
                let trainer = DrafterTrainer::resume(dir, &model)
                    .with_context(|| format!("loading the EAGLE drafter from {}", dir.display()))?;
                Ok(EagleProposer::fixed(trainer.runtime(&RuntimeOptions::default())?))
            };
            let mut e = eagle()?;
            runs.push(rollout(&model, &prompts, g, &params, "eagle", How::Fixed(&mut e, plan))?.0);
            let mut h = HybridDrafter::new(SuffixDrafter::new(suffix_cfg)?, eagle()?);
            runs.push(rollout(&model, &prompts, g, &params, "hybrid", How::Fixed(&mut h, plan))?.0);
            mab.drafters.push("hybrid".into());
            kinds.push(Box::new(HybridDrafter::new(SuffixDrafter::new(suffix_cfg)?, eagle()?)));
        }
        let mut decoder = AdaptiveDecoder::new(cpu_gate(), mab)?;
        let mut set = DrafterSet::new(kinds)?;
        let warm = SpecParams { seed: args.seed + 2_000, ..params.clone() };
        rollout(&model, &prompts, g, &warm, "warm", How::Adaptive(&mut set, &mut decoder))?;
        runs.push(rollout(&model, &prompts, g, &params, "adaptive", How::Adaptive(&mut set, &mut decoder))?.0);
        // Interleaved repeats: the pair's speed-ups, whole rollout and <= 4 running (raw throughput).
        let pair = |p: &RunStats, a: &RunStats| {
            let tail = tail_throughput(p);
            let whole = (a.tokens as f64 / a.seconds) / (p.tokens as f64 / p.seconds);
            (whole, if tail > 0.0 { tail_throughput(a) / tail } else { 0.0 })
        };
        let mut adaptive_pairs = runs.last().map(|a| vec![pair(&plain, a)]).unwrap_or_default();
        let mut das_pairs = Vec::new();
        for k in 1..args.repeats.max(1) {
            // Each pair samples new answers (its own seed, shared by both runs of the pair): the drafters' history
            // then holds the previous pair's answers to these prompts, as in training it holds an earlier step's,
            // never the very answers being measured (with one seed it would, and draft them perfectly).
            let params = SpecParams { seed: args.seed + 10_000 * k as u64, ..params.clone() };
            let p = rollout(&model, &prompts, g, &params, "none", How::Plain)?.0;
            let a = rollout(&model, &prompts, g, &params, "adaptive", How::Adaptive(&mut set, &mut decoder))?.0;
            adaptive_pairs.push(pair(&p, &a));
            info!(temperature, pair = ?adaptive_pairs.last(), "repeat");
            if let Some((partner, das)) = das_pair.as_mut() {
                let h = rollout(&model, &prompts, g, &params, "suffix+history", How::Fixed(partner, plan))?.0;
                let d = rollout(&model, &prompts, g, &params, "suffix+history+das", How::Fixed(das, plan))?.0;
                das_pairs.push(h.seconds / d.seconds);
                info!(temperature, das_over_history = das_pairs.last(), "repeat");
            }
        }

        let plain_tput = plain.tokens as f64 / plain.seconds;
        let plain_tail = tail_throughput(&plain);
        // Plain seconds per round at the largest running batches recorded (the full batch).
        let full = plain.buckets.iter().rev().find(|b| b.rounds > 0).map_or(0.0, |b| b.seconds / b.rounds as f64);
        plain.speedup = 1.0;
        plain.speedup_tail = 1.0;
        plain.speedup_matched = 1.0;
        plain.speedup_tail_matched = 1.0;
        for r in &mut runs {
            r.speedup = (r.tokens as f64 / r.seconds) / plain_tput;
            // 0 when the plain run never had a phase of at most 4 running requests.
            r.speedup_tail = if plain_tail > 0.0 { tail_throughput(r) / plain_tail } else { 0.0 };
            r.speedup_matched = matched_speedup(&plain, r, usize::MAX);
            r.speedup_tail_matched = matched_speedup(&plain, r, 4);
            let rounds: u64 = r.buckets.iter().map(|b| b.rounds).sum();
            r.index_cost_frac = if full > 0.0 { r.index_s / rounds.max(1) as f64 / full } else { 0.0 };
            info!(
                temperature,
                drafter = r.drafter,
                tokens_per_step = format!("{:.2}", r.tokens_per_sd_step),
                speedup = format!("{:.2}", r.speedup),
                tail = format!("{:.2}", r.speedup_tail),
                matched = format!("{:.2}", r.speedup_matched),
                tail_matched = format!("{:.2}", r.speedup_tail_matched),
                "run"
            );
        }
        runs.insert(0, plain);
        temps.push(TempReport {
            temperature,
            ceiling,
            mean_p_max,
            length_p50_p90_max: length,
            runs,
            adaptive_pairs,
            das_pairs,
        });
    }
    let report = GroupReport {
        header: Header::new("group", 1, timestamp, machine),
        group_size: g,
        prompts: args.prompts,
        max_new_tokens: args.max_new_tokens,
        plan,
        prefill_shared_s: ps,
        prefill_separate_s: pp,
        prefill_saved_frac: 1.0 - ps / pp.max(1e-12),
        temperatures: temps,
    };
    let md = markdown(&report);
    println!("{md}");
    report::write_outputs("group", &report, &md)
}

fn markdown(r: &GroupReport) -> String {
    let g = r.group_size as f64;
    let mut s = format!(
        "# bench group\n\n{} on {} ({} threads), commit {}\n\n`{}`\n\nG = {}, {} prompts, max_new_tokens {}, fixed plan {}:{}:{}\n\n\
         Prefill: shared {:.3}s vs separate {:.3}s: saved {:.1}% (ideal (G-1)/G = {:.1}%, target >= {:.1}%)\n",
        r.header.timestamp,
        r.header.machine.cpu_model,
        r.header.machine.candle_threads,
        r.header.git_commit,
        r.header.command_line,
        r.group_size,
        r.prompts,
        r.max_new_tokens,
        r.plan.steps,
        r.plan.top_k,
        r.plan.verify_tokens,
        r.prefill_shared_s,
        r.prefill_separate_s,
        100.0 * r.prefill_saved_frac,
        100.0 * (g - 1.0) / g,
        80.0 * (g - 1.0) / g,
    );
    for t in &r.temperatures {
        let ceil: Vec<String> = t.ceiling.iter().map(|(k, v)| format!("k={k}: {v:.2}")).collect();
        s += &format!(
            "\n## T = {}\n\nmean p_max {:.3}; argmax-chain ceiling (tokens/step) {}; response length p50/p90/max {:?}\n\n\
             Speedups are throughput ratios to plain: raw (each run's own length profile) and on plain's \
             running-batch profile (matched; runs sample different completions).\n\n\
             | drafter | tokens/SD step | tokens/step | speedup | speedup (<= 4 running) | matched | matched (<= 4 running) | index cost / decode step | s |\n\
             |---|---|---|---|---|---|---|---|---|\n",
            t.temperature,
            t.mean_p_max,
            ceil.join(", "),
            t.length_p50_p90_max
        );
        for run in &t.runs {
            s += &format!(
                "| {} | {:.2} | {:.2} | {:.2}x | {:.2}x | {:.2}x | {:.2}x | {:.2}% | {:.1} |\n",
                run.drafter,
                run.tokens_per_sd_step,
                run.tokens_per_step,
                run.speedup,
                run.speedup_tail,
                run.speedup_matched,
                run.speedup_tail_matched,
                100.0 * run.index_cost_frac,
                run.seconds
            );
        }
        if t.adaptive_pairs.len() > 1 {
            let (w, tl): (Vec<f64>, Vec<f64>) = t.adaptive_pairs.iter().copied().unzip();
            let show = |v: &[f64]| v.iter().map(|x| format!("{x:.2}x")).collect::<Vec<_>>().join(", ");
            s += &format!(
                "\nAdaptive vs plain over {} interleaved pairs: whole rollout median {:.2}x ({}); <= 4 running median \
                 {:.2}x ({}).\n",
                w.len(),
                crate::report::median(&w),
                show(&w),
                crate::report::median(&tl),
                show(&tl)
            );
        }
        if !t.das_pairs.is_empty() {
            let show = t.das_pairs.iter().map(|x| format!("{x:.2}x")).collect::<Vec<_>>().join(", ");
            s += &format!(
                "\nDAS over suffix+history in {} interleaved pairs (same tokens; seconds ratio): median {:.2}x ({show}).\n",
                t.das_pairs.len(),
                crate::report::median(&t.das_pairs)
            );
        }
        s += "\nBy running batch (tokens/step, tok/s):\n\n| drafter | 1 | 2-4 | 5-8 | 9+ |\n|---|---|---|---|---|\n";
        for run in &t.runs {
            let cells: Vec<String> =
                run.buckets.iter().map(|b| format!("{:.2}, {:.0}", b.tokens_per_step(), b.tokens_per_s())).collect();
            s += &format!("| {} | {} |\n", run.drafter, cells.join(" | "));
        }
        s += "\nSpeculative rounds against the argmax-chain ceiling of the same rounds (depth 2 / 4 / 6):\n\n";
        for run in t.runs.iter().filter(|r| r.sd_ceiling.rounds > 0) {
            let c = &run.sd_ceiling;
            s += &format!(
                "- {}: {:.2} tokens per step over {} request-rounds; ceiling {:.2} / {:.2} / {:.2} ({:.0}% of depth 4)\n",
                run.drafter,
                c.tokens_per_step(),
                c.rounds,
                c.ceiling(0),
                c.ceiling(1),
                c.ceiling(2),
                100.0 * c.tokens_per_step() / c.ceiling(1).max(1e-9)
            );
        }
        s += "\nEngine seconds (draft / target forward / acceptance / commit):\n\n";
        for run in &t.runs {
            s += &format!(
                "- {}: {:.2} / {:.2} / {:.2} / {:.2}\n",
                run.drafter, run.draft_s, run.forward_s, run.verify_s, run.commit_s
            );
        }
        if let Some(a) = t.runs.iter().find(|r| r.drafter == "adaptive") {
            s += &format!("\nAdaptive arms: {:?}\n", a.arms);
        }
    }
    s
}
