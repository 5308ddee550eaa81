//! The report of `bench decode` (`decode.json`, every field documented) and its markdown rendering.

use serde::Serialize;

use crate::report::Header;
use crate::sysinfo::Probe;

/// Median figures of one implementation at one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct ImplResult {
    /// Median prefill time of the whole batch, milliseconds.
    pub prefill_ms: f64,
    /// Median decode time of all steps, seconds.
    pub decode_s: f64,
    /// `batch * new_tokens / decode_s`.
    pub tokens_per_s: f64,
    /// `decode_s / new_tokens`, milliseconds.
    pub ms_per_step: f64,
    /// `weight_bytes_per_step / step time`, GB/s (10^9 B/s).
    pub achieved_gbs: f64,
    /// `achieved_gbs / read_bandwidth_gbs`.
    pub bw_fraction: f64,
    /// Decode seconds of every repeat, in run order.
    pub decode_s_runs: Vec<f64>,
    /// Prefill milliseconds of every repeat, in run order.
    pub prefill_ms_runs: Vec<f64>,
}

/// Everything measured at one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct BatchResult {
    /// Sequences decoded together.
    pub batch: usize,
    /// Runs per implementation.
    pub repeats: usize,
    /// Decode steps per run.
    pub new_tokens: usize,
    /// Bytes of weights one decode step reads (all linear weights and biases, plus the LM head once).
    pub weight_bytes_per_step: u64,
    /// tlt-model.
    pub ours: ImplResult,
    /// candle-transformers' Llama on the same weights.
    pub candle_transformers: ImplResult,
    /// `ours.tokens_per_s / candle_transformers.tokens_per_s`.
    pub ratio_vs_candle_transformers: f64,
}

/// The greedy-agreement check at batch 1.
#[derive(Debug, Clone, Serialize)]
pub struct Sanity {
    /// Greedy tokens compared (the prefill's token plus `check_steps - 1` decode steps).
    pub tokens_compared: usize,
    /// Whether all of them agreed.
    pub tokens_match: bool,
    /// Index of the first disagreeing token, if any.
    pub first_mismatch: Option<usize>,
    /// tlt-model's tokens.
    pub ours: Vec<u32>,
    /// candle-transformers' tokens.
    pub candle_transformers: Vec<u32>,
}

/// The workload.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    /// The GGUF file.
    pub model_path: String,
    /// Parameter count (a tied head counted once).
    pub params: usize,
    /// Compute dtype.
    pub dtype: &'static str,
    /// Tokens per prompt.
    pub prompt_tokens: usize,
    /// Decode steps per run.
    pub new_tokens: usize,
    /// Token choice.
    pub sampling: &'static str,
}

/// Batch-1 throughput of a pair of implementations, side by side.
#[derive(Debug, Clone, Serialize)]
pub struct Pair {
    /// Weight format both read.
    pub weights: &'static str,
    /// Bytes of weights one decode step of ours reads.
    pub weight_bytes_per_step: u64,
    /// tlt-model's tokens per second.
    pub ours_tokens_per_s: f64,
    /// candle-transformers' tokens per second.
    pub candle_tokens_per_s: f64,
    /// `ours_tokens_per_s / candle_tokens_per_s`.
    pub ratio_vs_candle_transformers: f64,
}

/// Batch-1 decode with Q8_0 weights: tlt-model (`pack_for_inference(Q8_0)`) vs candle-transformers' quantized Llama.
#[derive(Debug, Clone, Serialize)]
pub struct Q8Result {
    /// The headline figures.
    #[serde(flatten)]
    pub pair: Pair,
    /// Runs per implementation.
    pub repeats: usize,
    /// Decode steps per run.
    pub new_tokens: usize,
    /// The Q8_0 GGUF candle-transformers loads (re-quantized from the model's GGUF).
    pub candle_gguf: String,
    /// tlt-model's full figures (`bw_fraction` against `weight_bytes_per_step`).
    pub ours: ImplResult,
    /// candle-transformers' full figures (same byte count).
    pub candle_transformers: ImplResult,
    /// Greedy agreement of the two over the first tokens (informative: the weights are quantized separately).
    pub greedy_agreement: Sanity,
}

/// One draft shape of the verification measurement.
#[derive(Debug, Clone, Serialize)]
pub struct TreeTiming {
    /// Parent links of the 8 draft nodes.
    pub parents: Vec<Option<usize>>,
    /// Median time of `verify_tree` plus `commit(seq, &[])`, ms.
    pub verify_ms: f64,
    /// Every repeat's time, ms, in run order.
    pub verify_ms_runs: Vec<f64>,
    /// `verify_ms / decode1_ms`.
    pub verify8_over_decode1: f64,
}

/// Cost of scoring an 8-token draft against one decode step, batch 1, f32, at the same context.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyResult {
    /// Committed tokens before every timed call (the prefill).
    pub context: usize,
    /// Draft nodes per verification.
    pub nodes: usize,
    /// Timed repeats of each measurement (interleaved).
    pub repeats: usize,
    /// Median time of one `decode` step (then truncated back to `context`), ms.
    pub decode1_ms: f64,
    /// Every repeat's decode time, ms, in run order.
    pub decode1_ms_runs: Vec<f64>,
    /// `chain.verify8_over_decode1`.
    pub verify8_over_decode1: f64,
    /// A chain of 8 tokens (`parents = [None, Some(0), ..., Some(6)]`).
    pub chain: TreeTiming,
    /// A branching tree of 8 nodes.
    pub tree: TreeTiming,
}

/// The whole `decode.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Suite, schema version, time, commit, command line and machine.
    #[serde(flatten)]
    pub header: Header,
    /// The workload.
    pub workload: Workload,
    /// Single-thread read bandwidth, GB/s (10^9 B/s).
    pub read_bandwidth_gbs: f64,
    /// How `read_bandwidth_gbs` was measured.
    pub read_bandwidth_probe: Probe,
    /// The greedy-agreement check.
    pub sanity: Sanity,
    /// One entry per batch size.
    pub results: Vec<BatchResult>,
    /// The f32 pair at batch 1 (copied from `results`; `null` without batch 1).
    pub f32_batch1: Option<Pair>,
    /// Batch-1 decode with Q8_0 weights (`null` with `--skip-q8-0`).
    pub q8_0: Option<Q8Result>,
    /// Draft verification against single-token decode at batch 1 (f32).
    pub verify: VerifyResult,
}

/// The markdown summary table.
pub(crate) fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# decode: tlt-model vs candle-transformers (SmolLM2-135M, f32, greedy)\n\n\
         {} prompt tokens, {} new tokens; {} ({} threads); read bandwidth {:.2} GB/s (probe on the model's thread count); \
         weights read per step {:.1} MB; commit {}; {}\n\n\
         | batch | runs | steps | ours tok/s | ours ms/step | ours prefill ms | ours GB/s | ours bw_fraction \
         | candle tok/s | candle ms/step | candle prefill ms | ratio vs candle |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        r.workload.prompt_tokens,
        r.workload.new_tokens,
        r.header.machine.cpu_model,
        r.header.machine.candle_threads,
        r.read_bandwidth_gbs,
        r.results.first().map_or(0.0, |b| b.weight_bytes_per_step as f64 / 1e6),
        r.header.git_commit,
        r.header.timestamp,
    );
    for b in &r.results {
        let (o, c) = (&b.ours, &b.candle_transformers);
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.2} | {:.3} | {:.1} | {:.1} | {:.0} | {:.2} |\n",
            b.batch,
            b.repeats,
            b.new_tokens,
            o.tokens_per_s,
            o.ms_per_step,
            o.prefill_ms,
            o.achieved_gbs,
            o.bw_fraction,
            c.tokens_per_s,
            c.ms_per_step,
            c.prefill_ms,
            b.ratio_vs_candle_transformers
        ));
    }
    let agree = if r.sanity.tokens_match {
        format!("greedy tokens agree with candle-transformers for {} tokens at batch 1", r.sanity.tokens_compared)
    } else {
        format!("greedy tokens DISAGREE with candle-transformers at token {:?}", r.sanity.first_mismatch)
    };
    s.push_str(&format!("\nSanity: {agree}.\n"));
    if let Some(q) = &r.q8_0 {
        let o = &q.ours;
        s.push_str(
            "\n## batch 1, Q8_0 weights (tlt-model packed vs candle-transformers quantized_llama)\n\n\
             | weights | weights read per step MB | ours tok/s | ours ms/step | ours bw_fraction | candle tok/s \
             | candle ms/step | ratio vs candle |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        if let Some(f) = &r.f32_batch1 {
            let b1 = r.results.iter().find(|b| b.batch == 1);
            s.push_str(&format!(
                "| f32 | {:.1} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} | {:.2} |\n",
                f.weight_bytes_per_step as f64 / 1e6,
                f.ours_tokens_per_s,
                b1.map_or(f64::NAN, |b| b.ours.ms_per_step),
                b1.map_or(f64::NAN, |b| b.ours.bw_fraction),
                f.candle_tokens_per_s,
                b1.map_or(f64::NAN, |b| b.candle_transformers.ms_per_step),
                f.ratio_vs_candle_transformers
            ));
        }
        s.push_str(&format!(
            "| q8_0 | {:.1} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} | {:.2} |\n",
            q.pair.weight_bytes_per_step as f64 / 1e6,
            q.pair.ours_tokens_per_s,
            o.ms_per_step,
            o.bw_fraction,
            q.pair.candle_tokens_per_s,
            q.candle_transformers.ms_per_step,
            q.pair.ratio_vs_candle_transformers
        ));
        let g = &q.greedy_agreement;
        s.push_str(&format!(
            "\nQ8_0 greedy agreement over the first {} tokens: {} (informative only; the two quantize separately).\n",
            g.tokens_compared,
            match g.first_mismatch {
                None => "all agree".to_string(),
                Some(i) => format!("first difference at token {i}"),
            }
        ));
    }
    let v = &r.verify;
    s.push_str(&format!(
        "\n## verifying {} draft tokens vs one decode step (batch 1, f32, context {}, median of {})\n\n\
         | draft | ms | ÷ decode step |\n|---|---:|---:|\n| decode 1 token | {:.2} | 1.00 |\n\
         | chain of {} | {:.2} | {:.2} |\n| branching tree {:?} | {:.2} | {:.2} |\n",
        v.nodes,
        v.context,
        v.repeats,
        v.decode1_ms,
        v.nodes,
        v.chain.verify_ms,
        v.chain.verify8_over_decode1,
        v.tree.parents.iter().map(|p| p.map_or(-1, |p| p as i64)).collect::<Vec<_>>(),
        v.tree.verify_ms,
        v.tree.verify8_over_decode1,
    ));
    s
}
