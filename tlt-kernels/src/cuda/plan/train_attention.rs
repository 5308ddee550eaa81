//! Plans of the training attention kernels (`train_attention.cu`): causal self-attention over packed rows (the
//! tokens of several sequences one after another) from one fused q/k/v projection, and its backward to q, k and v.
//! Deterministic: no atomics, every sum in a fixed order, so a run gives the same bits whatever the block order.

use super::*;

/// Threads per block of the training attention kernels (`TA_THREADS`).
const TRAIN_ATT_BLOCK: u32 = 128;

/// The largest head dimension of the training attention kernels (`TA_MAX_HD`).
pub const TRAIN_ATT_MAX_HEAD_DIM: usize = 256;

/// The shape of a training attention call: `rows` packed rows, `heads` query heads sharing `kv_heads` KV heads
/// (GQA: query head `h` reads KV head `h / (heads / kv_heads)`), `head_dim` wide, scores scaled by `scale`
/// (usually `1 / sqrt(head_dim)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainAttnDims {
    /// Rows (tokens of every sequence, packed).
    pub rows: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Elements per head (even, at most [`TRAIN_ATT_MAX_HEAD_DIM`]).
    pub head_dim: usize,
    /// The factor of every score `q · k`.
    pub scale: f32,
}

impl TrainAttnDims {
    /// Checks the shape: rows, heads and KV heads positive, `heads % kv_heads == 0`, `head_dim` even and in
    /// `2..=256`, `scale` finite, and every size the kernels index within an `int`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what is wrong.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("training attention {self:?}: {m}")));
        if self.rows == 0 || self.heads == 0 || self.kv_heads == 0 {
            return bad("rows, heads and kv_heads must be positive".into());
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad("heads must be a multiple of kv_heads".into());
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.head_dim > TRAIN_ATT_MAX_HEAD_DIM {
            return bad(format!("head_dim must be even and in 2..={TRAIN_ATT_MAX_HEAD_DIM}"));
        }
        if !self.scale.is_finite() {
            return bad("scale must be finite".into());
        }
        let fits = |n: Option<usize>| n.is_some_and(|n| i32::try_from(n).is_ok());
        if !fits(self.rows.checked_mul(self.heads)) || !fits(Some(self.width())) {
            return bad("too large for the kernels' int indices".into());
        }
        Ok(())
    }

    /// Elements of one row of `qkv` and `d_qkv`: `(heads + 2 kv_heads) head_dim`.
    #[must_use]
    pub fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Query heads per KV head (0 for an invalid shape with no KV heads).
    #[must_use]
    pub fn group(&self) -> usize {
        self.heads.checked_div(self.kv_heads).unwrap_or(0)
    }

    /// Elements of `o` and `d_o`: `rows * heads * head_dim`.
    #[must_use]
    pub fn out_len(&self) -> usize {
        self.rows * self.heads * self.head_dim
    }

    /// The shape check, `qkv` (`[rows, width]`) and `seq_start` (`[rows]`), then the kernel's trailing arguments:
    /// `rows, heads, kv_heads, head_dim, scale`.
    fn common(&self, qkv: Buf<bf16>, seq_start: Buf<i32>) -> Result<[Arg; 5]> {
        self.check()?;
        check_len("qkv", self.rows * self.width(), qkv.len())?;
        check_len("seq_start", self.rows, seq_start.len())?;
        Ok([
            i32_arg("rows", self.rows)?,
            i32_arg("heads", self.heads)?,
            i32_arg("kv_heads", self.kv_heads)?,
            i32_arg("head_dim", self.head_dim)?,
            Arg::F32(self.scale),
        ])
    }
}

/// The forward (`train_attention_fwd_bf16`): for every row `i` and head `h`, `o[i, h] = softmax_j(scale q_i · k_j)
/// v_j` over the rows `j` in `seq_start[i] ..= i` (its own sequence, causally), with f32 accumulation and an online
/// max-subtracted softmax, and `lse[i, h]` the natural log-sum-exp of those scaled scores (for the backward).
///
/// `qkv`: `[rows, (heads + 2 kv_heads) head_dim]` bf16 (per row: the query heads, the key heads, the value heads;
/// RoPE applied); `seq_start`: `[rows]`, the row where each row's sequence starts (non-decreasing, `seq_start[r] <=
/// r`, sequences contiguous); `o`: `[rows, heads, head_dim]` bf16; `lse`: `[rows, heads]` f32. One block per (row,
/// head).
///
/// # Errors
/// [`Error::InvalidArgument`] for a bad shape ([`TrainAttnDims::check`]), [`Error::ShapeMismatch`] for a buffer of
/// the wrong length.
pub fn causal_attention(
    d: &TrainAttnDims,
    qkv: Buf<bf16>,
    seq_start: Buf<i32>,
    o: Buf<bf16>,
    lse: Buf<f32>,
) -> Result<Launch> {
    let tail = d.common(qkv, seq_start)?;
    check_len("o", d.out_len(), o.len())?;
    check_len("lse", d.rows * d.heads, lse.len())?;
    let args: Vec<Arg> = [qkv.arg(), seq_start.arg(), o.arg(), lse.arg()].into_iter().chain(tail).collect();
    let grid = [dim("rows", d.rows)?, dim("heads", d.heads)?, 1];
    Ok(Launch::new("train_attention_fwd_bf16", grid, TRAIN_ATT_BLOCK, args))
}

/// The backward to q (`train_attention_back_dq_bf16`), first of the two backward launches. For every row `i` and
/// head `h`: `delta[i, h] = Σ_d dO[i, h, d] O[i, h, d]` (written, `[rows, heads]` f32); over `j` in `seq_start[i]
/// ..= i`, `P_ij = exp(scale q_i · k_j - lse[i, h])`, `dS_ij = P_ij (dO_i · v_j - delta[i, h])`; `dq_i = scale Σ_j
/// dS_ij k_j`, written (f32) into the q columns of `d_qkv` (`[rows, (heads + 2 kv_heads) head_dim]`; the k and v
/// columns are left to [`causal_attention_back_dkv`]).
///
/// `o`, `d_o`: `[rows, heads, head_dim]` bf16 (the forward's output and its gradient); `lse`: the forward's.
///
/// # Errors
/// As [`causal_attention`].
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_back_dq(
    d: &TrainAttnDims,
    qkv: Buf<bf16>,
    seq_start: Buf<i32>,
    o: Buf<bf16>,
    d_o: Buf<bf16>,
    lse: Buf<f32>,
    delta: Buf<f32>,
    d_qkv: Buf<f32>,
) -> Result<Launch> {
    let tail = d.common(qkv, seq_start)?;
    check_len("o", d.out_len(), o.len())?;
    check_len("d_o", d.out_len(), d_o.len())?;
    check_len("lse", d.rows * d.heads, lse.len())?;
    check_len("delta", d.rows * d.heads, delta.len())?;
    check_len("d_qkv", d.rows * d.width(), d_qkv.len())?;
    let head = [qkv.arg(), seq_start.arg(), o.arg(), d_o.arg(), lse.arg(), delta.arg(), d_qkv.arg()];
    let args: Vec<Arg> = head.into_iter().chain(tail).collect();
    let grid = [dim("rows", d.rows)?, dim("heads", d.heads)?, 1];
    Ok(Launch::new("train_attention_back_dq_bf16", grid, TRAIN_ATT_BLOCK, args))
}

/// The backward to k and v (`train_attention_back_dkv_bf16`), run after [`causal_attention_back_dq`] (it reads its
/// `delta`). For every key row `j` and KV head `g`: over the query rows `i` from `j` to the end of `j`'s sequence
/// and the query heads `h` of `g`'s group, in that fixed order, `dV_j += P_ij dO_i` and `dK_j += scale dS_ij q_i`
/// (`P`, `dS` as there); written (f32) into the k and v columns of `d_qkv`. One block per (row, KV head).
///
/// # Errors
/// As [`causal_attention`].
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_back_dkv(
    d: &TrainAttnDims,
    qkv: Buf<bf16>,
    seq_start: Buf<i32>,
    d_o: Buf<bf16>,
    lse: Buf<f32>,
    delta: Buf<f32>,
    d_qkv: Buf<f32>,
) -> Result<Launch> {
    let tail = d.common(qkv, seq_start)?;
    check_len("d_o", d.out_len(), d_o.len())?;
    check_len("lse", d.rows * d.heads, lse.len())?;
    check_len("delta", d.rows * d.heads, delta.len())?;
    check_len("d_qkv", d.rows * d.width(), d_qkv.len())?;
    let head = [qkv.arg(), seq_start.arg(), d_o.arg(), lse.arg(), delta.arg(), d_qkv.arg()];
    let args: Vec<Arg> = head.into_iter().chain(tail).collect();
    let grid = [dim("rows", d.rows)?, dim("kv_heads", d.kv_heads)?, 1];
    Ok(Launch::new("train_attention_back_dkv_bf16", grid, TRAIN_ATT_BLOCK, args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> TrainAttnDims {
        TrainAttnDims { rows: 23, heads: 4, kv_heads: 2, head_dim: 8, scale: 8f32.sqrt().recip() }
    }

    #[test]
    fn shapes_are_checked() {
        assert!(dims().check().is_ok());
        for bad in [
            TrainAttnDims { rows: 0, ..dims() },
            TrainAttnDims { heads: 0, ..dims() },
            TrainAttnDims { kv_heads: 0, ..dims() },
            TrainAttnDims { heads: 6, kv_heads: 4, ..dims() },
            TrainAttnDims { head_dim: 7, ..dims() },
            TrainAttnDims { head_dim: 0, ..dims() },
            TrainAttnDims { head_dim: 258, ..dims() },
            TrainAttnDims { scale: f32::NAN, ..dims() },
            TrainAttnDims { rows: 1 << 30, ..dims() },
        ] {
            assert!(matches!(bad.check(), Err(Error::InvalidArgument(_))), "{bad:?} passed");
        }
        assert!(TrainAttnDims { head_dim: 256, heads: 64, kv_heads: 8, ..dims() }.check().is_ok());
    }

    #[test]
    fn plans_check_every_length_and_lay_out_the_grid() {
        let d = dims();
        let (w, n) = (d.width(), d.out_len());
        assert_eq!(w, (4 + 2 * 2) * 8);
        let bf = |n| Buf::<bf16>::new(0x10_0000, n);
        let f = |n| Buf::<f32>::new(0x20_0000, n);
        let i = |n| Buf::<i32>::new(0x30_0000, n);
        let (rh, rw) = (d.rows * d.heads, d.rows * w);
        let l = causal_attention(&d, bf(rw), i(23), bf(n), f(rh)).unwrap();
        assert_eq!((l.kernel, l.grid, l.block), ("train_attention_fwd_bf16", [23, 4, 1], [128, 1, 1]));
        assert_eq!(l.args.len(), 9);
        assert_eq!(l.args[8], Arg::F32(d.scale));
        let l = causal_attention_back_dq(&d, bf(rw), i(23), bf(n), bf(n), f(rh), f(rh), f(rw)).unwrap();
        assert_eq!((l.kernel, l.grid, l.args.len()), ("train_attention_back_dq_bf16", [23, 4, 1], 12));
        let l = causal_attention_back_dkv(&d, bf(rw), i(23), bf(n), f(rh), f(rh), f(rw)).unwrap();
        assert_eq!((l.kernel, l.grid, l.args.len()), ("train_attention_back_dkv_bf16", [23, 2, 1], 11));
        // Every buffer's length is checked.
        let e = |r: Result<Launch>, what: &str| {
            assert!(matches!(r, Err(Error::ShapeMismatch { what: w, .. }) if w == what), "{what}");
        };
        e(causal_attention(&d, bf(rw - 1), i(23), bf(n), f(rh)), "qkv");
        e(causal_attention(&d, bf(rw), i(22), bf(n), f(rh)), "seq_start");
        e(causal_attention(&d, bf(rw), i(23), bf(n + 1), f(rh)), "o");
        e(causal_attention(&d, bf(rw), i(23), bf(n), f(rh - 1)), "lse");
        e(causal_attention_back_dq(&d, bf(rw), i(23), bf(n - 1), bf(n), f(rh), f(rh), f(rw)), "o");
        e(causal_attention_back_dq(&d, bf(rw), i(23), bf(n), bf(n - 1), f(rh), f(rh), f(rw)), "d_o");
        e(causal_attention_back_dq(&d, bf(rw), i(23), bf(n), bf(n), f(1), f(rh), f(rw)), "lse");
        e(causal_attention_back_dq(&d, bf(rw), i(23), bf(n), bf(n), f(rh), f(1), f(rw)), "delta");
        e(causal_attention_back_dq(&d, bf(rw), i(23), bf(n), bf(n), f(rh), f(rh), f(n)), "d_qkv");
        e(causal_attention_back_dkv(&d, bf(rw), i(23), bf(1), f(rh), f(rh), f(rw)), "d_o");
        e(causal_attention_back_dkv(&d, bf(rw), i(23), bf(n), f(1), f(rh), f(rw)), "lse");
        e(causal_attention_back_dkv(&d, bf(rw), i(23), bf(n), f(rh), f(1), f(rw)), "delta");
        e(causal_attention_back_dkv(&d, bf(rw), i(23), bf(n), f(rh), f(rh), f(rw + 1)), "d_qkv");
        let bad = TrainAttnDims { kv_heads: 3, ..d };
        assert!(matches!(causal_attention(&bad, bf(rw), i(23), bf(n), f(rh)), Err(Error::InvalidArgument(_))));
    }
}
