//! AdamW with visible state (for bit-exact resume) and gradient clipping by global norm.
//!
//! `candle_nn::AdamW` keeps its moments private, so a checkpoint could not restore them. This one runs on the
//! host, element by element in f64 with f32 moments, in a fixed order: the same state and gradients always
//! give the same bits.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// AdamW hyperparameters, with `torch.optim.AdamW` semantics (decoupled weight decay, bias correction, `eps`
/// added to the bias-corrected `sqrt(v)`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWParams {
    /// First-moment decay (EAGLE, TLT: 0.9).
    pub beta1: f64,
    /// Second-moment decay (EAGLE, TLT: 0.95).
    pub beta2: f64,
    /// Denominator epsilon (1e-8).
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies parameters by `1 - lr * weight_decay` (EAGLE: 0; TLT online:
    /// 0.01).
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    /// `(0.9, 0.95)`, eps `1e-8`, no weight decay.
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 }
    }
}

impl AdamWParams {
    /// Checks `0 <= beta < 1`, `eps > 0` and a finite, non-negative weight decay.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        for (field, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::config(field, b, "must be in [0, 1)"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(Error::config("eps", self.eps, "must be finite and > 0"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::config("weight_decay", self.weight_decay, "must be finite and >= 0"));
        }
        Ok(())
    }
}

/// Gradient norms of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradNorm {
    /// Global L2 norm over all gradients before clipping.
    pub before: f64,
    /// The norm after clipping (`<= max_norm`, up to rounding).
    pub after: f64,
}

/// Scales `grads` in place so their global L2 norm is at most `max_norm` (PyTorch `clip_grad_norm_`: factor
/// `max_norm / (norm + 1e-6)` when below 1). Returns the norms before and after.
pub fn clip_grad_norm(grads: &mut [Vec<f64>], max_norm: Option<f64>) -> GradNorm {
    let before = grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
    let coef = clip_coef(before, max_norm);
    if coef >= 1.0 {
        return GradNorm { before, after: before };
    }
    for g in grads.iter_mut().flatten() {
        *g *= coef;
    }
    GradNorm { before, after: grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt() }
}

/// The factor [`clip_grad_norm`] scales by (1 when no clipping applies).
fn clip_coef(norm: f64, max_norm: Option<f64>) -> f64 {
    match max_norm {
        Some(max) => {
            let coef = max / (norm + 1e-6);
            if coef.is_finite() && coef < 1.0 {
                coef
            } else {
                1.0
            }
        }
        None => 1.0,
    }
}

fn host_f64(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

/// The state of one parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamState {
    /// First moment (`exp_avg`).
    pub exp_avg: Vec<f32>,
    /// Second moment (`exp_avg_sq`).
    pub exp_avg_sq: Vec<f32>,
    /// Updates applied so far (bias correction uses it; a parameter without a gradient is skipped, as in
    /// PyTorch).
    pub steps: u64,
}

/// AdamW over named [`Var`]s, updating them in place.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<(String, Var)>,
    state: Vec<ParamState>,
    hp: AdamWParams,
}

impl AdamW {
    /// An optimizer for `params` with zero moments.
    ///
    /// # Errors
    /// If `hp` is invalid.
    pub fn new(params: Vec<(String, Var)>, hp: AdamWParams) -> Result<Self> {
        hp.validate()?;
        let state = params
            .iter()
            .map(|(_, v)| {
                let n = v.elem_count();
                ParamState { exp_avg: vec![0.0; n], exp_avg_sq: vec![0.0; n], steps: 0 }
            })
            .collect();
        Ok(Self { params, state, hp })
    }

    /// The parameters, in update order.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The hyperparameters.
    pub fn hyper(&self) -> &AdamWParams {
        &self.hp
    }

    /// The per-parameter state, in [`Self::params`] order.
    pub fn state(&self) -> &[ParamState] {
        &self.state
    }

    /// Replaces the state (a resumed checkpoint's).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the count or a moment's length does not match the parameters.
    pub fn set_state(&mut self, state: Vec<ParamState>) -> Result<()> {
        if state.len() != self.params.len() {
            return Err(Error::InvalidInput(format!(
                "optimizer state for {} parameters, expected {}",
                state.len(),
                self.params.len()
            )));
        }
        for ((name, v), s) in self.params.iter().zip(&state) {
            if s.exp_avg.len() != v.elem_count() || s.exp_avg_sq.len() != v.elem_count() {
                return Err(Error::InvalidInput(format!("optimizer state of `{name}` has the wrong size")));
            }
        }
        self.state = state;
        Ok(())
    }

    /// One update at learning rate `lr` from `grads`, clipped first to a global norm of `max_grad_norm`.
    /// Parameters without a gradient are left alone.
    ///
    /// # Errors
    /// On a non-finite `lr` or a tensor conversion failure.
    pub fn step(&mut self, grads: &GradStore, lr: f64, max_grad_norm: Option<f64>) -> Result<GradNorm> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::config("lr", lr, "must be finite and >= 0"));
        }
        // Two passes so only one parameter's gradient is on the host at a time: the global norm, then the
        // (scaled) updates. Both sum in parameter order, as `clip_grad_norm` does.
        let present: Vec<(usize, &Tensor)> =
            self.params.iter().enumerate().filter_map(|(i, (_, v))| grads.get(v.as_tensor()).map(|g| (i, g))).collect();
        let mut sq = 0.0;
        for (_, g) in &present {
            for x in host_f64(g)? {
                sq += x * x;
            }
        }
        let before = sq.sqrt();
        let coef = clip_coef(before, max_grad_norm);
        let mut sq_after = 0.0;
        for (i, g) in present {
            let mut g = host_f64(g)?;
            if coef < 1.0 {
                g.iter_mut().for_each(|x| *x *= coef);
            }
            for x in &g {
                sq_after += x * x;
            }
            self.update(i, &g, lr)?;
        }
        Ok(GradNorm { before, after: if coef < 1.0 { sq_after.sqrt() } else { before } })
    }

    /// Applies an update from an explicit host gradient (already clipped) to parameter `i`.
    fn update(&mut self, i: usize, g: &[f64], lr: f64) -> Result<()> {
        let (name, var) = &self.params[i];
        let st = &mut self.state[i];
        if g.len() != st.exp_avg.len() {
            return Err(Error::InvalidInput(format!("gradient of `{name}` has {} elements", g.len())));
        }
        let AdamWParams { beta1, beta2, eps, weight_decay } = self.hp;
        st.steps += 1;
        let t = i32::try_from(st.steps).unwrap_or(i32::MAX);
        let bc1 = 1.0 - beta1.powi(t);
        let bc2_sqrt = (1.0 - beta2.powi(t)).sqrt();
        let step_size = lr / bc1;
        let decay = 1.0 - lr * weight_decay;
        let mut p = host_f64(var.as_tensor())?;
        for (k, gk) in g.iter().enumerate() {
            let m = (beta1 * f64::from(st.exp_avg[k]) + (1.0 - beta1) * gk) as f32;
            let v = (beta2 * f64::from(st.exp_avg_sq[k]) + (1.0 - beta2) * gk * gk) as f32;
            st.exp_avg[k] = m;
            st.exp_avg_sq[k] = v;
            let denom = f64::from(v).sqrt() / bc2_sqrt + eps;
            p[k] = p[k] * decay - step_size * f64::from(m) / denom;
        }
        let new = Tensor::from_vec(p, var.shape(), var.device())?.to_dtype(var.dtype())?;
        var.set(&new)?;
        Ok(())
    }
}
