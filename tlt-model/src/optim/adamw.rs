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

impl GradNorm {
    /// Whether [`AdamW::step`] applied the update: false when the global norm is not finite (a NaN or infinite
    /// gradient), in which case the step changed nothing.
    pub fn applied(&self) -> bool {
        self.before.is_finite()
    }
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
pub(crate) fn clip_coef(norm: f64, max_norm: Option<f64>) -> f64 {
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
    /// [`Error::InvalidInput`] if the count or a moment's length does not match the parameters.
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
    /// **A non-finite global norm skips the step** (verl skips it, as PyTorch's AMP grad scaler does): a NaN norm
    /// would give a clip factor of 1 and an infinite one `0 × inf = NaN`, and the update would corrupt the weights,
    /// the moments and every later checkpoint. Nothing changes then (parameters, moments, step counts) and the
    /// returned norm says so ([`GradNorm::applied`] is false).
    ///
    /// # Errors
    /// On a non-finite `lr`, a gradient of the wrong size (checked for every parameter before any is touched) or a
    /// tensor conversion failure.
    pub fn step(&mut self, grads: &GradStore, lr: f64, max_grad_norm: Option<f64>) -> Result<GradNorm> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::config("lr", lr, "must be finite and >= 0"));
        }
        for (name, v) in &self.params {
            if let Some(g) = grads.get(v.as_tensor()) {
                if g.elem_count() != v.elem_count() {
                    return Err(Error::InvalidInput(format!("gradient of `{name}` has {} elements", g.elem_count())));
                }
            }
        }
        // Two passes so only one parameter's gradient is on the host at a time: the global norm, then the
        // (scaled) updates. Both sum in parameter order, as `clip_grad_norm` does.
        let present: Vec<(usize, &Tensor)> =
            self.params.iter().enumerate().filter_map(|(i, (_, v))| grads.get(v.as_tensor()).map(|g| (i, g))).collect();
        let mut sq = 0.0;
        for (_, g) in &present {
            add_sq(g, &mut sq)?;
        }
        let before = sq.sqrt();
        if !before.is_finite() {
            return Ok(GradNorm { before, after: before });
        }
        let coef = clip_coef(before, max_grad_norm);
        let mut sq_after = 0.0;
        for (i, g) in present {
            self.update(i, g, coef, lr, &mut sq_after)?;
        }
        Ok(GradNorm { before, after: if coef < 1.0 { sq_after.sqrt() } else { before } })
    }

    /// Applies the update from gradient `g` scaled by `coef` (clipping) to parameter `i`, adding the squares of
    /// the scaled gradient to `sq` (in element order, as one running sum over all parameters). The arithmetic is f64 element by element whatever the parameter's dtype;
    /// f32 parameters and gradients are read and written as f32 (exactly the values an f64 round trip would
    /// give), so the host copies of the largest parameter (the embedding) cost 4 bytes per weight, not 8.
    fn update(&mut self, i: usize, g: &Tensor, coef: f64, lr: f64, sq: &mut f64) -> Result<()> {
        let (name, var) = &self.params[i];
        let st = &mut self.state[i];
        let n = st.exp_avg.len();
        if g.elem_count() != n {
            return Err(Error::InvalidInput(format!("gradient of `{name}` has {} elements", g.elem_count())));
        }
        let AdamWParams { beta1, beta2, eps, weight_decay } = self.hp;
        st.steps += 1;
        let t = i32::try_from(st.steps).unwrap_or(i32::MAX);
        let bc1 = 1.0 - beta1.powi(t);
        let bc2_sqrt = (1.0 - beta2.powi(t)).sqrt();
        let step_size = lr / bc1;
        let decay = 1.0 - lr * weight_decay;
        let mut step = |k: usize, gk: f64, p: f64| -> f64 {
            let gk = if coef < 1.0 { gk * coef } else { gk };
            *sq += gk * gk;
            let m = (beta1 * f64::from(st.exp_avg[k]) + (1.0 - beta1) * gk) as f32;
            let v = (beta2 * f64::from(st.exp_avg_sq[k]) + (1.0 - beta2) * gk * gk) as f32;
            st.exp_avg[k] = m;
            st.exp_avg_sq[k] = v;
            let denom = f64::from(v).sqrt() / bc2_sqrt + eps;
            p * decay - step_size * f64::from(m) / denom
        };
        let new = if var.dtype() == DType::F32 && g.dtype() == DType::F32 {
            let gs = g.flatten_all()?.to_vec1::<f32>()?;
            let ps = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            let out: Vec<f32> = gs
                .iter()
                .zip(&ps)
                .enumerate()
                .map(|(k, (&gk, &p))| step(k, f64::from(gk), f64::from(p)) as f32)
                .collect();
            Tensor::from_vec(out, var.shape(), var.device())?
        } else {
            let gs = host_f64(g)?;
            let ps = host_f64(var.as_tensor())?;
            let out: Vec<f64> = gs.iter().zip(&ps).enumerate().map(|(k, (&gk, &p))| step(k, gk, p)).collect();
            Tensor::from_vec(out, var.shape(), var.device())?.to_dtype(var.dtype())?
        };
        var.set(&new)?;
        Ok(())
    }
}

/// Adds `x²` of every element of `t` to `sq`, in f64 and in element order (f32 read as f32, other dtypes
/// through f64).
fn add_sq(t: &Tensor, sq: &mut f64) -> Result<()> {
    if t.dtype() == DType::F32 {
        for x in t.flatten_all()?.to_vec1::<f32>()? {
            *sq += f64::from(x) * f64::from(x);
        }
    } else {
        for x in host_f64(t)? {
            *sq += x * x;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn one_param(values: &[f32]) -> (AdamW, Var) {
        let v = Var::from_tensor(&Tensor::new(values, &Device::Cpu).unwrap()).unwrap();
        let opt = AdamW::new(vec![("w".into(), v.clone())], AdamWParams { weight_decay: 0.01, ..Default::default() })
            .unwrap();
        (opt, v)
    }

    /// `loss = sum(w * scale)`: the gradient of `w` is `scale` everywhere.
    fn grads_of(v: &Var, scale: f32) -> GradStore {
        (v.as_tensor() * f64::from(scale)).unwrap().sum_all().unwrap().backward().unwrap()
    }

    #[test]
    fn adamw_skips_a_step_with_a_non_finite_norm_and_changes_nothing() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let (mut opt, v) = one_param(&[1.0, -2.0, 3.0]);
            // One good step first, so the moments and step counts are non-trivial.
            assert!(opt.step(&grads_of(&v, 0.5), 1e-2, Some(1.0)).unwrap().applied());
            let (w0, st0) = (v.as_tensor().to_vec1::<f32>().unwrap(), opt.state().to_vec());
            let norm = opt.step(&grads_of(&v, bad), 1e-2, Some(1.0)).unwrap();
            assert!(!norm.applied() && !norm.before.is_finite(), "{bad}: {norm:?}");
            assert_eq!(v.as_tensor().to_vec1::<f32>().unwrap(), w0, "{bad}: weights moved");
            assert_eq!(opt.state(), &st0[..], "{bad}: moments or step counts moved");
            // The run goes on: the next finite step applies.
            assert!(opt.step(&grads_of(&v, 0.5), 1e-2, Some(1.0)).unwrap().applied());
            assert!(v.as_tensor().to_vec1::<f32>().unwrap().iter().all(|x| x.is_finite()));
            assert_ne!(v.as_tensor().to_vec1::<f32>().unwrap(), w0);
        }
    }

    #[test]
    fn adamw_checks_every_gradient_before_touching_any_parameter() {
        let a = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[3.0f32], &Device::Cpu).unwrap()).unwrap();
        let mut opt =
            AdamW::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], AdamWParams::default()).unwrap();
        // A store whose gradient for `b` has the wrong size (keyed by `b`'s id, computed from a wider tensor).
        let mut grads =
            (a.as_tensor().sum_all().unwrap() + b.as_tensor().sum_all().unwrap()).unwrap().backward().unwrap();
        grads.insert(b.as_tensor(), Tensor::new(&[1.0f32, 1.0], &Device::Cpu).unwrap());
        let e = opt.step(&grads, 1e-2, None).unwrap_err();
        assert!(e.to_string().contains("`b`"), "{e}");
        assert_eq!(a.as_tensor().to_vec1::<f32>().unwrap(), [1.0, 2.0], "`a` was updated before `b` failed");
        assert!(opt.state().iter().all(|s| s.steps == 0));
    }
}
