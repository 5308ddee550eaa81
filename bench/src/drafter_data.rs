//! Prompts and rollout data for `cargo xtask bench drafter`: templated chat prompts (disjoint train and held-out
//! fills), the target's greedy responses with hidden states recorded, and speculative-vs-plain evaluation.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use tlt_drafter::online::FeatureSample;
use tlt_drafter::{DraftRuntime, EagleProposer};
use tlt_model::{Llama, Tap};
use tlt_spec_decode::{Counters, Engine, HiddenStates, Plan, SpecParams, TappedLlama};

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

/// More question templates, used for training prompts only (`--extra-templates`): the held-out prompts stay
/// the same whatever the amount of training data.
const EXTRA_TEMPLATES: [&str; 10] = [
    "How does {} work?",
    "Write a haiku about {}.",
    "What would the world be like without {}?",
    "List some common misconceptions about {}.",
    "Write a short speech about {}.",
    "Compare {} with something similar.",
    "What careers are related to {}?",
    "Tell me a fun fact about {}.",
    "How can I learn more about {}?",
    "Write a diary entry about a day with {}.",
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

/// More topics, for training prompts only (`--extra-fills`): topic diversity is what held-out accuracy needs.
const EXTRA_FILLS: [&str; 24] = [
    "trains",
    "the weather",
    "cats",
    "painting",
    "the brain",
    "forests",
    "money",
    "sleep",
    "the stars",
    "cooking",
    "birds",
    "computers",
    "the Olympics",
    "tea",
    "bridges",
    "languages",
    "earthquakes",
    "museums",
    "whales",
    "vaccines",
    "castles",
    "mathematics",
    "islands",
    "the telephone",
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
    prompts_with_extra(0)
}

/// [`prompts`], with the first `extra` of [`EXTRA_TEMPLATES`] (at most 10) added to the training templates.
pub fn prompts_with_extra(extra: usize) -> (Vec<String>, Vec<String>) {
    let split = FILLS.len() - HELD_OUT_FILLS;
    let make = |templates: &[&str], fills: &[&str]| -> Vec<String> {
        fills.iter().flat_map(|f| templates.iter().map(move |t| chat(&t.replace("{}", f)))).collect()
    };
    let train_templates: Vec<&str> = TEMPLATES.iter().chain(EXTRA_TEMPLATES.iter().take(extra)).copied().collect();
    (make(&train_templates, &FILLS[..split]), make(&TEMPLATES, &FILLS[split..]))
}

/// Training prompts on the first `extra_fills` of [`EXTRA_FILLS`] (at most 24), with the first 10 templates and
/// the first `extra_templates` of [`EXTRA_TEMPLATES`]: added to [`prompts_with_extra`]'s training prompts.
pub fn extra_fill_prompts(extra_templates: usize, extra_fills: usize) -> Vec<String> {
    let templates: Vec<&str> = TEMPLATES.iter().chain(EXTRA_TEMPLATES.iter().take(extra_templates)).copied().collect();
    EXTRA_FILLS
        .iter()
        .take(extra_fills)
        .flat_map(|f| templates.iter().map(move |t| chat(&t.replace("{}", f))))
        .collect()
}

/// [`rollout_samples`] through a cache file under `dir`, keyed by everything that determines the greedy
/// responses (model file, prompts, length, batch): the first call generates and saves them (atomically), later
/// calls load them. Returns the samples and whether they came from the cache.
pub fn cached_rollout_samples(
    dir: &Path,
    model_path: &Path,
    target: &Llama,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    batch: usize,
) -> Result<(Vec<FeatureSample>, bool)> {
    let mut key = Fnv::default();
    let meta = std::fs::metadata(model_path).with_context(|| format!("reading {}", model_path.display()))?;
    key.write(model_path.to_string_lossy().as_bytes());
    key.write(&meta.len().to_le_bytes());
    for p in prompts {
        key.write(&(p.len() as u64).to_le_bytes());
        for t in p {
            key.write(&t.to_le_bytes());
        }
    }
    key.write(&(new_tokens as u64).to_le_bytes());
    key.write(&(batch as u64).to_le_bytes());
    let path = dir.join(format!("rollouts-{:016x}.safetensors", key.0));
    if path.exists() {
        match load_samples(&path) {
            Ok(s) if s.len() == prompts.len() => return Ok((s, true)),
            Ok(_) => tracing::warn!(path = %path.display(), "cached rollouts have the wrong count; regenerating"),
            Err(e) => tracing::warn!(path = %path.display(), "unreadable cached rollouts ({e:#}); regenerating"),
        }
    }
    let samples = rollout_samples(target, prompts, new_tokens, batch)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    save_samples(&path, &samples)?;
    Ok((samples, false))
}

/// 64-bit FNV-1a.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn save_samples(path: &Path, samples: &[FeatureSample]) -> Result<()> {
    let dev = Device::Cpu;
    let mut map = HashMap::new();
    let starts: Vec<u32> = samples.iter().map(|s| s.response_start as u32).collect();
    map.insert("response_start".to_string(), Tensor::from_vec(starts, samples.len(), &dev)?);
    for (i, s) in samples.iter().enumerate() {
        map.insert(format!("{i}.tokens"), Tensor::from_slice(&s.tokens, s.tokens.len(), &dev)?);
        let h = &s.hidden;
        map.insert(format!("{i}.hidden"), Tensor::from_slice(h.as_flat(), (h.len(), h.width()), &dev)?);
    }
    tlt_model::atomic_write(path, |tmp| Ok(candle_core::safetensors::save(&map, tmp)?))
        .with_context(|| format!("writing {}", path.display()))
}

fn load_samples(path: &Path) -> Result<Vec<FeatureSample>> {
    let map = candle_core::safetensors::load(path, &Device::Cpu)?;
    let starts: Vec<u32> = map.get("response_start").context("no response_start")?.to_vec1()?;
    let mut out = Vec::with_capacity(starts.len());
    for (i, &start) in starts.iter().enumerate() {
        let tokens: Vec<u32> = map.get(&format!("{i}.tokens")).context("missing tokens")?.to_vec1()?;
        let h = map.get(&format!("{i}.hidden")).context("missing hidden")?;
        let (_, width) = h.dims2()?;
        let hidden = HiddenStates::from_flat(width, h.flatten_all()?.to_vec1()?)?;
        let s = FeatureSample { tokens, hidden, response_start: start as usize, rl_step: 0 };
        s.validate()?;
        out.push(s);
    }
    Ok(out)
}

/// Greedy responses of `target` to `prompts` (`batch` at a time, up to `new_tokens` each, EOS stops), with the
/// taps of [`Tap::eagle3`] recorded (rows of 4H: three aux layers, then the final norm), as training samples.
pub fn rollout_samples(
    target: &Llama,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    batch: usize,
) -> Result<Vec<FeatureSample>> {
    Ok(FeatureSample::greedy_rollouts(target, prompts, new_tokens, batch, |_| {})?)
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

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests: a panic is the failure report.
mod tests {
    use super::*;

    fn sample(n: usize, width: usize, start: usize, seed: u32) -> FeatureSample {
        let tokens: Vec<u32> = (0..n as u32).map(|i| i * 7 + seed).collect();
        let data: Vec<f32> = (0..(n - 1) * width).map(|i| (i as f32 + seed as f32) * 0.5 - 3.0).collect();
        FeatureSample {
            tokens,
            hidden: HiddenStates::from_flat(width, data).unwrap(),
            response_start: start,
            rl_step: 0,
        }
    }

    #[test]
    fn saved_samples_load_back_identical() {
        let dir = std::env::temp_dir().join(format!("tlt-drafter-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.safetensors");
        let samples = vec![sample(5, 3, 2, 1), sample(9, 3, 4, 2), sample(2, 3, 1, 3)];
        save_samples(&path, &samples).unwrap();
        let back = load_samples(&path).unwrap();
        assert_eq!(back.len(), samples.len());
        for (a, b) in samples.iter().zip(&back) {
            assert_eq!(a.tokens, b.tokens);
            assert_eq!(a.response_start, b.response_start);
            assert_eq!(a.hidden.width(), b.hidden.width());
            assert_eq!(a.hidden.as_flat(), b.hidden.as_flat());
        }
        std::fs::write(&path, b"not a safetensors file").unwrap();
        assert!(load_samples(&path).is_err(), "a corrupt cache file is an error (the caller regenerates)");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fnv_keys_differ_by_content() {
        let key = |b: &[u8]| {
            let mut f = Fnv::default();
            f.write(b);
            f.0
        };
        assert_ne!(key(b"abc"), key(b"abd"));
        assert_eq!(key(b"abc"), key(b"abc"));
    }
}
