//! How the engine thread decodes ([`DecodeConfig`]): TLT's adaptive rollout with the trainer's defaults, the SD gate,
//! the BEG-MAB bandit and its arms, the drafter kinds, and a TOML file of the same sections as the trainer's `[sd]`
//! ([`SdFile`]).

use serde::{Deserialize, Serialize};
pub use tlt_rl::trainer::DrafterChoice;
use tlt_spec_decode::{Drafter, DrafterSet, HybridDrafter, NgramDrafter, SuffixConfig, SuffixDrafter};

use crate::drafter::{EagleConfig, OnlineDrafter};
use crate::{Error, Result};

/// How the engine thread decodes: TLT's adaptive rollout. Each engine's rounds go through a
/// [`tlt_scheduler::AdaptiveDecoder`]: the SD gate sees the engine's live batch before every round and turns
/// speculation on once it has shrunk (the long tail), off when it grows again; in the speculative phase the bandit
/// picks the arm for the batch's bucket (a draft tree of the bucket's size, per drafter kind, or a plain round),
/// rewarded with the round's committed tokens per second. The gate and the bandit keep what they learned across
/// weight updates and idle spells.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// Speculate where the gate lets it; off: plain decoding always.
    pub speculate: bool,
    /// When to speculate. Default TLT's: on once the batch has been at most 32 for 10 rounds, off above 48.
    pub gate: tlt_scheduler::GateConfig,
    /// The bandit and its arms. Default the trainer's (fastrl's trees `8_4_48`, `8_4_32`, `8_4_16`, `8_4_8` for
    /// batches from 1, 2, 5 and 21) with a plain arm in every bucket, so the bandit can learn where drafts do not
    /// pay.
    pub mab: tlt_scheduler::MabConfig,
    /// The drafter kinds the bandit chooses between (every kind sees every commit; the chosen one drafts).
    /// Default: group suffix drafting over each prompt's siblings (`suffix`), or `hybrid` (suffix and the online
    /// EAGLE-2 drafter in one tree) with [`DecodeConfig::eagle`].
    pub drafters: Vec<DrafterChoice>,
    /// Group drafting settings (`suffix`, `hybrid`).
    pub suffix: SuffixConfig,
    /// Most requests decoding at once, all engines together (SGLang's `--max-running-requests`); more wait in a
    /// queue. Default 256.
    pub max_running: usize,
    /// TLT's online EAGLE-2 drafter (trained on the served requests' hidden states), for the kinds `eagle2` and
    /// `hybrid`.
    pub eagle: Option<EagleConfig>,
    /// Tests only (no flag sets it): the engine thread panics when it admits a request with this `rid`, so that
    /// tests can see what a dead engine thread answers.
    #[doc(hidden)]
    pub panic_on_rid: Option<String>,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            speculate: true,
            gate: tlt_scheduler::GateConfig::default(),
            mab: tlt_scheduler::MabConfig { plain_arm: true, ..tlt_scheduler::MabConfig::default() },
            drafters: Vec::new(),
            suffix: SuffixConfig::default(),
            max_running: 256,
            eagle: None,
            panic_on_rid: None,
        }
    }
}

/// The `--sd-config` TOML file: the trainer's `[sd]` sections the server has (each optional, the defaults of
/// [`DecodeConfig`] otherwise).
///
/// ```toml
/// drafters = ["suffix", "ngram"]
/// [gate]
/// threshold = 16
/// [mab]
/// arms = [{ steps = 4, top_k = 1, verify_tokens = 5 }, { steps = 8, top_k = 4, verify_tokens = 32 }]
/// thresholds = [1, 8]
/// plain_arm = true
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SdFile {
    /// The SD gate.
    pub gate: Option<tlt_scheduler::GateConfig>,
    /// The bandit.
    pub mab: Option<tlt_scheduler::MabConfig>,
    /// The drafter kinds.
    pub drafters: Option<Vec<DrafterChoice>>,
    /// Group drafting.
    pub suffix: Option<SuffixConfig>,
}

impl SdFile {
    /// Reads `path`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when it cannot be read or parsed (unknown keys included).
    pub fn read(path: &std::path::Path) -> Result<Self> {
        let invalid = |reason: String| Error::Invalid { field: "sd_config".into(), reason };
        let text = std::fs::read_to_string(path).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))
    }

    /// `cfg` with this file's sections in place of its own.
    pub fn apply(self, cfg: &mut DecodeConfig) {
        if let Some(g) = self.gate {
            cfg.gate = g;
        }
        if let Some(m) = self.mab {
            cfg.mab = m;
        }
        if let Some(d) = self.drafters {
            cfg.drafters = d;
        }
        if let Some(s) = self.suffix {
            cfg.suffix = s;
        }
    }
}

impl DecodeConfig {
    /// Speculation in every round, whatever the batch (no gate), with one chain of 4 drafts and no plain arm: for
    /// tests and for measuring SD at any batch.
    pub fn always_speculate() -> Self {
        let gate =
            tlt_scheduler::GateConfig { threshold: usize::MAX, on_after: 1, off_threshold: usize::MAX, off_after: 1 };
        let mab = tlt_scheduler::MabConfig {
            arms: vec![tlt_spec_decode::Plan { steps: 4, top_k: 1, verify_tokens: 5 }],
            thresholds: vec![1],
            ..tlt_scheduler::MabConfig::default()
        };
        Self { gate, mab, ..Self::default() }
    }

    /// SGLang's `speculative_algorithm` for what is served: none without speculation, `NGRAM` for model-free kinds
    /// only, `EAGLE` once the EAGLE drafter drafts.
    pub fn speculative_algorithm(&self) -> Option<&'static str> {
        match (self.speculate, self.kinds().iter().any(|k| k.has_eagle())) {
            (false, _) => None,
            (true, false) => Some("NGRAM"),
            (true, true) => Some("EAGLE"),
        }
    }

    /// The drafter kinds in effect: [`Self::drafters`], else the default (see there).
    pub fn kinds(&self) -> Vec<DrafterChoice> {
        match (self.drafters.is_empty(), self.eagle.is_some()) {
            (false, _) => self.drafters.clone(),
            (true, false) => vec![DrafterChoice::Suffix],
            (true, true) => vec![DrafterChoice::Hybrid],
        }
    }

    /// The bandit's configuration: [`Self::mab`] with its kinds named when there are several.
    pub fn bandit(&self) -> tlt_scheduler::MabConfig {
        let kinds = self.kinds();
        let mut mab = self.mab.clone();
        mab.drafters = if kinds.len() > 1 { kinds.iter().map(|k| k.name().to_string()).collect() } else { Vec::new() };
        mab
    }

    /// Checks the settings together: a valid gate and bandit, valid suffix settings, kinds without duplicates, and
    /// an EAGLE drafter for the kinds that need one.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let invalid = |field: &str, reason: String| Error::Invalid { field: field.into(), reason };
        self.decoder()?;
        self.suffix.validate().map_err(|e| invalid("suffix", e.to_string()))?;
        let kinds = self.kinds();
        if kinds.iter().enumerate().any(|(i, k)| kinds[..i].contains(k)) {
            return Err(invalid("drafters", format!("{kinds:?} names a kind twice")));
        }
        if self.eagle.is_none() && kinds.iter().any(|k| k.has_eagle()) {
            return Err(invalid("drafters", "eagle2 and hybrid need the online EAGLE drafter (--eagle)".into()));
        }
        Ok(())
    }

    /// The device memory the online drafter takes beside a device target of `model` (none without one), which a
    /// device backend's KV pool leaves to it ([`crate::drafter::device_footprint`]).
    pub fn beside(&self, model: &tlt_model::LlamaConfig) -> crate::pool::Beside {
        self.eagle.as_ref().map(|e| crate::drafter::device_footprint(model, e)).unwrap_or_default()
    }

    /// A fresh decoder for an engine.
    ///
    /// # Errors
    /// [`Error::Engine`] when the gate or bandit settings are invalid.
    pub fn decoder(&self) -> Result<tlt_scheduler::AdaptiveDecoder> {
        let decoder = if self.speculate {
            tlt_scheduler::AdaptiveDecoder::new(self.gate.clone(), self.bandit())
        } else {
            tlt_scheduler::AdaptiveDecoder::plain()
        };
        decoder.map_err(|e| Error::Engine(e.to_string()))
    }

    /// A fresh drafter for an engine (`None` without speculation): the one kind, or a set of the kinds in order
    /// (the bandit's drafter index).
    ///
    /// # Errors
    /// [`Error::Engine`] for a kind that needs the EAGLE drafter without one, or invalid suffix settings.
    pub fn drafter(&self, eagle: Option<&OnlineDrafter>) -> Result<Option<Box<dyn Drafter>>> {
        self.drafter_on(eagle, None)
    }

    /// [`Self::drafter`], the EAGLE drafter's forward on a device with `exec` when given.
    ///
    /// # Errors
    /// As [`Self::drafter`].
    pub fn drafter_on(
        &self,
        eagle: Option<&OnlineDrafter>,
        exec: Option<&crate::drafter::DeviceExec>,
    ) -> Result<Option<Box<dyn Drafter>>> {
        if !self.speculate {
            return Ok(None);
        }
        let engine = |e: tlt_spec_decode::Error| Error::Engine(e.to_string());
        let eagle = || eagle.ok_or_else(|| Error::Engine("no EAGLE drafter".into()));
        let suffix = || SuffixDrafter::new(self.suffix).map_err(engine);
        let mut members: Vec<Box<dyn Drafter>> = Vec::new();
        for kind in self.kinds() {
            members.push(match kind {
                DrafterChoice::Ngram => Box::new(NgramDrafter::default()),
                DrafterChoice::Suffix => Box::new(suffix()?),
                DrafterChoice::Eagle2 => match exec {
                    Some(x) => Box::new(eagle()?.proposer_on(x.clone())),
                    None => Box::new(eagle()?.proposer()),
                },
                DrafterChoice::Hybrid => match exec {
                    Some(x) => Box::new(HybridDrafter::new(suffix()?, eagle()?.proposer_on(x.clone()))),
                    None => Box::new(HybridDrafter::new(suffix()?, eagle()?.proposer())),
                },
            });
        }
        if members.len() == 1 {
            return Ok(members.pop());
        }
        Ok(Some(Box::new(DrafterSet::new(members).map_err(engine)?)))
    }
}

/// The bandit's buckets and arms, for `/get_server_info`: per bucket the smallest batch it serves, its tree size and
/// its arms by name (`plain`, or `[kind/]steps:top_k:verify_tokens`).
pub fn bandit_arms(mab: &tlt_scheduler::BegMab) -> serde_json::Value {
    let cfg = mab.config();
    let sizes = cfg.tree_sizes();
    let buckets: Vec<serde_json::Value> = (cfg.thresholds.iter().zip(&sizes).enumerate())
        .map(|(b, (min_batch, size))| {
            let arms: Vec<String> = mab.bucket_arms(b).iter().map(|&a| mab.arm_name(a)).collect();
            serde_json::json!({"min_batch": min_batch, "tree_size": size, "arms": arms})
        })
        .collect();
    serde_json::json!({"buckets": buckets, "epsilon": cfg.epsilon, "window": cfg.window,
        "statistic": format!("{:?}", cfg.statistic).to_lowercase(), "drafters": cfg.drafters})
}

/// What a bandit has learned: per bucket the arm it would exploit now, its score and the steps in the window.
pub fn bandit_leaders(mab: &tlt_scheduler::BegMab) -> Vec<serde_json::Value> {
    (0..mab.config().thresholds.len())
        .map(|b| match mab.leader(b) {
            Some((arm, score)) => serde_json::json!({"bucket": b, "leader": mab.arm_name(arm), "score": score}),
            None => serde_json::json!({"bucket": b, "leader": null}),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_bandit_has_real_arms_and_a_plain_one_per_bucket() {
        let cfg = DecodeConfig::default();
        cfg.validate().unwrap();
        let mab = tlt_scheduler::BegMab::new(cfg.bandit()).unwrap();
        assert_eq!(cfg.mab.tree_sizes(), vec![48, 32, 16, 8]);
        for b in 0..4 {
            let names: Vec<String> = mab.bucket_arms(b).iter().map(|&a| mab.arm_name(a)).collect();
            assert_eq!(names.len(), 2, "{names:?}");
            assert_eq!(names[1], "plain");
        }
        assert_eq!(cfg.kinds(), vec![DrafterChoice::Suffix]);
    }

    #[test]
    fn a_file_replaces_sections_and_unknown_keys_are_refused() {
        let text = "drafters = [\"suffix\", \"ngram\"]\n[gate]\nthreshold = 16\n[mab]\n\
                    arms = [{ steps = 4, top_k = 1, verify_tokens = 5 }, { steps = 8, top_k = 4, verify_tokens = 32 }]\n\
                    thresholds = [1, 8]\nplain_arm = true\n";
        let f: SdFile = toml::from_str(text).unwrap();
        let mut cfg = DecodeConfig::default();
        f.apply(&mut cfg);
        cfg.validate().unwrap();
        assert_eq!(cfg.gate.threshold, 16);
        let mab = tlt_scheduler::BegMab::new(cfg.bandit()).unwrap();
        let names: Vec<String> = mab.bucket_arms(0).iter().map(|&a| mab.arm_name(a)).collect();
        assert_eq!(names, ["suffix/8:4:32", "ngram/8:4:32", "plain"]);
        assert!(toml::from_str::<SdFile>("[gate]\nthreshhold = 3\n").is_err());
        let eagle_less = DecodeConfig { drafters: vec![DrafterChoice::Hybrid], ..DecodeConfig::default() };
        assert!(eagle_less.validate().unwrap_err().to_string().contains("--eagle"));
    }
}
