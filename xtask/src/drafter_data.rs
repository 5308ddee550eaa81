//! Prompts and rollout data for `cargo xtask bench drafter`: templated chat prompts (disjoint train and held-out
//! fills), the target's greedy responses with hidden states recorded, and speculative-vs-plain evaluation.

use std::time::Instant;

use anyhow::Result;
use tlt_drafter::online::Sample;
use tlt_drafter::{DraftRuntime, EagleProposer};
use tlt_model::{Llama, Tap};
use tlt_spec_decode::{Counters, Engine, Plan, SpecParams, TappedLlama};

/// Question templates; `{}` is replaced by a fill.
const TEMPLATES: [&str; 10] = [
    "Explain {} in simple terms.",
    "Write a short poem about {}.",
    "What are three interesting facts about {}?",
    "Describe {} to a ten-year-old.",
    "What is the history of {}?",
    "Give me five tips related to {}.",
    "Why is {} important?",
    "Write a short story that involves {}.",
    "What are the pros and cons of {}?",
    "Summarize what people should know about {}.",
];

/// Fills; the last [`HELD_OUT_FILLS`] are never used for training.
const FILLS: [&str; 28] = [
    "the ocean",
    "volcanoes",
    "the moon",
    "honey bees",
    "coffee",
    "the internet",
    "bicycles",
    "rainbows",
    "the Roman Empire",
    "chess",
    "photosynthesis",
    "electric cars",
    "music",
    "gardening",
    "dinosaurs",
    "the human heart",
    "snow",
    "libraries",
    "airplanes",
    "recycling",
    "mountains",
    "friendship",
    "the solar system",
    "bread",
    "rivers",
    "robots",
    "the desert",
    "football",
];

/// Fills reserved for held-out prompts.
pub const HELD_OUT_FILLS: usize = 4;

/// Wraps a user message in SmolLM2's chat template.
pub fn chat(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

/// Training prompts (every template x every training fill) and held-out prompts (every template x held-out
/// fills), as text.
pub fn prompts() -> (Vec<String>, Vec<String>) {
    let split = FILLS.len() - HELD_OUT_FILLS;
    let make = |fills: &[&str]| -> Vec<String> {
        fills.iter().flat_map(|f| TEMPLATES.iter().map(move |t| chat(&t.replace("{}", f)))).collect()
    };
    (make(&FILLS[..split]), make(&FILLS[split..]))
}

/// Greedy responses of `target` to `prompts` (`batch` at a time, up to `new_tokens` each, EOS stops), with the
/// taps of [`Tap::eagle3`] recorded (rows of 4H: three aux layers, then the final norm), as training samples.
pub fn rollout_samples(target: &Llama, prompts: &[Vec<u32>], new_tokens: usize, batch: usize) -> Result<Vec<Sample>> {
    let taps = Tap::eagle3(target.config().num_hidden_layers);
    let mut out = Vec::with_capacity(prompts.len());
    for chunk in prompts.chunks(batch.max(1)) {
        let mut e = Engine::new(TappedLlama { model: target, taps: &taps }, SpecParams::greedy(new_tokens))?;
        e.record_hidden(true);
        for p in chunk {
            e.add_request(p)?;
        }
        e.run_to_completion(None, &Plan::chain(1))?;
        let mut fin = e.take_finished();
        fin.sort_by_key(|f| f.id);
        for f in &fin {
            out.push(Sample::from_finished(f, 0)?);
        }
    }
    Ok(out)
}

/// One evaluation run: decode seconds (prefill excluded), tokens per request, and the engine counters.
pub struct EvalRun {
    /// Decode seconds.
    pub decode_s: f64,
    /// Generated tokens, per request.
    pub tokens: Vec<Vec<u32>>,
    /// Engine counters of the run.
    pub counters: Counters,
}

/// Decodes `prompts` one at a time (batch 1), greedily, plain (`runtime = None`) or speculatively with an
/// [`EagleProposer`] over `runtime` and `plan`. When drafting, the target records [`Tap::eagle3`]'s rows, from
/// which either drafter kind reads its features.
pub fn eval_batch1(
    target: &Llama,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    runtime: Option<&DraftRuntime>,
    plan: &Plan,
) -> Result<EvalRun> {
    let taps = Tap::eagle3(target.config().num_hidden_layers);
    let mut decode_s = 0.0;
    let mut tokens = Vec::new();
    let mut counters = Counters::default();
    for p in prompts {
        let mut e = Engine::new(TappedLlama { model: target, taps: &taps }, SpecParams::greedy(new_tokens))?;
        e.record_hidden(runtime.is_some());
        e.add_request(p)?;
        e.reset_counters();
        let mut proposer = runtime.map(|rt| EagleProposer::fixed(rt.clone()));
        let t = Instant::now();
        match proposer.as_mut() {
            Some(d) => e.run_to_completion(Some(d), plan)?,
            None => e.run_to_completion(None, plan)?,
        }
        decode_s += t.elapsed().as_secs_f64();
        let c = e.counters();
        counters.rounds += c.rounds;
        counters.seq_rounds += c.seq_rounds;
        counters.drafted += c.drafted;
        counters.accepted += c.accepted;
        counters.committed += c.committed;
        counters.draft_s += c.draft_s;
        counters.forward_s += c.forward_s;
        counters.verify_s += c.verify_s;
        counters.commit_s += c.commit_s;
        tokens.extend(e.take_finished().into_iter().map(|f| f.tokens));
    }
    Ok(EvalRun { decode_s, tokens, counters })
}
