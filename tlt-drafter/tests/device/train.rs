//! EAGLE-2 drafter training on the device (`CudaDrafterTrainer`) against the CPU's f32 trainer (candle autograd and
//! the host AdamW) on the same packed batch of real rollout features, on the device the environment gives (the
//! simulated one in CI): the same loss parts within bf16 tolerance, gradients with cosine >= 0.999 overall (>= 0.99
//! per tensor, with a negative control that the threshold tells a slightly different loss apart) and the same norm
//! within 5%, then after 3 AdamW steps on both the same draft argmax at the batch's training positions except near
//! ties; two device runs give the same bits; the target's embedding and head copied from the device policy give the
//! loss of the policy's own; bad calls are errors. Weights are bf16 values on both sides (the CPU computes in f32):
//! the comparison measures the device's bf16 activations only. No input noise (the device draws it with the CPU's
//! own function).

use std::sync::Arc;

use candle_core::{DType, Tensor};
use tlt_drafter::cuda::{CudaDrafterTrainer, DraftArena};
use tlt_drafter::online::FeatureSample;
use tlt_drafter::train::build_eagle2_batch;
use tlt_drafter::{
    DrafterConfig, DrafterKind, DrafterTrainer, Eagle2Batch, Eagle2Drafter, Eagle2LossConfig, FrozenTarget,
    TrainConfig, TrainableDrafter,
};
use tlt_kernels::cuda::SharedGpu;
use tlt_model::cuda::CudaLlama;
use tlt_model::device_step::row_parity;
use tlt_model::Llama;

use super::common::rollouts::{samples, small_cfg};
use super::common::{target, tokens};

/// Positions the device trainer holds (the batches below have 128).
const MAX_ROWS: usize = 192;

/// A tiny target with bf16 weights (an f32 model whose values are bf16's).
fn bf16_target(model_type: &str) -> Llama {
    target(model_type, 5).rounded_to_bf16().unwrap()
}

/// A fresh seeded EAGLE-2 drafter of `target` whose weights are bf16 values (new storage on every call): `fc` bias
/// for Llama, q/k/v biases for Qwen2.
fn drafter(target: &Llama, model_type: &str) -> Eagle2Drafter {
    let cfg = DrafterConfig::eagle2_from_target(target.config(), model_type == "llama");
    let d = Eagle2Drafter::random(cfg.clone(), FrozenTarget::new(target), 13).unwrap();
    let mut w = d.weights().clone();
    for (_, t) in w.entries_mut() {
        *t = t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().detach();
    }
    Eagle2Drafter::new(cfg, w, FrozenTarget::new(target)).unwrap()
}

fn rollout_set(target: &Llama) -> Vec<Arc<FeatureSample>> {
    samples(target, DrafterKind::Eagle2, &tokens(4, 5, 3), 28)
}

fn cfg() -> TrainConfig {
    small_cfg(0.005)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
    dot / (norm(a) * norm(b)).max(1e-30)
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt()
}

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// The CPU's gradient of `lc`'s total loss on `batch`, by checkpoint name.
fn cpu_grads(d: &Eagle2Drafter, batch: &Eagle2Batch, lc: &Eagle2LossConfig) -> Vec<(String, Vec<f32>)> {
    let store = d.loss(batch, lc).unwrap().total.backward().unwrap();
    d.vars()
        .unwrap()
        .into_iter()
        .map(|(n, v)| (n, store.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// `batch` with the loss mask of every third position cleared: a slightly different loss (the negative control).
fn thinned(batch: &Eagle2Batch) -> Eagle2Batch {
    let m: Vec<f32> = batch.loss_mask.flatten_all().unwrap().to_vec1().unwrap();
    let m: Vec<f32> = m.iter().enumerate().map(|(i, &x)| if i % 3 == 0 { 0.0 } else { x }).collect();
    Eagle2Batch {
        loss_mask: Tensor::from_vec(m, batch.loss_mask.shape(), &candle_core::Device::Cpu).unwrap(),
        ..batch.clone()
    }
}

/// The CPU drafter's logits `[positions, vocab]` of `batch` (row-major as the batch).
fn cpu_logits(d: &Eagle2Drafter, batch: &Eagle2Batch) -> Vec<f32> {
    let pred = d.forward_train(batch).unwrap();
    let logits = pred.broadcast_matmul(&d.target().lm_head().t().unwrap()).unwrap();
    logits.flatten_all().unwrap().to_vec1().unwrap()
}

fn parity(model_type: &str, dev: SharedGpu) {
    let target = bf16_target(model_type);
    let set = rollout_set(&target);
    let cfg = cfg();
    let d = drafter(&target, model_type);
    let h = d.config().hidden_size();
    let (batch, info) = build_eagle2_batch(&set, h, &cfg).unwrap();
    let mut dt = CudaDrafterTrainer::new(dev.clone(), &d, cfg.clone(), MAX_ROWS).unwrap();

    // One pass, for three loss configs: the default (1.0 vloss + 0.1 ploss) and each part alone.
    let default = cfg.eagle2_loss;
    let configs = [
        ("default", default),
        ("vloss", Eagle2LossConfig { ploss_weight: 0.0, ..default }),
        ("ploss", Eagle2LossConfig { vloss_weight: 0.0, ploss_weight: 1.0, ..default }),
    ];
    for (what, lc) in configs {
        let cpu = d.loss(&batch, &lc).unwrap();
        let (cv, cp, ct) = (scalar(&cpu.vloss), scalar(&cpu.ploss), scalar(&cpu.total));
        dt.zero_grad().unwrap();
        let got = dt.forward(&batch, &lc).unwrap();
        dt.backward().unwrap();
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-6);
        let ctx = format!("{model_type} {what}");
        assert_eq!(got.tokens, cpu.tokens, "{ctx}: the same training positions");
        // bf16 activations against f32 (measured: <= 0.3% on these losses).
        assert!(rel(got.vloss, cv) <= 0.02, "{ctx}: vloss {} vs CPU {cv}", got.vloss);
        assert!(
            rel(got.ploss, cp) <= 0.02 || (cp == 0.0 && got.ploss == 0.0),
            "{ctx}: ploss {} vs CPU {cp}",
            got.ploss
        );
        assert!(rel(got.total, ct) <= 0.02, "{ctx}: total {} vs CPU {ct}", got.total);
        if lc.ploss_weight > 0.0 {
            assert!((got.accuracy - cpu.accuracy).abs() <= 0.1, "{ctx}: accuracy {} vs {}", got.accuracy, cpu.accuracy);
        }
        let want = cpu_grads(&d, &batch, &lc);
        let have = dt.named(DraftArena::Grad).unwrap();
        assert_eq!(have.len(), want.len(), "{ctx}: every CPU parameter has a device gradient");
        let (mut all_cpu, mut all_dev, mut worst) = (Vec::new(), Vec::new(), 1f64);
        for (name, w) in &want {
            let g =
                &have.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{ctx}: no device gradient {name}")).1;
            assert_eq!(g.len(), w.len(), "{ctx}: {name}");
            let c = cosine(g, w);
            worst = worst.min(c);
            assert!(c >= 0.99, "{ctx}: {name}: gradient cosine {c}");
            all_cpu.extend_from_slice(w);
            all_dev.extend_from_slice(g);
        }
        let c = cosine(&all_dev, &all_cpu);
        let (nd, nc) = (norm(&all_dev), norm(&all_cpu));
        assert!(c >= 0.999, "{ctx}: global gradient cosine {c}");
        assert!((nd / nc - 1.0).abs() <= 0.05, "{ctx}: gradient norms {nd} vs {nc}");
        let dn = dt.grad_norm().unwrap();
        assert!((dn / nd - 1.0).abs() < 1e-6, "{ctx}: grad_norm {dn} vs the host's {nd}");
        // Negative control: the gradient of a slightly different loss (a third of the positions unweighted).
        let other: Vec<f32> = cpu_grads(&d, &thinned(&batch), &lc).into_iter().flat_map(|(_, g)| g).collect();
        let c_other = cosine(&all_dev, &other);
        assert!(c_other < 0.999, "{ctx}: the control's cosine {c_other} passes the threshold: the test has no power");
        println!(
            "{ctx}: vloss {:.6} / {cv:.6}, ploss {:.6} / {cp:.6}, accuracy {:.3} / {:.3}; gradient cosine {c:.6} (worst tensor {worst:.5}), norms {nd:.5} / {nc:.5}, control {c_other:.4}",
            got.vloss, got.ploss, got.accuracy, cpu.accuracy
        );
    }

    // Three steps on both (the CPU's own trainer; the device's `step`, same batches, schedule and clipping).
    let before = cpu_logits(&d, &batch);
    let mut cpu = DrafterTrainer::new(drafter(&target, model_type), cfg.clone()).unwrap();
    let mut dt = CudaDrafterTrainer::new(dev, &d, cfg.clone(), MAX_ROWS).unwrap();
    for k in 0..3 {
        let a = cpu.step(&set).unwrap();
        let b = dt.step(&set, None).unwrap();
        assert_eq!((b.step, b.lr, b.eval.batch), (a.step, a.lr, a.eval.batch), "{model_type} step {k}");
        let rel = (b.eval.loss - a.eval.loss).abs() / a.eval.loss;
        assert!(rel <= 0.02, "{model_type} step {k}: loss {} vs CPU {}", b.eval.loss, a.eval.loss);
        let gn = (b.grad_norm.before / a.grad_norm.before - 1.0).abs();
        assert!(gn <= 0.05, "{model_type} step {k}: gradient norm {:?} vs CPU {:?}", b.grad_norm, a.grad_norm);
        println!(
            "{model_type} step {k}: loss {:.6} / CPU {:.6}, grad norm {:.5} / {:.5}",
            b.eval.loss, a.eval.loss, b.grad_norm.before, a.grad_norm.before
        );
    }
    let TrainableDrafter::Eagle2(trained) = cpu.drafter() else { panic!("an EAGLE-2 trainer") };
    let after = cpu_logits(trained, &batch);
    dt.forward(&batch, &default).unwrap();
    let got = dt.draft_logits().unwrap();
    let v = d.config().vocab_size();
    let w: Vec<f32> = batch.loss_mask.flatten_all().unwrap().to_vec1().unwrap();
    let (mut agree, mut positions, mut changed, mut worst) = (0, 0, 0, 0f32);
    for k in 0..info.rows * info.row_len {
        // Position k is trained when the next one is a target in its window (the packing puts targets' masks there).
        if k + 1 >= w.len() || w[k + 1] == 0.0 || (k + 1) % info.row_len == 0 {
            continue;
        }
        let (dev_row, cpu_row) = (&got[k * v..(k + 1) * v], &after[k * v..(k + 1) * v]);
        let p = row_parity(dev_row, cpu_row, 0.1);
        assert!(p.argmax_equal || p.near_tie, "{model_type}: position {k} after 3 steps: {p:?}");
        assert!(p.rel_diff <= 0.25, "{model_type}: position {k}: logits after 3 steps {p:?}");
        positions += 1;
        agree += usize::from(p.argmax_equal);
        worst = worst.max(p.rel_diff);
        let am = |r: &[f32]| {
            r.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &x)| if x > m.1 { (i, x) } else { m }).0
        };
        changed += usize::from(am(cpu_row) != am(&before[k * v..(k + 1) * v]));
    }
    println!("{model_type}: after 3 steps the device's draft argmax agrees on {agree}/{positions} positions (rows within {worst:.3} std); training changed {changed}");
    assert!(positions >= 20, "{model_type}: {positions} positions compared");
    assert!(changed > 0, "{model_type}: 3 steps changed no prediction: the comparison has no power");
    // The trained weights, as host weights, are the CPU's up to the bf16 steps (zero-initialised biases are their
    // updates alone, where elements of tiny gradients may step the other way: measured >= 0.998).
    let dw = dt.weights().unwrap();
    let (mut all_a, mut all_b, mut worst_w) = (Vec::new(), Vec::new(), 1f64);
    for ((n, a), (m, b)) in trained.weights().named_tensors().iter().zip(dw.named_tensors().iter()) {
        assert_eq!(n, m);
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        let c = cosine(&a, &b);
        assert!(c >= 0.99, "{model_type}: {n} after 3 steps: cosine {c}");
        worst_w = worst_w.min(c);
        all_a.extend(a);
        all_b.extend(b);
    }
    let c = cosine(&all_a, &all_b);
    println!("{model_type}: weights after 3 steps: cosine {c:.7} (worst tensor {worst_w:.5})");
    assert!(c >= 0.9999, "{model_type}: weights after 3 steps: cosine {c}");
}

#[test]
fn device_drafter_training_matches_the_cpu_llama() {
    for d in super::devices("device_drafter_training_matches_the_cpu_llama", &[tlt_cuda_sim::Schedule::Seeded(4)]) {
        parity("llama", d);
    }
}

#[test]
fn device_drafter_training_matches_the_cpu_qwen2() {
    for d in super::devices("device_drafter_training_matches_the_cpu_qwen2", &[tlt_cuda_sim::Schedule::Lazy]) {
        parity("qwen2", d);
    }
}

/// Two device trainers from the same drafter, fed the same samples, end with the same bits (master weights, draft
/// logits): the device step has no order-dependent reduction.
#[test]
fn device_drafter_training_is_deterministic() {
    let dev =
        super::devices("device_drafter_training_is_deterministic", &[tlt_cuda_sim::Schedule::Seeded(9)]).remove(0);
    let target = bf16_target("llama");
    let set = rollout_set(&target);
    let d = drafter(&target, "llama");
    let (batch, _) = build_eagle2_batch(&set, d.config().hidden_size(), &cfg()).unwrap();
    let run = || {
        let mut t = CudaDrafterTrainer::new(dev.clone(), &d, cfg(), MAX_ROWS).unwrap();
        for _ in 0..2 {
            t.step(&set, None).unwrap();
        }
        t.forward(&batch, &cfg().eagle2_loss).unwrap();
        (t.named(DraftArena::Master).unwrap(), t.draft_logits().unwrap())
    };
    let (a, b) = (run(), run());
    let bits = |v: &[(String, Vec<f32>)]| v.iter().flat_map(|(_, x)| x.iter().map(|f| f.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&a.0), bits(&b.0), "master weights differ between runs");
    assert!(a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits()), "draft logits differ between runs");
    let start = CudaDrafterTrainer::new(dev, &d, cfg(), MAX_ROWS).unwrap();
    assert_ne!(bits(&start.named(DraftArena::Master).unwrap()), bits(&a.0), "two steps changed nothing");
}

#[test]
fn bad_drafter_training_calls_are_errors() {
    let dev = super::devices("bad_drafter_training_calls_are_errors", &[tlt_cuda_sim::Schedule::Lazy]).remove(0);
    let target = bf16_target("llama");
    let set = rollout_set(&target);
    let d = drafter(&target, "llama");
    let (batch, _) = build_eagle2_batch(&set, d.config().hidden_size(), &cfg()).unwrap();
    let mut t = CudaDrafterTrainer::new(dev.clone(), &d, cfg(), 16).unwrap();
    assert!(t.backward().is_err(), "a backward with no forward");
    assert!(t.draft_logits().is_err(), "logits with no forward");
    assert!(t.forward(&batch, &cfg().eagle2_loss).is_err(), "a batch over max_rows");
    assert!(t.apply(f64::NAN, None).is_err(), "a NaN learning rate");
    assert!(CudaDrafterTrainer::new(dev.clone(), &d, cfg(), 0).is_err(), "no rows");
    let hot = drafter(&target, "llama").with_loss_vocab(&[1, 2, 3]).unwrap();
    assert!(CudaDrafterTrainer::new(dev, &hot, cfg(), 16).is_err(), "a hot vocabulary is refused");
}

/// A trainer built with another target's embedding and head, then given the policy's from its device decoder (device
/// to device), computes the loss of a trainer built with the policy's own, bit for bit; a policy on another device
/// is refused.
#[test]
fn the_target_is_copied_from_the_device_policy() {
    let test = "the_target_is_copied_from_the_device_policy";
    let dev = super::devices(test, &[tlt_cuda_sim::Schedule::Lazy]).remove(0);
    let policy = bf16_target("llama");
    let set = rollout_set(&policy);
    let d = drafter(&policy, "llama");
    let (batch, _) = build_eagle2_batch(&set, d.config().hidden_size(), &cfg()).unwrap();
    let lc = cfg().eagle2_loss;
    let want = CudaDrafterTrainer::new(dev.clone(), &d, cfg(), MAX_ROWS).unwrap().forward(&batch, &lc).unwrap();
    let stale = FrozenTarget::new(&target("llama", 6).rounded_to_bf16().unwrap());
    let stale = Eagle2Drafter::new(d.config().clone(), d.weights().clone(), stale).unwrap();
    let mut t = CudaDrafterTrainer::new(dev.clone(), &stale, cfg(), MAX_ROWS).unwrap();
    assert_ne!(t.forward(&batch, &lc).unwrap().total, want.total, "another target, another loss");
    t.copy_target_from(&CudaLlama::new(&policy, dev, 1, 16).unwrap()).unwrap();
    let got = t.forward(&batch, &lc).unwrap();
    assert_eq!((got.total.to_bits(), got.accuracy.to_bits()), (want.total.to_bits(), want.accuracy.to_bits()));
    let elsewhere = super::devices(test, &[tlt_cuda_sim::Schedule::Lazy]).remove(0);
    assert!(t.copy_target_from(&CudaLlama::new(&policy, elsewhere, 1, 16).unwrap()).is_err(), "another device");
}
