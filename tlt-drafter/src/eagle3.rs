//! EAGLE-3: fused multi-layer features, a reduced draft vocabulary, and the training-time-test (TTT) unroll.
//!
//! Step 0 at position `t` reads the token `x_{t+1}` and the feature `g_t = fc([l_t; m_t; h_t])` (three tapped
//! target layers); step `k > 0` reads `x_{t+1+k}` and the drafter's own previous pre-norm output at `t`, at RoPE
//! position `pos_t + k`. The layer attends `concat(input_layernorm(embed), hidden_norm(g))` with residual `g`;
//! then `post_attention_layernorm` + SwiGLU, the final `norm` and the draft `lm_head`. At step `k` attention is
//! causal over the step-0 keys plus the same-position (diagonal) keys of steps `1..=k` (official EAGLE-3).
//! Step `k` at `t` is trained against the target's distribution at `t + 1 + k` restricted to the draft vocabulary.

use candle_core::{DType, Tensor, Var, D};
use tlt_kernels::SeededRng;
use tlt_model::nn::{linear, rms_norm};
use tlt_model::Linear;

use crate::batch::{add_noise, argmax_host, shift_rows, soft_cross_entropy, weighted_sum, Layout};
use crate::config::{DrafterConfig, DrafterKind, Eagle3LossConfig};
use crate::frozen::FrozenTarget;
use crate::layer::{check_shape, make_var, ones, random_matrix, DraftLayer};
use crate::vocab::VocabMap;
use crate::{Error, Result};

/// Name prefix of the decoder layer in the SGLang/vLLM EAGLE-3 layout.
pub(crate) const LAYER_PREFIX: &str = "midlayer.";

/// The trainable parameters of an EAGLE-3 drafter.
#[derive(Debug, Clone)]
pub struct Eagle3Weights {
    /// `[H, 3 * target_hidden]` fusion of the three tapped layers, no bias.
    pub fc: Linear,
    /// The decoder layer (with `input_layernorm` and `hidden_norm`; q/k/v read `2H`).
    pub layer: DraftLayer,
    /// `[H]` final RMSNorm.
    pub norm: Tensor,
    /// `[draft_vocab, H]` draft LM head.
    pub lm_head: Tensor,
}

impl Eagle3Weights {
    /// Seeded initialisation for `cfg` with the LM head taken from the target's rows `vocab.used()`
    /// ([`VocabMap::init_head`]); f32.
    pub fn random(cfg: &DrafterConfig, vocab: &VocabMap, target_head: &Tensor, seed: u64) -> Result<Self> {
        let mut rng = SeededRng::new(seed);
        let h = cfg.hidden_size();
        Ok(Self {
            fc: Linear::new(random_matrix(&mut rng, h, cfg.fc_in())?, None),
            layer: DraftLayer::random(cfg, &mut rng)?,
            norm: ones(h)?,
            lm_head: vocab.init_head(&target_head.to_dtype(DType::F32)?)?,
        })
    }

    /// Weights for `cfg` whose parameters `get(name, shape)` supplies, by checkpoint name.
    pub(crate) fn from_source(
        cfg: &DrafterConfig,
        get: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<Self> {
        let h = cfg.hidden_size();
        Ok(Self {
            fc: Linear::new(get("fc.weight", &[h, cfg.fc_in()])?, None),
            layer: DraftLayer::from_source(cfg, LAYER_PREFIX, get)?,
            norm: get("norm.weight", &[h])?,
            lm_head: get("lm_head.weight", &[cfg.draft_vocab_size, h])?,
        })
    }

    /// Every parameter with its SGLang/vLLM checkpoint name (`fc.weight`, `midlayer.*`, `norm.weight`,
    /// `lm_head.weight`).
    pub fn entries_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut out: Vec<(String, &mut Tensor)> = vec![("fc.weight".into(), &mut self.fc.weight)];
        out.extend(self.layer.entries_mut(LAYER_PREFIX));
        out.push(("norm.weight".into(), &mut self.norm));
        out.push(("lm_head.weight".into(), &mut self.lm_head));
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
        let mut out = vec![("fc.weight".to_string(), vec![h, cfg.fc_in()])];
        out.extend(DraftLayer::expected_shapes(cfg, LAYER_PREFIX));
        out.push(("norm.weight".into(), vec![h]));
        out.push(("lm_head.weight".into(), vec![cfg.draft_vocab_size, h]));
        out
    }

    fn check(&mut self, cfg: &DrafterConfig) -> Result<()> {
        if self.fc.bias.is_some() {
            return Err(Error::UnexpectedTensor { path: "<weights>".into(), name: "fc.bias".into() });
        }
        check_shape("fc.weight", &self.fc.weight, &[cfg.hidden_size(), cfg.fc_in()])?;
        check_shape("norm.weight", &self.norm, &[cfg.hidden_size()])?;
        check_shape("lm_head.weight", &self.lm_head, &[cfg.draft_vocab_size, cfg.hidden_size()])?;
        self.layer.check(cfg)
    }
}

/// The target's next-token distributions a batch is trained against.
#[derive(Debug, Clone)]
pub enum Teacher {
    /// `[b, t, vocab]` target logits; row `t` predicts `x_{t+1}`.
    Logits(Tensor),
    /// `[b, t, H]` target hidden states after the final norm ([`tlt_model::Tap::FinalNorm`]); the logits are
    /// computed with the frozen target LM head.
    FinalHidden(Tensor),
}

/// A training batch for [`Eagle3Drafter`]: `b` right-padded (or packed) rows of `t` tokens.
#[derive(Debug, Clone)]
pub struct Eagle3Batch {
    /// `[b, t]` u32 tokens `x_0..x_{t-1}`.
    pub input_ids: Tensor,
    /// `[b, t, 3 * target_hidden]`: the three tapped layers (low, mid, high, as in
    /// [`DrafterConfig::aux_layers`]) concatenated; row `t` was computed reading `x_0..x_t`.
    pub aux_hidden: Tensor,
    /// The target distributions.
    pub teacher: Teacher,
    /// `[b, t]` loss mask over tokens; step `k` at position `t` is weighted by `loss_mask[t + 1 + k]`, the mask at
    /// the teacher's position (the same rule as EAGLE-2's `loss_mask[1:]`). Official EAGLE-3/SpecForge weigh it
    /// by `loss_mask[t + k]`, one token earlier: pass a mask shifted right by one to reproduce that exactly.
    pub loss_mask: Tensor,
    /// Optional `[b, t]` segment ids for packed rows (contiguous runs; attention and shifts stay inside one).
    pub segments: Option<Tensor>,
}

/// The EAGLE-3 TTT loss and per-step diagnostics.
#[derive(Debug, Clone)]
pub struct Eagle3Loss {
    /// `sum_k decay^k * steps[k]` (scalar; call `backward` on it).
    pub total: Tensor,
    /// Per-step soft cross-entropy, each divided by the step-0 valid-token count (so later steps, which have
    /// fewer valid positions, weigh proportionally less, as the official per-step mean over all positions does).
    pub steps: Vec<Tensor>,
    /// Per-step fraction of weighted positions where the draft argmax equals the target argmax.
    pub accuracy: Vec<f64>,
    /// Per-step sum of the loss weights (loss mask times "target argmax is in the draft vocabulary").
    pub tokens: Vec<f64>,
}

/// An EAGLE-3 drafter: trainable [`Eagle3Weights`], its [`VocabMap`], and the target's frozen embedding (and
/// LM head, used only to compute teacher logits from hidden states).
#[derive(Debug, Clone)]
pub struct Eagle3Drafter {
    cfg: DrafterConfig,
    weights: Eagle3Weights,
    vocab: VocabMap,
    target: FrozenTarget,
    inv_freq: Vec<f64>,
}

impl Eagle3Drafter {
    /// Builds a drafter, checking config, vocabulary map, weight shapes and dtype against each other and the
    /// target. The weights become trainable [`Var`]s (copied once unless they already are).
    pub fn new(cfg: DrafterConfig, mut weights: Eagle3Weights, vocab: VocabMap, target: FrozenTarget) -> Result<Self> {
        cfg.validate()?;
        if cfg.kind != DrafterKind::Eagle3 {
            return Err(Error::config("kind", "eagle2", "Eagle3Drafter needs an EAGLE-3 config"));
        }
        if target.hidden_size() != cfg.hidden_size() {
            return Err(Error::HiddenSizeMismatch {
                what: "hidden_size",
                drafter: cfg.hidden_size(),
                target: target.hidden_size(),
            });
        }
        if target.vocab_size() != cfg.vocab_size() || vocab.vocab_size() != cfg.vocab_size() {
            let drafter = if vocab.vocab_size() != target.vocab_size() { vocab.vocab_size() } else { cfg.vocab_size() };
            return Err(Error::VocabMismatch { drafter, target: target.vocab_size() });
        }
        if vocab.draft_vocab_size() != cfg.draft_vocab_size {
            return Err(Error::InconsistentVocabMap {
                reason: format!(
                    "map has {} draft tokens, config draft_vocab_size is {}",
                    vocab.draft_vocab_size(),
                    cfg.draft_vocab_size
                ),
            });
        }
        weights.check(&cfg)?;
        for (name, t) in weights.entries_mut() {
            if t.dtype() != target.dtype() {
                return Err(Error::config(&name, format!("{:?}", t.dtype()), "dtype differs from the target's"));
            }
            make_var(t)?;
        }
        let inv_freq = cfg.llama.rope_inv_freq();
        Ok(Self { cfg, weights, vocab, target, inv_freq })
    }

    /// A seeded, freshly initialised drafter (LM head from the target's rows, weights in the target's dtype).
    pub fn random(cfg: DrafterConfig, vocab: VocabMap, target: FrozenTarget, seed: u64) -> Result<Self> {
        let mut weights = Eagle3Weights::random(&cfg, &vocab, target.lm_head(), seed)?;
        for (_, t) in weights.entries_mut() {
            *t = t.to_dtype(target.dtype())?;
        }
        Self::new(cfg, weights, vocab, target)
    }

    /// The configuration.
    pub fn config(&self) -> &DrafterConfig {
        &self.cfg
    }

    /// The trainable parameters.
    pub fn weights(&self) -> &Eagle3Weights {
        &self.weights
    }

    /// The draft vocabulary.
    pub fn vocab(&self) -> &VocabMap {
        &self.vocab
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
    pub fn vars(&self) -> Result<Vec<(String, Var)>> {
        self.weights.named_tensors().into_iter().map(|(n, t)| Ok((n, Var::from_tensor(&t)?))).collect()
    }

    /// A copy with every tensor, the frozen target parts included, in `dtype` (e.g. f64 for gradient checks).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let mut weights = self.weights.clone();
        for (_, t) in weights.entries_mut() {
            *t = t.to_dtype(dtype)?.detach();
        }
        Self::new(self.cfg.clone(), weights, self.vocab.clone(), self.target.to_dtype(dtype)?)
    }

    fn check_batch(&self, batch: &Eagle3Batch) -> Result<Layout> {
        let lay = Layout::new(&batch.input_ids, &batch.loss_mask, batch.segments.as_ref(), self.cfg.vocab_size())?;
        let want = [lay.b, lay.t, self.cfg.fc_in()];
        if batch.aux_hidden.dims() != want {
            return Err(Error::batch("aux_hidden", format!("shape {:?}, expected {want:?}", batch.aux_hidden.dims())));
        }
        let (field, t, last) = match &batch.teacher {
            Teacher::Logits(t) => ("teacher logits", t, self.cfg.vocab_size()),
            Teacher::FinalHidden(t) => ("teacher hidden", t, self.cfg.hidden_size()),
        };
        if t.dims() != [lay.b, lay.t, last] {
            return Err(Error::batch(
                "teacher",
                format!("{field} shape {:?}, expected {:?}", t.dims(), [lay.b, lay.t, last]),
            ));
        }
        Ok(lay)
    }

    /// The differentiable TTT unroll over `steps` steps: `[b, t, draft_vocab]` logits per step (step `k` at
    /// position `t` drafts the token after `x_{t+1+k}`).
    pub fn forward_train(&self, batch: &Eagle3Batch, steps: usize) -> Result<Vec<Tensor>> {
        let lay = self.check_batch(batch)?;
        self.unroll(&lay, &batch.aux_hidden.to_dtype(self.target.dtype())?, steps)
    }

    fn unroll(&self, lay: &Layout, aux: &Tensor, steps: usize) -> Result<Vec<Tensor>> {
        let dtype = self.target.dtype();
        let dev = self.target.embed_tokens().device().clone();
        let eps = self.cfg.llama.rms_norm_eps;
        let w = &self.weights;
        let (in_norm, hid_norm) = match (&w.layer.input_layernorm, &w.layer.hidden_norm) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err(Error::MissingTensor { path: "<weights>".into(), name: "midlayer.hidden_norm".into() }),
        };
        let mask = lay.mask(dtype, &dev)?;
        let mut g = linear(aux, &w.fc)?;
        let mut kv = Vec::with_capacity(steps);
        let mut logits = Vec::with_capacity(steps);
        for k in 0..steps {
            let emb = self.target.embed(&lay.shifted_ids(k + 1), lay.b, lay.t)?;
            let x_in = Tensor::cat(&[&rms_norm(&emb, in_norm, eps)?, &rms_norm(&g, hid_norm, eps)?], D::Minus1)?;
            let (cos, sin) = lay.rope(&self.inv_freq, k, dtype, &dev)?;
            let attn = w.layer.attention(&self.cfg, &x_in, &cos, &sin, &mask, &mut kv)?;
            let out = w.layer.mlp_residual(&(&g + attn)?, eps)?;
            logits.push(linear(&rms_norm(&out, &w.norm, eps)?, &Linear::new(w.lm_head.clone(), None))?);
            g = out;
        }
        Ok(logits)
    }

    /// The TTT objective on `batch` (see [`Eagle3Loss`]): per step, soft cross-entropy of the draft logits
    /// against the target logits restricted to the draft vocabulary (`t2d` columns), on positions whose loss
    /// mask is set and whose target argmax lies in the draft vocabulary.
    pub fn loss(&self, batch: &Eagle3Batch, cfg: &Eagle3LossConfig) -> Result<Eagle3Loss> {
        cfg.validate()?;
        let lay = self.check_batch(batch)?;
        let dtype = self.target.dtype();
        let dev = self.target.embed_tokens().device().clone();
        let aux = add_noise(&batch.aux_hidden.to_dtype(dtype)?, cfg.noise.as_ref())?;
        let teacher = match &batch.teacher {
            Teacher::Logits(l) => l.to_dtype(dtype)?.detach(),
            Teacher::FinalHidden(h) => self.target.logits(&h.to_dtype(dtype)?)?.detach(),
        };
        let used = self.vocab.used_tensor(&dev)?;
        // The full-vocabulary teacher is needed once, for its argmax; each step then shifts the draft-vocabulary
        // columns and the argmax (7 shifts of [b, t, vocab] would dominate a step on CPU).
        let argmax = argmax_host(&teacher)?;
        let restricted = teacher.index_select(&used, D::Minus1)?;
        drop(teacher);
        let draft_logits = self.unroll(&lay, &aux, cfg.steps)?;
        let denom = lay.weights(1).iter().sum::<f64>().max(1.0);

        let mut out =
            Eagle3Loss { total: Tensor::zeros((), dtype, &dev)?, steps: vec![], accuracy: vec![], tokens: vec![] };
        for (k, logits) in draft_logits.iter().enumerate() {
            let s = k + 1;
            // Row `i` of a row of `t` reads position `i + s` (past the end: weight 0 anyway).
            let full_argmax: Vec<u32> =
                (0..lay.b * lay.t).map(|j| if j % lay.t + s < lay.t { argmax[j + s] } else { 0 }).collect();
            let w: Vec<f64> = lay
                .weights(s)
                .into_iter()
                .zip(&full_argmax)
                .map(|(w, &a)| if self.vocab.contains(a) { w } else { 0.0 })
                .collect();
            let ce = soft_cross_entropy(&shift_rows(&restricted, s)?, logits)?;
            let step = weighted_sum(&ce, &lay.weight_tensor(&w, dtype, &dev)?, denom)?;
            out.total = (&out.total + (&step * cfg.decay.powi(k as i32))?)?;

            let draft_argmax = argmax_host(logits)?;
            let tokens: f64 = w.iter().sum();
            let hits: f64 = w
                .iter()
                .zip(draft_argmax.iter().zip(&full_argmax))
                .filter(|(_, (&d, &t))| self.vocab.to_target(d as usize) == Some(t))
                .map(|(w, _)| w)
                .sum();
            out.steps.push(step);
            out.accuracy.push(hits / tokens.max(1e-12));
            out.tokens.push(tokens);
        }
        Ok(out)
    }
}
