//! The inference forward: batched, ragged, with causal appends and tentative token trees.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use tlt_kernels::{tree_attention, AttnShape, Matrix, Visibility, WeightDType};

use crate::cache::{KvCache, SeqId};
use crate::config::LlamaConfig;
use crate::linear::{linear, with_f32_slice};
use crate::ops;
use crate::weights::{Linear, LlamaWeights};

fn lin(x: &[f32], rows: usize, l: &Linear) -> Result<Vec<f32>> {
    linear(x, rows, &l.weight, l.bias.as_ref(), l.packed.as_deref())
}
use crate::{Error, Result};

/// A Llama-family decoder. Weights are read-only; all per-sequence state lives in a [`KvCache`].
#[derive(Debug, Clone)]
pub struct Llama {
    cfg: LlamaConfig,
    weights: LlamaWeights,
    inv_freq: Vec<f64>,
}

/// Which rows of logits a [`SeqInput`] wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// None (e.g. a prefill whose next token is already known).
    None,
    /// Only the last new token (prefill, decode).
    Last,
    /// Every new token (tree verification, scoring).
    All,
}

/// A hidden state the forward can hand back for every new token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tap {
    /// The residual stream entering layer `i` (`i == num_layers` is the output of the last layer).
    LayerInput(usize),
    /// The output of the final RMSNorm (what the LM head reads).
    FinalNorm,
}

impl Tap {
    /// The taps EAGLE-3 reads: the residual stream entering layers 2, L/2 and L-3, then the final norm.
    pub fn eagle3(num_layers: usize) -> [Tap; 4] {
        [
            Tap::LayerInput(2.min(num_layers)),
            Tap::LayerInput(num_layers / 2),
            Tap::LayerInput(num_layers.saturating_sub(3)),
            Tap::FinalNorm,
        ]
    }
}

/// New tokens for one sequence in a batched forward.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// The sequence (its committed tokens are the context).
    pub seq: SeqId,
    /// The new tokens.
    pub tokens: &'a [u32],
    /// `None`: a causal append, committed at once (prefill, decode).
    /// `Some(parents)`: a token tree; `parents[i]` is the index of node `i`'s parent among the new tokens
    /// (it must be `< i`) or `None` for a node attached to the committed prefix. Node `i` sits at position
    /// `len + depth(i)` and attends to the prefix and its own ancestors. Its keys and values stay tentative
    /// until [`KvCache::commit`].
    pub tree: Option<&'a [Option<usize>]>,
    /// Which logits to return.
    pub logits: LogitsFor,
}

/// What a batched forward returns.
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// `[rows, vocab]` logits for the requested rows of all inputs, in input order.
    pub logits: Tensor,
    /// For each input, its rows in `logits`.
    pub logit_rows: Vec<Range<usize>>,
    /// One `[tokens, hidden]` tensor per requested tap, rows in input order.
    pub taps: Vec<Tensor>,
    /// For each input, its rows in every tap tensor.
    pub token_rows: Vec<Range<usize>>,
}

/// Per-input layout computed before any state changes.
struct Plan {
    seq: SeqId,
    base: usize,
    rows: Range<usize>,
    /// Position of each new token: `base + depth`.
    positions: Vec<usize>,
    tree: Option<Vec<Option<usize>>>,
}

impl Llama {
    /// Builds a model from a validated config and matching weights.
    pub fn new(cfg: LlamaConfig, weights: LlamaWeights) -> Result<Self> {
        cfg.validate()?;
        if weights.layers.len() != cfg.num_hidden_layers {
            return Err(Error::InvalidInput(format!(
                "{} layers of weights for a config with {}",
                weights.layers.len(),
                cfg.num_hidden_layers
            )));
        }
        let inv_freq = cfg.rope_inv_freq();
        Ok(Self { cfg, weights, inv_freq })
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The parameters.
    pub fn weights(&self) -> &LlamaWeights {
        &self.weights
    }

    pub(crate) fn weights_mut(&mut self) -> &mut LlamaWeights {
        &mut self.weights
    }

    pub(crate) fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// An empty cache shaped for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.cfg.num_hidden_layers, self.cfg.kv_dim())
    }

    /// Appends `tokens` to `seq` and returns the `[vocab]` logits after the last one.
    pub fn prefill(&self, cache: &mut KvCache, seq: SeqId, tokens: &[u32]) -> Result<Tensor> {
        let input = SeqInput { seq, tokens, tree: None, logits: LogitsFor::Last };
        Ok(self.forward(cache, &[input], &[])?.logits.squeeze(0)?)
    }

    /// One token for each of a batch of sequences; returns `[batch, vocab]` logits.
    pub fn decode(&self, cache: &mut KvCache, batch: &[(SeqId, u32)]) -> Result<Tensor> {
        let inputs: Vec<SeqInput> = batch
            .iter()
            .map(|(seq, tok)| SeqInput {
                seq: *seq,
                tokens: std::slice::from_ref(tok),
                tree: None,
                logits: LogitsFor::Last,
            })
            .collect();
        Ok(self.forward(cache, &inputs, &[])?.logits)
    }

    /// Scores a token tree on `seq` (see [`SeqInput::tree`]); returns `[nodes, vocab]` logits.
    pub fn verify_tree(
        &self,
        cache: &mut KvCache,
        seq: SeqId,
        tokens: &[u32],
        parents: &[Option<usize>],
    ) -> Result<Tensor> {
        let input = SeqInput { seq, tokens, tree: Some(parents), logits: LogitsFor::All };
        Ok(self.forward(cache, &[input], &[])?.logits)
    }

    /// The general batched forward. On error the cache is left as it was.
    pub fn forward(&self, cache: &mut KvCache, inputs: &[SeqInput], taps: &[Tap]) -> Result<ForwardOutput> {
        let plans = self.plan(cache, inputs, taps)?;
        let result = self.run(cache, inputs, &plans, taps);
        if result.is_err() {
            for p in &plans {
                cache.rollback_to(p.seq, p.base)?;
            }
        }
        result
    }

    fn plan(&self, cache: &KvCache, inputs: &[SeqInput], taps: &[Tap]) -> Result<Vec<Plan>> {
        if cache.n_layers() != self.cfg.num_hidden_layers || cache.kv_dim() != self.cfg.kv_dim() {
            return Err(Error::InvalidInput("cache was made for a different model shape".into()));
        }
        for tap in taps {
            if let Tap::LayerInput(i) = tap {
                if *i > self.cfg.num_hidden_layers {
                    return Err(Error::InvalidInput(format!(
                        "tap of layer {i} in a {}-layer model",
                        self.cfg.num_hidden_layers
                    )));
                }
            }
        }
        let mut plans = Vec::with_capacity(inputs.len());
        let mut row = 0;
        for (k, input) in inputs.iter().enumerate() {
            let n = input.tokens.len();
            if n == 0 {
                return Err(Error::InvalidInput(format!("input {k} has no tokens")));
            }
            if inputs[..k].iter().any(|o| o.seq == input.seq) {
                return Err(Error::InvalidInput(format!("sequence {} appears twice in one batch", input.seq.0)));
            }
            if cache.has_pending(input.seq)? {
                return Err(Error::PendingTree(input.seq.0));
            }
            if let Some(&bad) = input.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
                return Err(Error::InvalidInput(format!("token id {bad} >= vocab size {}", self.cfg.vocab_size)));
            }
            let base = cache.len(input.seq)?;
            let positions = match input.tree {
                None => (base..base + n).collect(),
                Some(parents) => tree_depths(parents, n)?.into_iter().map(|d| base + d).collect(),
            };
            plans.push(Plan {
                seq: input.seq,
                base,
                rows: row..row + n,
                positions,
                tree: input.tree.map(<[Option<usize>]>::to_vec),
            });
            row += n;
        }
        Ok(plans)
    }

    fn run(&self, cache: &mut KvCache, inputs: &[SeqInput], plans: &[Plan], taps: &[Tap]) -> Result<ForwardOutput> {
        let cfg = &self.cfg;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let eps = cfg.rms_norm_eps as f32;
        let tokens: Vec<u32> = inputs.iter().flat_map(|i| i.tokens.iter().copied()).collect();
        let t = tokens.len();
        let positions: Vec<usize> = plans.iter().flat_map(|p| p.positions.iter().copied()).collect();
        let (cos, sin) = ops::rope_table(&self.inv_freq, &positions);
        let scale = 1.0 / (hd as f32).sqrt();

        let ids = Tensor::from_slice(&tokens, t, &Device::Cpu)?;
        let mut x: Vec<f32> = self.weights.embed_tokens.index_select(&ids, 0)?.flatten_all()?.to_vec1()?;
        let mut tapped: Vec<Option<Vec<f32>>> = vec![None; taps.len()];
        let mut record = |layer_input: usize, x: &[f32]| {
            for (slot, tap) in tapped.iter_mut().zip(taps) {
                if *tap == Tap::LayerInput(layer_input) {
                    *slot = Some(x.to_vec());
                }
            }
        };

        for (li, lw) in self.weights.layers.iter().enumerate() {
            record(li, &x);
            let xn = ops::rms_norm_rows(&x, &lw.input_layernorm.to_vec1::<f32>()?, eps);
            let mut q = lin(&xn, t, &lw.proj.q_proj)?;
            let mut k = lin(&xn, t, &lw.proj.k_proj)?;
            let v = lin(&xn, t, &lw.proj.v_proj)?;
            if let Some(n) = &lw.qk_norm {
                // Every head's vector on its own (rows of head_dim), before RoPE.
                q = ops::rms_norm_rows(&q, &n.q_norm.to_vec1::<f32>()?, eps);
                k = ops::rms_norm_rows(&k, &n.k_norm.to_vec1::<f32>()?, eps);
            }
            ops::apply_rope(&mut q, hd, &cos, &sin);
            ops::apply_rope(&mut k, hd, &cos, &sin);
            let kvd = cfg.kv_dim();
            let mut attn = vec![0f32; t * cfg.q_dim()];
            for p in plans {
                let r = p.rows.clone();
                cache.append(p.seq, li, &k[r.start * kvd..r.end * kvd], &v[r.start * kvd..r.end * kvd])?;
                let (keys, values) = cache.layer(p.seq, li)?;
                let vis = p.tree.as_deref().map_or(Visibility::Causal, Visibility::Tree);
                tree_attention(
                    &q[r.start * cfg.q_dim()..r.end * cfg.q_dim()],
                    keys,
                    values,
                    p.base,
                    vis,
                    AttnShape::new(cfg.num_attention_heads, cfg.kv_heads(), hd),
                    scale,
                    &mut attn[r.start * cfg.q_dim()..r.end * cfg.q_dim()],
                )?;
            }
            let o = lin(&attn, t, &lw.proj.o_proj)?;
            ops::add_assign(&mut x, &o);
            let xn = ops::rms_norm_rows(&x, &lw.post_attention_layernorm.to_vec1::<f32>()?, eps);
            let mut gate = lin(&xn, t, &lw.proj.gate_proj)?;
            let up = lin(&xn, t, &lw.proj.up_proj)?;
            ops::silu_mul_assign(&mut gate, &up);
            let down = lin(&gate, t, &lw.proj.down_proj)?;
            ops::add_assign(&mut x, &down);
        }
        record(cfg.num_hidden_layers, &x);
        let xn = ops::rms_norm_rows(&x, &self.weights.norm.to_vec1::<f32>()?, eps);
        for (slot, tap) in tapped.iter_mut().zip(taps) {
            if *tap == Tap::FinalNorm {
                *slot = Some(xn.clone());
            }
        }

        let mut head_in = Vec::new();
        let mut logit_rows = Vec::with_capacity(plans.len());
        for (p, input) in plans.iter().zip(inputs) {
            let rows = match input.logits {
                LogitsFor::None => p.rows.end..p.rows.end,
                LogitsFor::Last => p.rows.end - 1..p.rows.end,
                LogitsFor::All => p.rows.clone(),
            };
            let start = head_in.len() / h;
            head_in.extend_from_slice(&xn[rows.start * h..rows.end * h]);
            logit_rows.push(start..start + rows.len());
        }
        let n_rows = head_in.len() / h;
        let logits = if n_rows == 0 {
            Tensor::zeros((0, cfg.vocab_size), candle_core::DType::F32, &Device::Cpu)?
        } else {
            let head = self.weights.head_packed.as_deref();
            let y = linear(&head_in, n_rows, self.weights.lm_head(), None, head)?;
            Tensor::from_vec(y, (n_rows, cfg.vocab_size), &Device::Cpu)?
        };
        let taps = tapped
            .into_iter()
            .map(|v| Ok(Tensor::from_vec(v.unwrap_or_default(), (t, h), &Device::Cpu)?))
            .collect::<Result<Vec<_>>>()?;
        for p in plans {
            cache.finish_forward(p.seq, p.rows.len(), p.tree.clone())?;
        }
        Ok(ForwardOutput { logits, logit_rows, taps, token_rows: plans.iter().map(|p| p.rows.clone()).collect() })
    }
}

/// Depth of each node of a tree given by `parents` (0 for nodes attached to the prefix).
fn tree_depths(parents: &[Option<usize>], n: usize) -> Result<Vec<usize>> {
    if parents.len() != n {
        return Err(Error::InvalidInput(format!("{} parents for {n} tree tokens", parents.len())));
    }
    let mut depths: Vec<usize> = Vec::with_capacity(n);
    for (i, parent) in parents.iter().enumerate() {
        depths.push(match parent {
            None => 0,
            Some(p) if *p < i => depths[*p] + 1,
            Some(p) => {
                return Err(Error::InvalidInput(format!("tree node {i} has parent {p}; parents must precede children")))
            }
        });
    }
    Ok(depths)
}

fn pack(t: &Tensor, dtype: WeightDType) -> Result<Arc<Matrix>> {
    let (n, k) = t.dims2()?;
    Ok(Arc::new(with_f32_slice(t, |w| Matrix::from_f32(n, k, w, dtype))??))
}

impl Llama {
    /// Converts every linear layer and the LM head to `dtype` for the inference forward (e.g. Q8_0 streams
    /// about a quarter of the bytes of f32). The f32 weights stay for training and saving; training does not
    /// update the packed copies, so [`Llama::make_trainable`] drops them. `WeightDType::F32` removes the packs.
    pub fn pack_for_inference(&mut self, dtype: WeightDType) -> Result<()> {
        let keep = dtype != WeightDType::F32;
        let w = self.weights_mut();
        for (_, lin) in w.linears_mut() {
            lin.packed = if keep { Some(pack(&lin.weight, dtype)?) } else { None };
        }
        w.head_packed = if keep { Some(pack(w.lm_head(), dtype)?) } else { None };
        Ok(())
    }

    /// The format the inference forward reads the linear layers in.
    pub fn inference_dtype(&self) -> WeightDType {
        self.weights()
            .layers
            .first()
            .and_then(|l| l.proj.q_proj.packed.as_ref())
            .map_or(WeightDType::F32, |m| m.view().dtype())
    }

    /// Bytes of weights one decode step streams through the linear layers (weights and biases) and the LM head.
    pub fn weight_bytes_per_token(&self) -> usize {
        let w = self.weights();
        let bytes =
            |t: &Tensor, p: Option<&Arc<Matrix>>| -> usize { p.map_or(t.elem_count() * 4, |m| m.view().bytes()) };
        let mut total = bytes(w.lm_head(), w.head_packed.as_ref());
        for l in &w.layers {
            for lin in l.proj.all() {
                total += bytes(&lin.weight, lin.packed.as_ref()) + lin.bias.as_ref().map_or(0, |b| b.elem_count() * 4);
            }
        }
        total
    }
}
