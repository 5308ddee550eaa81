//! `cargo xtask bench decode`: batched greedy decode of SmolLM2-135M (f32), tlt-model against candle-transformers'
//! Llama on the same weights, side by side in one run. Writes `target/bench/decode.json` and `decode.md`.
//!
//! Per batch size `b`: `b` distinct prompts of exactly `prompt_tokens` tokens are prefilled (timed separately),
//! then `new_tokens` decode steps run over the whole batch, each feeding every sequence its greedy token. Both
//! implementations repeat this `repeats` times, alternating which goes first; medians are reported.
//!
//! Besides: the cost of verifying an 8-token draft (chain and branching tree) against one decode step at batch 1,
//! and batch-1 decode with Q8_0 weights (tlt-model's packed inference weights against candle-transformers'
//! quantized Llama on a Q8_0 GGUF).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{Tensor, D};
use indicatif::{ProgressBar, ProgressState, ProgressStyle};
use tlt_model::{KvCache, Llama, LogitsFor, SeqId, SeqInput, WeightDType};
use tracing::{info, warn};

use crate::bench_decode_md::{
    BatchResult, ImplResult, Pair, Q8Result, Report, Sanity, TreeTiming, VerifyResult, Workload,
};
use crate::candle_ref::{requant_path, requantize_gguf, CandleLlama, CandleQuantLlama};
use crate::report::{self, median, Header};
use crate::sysinfo::{self, MachineInfo, Probe};

/// Draft tokens a verification scores.
const VERIFY_NODES: usize = 8;
/// The branching draft tree of the verification measurement (parent links, 8 nodes, depth 4).
const BRANCHING_TREE: [Option<usize>; VERIFY_NODES] =
    [None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(3), Some(4)];
/// Greedy tokens compared between the two Q8_0 implementations.
const Q8_CHECK_TOKENS: usize = 8;

/// Options of `cargo xtask bench decode`.
#[derive(Debug, Clone, clap::Args)]
pub struct DecodeArgs {
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    batches: Vec<usize>,
    /// Decode steps per run (tokens generated per sequence after the prefill).
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Prompt length in tokens (every prompt has exactly this many).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Runs per implementation and batch size; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Batch sizes at least this large run once per implementation, whatever `--repeats` says. This keeps the
    /// default suite under ten minutes on a 2-vCPU machine: there one batch-64 run (a prefill of 8192 tokens plus
    /// 128 steps of 64 rows) takes minutes per implementation, and 3 runs at batch 4 already pushed the suite to
    /// 9m52s. Raise it to repeat larger batches too.
    #[arg(long, default_value_t = 4)]
    single_run_from: usize,
    /// Batch sizes at least this large decode `--large-batch-new-tokens` steps instead of `--new-tokens`.
    #[arg(long, default_value_t = 64)]
    large_batch_from: usize,
    /// Decode steps per run for batch sizes of at least `--large-batch-from` (at most `--new-tokens`).
    #[arg(long, default_value_t = 32)]
    large_batch_new_tokens: usize,
    /// Timed repeats of the draft-verification measurement (at least 10).
    #[arg(long, default_value_t = 10)]
    verify_repeats: usize,
    /// Skip the batch-1 Q8_0 comparison (and building its GGUF).
    #[arg(long)]
    skip_q8_0: bool,
    /// Decode steps whose greedy tokens must agree between the two implementations at batch 1.
    #[arg(long, default_value_t = 16)]
    check_steps: usize,
    /// Size of the read-bandwidth probe buffer in MiB (at least 512).
    #[arg(long, default_value_t = 512)]
    probe_mib: usize,
    /// The GGUF to load (default: the cached SmolLM2-135M-Instruct, fetched if missing).
    #[arg(long)]
    model: Option<PathBuf>,
    /// `cpu` (this suite), or `cuda[:N]`: the GPU suite instead (`gpu-bench` per architecture of `--gpu-archs`:
    /// batch 1-256 decode with and without CUDA graphs against the measured copy bandwidth, verify-k, oracle SD).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Architectures of the GPU suite (synthetic bf16 weights of their published shapes).
    #[arg(long, value_delimiter = ',', default_value = "smollm2-135m,qwen2.5-1.5b,llama3-8b")]
    gpu_archs: Vec<String>,
}

/// Fixed English text the prompts are cut from.
const PROMPT_TEXT: &str = "The history of computing is a story of ideas that took a long time to become practical. \
Long before electronic machines existed, people built mechanical aids for arithmetic: the abacus, Napier's bones, \
the slide rule, and the calculating engines of Pascal and Leibniz. In the nineteenth century Charles Babbage designed \
a programmable analytical engine, and Ada Lovelace wrote what many consider the first published algorithm intended \
for a machine. The twentieth century brought relays, vacuum tubes, transistors and finally integrated circuits, each \
step making machines smaller, faster and cheaper. Alan Turing described a universal machine that could simulate any \
other, and John von Neumann popularized the stored-program design in which instructions and data share one memory. \
Programming languages grew from raw machine code to assembly, then to FORTRAN, COBOL, Lisp and C, and later to the \
many languages used today. Operating systems learned to share one processor among many programs, networks connected \
machines across campuses and then across the world, and the personal computer put this power on ordinary desks. \
Each generation of hardware made new software possible, and each generation of software demanded more hardware.";

/// One timed run of one implementation.
pub(crate) struct Run {
    prefill: Duration,
    decode: Duration,
    /// Greedy tokens of sequence 0: the one from the prefill, then one per decode step.
    tokens0: Vec<u32>,
}

/// Greedy token of every row of `[rows, vocab]` logits.
fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}

/// `n` distinct prompts of exactly `len` tokens: `"Passage {i}. "` followed by the fixed text, cut to `len`.
pub(crate) fn make_prompts(tokenizer: &tokenizers::Tokenizer, n: usize, len: usize) -> Result<Vec<Vec<u32>>> {
    (0..n)
        .map(|i| {
            let mut ids = tlt_model::encode(tokenizer, &format!("Passage {i}. {PROMPT_TEXT}"))?;
            if ids.len() < len {
                bail!("the prompt text has {} tokens, fewer than --prompt-tokens {len}", ids.len());
            }
            ids.truncate(len);
            Ok(ids)
        })
        .collect()
}

/// tlt-model: one batched prefill, then `steps` batched decode steps.
pub(crate) fn run_ours(model: &Llama, prompts: &[Vec<u32>], steps: usize, bar: &ProgressBar) -> Result<Run> {
    let mut cache = model.new_cache();
    let seqs: Vec<_> = prompts.iter().map(|_| cache.add_sequence()).collect();
    let inputs: Vec<SeqInput> = seqs
        .iter()
        .zip(prompts)
        .map(|(&seq, p)| SeqInput { seq, tokens: p, tree: None, logits: LogitsFor::Last })
        .collect();
    let t = Instant::now();
    let mut next = argmax_rows(&model.forward(&mut cache, &inputs, &[])?.logits)?;
    let prefill = t.elapsed();
    let mut tokens0 = vec![next[0]];
    let t = Instant::now();
    for _ in 0..steps {
        let batch: Vec<_> = seqs.iter().copied().zip(next.iter().copied()).collect();
        next = argmax_rows(&model.decode(&mut cache, &batch)?)?;
        tokens0.push(next[0]);
        bar.inc(1);
    }
    Ok(Run { prefill, decode: t.elapsed(), tokens0 })
}

/// candle-transformers: one `[b, len]` prefill, then `steps` `[b, 1]` steps with a shared KV cache.
fn run_candle(model: &CandleLlama, prompts: &[Vec<u32>], steps: usize, bar: &ProgressBar) -> Result<Run> {
    let b = prompts.len();
    let len = prompts.first().map_or(0, Vec::len);
    let flat: Vec<u32> = prompts.concat();
    let mut cache = model.new_cache()?;
    let t = Instant::now();
    let mut next = argmax_rows(&model.forward(&mut cache, &flat, b, 0)?)?;
    let prefill = t.elapsed();
    let mut tokens0 = vec![next[0]];
    let t = Instant::now();
    for step in 0..steps {
        next = argmax_rows(&model.forward(&mut cache, &next, b, len + step)?)?;
        tokens0.push(next[0]);
        bar.inc(1);
    }
    Ok(Run { prefill, decode: t.elapsed(), tokens0 })
}

/// candle-transformers' quantized Llama at batch 1: a `[1, len]` prefill, then `steps` `[1, 1]` steps.
fn run_candle_quant(model: &mut CandleQuantLlama, prompt: &[u32], steps: usize, bar: &ProgressBar) -> Result<Run> {
    model.reset();
    let t = Instant::now();
    let mut next = argmax_rows(&model.forward(prompt, 0)?)?;
    let prefill = t.elapsed();
    let mut tokens0 = vec![next[0]];
    let t = Instant::now();
    for step in 0..steps {
        next = argmax_rows(&model.forward(&next[..1], prompt.len() + step)?)?;
        tokens0.push(next[0]);
        bar.inc(1);
    }
    Ok(Run { prefill, decode: t.elapsed(), tokens0 })
}

/// One `decode` step of `seq` (at its committed length `ctx`), then truncated back to `ctx`; returns ms.
fn time_decode1(model: &Llama, cache: &mut KvCache, seq: SeqId, ctx: usize, token: u32) -> Result<f64> {
    let t = Instant::now();
    std::hint::black_box(model.decode(cache, &[(seq, token)])?);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    cache.truncate(seq, ctx)?;
    Ok(ms)
}

/// `verify_tree` of `tokens` with `parents`, then `commit(seq, &[])` (discarding the tree); returns ms.
fn time_verify(
    model: &Llama,
    cache: &mut KvCache,
    seq: SeqId,
    tokens: &[u32],
    parents: &[Option<usize>],
) -> Result<f64> {
    let t = Instant::now();
    std::hint::black_box(model.verify_tree(cache, seq, tokens, parents)?);
    cache.commit(seq, &[])?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// After prefilling `prompt`, times one decode step, an 8-token chain and an 8-node branching tree, interleaved
/// (rotating the order each repeat), at the same committed context.
fn measure_verify(model: &Llama, prompt: &[u32], draft: &[u32], repeats: usize) -> Result<VerifyResult> {
    let chain: Vec<Option<usize>> = (0..VERIFY_NODES).map(|i| i.checked_sub(1)).collect();
    let tree = BRANCHING_TREE.to_vec();
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    model.prefill(&mut cache, seq, prompt)?;
    let ctx = prompt.len();
    // Warm-up, not timed.
    time_decode1(model, &mut cache, seq, ctx, draft[0])?;
    time_verify(model, &mut cache, seq, draft, &chain)?;
    time_verify(model, &mut cache, seq, draft, &tree)?;
    let (mut dec, mut ch, mut tr) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..repeats {
        for what in 0..3 {
            match (what + r) % 3 {
                0 => dec.push(time_decode1(model, &mut cache, seq, ctx, draft[0])?),
                1 => ch.push(time_verify(model, &mut cache, seq, draft, &chain)?),
                _ => tr.push(time_verify(model, &mut cache, seq, draft, &tree)?),
            }
        }
    }
    let decode1_ms = median(&dec);
    let timing = |parents: Vec<Option<usize>>, runs: Vec<f64>| {
        let verify_ms = median(&runs);
        TreeTiming { parents, verify_ms, verify_ms_runs: runs, verify8_over_decode1: verify_ms / decode1_ms }
    };
    let chain = timing(chain, ch);
    let tree = timing(tree, tr);
    info!(
        decode1_ms = format!("{decode1_ms:.2}"),
        chain_ms = format!("{:.2}", chain.verify_ms),
        tree_ms = format!("{:.2}", tree.verify_ms),
        chain_ratio = format!("{:.2}", chain.verify8_over_decode1),
        tree_ratio = format!("{:.2}", tree.verify8_over_decode1),
        "verify 8 vs decode 1"
    );
    Ok(VerifyResult {
        context: ctx,
        nodes: VERIFY_NODES,
        repeats,
        decode1_ms,
        decode1_ms_runs: dec,
        verify8_over_decode1: chain.verify8_over_decode1,
        chain,
        tree,
    })
}

pub(crate) fn summarize(runs: &[Run], batch: usize, steps: usize, bytes: u64, bw_gbs: f64) -> ImplResult {
    let decode_s_runs: Vec<f64> = runs.iter().map(|r| r.decode.as_secs_f64()).collect();
    let prefill_ms_runs: Vec<f64> = runs.iter().map(|r| r.prefill.as_secs_f64() * 1e3).collect();
    let decode_s = median(&decode_s_runs);
    let step_s = decode_s / steps as f64;
    let achieved_gbs = bytes as f64 / step_s / 1e9;
    ImplResult {
        prefill_ms: median(&prefill_ms_runs),
        decode_s,
        tokens_per_s: (batch * steps) as f64 / decode_s,
        ms_per_step: step_s * 1e3,
        achieved_gbs,
        bw_fraction: achieved_gbs / bw_gbs,
        decode_s_runs,
        prefill_ms_runs,
    }
}

/// Runs the suite and writes `target/bench/decode.{json,md}`.
pub fn run(args: &DecodeArgs) -> Result<()> {
    if crate::bench_gpu::is_cuda(&args.device)? {
        let archs: Vec<&str> = args.gpu_archs.iter().map(String::as_str).collect();
        return crate::bench_gpu::run(&args.device, &archs, &[]);
    }
    if args.batches.is_empty() || args.batches.contains(&0) {
        bail!("--batches must list positive batch sizes");
    }
    if args.new_tokens == 0 || args.prompt_tokens == 0 || args.repeats == 0 {
        bail!("--new-tokens, --prompt-tokens and --repeats must be positive");
    }
    let timestamp = sysinfo::utc_timestamp();
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::env::smollm2_gguf()?,
    };
    let loaded = tlt_model::load_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let model = loaded.model;
    let tokenizer = loaded.tokenizer.with_context(|| format!("{} carries no tokenizer", path.display()))?;
    if args.prompt_tokens + args.new_tokens + 1 > model.config().max_position_embeddings {
        bail!("prompt + new tokens exceed the model's context");
    }
    if args.verify_repeats < 10 {
        bail!("--verify-repeats must be at least 10");
    }
    let reference = CandleLlama::from_model(&model).context("building candle-transformers' Llama")?;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let prompts = make_prompts(&tokenizer, max_batch, args.prompt_tokens)?;
    let draft: Vec<u32> =
        make_prompts(&tokenizer, 1, args.prompt_tokens + VERIFY_NODES)?[0][args.prompt_tokens..].to_vec();
    let bytes = model.weight_bytes_per_token() as u64;
    let machine = MachineInfo::collect();
    info!(model = %path.display(), params = model.weights().num_params(), weight_bytes_per_step = bytes,
          threads = machine.candle_threads, "decode benchmark");

    // The model's GEMMs run on all cores (tlt_kernels::default_threads); probe with the same count.
    let probe_threads = tlt_kernels::default_threads();
    info!(mib = args.probe_mib.max(512), threads = probe_threads, "probing read bandwidth");
    let (bw_gbs, probe) = Probe::run(args.probe_mib, probe_threads);
    info!(gb_per_s = format!("{bw_gbs:.2}"), "read bandwidth");

    let sanity = check_agreement(&model, &reference, &prompts[0], args.check_steps)?;

    info!(context = args.prompt_tokens, repeats = args.verify_repeats, "timing verification of 8 draft tokens");
    let verify = measure_verify(&model, &prompts[0], &draft, args.verify_repeats)?;

    // Q8_0: our packed inference weights on a clone (sharing the f32 tensors), candle's quantized Llama on a GGUF.
    let q8 = if args.skip_q8_0 {
        None
    } else {
        let mut ours = model.clone();
        ours.pack_for_inference(WeightDType::Q8_0)?;
        let gguf = requant_path(&path, "q8_0")?;
        if !gguf.exists() {
            info!(from = %path.display(), to = %gguf.display(), "writing a Q8_0 GGUF for candle-transformers");
        }
        requantize_gguf(&path, &gguf, GgmlDType::Q8_0)?;
        let theirs = CandleQuantLlama::load(&gguf).context("loading candle-transformers' quantized Llama")?;
        Some((ours, theirs, gguf))
    };

    let repeats_for = |b: usize| if b >= args.single_run_from { 1 } else { args.repeats };
    let steps_for = |b: usize| {
        if b >= args.large_batch_from {
            args.large_batch_new_tokens.clamp(1, args.new_tokens)
        } else {
            args.new_tokens
        }
    };
    let q8_steps = if q8.is_some() { 2 * args.repeats * args.new_tokens } else { 0 };
    let total: usize = args.batches.iter().map(|&b| 2 * repeats_for(b) * steps_for(b)).sum::<usize>() + q8_steps;
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps ({rate}) {msg}")?
            .with_key("rate", |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                // The average since the start: prefills make the instantaneous rate swing wildly.
                let _ = write!(w, "{:.2} steps/s", s.pos() as f64 / s.elapsed().as_secs_f64().max(1e-9));
            }),
    );
    let mut results = Vec::new();
    for &b in &args.batches {
        let batch_prompts = &prompts[..b];
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        let repeats = repeats_for(b);
        let steps = steps_for(b);
        for r in 0..repeats {
            // Alternate the order so drift (thermal, page cache) does not favour one side.
            for ours_turn in if r % 2 == 0 { [true, false] } else { [false, true] } {
                let who = if ours_turn { "tlt-model" } else { "candle-transformers" };
                bar.set_message(format!("batch {b}, {who}, run {}/{repeats}", r + 1));
                if ours_turn {
                    ours.push(run_ours(&model, batch_prompts, steps, &bar)?);
                } else {
                    theirs.push(run_candle(&reference, batch_prompts, steps, &bar)?);
                }
            }
        }
        let ours = summarize(&ours, b, steps, bytes, bw_gbs);
        let theirs = summarize(&theirs, b, steps, bytes, bw_gbs);
        // `println` on a hidden bar (stderr not a terminal) prints nothing; log above the bar instead.
        bar.suspend(|| {
            info!(
                batch = b,
                ours_tok_s = format!("{:.1}", ours.tokens_per_s),
                candle_tok_s = format!("{:.1}", theirs.tokens_per_s),
                ratio = format!("{:.2}", ours.tokens_per_s / theirs.tokens_per_s),
                "batch done"
            )
        });
        results.push(BatchResult {
            batch: b,
            repeats,
            new_tokens: steps,
            weight_bytes_per_step: bytes,
            ratio_vs_candle_transformers: ours.tokens_per_s / theirs.tokens_per_s,
            ours,
            candle_transformers: theirs,
        });
    }

    let q8_0 = match q8 {
        None => None,
        Some((ours_model, mut theirs_model, gguf)) => {
            let q8_bytes = ours_model.weight_bytes_per_token() as u64;
            let prompt = &prompts[0];
            let hidden = ProgressBar::hidden();
            let ours_tokens =
                run_ours(&ours_model, std::slice::from_ref(prompt), Q8_CHECK_TOKENS - 1, &hidden)?.tokens0;
            let theirs_tokens = run_candle_quant(&mut theirs_model, prompt, Q8_CHECK_TOKENS - 1, &hidden)?.tokens0;
            let greedy_agreement = agreement(ours_tokens, theirs_tokens);
            if !greedy_agreement.tokens_match {
                bar.suspend(|| {
                    info!(index = ?greedy_agreement.first_mismatch, "Q8_0 greedy tokens differ from candle-transformers' (separately quantized weights)")
                });
            }
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for r in 0..args.repeats {
                for ours_turn in if r % 2 == 0 { [true, false] } else { [false, true] } {
                    let who = if ours_turn { "tlt-model" } else { "candle-transformers" };
                    bar.set_message(format!("batch 1 Q8_0, {who}, run {}/{}", r + 1, args.repeats));
                    if ours_turn {
                        ours.push(run_ours(&ours_model, std::slice::from_ref(prompt), args.new_tokens, &bar)?);
                    } else {
                        theirs.push(run_candle_quant(&mut theirs_model, prompt, args.new_tokens, &bar)?);
                    }
                }
            }
            let ours = summarize(&ours, 1, args.new_tokens, q8_bytes, bw_gbs);
            let theirs = summarize(&theirs, 1, args.new_tokens, q8_bytes, bw_gbs);
            bar.suspend(|| {
                info!(
                    ours_tok_s = format!("{:.1}", ours.tokens_per_s),
                    candle_tok_s = format!("{:.1}", theirs.tokens_per_s),
                    ratio = format!("{:.2}", ours.tokens_per_s / theirs.tokens_per_s),
                    "batch 1 Q8_0 done"
                )
            });
            Some(Q8Result {
                pair: Pair {
                    weights: "q8_0",
                    weight_bytes_per_step: q8_bytes,
                    ours_tokens_per_s: ours.tokens_per_s,
                    candle_tokens_per_s: theirs.tokens_per_s,
                    ratio_vs_candle_transformers: ours.tokens_per_s / theirs.tokens_per_s,
                },
                repeats: args.repeats,
                new_tokens: args.new_tokens,
                candle_gguf: gguf.display().to_string(),
                ours,
                candle_transformers: theirs,
                greedy_agreement,
            })
        }
    };
    bar.finish_and_clear();

    let f32_batch1 = results.iter().find(|b| b.batch == 1).map(|b| Pair {
        weights: "f32",
        weight_bytes_per_step: b.weight_bytes_per_step,
        ours_tokens_per_s: b.ours.tokens_per_s,
        candle_tokens_per_s: b.candle_transformers.tokens_per_s,
        ratio_vs_candle_transformers: b.ratio_vs_candle_transformers,
    });
    let report = Report {
        header: Header::new("decode", 2, timestamp, machine),
        workload: Workload {
            model_path: path.display().to_string(),
            params: model.weights().num_params(),
            dtype: "f32",
            prompt_tokens: args.prompt_tokens,
            new_tokens: args.new_tokens,
            sampling: "greedy",
        },
        read_bandwidth_gbs: bw_gbs,
        read_bandwidth_probe: probe,
        sanity,
        results,
        f32_batch1,
        q8_0,
        verify,
    };
    let table = crate::bench_decode_md::markdown(&report);
    report::write_outputs("decode", &report, &table)?;
    println!("{table}");
    Ok(())
}

/// Greedy tokens of both implementations on one prompt must agree for `steps` tokens.
fn check_agreement(model: &Llama, reference: &CandleLlama, prompt: &[u32], steps: usize) -> Result<Sanity> {
    let steps = steps.max(1);
    let hidden = ProgressBar::hidden();
    let prompts = [prompt.to_vec()];
    let ours = run_ours(model, &prompts, steps - 1, &hidden)?.tokens0;
    let theirs = run_candle(reference, &prompts, steps - 1, &hidden)?.tokens0;
    let sanity = agreement(ours, theirs);
    match sanity.first_mismatch {
        None => info!(tokens = steps, "greedy tokens agree with candle-transformers at batch 1"),
        Some(i) => warn!(
            index = i,
            ours = sanity.ours[i],
            candle_transformers = sanity.candle_transformers[i],
            "greedy tokens DISAGREE with candle-transformers at batch 1"
        ),
    }
    Ok(sanity)
}

/// Compares two greedy token streams.
fn agreement(ours: Vec<u32>, theirs: Vec<u32>) -> Sanity {
    let first_mismatch = ours.iter().zip(&theirs).position(|(a, b)| a != b);
    Sanity {
        tokens_compared: ours.len().min(theirs.len()),
        tokens_match: first_mismatch.is_none(),
        first_mismatch,
        ours,
        candle_transformers: theirs,
    }
}
