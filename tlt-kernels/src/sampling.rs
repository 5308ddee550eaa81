//! Sampling primitives on logit rows: greedy [`argmax`], the temperature / top-k / top-p distribution
//! ([`probs`]), [`log_softmax`] and inverse-CDF [`categorical`] draws driven by the deterministic RNG
//! ([`SeededRng`]) with per-sequence streams.
//!
//! Logits may be finite or `-inf` (a masked token); `NaN` and `+inf` are rejected. Probabilities are computed with
//! the maximum subtracted (so they never overflow) and summed in f64.

use std::cmp::Ordering;

use crate::attention::exp_approx;
use crate::{Error, Result, SeededRng};

/// How to turn logits into a sampling distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature (`>= 0`, finite). `0` means greedy: all mass on the first maximum.
    pub temperature: f32,
    /// Keep only the `k` most probable tokens (`k >= 1`; ties broken by lower token id).
    pub top_k: Option<usize>,
    /// Nucleus sampling: keep the smallest set of most probable tokens whose mass is at least `top_p`
    /// (`0 < top_p <= 1`), applied after top-k.
    pub top_p: Option<f32>,
}

impl Default for SamplingParams {
    /// Temperature 1, no top-k, no top-p: the model's own distribution.
    fn default() -> Self {
        Self { temperature: 1.0, top_k: None, top_p: None }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0).
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Checks the ranges: `temperature` finite and `>= 0`, `top_k >= 1`, `0 < top_p <= 1`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(invalid(format!("temperature must be finite and >= 0, got {}", self.temperature)));
        }
        if self.top_k == Some(0) {
            return Err(invalid("top_k must be at least 1".into()));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(invalid(format!("top_p must be in (0, 1], got {p}")));
            }
        }
        Ok(())
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// The maximum of a logit row, rejecting empty rows and NaN.
fn row_max(row: &[f32]) -> Result<f32> {
    if row.is_empty() {
        return Err(invalid("empty logit row".into()));
    }
    // Eight independent lanes so the loop vectorises.
    let mut mx = [f32::NEG_INFINITY; 8];
    let mut nan = [false; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            nan[l] |= c[l].is_nan();
            mx[l] = if c[l] > mx[l] { c[l] } else { mx[l] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    let mut any_nan = nan.iter().any(|&b| b);
    for &x in mx.iter().chain(tail) {
        any_nan |= x.is_nan();
        m = if x > m { x } else { m };
    }
    if any_nan {
        let i = row.iter().position(|x| x.is_nan()).unwrap_or(0);
        return Err(invalid(format!("NaN logit at index {i}")));
    }
    Ok(m)
}

/// Like [`row_max`], also rejecting `+inf` and rows with no finite logit.
fn finite_max(row: &[f32]) -> Result<f32> {
    let m = row_max(row)?;
    if m == f32::INFINITY {
        return Err(invalid("+inf logit".into()));
    }
    if m == f32::NEG_INFINITY {
        return Err(invalid("every logit is -inf".into()));
    }
    Ok(m)
}

/// Sum in f64 over eight lanes (vectorisable).
fn sum_f64(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l] as f64;
        }
    }
    acc.iter().sum::<f64>() + tail.iter().map(|&v| v as f64).sum::<f64>()
}

/// Index of the first maximum of `row`.
///
/// # Errors
/// [`Error::InvalidArgument`] for an empty row or a NaN anywhere in it.
pub fn argmax(row: &[f32]) -> Result<usize> {
    let m = row_max(row)?;
    Ok(row.iter().position(|&x| x == m).unwrap_or(0))
}

/// `(p desc, id asc)`: the order in which top-k and top-p keep tokens.
fn by_prob_desc(p: &[f32], a: u32, b: u32) -> Ordering {
    p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b))
}

/// The dense sampling distribution of `logits` under `params`: softmax at `temperature`, then top-k, then top-p
/// (the smallest set of most probable tokens whose mass is `>= top_p`, ties broken by lower token id), then
/// renormalised. Tokens outside the kept set are exactly 0. Temperature 0 gives the one-hot first argmax.
///
/// # Errors
/// [`Error::InvalidArgument`] for invalid `params`, an empty row, NaN or `+inf` logits, or all logits `-inf`.
///
/// ```
/// use tlt_kernels::{probs, SamplingParams};
///
/// # fn main() -> tlt_kernels::Result<()> {
/// let p = probs(&[0.0, (3f32).ln(), f32::NEG_INFINITY], &SamplingParams::default())?;
/// assert!((p[0] - 0.25).abs() < 1e-6 && (p[1] - 0.75).abs() < 1e-6 && p[2] == 0.0);
/// let p = probs(&[0.0, (3f32).ln(), 0.1], &SamplingParams { top_k: Some(1), ..Default::default() })?;
/// assert_eq!(p, vec![0.0, 1.0, 0.0]);
/// # Ok(()) }
/// ```
pub fn probs(logits: &[f32], params: &SamplingParams) -> Result<Vec<f32>> {
    params.validate()?;
    let mx = finite_max(logits)?;
    let v = logits.len();
    if params.temperature == 0.0 {
        let mut p = vec![0.0; v];
        p[logits.iter().position(|&x| x == mx).unwrap_or(0)] = 1.0;
        return Ok(p);
    }
    let t = params.temperature;
    // Dividing after subtracting keeps the maximum at exactly exp(0) = 1 even for tiny temperatures.
    let mut p: Vec<f32> = logits.iter().map(|&x| exp_approx((x - mx) / t)).collect();

    // Top-k: partial selection, O(v).
    let k = params.top_k.unwrap_or(v).min(v);
    let mut kept: Option<Vec<u32>> = None;
    if k < v {
        let mut idx: Vec<u32> = (0..v as u32).collect();
        idx.select_nth_unstable_by(k - 1, |&a, &b| by_prob_desc(&p, a, b));
        for &i in &idx[k..] {
            p[i as usize] = 0.0;
        }
        idx.truncate(k);
        kept = Some(idx);
    }

    // Top-p: the answer is a prefix of the (p desc, id asc) order. Any threshold set {p_i >= thr} is also such
    // a prefix, so once one holds enough mass only it needs sorting.
    if let Some(top_p) = params.top_p.filter(|&tp| tp < 1.0) {
        let total = sum_f64(&p);
        let target = top_p as f64 * total;
        let pool: Vec<u32> = kept.take().unwrap_or_else(|| (0..v as u32).collect());
        let mut cand: Vec<u32> = Vec::new();
        let mut thr = 1.0f32 / 16.0;
        loop {
            cand.clear();
            cand.extend(pool.iter().copied().filter(|&i| p[i as usize] >= thr && p[i as usize] > 0.0));
            let mass: f64 = cand.iter().map(|&i| p[i as usize] as f64).sum();
            if mass >= target || thr == 0.0 {
                break;
            }
            thr = if thr < 1e-30 { 0.0 } else { thr / 256.0 };
        }
        cand.sort_unstable_by(|&a, &b| by_prob_desc(&p, a, b));
        let mut cum = 0f64;
        let mut len = cand.len();
        for (n, &i) in cand.iter().enumerate() {
            cum += p[i as usize] as f64;
            if cum >= target {
                len = n + 1;
                break;
            }
        }
        cand.truncate(len);
        let mut q = vec![0.0f32; v];
        for &i in &cand {
            q[i as usize] = p[i as usize];
        }
        p = q;
    }

    let z = sum_f64(&p);
    // z >= 1: the maximum token has probability exp(0) and survives top-k and top-p.
    let inv = 1.0 / z;
    for x in &mut p {
        *x = (*x as f64 * inv) as f32;
    }
    Ok(p)
}

/// `log softmax(logits)` at temperature 1, computed stably (`-inf` logits give `-inf`).
///
/// # Errors
/// [`Error::InvalidArgument`] for an empty row, NaN or `+inf` logits, or all logits `-inf`.
pub fn log_softmax(logits: &[f32]) -> Result<Vec<f32>> {
    let mx = finite_max(logits)?;
    let e: Vec<f32> = logits.iter().map(|&x| exp_approx(x - mx)).collect();
    let lse = sum_f64(&e).ln();
    Ok(logits.iter().map(|&x| ((x - mx) as f64 - lse) as f32).collect())
}

/// `log softmax(logits / temperature)[token]`: the log-probability of one token under the temperature-scaled
/// distribution (no top-k/top-p), without materialising the row. A `temperature` of 0 (greedy) counts as 1.
///
/// # Errors
/// [`Error::InvalidArgument`] for a `token` out of range, a negative or non-finite temperature, or the rows
/// [`log_softmax`] rejects.
pub fn token_logprob(logits: &[f32], token: usize, temperature: f32) -> Result<f32> {
    Ok(token_logprob_pmax(logits, token, temperature)?.0)
}

/// [`token_logprob`] together with the largest probability of the same distribution, `p_max = 1 / Σ_j
/// exp((x_j - max) / T)` (one pass: the normaliser is computed anyway). `p_max` is what a point-mass draft of the
/// argmax is accepted with, the quantity behind the argmax-chain ceiling of speculative decoding.
///
/// # Errors
/// As [`token_logprob`].
pub fn token_logprob_pmax(logits: &[f32], token: usize, temperature: f32) -> Result<(f32, f32)> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(invalid(format!("temperature must be finite and >= 0, got {temperature}")));
    }
    let Some(&z) = logits.get(token) else {
        return Err(invalid(format!("token {token} out of range for {} logits", logits.len())));
    };
    let inv_t = if temperature > 0.0 { 1.0 / temperature } else { 1.0 };
    let mx = finite_max(logits)?;
    let mut buf = [0f32; 256];
    let mut total = 0f64;
    for c in logits.chunks(buf.len()) {
        for (b, &x) in buf.iter_mut().zip(c) {
            *b = exp_approx((x - mx) * inv_t);
        }
        total += sum_f64(&buf[..c.len()]);
    }
    Ok(((((z - mx) * inv_t) as f64 - total.ln()) as f32, (1.0 / total) as f32))
}

/// Draws a token from the (not necessarily normalised) distribution `probs` by inverse CDF with the uniform
/// variate `u` in `[0, 1)`. Never returns a zero-probability token.
///
/// # Errors
/// [`Error::InvalidArgument`] if `u` is outside `[0, 1)`, `probs` is empty, has a negative or non-finite entry,
/// or sums to 0.
pub fn categorical(probs: &[f32], u: f64) -> Result<usize> {
    if !(0.0..1.0).contains(&u) {
        return Err(invalid(format!("uniform variate must be in [0, 1), got {u}")));
    }
    if probs.is_empty() {
        return Err(invalid("empty probability row".into()));
    }
    if let Some(i) = probs.iter().position(|&x| !(x.is_finite() && x >= 0.0)) {
        return Err(invalid(format!("probability {i} is {}, must be finite and >= 0", probs[i])));
    }
    let total = sum_f64(probs);
    if !(total > 0.0 && total.is_finite()) {
        return Err(invalid(format!("probabilities sum to {total}")));
    }
    let target = u * total;
    let mut cum = 0f64;
    let mut last = None;
    const BLOCK: usize = 64;
    for (bi, block) in probs.chunks(BLOCK).enumerate() {
        let bs = sum_f64(block);
        if bs > 0.0 && cum + bs <= target {
            // The whole block lies below the target: skip it, remembering its last positive entry.
            cum += bs;
            last = block.iter().rposition(|&x| x > 0.0).map(|j| bi * BLOCK + j).or(last);
            continue;
        }
        for (j, &x) in block.iter().enumerate() {
            if x > 0.0 {
                cum += x as f64;
                last = Some(bi * BLOCK + j);
                if cum > target {
                    return Ok(bi * BLOCK + j);
                }
            }
        }
    }
    // Rounding kept the running sum at or below u * total: take the last token with mass.
    last.ok_or_else(|| invalid("probabilities sum to 0".into()))
}

/// Samples a token from `logits` under `params` with randomness from `rng` (one draw; greedy draws none).
///
/// # Errors
/// As [`probs`].
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut SeededRng) -> Result<usize> {
    params.validate()?;
    if params.temperature == 0.0 {
        finite_max(logits)?;
        return argmax(logits);
    }
    let p = probs(logits, params)?;
    categorical(&p, rng.uniform())
}
