//! The drafter's inference forward: an immutable snapshot of its weights packed for `tlt-kernels`' skinny GEMM,
//! and the per-sequence KV cache of its one decoder layer.
//!
//! Row layout of a forward: each row is `(token, feature, position)`. EAGLE-2 fuses `fc([embed(token);
//! feature])` and runs a layer whose input norm is the identity; EAGLE-3 fuses the target's three tapped layers
//! with `fc` at committed positions (at drafted ones the feature is the drafter's own previous output, already
//! `H` wide), then attends over `[input_layernorm(embed); hidden_norm(g)]`. Both return the layer output `a` (fed
//! back as the next feature) and logits over the draft vocabulary (EAGLE-3 applies the final norm first).

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use tlt_kernels::{gemm, tree_attention, AttnShape, Matrix, Visibility, WeightDType};
use tlt_model::ops::{add_assign, apply_rope, rms_norm_rows, rope_table, silu_mul_assign};
use tlt_model::Linear;

use crate::config::DrafterKind;
use crate::{DraftLayer, DrafterConfig, Eagle2Drafter, Eagle3Drafter, Error, Result};

/// A linear layer packed for the inference GEMM (a copy: training may keep changing the source).
#[derive(Debug, Clone)]
struct Packed {
    w: Arc<Matrix>,
    bias: Option<Vec<f32>>,
}

fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl Packed {
    /// Packs `weight` in `dtype`, or in f32 when `dtype` is a block format and the row length is not a multiple
    /// of its 32-weight blocks (tiny test models).
    fn new(weight: &Tensor, bias: Option<&Tensor>, dtype: WeightDType) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        let dtype = if dtype.is_blocked() && !k.is_multiple_of(32) { WeightDType::F32 } else { dtype };
        let w = Arc::new(Matrix::from_f32(n, k, &host_f32(weight)?, dtype).map_err(tlt_model::Error::from)?);
        Ok(Self { w, bias: bias.map(host_f32).transpose()? })
    }

    fn from_linear(lin: &Linear, dtype: WeightDType) -> Result<Self> {
        Self::new(&lin.weight, lin.bias.as_ref(), dtype)
    }

    fn out_dim(&self) -> usize {
        self.w.view().n()
    }

    fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let mut y = vec![0f32; rows * self.out_dim()];
        gemm(x, rows, self.w.view(), self.bias.as_deref(), &mut y).map_err(tlt_model::Error::from)?;
        Ok(y)
    }
}

#[derive(Debug, Clone)]
struct PackedLayer {
    q: Packed,
    k: Packed,
    v: Packed,
    o: Packed,
    gate: Packed,
    up: Packed,
    down: Packed,
    input_norm: Option<Vec<f32>>,
    hidden_norm: Option<Vec<f32>>,
    post_norm: Vec<f32>,
}

impl PackedLayer {
    fn new(l: &DraftLayer, dtype: WeightDType) -> Result<Self> {
        let p = |lin: &Linear| Packed::from_linear(lin, dtype);
        Ok(Self {
            q: p(&l.proj.q_proj)?,
            k: p(&l.proj.k_proj)?,
            v: p(&l.proj.v_proj)?,
            o: p(&l.proj.o_proj)?,
            gate: p(&l.proj.gate_proj)?,
            up: p(&l.proj.up_proj)?,
            down: p(&l.proj.down_proj)?,
            input_norm: l.input_layernorm.as_ref().map(host_f32).transpose()?,
            hidden_norm: l.hidden_norm.as_ref().map(host_f32).transpose()?,
            post_norm: host_f32(&l.post_attention_layernorm)?,
        })
    }
}

/// A linear layer as host f32 (`w`: `[out, inp]`).
#[derive(Debug, Clone)]
pub(crate) struct ExportedLinear {
    pub w: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub out: usize,
    pub inp: usize,
}

/// A runtime's weights as host f32 ([`DraftRuntime::export`]).
#[derive(Debug, Clone)]
pub(crate) struct Exported {
    pub fc: ExportedLinear,
    /// q, k, v, o, gate, up, down.
    pub proj: [ExportedLinear; 7],
    pub input_norm: Option<Vec<f32>>,
    pub hidden_norm: Option<Vec<f32>>,
    pub post_norm: Vec<f32>,
    pub final_norm: Option<Vec<f32>>,
    /// The target's embedding, `[vocab, H]`.
    pub embed: Vec<f32>,
    pub head: ExportedLinear,
}

/// How a runtime packs its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeOptions {
    /// Format of the layer and `fc` weights (default f32). Block formats fall back to f32 for matrices whose rows
    /// are not a multiple of 32 weights.
    pub layer_dtype: WeightDType,
    /// Format of the LM head (default Q8_0: the head dominates a draft step's bytes).
    pub head_dtype: WeightDType,
    /// EAGLE-2 only: draft over these target ids only ("hot vocabulary", SGLang's `speculative_token_map`,
    /// FR-Spec's frequency-ranked draft head), instead of the drafter's own loss vocabulary
    /// ([`Eagle2Drafter::loss_vocab`]) or, without one, the whole vocabulary. EAGLE-3 always uses its own draft
    /// vocabulary.
    pub hot_vocab: Option<Vec<u32>>,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self { layer_dtype: WeightDType::F32, head_dtype: WeightDType::Q8_0, hot_vocab: None }
    }
}

/// An immutable snapshot of a drafter, packed for inference.
#[derive(Debug, Clone)]
pub struct DraftRuntime {
    kind: DrafterKind,
    hidden: usize,
    eps: f32,
    shape: AttnShape,
    inv_freq: Vec<f64>,
    fc: Packed,
    layer: PackedLayer,
    final_norm: Option<Vec<f32>>,
    /// The target's embedding, `[vocab, H]` (shared storage).
    embed: Tensor,
    head: Packed,
    /// Draft id -> target id (`None`: identity).
    head_ids: Option<Vec<u32>>,
}

/// Per-sequence state of the drafter: keys and values of its committed positions.
#[derive(Debug, Clone, Default)]
pub struct DraftCache {
    pub(crate) keys: Vec<f32>,
    pub(crate) values: Vec<f32>,
    /// Committed positions in the cache.
    pub(crate) len: usize,
}

/// One sequence's share of a forward: its cache, its rows (a range of the forward's rows), and what they attend
/// to besides the cache's committed positions. It lives here, beside [`Attend`], so that the executors above
/// (`exec`, `cuda`) and this runtime share it without importing each other.
pub type Group<'c, 'p, C> = (&'c mut C, Range<usize>, Attend<'p>);

/// What a group of rows attends to besides its cache's committed positions.
#[derive(Debug, Clone, Copy)]
pub enum Attend<'a> {
    /// The rows are consecutive new positions (tentative rows are dropped first).
    Causal,
    /// The rows extend the cache's tentative tree rows: `parents` covers the tentative rows already in the cache
    /// and then the new ones (`None` = attached to the last committed position).
    Tree(&'a [Option<usize>]),
}

/// See [`DraftRuntime::feature_of`]: training's column choice ([`crate::config::feature_slices`]), plus EAGLE-3
/// rows of just the three taps (inference needs no teacher).
pub(crate) fn feature_slice(kind: DrafterKind, h: usize, row: &[f32]) -> Result<&[f32]> {
    if kind == DrafterKind::Eagle3 && row.len() == 3 * h {
        return Ok(row);
    }
    let cols = crate::config::feature_slices(kind, h, row.len())?;
    row.get(cols.feature).ok_or_else(|| Error::batch("hidden", "feature columns outside the row"))
}

impl DraftCache {
    /// Committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is committed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One row of a forward: the token read, the feature paired with it, its position.
#[derive(Debug, Clone)]
pub struct Row<'a> {
    /// The token read at this position.
    pub token: u32,
    /// `3 * target_hidden` (EAGLE-3 at a committed position, fused by `fc`) or `H` (EAGLE-2 input; EAGLE-3 at a
    /// drafted position, the drafter's own previous output).
    pub feature: &'a [f32],
    /// Its position (RoPE).
    pub pos: usize,
}

impl DraftRuntime {
    /// Packs an EAGLE-2 drafter (its weights now, the target's embedding and LM head rows).
    ///
    /// # Errors
    /// For a hot vocabulary with an id outside the target's, or a packing failure.
    pub fn eagle2(d: &Eagle2Drafter, opts: &RuntimeOptions) -> Result<Self> {
        let w = d.weights();
        let head_full = d.target().lm_head();
        let own = if opts.hot_vocab.is_none() { d.loss_vocab()? } else { None };
        let (head, head_ids) = match opts.hot_vocab.as_ref().or(own.as_ref()) {
            Some(ids) => {
                let v = d.target().vocab_size();
                if ids.is_empty() || ids.iter().any(|&i| i as usize >= v) {
                    return Err(Error::InvalidArgument(format!("hot vocabulary must be non-empty ids below {v}")));
                }
                let idx = Tensor::from_slice(ids, ids.len(), head_full.device())?;
                (Packed::new(&head_full.index_select(&idx, 0)?, None, opts.head_dtype)?, Some(ids.clone()))
            }
            None => (Packed::new(head_full, None, opts.head_dtype)?, None),
        };
        Self::build(d.config(), &w.fc, &w.layer, None, d.target().embed_tokens(), head, head_ids, opts)
    }

    /// Packs an EAGLE-3 drafter (its weights and draft LM head now).
    ///
    /// # Errors
    /// On a packing failure.
    pub fn eagle3(d: &Eagle3Drafter, opts: &RuntimeOptions) -> Result<Self> {
        let w = d.weights();
        let head = Packed::new(&w.lm_head, None, opts.head_dtype)?;
        let ids = (!d.vocab().is_identity()).then(|| d.vocab().used().to_vec());
        Self::build(d.config(), &w.fc, &w.layer, Some(&w.norm), d.target().embed_tokens(), head, ids, opts)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        cfg: &DrafterConfig,
        fc: &Linear,
        layer: &DraftLayer,
        norm: Option<&Tensor>,
        embed: &Tensor,
        head: Packed,
        head_ids: Option<Vec<u32>>,
        opts: &RuntimeOptions,
    ) -> Result<Self> {
        let l = &cfg.llama;
        let shape = AttnShape::new(l.num_attention_heads, l.kv_heads(), l.head_dim());
        Ok(Self {
            kind: cfg.kind,
            hidden: l.hidden_size,
            eps: l.rms_norm_eps as f32,
            shape,
            inv_freq: l.rope_inv_freq(),
            fc: Packed::from_linear(fc, opts.layer_dtype)?,
            layer: PackedLayer::new(layer, opts.layer_dtype)?,
            final_norm: norm.map(host_f32).transpose()?,
            embed: embed.to_dtype(DType::F32)?,
            head,
            head_ids,
        })
    }

    /// EAGLE-2 or EAGLE-3.
    pub fn kind(&self) -> DrafterKind {
        self.kind
    }

    /// Width of a target feature row the drafter reads at committed positions (`H`, or `3H` for EAGLE-3).
    pub fn feature_width(&self) -> usize {
        self.fc.w.view().k() - if self.kind == DrafterKind::Eagle2 { self.hidden } else { 0 }
    }

    /// The part of a recorded target feature row the drafter reads at a committed position. Rows are the
    /// final-norm state (`H`), the three EAGLE-3 taps (`3H`), or `Tap::eagle3`'s four taps (`4H`: three aux
    /// layers, then the final norm): EAGLE-2 reads the final norm, EAGLE-3 the three aux layers.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] for any other width.
    pub fn feature_of<'r>(&self, row: &'r [f32]) -> Result<&'r [f32]> {
        feature_slice(self.kind, self.hidden, row)
    }

    /// The drafter's hidden size `H`.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// Number of draft-vocabulary logits per row.
    pub fn draft_vocab(&self) -> usize {
        self.head.out_dim()
    }

    /// The target id of draft id `i`.
    pub fn target_id(&self, i: usize) -> u32 {
        match &self.head_ids {
            Some(ids) => ids.get(i).copied().unwrap_or(0),
            None => i as u32,
        }
    }

    fn embed_rows(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let idx = Tensor::from_slice(tokens, tokens.len(), self.embed.device())?;
        host_f32(&self.embed.index_select(&idx, 0)?)
    }

    /// The attention input (`[rows, qkv_in]`) and the residual stream (`[rows, H]`) of `rows`.
    fn inputs(&self, rows: &[Row<'_>]) -> Result<(Vec<f32>, Vec<f32>)> {
        let h = self.hidden;
        let emb = self.embed_rows(&rows.iter().map(|r| r.token).collect::<Vec<_>>())?;
        match self.kind {
            DrafterKind::Eagle2 => {
                let mut cat = Vec::with_capacity(rows.len() * 2 * h);
                for (r, e) in rows.iter().zip(emb.chunks_exact(h)) {
                    if r.feature.len() != h {
                        return Err(Error::batch("feature", format!("width {}, expected {h}", r.feature.len())));
                    }
                    cat.extend_from_slice(e);
                    cat.extend_from_slice(r.feature);
                }
                let x = self.fc.forward(&cat, rows.len())?;
                Ok((x.clone(), x))
            }
            DrafterKind::Eagle3 => {
                let fw = self.fc.w.view().k();
                let mut g = Vec::with_capacity(rows.len() * h);
                for r in rows {
                    if r.feature.len() == fw {
                        g.extend(self.fc.forward(r.feature, 1)?);
                    } else if r.feature.len() == h {
                        g.extend_from_slice(r.feature);
                    } else {
                        return Err(Error::batch(
                            "feature",
                            format!("width {}, expected {fw} or {h}", r.feature.len()),
                        ));
                    }
                }
                let (inorm, hnorm) = match (&self.layer.input_norm, &self.layer.hidden_norm) {
                    (Some(a), Some(b)) => (a, b),
                    _ => return Err(Error::config("midlayer", "no input/hidden norm", "EAGLE-3 needs both")),
                };
                let (en, gn) = (rms_norm_rows(&emb, inorm, self.eps), rms_norm_rows(&g, hnorm, self.eps));
                let mut x = Vec::with_capacity(rows.len() * 2 * h);
                for (e, gg) in en.chunks_exact(h).zip(gn.chunks_exact(h)) {
                    x.extend_from_slice(e);
                    x.extend_from_slice(gg);
                }
                Ok((x, g))
            }
        }
    }

    /// Runs `rows`, grouped per sequence: `groups[i] = (cache, row range, attend)`. The group's rows attend to
    /// its cache's committed positions and as [`Attend`] says; their keys and values are appended to the cache
    /// (after any tentative rows [`Attend::Tree`] keeps). They become committed only if the caller raises the
    /// cache's `len`. Returns the layer outputs `[rows, H]`.
    pub(crate) fn forward(&self, rows: &[Row<'_>], groups: &mut [Group<'_, '_, DraftCache>]) -> Result<Vec<f32>> {
        let n = rows.len();
        let (x_in, mut resid) = self.inputs(rows)?;
        let l = &self.layer;
        let (mut q, mut k, v) = (l.q.forward(&x_in, n)?, l.k.forward(&x_in, n)?, l.v.forward(&x_in, n)?);
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect();
        let (cos, sin) = rope_table(&self.inv_freq, &positions);
        apply_rope(&mut q, self.shape.head_dim, &cos, &sin);
        apply_rope(&mut k, self.shape.head_dim, &cos, &sin);
        let (qw, kw) = (self.shape.q_width(), self.shape.kv_width());
        let mut attn = vec![0f32; n * qw];
        let scale = 1.0 / (self.shape.head_dim as f32).sqrt();
        for (cache, range, attend) in groups.iter_mut() {
            let new = range.len();
            // Tentative rows kept from earlier levels (their queries are not recomputed: zero rows, output dropped).
            let prior = match attend {
                Attend::Causal => {
                    self.truncate_tentative(cache);
                    0
                }
                Attend::Tree(parents) => {
                    let prior = cache.keys.len() / kw - cache.len;
                    if parents.len() != prior + new {
                        return Err(Error::batch(
                            "tree",
                            format!("{} parents for {prior} + {new} rows", parents.len()),
                        ));
                    }
                    prior
                }
            };
            cache.keys.extend_from_slice(&k[range.start * kw..range.end * kw]);
            cache.values.extend_from_slice(&v[range.start * kw..range.end * kw]);
            let mut qs = vec![0f32; prior * qw];
            qs.extend_from_slice(&q[range.start * qw..range.end * qw]);
            let mut out = vec![0f32; (prior + new) * qw];
            let vis = match attend {
                Attend::Causal => Visibility::Causal,
                Attend::Tree(parents) => Visibility::Tree(parents),
            };
            tree_attention(&qs, &cache.keys, &cache.values, cache.len, vis, self.shape, scale, &mut out)
                .map_err(tlt_model::Error::from)?;
            attn[range.start * qw..range.end * qw].copy_from_slice(&out[prior * qw..]);
        }
        add_assign(&mut resid, &l.o.forward(&attn, n)?);
        let normed = rms_norm_rows(&resid, &l.post_norm, self.eps);
        let mut gate = l.gate.forward(&normed, n)?;
        silu_mul_assign(&mut gate, &l.up.forward(&normed, n)?);
        add_assign(&mut resid, &l.down.forward(&gate, n)?);
        Ok(resid)
    }

    /// Feeds one sequence's committed positions `cache.len .. tokens.len() - 1` into `cache`: position `t` reads
    /// `(tokens[t + 1], features[t])`, where `features` has the width [`DraftRuntime::feature_width`] (or `H`,
    /// the drafter's own outputs, for EAGLE-3 positions it drafted). Returns the layer outputs of those positions
    /// (`[rows, H]`); the last is the feature and draft distribution of the token after `tokens`.
    ///
    /// # Errors
    /// If `features` has fewer than `tokens.len() - 1` rows or a wrong width.
    pub fn extend(&self, cache: &mut DraftCache, tokens: &[u32], features: &[&[f32]]) -> Result<Vec<f32>> {
        let end = tokens.len().saturating_sub(1);
        if features.len() < end {
            return Err(Error::batch("features", format!("{} rows for {end} positions", features.len())));
        }
        let rows: Vec<Row<'_>> =
            (cache.len..end).map(|t| Row { token: tokens[t + 1], feature: features[t], pos: t }).collect();
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let n = rows.len();
        let out = self.forward(&rows, &mut [(&mut *cache, 0..n, Attend::Causal)])?;
        cache.len += n;
        Ok(out)
    }

    /// Draft-vocabulary logits `[rows, draft_vocab]` of layer outputs `a` (`[rows, H]`).
    pub fn logits(&self, a: &[f32]) -> Result<Vec<f32>> {
        let rows = a.len() / self.hidden;
        match &self.final_norm {
            Some(w) => self.head.forward(&rms_norm_rows(a, w, self.eps), rows),
            None => self.head.forward(a, rows),
        }
    }

    /// The heads and head dimension of the drafter's attention.
    pub fn attn_shape(&self) -> AttnShape {
        self.shape
    }

    /// RMSNorm epsilon and RoPE inverse frequencies (`[head_dim / 2]`).
    pub(crate) fn norm_eps_and_rope(&self) -> (f32, &[f64]) {
        (self.eps, &self.inv_freq)
    }

    /// Every weight as host f32 (quantized packings dequantized), for an executor that copies them elsewhere.
    pub(crate) fn export(&self) -> Result<Exported> {
        let lin = |p: &Packed| ExportedLinear {
            w: p.w.to_f32(),
            bias: p.bias.clone(),
            out: p.w.view().n(),
            inp: p.w.view().k(),
        };
        let l = &self.layer;
        Ok(Exported {
            fc: lin(&self.fc),
            proj: [lin(&l.q), lin(&l.k), lin(&l.v), lin(&l.o), lin(&l.gate), lin(&l.up), lin(&l.down)],
            input_norm: l.input_norm.clone(),
            hidden_norm: l.hidden_norm.clone(),
            post_norm: l.post_norm.clone(),
            final_norm: self.final_norm.clone(),
            embed: host_f32(&self.embed)?,
            head: lin(&self.head),
        })
    }

    /// Drops a cache's tentative rows (keys/values past its committed length).
    pub(crate) fn truncate_tentative(&self, cache: &mut DraftCache) {
        let kw = self.shape.kv_width();
        cache.keys.truncate(cache.len * kw);
        cache.values.truncate(cache.len * kw);
    }
}
