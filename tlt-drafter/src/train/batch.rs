//! Training batches from rollout [`FeatureSample`]s: which part of a recorded hidden row each drafter reads, the
//! window of a sample a step trains on, and packing windows into rows with segment ids.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::TrainConfig;
use crate::config::{feature_slices, DrafterKind};
use crate::eagle2::Eagle2Batch;
use crate::eagle3::{Eagle3Batch, Teacher};
use crate::online::FeatureSample;
use crate::{Error, Result};

/// The tokens of one sample a step trains on: `tokens[start..start + len]` and the hidden rows at the same
/// positions (the last token of a sample has none; its row is zero and masked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// First token index.
    pub start: usize,
    /// Number of tokens (at least 2).
    pub len: usize,
}

/// The training window of `sample`, at most `max_len >= 2` tokens, or `None` when it has no trainable position.
///
/// Training targets are the hidden rows `j` that predict a response token (`j + 1 >= response_start`) and that
/// exist (`j <= tokens.len() - 2`); target `j` is predicted by drafter position `j - 1` (which reads `x_j` and
/// `h_{j-1}`), so `j >= 1`. Like TLT's trainer, the window starts at the first response token's context:
/// one position before the first target, `start = max(response_start - 1, 1) - 1`.
pub fn window(sample: &FeatureSample, max_len: usize) -> Option<Window> {
    let n = sample.tokens.len();
    if n < 3 || max_len < 2 {
        return None;
    }
    let first = sample.response_start.saturating_sub(1).max(1);
    if first > n - 2 {
        return None;
    }
    let start = first - 1;
    Some(Window { start, len: max_len.min(n - start) })
}

/// How one step's windows are laid out: `rows[r]` lists `(sample index, window)` in row order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    /// The packed rows.
    pub rows: Vec<Vec<(usize, Window)>>,
    /// Length of every (right-padded) row: the longest row's token count.
    pub row_len: usize,
}

impl Packing {
    /// Number of samples packed.
    pub fn samples(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }

    /// Tokens in windows (padding excluded).
    pub fn tokens(&self) -> usize {
        self.rows.iter().flatten().map(|(_, w)| w.len).sum()
    }
}

/// Packs the windows of `samples`, in order, first-fit into rows of at most `cfg.row_len` tokens, until
/// `cfg.tokens_per_step` tokens are used (the last window is cropped to what is left if that still trains
/// something; samples without a trainable position are skipped).
pub fn pack(samples: &[Arc<FeatureSample>], cfg: &TrainConfig) -> Packing {
    let mut rows: Vec<Vec<(usize, Window)>> = Vec::new();
    let mut used_per_row: Vec<usize> = Vec::new();
    let mut used = 0;
    for (i, s) in samples.iter().enumerate() {
        let Some(mut w) = window(s, cfg.window) else { continue };
        let left = cfg.tokens_per_step.saturating_sub(used);
        if left < 2 {
            break;
        }
        w.len = w.len.min(left);
        used += w.len;
        match used_per_row.iter().position(|&u| u + w.len <= cfg.row_len) {
            Some(r) => {
                used_per_row[r] += w.len;
                rows[r].push((i, w));
            }
            None => {
                used_per_row.push(w.len);
                rows.push(vec![(i, w)]);
            }
        }
    }
    let row_len = used_per_row.iter().copied().max().unwrap_or(0);
    Packing { rows, row_len }
}

/// Host buffers of a packed batch.
struct Gathered {
    b: usize,
    t: usize,
    ids: Vec<u32>,
    feature: Vec<f32>,
    teacher: Vec<f32>,
    loss_mask: Vec<f32>,
    segments: Vec<u32>,
}

fn gather(samples: &[Arc<FeatureSample>], packing: &Packing, kind: DrafterKind, h: usize) -> Result<Gathered> {
    let (b, t) = (packing.rows.len(), packing.row_len);
    if b == 0 || t < 2 {
        return Err(Error::InvalidArgument(format!(
            "none of the {} samples has a training position (a response token after at least two tokens)",
            samples.len()
        )));
    }
    let fw = if kind == DrafterKind::Eagle2 { h } else { 3 * h };
    let tw = if kind == DrafterKind::Eagle3 { h } else { 0 };
    let mut g = Gathered {
        b,
        t,
        ids: vec![0; b * t],
        feature: vec![0.0; b * t * fw],
        teacher: vec![0.0; b * t * tw],
        loss_mask: vec![0.0; b * t],
        segments: vec![0; b * t],
    };
    for (r, row) in packing.rows.iter().enumerate() {
        let mut at = r * t;
        for (seg, &(i, w)) in row.iter().enumerate() {
            let s = samples.get(i).ok_or_else(|| Error::InvalidArgument(format!("packing names sample {i}")))?;
            let slices = feature_slices(kind, h, s.hidden.width())?;
            let n = s.tokens.len();
            if w.start + w.len > n || s.hidden.len() + 1 != n {
                return Err(Error::InvalidArgument(format!(
                    "window {w:?} outside a sample of {n} tokens and {} hidden rows",
                    s.hidden.len()
                )));
            }
            let first = s.response_start.saturating_sub(1).max(1);
            for k in 0..w.len {
                let j = w.start + k;
                g.ids[at] = s.tokens[j];
                g.segments[at] = seg as u32;
                if let Some(hrow) = s.hidden.row(j) {
                    g.feature[at * fw..(at + 1) * fw].copy_from_slice(&hrow[slices.feature.clone()]);
                    if let Some(tr) = &slices.teacher {
                        g.teacher[at * tw..(at + 1) * tw].copy_from_slice(&hrow[tr.clone()]);
                    }
                    if j >= first {
                        g.loss_mask[at] = 1.0;
                    }
                }
                at += 1;
            }
        }
        // Padding: one more segment, token 0, zero features, mask 0.
        g.segments[at..(r + 1) * t].fill(row.len() as u32);
    }
    Ok(g)
}

/// What a packed batch holds besides its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchInfo {
    /// Samples packed.
    pub samples: usize,
    /// Tokens in windows (padding excluded).
    pub tokens: usize,
    /// Rows.
    pub rows: usize,
    /// Tokens per (padded) row.
    pub row_len: usize,
}

fn info(p: &Packing) -> BatchInfo {
    BatchInfo { samples: p.samples(), tokens: p.tokens(), rows: p.rows.len(), row_len: p.row_len }
}

/// Builds an [`Eagle2Batch`] (f32 hidden states) from `samples`, packed as [`pack`] says: each window is its own
/// segment, padding is a final segment with mask 0, and the loss mask is 1 on the training targets of
/// [`window`]. Rows of width `H` or `4H` are read as [`feature_slices`] says.
///
/// # Errors
/// [`Error::InvalidBatch`] for a sample of the wrong width; [`Error::InvalidArgument`] when no sample has a
/// training position.
pub fn build_eagle2_batch(
    samples: &[Arc<FeatureSample>],
    h: usize,
    cfg: &TrainConfig,
) -> Result<(Eagle2Batch, BatchInfo)> {
    let p = pack(samples, cfg);
    let g = gather(samples, &p, DrafterKind::Eagle2, h)?;
    let dev = Device::Cpu;
    let batch = Eagle2Batch {
        input_ids: Tensor::from_vec(g.ids, (g.b, g.t), &dev)?,
        hidden: Tensor::from_vec(g.feature, (g.b, g.t, h), &dev)?,
        loss_mask: Tensor::from_vec(g.loss_mask, (g.b, g.t), &dev)?,
        segments: Some(Tensor::from_vec(g.segments, (g.b, g.t), &dev)?),
    };
    Ok((batch, info(&p)))
}

/// Builds an [`Eagle3Batch`] from `samples` recorded with `TappedLlama` and `Tap::eagle3` (rows of `4H`): the
/// aux features are the first `3H` columns, [`Teacher::FinalHidden`] the last `H`. Packing and masks as in
/// [`build_eagle2_batch`].
///
/// # Errors
/// As [`build_eagle2_batch`]; rows not `4H` wide are an [`Error::InvalidBatch`].
pub fn build_eagle3_batch(
    samples: &[Arc<FeatureSample>],
    h: usize,
    cfg: &TrainConfig,
) -> Result<(Eagle3Batch, BatchInfo)> {
    let p = pack(samples, cfg);
    let g = gather(samples, &p, DrafterKind::Eagle3, h)?;
    let dev = Device::Cpu;
    let batch = Eagle3Batch {
        input_ids: Tensor::from_vec(g.ids, (g.b, g.t), &dev)?,
        aux_hidden: Tensor::from_vec(g.feature, (g.b, g.t, 3 * h), &dev)?,
        teacher: Teacher::FinalHidden(Tensor::from_vec(g.teacher, (g.b, g.t, h), &dev)?),
        loss_mask: Tensor::from_vec(g.loss_mask, (g.b, g.t), &dev)?,
        segments: Some(Tensor::from_vec(g.segments, (g.b, g.t), &dev)?),
    };
    Ok((batch, info(&p)))
}
