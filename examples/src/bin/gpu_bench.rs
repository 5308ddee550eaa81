//! `gpu-bench`: batched decode and verify-k of a real architecture's shapes on a CUDA device, with synthetic bf16
//! weights generated on the device, against the device's measured copy bandwidth (build with `--features cuda`).
//! Each decode batch runs eagerly and then through CUDA graphs (captured on first use, replayed after); then the
//! engine on the device (`CudaTarget`, verification on the device) decodes one request plainly and with a perfect
//! oracle drafter at several tokens per round; last, one level of an EAGLE-2 drafter of the same shape on the device
//! (`CudaDrafter`: a draft tree level of `--drafter-top-k` rows per sequence over a `--context` cache, with its
//! top-k), beside the target's decode step at the same batch. Prints markdown tables and writes JSON.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use tlt_kernels::cuda::{gpu, CudaGpu, DeviceBuf, SharedGpu, MAX_TREE_NODES};
use tlt_model::cuda::{CudaLlama, DeviceSeq};
use tlt_model::LlamaConfig;
use tlt_spec_decode::cuda::CudaTarget;
use tlt_spec_decode::{Corruption, Counters, Drafter, Engine, OracleDrafter, Plan, RequestId, SpecParams};

#[derive(Parser, Debug)]
#[command(about = "Decode and verify-k timings of an architecture on a CUDA device (synthetic bf16 weights)")]
struct Args {
    /// smollm2-135m, qwen2.5-1.5b, qwen2.5-7b, llama3-8b, qwen3-0.6b or qwen3-8b.
    #[arg(long, default_value = "smollm2-135m")]
    arch: String,
    /// `cuda` or `cuda:N`.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Batch sizes of the decode sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128,256")]
    batches: Vec<usize>,
    /// Committed tokens per sequence before the timed steps.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Timed steps per measurement (the median is reported).
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Verify widths measured at batch 1 (tokens per verify forward).
    #[arg(long, value_delimiter = ',', default_value = "2,4,6,8")]
    verify: Vec<usize>,
    /// Mean tokens per round of the measured oracle speculative decoding at batch 1 (a perfect oracle drafting
    /// `tau - 1` tokens per round, verified on the device through the engine).
    #[arg(long, value_delimiter = ',', default_value = "2,4,6")]
    tau: Vec<usize>,
    /// Tokens generated per oracle run.
    #[arg(long, default_value_t = 256)]
    sd_tokens: usize,
    /// JSON output.
    /// Rows per sequence of the timed EAGLE drafter level (its top-k, the draft tree's width).
    #[arg(long, default_value_t = 4)]
    drafter_top_k: usize,
    /// Batches of the EAGLE drafter level (empty: skip it).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    drafter_batches: Vec<usize>,
    #[arg(long, default_value = "target/bench/gpu-decode.json")]
    out: std::path::PathBuf,
}

/// Published shapes of the architectures the issue names (config.json of each model).
fn config(arch: &str) -> Result<LlamaConfig> {
    // (model_type, hidden, intermediate, layers, heads, kv heads, vocab, tied, rope theta)
    let (mt, h, i, l, nh, kv, v, tied, theta) = match arch {
        "smollm2-135m" => ("llama", 576, 1536, 30, 9, 3, 49_152, true, 100_000.0),
        "qwen2.5-1.5b" => ("qwen2", 1536, 8960, 28, 12, 2, 151_936, true, 1_000_000.0),
        "qwen2.5-7b" => ("qwen2", 3584, 18_944, 28, 28, 4, 152_064, false, 1_000_000.0),
        "llama3-8b" => ("llama", 4096, 14_336, 32, 32, 8, 128_256, false, 500_000.0),
        // Qwen3's head_dim is its config default, 128 (0.6B: 16 heads of 128 in a width of 1024).
        "qwen3-0.6b" => ("qwen3", 1024, 3072, 28, 16, 8, 151_936, true, 1_000_000.0),
        "qwen3-8b" => ("qwen3", 4096, 12_288, 36, 32, 8, 151_936, false, 1_000_000.0),
        other => bail!("unknown architecture {other}"),
    };
    let mut c = LlamaConfig::tiny(v, h, l);
    c.model_type = mt.into();
    c.intermediate_size = i;
    c.num_attention_heads = nh;
    c.num_key_value_heads = Some(kv);
    c.tie_word_embeddings = tied;
    c.rope_theta = theta;
    c.max_position_embeddings = 32_768;
    c.rms_norm_eps = 1e-6;
    Ok(c)
}

fn ordinal(device: &str) -> Result<usize> {
    match device.parse::<tlt_model::Device>().map_err(anyhow::Error::msg)? {
        tlt_model::Device::Cuda(n) => Ok(n),
        tlt_model::Device::Cpu => {
            bail!("gpu-bench runs on CUDA only (`cargo xtask bench decode` is the CPU suite)")
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `steps` forwards of `n` tokens for each of `batch` sequences at `context` (a decode step for
/// `n == 1`, else the verification of an `n`-node draft chain, as speculative decoding runs it).
fn time_forward(m: &mut CudaLlama, batch: usize, n: usize, context: usize, steps: usize) -> Result<f64> {
    let tokens: Vec<u32> = (0..n as u32).map(|t| 100 + t).collect();
    let chain: Vec<i32> = (0..n as i32).map(|i| i - 1).collect();
    let parents = (n > 1).then_some(chain.as_slice());
    let seqs: Vec<DeviceSeq> =
        (0..batch).map(|slot| DeviceSeq { slot, prefix_len: context, tokens: &tokens, parents }).collect();
    let mut times = Vec::with_capacity(steps);
    for step in 0..steps + 3 {
        let t0 = Instant::now();
        m.forward(&seqs)?;
        m.gpu().synchronize().context("synchronize")?;
        if step >= 3 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// Device-to-device copy bandwidth (read + write bytes per second) over a 1 GiB buffer.
fn copy_bandwidth(m: &CudaLlama) -> Result<f64> {
    let n = 1usize << 30; // bytes: 1 GiB
    let g = m.gpu().as_ref();
    let src = DeviceBuf::<u8>::zeros(g, n).context("alloc")?;
    let dst = DeviceBuf::<u8>::zeros(g, n).context("alloc")?;
    let mut times = Vec::new();
    for rep in 0..12 {
        let t0 = Instant::now();
        gpu::copy(g, src.buf(), dst.buf()).context("memcpy")?;
        g.synchronize().context("synchronize")?;
        if rep >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * n as f64 / median(times))
}

/// Wall seconds of the decode phase (prefill excluded) of one greedy request through the engine on `target`, and
/// its tokens and counters.
fn engine_run(
    target: &CudaTarget,
    prompt: &[u32],
    n: usize,
    drafter: Option<(&mut OracleDrafter, Plan)>,
) -> Result<(f64, Vec<u32>, Counters)> {
    let params = SpecParams { stop_token_ids: Some(Vec::new()), ..SpecParams::greedy(n) };
    let mut engine = Engine::new(target, params)?;
    let id = engine.add_request(prompt)?;
    let t0 = Instant::now();
    match drafter {
        Some((d, plan)) => {
            engine.run_to_completion(Some(d as &mut dyn Drafter), &plan)?;
        }
        None => engine.run_to_completion(None, &Plan::chain(1))?,
    }
    let secs = t0.elapsed().as_secs_f64() - engine.counters().prefill_s;
    let f = engine.take_finished().into_iter().find(|f| f.id == id).context("the request did not finish")?;
    Ok((secs, f.tokens, *engine.counters()))
}

/// Measured oracle speculative decoding at batch 1: plain decoding through the engine (device sampling, graphs),
/// then a perfect oracle drafting `tau - 1` tokens per round of the continuation the verify shape commits; speed-up
/// over plain and whether the tokens equal plain decoding's (greedy SD is lossless up to the near ties that two
/// GEMM shapes may round differently in bf16; `identical_to_plain` says whether any occurred).
fn oracle_sd(target: &CudaTarget, cfg: &LlamaConfig, a: &Args) -> Result<Vec<serde_json::Value>> {
    let prompt: Vec<u32> = (0..a.context as u32).map(|i| (i * 7919 + 13) % cfg.vocab_size as u32).collect();
    let mut plain = Vec::new();
    let mut reference = Vec::new();
    for _ in 0..3 {
        let (t, toks, _) = engine_run(target, &prompt, a.sd_tokens, None)?;
        plain.push(t);
        reference = toks;
    }
    let plain = median(plain);
    println!(
        "\nengine on the device, batch 1, {} tokens after a {}-token prompt (decode phase):",
        a.sd_tokens, a.context
    );
    println!("| drafter | tokens/round | ms/token | speed-up over plain | identical |\n|---|---:|---:|---:|---|");
    println!("| none (plain) | 1.00 | {:.3} | 1.00x | - |", plain * 1e3 / a.sd_tokens as f64);
    let mut rows = vec![serde_json::json!({"tau": 1, "decode_s": plain, "speedup": 1.0})];
    for &tau in &a.tau {
        let steps = tau.saturating_sub(1).max(1);
        let plan = Plan { steps, top_k: 1, verify_tokens: steps + 1 };
        let run = |reference: &[u32]| {
            let mut oracle = OracleDrafter::new(cfg.vocab_size, Corruption::Rate { rate: 0.0, seed: 0 }, false)?;
            oracle.insert(RequestId(0), prompt.len(), reference.to_vec());
            engine_run(target, &prompt, a.sd_tokens, Some((&mut oracle, plan)))
        };
        // The oracle's reference comes from the verify shape: the decode shape's tokens can differ from the verify
        // shape's where two logits nearly tie (other cuBLAS kernels, other rounding; random weights make ties
        // common), and each such token would end a round early and understate the speed-up. So run SD, take what it
        // committed as the next reference, until a run commits its own reference (every draft then accepted).
        let mut own = reference.clone();
        let mut calibration_runs = 0;
        for _ in 0..4 {
            let (_, toks, _) = run(&own)?;
            calibration_runs += 1;
            if toks == own {
                break;
            }
            own = toks;
        }
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..3 {
            let (t, toks, c) = run(&own)?;
            times.push(t);
            last = Some((toks, c));
        }
        let (toks, c) = last.context("no run")?;
        let t = median(times);
        let same = toks == reference;
        println!(
            "| oracle, {} drafts | {:.2} | {:.3} | {:.2}x | {same} |",
            steps,
            c.mean_accept_len(),
            t * 1e3 / a.sd_tokens as f64,
            plain / t
        );
        rows.push(serde_json::json!({
            "tau": tau, "tokens_per_round": c.mean_accept_len(), "decode_s": t, "speedup": plain / t,
            "identical_to_plain": same, "reference_fixed_point": toks == own, "calibration_runs": calibration_runs,
        }));
    }
    Ok(rows)
}

/// One EAGLE-2 draft level on the device per batch: seconds (median), beside the target's decode step.
fn drafter_level(
    gpu: &SharedGpu,
    cfg: &LlamaConfig,
    a: &Args,
    decode: &[(usize, f64)],
) -> Result<Vec<serde_json::Value>> {
    use tlt_drafter::cuda::{CudaDraftOptions, CudaDrafter, DeviceDraftCache};
    use tlt_drafter::{
        Attend, DraftExecutor, DraftRuntime, DrafterConfig, Eagle2Drafter, FrozenTarget, Row, RuntimeOptions,
    };
    if a.drafter_batches.is_empty() {
        return Ok(Vec::new());
    }
    // The target's embedding and head at this shape (one layer: the drafter reads only those).
    let target = tlt_model::Llama::random(LlamaConfig { num_hidden_layers: 1, ..cfg.clone() }, 7)?;
    let d = Eagle2Drafter::random(
        DrafterConfig::eagle2_from_target(target.config(), false),
        FrozenTarget::new(&target),
        8,
    )?;
    let f32s = tlt_kernels::WeightDType::F32;
    let rt = DraftRuntime::eagle2(&d, &RuntimeOptions { layer_dtype: f32s, head_dtype: f32s, hot_vocab: None })?;
    let max_batch = a.drafter_batches.iter().copied().max().unwrap_or(1);
    let opts = CudaDraftOptions { slots: max_batch, max_len: a.context + MAX_TREE_NODES };
    let mut exec = CudaDrafter::new(gpu.clone(), opts)?;
    exec.load(&rt, 0)?;
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
            exec.forward(&rt, &rows, &mut g, 0)?;
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
                exec.forward(&rt, &level, &mut groups, k)?;
            }
            times.push(start.elapsed().as_secs_f64());
            for c in &mut caches {
                exec.truncate_tentative(&rt, c);
            }
        }
        let t = median(times);
        let dec = decode.iter().find(|(bb, _)| *bb == b).map_or(f64::NAN, |&(_, s)| s);
        println!("| {b} | {:.3} | {:.3} | {:.2} |", t * 1e3, dec * 1e3, t / dec);
        rows_out.push(serde_json::json!({"batch": b, "rows_per_seq": k, "level_s": t, "target_decode_s": dec}));
    }
    Ok(rows_out)
}

fn main() -> Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let a = Args::parse();
    let cfg = config(&a.arch)?;
    let max_batch = a.batches.iter().copied().max().unwrap_or(1);
    let max_len = a.context + a.verify.iter().copied().max().unwrap_or(1) + a.sd_tokens + MAX_TREE_NODES + 8;
    let gpu: SharedGpu = CudaGpu::open(ordinal(&a.device)?)?;
    let mut m = CudaLlama::synthetic(cfg.clone(), 42, gpu.clone(), max_batch, max_len)?;
    let copy = copy_bandwidth(&m)?;
    let weights = m.weight_bytes() as f64;
    let kv_row = (cfg.kv_dim() * 2 * 2 * cfg.num_hidden_layers) as f64; // K and V, bf16, every layer
    println!(
        "{} on {}: weights {:.2} GB, copy bandwidth {:.0} GB/s, context {}",
        a.arch,
        a.device,
        weights / 1e9,
        copy / 1e9,
        a.context
    );
    println!("| batch | step ms | tok/s | GB/s (weights + KV) | of copy bw |\n|---:|---:|---:|---:|---:|");
    let mut decode = Vec::new();
    for graphs in [false, true] {
        if graphs {
            m.enable_graphs(max_batch, 8 << 30);
            println!("\nwith CUDA graphs:\n| batch | step ms | tok/s | GB/s (weights + KV) | of copy bw |\n|---:|---:|---:|---:|---:|");
        }
        for &b in &a.batches {
            let t = time_forward(&mut m, b, 1, a.context, a.steps)?;
            let bytes = weights + b as f64 * a.context as f64 * kv_row;
            let bw = bytes / t;
            println!("| {b} | {:.3} | {:.0} | {:.0} | {:.2} |", t * 1e3, b as f64 / t, bw / 1e9, bw / copy);
            decode.push(serde_json::json!({"graphs": graphs, "batch": b, "step_s": t, "tokens_per_s": b as f64 / t, "bytes": bytes, "bandwidth": bw, "of_copy": bw / copy}));
        }
    }
    println!("\ngraph pool: {:?}", m.graph_stats());
    let t1 = time_forward(&mut m, 1, 1, a.context, a.steps)?;
    println!("\nwith CUDA graphs:\n| verify k (batch 1) | ms | verify / decode-1 | oracle SD at tau = k (k x decode / verify) |\n|---:|---:|---:|---:|");
    let mut verify = Vec::new();
    for &k in &a.verify {
        let t = time_forward(&mut m, 1, k, a.context, a.steps)?;
        println!("| {k} | {:.3} | {:.3} | {:.2}x |", t * 1e3, t / t1, k as f64 * t1 / t);
        verify.push(
            serde_json::json!({"k": k, "step_s": t, "over_decode": t / t1, "oracle_sd_speedup": k as f64 * t1 / t}),
        );
    }
    let target = CudaTarget::from_model(m);
    let oracle = oracle_sd(&target, &cfg, &a)?;
    println!("\ngraph pool after the engine runs: {:?}", target.with_model(|m| m.graph_stats().cloned())?);
    drop(target);
    let graphs_decode: Vec<(usize, f64)> = decode
        .iter()
        .filter(|d| d["graphs"] == true)
        .filter_map(|d| Some((usize::try_from(d["batch"].as_u64()?).ok()?, d["step_s"].as_f64()?)))
        .collect();
    let drafter = drafter_level(&gpu, &cfg, &a, &graphs_decode)?;
    let json = serde_json::json!({
        "arch": a.arch, "device": a.device, "context": a.context, "steps": a.steps,
        "weight_bytes": weights, "copy_bandwidth": copy, "decode": decode, "decode_1_s": t1, "verify": verify,
        "oracle_sd": oracle, "drafter_level": drafter,
    });
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&json)?)?;
    println!("\nJSON: {}", a.out.display());
    Ok(())
}
