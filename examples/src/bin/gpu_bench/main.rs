//! `gpu-bench`: batched decode and verify-k of a real architecture's shapes on a device, with synthetic bf16 weights
//! generated on the device, against the device's measured copy bandwidth; then the engine on the device
//! (`CudaTarget`, verification on the device) decoding plainly, with a perfect oracle drafter at several tokens per
//! round and with an EAGLE-2 drafter whose levels run on the device, at several batch sizes, each with its speed-up
//! over plain decoding and whether it committed plain decoding's tokens; last, one EAGLE-2 draft level timed alone.
//!
//! Every section runs on its own: a failing one is reported (in the output and the JSON, with its error) and the rest
//! still run; the process exits with an error when any failed. `--device cuda[:N]` (feature `cuda`) or `--device
//! sim` (the simulated device: CI runs this binary on `--arch tiny` to test it). Prints markdown tables, a summary of
//! the sections last, and writes JSON (rewritten as each section ends, so a killed run keeps what finished).

mod args;
mod sd;
mod sweep;
mod timing;

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use tlt_kernels::cuda::{gpu, DeviceBuf, SharedGpu, MAX_TREE_NODES};
use tlt_model::cuda::CudaLlama;
use tlt_model::device_step::roofline::{self, Hardware};
use tlt_model::LlamaConfig;
use tlt_spec_decode::cuda::CudaTarget;

use args::Args;
use timing::{median, time_forward};

/// Published shapes of the architectures the issue names (config.json of each model), and `tiny`.
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
        "tiny" => ("llama", 64, 128, 2, 4, 2, 96, true, 10_000.0),
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

/// The device `--device` names.
fn open(device: &str) -> Result<SharedGpu> {
    if device == "sim" {
        return Ok(std::sync::Arc::new(tlt_cuda_sim::SimGpu::new(tlt_cuda_sim::Schedule::Lazy)));
    }
    match device.parse::<tlt_model::Device>().map_err(anyhow::Error::msg)? {
        tlt_model::Device::Cuda(n) => Ok(tlt_kernels::cuda::open_device(n)?),
        tlt_model::Device::Cpu => {
            bail!("gpu-bench runs on a device (`cargo xtask bench decode` is the CPU suite)")
        }
    }
}

/// Device-to-device copy bandwidth (read + write bytes per second) over a buffer of `bytes`.
fn copy_bandwidth(g: &SharedGpu, bytes: usize) -> Result<f64> {
    let g = g.as_ref();
    let src = DeviceBuf::<u8>::zeros(g, bytes).context("alloc")?;
    let dst = DeviceBuf::<u8>::zeros(g, bytes).context("alloc")?;
    let mut times = Vec::new();
    for rep in 0..12 {
        let t0 = Instant::now();
        gpu::copy(g, src.buf(), dst.buf()).context("memcpy")?;
        g.synchronize().context("synchronize")?;
        if rep >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * bytes as f64 / median(times))
}

/// The sections' outcomes, in order, and where the JSON goes: it is rewritten as each section ends (atomically: a
/// temporary file renamed over it), so a process killed at its time limit leaves every finished section's results.
struct Sections {
    json: serde_json::Map<String, serde_json::Value>,
    outcomes: Vec<(String, Option<String>)>,
    out: std::path::PathBuf,
}

impl Sections {
    /// The JSON so far: `header`'s fields, then every section's.
    fn document(&self, header: &serde_json::Value) -> serde_json::Value {
        let mut json = header.clone();
        if let Some(o) = json.as_object_mut() {
            o.extend(self.json.clone());
        }
        json
    }

    /// Writes the JSON so far to `out`.
    fn save(&self, header: &serde_json::Value) -> Result<()> {
        if let Some(dir) = self.out.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = self.out.with_extension("json.part");
        std::fs::write(&tmp, serde_json::to_string_pretty(&self.document(header))?)?;
        std::fs::rename(&tmp, &self.out)?;
        Ok(())
    }

    /// Runs section `name`; its value goes to the JSON under `name`, or its error (a panic included) is recorded.
    fn run<T: serde::Serialize>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Option<T> {
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(anyhow::anyhow!("panicked: {}", msg.unwrap_or_default()))
        });
        let v = match ran {
            Ok(v) => {
                self.json.insert(name.into(), serde_json::to_value(&v).unwrap_or(serde_json::Value::Null));
                self.outcomes.push((name.into(), None));
                Some(v)
            }
            Err(e) => {
                let msg = format!("{e:#}");
                eprintln!("section {name} failed: {msg}");
                self.json.insert(name.into(), serde_json::json!({ "error": msg }));
                self.outcomes.push((name.into(), Some(msg)));
                None
            }
        };
        if let Err(e) = self.save(&serde_json::json!({ "partial": true })) {
            eprintln!("writing {}: {e:#}", self.out.display());
        }
        v
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let a = Args::parse();
    let cfg = config(&a.arch)?;
    let g = open(&a.device)?;
    let sim = g.info().simulated;
    let mut s = Sections { json: serde_json::Map::new(), outcomes: Vec::new(), out: a.out.clone() };
    let copy = s.run("copy_bandwidth", || copy_bandwidth(&g, if sim { 1 << 20 } else { 1 << 30 })).unwrap_or(f64::NAN);
    let hw = Hardware::measured(&g.info().name, g.info().multiprocessors, g.info().total_memory, copy);
    println!("{} on {} ({}): copy bandwidth {:.0} GB/s", a.arch, a.device, g.info().name, copy / 1e9);
    if !a.sweep_only {
        standard(&g, &cfg, &a, hw, &mut s);
    }
    if !a.contexts.is_empty() {
        s.run("context_sweep", || sweep::run(&g, &cfg, &a, copy));
    }
    let header = serde_json::json!({
        "arch": a.arch, "device": a.device, "device_name": g.info().name, "context": a.context, "steps": a.steps,
        "copy_bandwidth": copy,
    });
    s.save(&header)?;
    let json = s.document(&header);
    println!("\nJSON: {}", a.out.display());
    for line in summary(&json, &s.outcomes) {
        println!("summary: {line}");
    }
    let failed = s.outcomes.iter().filter(|(_, e)| e.is_some()).count();
    if failed > 0 {
        bail!("{failed} of {} sections failed", s.outcomes.len());
    }
    Ok(())
}

/// The standard sections on one model at `--context`: decode (eager and graphs) and verify-k, each beside the
/// roofline's prediction on `hw`, then the engine's oracle and EAGLE-2 speculative decoding and one draft level.
fn standard(g: &SharedGpu, cfg: &LlamaConfig, a: &Args, hw: Hardware, s: &mut Sections) {
    let copy = hw.bytes_per_s;
    let max_batch = a.batches.iter().chain(&a.sd_batches).copied().max().unwrap_or(1);
    let max_len = a.context + a.verify.iter().copied().max().unwrap_or(1) + a.sd_tokens + 2 * MAX_TREE_NODES + 8;
    let mut m = match CudaLlama::synthetic(cfg.clone(), 42, g.clone(), max_batch, max_len) {
        Ok(m) => m,
        Err(e) => {
            let msg = format!("{e:#}");
            eprintln!("section model failed: {msg}");
            s.json.insert("model".into(), serde_json::json!({ "error": msg }));
            s.outcomes.push(("model".into(), Some(msg)));
            return;
        }
    };
    let weights = m.weight_bytes() as f64;
    s.json.insert("weight_bytes".into(), weights.into());
    let kv_row = (cfg.kv_dim() * 2 * 2 * cfg.num_hidden_layers) as f64; // K and V, bf16, every layer
    println!("weights {:.2} GB, context {}", weights / 1e9, a.context);
    let predict =
        |b: usize, n: usize| roofline::step(&a.arch, cfg, hw, b, n, a.context).map_or(f64::NAN, |p| p.seconds);
    let decode = s
        .run("decode", || {
            let mut rows = Vec::new();
            for graphs in [false, true] {
                if graphs {
                    m.enable_graphs(max_batch, 8 << 30);
                }
                println!(
                    "\n{}:\n| batch | step ms | tok/s | GB/s (weights + KV) | of copy bw | predicted ms | measured / \
                     predicted |\n|---:|---:|---:|---:|---:|---:|---:|",
                    if graphs { "with CUDA graphs" } else { "eager" }
                );
                for &b in &a.batches {
                    let t = time_forward(&mut m, b, 1, a.context, a.steps)?;
                    let bytes = weights + b as f64 * a.context as f64 * kv_row;
                    let bw = bytes / t;
                    let p = predict(b, 1);
                    println!(
                        "| {b} | {:.3} | {:.0} | {:.0} | {:.2} | {:.3} | {:.2} |",
                        t * 1e3,
                        b as f64 / t,
                        bw / 1e9,
                        bw / copy,
                        p * 1e3,
                        t / p
                    );
                    rows.push(serde_json::json!({"graphs": graphs, "batch": b, "step_s": t,
                        "tokens_per_s": b as f64 / t, "bytes": bytes, "bandwidth": bw, "of_copy": bw / copy,
                        "predicted_s": p, "over_predicted": t / p}));
                }
            }
            println!("\ngraph pool: {:?}", m.graph_stats());
            Ok(rows)
        })
        .unwrap_or_default();
    s.run("verify", || {
        let t1 = time_forward(&mut m, 1, 1, a.context, a.steps)?;
        println!(
            "\n| verify k (batch 1) | ms | verify / decode-1 | oracle SD at tau = k (k x decode / verify) | predicted ms \
             | measured / predicted |\n|---:|---:|---:|---:|---:|---:|"
        );
        let mut rows = vec![serde_json::json!({"k": 1, "step_s": t1})];
        for &k in &a.verify {
            let t = time_forward(&mut m, 1, k, a.context, a.steps)?;
            let p = predict(1, k);
            println!(
                "| {k} | {:.3} | {:.3} | {:.2}x | {:.3} | {:.2} |",
                t * 1e3,
                t / t1,
                k as f64 * t1 / t,
                p * 1e3,
                t / p
            );
            rows.push(serde_json::json!({"k": k, "step_s": t, "over_decode": t / t1,
                "oracle_sd_speedup": k as f64 * t1 / t, "predicted_s": p, "over_predicted": t / p}));
        }
        Ok(rows)
    });
    let target = CudaTarget::from_model(m);
    s.run("oracle_sd", || sd::oracle(&target, cfg, a));
    let mut eagle = None;
    if !a.no_eagle {
        s.run("eagle2_drafter", || {
            eagle = Some(sd::eagle2_runtime(cfg)?);
            Ok(())
        });
    }
    if let Some(rt) = &eagle {
        s.run("eagle2_sd", || sd::eagle(g, &target, rt, cfg, a));
    }
    if let Ok(stats) = target.with_model(|m| m.graph_stats().cloned()) {
        println!("\ngraph pool after the engine runs: {stats:?}");
    }
    drop(target);
    let graphs_decode: Vec<(usize, f64)> = decode
        .iter()
        .filter(|d| d["graphs"] == true)
        .filter_map(|d| Some((usize::try_from(d["batch"].as_u64()?).ok()?, d["step_s"].as_f64()?)))
        .collect();
    if let Some(rt) = &eagle {
        s.run("drafter_level", || sd::drafter_level(g, rt, cfg, a, &graphs_decode));
    }
}

/// A few lines for the GPU plan's summary (`run.sh` keeps the lines starting `summary:`): decode at the smallest and
/// largest batch with graphs, the widest verify against decode, each SD row's speed-up and whether it committed plain
/// decoding's tokens (`=`) or not (`DIFFERS`), and the sections that failed.
fn summary(json: &serde_json::Value, outcomes: &[(String, Option<String>)]) -> Vec<String> {
    let mut lines = Vec::new();
    let rows = |key: &str| json[key].as_array().cloned().unwrap_or_default();
    let graphs: Vec<_> = rows("decode").into_iter().filter(|d| d["graphs"] == true).collect();
    if let (Some(first), Some(last)) = (graphs.first(), graphs.last()) {
        let f = |d: &serde_json::Value| {
            format!(
                "b{} {:.3} ms ({:.2} of copy bw)",
                d["batch"],
                d["step_s"].as_f64().unwrap_or(f64::NAN) * 1e3,
                d["of_copy"].as_f64().unwrap_or(f64::NAN)
            )
        };
        let verify = rows("verify").last().and_then(|v| Some((v["k"].as_u64()?, v["over_decode"].as_f64()?)));
        let v = verify.map_or(String::new(), |(k, r)| format!("; verify-{k} / decode-1 {r:.3}"));
        lines.push(format!("decode with graphs: {}, {}{v}", f(first), f(last)));
    }
    for key in ["oracle_sd", "eagle2_sd"] {
        let sd: Vec<String> = rows(key)
            .iter()
            .filter(|r| r["identical_to_plain"].is_boolean())
            .map(|r| {
                let tag = r["tau"].as_u64().map_or(String::new(), |t| format!(" tau {t}"));
                let same = if r["identical_to_plain"] == true { "=" } else { "DIFFERS" };
                format!("b{}{tag} {:.2}x {same}", r["batch"], r["speedup"].as_f64().unwrap_or(f64::NAN))
            })
            .collect();
        if !sd.is_empty() {
            lines.push(format!("{key} (speed-up over plain, tokens = plain's): {}", sd.join(", ")));
        }
    }
    if let Some(line) = sweep::summary(&rows("context_sweep")) {
        lines.push(line);
    }
    let failed: Vec<&str> = outcomes.iter().filter(|(_, e)| e.is_some()).map(|(n, _)| n.as_str()).collect();
    lines.push(if failed.is_empty() {
        format!("all {} sections ok", outcomes.len())
    } else {
        let first = outcomes.iter().find_map(|(_, e)| e.as_deref()).unwrap_or_default();
        format!("FAILED sections: {} (first: {})", failed.join(", "), first.chars().take(120).collect::<String>())
    });
    lines
}
