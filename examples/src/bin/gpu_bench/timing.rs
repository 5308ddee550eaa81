//! Timing helpers shared by the standard sections and the sweeps.

use std::time::Instant;

use anyhow::{Context, Result};
use tlt_model::cuda::{CudaLlama, DeviceSeq};

/// The middle element (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `steps` forwards of `n` tokens for each of `batch` sequences at `context` (a decode step for
/// `n == 1`, else the verification of an `n`-node draft chain, as speculative decoding runs it).
pub fn time_forward(m: &mut CudaLlama, batch: usize, n: usize, context: usize, steps: usize) -> Result<f64> {
    let tokens: Vec<u32> = (0..n as u32).map(|t| 10 + t).collect();
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
