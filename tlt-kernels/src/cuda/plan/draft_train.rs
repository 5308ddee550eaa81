//! Plans of the EAGLE-2 drafter's training losses (`draft_train.cu`): the soft cross-entropy between the target's and
//! the draft's logits and its gradient with respect to the draft's logits, and the SmoothL1 feature regression and
//! its gradient. Every reduction runs in a fixed order, so the same inputs give the same bits on every run.

use super::*;

/// Threads per block of `draft_train.cu`'s row kernels (`DT_THREADS`).
const DT_THREADS: u32 = 256;

/// What [`soft_ce`] writes, one entry per row (`[rows]` each).
#[derive(Debug, Clone, Copy)]
pub struct SoftCeBufs {
    /// The soft cross-entropy `-sum_v softmax(target)_v log softmax(draft)_v`.
    pub loss: Buf<f32>,
    /// The target logits' log-sum-exp.
    pub lse_t: Buf<f32>,
    /// The draft logits' log-sum-exp.
    pub lse_d: Buf<f32>,
    /// The target logits' argmax (ties: the smaller index; -1 for a row of `-inf`).
    pub arg_t: Buf<i32>,
    /// The draft logits' argmax (likewise).
    pub arg_d: Buf<i32>,
}

/// Checks a `[rows, vocab]` pair of logits.
fn check_pair(rows: usize, vocab: usize, target: Buf<f32>, draft: Buf<f32>) -> Result<()> {
    if rows == 0 || vocab == 0 {
        return Err(Error::InvalidArgument(format!("soft cross-entropy of {rows} rows of vocabulary {vocab}")));
    }
    check_len("target logits", rows * vocab, target.len())?;
    check_len("draft logits", rows * vocab, draft.len())
}

/// Per row of the target's and the draft's logits (`soft_ce_f32`; `[rows, vocab]` f32 each): the soft
/// cross-entropy `loss = -sum_v p_v log q_v` with `p = softmax(target)`, `q = softmax(draft)` (max-subtracted, the
/// exponentials in f32 and their sums in f64), both log-sum-exps (what [`soft_ce_back`] reads) and both argmaxes.
///
/// # Errors
/// [`Error::InvalidArgument`] for no rows or an empty vocabulary; [`Error::ShapeMismatch`] for a buffer of the
/// wrong length.
pub fn soft_ce(rows: usize, vocab: usize, target: Buf<f32>, draft: Buf<f32>, out: &SoftCeBufs) -> Result<Launch> {
    check_pair(rows, vocab, target, draft)?;
    check_len("loss", rows, out.loss.len())?;
    check_len("lse_t", rows, out.lse_t.len())?;
    check_len("lse_d", rows, out.lse_d.len())?;
    check_len("arg_t", rows, out.arg_t.len())?;
    check_len("arg_d", rows, out.arg_d.len())?;
    let args = vec![
        target.arg(),
        draft.arg(),
        out.loss.arg(),
        out.lse_t.arg(),
        out.lse_d.arg(),
        out.arg_t.arg(),
        out.arg_d.arg(),
        i32_arg("rows", rows)?,
        i32_arg("vocab", vocab)?,
    ];
    Ok(Launch::new("soft_ce_f32", [dim("rows", rows)?, 1, 1], DT_THREADS, args))
}

/// The gradient of `sum_r w[r] * loss[r]` ([`soft_ce`]'s loss) with respect to the draft's logits
/// (`soft_ce_back_f32`): `d[r, v] = w[r] * (softmax(draft)_v - softmax(target)_v)` from [`soft_ce`]'s log-sum-exps,
/// f32 math rounded to bf16 (`d`: `[rows, vocab]`, every element written; zeros for a row with `w[r] == 0`).
///
/// # Errors
/// As [`soft_ce`].
#[allow(clippy::too_many_arguments)]
pub fn soft_ce_back(
    rows: usize,
    vocab: usize,
    target: Buf<f32>,
    draft: Buf<f32>,
    lse_t: Buf<f32>,
    lse_d: Buf<f32>,
    w: Buf<f32>,
    d: Buf<bf16>,
) -> Result<Launch> {
    check_pair(rows, vocab, target, draft)?;
    check_len("lse_t", rows, lse_t.len())?;
    check_len("lse_d", rows, lse_d.len())?;
    check_len("row weights", rows, w.len())?;
    check_len("d_draft", rows * vocab, d.len())?;
    let args = vec![
        target.arg(),
        draft.arg(),
        lse_t.arg(),
        lse_d.arg(),
        w.arg(),
        d.arg(),
        i32_arg("rows", rows)?,
        i32_arg("vocab", vocab)?,
    ];
    // Up to 16 elements a thread per block; at most 64 blocks a row.
    let chunks = vocab.div_ceil(16 * DT_THREADS as usize).clamp(1, 64);
    Ok(Launch::new("soft_ce_back_f32", [dim("rows", rows)?, dim("chunks", chunks)?, 1], DT_THREADS, args))
}

/// Checks a `[rows, width]` pair of feature rows.
fn check_features(rows: usize, width: usize, pred: Buf<f32>, target: Buf<f32>) -> Result<()> {
    if rows == 0 || width == 0 {
        return Err(Error::InvalidArgument(format!("SmoothL1 of {rows} rows of width {width}")));
    }
    check_len("pred", rows * width, pred.len())?;
    check_len("target", rows * width, target.len())
}

/// Per row (`smooth_l1_f32`; `pred`, `target`: `[rows, width]` f32, `loss`: `[rows]`): the mean over the row of
/// SmoothL1 (Huber, beta 1) of `pred - target`, the elements in f32 and their sum in f64.
///
/// # Errors
/// [`Error::InvalidArgument`] for no rows or a zero width; [`Error::ShapeMismatch`] for a buffer of the wrong
/// length.
pub fn smooth_l1(rows: usize, width: usize, pred: Buf<f32>, target: Buf<f32>, loss: Buf<f32>) -> Result<Launch> {
    check_features(rows, width, pred, target)?;
    check_len("loss", rows, loss.len())?;
    let args = vec![pred.arg(), target.arg(), loss.arg(), i32_arg("rows", rows)?, i32_arg("width", width)?];
    Ok(Launch::new("smooth_l1_f32", [dim("rows", rows)?, 1, 1], DT_THREADS, args))
}

/// The gradient of `sum_r w[r] * loss[r]` ([`smooth_l1`]'s loss) with respect to `pred` (`smooth_l1_back_f32`):
/// `dx[r, c] = w[r] * clamp(pred - target, -1, 1) / width` (f32, written; `dx`: `[rows, width]`, `w`: `[rows]`).
///
/// # Errors
/// As [`smooth_l1`].
pub fn smooth_l1_back(
    rows: usize,
    width: usize,
    pred: Buf<f32>,
    target: Buf<f32>,
    w: Buf<f32>,
    dx: Buf<f32>,
) -> Result<Launch> {
    check_features(rows, width, pred, target)?;
    check_len("row weights", rows, w.len())?;
    check_len("dx", rows * width, dx.len())?;
    let args = vec![pred.arg(), target.arg(), w.arg(), dx.arg(), i32_arg("rows", rows)?, i32_arg("width", width)?];
    Ok(Launch::new("smooth_l1_back_f32", stride_grid(rows * width), 256, args))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_train_plans_check_shapes() {
        let f = |n| Buf::<f32>::new(0x10_0000, n);
        let bf = |n| Buf::<bf16>::new(0x20_0000, n);
        let i = |n| Buf::<i32>::new(0x30_0000, n);
        let out = SoftCeBufs { loss: f(3), lse_t: f(3), lse_d: f(3), arg_t: i(3), arg_d: i(3) };
        let l = soft_ce(3, 10, f(30), f(30), &out).unwrap();
        assert_eq!((l.kernel, l.grid, l.args.len()), ("soft_ce_f32", [3, 1, 1], 9));
        assert!(soft_ce(3, 10, f(30), f(29), &out).is_err());
        assert!(soft_ce(0, 10, f(0), f(0), &out).is_err());
        assert!(soft_ce(3, 10, f(30), f(30), &SoftCeBufs { arg_d: i(2), ..out }).is_err());
        let l = soft_ce_back(2, 152_000, f(304_000), f(304_000), f(2), f(2), f(2), bf(304_000)).unwrap();
        assert_eq!(l.grid, [2, 38, 1]);
        assert!(soft_ce_back(2, 5, f(10), f(10), f(2), f(2), f(1), bf(10)).is_err(), "row weights");
        assert!(soft_ce_back(2, 5, f(10), f(10), f(2), f(2), f(2), bf(9)).is_err());
        assert_eq!(smooth_l1(4, 8, f(32), f(32), f(4)).unwrap().grid, [4, 1, 1]);
        assert!(smooth_l1(4, 0, f(0), f(0), f(4)).is_err());
        assert!(smooth_l1(4, 8, f(32), f(32), f(3)).is_err());
        assert!(smooth_l1_back(4, 8, f(32), f(32), f(4), f(31)).is_err());
        assert_eq!(smooth_l1_back(4, 8, f(32), f(32), f(4), f(32)).unwrap().kernel, "smooth_l1_back_f32");
    }
}
