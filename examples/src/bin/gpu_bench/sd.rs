//! The engine's speculative decoding on the device (`CudaTarget`, verification on the device): plain decoding, a
//! perfect oracle drafter at several tokens per round, and an EAGLE-2 drafter whose levels run on the device
//! (`CudaDrafter`), at several batch sizes; and one EAGLE-2 draft level timed alone.

use std::time::Instant;

use anyhow::{Context, Result};
use tlt_drafter::cuda::{CudaDraftOptions, CudaDrafter, DeviceDraftCache};
use tlt_drafter::online::WeightsSlot;
use tlt_drafter::{
    Attend, DraftExecutor, DraftRuntime, DrafterConfig, Eagle2Drafter, EagleProposer, FrozenTarget, Row, RuntimeOptions,
};
use tlt_kernels::cuda::{SharedGpu, MAX_TREE_NODES};
use tlt_model::LlamaConfig;
use tlt_spec_decode::cuda::CudaTarget;
use tlt_spec_decode::{Corruption, Counters, Drafter, Engine, OracleDrafter, Plan, RequestId, SpecParams};

use crate::args::Args;
use crate::timing::median;

/// One run of the engine: decode-phase seconds (prefill excluded), every request's tokens (request order) and the
/// counters.
struct Run {
    secs: f64,
    tokens: Vec<Vec<u32>>,
    counters: Counters,
}

/// `batch` prompts of `context` tokens each (distinct per request).
fn prompts(cfg: &LlamaConfig, batch: usize, context: usize) -> Vec<Vec<u32>> {
    (0..batch as u32)
        .map(|b| (0..context as u32).map(|i| (i * 7919 + 13 + b * 104_729) % cfg.vocab_size as u32).collect())
        .collect()
}

/// Greedy decoding of `prompts` (`n` tokens each) through the engine on `target`, with `drafter` under `plan` (or
/// plainly).
fn engine_run(
    target: &CudaTarget,
    prompts: &[Vec<u32>],
    n: usize,
    drafter: Option<(&mut dyn Drafter, Plan)>,
    record_hidden: bool,
) -> Result<Run> {
    let params = SpecParams { stop_token_ids: Some(Vec::new()), ..SpecParams::greedy(n) };
    let mut engine = Engine::new(target, params)?;
    engine.record_hidden(record_hidden);
    // The prompts are prefilled as they are added: the clock starts before, and the prefill's time is taken out.
    // (Until 2026-11-27 the clock started after them and the prefill was subtracted once more, understating the
    // decode phase by one prefill: about 1% of the first GPU run's batch-1 figures.)
    let t0 = Instant::now();
    let ids: Vec<RequestId> = prompts.iter().map(|p| engine.add_request(p)).collect::<tlt_spec_decode::Result<_>>()?;
    match drafter {
        Some((d, plan)) => engine.run_to_completion(Some(d), &plan)?,
        None => engine.run_to_completion(None, &Plan::chain(1))?,
    }
    let secs = t0.elapsed().as_secs_f64() - engine.counters().prefill_s;
    let mut done = engine.take_finished();
    done.sort_by_key(|f| f.id);
    anyhow::ensure!(done.iter().map(|f| f.id).eq(ids.iter().copied()), "not every request finished");
    Ok(Run { secs, tokens: done.into_iter().map(|f| f.tokens).collect(), counters: *engine.counters() })
}

/// Median of three runs (the last one's tokens and counters).
fn timed(mut once: impl FnMut() -> Result<Run>) -> Result<Run> {
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..3 {
        let r = once()?;
        times.push(r.secs);
        last = Some(r);
    }
    let mut r = last.context("no run")?;
    r.secs = median(times);
    Ok(r)
}

/// A JSON row and a markdown line of one SD measurement against plain decoding.
fn row(
    batch: usize,
    drafter: &str,
    r: &Run,
    plain: &Run,
    tokens: usize,
    extra: serde_json::Value,
) -> serde_json::Value {
    let same = r.tokens == plain.tokens;
    println!(
        "| {batch} | {drafter} | {:.2} | {:.3} | {:.2}x | {same} |",
        r.counters.mean_accept_len(),
        r.secs * 1e3 / tokens as f64,
        plain.secs / r.secs
    );
    let mut v = serde_json::json!({
        "batch": batch, "drafter": drafter, "tokens_per_round": r.counters.mean_accept_len(), "decode_s": r.secs,
        "speedup": plain.secs / r.secs, "identical_to_plain": same,
    });
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    v
}

/// Plain decoding, then a perfect oracle drafting `tau - 1` tokens per round, at each batch of `a.sd_batches`: the
/// speed-up over plain and whether the tokens equal plain decoding's (`identical_to_plain`: the decode and verify
/// shapes run batch-invariant kernels, so greedy SD commits plain decoding's tokens exactly).
pub fn oracle(target: &CudaTarget, cfg: &LlamaConfig, a: &Args) -> Result<Vec<serde_json::Value>> {
    println!(
        "\nengine on the device, {} tokens per request after a {}-token prompt (decode phase):",
        a.sd_tokens, a.context
    );
    println!(
        "| batch | drafter | tokens/round | ms/step | speed-up over plain | identical |\n|---:|---|---:|---:|---:|---|"
    );
    let mut rows = Vec::new();
    for &batch in &a.sd_batches {
        let ps = prompts(cfg, batch, a.context);
        let plain = timed(|| engine_run(target, &ps, a.sd_tokens, None, false))?;
        println!("| {batch} | none (plain) | 1.00 | {:.3} | 1.00x | - |", plain.secs * 1e3 / a.sd_tokens as f64);
        rows.push(serde_json::json!({"batch": batch, "drafter": "none", "decode_s": plain.secs, "speedup": 1.0}));
        for &tau in &a.tau {
            let steps = tau.saturating_sub(1).max(1);
            let plan = Plan { steps, top_k: 1, verify_tokens: steps + 1 };
            let run = |reference: &[Vec<u32>]| {
                let mut oracle = OracleDrafter::new(cfg.vocab_size, Corruption::Rate { rate: 0.0, seed: 0 }, false)?;
                for (i, r) in reference.iter().enumerate() {
                    oracle.insert(RequestId(i), a.context, r.clone());
                }
                engine_run(target, &ps, a.sd_tokens, Some((&mut oracle, plan)), false)
            };
            // The oracle drafts plain decoding's own tokens: with batch-invariant decode and verify kernels the
            // verify shape commits exactly them, so every round accepts all its drafts and `identical_to_plain`
            // compares bits, with no allowance for near ties.
            let r = timed(|| run(&plain.tokens))?;
            let extra = serde_json::json!({"tau": tau});
            rows.push(row(batch, &format!("oracle, {steps} drafts"), &r, &plain, a.sd_tokens, extra));
        }
    }
    Ok(rows)
}

/// An EAGLE-2 drafter of `cfg`'s shape (random weights: its acceptance is near zero on synthetic targets, so this
/// measures the drafting overhead and losslessness, not a speed-up).
pub fn eagle2_runtime(cfg: &LlamaConfig) -> Result<DraftRuntime> {
    // The target's embedding and head at this shape (one layer: the drafter reads only those).
    let target = tlt_model::Llama::random(LlamaConfig { num_hidden_layers: 1, ..cfg.clone() }, 7)?;
    let d = Eagle2Drafter::random(
        DrafterConfig::eagle2_from_target(target.config(), false),
        FrozenTarget::new(&target),
        8,
    )?;
    let f32s = tlt_kernels::WeightDType::F32;
    Ok(DraftRuntime::eagle2(&d, &RuntimeOptions { layer_dtype: f32s, head_dtype: f32s, hot_vocab: None })?)
}

/// Plain decoding against SD with an EAGLE-2 drafter whose levels run on the device (`CudaDrafter` on the target's
/// device and stream), at each batch of `a.sd_batches`: the tokens must be plain decoding's.
pub fn eagle(
    gpu: &SharedGpu,
    target: &CudaTarget,
    rt: &DraftRuntime,
    cfg: &LlamaConfig,
    a: &Args,
) -> Result<Vec<serde_json::Value>> {
    let max_batch = a.sd_batches.iter().copied().max().unwrap_or(1);
    println!("\nEAGLE-2 SD on the device (random drafter; its levels on the device), plan 3 steps x top-2:");
    println!(
        "| batch | drafter | tokens/round | ms/step | speed-up over plain | identical |\n|---:|---|---:|---:|---:|---|"
    );
    let mut rows = Vec::new();
    for &batch in &a.sd_batches {
        let ps = prompts(cfg, batch, a.context);
        let plain = timed(|| engine_run(target, &ps, a.sd_tokens, None, true))?;
        let opts = CudaDraftOptions { slots: max_batch, max_len: a.context + a.sd_tokens + 2 * MAX_TREE_NODES };
        let plan = Plan { steps: 3, top_k: 2, verify_tokens: 8 };
        let r = timed(|| {
            // The drafter's weights go to the device before the clock starts (version 0, the slot's).
            let mut exec = CudaDrafter::new(gpu.clone(), opts)?;
            exec.load(rt, 0)?;
            let mut d = EagleProposer::with_executor(std::sync::Arc::new(WeightsSlot::new(rt.clone())), exec);
            engine_run(target, &ps, a.sd_tokens, Some((&mut d, plan)), true)
        })?;
        rows.push(row(batch, "eagle2 (device)", &r, &plain, a.sd_tokens, serde_json::json!({})));
    }
    Ok(rows)
}

/// One EAGLE-2 draft level on the device per batch: seconds (median), beside the target's decode step.
pub fn drafter_level(
    gpu: &SharedGpu,
    rt: &DraftRuntime,
    cfg: &LlamaConfig,
    a: &Args,
    decode: &[(usize, f64)],
) -> Result<Vec<serde_json::Value>> {
    let max_batch = a.drafter_batches.iter().copied().max().unwrap_or(1);
    let opts = CudaDraftOptions { slots: max_batch, max_len: a.context + MAX_TREE_NODES };
    let mut exec = CudaDrafter::new(gpu.clone(), opts)?;
    exec.load(rt, 0)?;
    let h = cfg.hidden_size;
    let feature = vec![0.01f32; h];
    let k = a.drafter_top_k.max(1);
    println!("\nEAGLE-2 drafter on the device, one tree level of {k} rows per sequence over a {} cache:", a.context);
    println!("| batch | level ms | target decode ms | level / decode |\n|---:|---:|---:|---:|");
    let mut rows_out = Vec::new();
    for &b in &a.drafter_batches {
        let mut caches: Vec<DeviceDraftCache> = (0..b).map(|_| DeviceDraftCache::default()).collect();
        // Fill each cache with `context` committed positions (one causal forward per sequence, untimed).
        for c in &mut caches {
            let rows: Vec<Row<'_>> =
                (0..a.context).map(|t| Row { token: (t % 1000) as u32, feature: &feature, pos: t }).collect();
            let mut g = [(&mut *c, 0..a.context, Attend::Causal)];
            exec.forward(rt, &rows, &mut g, 0)?;
            CudaDrafter::commit(c, a.context);
        }
        let parents = vec![None; k];
        let level: Vec<Row<'_>> =
            (0..b * k).map(|i| Row { token: (i % 1000) as u32, feature: &feature, pos: a.context }).collect();
        let mut times = Vec::new();
        for _ in 0..a.steps.max(3) {
            let start = Instant::now();
            {
                let mut groups: Vec<_> = caches
                    .iter_mut()
                    .enumerate()
                    .map(|(i, c)| (c, i * k..(i + 1) * k, Attend::Tree(&parents)))
                    .collect();
                exec.forward(rt, &level, &mut groups, k)?;
            }
            times.push(start.elapsed().as_secs_f64());
            for c in &mut caches {
                exec.truncate_tentative(rt, c);
            }
        }
        let t = median(times);
        let dec = decode.iter().find(|(bb, _)| *bb == b).map_or(f64::NAN, |&(_, s)| s);
        println!("| {b} | {:.3} | {:.3} | {:.2} |", t * 1e3, dec * 1e3, t / dec);
        rows_out.push(serde_json::json!({"batch": b, "rows_per_seq": k, "level_s": t, "target_decode_s": dec}));
    }
    Ok(rows_out)
}
