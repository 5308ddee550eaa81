//! Token log-probabilities, entropies and KL estimators, all differentiable with candle's autograd.

use candle_core::{DType, Tensor, D};

use super::KlEstimator;
use crate::{Error, Result};

/// Bound on `|ref_logp - logp|` inside [`KlEstimator::K3`] and on the k3 value itself, as verl does: keeps `exp`
/// finite; beyond it the gradient is 0.
const K3_LOG_RATIO_BOUND: f64 = 20.0;
/// Upper clamp of the k3 estimate (verl `low_var_kl` clamps to `[-10, 10]`).
const K3_MAX: f64 = 10.0;

/// Per-token KL(policy ‖ reference) estimate, elementwise over same-shaped `logp` and `ref_logp`.
///
/// Differentiable w.r.t. `logp`; `ref_logp` is detached. `k1 = logp - ref`, `k2 = 0.5 (logp - ref)^2`,
/// `k3 = exp(ref - logp) - (ref - logp) - 1`, where k3 clamps `ref - logp` to `[-20, 20]` and the result to at most
/// 10 (as verl's `low_var_kl`). `ref_logp` is cast to `logp`'s dtype.
pub fn kl_estimate(logp: &Tensor, ref_logp: &Tensor, est: KlEstimator) -> Result<Tensor> {
    if logp.shape() != ref_logp.shape() {
        return Err(Error::InvalidArgument(format!(
            "kl_estimate: logp {:?} and ref_logp {:?} differ in shape",
            logp.dims(),
            ref_logp.dims()
        )));
    }
    let reference = ref_logp.to_dtype(logp.dtype())?.detach();
    let kl = match est {
        KlEstimator::K1 => (logp - &reference)?,
        KlEstimator::K2 => ((logp - &reference)?.sqr()? * 0.5)?,
        KlEstimator::K3 => {
            let d = (&reference - logp)?.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)?;
            ((d.exp()? - &d)? - 1.0)?.minimum(K3_MAX)?
        }
    };
    Ok(kl)
}

/// Log-probabilities of `targets` under `softmax(logits / temperature)`, and optionally the per-token entropy.
///
/// `logits` is `[b, t, V]`, `targets` `[b, t]` integer ids (any integer dtype; cast to `u32`). Returns `[b, t]`
/// tensors, differentiable w.r.t. `logits` (built from `candle_nn::ops::log_softmax`, i.e. differentiable
/// primitives). Half-precision logits are computed in `f32`; `f32`/`f64` keep their dtype. Errors on bad shapes or
/// a non-positive or non-finite temperature.
pub fn logprobs_and_entropy(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
    want_entropy: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(Error::InvalidArgument(format!(
            "logprobs_and_entropy: temperature must be > 0, got {temperature}"
        )));
    }
    let (b, t, _v) = logits.dims3()?;
    if targets.dims() != [b, t] {
        return Err(Error::InvalidArgument(format!(
            "logprobs_and_entropy: targets {:?} do not match logits {:?}",
            targets.dims(),
            logits.dims()
        )));
    }
    let logits = match logits.dtype() {
        DType::F32 | DType::F64 => logits.clone(),
        _ => logits.to_dtype(DType::F32)?,
    };
    let scaled = if temperature == 1.0 { logits } else { logits.affine(1.0 / temperature, 0.0)? };
    let log_probs = candle_nn::ops::log_softmax(&scaled, D::Minus1)?;
    let idx = targets.to_dtype(DType::U32)?.unsqueeze(2)?.contiguous()?;
    let logp = log_probs.contiguous()?.gather(&idx, 2)?.squeeze(2)?;
    let entropy = if want_entropy { Some((log_probs.exp()? * &log_probs)?.sum(D::Minus1)?.neg()?) } else { None };
    Ok((logp, entropy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use proptest::prelude::*;

    #[test]
    fn grpo_kl_estimators_hand_computed() {
        let dev = Device::Cpu;
        let logp = Tensor::new(&[-1.0f64], &dev).unwrap();
        let reference = Tensor::new(&[-1.5f64], &dev).unwrap();
        let get = |e| kl_estimate(&logp, &reference, e).unwrap().to_vec1::<f64>().unwrap()[0];
        assert!((get(KlEstimator::K1) - 0.5).abs() < 1e-12);
        assert!((get(KlEstimator::K2) - 0.125).abs() < 1e-12);
        assert!((get(KlEstimator::K3) - ((-0.5f64).exp() + 0.5 - 1.0)).abs() < 1e-12);
        let other = Tensor::new(&[-1.0f64, 2.0], &dev).unwrap();
        assert!(kl_estimate(&logp, &other, KlEstimator::K1).is_err());
    }

    #[test]
    fn grpo_kl_k3_gradient() {
        // d/dlogp [exp(r - l) - (r - l) - 1] = 1 - exp(r - l).
        let dev = Device::Cpu;
        let var = Var::new(&[-1.0f64, -2.0], &dev).unwrap();
        let reference = Tensor::new(&[-1.5f64, -0.5], &dev).unwrap();
        let kl = kl_estimate(var.as_tensor(), &reference, KlEstimator::K3).unwrap();
        let grads = kl.sum_all().unwrap().backward().unwrap();
        let g = grads.get(var.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        assert!((g[0] - (1.0 - (-0.5f64).exp())).abs() < 1e-12);
        assert!((g[1] - (1.0 - 1.5f64.exp())).abs() < 1e-12);
    }

    #[test]
    fn grpo_logprobs_match_direct_computation() {
        let dev = Device::Cpu;
        let raw: Vec<f64> = (0..2 * 3 * 5).map(|i| ((i * 37 % 11) as f64 - 5.0) * 0.3).collect();
        let logits = Tensor::from_vec(raw.clone(), (2, 3, 5), &dev).unwrap();
        let ids: Vec<u32> = vec![0, 4, 2, 1, 3, 3];
        let targets = Tensor::from_vec(ids.clone(), (2, 3), &dev).unwrap();
        for temp in [1.0, 0.7] {
            let (lp, ent) = logprobs_and_entropy(&logits, &targets, temp, true).unwrap();
            let lp = lp.to_vec2::<f64>().unwrap();
            let ent = ent.unwrap().to_vec2::<f64>().unwrap();
            for (pos, (row, &id)) in raw.chunks(5).zip(&ids).enumerate() {
                let z: Vec<f64> = row.iter().map(|x| x / temp).collect();
                let lse = z.iter().map(|x| x.exp()).sum::<f64>().ln();
                let want_lp = z[id as usize] - lse;
                let want_ent: f64 = -z.iter().map(|x| (x - lse).exp() * (x - lse)).sum::<f64>();
                assert!((lp[pos / 3][pos % 3] - want_lp).abs() < 1e-12);
                assert!((ent[pos / 3][pos % 3] - want_ent).abs() < 1e-12);
            }
        }
        let (_, none) = logprobs_and_entropy(&logits, &targets, 1.0, false).unwrap();
        assert!(none.is_none());
        assert!(logprobs_and_entropy(&logits, &targets, 0.0, false).is_err());
        let bad = Tensor::from_vec(vec![0u32; 4], (2, 2), &dev).unwrap();
        assert!(logprobs_and_entropy(&logits, &bad, 1.0, false).is_err());
    }

    #[test]
    fn grpo_entropy_of_uniform_logits_is_ln_v() {
        let dev = Device::Cpu;
        let v = 7;
        let logits = Tensor::zeros((2, 4, v), DType::F32, &dev).unwrap();
        let targets = Tensor::zeros((2, 4), DType::U32, &dev).unwrap();
        let (lp, ent) = logprobs_and_entropy(&logits, &targets, 1.3, true).unwrap();
        let want = (v as f32).ln();
        for row in ent.unwrap().to_vec2::<f32>().unwrap() {
            assert!(row.iter().all(|e| (e - want).abs() < 1e-5));
        }
        for row in lp.to_vec2::<f32>().unwrap() {
            assert!(row.iter().all(|l| (l + want).abs() < 1e-5));
        }
        let half = logits.to_dtype(DType::BF16).unwrap();
        let (lp, _) = logprobs_and_entropy(&half, &targets, 1.0, false).unwrap();
        assert_eq!(lp.dtype(), DType::F32);
    }

    #[test]
    fn grpo_logprobs_gradient_matches_softmax() {
        // d logp(y) / d z_j = (1[j = y] - p_j) / T.
        let dev = Device::Cpu;
        let z = [0.3f64, -1.2, 0.8, 0.1];
        let var = Var::from_tensor(&Tensor::new(&z, &dev).unwrap().reshape((1, 1, 4)).unwrap()).unwrap();
        let targets = Tensor::new(&[[2u32]], &dev).unwrap();
        let temp = 0.5;
        let (lp, _) = logprobs_and_entropy(var.as_tensor(), &targets, temp, false).unwrap();
        let g = lp.sum_all().unwrap().backward().unwrap();
        let g = g.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let e: Vec<f64> = z.iter().map(|x| (x / temp).exp()).collect();
        let s: f64 = e.iter().sum();
        for j in 0..4 {
            let want = ((j == 2) as u8 as f64 - e[j] / s) / temp;
            assert!((g[j] - want).abs() < 1e-12, "{j}: {} vs {want}", g[j]);
        }
    }

    proptest! {
        #[test]
        fn grpo_kl_k2_k3_non_negative(pairs in prop::collection::vec((-30.0f64..0.0, -30.0f64..0.0), 1..20)) {
            let dev = Device::Cpu;
            let l: Vec<f64> = pairs.iter().map(|p| p.0).collect();
            let r: Vec<f64> = pairs.iter().map(|p| p.1).collect();
            let lt = Tensor::new(l.as_slice(), &dev).unwrap();
            let rt = Tensor::new(r.as_slice(), &dev).unwrap();
            for est in [KlEstimator::K2, KlEstimator::K3] {
                let kl = kl_estimate(&lt, &rt, est).unwrap().to_vec1::<f64>().unwrap();
                prop_assert!(kl.iter().all(|&k| k >= 0.0 && k.is_finite()));
            }
            let k1 = kl_estimate(&lt, &rt, KlEstimator::K1).unwrap().to_vec1::<f64>().unwrap();
            for ((k, a), b) in k1.iter().zip(&l).zip(&r) {
                prop_assert!((k - (a - b)).abs() < 1e-12);
            }
        }
    }
}
