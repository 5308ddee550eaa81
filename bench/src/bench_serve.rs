//! `cargo xtask bench serve`: the rollout server against the same rollout in process. Writes
//! `target/bench/serve.json` and `.md`.
//!
//! The workload is slime's: `--prompts` problems of the trainer's arithmetic task (chat template) times `--samples`
//! samples each at `--temperature`, every sample its own `/generate` request with its own `sampling_seed` and a
//! long-tailed token limit (most short, a few up to `--max-new-tokens`), all sent at once over HTTP/1.1 by one client
//! thread per request. The in-process run decodes the same requests (same coin streams, a prompt's samples forked
//! from one prefill) in one `tlt_spec_decode::Engine` driven round by round, the loop the server's engine thread
//! runs. Each pair (in process, HTTP; the order alternating with the repeat) runs per `--sd` setting, `--repeats`
//! times, interleaved; every HTTP output must equal its in-process twin token for token (the suite fails otherwise, after writing
//! its report with the differing outputs: request, seed, lengths, first differing position).
//! Then `--concurrent` short requests at once: none lost, the process's peak resident memory reported. Both paths
//! run with the allocator settings of the server binary (`tlt_serve::tune_allocator`; `--system-allocator`: glibc's
//! defaults).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use tlt_model::Llama;
use tlt_rl::task::{builtin, ChatTemplate};
use tlt_serve::api::seeded_stream;
use tlt_serve::backend::{slot_len, DeviceBackend, DeviceChoice, GRAPH_BUDGET};
use tlt_serve::worker::DecodeConfig;
use tlt_serve::{ServeConfig, Server};
use tlt_spec_decode::cuda::CudaTarget;
use tlt_spec_decode::{Engine, GroupId, SamplingParams, SpecParams, Target};
use tracing::{info, warn};

use crate::report::{self, median, Header};
use crate::sysinfo::{self, MachineInfo};

/// Options of `cargo xtask bench serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Prompts of the rollout.
    #[arg(long, default_value_t = 64)]
    prompts: usize,
    /// Samples per prompt (the GRPO group size).
    #[arg(long, default_value_t = 8)]
    samples: usize,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
    /// Token limit of the longest samples; limits are `min + (max - min) * u^4`, u uniform: a long tail.
    #[arg(long, default_value_t = 96)]
    max_new_tokens: usize,
    /// Token limit of the shortest samples.
    #[arg(long, default_value_t = 8)]
    min_new_tokens: usize,
    /// Pairs (in process, HTTP) per speculation setting, interleaved.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Speculation settings to run, in order, each as an (in process, HTTP) pair per repeat: `off`, `gated` (TLT's
    /// gate and bandit, the server's default), `always` (every round).
    #[arg(long, value_delimiter = ',', default_value = "off,gated")]
    sd: Vec<Sd>,
    /// Requests sent at once in the concurrency check (each `--concurrent-tokens` long).
    #[arg(long, default_value_t = 1000)]
    concurrent: usize,
    /// Tokens each request of the concurrency check generates.
    #[arg(long, default_value_t = 4)]
    concurrent_tokens: usize,
    /// Seed of the problems and of the samples' seeds.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where both paths decode: `cpu` (SmolLM2), `cuda[:N]` (SmolLM2 on the GPU, bf16) or `sim` (the simulated
    /// device, every CUDA kernel on the CPU: a two-layer model of 512 tokens with random weights, the prompts' ids
    /// taken modulo 512, for CI: its times measure the simulator, its outputs the device path's correctness).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: DeviceChoice,
    /// Keep glibc's default allocator settings instead of the ones the server binary runs with
    /// (`tlt_serve::tune_allocator`), for both paths.
    #[arg(long)]
    system_allocator: bool,
}

/// The vocabulary of `--device sim`'s model.
const SIM_VOCAB: usize = 512;

/// One request of the workload.
#[derive(Debug, Clone)]
struct Req {
    prompt: usize,
    ids: Arc<Vec<u32>>,
    limit: usize,
    seed: u64,
}

/// One timed rollout.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// `in_process` or `http`.
    pub path: &'static str,
    /// How it speculated (prompt-lookup n-grams, the server's plan).
    pub sd: Sd,
    /// Which repeat.
    pub repeat: usize,
    /// Seconds from the first request to the last output.
    pub wall_s: f64,
    /// Tokens generated.
    pub tokens: usize,
    /// `tokens / wall_s`.
    pub tokens_per_s: f64,
    /// HTTP only: request latency percentiles (seconds).
    pub latency_p50_s: Option<f64>,
    /// HTTP only.
    pub latency_p99_s: Option<f64>,
    /// HTTP only: outputs equal to the in-process run's of the same setting and repeat.
    pub outputs_equal: Option<usize>,
    /// HTTP only: the outputs that differ from their in-process twin (empty when all are equal).
    pub differing: Vec<Differing>,
    /// Engine rounds (batched target forwards) the rollout took.
    pub rounds: u64,
    /// HTTP only: rounds the SD gate ran speculatively, and the accept length (tokens committed per speculative
    /// request-round) over them.
    pub sd_rounds_accept: Option<(u64, f64)>,
    /// HTTP with `tlt` only: the online drafter's optimizer steps during the run (it trains only in the tail and
    /// idle time), and whether it trained on the device.
    pub drafter_steps_on_device: Option<(u64, bool)>,
}

/// An HTTP output that differs from its in-process twin.
#[derive(Debug, Clone, Serialize)]
pub struct Differing {
    /// The request's index in the workload.
    pub request: usize,
    /// Its sampling seed.
    pub seed: u64,
    /// Tokens over HTTP and in process.
    pub tokens: (usize, usize),
    /// The first position where they differ.
    pub first_difference: usize,
}

/// The concurrency check.
#[derive(Debug, Clone, Serialize)]
pub struct Concurrency {
    /// Requests sent at once.
    pub requests: usize,
    /// Answered 200 with the asked number of tokens.
    pub completed: usize,
    /// Seconds until the last answer.
    pub wall_s: f64,
    /// Resident memory before (MiB).
    pub rss_before_mib: f64,
    /// Peak resident memory of the process after (MiB; includes the model, the client threads' stacks in use).
    pub rss_peak_mib: f64,
    /// `/metrics` after: waiting and running requests (both must be 0).
    pub left_waiting_running: (f64, f64),
}

/// `target/bench/serve.json`.
#[derive(Debug, Clone, Serialize)]
pub struct ServeReport {
    /// Suite header.
    pub header: Header,
    /// Requests of the workload.
    pub requests: usize,
    /// Prompt tokens (mean).
    pub mean_prompt_tokens: f64,
    /// Token limits: p50, p90, max.
    pub limit_p50_p90_max: (usize, usize, usize),
    /// Every run, in the order run.
    pub runs: Vec<Run>,
    /// Per speculation setting: median HTTP / in-process throughput over its pairs, and the smallest and largest.
    pub http_over_in_process: Vec<(Sd, f64, f64, f64)>,
    /// Per speculation setting other than `off` (when `off` ran): median throughput over `off`'s of the same repeat,
    /// in process and over HTTP.
    pub sd_speedup: Vec<(Sd, f64, f64)>,
    /// Per speculation setting other than `off` and repeat (when `off` ran): in-process outputs equal to `off`'s of
    /// the same repeat, of how many (lossless decoding: all).
    pub equal_to_off: Vec<(Sd, usize, usize, usize)>,
    /// The concurrency check.
    pub concurrency: Concurrency,
    /// Whether both paths ran with the server binary's allocator settings (`tlt_serve::tune_allocator`).
    pub tuned_allocator: bool,
}

/// The workload: prompts x samples, long-tailed limits, a seed per sample.
fn workload(args: &ServeArgs, tok: &tokenizers::Tokenizer) -> Result<Vec<Req>> {
    let task = builtin("arithmetic", args.seed)?;
    let template = ChatTemplate::chatml();
    let mut reqs = Vec::new();
    let mut state = args.seed ^ 0x5EED;
    for p in 0..args.prompts {
        let text = template.prompt(None, &task.problem(p as u64)?.prompt)?;
        let ids = Arc::new(tlt_model::encode(tok, &text)?);
        for _ in 0..args.samples {
            state = seeded_stream(state, 1);
            // The top bit of a seeded stream is always set: u from the 53 bits below it.
            let u = ((state << 1) >> 11) as f64 / (1u64 << 53) as f64;
            let span = args.max_new_tokens.saturating_sub(args.min_new_tokens) as f64;
            let limit = args.min_new_tokens + (span * u.powi(4)).round() as usize;
            reqs.push(Req { prompt: p, ids: ids.clone(), limit, seed: args.seed * 1_000_000 + reqs.len() as u64 });
        }
    }
    Ok(reqs)
}

/// The server's decode settings: speculation off, gated (TLT's default gate) or in every round, or TLT with its online
/// EAGLE drafter (the server's `--eagle`: hybrid drafting, the drafter trained in the tail); `in_process`: the
/// in-process twin's, which drafts without the EAGLE drafter (it has no engine thread to train one).
fn decode(sd: Sd, in_process: bool) -> DecodeConfig {
    match sd {
        Sd::Off => DecodeConfig { speculate: false, ..DecodeConfig::default() },
        Sd::Gated => DecodeConfig::default(),
        Sd::Tlt if in_process => DecodeConfig::default(),
        Sd::Tlt => DecodeConfig { eagle: Some(tlt_serve::drafter::EagleConfig::default()), ..DecodeConfig::default() },
        Sd::Always => DecodeConfig::always_speculate(),
    }
}

/// How a run speculates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Sd {
    /// Plain decoding.
    Off,
    /// TLT's SD gate (on once the batch is small) and bandit: the server's default.
    Gated,
    /// Speculation in every round.
    Always,
    /// The gate and bandit with TLT's online EAGLE drafter (hybrid with group suffix drafting), trained while at most
    /// 4 requests run (on the device with a device backend). Its in-process twin drafts without it (the same
    /// outputs: decoding is lossless).
    Tlt,
}

/// The rollout in process on `device`: one engine over `model` (a fresh device target on a device), round by round
/// through the same adaptive decoder (gate and bandit) and drafters as the server's engine thread.
fn in_process(
    model: &Llama,
    device: DeviceChoice,
    reqs: &[Req],
    temperature: f64,
    sd: Sd,
) -> Result<(f64, Vec<Vec<u32>>, u64)> {
    match device.open()? {
        None => decode_in_process(model, reqs, temperature, sd),
        Some((gpu, _)) => {
            let target = CudaTarget::new(model, gpu, reqs.len(), slot_len(model.config()), GRAPH_BUDGET)?;
            decode_in_process(&target, reqs, temperature, sd)
        }
    }
}

fn decode_in_process<T: Target>(
    target: T,
    reqs: &[Req],
    temperature: f64,
    sd: Sd,
) -> Result<(f64, Vec<Vec<u32>>, u64)> {
    let params = SpecParams {
        sampling: SamplingParams { temperature: temperature as f32, top_k: None, top_p: None },
        max_new_tokens: reqs.iter().map(|r| r.limit).max().unwrap_or(1),
        stop_token_ids: None,
        stop: Vec::new(),
        seed: 0,
    };
    let cfg = decode(sd, true);
    let t0 = Instant::now();
    let mut e = Engine::new(target, params)?;
    let mut drafter = cfg.drafter(None)?;
    let mut decoder = cfg.decoder()?;
    for r in reqs {
        e.key_streams_from(seeded_stream(r.seed, 0));
        e.add_to_group(GroupId(r.prompt as u64), &r.ids, 1, r.limit)?;
    }
    while !e.is_idle() {
        decoder.step(&mut e, drafter.as_deref_mut())?;
        let _ = decoder.drain_trace();
    }
    let wall = t0.elapsed().as_secs_f64();
    let rounds = e.counters().rounds;
    let mut done = e.take_finished();
    done.sort_by_key(|f| f.id);
    Ok((wall, done.into_iter().map(|f| f.tokens).collect(), rounds))
}

/// A server of `model` on `device` on a free port; its address and the runtime serving it (drop it to stop the
/// server). `max_running`: the server's admission bound (`None`: its default); on a device the KV pool holds that
/// many slots.
fn start(
    model: Llama,
    device: DeviceChoice,
    sd: Sd,
    max_running: Option<usize>,
) -> Result<(SocketAddr, tokio::runtime::Runtime)> {
    let mut decode = decode(sd, false);
    decode.max_running = max_running.unwrap_or(decode.max_running);
    let mut cfg = ServeConfig { decode, model_name: "bench".into(), ..ServeConfig::default() };
    let server = match device.open()? {
        None => Server::start(model, None, cfg)?,
        Some((gpu, name)) => {
            cfg.pool.max_total_tokens = Some(cfg.decode.max_running * slot_len(model.config()));
            let beside = cfg.decode.beside(model.config());
            let backend = DeviceBackend::new(model, gpu, &name, &cfg.pool, cfg.decode.max_running, beside)?;
            Server::start_on(backend, None, cfg)?
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let listener = rt.block_on(tlt_serve::bind("127.0.0.1", 0))?;
    let addr = listener.local_addr()?;
    rt.spawn(async move { axum::serve(listener, server.router).await });
    Ok((addr, rt))
}

/// `POST /generate` with `body`: the answer's JSON.
fn post(addr: SocketAddr, body: &Value) -> Result<Value> {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr)?;
    write!(
        s,
        "POST /generate HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (head, json) = out.split_once("\r\n\r\n").context("no HTTP body")?;
    ensure!(head.starts_with("HTTP/1.1 200"), "{head}: {json}");
    Ok(serde_json::from_str(json)?)
}

/// Sends every request at once, one thread each; (wall seconds, outputs, latencies).
fn over_http(addr: SocketAddr, reqs: &[Req], temperature: f64) -> Result<(f64, Vec<Vec<u32>>, Vec<f64>)> {
    let gate = Arc::new(Barrier::new(reqs.len() + 1));
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| {
            let body = json!({"input_ids": *r.ids, "return_logprob": true, "sampling_params": {
                "temperature": temperature, "max_new_tokens": r.limit, "sampling_seed": r.seed}});
            let gate = gate.clone();
            std::thread::Builder::new().stack_size(256 << 10).spawn(move || -> Result<(Vec<u32>, f64)> {
                gate.wait();
                let t0 = Instant::now();
                let v = post(addr, &body)?;
                let ids = v["output_ids"].as_array().context("no output_ids")?;
                let ids =
                    ids.iter().map(|t| t.as_u64().map(|t| t as u32).context("a bad id")).collect::<Result<Vec<u32>>>();
                Ok((ids?, t0.elapsed().as_secs_f64()))
            })
        })
        .collect::<std::io::Result<_>>()?;
    gate.wait();
    let t0 = Instant::now();
    let mut outs = Vec::with_capacity(reqs.len());
    let mut lat = Vec::with_capacity(reqs.len());
    for h in handles {
        let (ids, l) = h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        outs.push(ids);
        lat.push(l);
    }
    Ok((t0.elapsed().as_secs_f64(), outs, lat))
}

/// The server's Prometheus metric `tlt_serve_<name>`.
fn metric(addr: SocketAddr, name: &str) -> Result<f64> {
    let mut s = TcpStream::connect(addr)?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let line = out.lines().find(|l| l.starts_with(&format!("tlt_serve_{name} "))).context("no metric")?;
    Ok(line.split_whitespace().nth(1).context("no value")?.parse()?)
}

/// The rollout over HTTP against a fresh server that admits every request at once, as in process (the default
/// bound, 256, would queue half of them); its run (outputs not yet compared) and outputs.
fn http_run(
    model: &Llama,
    device: DeviceChoice,
    reqs: &[Req],
    temperature: f64,
    sd: Sd,
    repeat: usize,
) -> Result<(Run, Vec<Vec<u32>>)> {
    let (addr, rt) = start(model.clone(), device, sd, Some(reqs.len()))?;
    let (wall, outs, lat) = over_http(addr, reqs, temperature)?;
    let rounds = metric(addr, "engine_rounds_total")? as u64;
    let sd_rounds_accept = Some((metric(addr, "engine_sd_rounds_total")? as u64, metric(addr, "spec_accept_length")?));
    let drafter_steps_on_device = if sd == Sd::Tlt {
        Some((metric(addr, "drafter_steps_total")? as u64, metric(addr, "drafter_trains_on_device")? > 0.0))
    } else {
        None
    };
    rt.shutdown_background();
    let tokens: usize = outs.iter().map(Vec::len).sum();
    let run = Run {
        path: "http",
        sd,
        repeat,
        wall_s: wall,
        tokens,
        tokens_per_s: tokens as f64 / wall,
        latency_p50_s: Some(tlt_rl::metrics::percentile(&lat, 0.5)),
        latency_p99_s: Some(tlt_rl::metrics::percentile(&lat, 0.99)),
        outputs_equal: None,
        differing: Vec::new(),
        rounds,
        sd_rounds_accept,
        drafter_steps_on_device,
    };
    Ok((run, outs))
}

/// `VmRSS` and `VmHWM` of this process (MiB).
fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// `--concurrent` short requests at once against a fresh server with its default admission bound (256 running).
fn concurrency(model: &Llama, args: &ServeArgs, prompt: &[u32]) -> Result<Concurrency> {
    let (addr, rt) = start(model.clone(), args.device, Sd::Gated, Some(args.concurrent.min(256)))?;
    let (before, _) = rss_mib();
    let reqs: Vec<Req> = (0..args.concurrent)
        .map(|i| Req { prompt: 0, ids: Arc::new(prompt.to_vec()), limit: args.concurrent_tokens, seed: i as u64 })
        .collect();
    let body_limit = args.concurrent_tokens;
    let (wall, outs, _) = over_http(addr, &reqs, 0.7)?;
    let completed = outs.iter().filter(|o| o.len() <= body_limit && !o.is_empty()).count();
    let left = (metric(addr, "waiting_requests")?, metric(addr, "running_requests")?);
    let (_, peak) = rss_mib();
    rt.shutdown_background();
    Ok(Concurrency {
        requests: args.concurrent,
        completed,
        wall_s: wall,
        rss_before_mib: before,
        rss_peak_mib: peak,
        left_waiting_running: left,
    })
}

/// Runs the suite.
///
/// # Errors
/// On a model, engine, server or I/O error, or when an HTTP output differs from its in-process twin.
pub fn run(args: &ServeArgs) -> Result<()> {
    // The server binary's allocator settings, for both paths (before the suite starts threads).
    let tuned_allocator = !args.system_allocator && tlt_serve::tune_allocator();
    ensure!(args.prompts > 0 && args.samples > 0 && args.repeats > 0, "prompts, samples and repeats must be >= 1");
    ensure!(args.min_new_tokens >= 1 && args.min_new_tokens <= args.max_new_tokens, "need 1 <= min <= max tokens");
    let machine = MachineInfo::collect();
    let timestamp = sysinfo::utc_timestamp();
    let path = crate::env::smollm2_gguf()?;
    let loaded = tlt_model::load_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let (model, tok) = (loaded.model, loaded.tokenizer.context("the GGUF carries no tokenizer")?);
    let model = match args.device {
        DeviceChoice::Sim => {
            // Two small layers and a vocabulary of SIM_VOCAB (the simulator runs every CUDA thread of the LM head
            // on the CPU); the prompts' ids are taken modulo it below.
            let mut cfg = tlt_model::LlamaConfig::tiny(SIM_VOCAB, 64, 2);
            cfg.eos_token_id = Some(tlt_model::EosTokens::One(1));
            cfg.max_position_embeddings = 512;
            Llama::random(cfg, args.seed)?
        }
        _ => model,
    };
    let mut reqs = workload(args, &tok)?;
    if args.device == DeviceChoice::Sim {
        for r in &mut reqs {
            r.ids = Arc::new(r.ids.iter().map(|&t| t % SIM_VOCAB as u32).collect());
        }
    }
    let mut limits: Vec<usize> = reqs.iter().map(|r| r.limit).collect();
    limits.sort_unstable();
    let pick = |q: f64| limits[((limits.len() as f64 * q).ceil() as usize).saturating_sub(1)];
    let mean_prompt = reqs.iter().map(|r| r.ids.len()).sum::<usize>() as f64 / reqs.len() as f64;
    info!(requests = reqs.len(), mean_prompt, limits = ?(pick(0.5), pick(0.9), pick(1.0)), "workload");

    let mut runs = Vec::new();
    let mut twins: Vec<(Sd, usize, Vec<Vec<u32>>)> = Vec::new();
    for repeat in 0..args.repeats {
        for &sd in &args.sd {
            // The pair's order alternates with the repeat, so that an order effect cancels in the medians.
            let http_first = repeat % 2 == 1;
            let mut http = None;
            if http_first {
                http = Some(http_run(&model, args.device, &reqs, args.temperature, sd, repeat)?);
            }
            let (wall, twin_outputs, rounds) = in_process(&model, args.device, &reqs, args.temperature, sd)?;
            let tokens: usize = twin_outputs.iter().map(Vec::len).sum();
            info!(repeat, ?sd, wall, tokens, "in process");
            runs.push(Run {
                path: "in_process",
                sd,
                repeat,
                wall_s: wall,
                tokens,
                tokens_per_s: tokens as f64 / wall,
                latency_p50_s: None,
                latency_p99_s: None,
                outputs_equal: None,
                differing: Vec::new(),
                rounds,
                sd_rounds_accept: None,
                drafter_steps_on_device: None,
            });
            let (mut run, outs) = match http {
                Some(h) => h,
                None => http_run(&model, args.device, &reqs, args.temperature, sd, repeat)?,
            };
            let twin = twins.len();
            twins.push((sd, repeat, twin_outputs));
            run.differing = outs
                .iter()
                .zip(&twins[twin].2)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(i, (a, b))| Differing {
                    request: i,
                    seed: reqs[i].seed,
                    tokens: (a.len(), b.len()),
                    first_difference: a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len())),
                })
                .collect();
            let equal = reqs.len() - run.differing.len();
            run.outputs_equal = Some(equal);
            info!(repeat, ?sd, wall = run.wall_s, tokens = run.tokens, equal, http_first, "http");
            for d in &run.differing {
                warn!(?d, "an HTTP output differs from its in-process twin");
            }
            runs.push(run);
        }
    }
    let off = |repeat: usize| twins.iter().find(|t| t.0 == Sd::Off && t.1 == repeat).map(|t| &t.2);
    let equal_to_off: Vec<(Sd, usize, usize, usize)> = twins
        .iter()
        .filter(|t| t.0 != Sd::Off)
        .filter_map(|(sd, repeat, outs)| {
            let base = off(*repeat)?;
            Some((*sd, *repeat, outs.iter().zip(base).filter(|(a, b)| a == b).count(), outs.len()))
        })
        .collect();
    let tps = |path: &str, sd: Sd| -> Vec<f64> {
        runs.iter().filter(|r| r.path == path && r.sd == sd).map(|r| r.tokens_per_s).collect()
    };
    let mut ratios = Vec::new();
    let mut speedups = Vec::new();
    for &sd in &args.sd {
        let r: Vec<f64> = tps("http", sd).iter().zip(tps("in_process", sd)).map(|(h, i)| h / i).collect();
        let (lo, hi) = r.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
        ratios.push((sd, median(&r), lo, hi));
        if sd != Sd::Off && args.sd.contains(&Sd::Off) {
            let up = |path: &str| -> f64 {
                median(&tps(path, sd).iter().zip(tps(path, Sd::Off)).map(|(on, off)| on / off).collect::<Vec<_>>())
            };
            speedups.push((sd, up("in_process"), up("http")));
        }
    }
    let concurrency = concurrency(&model, args, &reqs[0].ids)?;
    let report = ServeReport {
        header: Header::new("serve", 1, timestamp, machine),
        requests: reqs.len(),
        mean_prompt_tokens: mean_prompt,
        limit_p50_p90_max: (pick(0.5), pick(0.9), pick(1.0)),
        http_over_in_process: ratios,
        sd_speedup: speedups,
        equal_to_off,
        runs,
        concurrency,
        tuned_allocator,
    };
    report::write_outputs("serve", &report, &markdown(&report, args))?;
    // Written first, so that the differing outputs are on record.
    let differing: usize = report.runs.iter().map(|r| r.differing.len()).sum();
    if differing > 0 {
        bail!("{differing} HTTP outputs differ from their in-process twins (listed in target/bench/serve.json)");
    }
    if let Some((sd, repeat, equal, n)) = report.equal_to_off.iter().find(|e| e.2 != e.3) {
        bail!("SD {sd:?}, repeat {repeat}: {equal} of {n} outputs equal SD off's (lossless decoding gives all)");
    }
    Ok(())
}

fn markdown(r: &ServeReport, args: &ServeArgs) -> String {
    let mut s = format!(
        "# bench serve\n\n{} on {} ({} threads), commit {}\n\n`{}`\n\n{} requests ({} prompts x {} samples, T = {}), \
         mean prompt {:.0} tokens, token limits p50/p90/max {}/{}/{}; allocator: {}\n\n\
         | path | SD | repeat | wall s | tokens | tok/s | rounds | SD rounds | accept length | p50 s | p99 s | equal to in-process |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        r.header.timestamp,
        r.header.machine.cpu_model,
        r.header.machine.candle_threads,
        r.header.git_commit,
        r.header.command_line,
        r.requests,
        args.prompts,
        args.samples,
        args.temperature,
        r.mean_prompt_tokens,
        r.limit_p50_p90_max.0,
        r.limit_p50_p90_max.1,
        r.limit_p50_p90_max.2,
        if r.tuned_allocator { "the server binary's (`tlt_serve::tune_allocator`)" } else { "glibc's defaults" },
    );
    let opt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    for run in &r.runs {
        s += &format!(
            "| {} | {} | {} | {:.1} | {} | {:.1} | {} | {} | {} | {} | {} | {} |\n",
            run.path,
            format!("{:?}", run.sd).to_lowercase(),
            run.repeat,
            run.wall_s,
            run.tokens,
            run.tokens_per_s,
            run.rounds,
            run.sd_rounds_accept.map_or("-".to_string(), |a| a.0.to_string()),
            run.sd_rounds_accept.map_or("-".to_string(), |a| format!("{:.2}", a.1)),
            opt(run.latency_p50_s),
            opt(run.latency_p99_s),
            run.outputs_equal.map_or("-".to_string(), |n| n.to_string()),
        );
    }
    for run in r.runs.iter().filter(|r| !r.differing.is_empty()) {
        for d in &run.differing {
            s += &format!(
                "\nDiffers ({:?}, repeat {}): request {} (seed {}), {} tokens over HTTP vs {} in process, from position {}\n",
                run.sd, run.repeat, d.request, d.seed, d.tokens.0, d.tokens.1, d.first_difference
            );
        }
    }
    for run in &r.runs {
        if let Some((steps, on_device)) = run.drafter_steps_on_device {
            let site = if on_device { "on the device" } else { "on the host" };
            s += &format!(
                "\nOnline drafter (HTTP, repeat {}): {steps} optimizer steps during the run, {site}\n",
                run.repeat
            );
        }
    }
    s += "\nHTTP / in-process throughput, median over pairs (target >= 0.95):";
    for (sd, m, lo, hi) in &r.http_over_in_process {
        s += &format!(" SD {sd:?} {m:.3} ({lo:.3}..{hi:.3});");
    }
    s += "\n\nOutputs equal to SD off's (in process, same repeat):";
    for (sd, repeat, equal, n) in &r.equal_to_off {
        s += &format!(" SD {sd:?} repeat {repeat}: {equal} of {n};");
    }
    s += "\n\nSpeed-up over SD off, median over repeats:";
    for (sd, inp, http) in &r.sd_speedup {
        s += &format!(" SD {sd:?}: in process {inp:.3}, HTTP {http:.3};");
    }
    let c = &r.concurrency;
    s += &format!(
        "\n\nConcurrency: {} requests at once, {} completed in {:.1} s; waiting/running after: {}/{}; resident memory \
         {:.0} MiB before, peak {:.0} MiB\n",
        c.requests,
        c.completed,
        c.wall_s,
        c.left_waiting_running.0,
        c.left_waiting_running.1,
        c.rss_before_mib,
        c.rss_peak_mib,
    );
    s
}
