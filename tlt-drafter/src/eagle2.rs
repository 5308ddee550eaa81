//! EAGLE-2 (TLT's RL path): feature-level autoregression on the target's last hidden state.
//!
//! Position `t` of a sequence `x_0..x_{T-1}` with target hidden states `h_0..h_{T-1}` (after the final norm)
//! reads the token `x_{t+1}` and the hidden state `h_t` and predicts `h_{t+1}`:
//! `a = fc([embed(x_{t+1}); h_t])`, then one decoder layer with an identity input norm (`a + attn(a)`, then
//! `+ mlp(post_attention_layernorm(.))`), no final norm. The target's LM head turns the prediction into logits.

use candle_core::{DType, Tensor, Var, D};
use tlt_kernels::SeededRng;
use tlt_model::nn::linear;
use tlt_model::Linear;

use crate::batch::{add_noise, argmax_host, shift_rows, smooth_l1, soft_cross_entropy, weighted_sum, Layout};
use crate::config::{DrafterConfig, DrafterKind, Eagle2LossConfig};
use crate::frozen::FrozenTarget;
use crate::layer::{check_shape, make_var, random_matrix, DraftLayer};
use crate::{Error, Result};

/// Name prefix of the decoder layer in the fastrl/TLT checkpoint layout.
pub(crate) const LAYER_PREFIX: &str = "model.layers.0.";

/// The trainable parameters of an EAGLE-2 drafter.
#[derive(Debug, Clone)]
pub struct Eagle2Weights {
    /// `[H, 2H]` fusion of `[embed(x_{t+1}); h_t]`, with an optional `[H]` bias.
    pub fc: Linear,
    /// The decoder layer (`input_layernorm` and `hidden_norm` are `None`).
    pub layer: DraftLayer,
}

impl Eagle2Weights {
    /// Seeded initialisation for `cfg` (f32).
    pub fn random(cfg: &DrafterConfig, seed: u64) -> Result<Self> {
        let mut rng = SeededRng::new(seed);
        let h = cfg.hidden_size();
        let bias = if cfg.fc_bias { Some(Tensor::zeros(h, DType::F32, &candle_core::Device::Cpu)?) } else { None };
        Ok(Self {
            fc: Linear::new(random_matrix(&mut rng, h, cfg.fc_in())?, bias),
            layer: DraftLayer::random(cfg, &mut rng)?,
        })
    }

    /// Weights for `cfg` whose parameters `get(name, shape)` supplies, by checkpoint name under `prefix`
    /// (`"model."` for the fastrl layout, `""` for the original EAGLE one).
    pub(crate) fn from_source(
        cfg: &DrafterConfig,
        prefix: &str,
        get: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<Self> {
        let h = cfg.hidden_size();
        let weight = get(&format!("{prefix}fc.weight"), &[h, cfg.fc_in()])?;
        let bias = if cfg.fc_bias { Some(get(&format!("{prefix}fc.bias"), &[h])?) } else { None };
        Ok(Self {
            fc: Linear::new(weight, bias),
            layer: DraftLayer::from_source(cfg, &format!("{prefix}layers.0."), get)?,
        })
    }

    /// Every parameter with its checkpoint name (`model.fc.weight`, `model.layers.0.self_attn.q_proj.weight`, ...).
    pub fn entries_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut out: Vec<(String, &mut Tensor)> = vec![("model.fc.weight".into(), &mut self.fc.weight)];
        if let Some(b) = self.fc.bias.as_mut() {
            out.push(("model.fc.bias".into(), b));
        }
        out.extend(self.layer.entries_mut(LAYER_PREFIX));
        out
    }

    /// Every parameter with its checkpoint name (cheap clones sharing storage).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut shallow = self.clone();
        shallow.entries_mut().into_iter().map(|(n, t)| (n, t.clone())).collect()
    }

    /// The checkpoint names and shapes `cfg` implies, in [`Self::entries_mut`] order.
    pub fn expected_shapes(cfg: &DrafterConfig) -> Vec<(String, Vec<usize>)> {
        let h = cfg.hidden_size();
        let mut out = vec![("model.fc.weight".to_string(), vec![h, cfg.fc_in()])];
        if cfg.fc_bias {
            out.push(("model.fc.bias".into(), vec![h]));
        }
        out.extend(DraftLayer::expected_shapes(cfg, LAYER_PREFIX));
        out
    }

    fn check(&mut self, cfg: &DrafterConfig) -> Result<()> {
        check_shape("fc.weight", &self.fc.weight, &[cfg.hidden_size(), cfg.fc_in()])?;
        match (&self.fc.bias, cfg.fc_bias) {
            (Some(b), true) => check_shape("fc.bias", b, &[cfg.hidden_size()])?,
            (None, false) => {}
            (Some(_), false) => {
                return Err(Error::UnexpectedTensor { path: "<weights>".into(), name: "fc.bias".into() })
            }
            (None, true) => return Err(Error::MissingTensor { path: "<weights>".into(), name: "fc.bias".into() }),
        }
        self.layer.check(cfg)
    }
}

/// A training batch for [`Eagle2Drafter`]: `b` right-padded (or packed) rows of `t` tokens.
#[derive(Debug, Clone)]
pub struct Eagle2Batch {
    /// `[b, t]` u32 tokens `x_0..x_{t-1}`.
    pub input_ids: Tensor,
    /// `[b, t, H]` target hidden states after the final norm; row `t` was computed reading `x_0..x_t`.
    pub hidden: Tensor,
    /// `[b, t]` (any dtype, 0/1 or weights): whether the target hidden state at each token is a training target.
    /// Drafter position `t` (predicting `h_{t+1}`) is weighted by `loss_mask[t + 1]` (fastrl's `loss_mask[1:]`).
    pub loss_mask: Tensor,
    /// Optional `[b, t]` segment ids for packed rows (contiguous runs; attention and shifts stay inside one).
    pub segments: Option<Tensor>,
}

/// The EAGLE-2 loss and its parts.
#[derive(Debug, Clone)]
pub struct Eagle2Loss {
    /// `vloss_weight * vloss + ploss_weight * ploss` (scalar; call `backward` on it).
    pub total: Tensor,
    /// SmoothL1 between predicted and target hidden state, mean over H, averaged over valid tokens.
    pub vloss: Tensor,
    /// Soft cross-entropy `-sum p_target log p_draft`, averaged over valid tokens.
    pub ploss: Tensor,
    /// Sum of the loss weights (valid tokens).
    pub tokens: f64,
    /// Fraction of weighted positions where the draft's argmax token equals the target's (NaN when `ploss_weight` is 0: the
    /// logits are then not computed).
    pub accuracy: f64,
}

/// An EAGLE-2 drafter: trainable [`Eagle2Weights`] plus the target's frozen embedding and LM head.
#[derive(Debug, Clone)]
pub struct Eagle2Drafter {
    cfg: DrafterConfig,
    weights: Eagle2Weights,
    target: FrozenTarget,
    inv_freq: Vec<f64>,
    /// Target ids the soft cross-entropy is restricted to (`None`: the whole vocabulary).
    loss_vocab: Option<Tensor>,
}

impl Eagle2Drafter {
    /// Builds a drafter, checking the config, the weights' shapes and dtype, and the target's shapes. The weights
    /// become trainable [`Var`]s (copied once unless they already are).
    pub fn new(cfg: DrafterConfig, mut weights: Eagle2Weights, target: FrozenTarget) -> Result<Self> {
        cfg.validate()?;
        if cfg.kind != DrafterKind::Eagle2 {
            return Err(Error::config("kind", "eagle3", "Eagle2Drafter needs an EAGLE-2 config"));
        }
        if target.hidden_size() != cfg.hidden_size() {
            return Err(Error::HiddenSizeMismatch {
                what: "hidden_size",
                drafter: cfg.hidden_size(),
                target: target.hidden_size(),
            });
        }
        if target.vocab_size() != cfg.vocab_size() {
            return Err(Error::VocabMismatch { drafter: cfg.vocab_size(), target: target.vocab_size() });
        }
        weights.check(&cfg)?;
        for (name, t) in weights.entries_mut() {
            if t.dtype() != target.dtype() {
                return Err(Error::config(&name, format!("{:?}", t.dtype()), "dtype differs from the target's"));
            }
            make_var(t)?;
        }
        let inv_freq = cfg.llama.rope_inv_freq();
        Ok(Self { cfg, weights, target, inv_freq, loss_vocab: None })
    }

    /// A seeded, freshly initialised drafter for `target` (weights in the target's dtype).
    pub fn random(cfg: DrafterConfig, target: FrozenTarget, seed: u64) -> Result<Self> {
        let mut weights = Eagle2Weights::random(&cfg, seed)?;
        for (_, t) in weights.entries_mut() {
            *t = t.to_dtype(target.dtype())?;
        }
        Self::new(cfg, weights, target)
    }

    /// The configuration.
    pub fn config(&self) -> &DrafterConfig {
        &self.cfg
    }

    /// The trainable parameters.
    pub fn weights(&self) -> &Eagle2Weights {
        &self.weights
    }

    /// The shared frozen target parts.
    pub fn target(&self) -> &FrozenTarget {
        &self.target
    }

    /// Replaces the shared target parts (the policy changed in RL); the trainable weights are kept.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `target`'s shapes or dtype differ from the current target's.
    pub fn set_target(&mut self, target: FrozenTarget) -> Result<()> {
        self.target.check_replacement(&target)?;
        self.target = target;
        Ok(())
    }

    /// Every trainable parameter as a named [`Var`] sharing the drafter's storage (for `candle_nn::AdamW`).
    /// The target's embedding and LM head are not among them.
    pub fn vars(&self) -> Result<Vec<(String, Var)>> {
        self.weights.named_tensors().into_iter().map(|(n, t)| Ok((n, Var::from_tensor(&t)?))).collect()
    }

    /// A copy with every tensor, the frozen target parts included, in `dtype` (e.g. f64 for gradient checks).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let mut weights = self.weights.clone();
        for (_, t) in weights.entries_mut() {
            *t = t.to_dtype(dtype)?.detach();
        }
        let mut d = Self::new(self.cfg.clone(), weights, self.target.to_dtype(dtype)?)?;
        d.loss_vocab = self.loss_vocab.clone();
        Ok(d)
    }

    fn check_batch(&self, batch: &Eagle2Batch) -> Result<Layout> {
        let lay = Layout::new(&batch.input_ids, &batch.loss_mask, batch.segments.as_ref(), self.cfg.vocab_size())?;
        let want = [lay.b, lay.t, self.cfg.hidden_size()];
        if batch.hidden.dims() != want {
            return Err(Error::batch("hidden", format!("shape {:?}, expected {want:?}", batch.hidden.dims())));
        }
        Ok(lay)
    }

    /// Restricts the soft cross-entropy (and the accuracy) to the target ids `ids`, e.g. the hot vocabulary the
    /// drafter will draft over (SGLang's `speculative_token_map`): both LM-head products then cost
    /// `ids.len() / vocab` of the full ones. The rows are read from the shared target head at every loss, so
    /// they follow target updates. The target distribution is renormalised over `ids`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an empty list or an id outside the vocabulary.
    pub fn with_loss_vocab(mut self, ids: &[u32]) -> Result<Self> {
        self.set_loss_vocab(Some(ids))?;
        Ok(self)
    }

    /// [`Self::with_loss_vocab`] in place (`None`: the whole vocabulary again).
    ///
    /// # Errors
    /// As [`Self::with_loss_vocab`].
    pub fn set_loss_vocab(&mut self, ids: Option<&[u32]>) -> Result<()> {
        let Some(ids) = ids else {
            self.loss_vocab = None;
            return Ok(());
        };
        let v = self.cfg.vocab_size();
        if ids.is_empty() || ids.iter().any(|&i| i as usize >= v) {
            return Err(Error::config("loss_vocab", ids.len(), "must be non-empty ids below the vocabulary size"));
        }
        self.loss_vocab = Some(Tensor::from_slice(ids, ids.len(), self.target.embed_tokens().device())?);
        Ok(())
    }

    /// The target ids the loss is restricted to ([`Self::with_loss_vocab`]), which the drafter's inference
    /// runtime also drafts over unless told otherwise ([`crate::RuntimeOptions::hot_vocab`]).
    ///
    /// # Errors
    /// If the ids cannot be read back from their device.
    pub fn loss_vocab(&self) -> Result<Option<Vec<u32>>> {
        Ok(self.loss_vocab.as_ref().map(|t| t.to_vec1::<u32>()).transpose()?)
    }

    /// The differentiable forward: `[b, t, H]` predictions of `h_{t+1}` at every position `t` (positions with no
    /// next token in their segment read token 0 and are meaningless; the loss masks them).
    pub fn forward_train(&self, batch: &Eagle2Batch) -> Result<Tensor> {
        let lay = self.check_batch(batch)?;
        self.forward_layout(&lay, &batch.hidden)
    }

    fn forward_layout(&self, lay: &Layout, hidden: &Tensor) -> Result<Tensor> {
        let dtype = self.target.dtype();
        let dev = self.target.embed_tokens().device().clone();
        let emb = self.target.embed(&lay.shifted_ids(1), lay.b, lay.t)?;
        let hidden = hidden.to_dtype(dtype)?;
        let x = linear(&Tensor::cat(&[&emb, &hidden], D::Minus1)?, &self.weights.fc)?;
        let (cos, sin) = lay.rope(&self.inv_freq, 0, dtype, &dev)?;
        let mask = lay.mask(dtype, &dev)?;
        let attn = self.weights.layer.attention(&self.cfg, &x, &cos, &sin, &mask, &mut Vec::new())?;
        self.weights.layer.mlp_residual(&(x + attn)?, self.cfg.llama.rms_norm_eps)
    }

    /// The EAGLE-2 objective on `batch` (see [`Eagle2Loss`]); `p_target = softmax(LMHead(h_{t+1}))` comes from
    /// the clean target hidden states through the frozen head. Noise, if configured, perturbs only the input
    /// hidden states.
    pub fn loss(&self, batch: &Eagle2Batch, cfg: &Eagle2LossConfig) -> Result<Eagle2Loss> {
        cfg.validate()?;
        let lay = self.check_batch(batch)?;
        let dtype = self.target.dtype();
        let dev = self.target.embed_tokens().device().clone();
        let clean = batch.hidden.to_dtype(dtype)?;
        let pred = self.forward_layout(&lay, &add_noise(&clean, cfg.noise.as_ref())?)?;
        let target = shift_rows(&clean, 1)?;

        let w = lay.weights(1);
        let tokens: f64 = w.iter().sum();
        let denom = tokens.max(1.0);
        let wt = lay.weight_tensor(&w, dtype, &dev)?;
        let vloss = weighted_sum(&smooth_l1(&(&pred - &target)?)?.mean(D::Minus1)?, &wt, denom)?;
        if cfg.ploss_weight == 0.0 {
            // Feature regression only: skip both LM-head products (most of a step's cost on a large vocabulary).
            let ploss = vloss.zeros_like()?;
            let total = (&vloss * cfg.vloss_weight)?;
            return Ok(Eagle2Loss { total, vloss, ploss, tokens, accuracy: f64::NAN });
        }
        let (target_logits, draft_logits) = match &self.loss_vocab {
            Some(ids) => {
                let head = self.target.lm_head().index_select(ids, 0)?;
                (target.broadcast_matmul(&head.t()?)?, pred.broadcast_matmul(&head.t()?)?)
            }
            None => (self.target.logits(&target)?, self.target.logits(&pred)?),
        };
        let ploss = weighted_sum(&soft_cross_entropy(&target_logits, &draft_logits)?, &wt, denom)?;
        let total = ((&vloss * cfg.vloss_weight)? + (&ploss * cfg.ploss_weight)?)?;

        let (a, b) = (argmax_host(&draft_logits)?, argmax_host(&target_logits)?);
        let hits: f64 = w.iter().zip(a.iter().zip(&b)).filter(|(_, (x, y))| x == y).map(|(w, _)| w).sum();
        Ok(Eagle2Loss { total, vloss, ploss, tokens, accuracy: hits / denom })
    }
}
