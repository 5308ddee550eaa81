//! `tlt-serve --model PATH [--device cpu|cuda[:N]|sim] [--port N] [--no-speculate]`: an SGLang- and
//! OpenAI-compatible rollout server with TLT's engine inside (see the crate docs for what is served).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use tlt_serve::worker::DecodeConfig;
use tlt_serve::{ServeConfig, Server};

/// Command line.
#[derive(Debug, Parser)]
#[command(about = "An SGLang- and OpenAI-compatible rollout server with TLT's speculative decoding inside")]
struct Args {
    /// A `.gguf` file or an HF checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Where to decode: `cpu`, `cuda[:N]` (a build with the `cuda` feature) or `sim` (the simulated device: every
    /// CUDA kernel on the CPU, slow; for CI and for trying the device path).
    #[arg(long, default_value = "cpu")]
    device: tlt_serve::backend::DeviceChoice,
    /// Share of the device's memory for the weights and the KV pool together (SGLang's meaning; on the CPU, of the
    /// host's memory). Default 0.88.
    #[arg(long)]
    mem_fraction_static: Option<f64>,
    /// Tokens of the KV pool, instead of sizing it from `--mem-fraction-static`.
    #[arg(long)]
    max_total_tokens: Option<usize>,
    /// A TOML file of the trainer's `[sd]` sections the server has (`gate`, `mab`, `drafters`, `suffix`), over the
    /// defaults and the flags below.
    #[arg(long)]
    sd_config: Option<PathBuf>,
    /// Drafter kinds for the bandit to choose between: `suffix` (group drafting over a prompt's siblings), `ngram`,
    /// `eagle2` and `hybrid` (the last two with `--eagle`). Default `suffix`, or `hybrid` with `--eagle`.
    #[arg(long, value_delimiter = ',')]
    drafters: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free one; the chosen address is logged).
    #[arg(long, default_value_t = 30000)]
    port: u16,
    /// Plain decoding (no speculation).
    #[arg(long)]
    no_speculate: bool,
    /// The SD gate: speculate once an engine's running batch has been at most this for `--sd-on-after` rounds
    /// (off again above 1.5x it). TLT's default 32.
    #[arg(long, default_value_t = 32)]
    sd_batch_threshold: usize,
    /// Rounds at or below the threshold before speculation turns on.
    #[arg(long, default_value_t = 10)]
    sd_on_after: usize,
    /// Most requests decoding at once; more wait in a queue (bounds the KV caches' memory).
    #[arg(long, default_value_t = 256)]
    max_running_requests: usize,
    /// The weights' version reported to clients.
    #[arg(long)]
    weight_version: Option<String>,
    /// Draft with TLT's online EAGLE-2 drafter, trained on the hidden states of the requests served (in idle time
    /// and the tail), instead of prompt-lookup n-grams; a fresh drafter unless `--drafter` gives one.
    #[arg(long)]
    eagle: bool,
    /// Start the online drafter from this directory (implies `--eagle`): a checkpoint `--drafter-checkpoint`
    /// wrote (resumed exactly), or an EAGLE-2 drafter in the fastrl/EAGLE layout.
    #[arg(long)]
    drafter: Option<PathBuf>,
    /// Save the online drafter's trainer here after every weight update and at shutdown.
    #[arg(long)]
    drafter_checkpoint: Option<PathBuf>,
    /// Train the online drafter while at most this many requests run.
    #[arg(long, default_value_t = 4)]
    drafter_tail_batch: usize,
    /// The online drafter's learning rate (constant).
    #[arg(long, default_value_t = 3e-4)]
    drafter_lr: f64,
    /// Most drafter optimizer steps per weight version (default: unbounded).
    #[arg(long)]
    drafter_steps_per_version: Option<u64>,
    /// Most MiB of samples (tokens and hidden rows) the online drafter's buffer holds; the oldest go first.
    #[arg(long, default_value_t = tlt_serve::drafter::DEFAULT_BUFFER_BYTES >> 20)]
    drafter_buffer_mib: usize,
    /// Require `Authorization: Bearer KEY` on every route but `/health*` and `/metrics` (SGLang's `--api-key`).
    /// Default: none, every route open.
    #[arg(long)]
    api_key: Option<String>,
    /// A directory `/update_weights_from_disk` may load checkpoints from (repeatable; symlinks resolved). Without
    /// one, every update from disk is refused.
    #[arg(long = "weights-dir")]
    weights_dirs: Vec<PathBuf>,
    /// Most requests waiting for the engine; past it a request is answered 429.
    #[arg(long, default_value_t = tlt_serve::guard::DEFAULT_MAX_QUEUED)]
    max_queued_requests: usize,
    /// Most samples (prompts x n) in one request; past it a 413.
    #[arg(long, default_value_t = tlt_serve::guard::DEFAULT_MAX_BATCH)]
    max_batch_requests: usize,
    /// Abort and answer 504 a request not answered within this many seconds (0: no limit, the default).
    #[arg(long, default_value_t = 0.0)]
    request_timeout: f64,
}

impl Args {
    /// The online drafter's settings, when asked for.
    fn eagle(&self) -> Option<tlt_serve::drafter::EagleConfig> {
        let mut cfg = tlt_serve::drafter::EagleConfig {
            init: self.drafter.clone(),
            checkpoint: self.drafter_checkpoint.clone(),
            tail_batch: self.drafter_tail_batch,
            steps_per_version: self.drafter_steps_per_version,
            ..Default::default()
        };
        cfg.train.schedule = tlt_model::optim::LrSchedule::constant(self.drafter_lr);
        cfg.buffer.max_bytes = Some(self.drafter_buffer_mib.saturating_mul(1 << 20).max(1));
        (self.eagle || self.drafter.is_some()).then_some(cfg)
    }
}

fn main() -> Result<()> {
    // Before any other thread exists (the runtime's workers, the engine thread).
    let tuned = tlt_serve::tune_allocator();
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(serve(tuned))
}

async fn serve(tuned_allocator: bool) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if !tuned_allocator {
        tracing::debug!("allocator settings not applied (not glibc)");
    }
    let loaded = tlt_model::load(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let chat_template = tlt_serve::chat::model_template(&args.model, &loaded).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "the chat template is unusable: /v1/chat/completions will refuse requests");
        None
    });
    let mut decode = DecodeConfig {
        speculate: !args.no_speculate,
        gate: tlt_scheduler::GateConfig {
            threshold: args.sd_batch_threshold,
            on_after: args.sd_on_after,
            off_threshold: args.sd_batch_threshold.saturating_add(args.sd_batch_threshold / 2),
            off_after: 2,
        },
        max_running: args.max_running_requests,
        eagle: args.eagle(),
        drafters: args
            .drafters
            .iter()
            .map(|d| serde_json::from_value(serde_json::Value::String(d.clone())))
            .collect::<Result<_, _>>()
            .context("--drafters: expected suffix, ngram, eagle2 or hybrid")?,
        ..DecodeConfig::default()
    };
    if let Some(path) = &args.sd_config {
        tlt_serve::decode::SdFile::read(path)?.apply(&mut decode);
    }
    let cfg = ServeConfig {
        decode,
        model_name: args.model.display().to_string(),
        weight_version: args.weight_version,
        chat_template,
        guard: tlt_serve::guard::GuardConfig {
            api_key: args.api_key.clone(),
            weights_dirs: args.weights_dirs.clone(),
            max_queued: args.max_queued_requests,
            max_batch: args.max_batch_requests,
            request_timeout: (args.request_timeout > 0.0)
                .then(|| std::time::Duration::try_from_secs_f64(args.request_timeout))
                .transpose()
                .context("--request-timeout")?,
        },
        pool: tlt_serve::pool::PoolSpec {
            mem_fraction_static: args.mem_fraction_static,
            max_total_tokens: args.max_total_tokens,
        },
    };
    let server = match args.device.open()? {
        None => Server::start(loaded.model, loaded.tokenizer, cfg)?,
        Some((gpu, name)) => {
            let beside = cfg.decode.beside(loaded.model.config());
            let max_running = cfg.decode.max_running;
            let backend =
                tlt_serve::backend::DeviceBackend::new(loaded.model, gpu, &name, &cfg.pool, max_running, beside)?;
            Server::start_on(backend, loaded.tokenizer, cfg)?
        }
    };
    let listener =
        tlt_serve::bind(&args.host, args.port).await.with_context(|| format!("binding {}:{}", args.host, args.port))?;
    tracing::info!(address = %listener.local_addr()?, "serving");
    let Server { router, engine } = server;
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutting down");
        })
        .await?;
    // The routes are gone: the engine thread finishes what runs, checkpoints the drafter and ends.
    tokio::task::spawn_blocking(move || engine.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    Ok(())
}
