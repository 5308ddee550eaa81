//! `gpu-bench --contexts`: decode and verify-k over contexts (512 to 32K keys), each step beside the roofline's
//! prediction at the copy bandwidth measured in the same process (`tlt_model::device_step::roofline`), so a GPU run
//! says at once where the model of the hardware is wrong. A fresh synthetic model per context, its KV cache sized
//! for it; batches whose weights and KV cache would take more than 3/4 of the device's memory are left out.

use anyhow::Result;
use tlt_kernels::cuda::SharedGpu;
use tlt_model::cuda::CudaLlama;
use tlt_model::device_step::roofline::{self, memory_bytes, Hardware};
use tlt_model::LlamaConfig;

use crate::args::Args;
use crate::timing::time_forward;

/// Runs the sweep; returns its JSON rows.
pub fn run(g: &SharedGpu, cfg: &LlamaConfig, a: &Args, copy: f64) -> Result<Vec<serde_json::Value>> {
    let info = g.info();
    let hw = Hardware::measured(&info.name, info.multiprocessors, info.total_memory, copy);
    let k = a.sweep_verify;
    let kv_row = (cfg.kv_dim() * 2 * 2 * cfg.num_hidden_layers) as f64;
    println!(
        "\ncontext sweep ({}, graphs; predicted: the roofline of {} at the measured {:.0} GB/s):\n| context | batch | new \
         tokens | step ms | predicted ms | measured / predicted | of copy bw | verify / decode-1 |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|",
        a.arch,
        hw.name,
        copy / 1e9
    );
    let mut rows = Vec::new();
    for &ctx in &a.contexts {
        let len = ctx + k + 8;
        let budget = 0.75 * info.total_memory as f64;
        let fits: Vec<usize> =
            a.sweep_batches.iter().copied().filter(|&b| memory_bytes(cfg, b, len) <= budget).collect();
        let Some(&max_b) = fits.iter().max() else {
            println!("| {ctx} | - | - | does not fit | | | | |");
            continue;
        };
        let mut m = CudaLlama::synthetic(cfg.clone(), 42, g.clone(), max_b, len)?;
        m.enable_graphs(max_b, 8 << 30);
        let mut decode_1 = None;
        for (b, n) in fits.iter().map(|&b| (b, 1)).chain([(1, k)]) {
            let t = time_forward(&mut m, b, n, ctx, a.steps)?;
            if (b, n) == (1, 1) {
                decode_1 = Some(t);
            }
            let p = roofline::step(&a.arch, cfg, hw, b, n, ctx)?;
            let bytes = m.weight_bytes() as f64 + (b * (ctx + n)) as f64 * kv_row;
            let of_copy = bytes / t / copy;
            let over = if n > 1 { decode_1.map(|d| t / d) } else { None };
            println!(
                "| {ctx} | {b} | {n} | {:.3} | {:.3} | {:.2} | {of_copy:.2} | {} |",
                t * 1e3,
                p.seconds * 1e3,
                t / p.seconds,
                over.map_or(String::new(), |r| format!("{r:.3}"))
            );
            rows.push(serde_json::json!({"context": ctx, "batch": b, "n": n, "step_s": t,
                "predicted_s": p.seconds, "over_predicted": t / p.seconds, "bytes": bytes, "of_copy": of_copy,
                "over_decode": over, "predicted_split_s": p.split}));
        }
    }
    Ok(rows)
}

/// The summary's line of the sweep: per context, decode-1's fraction of copy bandwidth, measured / predicted, and
/// verify-k / decode-1.
pub fn summary(rows: &[serde_json::Value]) -> Option<String> {
    let mut parts = Vec::new();
    for r in rows.iter().filter(|r| r["batch"] == 1) {
        let f = |key: &str| r[key].as_f64().unwrap_or(f64::NAN);
        if r["n"] == 1 {
            parts.push(format!("ctx {} b1 {:.2} bw {:.2}x pred", r["context"], f("of_copy"), f("over_predicted")));
        } else {
            parts.push(format!("v{}/d1 {:.2}", r["n"], f("over_decode")));
        }
    }
    (!parts.is_empty()).then(|| format!("sweep: {}", parts.join(", ")))
}
