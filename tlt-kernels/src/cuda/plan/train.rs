//! Plans of the GRPO policy update's kernels (`train.cu`): RoPE and its backward on packed rows, the backward of
//! RMSNorm, SiLU-gating and the embedding, column sums, token log-probabilities (with entropy) and their gradient,
//! the gradient's sum of squares, AdamW, and two element-wise helpers. Every reduction runs in a fixed order, so the
//! same inputs give the same bits on every run.

use super::*;

/// Threads per block of the row- and block-reduction kernels of `train.cu` (`TRAIN_THREADS`).
const TRAIN_THREADS: u32 = 256;

/// Blocks of [`sum_squares`]: a fixed grid, so the partials (and their sum on the host) do not depend on the device.
pub const SUM_SQUARES_BLOCKS: usize = 1024;

/// Checks the shapes shared by [`rope_rows`] and [`rope_rows_back`] and returns their common arguments.
#[allow(clippy::too_many_arguments)]
fn rope_args(
    rows: usize,
    stride: usize,
    col0: usize,
    heads: usize,
    head_dim: usize,
    pos: Buf<i32>,
    inv_freq: Buf<f64>,
    x_len: usize,
) -> Result<Vec<Arg>> {
    if rows == 0 || heads == 0 || head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(Error::InvalidArgument(format!(
            "RoPE of {rows} rows of {heads} heads of {head_dim} (rows and heads must be > 0, head_dim even and > 0)"
        )));
    }
    if col0 + heads * head_dim > stride {
        return Err(Error::InvalidArgument(format!(
            "RoPE of {heads} heads of {head_dim} from column {col0} overruns rows of {stride}"
        )));
    }
    check_len("x", rows * stride, x_len)?;
    check_len("positions", rows, pos.len())?;
    check_len("inv_freq", head_dim / 2, inv_freq.len())?;
    Ok(vec![
        pos.arg(),
        inv_freq.arg(),
        i32_arg("rows", rows)?,
        i32_arg("stride", stride)?,
        i32_arg("col0", col0)?,
        i32_arg("heads", heads)?,
        i32_arg("head_dim", head_dim)?,
    ])
}

/// RoPE in place on bf16 rows (`rope_rows_bf16`; `x`: `[rows, stride]`): the `heads` vectors of `head_dim`
/// starting at column `col0` of row `r` are rotated at position `pos[r]` (HF rotate-half, angle `pos *
/// inv_freq[i]`, `inv_freq`: `[head_dim / 2]`), with the decoder's arithmetic (`rope_kv_write_bf16`).
///
/// # Errors
/// [`Error::InvalidArgument`] for no rows or heads, an odd head dim or vectors past the row;
/// [`Error::ShapeMismatch`] for a buffer of the wrong length.
#[allow(clippy::too_many_arguments)]
pub fn rope_rows(
    rows: usize,
    stride: usize,
    col0: usize,
    heads: usize,
    head_dim: usize,
    pos: Buf<i32>,
    inv_freq: Buf<f64>,
    x: Buf<bf16>,
) -> Result<Launch> {
    let mut args = vec![x.arg()];
    args.extend(rope_args(rows, stride, col0, heads, head_dim, pos, inv_freq, x.len())?);
    Ok(Launch::new("rope_rows_bf16", [dim("rows", rows)?, 1, 1], TRAIN_THREADS, args))
}

/// The backward of [`rope_rows`] in place on f32 gradients (`rope_rows_back_f32`; `dx`: `[rows, stride]`): each
/// pair rotated by the negative angle (the transpose of the forward's rotation).
///
/// # Errors
/// As [`rope_rows`].
#[allow(clippy::too_many_arguments)]
pub fn rope_rows_back(
    rows: usize,
    stride: usize,
    col0: usize,
    heads: usize,
    head_dim: usize,
    pos: Buf<i32>,
    inv_freq: Buf<f64>,
    dx: Buf<f32>,
) -> Result<Launch> {
    let mut args = vec![dx.arg()];
    args.extend(rope_args(rows, stride, col0, heads, head_dim, pos, inv_freq, dx.len())?);
    Ok(Launch::new("rope_rows_back_f32", [dim("rows", rows)?, 1, 1], TRAIN_THREADS, args))
}

/// The backward of [`rms_norm`] (`rms_norm_back_f32`; `x`, `dy`, `dx`, `dw_rows`: `[rows, width]` f32, `w`: bf16
/// `[width]`): adds the input gradient `r * g - x * r^3 * sum(g * x) / width` (`r = rsqrt(mean(x^2) + eps)`, as
/// the forward computes it, `g = dy * w`) into `dx`, and writes `dw_rows = dy * x * r`, the rows' contributions to
/// the weight's gradient (reduce them with [`col_sum`]). f32 math, fixed-order reductions.
///
/// # Errors
/// [`Error::InvalidArgument`] for no rows or a zero width; [`Error::ShapeMismatch`] for a buffer of the wrong
/// length.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_back(
    rows: usize,
    width: usize,
    eps: f32,
    x: Buf<f32>,
    w: Buf<bf16>,
    dy: Buf<f32>,
    dx: Buf<f32>,
    dw_rows: Buf<f32>,
) -> Result<Launch> {
    if rows == 0 || width == 0 {
        return Err(Error::InvalidArgument(format!("RMSNorm backward of {rows} rows of width {width}")));
    }
    for (what, len) in [("x", x.len()), ("dy", dy.len()), ("dx", dx.len()), ("dw_rows", dw_rows.len())] {
        check_len(what, rows * width, len)?;
    }
    check_len("norm weight", width, w.len())?;
    let args = vec![
        x.arg(),
        w.arg(),
        dy.arg(),
        dx.arg(),
        dw_rows.arg(),
        i32_arg("rows", rows)?,
        i32_arg("width", width)?,
        Arg::F32(eps),
    ];
    Ok(Launch::new("rms_norm_back_f32", [dim("rows", rows)?, 1, 1], TRAIN_THREADS, args))
}

/// `dst[c] = (accumulate ? dst[c] : 0) + sum_r src[r, c]` (`col_sum_f32`; `src`: `[rows, cols]`, `dst`: `[cols]`,
/// f32): each column summed in f64 in a fixed order (8 interleaved row slices in row order, then the slices in
/// order, added to the previous value in f64), rounded to f32 once. For norm-weight and bias gradients.
///
/// # Errors
/// [`Error::InvalidArgument`] for no columns; [`Error::ShapeMismatch`] for a buffer of the wrong length.
pub fn col_sum(rows: usize, cols: usize, src: Buf<f32>, dst: Buf<f32>, accumulate: bool) -> Result<Launch> {
    if cols == 0 {
        return Err(Error::InvalidArgument(format!("column sums of {rows} rows of no columns")));
    }
    check_len("src", rows * cols, src.len())?;
    check_len("dst", cols, dst.len())?;
    let args =
        vec![src.arg(), dst.arg(), i32_arg("rows", rows)?, i32_arg("cols", cols)?, Arg::I32(i32::from(accumulate))];
    Ok(Launch::new("col_sum_f32", [dim("column blocks", cols.div_ceil(32))?, 1, 1], TRAIN_THREADS, args))
}

/// The backward of [`silu_mul_packed`] (`silu_mul_back_bf16`; `gu`, `d_gu`: `[rows, 2 * inter]` bf16, gate then up
/// in each row; `d_act`: `[rows, inter]` f32): `d_gate = d * up * s * (1 + g * (1 - s))` with `s = sigmoid(g)`,
/// `d_up = d * silu(g)`, f32 math rounded to bf16.
///
/// # Errors
/// [`Error::ShapeMismatch`] for a buffer of the wrong length.
pub fn silu_mul_back(rows: usize, inter: usize, gu: Buf<bf16>, d_act: Buf<f32>, d_gu: Buf<bf16>) -> Result<Launch> {
    check_len("gate/up", rows * 2 * inter, gu.len())?;
    check_len("d_act", rows * inter, d_act.len())?;
    check_len("d_gate/up", rows * 2 * inter, d_gu.len())?;
    let args = vec![gu.arg(), d_act.arg(), d_gu.arg(), i32_arg("rows", rows)?, i32_arg("intermediate", inter)?];
    Ok(Launch::new("silu_mul_back_bf16", stride_grid(rows * inter), 256, args))
}

/// Checks the row count, vocabulary and inverse temperature of the token log-prob kernels.
fn check_logits(rows: usize, vocab: usize, inv_temp: f32) -> Result<()> {
    if rows == 0 || vocab == 0 {
        return Err(Error::InvalidArgument(format!("{rows} rows of vocabulary {vocab}")));
    }
    if !(inv_temp.is_finite() && inv_temp > 0.0) {
        return Err(Error::InvalidArgument(format!("inverse temperature {inv_temp}")));
    }
    Ok(())
}

/// Per row of `logits` (`token_logprobs_f32`; `[rows, vocab]` f32), with `z = logits * inv_temp`: `lse[r] =
/// logsumexp(z)` (max-subtracted, the exponentials summed in f64), `logp[r] = z[targets[r]] - lse[r]` (0 for a
/// negative target, NaN for one `>= vocab`) and, when `entropy` is given, `entropy[r] = -sum p log p`. `targets`,
/// `logp`, `lse`, `entropy`: `[rows]`.
///
/// # Errors
/// [`Error::InvalidArgument`] for no rows, an empty vocabulary or a non-positive or non-finite `inv_temp`;
/// [`Error::ShapeMismatch`] for a buffer of the wrong length.
#[allow(clippy::too_many_arguments)]
pub fn token_logprobs(
    rows: usize,
    vocab: usize,
    inv_temp: f32,
    logits: Buf<f32>,
    targets: Buf<i32>,
    logp: Buf<f32>,
    lse: Buf<f32>,
    entropy: Option<Buf<f32>>,
) -> Result<Launch> {
    check_logits(rows, vocab, inv_temp)?;
    check_len("logits", rows * vocab, logits.len())?;
    check_len("targets", rows, targets.len())?;
    check_len("logp", rows, logp.len())?;
    check_len("lse", rows, lse.len())?;
    if let Some(e) = entropy {
        check_len("entropy", rows, e.len())?;
    }
    let args = vec![
        logits.arg(),
        targets.arg(),
        logp.arg(),
        lse.arg(),
        entropy.map_or_else(null, |e| e.arg()),
        i32_arg("rows", rows)?,
        i32_arg("vocab", vocab)?,
        Arg::F32(inv_temp),
    ];
    Ok(Launch::new("token_logprobs_f32", [dim("rows", rows)?, 1, 1], TRAIN_THREADS, args))
}

/// The gradient with respect to `logits` (`token_logprobs_back_f32`; `dlogits`: `[rows, vocab]` bf16, every
/// element written) of `sum_r g_logp[r] * logp[r]` (+ `sum_r g_ent[r] * entropy[r]` with `g_ent`), from
/// [`token_logprobs`]'s `lse` and `entropy`: with `p = softmax(z)`, `dz_j = g_logp[r] * ([j == target] - p_j) +
/// g_ent[r] * (-p_j * (log p_j + H_r))` (no first term for a row with a negative target), `dlogits = dz *
/// inv_temp`, rounded to bf16.
///
/// # Errors
/// [`Error::InvalidArgument`] for `g_ent` without `entropy`; otherwise as [`token_logprobs`].
#[allow(clippy::too_many_arguments)]
pub fn token_logprobs_back(
    rows: usize,
    vocab: usize,
    inv_temp: f32,
    logits: Buf<f32>,
    targets: Buf<i32>,
    lse: Buf<f32>,
    entropy: Option<Buf<f32>>,
    g_logp: Buf<f32>,
    g_ent: Option<Buf<f32>>,
    dlogits: Buf<bf16>,
) -> Result<Launch> {
    check_logits(rows, vocab, inv_temp)?;
    if g_ent.is_some() && entropy.is_none() {
        return Err(Error::InvalidArgument("an entropy gradient needs the rows' entropies".into()));
    }
    check_len("logits", rows * vocab, logits.len())?;
    check_len("dlogits", rows * vocab, dlogits.len())?;
    check_len("targets", rows, targets.len())?;
    check_len("lse", rows, lse.len())?;
    check_len("g_logp", rows, g_logp.len())?;
    if let Some(e) = entropy {
        check_len("entropy", rows, e.len())?;
    }
    if let Some(g) = g_ent {
        check_len("g_ent", rows, g.len())?;
    }
    let args = vec![
        logits.arg(),
        targets.arg(),
        lse.arg(),
        entropy.map_or_else(null, |e| e.arg()),
        g_logp.arg(),
        g_ent.map_or_else(null, |g| g.arg()),
        dlogits.arg(),
        i32_arg("rows", rows)?,
        i32_arg("vocab", vocab)?,
        Arg::F32(inv_temp),
    ];
    // Up to 16 elements a thread per block; at most 64 blocks a row.
    let chunks = vocab.div_ceil(16 * TRAIN_THREADS as usize).clamp(1, 64);
    Ok(Launch::new("token_logprobs_back_f32", [dim("rows", rows)?, dim("chunks", chunks)?, 1], TRAIN_THREADS, args))
}

/// The backward of the embedding gather (`embed_back_f32`) without atomics: the host sorts the rows of `dx`
/// (`[rows, width]` f32) by token; segment `s` covers the rows `order[seg_start[s]..seg_start[s + 1]]` and is
/// token `seg_token[s]` (`seg_start`: `[segments + 1]`, `seg_token`: `[segments]`, tokens distinct); one block per
/// segment adds the sum of those rows (in order, f32) into row `seg_token[s]` of `d_table` (`[vocab, width]`).
/// The kernel skips indices out of range (it never reads or writes outside the buffers).
///
/// # Errors
/// [`Error::InvalidArgument`] for a zero width, `dx` or `d_table` not whole rows, or an empty `seg_start`;
/// [`Error::ShapeMismatch`] for `seg_token` not one per segment.
pub fn embed_back(
    width: usize,
    order: Buf<i32>,
    seg_start: Buf<i32>,
    seg_token: Buf<i32>,
    dx: Buf<f32>,
    d_table: Buf<f32>,
) -> Result<Launch> {
    if width == 0 || !dx.len().is_multiple_of(width) || !d_table.len().is_multiple_of(width) {
        return Err(Error::InvalidArgument(format!(
            "embedding backward of width {width}: dx of {} and table of {} elements must be whole rows",
            dx.len(),
            d_table.len()
        )));
    }
    let Some(segments) = seg_start.len().checked_sub(1) else {
        return Err(Error::InvalidArgument("segment starts need segments + 1 entries".into()));
    };
    check_len("segment tokens", segments, seg_token.len())?;
    let args = vec![
        order.arg(),
        seg_start.arg(),
        seg_token.arg(),
        dx.arg(),
        d_table.arg(),
        i32_arg("segments", segments)?,
        i32_arg("width", width)?,
        i32_arg("rows", dx.len() / width)?,
        i32_arg("vocab", d_table.len() / width)?,
        i32_arg("order", order.len())?,
    ];
    Ok(Launch::new("embed_back_f32", [dim("segments", segments.max(1))?, 1, 1], TRAIN_THREADS, args))
}

/// The sum of squares of `x` in [`SUM_SQUARES_BLOCKS`] f64 partials (`sum_squares_f32`): block `b` writes the sum
/// over its fixed grid-stride share to `partials[b]`; the host adds the partials in order (for the gradient norm).
///
/// # Errors
/// [`Error::ShapeMismatch`] unless `partials` has [`SUM_SQUARES_BLOCKS`] elements.
pub fn sum_squares(x: Buf<f32>, partials: Buf<f64>) -> Result<Launch> {
    check_len("partials", SUM_SQUARES_BLOCKS, partials.len())?;
    let args = vec![x.arg(), partials.arg(), Arg::U64(x.len() as u64)];
    Ok(Launch::new("sum_squares_f32", [dim("blocks", SUM_SQUARES_BLOCKS)?, 1, 1], TRAIN_THREADS, args))
}

/// One AdamW step's hyperparameters, as tlt-model's host `AdamW` takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The parameter's update count including this one (1 on the first step): the bias corrections' exponent.
    pub step: u64,
    /// The gradient clipping factor (applied only when below 1).
    pub coef: f64,
}

impl AdamWStep {
    /// The host-computed doubles of the update, exactly as `AdamW::update`: `(step_size, decay, bc2_sqrt)` with
    /// `bc1 = 1 - beta1^t`, `step_size = lr / bc1`, `decay = 1 - lr * weight_decay`, `bc2_sqrt = sqrt(1 -
    /// beta2^t)` (`t` saturated to `i32`).
    #[must_use]
    pub fn host_terms(&self) -> (f64, f64, f64) {
        let t = i32::try_from(self.step).unwrap_or(i32::MAX);
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2_sqrt = (1.0 - self.beta2.powi(t)).sqrt();
        (self.lr / bc1, 1.0 - self.lr * self.weight_decay, bc2_sqrt)
    }

    fn validate(&self) -> Result<()> {
        let ok = self.lr.is_finite()
            && self.lr >= 0.0
            && (0.0..1.0).contains(&self.beta1)
            && (0.0..1.0).contains(&self.beta2)
            && self.eps.is_finite()
            && self.eps > 0.0
            && self.weight_decay.is_finite()
            && self.weight_decay >= 0.0
            && self.step >= 1
            && self.coef.is_finite()
            && self.coef >= 0.0;
        if ok {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!("AdamW step {self:?}")))
        }
    }
}

/// AdamW on f32 parameters (`adamw_f32`), element-wise and bit for bit as tlt-model's host `AdamW::update`: f64
/// arithmetic without fused multiply-adds, the gradient scaled by `coef` only when `coef < 1`, the moments `m`, `v`
/// rounded to f32, `w = w * decay - step_size * m / (sqrt(v) / bc2_sqrt + eps)` (the terms of
/// [`AdamWStep::host_terms`], passed as kernel arguments) rounded to f32; `out` gets the new `w` rounded to bf16
/// (nearest even, as `half::bf16::from_f32`). `w`, `m`, `v`, `g`, `out`: the same length.
///
/// # Errors
/// [`Error::InvalidArgument`] for hyperparameters the host optimizer rejects, step 0 or a negative or non-finite
/// `coef`; [`Error::ShapeMismatch`] for buffers of different lengths.
pub fn adamw(s: &AdamWStep, w: Buf<f32>, m: Buf<f32>, v: Buf<f32>, g: Buf<f32>, out: Buf<bf16>) -> Result<Launch> {
    s.validate()?;
    let n = w.len();
    for (what, len) in [("m", m.len()), ("v", v.len()), ("gradient", g.len()), ("out", out.len())] {
        check_len(what, n, len)?;
    }
    let (step_size, decay, bc2_sqrt) = s.host_terms();
    let f = |x: f64| Arg::U64(x.to_bits());
    let args = vec![
        w.arg(),
        m.arg(),
        v.arg(),
        g.arg(),
        out.arg(),
        Arg::U64(n as u64),
        f(s.beta1),
        f(s.beta2),
        f(s.eps),
        f(step_size),
        f(decay),
        f(bc2_sqrt),
        f(s.coef),
    ];
    Ok(Launch::new("adamw_f32", stride_grid(n), 256, args))
}

/// `dst = src` rounded to bf16, nearest even (`cast_f32_bf16`; the same length).
///
/// # Errors
/// [`Error::ShapeMismatch`] for different lengths.
pub fn cast_bf16(src: Buf<f32>, dst: Buf<bf16>) -> Result<Launch> {
    check_len("dst", src.len(), dst.len())?;
    Ok(Launch::new(
        "cast_f32_bf16",
        stride_grid(src.len()),
        256,
        vec![src.arg(), dst.arg(), Arg::U64(src.len() as u64)],
    ))
}

/// `dst *= s` (`scale_f32`; f32).
///
/// # Errors
/// [`Error::InvalidArgument`] for a non-finite `s`.
pub fn scale_f32(dst: Buf<f32>, s: f32) -> Result<Launch> {
    if !s.is_finite() {
        return Err(Error::InvalidArgument(format!("a scale of {s}")));
    }
    Ok(Launch::new("scale_f32", stride_grid(dst.len()), 256, vec![dst.arg(), Arg::F32(s), Arg::U64(dst.len() as u64)]))
}

/// `out = bf16(base + s * delta)` (`lora_merge_bf16`: the sum in f32, rounded to bf16 nearest even): a LoRA delta
/// merged into a frozen bf16 weight. All three the same length.
///
/// # Errors
/// [`Error::ShapeMismatch`] for different lengths; [`Error::InvalidArgument`] for a non-finite `s`.
pub fn lora_merge(base: Buf<bf16>, delta: Buf<f32>, s: f32, out: Buf<bf16>) -> Result<Launch> {
    check_len("delta", base.len(), delta.len())?;
    check_len("out", base.len(), out.len())?;
    if !s.is_finite() {
        return Err(Error::InvalidArgument(format!("a scale of {s}")));
    }
    let args = vec![base.arg(), delta.arg(), Arg::F32(s), out.arg(), Arg::U64(base.len() as u64)];
    Ok(Launch::new("lora_merge_bf16", stride_grid(base.len()), 256, args))
}

/// `dst += src` (`add_f32`; f32, the same length).
///
/// # Errors
/// [`Error::ShapeMismatch`] for different lengths.
pub fn add_f32(dst: Buf<f32>, src: Buf<f32>) -> Result<Launch> {
    check_len("src", dst.len(), src.len())?;
    Ok(Launch::new("add_f32", stride_grid(dst.len()), 256, vec![dst.arg(), src.arg(), Arg::U64(dst.len() as u64)]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn train_plans_check_shapes_and_arguments() {
        let f = |n| Buf::<f32>::new(0x10_0000, n);
        let bf = |n| Buf::<bf16>::new(0x20_0000, n);
        let i = |n| Buf::<i32>::new(0x30_0000, n);
        let d = |n| Buf::<f64>::new(0x40_0000, n);
        let l = rope_rows(3, 40, 8, 2, 16, i(3), d(8), bf(120)).unwrap();
        assert_eq!((l.kernel, l.grid, l.args.len()), ("rope_rows_bf16", [3, 1, 1], 8));
        assert!(rope_rows(3, 40, 9, 2, 16, i(3), d(8), bf(120)).is_err(), "vectors past the row");
        assert!(rope_rows(3, 40, 8, 2, 15, i(3), d(7), bf(120)).is_err(), "odd head dim");
        assert!(matches!(
            rope_rows_back(3, 40, 8, 2, 16, i(3), d(7), f(120)),
            Err(Error::ShapeMismatch { what: "inv_freq", .. })
        ));
        assert!(rms_norm_back(2, 8, 1e-6, f(16), bf(8), f(16), f(16), f(15)).is_err());
        assert_eq!(col_sum(0, 33, f(0), f(33), true).unwrap().grid, [2, 1, 1]);
        assert_eq!(col_sum(5, 33, f(165), f(33), true).unwrap().args[4], Arg::I32(1));
        assert!(silu_mul_back(2, 4, bf(16), f(8), bf(15)).is_err());
        assert!(token_logprobs(2, 5, 0.0, f(10), i(2), f(2), f(2), None).is_err());
        assert!(token_logprobs(2, 5, 1.0, f(10), i(2), f(2), f(2), Some(f(1))).is_err());
        let l = token_logprobs_back(2, 152_000, 1.0, f(304_000), i(2), f(2), None, f(2), None, bf(304_000)).unwrap();
        assert_eq!(l.grid, [2, 38, 1]);
        let e = token_logprobs_back(2, 5, 1.0, f(10), i(2), f(2), None, f(2), Some(f(2)), bf(10)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(embed_back(4, i(3), i(1), i(0), f(12), f(40)).unwrap().grid, [1, 1, 1]);
        assert!(embed_back(4, i(3), i(0), i(0), f(12), f(40)).is_err());
        assert!(embed_back(4, i(3), i(3), i(1), f(12), f(40)).is_err());
        assert!(sum_squares(f(10), d(SUM_SQUARES_BLOCKS - 1)).is_err());
        let s = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0, step: 1, coef: 1.0 };
        let l = adamw(&s, f(5), f(5), f(5), f(5), bf(5)).unwrap();
        assert_eq!(l.args[6], Arg::U64(0.9f64.to_bits()));
        assert!(adamw(&AdamWStep { step: 0, ..s }, f(5), f(5), f(5), f(5), bf(5)).is_err());
        assert!(adamw(&AdamWStep { beta2: 1.0, ..s }, f(5), f(5), f(5), f(5), bf(5)).is_err());
        assert!(adamw(&s, f(5), f(5), f(4), f(5), bf(5)).is_err());
        assert!(cast_bf16(f(3), bf(4)).is_err());
        assert!(add_f32(f(3), f(4)).is_err());
    }
}
