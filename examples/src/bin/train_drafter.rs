//! Offline drafter training for a supported model (Llama/Qwen2/Qwen3 architectures; SmolLM2-135M-Instruct by default),
//! with export for serving.
//!
//! ```text
//! cargo run --release -p tlt-examples --bin train-drafter -- --out target/drafter
//! cargo run --release -p tlt-examples --bin train-drafter -- --kind eagle2 --steps 200 --prompts my_prompts.txt
//! ```
//!
//! 1. **Data.** The target answers the prompts greedily (built-in chat questions, or one prompt per line of
//!    `--prompts`, wrapped in the model's chat template), and the engine records the hidden states EAGLE reads:
//!    the three tapped layers EAGLE-3 fuses and the final-norm state EAGLE-2 extrapolates (EAGLE's recipe: train
//!    on the target's own responses).
//! 2. **Training.** `tlt_drafter::train::train_offline` over those samples (AdamW, packed windows; EAGLE-3 with the
//!    7-step training-time test and a draft vocabulary of the most frequent response tokens).
//! 3. **Export.** `<out>/drafter`: EAGLE-3 in the SGLang/vLLM format or EAGLE-2 in the original EAGLE layout
//!    (bf16 by default); `<out>/target`: the target as a Hugging Face directory (f32, as loaded: a GGUF is
//!    dequantized), since the drafter pairs with it; `<out>/SERVE.md`: the SGLang and vLLM command lines.
//!
//! The defaults are tiny (16 prompts, 48 new tokens, 20 steps of 256 tokens): about a minute on SmolLM2 with two
//! CPU cores, enough to check the pipeline end to end, not to get a useful acceptance rate (see `cargo xtask bench
//! drafter` for that).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tlt_drafter::checkpoint::{save_eagle2_serving, save_eagle3};
use tlt_drafter::online::FeatureSample;
use tlt_drafter::train::{train_offline, Budget};
use tlt_drafter::{
    DrafterConfig, DrafterKind, DrafterTrainer, Eagle2Drafter, Eagle3Drafter, FrozenTarget, SaveDType, TrainConfig,
    TrainableDrafter, VocabMap,
};
use tlt_examples::default_model;
use tlt_model::Llama;
use tlt_rl::task::ChatTemplate;
use tracing::info;

/// Built-in training questions (the default data).
const PROMPTS: [&str; 16] = [
    "Explain the water cycle in simple terms.",
    "Write a short poem about the moon.",
    "What are three interesting facts about honey bees?",
    "Describe volcanoes to a ten-year-old.",
    "What is the history of the bicycle?",
    "Give me five tips for better sleep.",
    "Why is photosynthesis important?",
    "Write a short story about a robot who learns to paint.",
    "What are the pros and cons of electric cars?",
    "Summarize what people should know about recycling.",
    "How does the internet work?",
    "Write a haiku about autumn leaves.",
    "What careers are related to mathematics?",
    "Tell me a fun fact about whales.",
    "How can I learn to play chess?",
    "Compare coffee with tea.",
];

/// The drafter architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// EAGLE-3: three fused target layers, its own LM head over a reduced draft vocabulary.
    Eagle3,
    /// EAGLE-2: the target's final hidden state, the target's LM head (TLT's online drafter).
    Eagle2,
}

/// Weight dtype of the exported drafter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Dtype {
    /// bfloat16 (what the engines serve).
    Bf16,
    /// float16.
    F16,
    /// float32 (lossless).
    F32,
}

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(about = "Train an EAGLE-2/EAGLE-3 drafter offline on a model's own responses and export it for serving")]
struct Args {
    /// A `.gguf` file or an HF checkpoint directory (default: the cached SmolLM2-135M-Instruct GGUF).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Output directory: `drafter/`, `target/`, `SERVE.md`.
    #[arg(long, default_value = "target/tlt-drafter")]
    out: PathBuf,
    /// Drafter architecture.
    #[arg(long, value_enum, default_value_t = Kind::Eagle3)]
    kind: Kind,
    /// A text file with one training prompt per line (default: 16 built-in questions).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Most new tokens of each greedy response.
    #[arg(long, default_value_t = 48)]
    new_tokens: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Tokens packed into one step.
    #[arg(long, default_value_t = 256)]
    tokens_per_step: usize,
    /// Peak learning rate (linear warmup over the first tenth of the steps).
    #[arg(long, default_value_t = 3e-4)]
    lr: f64,
    /// EAGLE-3 draft vocabulary: the most frequent response tokens (capped at the model's vocabulary).
    #[arg(long, default_value_t = 4096)]
    draft_vocab: usize,
    /// Weight dtype of the export.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// Seed of the drafter's initial weights and of the batch draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// The training prompts, chat-templated and tokenized.
fn prompts(args: &Args, tok: &tokenizers::Tokenizer, template: Option<&str>) -> Result<Vec<Vec<u32>>> {
    let texts: Vec<String> = match &args.prompts {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading {}", path.display()))?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect(),
        None => PROMPTS.iter().map(|s| s.to_string()).collect(),
    };
    if texts.is_empty() {
        bail!("no prompts");
    }
    let name = |id: &str| if tok.token_to_id(id).is_some() { id.to_string() } else { String::new() };
    let chat = match template {
        Some(src) => ChatTemplate::from_jinja(src, &name("<|endoftext|>"), &name("<|im_end|>"))?,
        None => ChatTemplate::chatml(),
    };
    texts.iter().map(|t| Ok(tlt_model::encode(tok, &chat.prompt(None, t)?)?)).collect()
}

/// Greedy responses of `target` to `prompts` with the EAGLE taps recorded (rows of 4H: three aux layers, then the
/// final norm), as training samples.
fn rollouts(target: &Llama, prompts: &[Vec<u32>], new_tokens: usize) -> Result<Vec<Arc<FeatureSample>>> {
    let bar = ProgressBar::new(prompts.len() as u64).with_style(
        ProgressStyle::with_template("responses [{elapsed_precise}] {bar:30} {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let out = FeatureSample::greedy_rollouts(target, prompts, new_tokens, 8, |done| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    Ok(out.into_iter().map(Arc::new).collect())
}

/// A freshly initialised drafter of `kind` for `target` (EAGLE-3's draft vocabulary from the response tokens).
fn new_drafter(args: &Args, target: &Llama, samples: &[Arc<FeatureSample>]) -> Result<TrainableDrafter> {
    let frozen = FrozenTarget::new(target);
    Ok(match args.kind {
        Kind::Eagle2 => {
            let cfg = DrafterConfig::eagle2_from_target(target.config(), false);
            Eagle2Drafter::random(cfg, frozen, args.seed)?.into()
        }
        Kind::Eagle3 => {
            let v = target.config().vocab_size;
            let mut counts = vec![0u64; v];
            for s in samples {
                for &t in &s.tokens[s.response_start..] {
                    if let Some(c) = counts.get_mut(t as usize) {
                        *c += 1;
                    }
                }
            }
            let vocab = VocabMap::from_counts(&counts, args.draft_vocab.min(v), &target.config().eos_ids())?;
            let cfg = DrafterConfig::eagle3_from_target(target.config(), vocab.draft_vocab_size());
            Eagle3Drafter::random(cfg, vocab, frozen, args.seed)?.into()
        }
    })
}

fn main() -> Result<()> {
    tlt_examples::init_logging();
    let args = Args::parse();
    let path = args.model.clone().unwrap_or_else(default_model);
    if !path.exists() {
        bail!("model {} not found (run `cargo xtask fetch-assets`, or pass --model)", path.display());
    }
    let loaded = tlt_model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let target = loaded.model;
    let tok = loaded.tokenizer.with_context(|| format!("{} carries no tokenizer", path.display()))?;
    let prompts = prompts(&args, &tok, loaded.chat_template.as_deref())?;

    let t = Instant::now();
    let samples = rollouts(&target, &prompts, args.new_tokens)?;
    let tokens: usize = samples.iter().map(|s| s.tokens.len() - s.response_start).sum();
    info!(
        prompts = prompts.len(),
        response_tokens = tokens,
        seconds = format!("{:.1}", t.elapsed().as_secs_f64()),
        "training data: the target's greedy responses"
    );

    let drafter = new_drafter(&args, &target, &samples)?;
    let cfg = TrainConfig {
        schedule: tlt_model::optim::LrSchedule {
            warmup_steps: (args.steps / 10).max(1),
            ..tlt_model::optim::LrSchedule::constant(args.lr)
        },
        tokens_per_step: args.tokens_per_step,
        window: args.tokens_per_step.min(512),
        row_len: args.tokens_per_step.min(512),
        seed: args.seed,
        ..TrainConfig::default()
    };
    let mut trainer = DrafterTrainer::new(drafter, cfg)?;
    let before = trainer.evaluate(&samples)?;
    let bar = ProgressBar::new(args.steps).with_style(
        ProgressStyle::with_template("training [{elapsed_precise}] {bar:30} {pos}/{len} steps, {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let report = train_offline(&mut trainer, &samples, Budget::Steps(args.steps), |s| {
        bar.set_position(s.step);
        bar.set_message(format!("loss {:.3}, top-1 {:.2}", s.eval.loss, s.eval.accuracy));
    })?;
    bar.finish_and_clear();
    let after = trainer.evaluate(&samples)?;
    info!(
        steps = report.steps,
        seconds = format!("{:.1}", report.seconds),
        tokens_per_s = format!("{:.0}", report.tokens_per_s),
        "trained"
    );
    println!(
        "{:?} drafter: loss {:.3} -> {:.3}, teacher-forced top-1 accuracy on the training responses {:.3} -> {:.3}",
        args.kind, before.loss, after.loss, before.accuracy, after.accuracy
    );

    let dtype = match args.dtype {
        Dtype::Bf16 => SaveDType::Bf16,
        Dtype::F16 => SaveDType::F16,
        Dtype::F32 => SaveDType::F32,
    };
    let (ddir, tdir) = (args.out.join("drafter"), args.out.join("target"));
    let kind = match trainer.drafter() {
        TrainableDrafter::Eagle2(d) => {
            save_eagle2_serving(d, &ddir, dtype)?;
            DrafterKind::Eagle2
        }
        TrainableDrafter::Eagle3(d) => {
            save_eagle3(d, &ddir, dtype)?;
            DrafterKind::Eagle3
        }
    };
    tlt_model::save_hf_dir(&target, Some(&tok), &tdir, candle_core::DType::F32)?;
    let tc = tlt_rl::trainer::tokenizer_config(target.config(), &tok, loaded.chat_template.as_deref());
    std::fs::write(tdir.join("tokenizer_config.json"), serde_json::to_string_pretty(&tc)?)?;
    let abs = |p: &std::path::Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let serve = format!(
        "# Serving this drafter\n\n`drafter/` was trained offline on {} greedy responses of `target/` (the model \
         it drafts for: {}). Serve the pair with:\n\n{}",
        samples.len(),
        path.display(),
        tlt_rl::trainer::serve_commands(&abs(&tdir), Some((&abs(&ddir), kind)))
    );
    std::fs::write(args.out.join("SERVE.md"), serve)?;
    tlt_rl::trainer::make_readable(&args.out)?;
    println!(
        "drafter: {}\ntarget:  {}\nhow to serve them: {}",
        ddir.display(),
        tdir.display(),
        args.out.join("SERVE.md").display()
    );
    Ok(())
}
