//! Idle ranks training the EAGLE-2 drafter: one of them alone, or two together (data-parallel, each stepping on half
//! the batch and summing gradients with an all-reduce), timed on this machine to choose between them.
//!
//! ```text
//! cargo run --release -p tlt-examples --features mpi --bin drafter-ranks -- --out target/bench/drafter-ranks.json
//! ```
//!
//! It re-launches itself as 2 MPI ranks (one core each here, as `train --ranks 2` runs). Both ranks take SmolLM2's
//! greedy answers to the same prompts (hidden states recorded) and build the same drafter as the trainer's (EAGLE-2
//! over the demo's 1,024-token hot vocabulary, AdamW at 3e-4, 4 samples per step). Then, in interleaved repeats:
//! - **one trainer**: rank 0 takes drafter steps on the whole batch (`DrafterTrainer::step`), rank 1 waits;
//! - **two trainers**: both draw the same batch and step on every other sample of it, their gradients summed by an
//!   all-reduce (`DrafterTrainer::step_with`, as `tlt-rl`'s ranks take the drafter steps owed at an RL step's end);
//! - **all-reduce**: that gradient exchange alone.
//!
//! Medians and the spread of repeats go to `--out`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use serde_json::json;
use tlt_drafter::online::FeatureSample;
use tlt_drafter::{DrafterConfig, DrafterTrainer, Eagle2Drafter, FrozenTarget, TrainConfig};
use tlt_examples::{default_model, ranks};
use tlt_model::optim::LrSchedule;
use tlt_model::Llama;
use tlt_rl::task::ChatTemplate;

/// Prompts whose greedy answers are the training data.
const PROMPTS: [&str; 8] = [
    "Explain the water cycle in simple terms.",
    "What are three interesting facts about honey bees?",
    "Give me five tips for better sleep.",
    "Write a short story about a robot who learns to paint.",
    "What is 17 * 23 - 45? Show your steps.",
    "How does the internet work?",
    "Compute 128 + 256 * 3 step by step.",
    "Compare coffee with tea.",
];

#[derive(Parser, Debug)]
#[command(about = "One idle rank training the EAGLE drafter against two training it together, timed")]
struct Args {
    /// The target (GGUF or Hugging Face directory); default SmolLM2-135M-Instruct from the cache.
    #[arg(long)]
    model: Option<PathBuf>,
    /// New tokens per answer.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Most tokens per drafter step (`trainer.sd.drafter_train.tokens_per_step`; the demo's 1,024).
    #[arg(long, default_value_t = 1024)]
    tokens_per_step: usize,
    /// Drafter steps per arm and repeat.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Interleaved repeats of the arms.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Where the JSON goes (rank 0 writes it).
    #[arg(long, default_value = "target/bench/drafter-ranks.json")]
    out: PathBuf,
}

/// A drafter trainer as the RL trainer builds it: EAGLE-2 from `target`, `samples` samples and `tokens` tokens per
/// step, the demo's learning rate and hot vocabulary.
fn trainer(target: &Llama, hot: &[u32], samples: usize, tokens: usize) -> Result<DrafterTrainer> {
    let cfg = DrafterConfig::eagle2_from_target(target.config(), false);
    let d = Eagle2Drafter::random(cfg, FrozenTarget::new(target), 7)?;
    let train = TrainConfig {
        schedule: LrSchedule::constant(3e-4),
        tokens_per_step: tokens,
        samples_per_step: samples,
        ..TrainConfig::default()
    };
    let mut t = DrafterTrainer::new(d, train)?;
    t.set_hot_vocab(Some(hot))?;
    Ok(t)
}

/// The `k` most frequent answer tokens and the end-of-sequence ids (the trainer's hot vocabulary).
fn hot_vocab(target: &Llama, samples: &[Arc<FeatureSample>], k: usize) -> Vec<u32> {
    let mut counts = vec![0u64; target.config().vocab_size];
    for s in samples {
        for &t in &s.tokens[s.response_start..] {
            if let Some(c) = counts.get_mut(t as usize) {
                *c += 1;
            }
        }
    }
    let mut ids: Vec<u32> = (0..counts.len() as u32).collect();
    ids.sort_by_key(|&i| std::cmp::Reverse(counts[i as usize]));
    ids.truncate(k);
    for e in target.config().eos_ids() {
        if !ids.contains(&e) {
            ids.push(e);
        }
    }
    ids
}

/// Median and (min, max) of `v`.
fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

fn main() -> Result<()> {
    ranks::share_cores();
    tlt_examples::init_logging();
    let args = Args::parse();
    if let Some(status) = ranks::relaunch(2)? {
        std::process::exit(status.code().unwrap_or(1));
    }
    let comm = ranks::communicator(tlt_comm::Deadlines::default())?;
    ensure!(comm.size() == 2, "drafter-ranks runs as 2 ranks, not {}", comm.size());
    let path = args.model.clone().unwrap_or_else(default_model);
    if !path.exists() {
        bail!("model {} not found (run `cargo xtask fetch-assets`, or pass --model)", path.display());
    }
    let loaded = tlt_model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let tok = loaded.tokenizer.with_context(|| format!("{} carries no tokenizer", path.display()))?;
    let chat = ChatTemplate::chatml();
    let prompts =
        PROMPTS.iter().map(|p| Ok(tlt_model::encode(&tok, &chat.prompt(None, p)?)?)).collect::<Result<Vec<_>>>()?;
    let target = loaded.model;
    let samples: Vec<Arc<FeatureSample>> =
        FeatureSample::greedy_rollouts(&target, &prompts, args.new_tokens, 8, |_| {})?
            .into_iter()
            .map(Arc::new)
            .collect();
    let hot = hot_vocab(&target, &samples, 1024);
    let mut one = trainer(&target, &hot, 4, args.tokens_per_step)?;
    let mut two = trainer(&target, &hot, 4, args.tokens_per_step)?;
    let params: usize = two.drafter().vars()?.iter().map(|(_, v)| v.elem_count()).sum();
    let mut grad = vec![0f32; params];
    let rank = comm.rank();
    // This rank's share of the batch both ranks draw (the same: the same trainer state).
    let share = |t: &DrafterTrainer| -> Vec<Arc<FeatureSample>> {
        t.draw(&samples).into_iter().skip(rank).step_by(2).collect()
    };
    // Warm-up: one step of each (allocations, caches).
    let tokens = one.step(&one.draw(&samples))?.eval.batch.tokens;
    two.step_with(&share(&two), |b| comm.all_reduce_sum_f32(b))?;
    comm.all_reduce_sum_f32(&mut grad)?;

    let (mut one_s, mut two_s, mut reduce_s) = (vec![], vec![], vec![]);
    let per_step = |t: Instant| t.elapsed().as_secs_f64() / args.steps as f64;
    for _ in 0..args.repeats {
        comm.barrier()?;
        let t = Instant::now();
        if comm.rank() == 0 {
            for _ in 0..args.steps {
                one.step(&one.draw(&samples))?;
            }
        }
        comm.barrier()?;
        one_s.push(per_step(t));
        let t = Instant::now();
        for _ in 0..args.steps {
            two.step_with(&share(&two), |b| comm.all_reduce_sum_f32(b))?;
        }
        comm.barrier()?;
        two_s.push(per_step(t));
        let t = Instant::now();
        for _ in 0..args.steps {
            comm.all_reduce_sum_f32(&mut grad)?;
        }
        comm.barrier()?;
        reduce_s.push(per_step(t));
    }
    if comm.rank() != 0 {
        return Ok(());
    }
    let (one_m, two_m, red_m) = (stats(&one_s), stats(&two_s), stats(&reduce_s));
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_default();
    println!("drafter steps on 2 ranks ({cpu}, {threads} thread(s) per rank): {params} trainable weights ({:.1} MB of f32 gradient)", params as f64 * 4e-6);
    println!("| arm | s per step of 4 samples, {tokens} tokens (median) | min | max |");
    println!("|---|---|---|---|");
    for (name, (m, lo, hi)) in [
        ("one trainer", one_m),
        ("two trainers (every other sample each, gradients all-reduced)", two_m),
        ("all-reduce alone", red_m),
    ] {
        println!("| {name} | {m:.4} | {lo:.4} | {hi:.4} |");
    }
    let ratios: Vec<f64> = one_s.iter().zip(&two_s).map(|(a, b)| a / b).collect();
    let (r, rlo, rhi) = stats(&ratios);
    println!("two trainers are {r:.2}x as fast as one per step (repeats: {rlo:.2}x to {rhi:.2}x)");
    let report = json!({
        "cpu": cpu, "ranks": 2, "threads_per_rank": threads, "trainable_weights": params,
        "tokens_per_step": args.tokens_per_step, "batch_tokens": tokens, "steps_per_arm": args.steps, "repeats": args.repeats,
        "one_trainer_s": one_s, "two_trainers_s": two_s, "all_reduce_s": reduce_s,
        "median_s": { "one_trainer": one_m.0, "two_trainers": two_m.0, "all_reduce": red_m.0 },
        "speedup_two_over_one": ratios,
    });
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_vec_pretty(&report)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
