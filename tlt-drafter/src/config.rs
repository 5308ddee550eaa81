//! Drafter and loss configuration.
//!
//! A drafter's own decoder layer is described by an HF [`LlamaConfig`] with `num_hidden_layers = 1` (the EAGLE
//! checkpoints' `config.json` *is* such a config plus a few extras); [`DrafterConfig`] adds what ties the drafter
//! to its target. Configs do no I/O; checkpoint code in [`crate::checkpoint`] reads and writes them.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use tlt_model::{Architecture, AttentionBias, LlamaConfig, Tap};

use crate::{Error, Result};

/// Which EAGLE generation a drafter belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DrafterKind {
    /// EAGLE-1/2 (TLT's RL path): `fc(2H -> H)` over `[embed(x_{t+1}); h_t]` with `h_t` the target's last hidden
    /// state after the final norm, one decoder layer without input norm, no final norm, the target's LM head.
    Eagle2,
    /// EAGLE-3: `fc(3H -> H)` over three tapped target layers, a 2H-input decoder layer, a final norm and an
    /// own LM head over a reduced draft vocabulary.
    Eagle3,
}

/// The shape of a drafter and how it attaches to its target.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterConfig {
    /// EAGLE-2 or EAGLE-3.
    pub kind: DrafterKind,
    /// The drafter's decoder layer in HF form: hidden/intermediate size, heads, KV heads, head_dim, RMS eps,
    /// RoPE theta and scaling, `vocab_size` = the TARGET's vocabulary, `num_hidden_layers` = 1. For EAGLE-2 the
    /// `model_type` and `attention_bias` decide the biases (`qwen2` has q/k/v biases); EAGLE-3 drafters are always
    /// `llama`. Never a q/k-norm architecture: a Qwen3 target's drafter is a `llama` layer (see
    /// [`DrafterConfig::eagle2_from_target`]).
    pub llama: LlamaConfig,
    /// Hidden size of the target (the width of each tapped hidden state).
    pub target_hidden_size: usize,
    /// Number of decoder layers of the target (fixes the default EAGLE-3 taps).
    pub target_num_hidden_layers: usize,
    /// Whether `fc` has a bias (EAGLE-2 only: the fastrl trainers use none, SGLang's `qwen2_eagle` and the
    /// original EAGLE-1 have one). EAGLE-3's fc never has one.
    pub fc_bias: bool,
    /// Rows of the draft LM head. EAGLE-2: equal to `llama.vocab_size` (full vocabulary, the target's head).
    /// EAGLE-3: the reduced draft vocabulary (typically 32000), mapped with [`crate::VocabMap`].
    pub draft_vocab_size: usize,
    /// EAGLE-3 only: the target layers whose INPUT residual stream is tapped (low, mid, high), in
    /// [`Tap::LayerInput`] semantics (= vLLM's ids; SGLang's ids are these minus one). `None` for EAGLE-2.
    pub aux_layers: Option<[usize; 3]>,
}

/// The default EAGLE-3 taps of a `num_layers`-layer target: inputs of layers `2, L/2, L-3` (official EAGLE-3,
/// SGLang and vLLM defaults; the same as [`Tap::eagle3`]).
pub fn default_aux_layers(num_layers: usize) -> [usize; 3] {
    let mut out = [0; 3];
    for (slot, tap) in out.iter_mut().zip(Tap::eagle3(num_layers)) {
        if let Tap::LayerInput(i) = tap {
            *slot = i;
        }
    }
    out
}

impl DrafterConfig {
    /// An EAGLE-2 drafter for `target`: a copy of its config with one layer (the fastrl recipe).
    ///
    /// For a Qwen3 target (or any with q/k head norms) the layer is a plain `llama` layer of the target's shape
    /// (its `head_dim`, heads and `attention_bias`), without q/k norms: what SGLang's `LlamaForCausalLMEagle` and
    /// vLLM's `EagleLlamaForCausalLM` build for any target (neither engine has a Qwen3 EAGLE class), and the layer
    /// the published EAGLE-3 drafters of Qwen3 targets use (`LlamaForCausalLMEagle3`).
    pub fn eagle2_from_target(target: &LlamaConfig, fc_bias: bool) -> Self {
        let mut llama = Self::layer_of(target);
        if target.qk_norm() {
            llama.model_type = "llama".into();
        }
        Self {
            kind: DrafterKind::Eagle2,
            target_hidden_size: target.hidden_size,
            target_num_hidden_layers: target.num_hidden_layers,
            fc_bias,
            draft_vocab_size: target.vocab_size,
            aux_layers: None,
            llama,
        }
    }

    /// `target`'s config as one drafter layer: one layer, untied, `head_dim` and KV heads explicit (as
    /// `config.json` exports write them, so configs round-trip unchanged), no per-layer attention kinds.
    fn layer_of(target: &LlamaConfig) -> LlamaConfig {
        let mut llama = target.clone();
        llama.num_hidden_layers = 1;
        llama.tie_word_embeddings = false;
        llama.head_dim = Some(target.head_dim());
        llama.num_key_value_heads = Some(target.kv_heads());
        llama.layer_types = None;
        llama
    }

    /// An EAGLE-3 drafter for `target` with a `draft_vocab_size`-token LM head, tapping the default layers.
    /// The layer copies the target's shape (its `head_dim` too, which Qwen3 decouples from the hidden size) but is
    /// always `model_type = "llama"` without biases or q/k norms, as SGLang's and vLLM's `LlamaForCausalLMEagle3`
    /// expect (the published EAGLE-3 drafters of Qwen3 targets are such layers).
    pub fn eagle3_from_target(target: &LlamaConfig, draft_vocab_size: usize) -> Self {
        let mut llama = Self::layer_of(target);
        llama.model_type = "llama".into();
        llama.attention_bias = false;
        Self {
            kind: DrafterKind::Eagle3,
            target_hidden_size: target.hidden_size,
            target_num_hidden_layers: target.num_hidden_layers,
            fc_bias: false,
            draft_vocab_size,
            aux_layers: Some(default_aux_layers(target.num_hidden_layers)),
            llama,
        }
    }

    /// Width of the drafter's residual stream.
    pub fn hidden_size(&self) -> usize {
        self.llama.hidden_size
    }

    /// Size of the target's (full) vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.llama.vocab_size
    }

    /// Input width of `fc`: `2H` (EAGLE-2: embedding and hidden state) or `3 * target_hidden_size` (EAGLE-3).
    pub fn fc_in(&self) -> usize {
        match self.kind {
            DrafterKind::Eagle2 => 2 * self.target_hidden_size,
            DrafterKind::Eagle3 => 3 * self.target_hidden_size,
        }
    }

    /// Input width of q/k/v: `H` (EAGLE-2) or `2H` (EAGLE-3: normed embedding and normed feature).
    pub fn qkv_in(&self) -> usize {
        match self.kind {
            DrafterKind::Eagle2 => self.hidden_size(),
            DrafterKind::Eagle3 => 2 * self.hidden_size(),
        }
    }

    /// The layer's attention biases (EAGLE-2 drafters of Qwen2 targets have q/k/v biases; of targets with
    /// `attention_bias`, q/k/v/o biases). None for an unknown `model_type` ([`Self::validate`] refuses it).
    pub fn attention_bias(&self) -> AttentionBias {
        self.llama.attention_bias().unwrap_or_default()
    }

    /// The target hidden states the drafter consumes, in the order its inputs expect them:
    /// EAGLE-2 `[FinalNorm]`; EAGLE-3 the three layer inputs, then `FinalNorm` (for the teacher logits).
    pub fn taps(&self) -> Vec<Tap> {
        match self.aux_layers {
            Some(l) if self.kind == DrafterKind::Eagle3 => {
                vec![Tap::LayerInput(l[0]), Tap::LayerInput(l[1]), Tap::LayerInput(l[2]), Tap::FinalNorm]
            }
            _ => vec![Tap::FinalNorm],
        }
    }

    /// Checks every value the forward passes and the checkpoint formats rely on.
    pub fn validate(&self) -> Result<()> {
        self.llama.validate()?;
        let l = &self.llama;
        if l.qk_norm() {
            return Err(Error::config(
                "llama.model_type",
                &l.model_type,
                "drafter layers have no q/k norms (a Qwen3 target's drafter is a llama layer)",
            ));
        }
        if l.num_hidden_layers != 1 {
            return Err(Error::config(
                "llama.num_hidden_layers",
                l.num_hidden_layers,
                "drafters have exactly one layer",
            ));
        }
        if self.target_hidden_size != l.hidden_size {
            // The shared target embedding must fit the drafter's width; a drafter with its own embedding is not
            // implemented.
            return Err(Error::config(
                "target_hidden_size",
                self.target_hidden_size,
                "must equal llama.hidden_size (drafters share the target's embedding)",
            ));
        }
        if self.target_num_hidden_layers == 0 {
            return Err(Error::config("target_num_hidden_layers", 0, "must be positive"));
        }
        if self.draft_vocab_size == 0 || self.draft_vocab_size > l.vocab_size {
            return Err(Error::config("draft_vocab_size", self.draft_vocab_size, "must be in 1..=vocab_size"));
        }
        match self.kind {
            DrafterKind::Eagle2 => {
                if self.draft_vocab_size != l.vocab_size {
                    return Err(Error::config(
                        "draft_vocab_size",
                        self.draft_vocab_size,
                        "EAGLE-2 drafters use the target's full vocabulary",
                    ));
                }
                if self.aux_layers.is_some() {
                    return Err(Error::config("aux_layers", "Some(..)", "EAGLE-2 drafters read only the final norm"));
                }
            }
            DrafterKind::Eagle3 => {
                if l.architecture()? != Architecture::Llama {
                    return Err(Error::config("llama.model_type", &l.model_type, "EAGLE-3 drafters are llama layers"));
                }
                if self.fc_bias {
                    return Err(Error::config("fc_bias", true, "EAGLE-3's fc has no bias"));
                }
                let Some(layers) = self.aux_layers else {
                    return Err(Error::config("aux_layers", "None", "EAGLE-3 needs three tapped layers"));
                };
                if let Some(bad) = layers.iter().find(|&&i| i > self.target_num_hidden_layers) {
                    return Err(Error::config("aux_layers", bad, "must be <= target_num_hidden_layers"));
                }
            }
        }
        Ok(())
    }

    /// Checks that this drafter fits `target` (hidden size, vocabulary, layer count).
    pub fn check_target(&self, target: &LlamaConfig) -> Result<()> {
        if self.target_hidden_size != target.hidden_size {
            return Err(Error::HiddenSizeMismatch {
                what: "target_hidden_size",
                drafter: self.target_hidden_size,
                target: target.hidden_size,
            });
        }
        if self.llama.hidden_size != target.hidden_size {
            return Err(Error::HiddenSizeMismatch {
                what: "hidden_size",
                drafter: self.llama.hidden_size,
                target: target.hidden_size,
            });
        }
        if self.llama.vocab_size != target.vocab_size {
            return Err(Error::VocabMismatch { drafter: self.llama.vocab_size, target: target.vocab_size });
        }
        if self.target_num_hidden_layers != target.num_hidden_layers {
            return Err(Error::config(
                "target_num_hidden_layers",
                self.target_num_hidden_layers,
                "differs from the target's num_hidden_layers",
            ));
        }
        Ok(())
    }
}

/// EAGLE's uniform input noise on the target hidden states: `(U(0,1) - 0.5) * std * 512 / seq_len`
/// (`AddUniformNoise` in the EAGLE and fastrl trainers). Off unless set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UniformNoise {
    /// Noise scale; EAGLE uses 0.2.
    pub std: f64,
    /// Seed of this call's noise. Vary it per step (e.g. `base ^ step`), or every step sees the same noise.
    pub seed: u64,
}

impl UniformNoise {
    fn validate(&self) -> Result<()> {
        if !(self.std.is_finite() && self.std >= 0.0) {
            return Err(Error::config("noise.std", self.std, "must be finite and >= 0"));
        }
        Ok(())
    }
}

/// The EAGLE-2 objective `vloss_weight * vloss + ploss_weight * ploss`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Eagle2LossConfig {
    /// Weight of the SmoothL1 feature-regression loss. Default 1.0 (EAGLE, fastrl's online trainer).
    pub vloss_weight: f64,
    /// Weight of the soft cross-entropy against the target distribution. Default 0.1.
    pub ploss_weight: f64,
    /// Input noise on the hidden states. Default `None`.
    pub noise: Option<UniformNoise>,
}

impl Default for Eagle2LossConfig {
    /// `vloss_weight = 1.0`, `ploss_weight = 0.1`, no noise.
    fn default() -> Self {
        Self { vloss_weight: 1.0, ploss_weight: 0.1, noise: None }
    }
}

impl Eagle2LossConfig {
    /// Checks the weights are finite and non-negative and the noise is valid.
    pub fn validate(&self) -> Result<()> {
        for (field, w) in [("vloss_weight", self.vloss_weight), ("ploss_weight", self.ploss_weight)] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(Error::config(field, w, "must be finite and >= 0"));
            }
        }
        self.noise.as_ref().map_or(Ok(()), UniformNoise::validate)
    }
}

/// The EAGLE-3 training-time-test objective: `sum_k decay^k * loss_k` over `steps` unrolled draft steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Eagle3LossConfig {
    /// Unrolled steps (official EAGLE-3 and SpecForge: 7).
    pub steps: usize,
    /// Per-step weight base (`0.8`: step `k` weighs `0.8^k`).
    pub decay: f64,
    /// Input noise on the tapped hidden states. Default `None`.
    pub noise: Option<UniformNoise>,
}

impl Default for Eagle3LossConfig {
    /// 7 steps, decay 0.8, no noise.
    fn default() -> Self {
        Self { steps: 7, decay: 0.8, noise: None }
    }
}

impl Eagle3LossConfig {
    /// Checks `steps >= 1` and a finite, non-negative decay.
    pub fn validate(&self) -> Result<()> {
        if self.steps == 0 {
            return Err(Error::config("steps", 0, "must be >= 1"));
        }
        if !(self.decay.is_finite() && self.decay >= 0.0) {
            return Err(Error::config("decay", self.decay, "must be finite and >= 0"));
        }
        self.noise.as_ref().map_or(Ok(()), UniformNoise::validate)
    }
}

/// Where a drafter's inputs lie in one recorded hidden row (see [`feature_slices`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureSlices {
    /// The drafter's input feature: EAGLE-2 the final-norm state (`H` wide), EAGLE-3 the three tapped layers
    /// (`3H` wide).
    pub feature: Range<usize>,
    /// EAGLE-3 only: the final-norm state the teacher logits come from (`H` wide).
    pub teacher: Option<Range<usize>>,
}

/// Decides which columns of a recorded hidden row of `width` features a `kind` drafter of hidden size `h`
/// trains on.
///
/// - EAGLE-2, `width == H` (the engine on a plain `Llama`): the whole row is the final-norm state.
/// - EAGLE-2, `width == 4H` (`TappedLlama` with `Tap::eagle3`): the LAST `H` columns (the final norm).
/// - EAGLE-3, `width == 4H` (`TappedLlama` with `Tap::eagle3`): the first `3H` columns are the aux taps, the last
///   `H` the final-norm state that gives the teacher logits.
///
/// # Errors
/// [`Error::InvalidBatch`] for any other width, in particular `3H` rows for EAGLE-3 (no teacher: record the
/// samples with `TappedLlama { taps: &Tap::eagle3(L) }`) and `H` rows for EAGLE-3.
pub fn feature_slices(kind: DrafterKind, h: usize, width: usize) -> Result<FeatureSlices> {
    match kind {
        DrafterKind::Eagle2 if h > 0 && width == h => Ok(FeatureSlices { feature: 0..h, teacher: None }),
        DrafterKind::Eagle2 if h > 0 && width == 4 * h => Ok(FeatureSlices { feature: 3 * h..4 * h, teacher: None }),
        DrafterKind::Eagle3 if h > 0 && width == 4 * h => {
            Ok(FeatureSlices { feature: 0..3 * h, teacher: Some(3 * h..4 * h) })
        }
        DrafterKind::Eagle3 => Err(Error::batch(
            "hidden",
            format!(
                "rows of width {width}: EAGLE-3 training needs 4H = {} (three aux taps then the final norm, as \
                 TappedLlama with Tap::eagle3 records them)",
                4 * h
            ),
        )),
        DrafterKind::Eagle2 => Err(Error::batch(
            "hidden",
            format!("rows of width {width}: EAGLE-2 training reads rows of H = {h} or 4H = {} (Tap::eagle3)", 4 * h),
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests: a panic is the failure report.
mod tests {
    use super::*;

    #[test]
    fn from_target_is_valid_and_round_trips_through_serde() {
        let target = LlamaConfig::tiny(64, 32, 8);
        for cfg in [DrafterConfig::eagle2_from_target(&target, true), DrafterConfig::eagle3_from_target(&target, 16)] {
            cfg.validate().unwrap();
            cfg.check_target(&target).unwrap();
            let text = serde_json::to_string(&cfg).unwrap();
            let back: DrafterConfig = serde_json::from_str(&text).unwrap();
            assert_eq!(back, cfg);
        }
        let e3 = DrafterConfig::eagle3_from_target(&target, 16);
        assert_eq!(e3.aux_layers, Some([2, 4, 5]));
        assert_eq!(e3.fc_in(), 96);
        assert_eq!(e3.taps().len(), 4);
    }

    #[test]
    fn a_qwen3_targets_drafters_are_llama_layers_of_its_head_shape() {
        let mut target = LlamaConfig::tiny(64, 32, 8);
        target.model_type = "qwen3".into();
        target.head_dim = Some(16); // 4 heads of 16 in a width of 32
        target.layer_types = Some(vec!["full_attention".into(); 8]);
        for cfg in [DrafterConfig::eagle2_from_target(&target, false), DrafterConfig::eagle3_from_target(&target, 16)] {
            cfg.validate().unwrap();
            cfg.check_target(&target).unwrap();
            assert_eq!(cfg.llama.architecture().unwrap(), Architecture::Llama);
            assert_eq!((cfg.llama.head_dim(), cfg.llama.q_dim(), cfg.llama.kv_dim()), (16, 64, 32));
            assert_eq!(cfg.llama.layer_types, None, "one layer: no per-layer kinds of the target's");
            assert_eq!(cfg.attention_bias(), AttentionBias::default());
        }
        let mut qwen3_layer = DrafterConfig::eagle2_from_target(&target, false);
        qwen3_layer.llama.model_type = "qwen3".into();
        assert!(
            matches!(qwen3_layer.validate(), Err(Error::InvalidConfig { field, .. }) if field == "llama.model_type")
        );
        // A target's attention_bias carries over to the EAGLE-2 layer (q/k/v/o), never to EAGLE-3's.
        target.attention_bias = true;
        assert_eq!(
            DrafterConfig::eagle2_from_target(&target, false).attention_bias(),
            AttentionBias { qkv: true, o: true }
        );
        assert_eq!(DrafterConfig::eagle3_from_target(&target, 16).attention_bias(), AttentionBias::default());
    }

    #[test]
    fn rejects_inconsistent_values() {
        let target = LlamaConfig::tiny(64, 32, 8);
        let mut c = DrafterConfig::eagle3_from_target(&target, 65);
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "draft_vocab_size"));
        c.draft_vocab_size = 16;
        c.aux_layers = Some([2, 4, 9]);
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "aux_layers"));
        let mut c = DrafterConfig::eagle2_from_target(&target, false);
        c.draft_vocab_size = 16;
        assert!(c.validate().is_err());
        let mut other = target.clone();
        other.hidden_size = 64;
        let c = DrafterConfig::eagle2_from_target(&target, false);
        assert!(matches!(c.check_target(&other), Err(Error::HiddenSizeMismatch { .. })));
        assert!(serde_json::from_str::<DrafterConfig>(r#"{"kind":"eagle4"}"#).is_err());
    }
}
