//! Plans of the row-wise kernels: sampling and tree acceptance, embedding, norms, activations, concatenation and
//! top-k.

use super::*;

/// The target's token at every row of `logits` (`sample_rows_f32`; `[rows, vocab]` f32): the argmax at
/// `temperature == 0` (then `coins` must be `None`, and log-probs are at temperature 1), else the inverse-CDF draw
/// of `softmax(logits / temperature)` with `coins[row]` in `[0, 1)`; with its log-probability and the
/// distribution's largest probability.
///
/// # Errors
/// [`Error::InvalidArgument`] for a negative or non-finite temperature, or coins given at temperature 0 or missing
/// above it; otherwise as [`rope_kv_write`].
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    rows: usize,
    vocab: usize,
    temperature: f32,
    logits: Buf<f32>,
    coins: Option<Buf<f64>>,
    tokens: Buf<i32>,
    logprobs: Buf<f32>,
    pmax: Buf<f32>,
) -> Result<Launch> {
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(Error::InvalidArgument(format!("temperature {temperature}")));
    }
    if (temperature == 0.0) != coins.is_none() {
        return Err(Error::InvalidArgument(
            "coins are needed exactly when sampling (temperature > 0); greedy takes none".into(),
        ));
    }
    if rows == 0 || vocab == 0 {
        return Err(Error::InvalidArgument(format!("{rows} rows of vocabulary {vocab}")));
    }
    check_len("logits", rows * vocab, logits.len())?;
    if let Some(c) = coins {
        check_len("coins", rows, c.len())?;
    }
    check_len("tokens", rows, tokens.len())?;
    check_len("logprobs", rows, logprobs.len())?;
    check_len("pmax", rows, pmax.len())?;
    let inv_temp = if temperature == 0.0 { 1.0f32 } else { 1.0 / temperature };
    let args = vec![
        logits.arg(),
        coins.map_or_else(null, |c| c.arg()),
        tokens.arg(),
        logprobs.arg(),
        pmax.arg(),
        i32_arg("rows", rows)?,
        i32_arg("vocab", vocab)?,
        Arg::F32(inv_temp),
    ];
    Ok(Launch::new("sample_rows_f32", [dim("rows", rows)?, 1, 1], 256, args))
}

/// Walks each sequence's draft tree with the target's tokens (`tree_accept`; from [`sample_rows`] over the tree's
/// rows) and writes the accepted path and committed tokens. Every array is `[batch, n_max]` except `n_nodes` and
/// `n_acc` (`[batch]`).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn tree_accept(tree: TreeDims, i: AcceptInBufs, o: AcceptOutBufs) -> Result<Launch> {
    tree.check(false)?;
    let n = tree.nodes();
    for (what, len) in [
        ("parent", i.parent.len()),
        ("draft tokens", i.draft_tok.len()),
        ("target tokens", i.target_tok.len()),
        ("target log-probs", i.target_lp.len()),
        ("target p_max", i.target_pmax.len()),
        ("path", o.path.len()),
        ("committed tokens", o.tokens.len()),
        ("committed log-probs", o.logprobs.len()),
        ("committed p_max", o.pmax.len()),
    ] {
        check_len(what, n, len)?;
    }
    check_len("n_nodes", tree.batch, i.n_nodes.len())?;
    check_len("n_acc", tree.batch, o.n_acc.len())?;
    let args = vec![
        i.parent.arg(),
        i.draft_tok.arg(),
        i.target_tok.arg(),
        i.target_lp.arg(),
        i.target_pmax.arg(),
        i.n_nodes.arg(),
        o.path.arg(),
        o.n_acc.arg(),
        o.tokens.arg(),
        o.logprobs.arg(),
        o.pmax.arg(),
        i32_arg("batch", tree.batch)?,
        i32_arg("n_max", tree.n_max)?,
    ];
    Ok(Launch::new("tree_accept", [dim("batch", tree.batch.div_ceil(128))?, 1, 1], 128, args))
}

/// `x[r] = table[tokens[r]]` (`embed_rows_bf16`; bf16 rows to the f32 residual stream); `table`: `[vocab,
/// width]`. Token ids are the caller's to keep below `vocab`.
///
/// # Errors
/// As [`rope_kv_write`].
pub fn embed_rows(rows: usize, width: usize, table: Buf<bf16>, tokens: Buf<i32>, x: Buf<f32>) -> Result<Launch> {
    if width == 0 || !table.len().is_multiple_of(width) {
        return Err(Error::InvalidArgument(format!("embedding table of {} for width {width}", table.len())));
    }
    check_len("tokens", rows, tokens.len())?;
    check_len("x", rows * width, x.len())?;
    let args = vec![table.arg(), tokens.arg(), x.arg(), i32_arg("rows", rows)?, i32_arg("width", width)?];
    Ok(Launch::new("embed_rows_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// `out = rmsnorm(x) * w` per row (`rms_norm_bf16`; `x` f32 `[rows, width]`, `w` bf16 `[width]`, `out` bf16).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn rms_norm(rows: usize, width: usize, eps: f32, x: Buf<f32>, w: Buf<bf16>, out: Buf<bf16>) -> Result<Launch> {
    check_len("x", rows * width, x.len())?;
    check_len("norm weight", width, w.len())?;
    check_len("out", rows * width, out.len())?;
    let args = vec![x.arg(), w.arg(), out.arg(), i32_arg("rows", rows)?, i32_arg("width", width)?, Arg::F32(eps)];
    Ok(Launch::new("rms_norm_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// `x += y`, then `out = rmsnorm(x) * w` per row (`add_rms_norm_bf16`: the residual add fused with the next norm;
/// `x` f32 `[rows, width]`, `y` bf16, `w` bf16 `[width]`, `out` bf16).
///
/// # Errors
/// As [`rope_kv_write`].
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    rows: usize,
    width: usize,
    eps: f32,
    x: Buf<f32>,
    y: Buf<bf16>,
    w: Buf<bf16>,
    out: Buf<bf16>,
) -> Result<Launch> {
    check_len("x", rows * width, x.len())?;
    check_len("y", rows * width, y.len())?;
    check_len("norm weight", width, w.len())?;
    check_len("out", rows * width, out.len())?;
    let args =
        vec![x.arg(), y.arg(), w.arg(), out.arg(), i32_arg("rows", rows)?, i32_arg("width", width)?, Arg::F32(eps)];
    Ok(Launch::new("add_rms_norm_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// `out[r] = silu(gu[r, ..inter]) * gu[r, inter..]` (`silu_mul_packed_bf16`) over the packed gate/up rows of one
/// GEMM (`gu`: `[rows, 2 * inter]`, `out`: `[rows, inter]`, bf16).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn silu_mul_packed(rows: usize, inter: usize, gu: Buf<bf16>, out: Buf<bf16>) -> Result<Launch> {
    check_len("gate/up", rows * 2 * inter, gu.len())?;
    check_len("out", rows * inter, out.len())?;
    let args = vec![gu.arg(), out.arg(), i32_arg("rows", rows)?, i32_arg("intermediate", inter)?];
    Ok(Launch::new("silu_mul_packed_bf16", stride_grid(rows * inter), 256, args))
}

/// Qwen3's q/k norms (`head_rms_norm_bf16`): every `head_dim`-wide vector of `x` (bf16 `[vectors, head_dim]`, in
/// place) becomes `rmsnorm(x) * w` (`w` bf16 `[head_dim]`). `None` when `x` is empty (nothing to launch).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn head_rms_norm(head_dim: usize, eps: f32, x: Buf<bf16>, w: Buf<bf16>) -> Result<Option<Launch>> {
    check_len("norm weight", head_dim, w.len())?;
    if head_dim == 0 || !x.len().is_multiple_of(head_dim) {
        return Err(Error::InvalidArgument(format!("{} elements are not vectors of {head_dim}", x.len())));
    }
    let vectors = x.len() / head_dim;
    if vectors == 0 {
        return Ok(None);
    }
    let per_block = 256 / 32;
    let args = vec![x.arg(), w.arg(), i32_arg("vectors", vectors)?, i32_arg("head_dim", head_dim)?, Arg::F32(eps)];
    Ok(Some(Launch::new("head_rms_norm_bf16", [dim("blocks", vectors.div_ceil(per_block))?, 1, 1], 256, args)))
}

/// `x += y` (`add_bf16_to_f32`; the residual add; `x` f32, `y` bf16, same length).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn add_to_residual(x: Buf<f32>, y: Buf<bf16>) -> Result<Launch> {
    check_len("y", x.len(), y.len())?;
    Ok(Launch::new("add_bf16_to_f32", stride_grid(x.len()), 256, vec![x.arg(), y.arg(), Arg::U64(x.len() as u64)]))
}

/// `gate = silu(gate) * up` (`silu_mul_bf16`; bf16, same length).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn silu_mul(gate: Buf<bf16>, up: Buf<bf16>) -> Result<Launch> {
    check_len("up", gate.len(), up.len())?;
    let args = vec![gate.arg(), up.arg(), Arg::U64(gate.len() as u64)];
    Ok(Launch::new("silu_mul_bf16", stride_grid(gate.len()), 256, args))
}

/// `y[r] += bias` for every row of `y` (`bias_add_bf16`; `[rows, cols]`, bf16).
///
/// # Errors
/// As [`rope_kv_write`].
pub fn bias_add(rows: usize, y: Buf<bf16>, bias: Buf<bf16>) -> Result<Launch> {
    let cols = bias.len();
    check_len("y", rows * cols, y.len())?;
    let args = vec![y.arg(), bias.arg(), i32_arg("rows", rows)?, i32_arg("cols", cols)?];
    Ok(Launch::new("bias_add_bf16", stride_grid(y.len()), 256, args))
}

/// Fills `out` with seeded uniform values in `[lo, hi)` (`fill_uniform_bf16`: a hash of the seed and the index,
/// the same on every device).
///
/// # Errors
/// [`Error::InvalidArgument`] for a non-finite or empty range.
pub fn fill_uniform(out: Buf<bf16>, seed: u64, lo: f32, hi: f32) -> Result<Launch> {
    if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
        return Err(Error::InvalidArgument(format!("uniform range [{lo}, {hi})")));
    }
    let args = vec![out.arg(), Arg::U64(out.len() as u64), Arg::U64(seed), Arg::F32(lo), Arg::F32(hi)];
    Ok(Launch::new("fill_uniform_bf16", stride_grid(out.len()), 256, args))
}

/// `out[r] = [a[r]; b[r]]` as bf16 (`concat_rows_bf16`; `out`: `[rows, wa + wb]`); without `b`, a conversion of
/// `a` to bf16.
///
/// # Errors
/// As [`rope_kv_write`].
pub fn concat_rows(rows: usize, a: RowBuf, b: Option<RowBuf>, out: Buf<bf16>) -> Result<Launch> {
    let (wa, wb) = (a.width(), b.map_or(0, |b| b.width()));
    if rows == 0 || wa == 0 {
        return Err(Error::InvalidArgument(format!("concat of {rows} rows of width {wa} + {wb}")));
    }
    check_len("first source", rows * wa, a.len())?;
    if let Some(b) = b {
        check_len("second source", rows * wb, b.len())?;
    }
    check_len("out", rows * (wa + wb), out.len())?;
    let mut args: Vec<Arg> = RowBuf::args(Some(a)).into_iter().chain(RowBuf::args(b)).collect();
    args.extend([out.arg(), i32_arg("rows", rows)?, i32_arg("width", wa)?, i32_arg("width", wb)?]);
    Ok(Launch::new("concat_rows_bf16", [dim("rows", rows)?, 1, 1], 256, args))
}

/// The `k` largest logits of every row of `logits` (`top_k_rows_f32`; `[rows, vocab]` f32), in decreasing order
/// (ties: smaller index first), and their log-probabilities under the row's softmax: `idx`, `logprob`: `[rows, k]`.
///
/// # Errors
/// [`Error::InvalidArgument`] for `k` outside `1..=min(vocab, MAX_TOP_K)`; otherwise as [`rope_kv_write`].
pub fn top_k_rows(
    rows: usize,
    vocab: usize,
    k: usize,
    logits: Buf<f32>,
    idx: Buf<i32>,
    logprob: Buf<f32>,
) -> Result<Launch> {
    if rows == 0 || k == 0 || k > vocab || k > MAX_TOP_K {
        return Err(Error::InvalidArgument(format!(
            "top-{k} of {rows} rows of {vocab} logits (k must be in 1..={MAX_TOP_K} and <= the vocabulary)"
        )));
    }
    check_len("logits", rows * vocab, logits.len())?;
    check_len("top-k indices", rows * k, idx.len())?;
    check_len("top-k log-probs", rows * k, logprob.len())?;
    let args = vec![
        logits.arg(),
        idx.arg(),
        logprob.arg(),
        i32_arg("rows", rows)?,
        i32_arg("vocab", vocab)?,
        i32_arg("k", k)?,
    ];
    Ok(Launch::new("top_k_rows_f32", [dim("rows", rows)?, 1, 1], 256, args))
}
