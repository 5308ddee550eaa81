//! Training checkpoints: the drafter in its serving format (f32), the AdamW moments, and the trainer state,
//! written to a temporary directory and renamed into place, so a checkpoint directory is always complete.
//!
//! Layout of `dir`:
//! - `drafter/`: `config.json` + `model.safetensors` as [`save_eagle2`] / [`save_eagle3`] write them (f32);
//!   SGLang/vLLM load this directory directly.
//! - `optimizer.safetensors`: `exp_avg.<name>` and `exp_avg_sq.<name>` (f32) per trainable parameter.
//! - `trainer_state.json`: [`TrainState`] (written last).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use tlt_model::Llama;

use tlt_model::optim::{AdamW, ParamState};

use super::{DrafterTrainer, Totals, TrainConfig, TrainableDrafter};
use crate::checkpoint::{load_eagle2, load_eagle3, save_eagle2, save_eagle3, Blob, SaveDType, StFile};
use crate::config::{DrafterConfig, DrafterKind};
use crate::eagle2::Eagle2Drafter;
use crate::eagle3::Eagle3Drafter;
use crate::frozen::FrozenTarget;
use crate::{Error, Result};

/// Name of the trainer-state file in a checkpoint directory.
pub const STATE_FILE: &str = "trainer_state.json";
/// Name of the optimizer-moments file in a checkpoint directory.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Subdirectory holding the drafter in its serving format.
const DRAFTER_DIR: &str = "drafter";
/// Format tag of [`TrainState`].
const FORMAT: &str = "tlt-drafter-train/1";

/// `trainer_state.json`: everything besides tensors that a resumed trainer needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainState {
    /// Format tag (`tlt-drafter-train/1`).
    pub format: String,
    /// Steps done; the next draw uses `SeededRng::new(config.seed).fork(step)`.
    pub step: u64,
    /// The training configuration (seed included).
    pub config: TrainConfig,
    /// The drafter configuration, exactly (the serving `config.json` is checked against it).
    pub drafter: DrafterConfig,
    /// Lifetime counts.
    pub totals: Totals,
    /// AdamW updates applied to each parameter, by checkpoint name.
    pub param_steps: BTreeMap<String, u64>,
    /// An EAGLE-2 drafter's hot vocabulary ([`DrafterTrainer::set_hot_vocab`]; absent: the whole vocabulary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_vocab: Option<Vec<u32>>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

impl DrafterTrainer {
    /// Writes a checkpoint to `dir`, replacing any there, by [`tlt_model::write_dir_atomic`]: a kill at any point
    /// leaves the previous checkpoint or the new one in full, once [`tlt_model::recover_dir`] has run (which
    /// [`Self::resume`] does).
    ///
    /// # Errors
    /// On I/O failure (the temporary directory is removed).
    pub fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        tlt_model::write_dir_atomic(dir, |tmp| self.write_into(tmp))
    }

    fn write_into(&self, tmp: &Path) -> Result<()> {
        let ddir = tmp.join(DRAFTER_DIR);
        match &self.drafter {
            TrainableDrafter::Eagle2(d) => save_eagle2(d, &ddir, SaveDType::F32)?,
            TrainableDrafter::Eagle3(d) => save_eagle3(d, &ddir, SaveDType::F32)?,
        }
        let mut tensors = Vec::new();
        let mut param_steps = BTreeMap::new();
        for ((name, var), st) in self.opt.params().iter().zip(self.opt.state()) {
            for (prefix, m) in [("exp_avg", &st.exp_avg), ("exp_avg_sq", &st.exp_avg_sq)] {
                let t = Tensor::from_slice(m.as_slice(), var.shape(), var.device())?;
                tensors.push((format!("{prefix}.{name}"), Blob::float(&t, SaveDType::F32)?));
            }
            param_steps.insert(name.clone(), st.steps);
        }
        let opath = tmp.join(OPTIMIZER_FILE);
        safetensors::serialize_to_file(tensors, Some(HashMap::new()), &opath)
            .map_err(|e| Error::malformed(&opath, "safetensors", e))?;
        let state = TrainState {
            format: FORMAT.into(),
            step: self.step,
            config: self.cfg.clone(),
            drafter: self.drafter.config().clone(),
            totals: self.totals,
            param_steps,
            hot_vocab: match &self.drafter {
                TrainableDrafter::Eagle2(d) => d.loss_vocab()?,
                TrainableDrafter::Eagle3(_) => None,
            },
        };
        let spath = tmp.join(STATE_FILE);
        let text = serde_json::to_string_pretty(&state).map_err(|e| Error::malformed(&spath, STATE_FILE, e))?;
        fs::write(&spath, text).map_err(io(&spath))
    }

    /// Reads the [`TrainState`] of the checkpoint in `dir`.
    ///
    /// # Errors
    /// [`Error::Io`] if the file is missing, [`Error::Malformed`] if it does not parse or has another format.
    pub fn read_state(dir: &Path) -> Result<TrainState> {
        let path = dir.join(STATE_FILE);
        let text = fs::read_to_string(&path).map_err(io(&path))?;
        let state: TrainState = serde_json::from_str(&text).map_err(|e| Error::malformed(&path, STATE_FILE, e))?;
        if state.format != FORMAT {
            return Err(Error::malformed(&path, STATE_FILE, format!("format {:?}, expected {FORMAT:?}", state.format)));
        }
        state.config.validate()?;
        Ok(state)
    }

    /// Resumes the checkpoint in `dir` for `target` (whose embedding and LM head the drafter shares): weights,
    /// optimizer moments, step and configuration as saved, so further steps continue bit-for-bit (for f32
    /// targets; other dtypes round-trip the f32 weights).
    ///
    /// # Errors
    /// [`Error::Io`] naming a missing file, [`Error::Malformed`] for a truncated or corrupt one,
    /// [`Error::MissingTensor`] / [`Error::ShapeMismatch`] / [`Error::UnexpectedTensor`] for moments that do
    /// not match the drafter, and the drafter loaders' errors (e.g. a target of another shape).
    pub fn resume(dir: &Path, target: &Llama) -> Result<Self> {
        tlt_model::recover_dir(dir)?;
        let state = Self::read_state(dir)?;
        state.drafter.check_target(target.config())?;
        let ddir = dir.join(DRAFTER_DIR);
        let frozen = FrozenTarget::new(target);
        let dtype = frozen.dtype();
        let drafter: TrainableDrafter = match state.drafter.kind {
            DrafterKind::Eagle2 => {
                let mut ck = load_eagle2(&ddir, target.config())?;
                for (_, t) in ck.weights.entries_mut() {
                    *t = t.to_dtype(dtype)?;
                }
                let mut d = Eagle2Drafter::new(state.drafter.clone(), ck.weights, frozen)?;
                d.set_loss_vocab(state.hot_vocab.as_deref())?;
                d.into()
            }
            DrafterKind::Eagle3 => {
                let mut ck = load_eagle3(&ddir, target.config())?;
                for (_, t) in ck.weights.entries_mut() {
                    *t = t.to_dtype(dtype)?;
                }
                Eagle3Drafter::new(state.drafter.clone(), ck.weights, ck.vocab, frozen)?.into()
            }
        };
        let mut opt = AdamW::new(drafter.vars()?, state.config.adamw())?;
        let st = StFile::open(dir.join(OPTIMIZER_FILE))?;
        let mut expected = Vec::new();
        let mut moments = Vec::new();
        for (name, var) in opt.params() {
            let mut read = |prefix: &str| -> Result<Vec<f32>> {
                let key = format!("{prefix}.{name}");
                let t = st.required(&key, var.dims())?;
                expected.push(key);
                Ok(t.flatten_all()?.to_vec1::<f32>()?)
            };
            let (exp_avg, exp_avg_sq) = (read("exp_avg")?, read("exp_avg_sq")?);
            let steps = *state.param_steps.get(name).ok_or_else(|| {
                Error::malformed(dir.join(STATE_FILE), STATE_FILE, format!("no param_steps entry for `{name}`"))
            })?;
            moments.push(ParamState { exp_avg, exp_avg_sq, steps });
        }
        if let Some(extra) = st.index.keys().find(|k| !expected.contains(k)) {
            return Err(Error::UnexpectedTensor { path: st.path.clone(), name: extra.clone() });
        }
        opt.set_state(moments)?;
        Ok(Self { drafter, cfg: state.config, opt, step: state.step, totals: state.totals, last: None })
    }
}
