//! Shared engine-test helpers: plain greedy reference decoding through `tlt_model` and oracle drafters.
#![allow(dead_code, clippy::unwrap_used)]

use tlt_model::Llama;
use tlt_spec_decode::{Corruption, Drafter, Engine, Finished, OracleDrafter, Plan, RequestId, SpecParams};

pub fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

/// Plain greedy decoding through `Llama::prefill/decode`: `n` new tokens, stopping after any of `stop`.
pub fn greedy_reference(model: &Llama, prompt: &[u32], n: usize, stop: &[u32]) -> Vec<u32> {
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    let mut next = argmax(&model.prefill(&mut cache, seq, prompt).unwrap().to_vec1::<f32>().unwrap());
    let mut out = vec![next];
    while out.len() < n && !stop.contains(&next) {
        next = argmax(&model.decode(&mut cache, &[(seq, next)]).unwrap().to_vec2::<f32>().unwrap()[0]);
        out.push(next);
    }
    out
}

/// [`greedy_reference`] for many prompts at once, decoding the unfinished ones together with one batched
/// `Llama::decode` per token (same result, fewer forwards).
pub fn greedy_reference_batch(model: &Llama, prompts: &[Vec<u32>], n: usize, stop: &[u32]) -> Vec<Vec<u32>> {
    let mut cache = model.new_cache();
    let mut outs: Vec<Vec<u32>> = Vec::new();
    let mut seqs = Vec::new();
    for p in prompts {
        let seq = cache.add_sequence();
        outs.push(vec![argmax(&model.prefill(&mut cache, seq, p).unwrap().to_vec1::<f32>().unwrap())]);
        seqs.push(seq);
    }
    loop {
        let live: Vec<usize> =
            (0..prompts.len()).filter(|&k| outs[k].len() < n && !stop.contains(outs[k].last().unwrap())).collect();
        if live.is_empty() {
            return outs;
        }
        let batch: Vec<_> = live.iter().map(|&k| (seqs[k], *outs[k].last().unwrap())).collect();
        let rows = model.decode(&mut cache, &batch).unwrap().to_vec2::<f32>().unwrap();
        for (&k, row) in live.iter().zip(&rows) {
            outs[k].push(argmax(row));
        }
    }
}

/// An [`OracleDrafter`] over `vocab` tokens that knows `continuations[i]` for request `i` (prompt
/// `prompts[i]`), wrong at every `every`-th position; with `tree`, wrong positions get the true token as a sibling.
pub fn oracle(
    vocab: usize,
    prompts: &[Vec<u32>],
    continuations: &[Vec<u32>],
    every: usize,
    tree: bool,
) -> OracleDrafter {
    let mut o = OracleDrafter::new(vocab, Corruption::Every(every), tree).unwrap();
    for (i, (p, c)) in prompts.iter().zip(continuations).enumerate() {
        o.insert(RequestId(i), p.len(), c.clone());
    }
    o
}

/// Runs `prompts` through an engine in batches of `batch` (each batch to completion) and returns the finished
/// requests in prompt order, with the engines' accepted-draft count. With `oracle_source` (the greedy
/// continuation of each prompt) an [`oracle`] (every 3rd position wrong) drafts, otherwise `drafter` (or none: plain decoding).
#[allow(clippy::too_many_arguments)]
pub fn run_batches(
    model: &Llama,
    params: &SpecParams,
    prompts: &[Vec<u32>],
    batch: usize,
    mut drafter: Option<&mut dyn Drafter>,
    plan: &Plan,
    oracle_source: Option<&[Vec<u32>]>,
    oracle_tree: bool,
) -> (Vec<Finished>, u64) {
    let mut out: Vec<Finished> = Vec::new();
    let mut accepted = 0;
    for chunk in prompts.chunks(batch) {
        let mut engine = Engine::new(model, params.clone()).unwrap();
        for p in chunk {
            engine.add_request(p).unwrap();
        }
        let base = out.len();
        let mut oracle = oracle_source.map(|src| {
            let n = chunk.len();
            oracle(model.config().vocab_size, &prompts[base..base + n], &src[base..base + n], 3, oracle_tree)
        });
        match (&mut oracle, drafter.as_mut()) {
            (Some(o), _) => engine.run_to_completion(Some(o), plan).unwrap(),
            (None, Some(d)) => engine.run_to_completion(Some(&mut **d), plan).unwrap(),
            (None, None) => engine.run_to_completion(None, plan).unwrap(),
        }
        accepted += engine.counters().accepted;
        let mut fin = engine.take_finished();
        fin.sort_by_key(|f| f.id);
        out.extend(fin);
    }
    (out, accepted)
}
