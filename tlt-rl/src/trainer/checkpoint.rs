//! Trainer checkpoints: policy, optimizer moments, drafter and run state, written as one directory atomically
//! (a crash leaves the previous checkpoint intact).
//!
//! Layout: `policy/` (HF `config.json` + `model.safetensors`, f32: transformers loads it), `optimizer.safetensors`
//! (`exp_avg.<name>`, `exp_avg_sq.<name>`), `drafter/` (the drafter trainer's own checkpoint: weights, moments,
//! step count, hot vocabulary; EAGLE drafters only), `drafter_buffer.safetensors` (the online drafter's sample
//! buffer: every held sample's tokens and hidden states) and `state.json` ([`TrainerState`]: the step, the data
//! position, the SD gate's and the bandit's state, the drafter's published version). The rollout seeds derive from
//! the step, the drafter's data draws from its step count: with these files a resumed run reads exactly what the
//! interrupted one would have read.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use tlt_model::optim::{AdamW, ParamState};
use tlt_scheduler::DecoderState;

use super::config::TrainerConfig;
use crate::{Error, Result};

/// Format tag of `state.json`.
const FORMAT: &str = "tlt-rl-trainer/2";
/// The run state file.
pub const STATE_FILE: &str = "state.json";
/// The policy directory.
pub const POLICY_DIR: &str = "policy";
/// The drafter directory.
pub const DRAFTER_DIR: &str = "drafter";
/// The optimizer file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The online drafter's sample buffer.
pub const DRAFTER_BUFFER_FILE: &str = "drafter_buffer.safetensors";

/// `state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerState {
    /// Format tag.
    pub format: String,
    /// RL steps completed.
    pub step: u64,
    /// The run's config.
    pub config: TrainerConfig,
    /// Updates applied to each parameter (AdamW bias correction).
    pub param_steps: BTreeMap<String, u64>,
    /// The drafter's published weights version.
    pub drafter_version: u64,
    /// Prompts drawn so far: the next step's first data position (`step * prompts_per_step` unless dynamic
    /// sampling drew more).
    pub data_pos: u64,
    /// The SD gate's and the plan bandit's state.
    pub decoder: DecoderState,
    /// In a data-parallel run, every rank's gate and bandit state, by rank (`decoder` is rank 0's); empty for one
    /// rank.
    #[serde(default)]
    pub rank_decoders: Vec<DecoderState>,
}

impl TrainerState {
    /// A state at `step`.
    pub fn new(
        step: u64,
        config: TrainerConfig,
        opt: &AdamW,
        drafter_version: u64,
        data_pos: u64,
        decoder: DecoderState,
    ) -> Self {
        let param_steps = opt.params().iter().zip(opt.state()).map(|((n, _), s)| (n.clone(), s.steps)).collect();
        Self {
            format: FORMAT.into(),
            step,
            config,
            param_steps,
            drafter_version,
            data_pos,
            decoder,
            rank_decoders: vec![],
        }
    }

    /// Reads and checks `dir/state.json`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] if it is missing, malformed or of another format.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(STATE_FILE);
        let bad = |reason: String| Error::Checkpoint { path: path.clone(), reason };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let format = serde_json::from_str::<serde_json::Value>(&text)
            .map_err(|e| bad(e.to_string()))?
            .get("format")
            .and_then(|f| f.as_str().map(str::to_string));
        if format.as_deref() != Some(FORMAT) {
            return Err(bad(format!(
                "format {format:?}, expected {FORMAT:?} (checkpoints of format 1 lack the SD decoder's state and the \
                 drafter's sample buffer, so they cannot resume exactly)"
            )));
        }
        let state: Self = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        state.config.validate()?;
        Ok(state)
    }

    /// Writes `dir/state.json`.
    ///
    /// # Errors
    /// On an I/O failure.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(STATE_FILE);
        std::fs::write(&path, serde_json::to_string_pretty(self)?).map_err(|e| Error::io(path, e))
    }
}

/// Writes the optimizer moments of `opt` to `path`.
pub(crate) fn save_optimizer(opt: &AdamW, path: &Path) -> Result<()> {
    let mut tensors = HashMap::new();
    for ((name, var), st) in opt.params().iter().zip(opt.state()) {
        for (prefix, m) in [("exp_avg", &st.exp_avg), ("exp_avg_sq", &st.exp_avg_sq)] {
            tensors.insert(format!("{prefix}.{name}"), Tensor::from_slice(m, var.shape(), &Device::Cpu)?);
        }
    }
    candle_core::safetensors::save(&tensors, path)?;
    Ok(())
}

/// Restores the optimizer moments of `opt` from `path` and the per-parameter step counts of `state`.
pub(crate) fn load_optimizer(opt: &mut AdamW, path: &Path, state: &TrainerState) -> Result<()> {
    let bad = |reason: String| Error::Checkpoint { path: path.to_path_buf(), reason };
    let mut tensors = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| bad(e.to_string()))?;
    let mut states = Vec::with_capacity(opt.params().len());
    for (name, var) in opt.params() {
        let mut take = |prefix: &str| -> Result<Vec<f32>> {
            let key = format!("{prefix}.{name}");
            let t = tensors.remove(&key).ok_or_else(|| bad(format!("missing `{key}`")))?;
            if t.dims() != var.dims() || t.dtype() != DType::F32 {
                return Err(bad(format!("`{key}` is {:?} {:?}, expected {:?} F32", t.dims(), t.dtype(), var.dims())));
            }
            Ok(t.flatten_all()?.to_vec1::<f32>()?)
        };
        let (exp_avg, exp_avg_sq) = (take("exp_avg")?, take("exp_avg_sq")?);
        let steps = *state.param_steps.get(name).ok_or_else(|| bad(format!("no step count for `{name}`")))?;
        states.push(ParamState { exp_avg, exp_avg_sq, steps });
    }
    opt.set_state(states)?;
    Ok(())
}
