//! Shared engine-test helpers: plain greedy reference decoding through `tlt_model` and an oracle chain drafter.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;

use tlt_model::Llama;
use tlt_spec_decode::{DraftContext, DraftTree, Drafter, Engine, Finished, Plan, Result, SpecParams};

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

/// Proposes a chain of the target's own greedy continuation (precomputed per request), with every `every`-th
/// token of the continuation corrupted (`+1` mod vocab), so acceptance stops there.
pub struct ChainOracle {
    /// Per request id: (prompt length, greedy continuation).
    pub source: HashMap<usize, (usize, Vec<u32>)>,
    pub vocab: u32,
    pub every: usize,
    /// Tree mode: at a corrupted position also propose the true token as a second sibling and continue
    /// below it (when `plan.top_k >= 2`), so accepted paths skip nodes.
    pub tree: bool,
}

impl Drafter for ChainOracle {
    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> Result<DraftTree> {
        let history = ctx.history;
        let root = *history.last().expect("non-empty history");
        let Some((prompt_len, cont)) = self.source.get(&ctx.request.0) else {
            return Ok(DraftTree::new(root));
        };
        let g = history.len() - prompt_len;
        if g > cont.len() || history[*prompt_len..] != cont[..g] {
            return Ok(DraftTree::new(root)); // Off the oracle's track (sampling): no draft.
        }
        if self.tree && plan.top_k >= 2 {
            let mut t = DraftTree::new(root);
            let mut cur = 0;
            for (j, &tok) in cont.iter().enumerate().take(g + plan.steps).skip(g) {
                if t.len() >= plan.verify_tokens {
                    break;
                }
                if (j + 1) % self.every == 0 {
                    t.push_child(cur, (tok + 1) % self.vocab, -0.5)?;
                    if t.len() >= plan.verify_tokens {
                        break;
                    }
                }
                cur = t.push_child(cur, tok, -0.5)?;
            }
            return Ok(t);
        }
        let n = plan.steps.min(plan.verify_tokens - 1);
        let draft: Vec<u32> = (g..cont.len().min(g + n))
            .map(|j| if (j + 1) % self.every == 0 { (cont[j] + 1) % self.vocab } else { cont[j] })
            .collect();
        Ok(DraftTree::chain(root, &draft))
    }
}

/// Runs `prompts` through an engine in batches of `batch` (each batch to completion) and returns the finished
/// requests in prompt order, with the engines' accepted-draft count. With `oracle_source` (the greedy
/// continuation of each prompt) a [`ChainOracle`] drafts, otherwise `drafter` (or none: plain decoding).
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
        let mut oracle = oracle_source.map(|src| ChainOracle {
            source: (0..chunk.len()).map(|i| (i, (prompts[base + i].len(), src[base + i].clone()))).collect(),
            vocab: model.config().vocab_size as u32,
            every: 3,
            tree: oracle_tree,
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
