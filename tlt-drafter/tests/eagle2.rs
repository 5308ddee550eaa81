//! EAGLE-2: alignment, gradients, frozen shared parts, and training on real target hidden states.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use common::reference::*;
use common::*;
use tlt_drafter::{DrafterConfig, Eagle2Batch, Eagle2Drafter, Eagle2LossConfig, Error, FrozenTarget, UniformNoise};

fn drafter(model_type: &str, fc_bias: bool) -> (tlt_model::Llama, Eagle2Drafter) {
    let target = target(model_type, 3);
    let cfg = DrafterConfig::eagle2_from_target(target.config(), fc_bias);
    let d = Eagle2Drafter::random(cfg, FrozenTarget::new(&target), 11).unwrap();
    (target, d)
}

fn batch(target: &tlt_model::Llama) -> Eagle2Batch {
    let out = run_target(target, &tokens(2, 7, 1));
    // Row 1 is right-padded after 5 tokens; the first token of each row is prompt (no loss).
    let loss_mask = mask(&[vec![0., 1., 1., 1., 1., 1., 1.], vec![0., 1., 1., 1., 1., 0., 0.]]);
    Eagle2Batch { input_ids: out.ids, hidden: out.final_hidden, loss_mask, segments: None }
}

#[test]
fn gradients_match_finite_differences() {
    let (target, d) = drafter("qwen2", true);
    let d = d.to_dtype(DType::F64).unwrap();
    let b = batch(&target);
    let vars = d.vars().unwrap();
    let cfg = Eagle2LossConfig::default();
    let checked = check_gradients(&vars, 1, || d.loss(&b, &cfg).unwrap().total);
    assert!(checked >= 3 * vars.len(), "checked only {checked}");
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for (arch, bias) in [("llama", false), ("llama", true), ("qwen2", false)] {
        let (target, d) = drafter(arch, bias);
        let vars = d.vars().unwrap();
        let names: Vec<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names.contains(&"model.fc.bias"), bias);
        assert_eq!(names.contains(&"model.layers.0.self_attn.q_proj.bias"), arch == "qwen2");
        assert!(!names.iter().any(|n| n.contains("embed") || n.contains("lm_head") || n.contains("input_layernorm")));
        let loss = d.loss(&batch(&target), &Eagle2LossConfig::default()).unwrap();
        assert_all_gradients_nonzero(&vars, &loss.total, arch);
    }
}

#[test]
fn adamw_trains_while_shared_embedding_and_head_stay_bit_identical() {
    let (target, d) = drafter("llama", false);
    let (embed0, head0) = (bits(&target.weights().embed_tokens), bits(target.weights().lm_head()));
    let b = batch(&target);
    let vars: Vec<_> = d.vars().unwrap().into_iter().map(|(_, v)| v).collect();
    let before = bits(&d.weights().fc.weight);
    let params = ParamsAdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, weight_decay: 0.0, ..Default::default() };
    let mut opt = AdamW::new(vars, params).unwrap();
    let cfg = Eagle2LossConfig::default();
    let first = d.loss(&b, &cfg).unwrap();
    for _ in 0..8 {
        opt.backward_step(&d.loss(&b, &cfg).unwrap().total).unwrap();
    }
    let last = d.loss(&b, &cfg).unwrap();
    let (f, l) = (scalar(&first.total), scalar(&last.total));
    assert!(l < 0.8 * f, "loss {f} -> {l}");
    assert!(scalar(&last.vloss) < scalar(&first.vloss));
    assert_ne!(bits(&d.weights().fc.weight), before, "the drafter's own weights were updated in place");
    assert_eq!(bits(&target.weights().embed_tokens), embed0);
    assert_eq!(bits(target.weights().lm_head()), head0);
    assert_eq!(bits(d.target().embed_tokens()), embed0);
    assert_eq!(bits(d.target().lm_head()), head0);
}

/// The EAGLE-2 forward at the last of `tokens_in.len()` positions, written independently with f64 loops:
/// position `j` reads `tokens_in[j]` (= x_{j+1}) and `h[j]`, `a_j = fc([embed; h_j])`, attention over `a_0..a_t`
/// (no input norm), `+ mlp`, no final norm.
fn reference_output(d: &Eagle2Drafter, tokens_in: &[u32], h: &[Vec<f64>]) -> Vec<f64> {
    let w = d.weights();
    let l = &w.layer;
    let c = &d.config().llama;
    let (nh, nkv, hd, inv) = (c.num_attention_heads, c.kv_heads(), c.head_dim(), c.rope_inv_freq());
    let embed = mat(d.target().embed_tokens());
    let lin = |lin: &tlt_model::Linear, x: &[f64]| -> Vec<f64> {
        let y = matvec(&mat(&lin.weight), x);
        lin.bias.as_ref().map_or(y.clone(), |b| add(&y, &vec1(b)))
    };
    let (mut keys, mut values, mut last) = (vec![], vec![], (vec![], vec![]));
    for (j, (&tok, hj)) in tokens_in.iter().zip(h).enumerate() {
        let mut x = embed[tok as usize].clone();
        x.extend_from_slice(hj);
        let a = lin(&w.fc, &x);
        let (mut q, mut k) = (lin(&l.proj.q_proj, &a), lin(&l.proj.k_proj, &a));
        rope(&mut q, hd, j, &inv);
        rope(&mut k, hd, j, &inv);
        keys.push(k);
        values.push(lin(&l.proj.v_proj, &a));
        last = (a, q);
    }
    let (a, q) = last;
    let x = add(&a, &lin(&l.proj.o_proj, &attend(&q, &keys, &values, nh, nkv, hd)));
    let m = |lin: &tlt_model::Linear| mat(&lin.weight);
    mlp_residual(
        &x,
        &vec1(&l.post_attention_layernorm),
        &m(&l.proj.gate_proj),
        &m(&l.proj.up_proj),
        &m(&l.proj.down_proj),
        c.rms_norm_eps,
    )
}

/// Data generated by an independent reference drafter under the documented alignment (position t reads x_{t+1}
/// and h_t and predicts h_{t+1}) is fitted perfectly: vloss = 0 and ploss = the target distribution's entropy.
/// Shifted tokens or lagged hidden states are not, and `loss_mask[j]` selects the target `h_j`.
#[test]
fn alignment_is_pinned_by_a_perfect_drafter() {
    let (target, d) = drafter("qwen2", true);
    let d = d.to_dtype(DType::F64).unwrap();
    let t = 8;
    let ids: Vec<u32> = tokens(1, t, 4).remove(0);
    let input_ids = Tensor::from_vec(ids.clone(), (1, t), &Device::Cpu).unwrap();
    let mut h = vec![vec![0f64; HIDDEN]; t];
    h[0] = (0..HIDDEN).map(|i| ((i * 5 % 7) as f64 - 3.0) / 3.0).collect();
    for i in 0..t - 1 {
        h[i + 1] = reference_output(&d, &ids[1..=i + 1], &h[..=i]);
    }
    let hidden = |h: &Vec<Vec<f64>>| {
        Tensor::from_vec(h.iter().flatten().copied().collect::<Vec<_>>(), (1, t, HIDDEN), &Device::Cpu).unwrap()
    };
    let ones = Tensor::ones((1, t), DType::F64, &Device::Cpu).unwrap();
    let b = Eagle2Batch { input_ids: input_ids.clone(), hidden: hidden(&h), loss_mask: ones.clone(), segments: None };
    let loss = d.loss(&b, &Eagle2LossConfig::default()).unwrap();
    assert!(scalar(&loss.vloss) < 1e-12, "vloss {}", scalar(&loss.vloss));
    assert_eq!(loss.tokens, (t - 1) as f64);
    assert_eq!(loss.accuracy, 1.0);
    // ploss equals the mean entropy of softmax(LMHead(h_{t+1})) over positions 1..t.
    let head = target.weights().lm_head().to_dtype(DType::F64).unwrap();
    let targets = hidden(&h).narrow(1, 1, t - 1).unwrap();
    let logp = candle_nn::ops::log_softmax(&targets.broadcast_matmul(&head.t().unwrap()).unwrap(), D::Minus1).unwrap();
    let entropy = scalar(&(logp.exp().unwrap() * &logp).unwrap().sum_all().unwrap().neg().unwrap()) / (t - 1) as f64;
    assert!((scalar(&loss.ploss) - entropy).abs() < 1e-10);
    assert!((scalar(&loss.total) - 0.1 * entropy).abs() < 1e-10);

    // Misalignments: reading x_t instead of x_{t+1}, or predicting h_t from h_t, are far from perfect.
    let vloss = |input_ids: &Tensor, h: &Vec<Vec<f64>>, mask: &Tensor| {
        let b =
            Eagle2Batch { input_ids: input_ids.clone(), hidden: hidden(h), loss_mask: mask.clone(), segments: None };
        scalar(&d.loss(&b, &Eagle2LossConfig::default()).unwrap().vloss)
    };
    let mut shifted = vec![0u32];
    shifted.extend_from_slice(&ids[..t - 1]);
    assert!(vloss(&Tensor::from_vec(shifted, (1, t), &Device::Cpu).unwrap(), &h, &ones) > 1e-3);
    let mut lagged = h.clone();
    lagged.rotate_right(1);
    assert!(vloss(&input_ids, &lagged, &ones) > 1e-3);
    // Corrupting h_5 breaks only the predictions at positions >= 4; loss_mask[4] (target h_4) stays perfect.
    let mut corrupt = h.clone();
    corrupt[5].iter_mut().for_each(|v| *v += 0.5);
    let only = |j: usize| {
        let mut m = vec![0f64; t];
        m[j] = 1.0;
        Tensor::from_vec(m, (1, t), &Device::Cpu).unwrap()
    };
    assert!(vloss(&input_ids, &corrupt, &only(4)) < 1e-12);
    assert!(vloss(&input_ids, &corrupt, &only(5)) > 1e-3);
    assert!(vloss(&input_ids, &corrupt, &only(0)) == 0.0, "h_0 is never a target");
}

/// Two documents packed into one row with segment ids give the same loss as the two rows padded.
#[test]
fn packed_rows_match_padded_rows() {
    let (target, d) = drafter("llama", false);
    let a = run_target(&target, &tokens(1, 5, 2));
    let b = run_target(&target, &tokens(1, 4, 5));
    let cat = |x: &Tensor, y: &Tensor| Tensor::cat(&[x, y], 1).unwrap();
    let packed = Eagle2Batch {
        input_ids: cat(&a.ids, &b.ids),
        hidden: cat(&a.final_hidden, &b.final_hidden),
        loss_mask: mask(&[vec![0., 1., 1., 1., 1., 0., 1., 1., 1.]]),
        segments: Some(Tensor::new(&[[0u32, 0, 0, 0, 0, 7, 7, 7, 7]], &Device::Cpu).unwrap()),
    };
    let pad_ids = Tensor::cat(&[&b.ids, &Tensor::zeros((1, 1), DType::U32, &Device::Cpu).unwrap()], 1).unwrap();
    let pad_h =
        Tensor::cat(&[&b.final_hidden, &Tensor::zeros((1, 1, HIDDEN), DType::F32, &Device::Cpu).unwrap()], 1).unwrap();
    let padded = Eagle2Batch {
        input_ids: Tensor::cat(&[&a.ids, &pad_ids], 0).unwrap(),
        hidden: Tensor::cat(&[&a.final_hidden, &pad_h], 0).unwrap(),
        loss_mask: mask(&[vec![0., 1., 1., 1., 1.], vec![0., 1., 1., 1., 0.]]),
        segments: None,
    };
    let cfg = Eagle2LossConfig::default();
    let (p, q) = (d.loss(&packed, &cfg).unwrap(), d.loss(&padded, &cfg).unwrap());
    assert_eq!(p.tokens, 7.0);
    assert_eq!(q.tokens, 7.0);
    assert!((scalar(&p.total) - scalar(&q.total)).abs() < 1e-5, "{} vs {}", scalar(&p.total), scalar(&q.total));
}

#[test]
fn noise_is_seeded_and_bad_batches_are_errors() {
    let (target, d) = drafter("llama", false);
    let b = batch(&target);
    let noisy = |seed| Eagle2LossConfig { noise: Some(UniformNoise { std: 0.2, seed }), ..Default::default() };
    let (x, y, z) = (d.loss(&b, &noisy(1)).unwrap(), d.loss(&b, &noisy(1)).unwrap(), d.loss(&b, &noisy(2)).unwrap());
    assert_eq!(scalar(&x.total), scalar(&y.total));
    assert_ne!(scalar(&x.total), scalar(&z.total));
    assert_ne!(scalar(&x.total), scalar(&d.loss(&b, &Eagle2LossConfig::default()).unwrap().total));

    let mut bad = b.clone();
    bad.hidden = bad.hidden.narrow(2, 0, 8).unwrap();
    assert!(matches!(d.loss(&bad, &Default::default()), Err(Error::InvalidBatch { field: "hidden", .. })));
    let mut bad = b.clone();
    bad.input_ids = (bad.input_ids + 100.0).unwrap();
    assert!(matches!(d.loss(&bad, &Default::default()), Err(Error::InvalidBatch { field: "input_ids", .. })));
    let mut bad = b.clone();
    bad.loss_mask = bad.loss_mask.narrow(1, 0, 3).unwrap();
    assert!(matches!(d.loss(&bad, &Default::default()), Err(Error::InvalidBatch { field: "loss_mask", .. })));
    let bad_cfg = Eagle2LossConfig { ploss_weight: f64::NAN, ..Default::default() };
    assert!(matches!(d.loss(&b, &bad_cfg), Err(Error::InvalidConfig { .. })));
}

#[test]
fn feature_regression_alone_skips_the_head_and_keeps_gradients() {
    let (target, d) = drafter("llama", false);
    let b = batch(&target);
    let full = d.loss(&b, &Eagle2LossConfig::default()).unwrap();
    let cfg = Eagle2LossConfig { ploss_weight: 0.0, ..Eagle2LossConfig::default() };
    let v = d.loss(&b, &cfg).unwrap();
    let s = |t: &candle_core::Tensor| t.to_dtype(candle_core::DType::F64).unwrap().to_scalar::<f64>().unwrap();
    assert_eq!(s(&v.vloss), s(&full.vloss));
    assert_eq!(s(&v.total), s(&v.vloss));
    assert!(v.accuracy.is_nan());
    let grads = v.total.backward().unwrap();
    for (name, var) in d.vars().unwrap() {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{name} has no gradient"));
        assert!(g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "{name}");
    }
}

#[test]
fn soft_ce_restricted_to_a_vocabulary_subset() {
    let (target, d) = drafter("llama", false);
    let b = batch(&target);
    let cfg = Eagle2LossConfig::default();
    let s = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
    let full = d.loss(&b, &cfg).unwrap();
    let all: Vec<u32> = (0..VOCAB as u32).collect();
    let same = d.clone().with_loss_vocab(&all).unwrap().loss(&b, &cfg).unwrap();
    assert!((s(&full.total) - s(&same.total)).abs() < 1e-6, "all ids = the full vocabulary");
    let sub = d.clone().with_loss_vocab(&[0, 3, 5, 7, 11]).unwrap();
    let l = sub.loss(&b, &cfg).unwrap();
    assert!(s(&l.ploss).is_finite() && s(&l.ploss) < s(&full.ploss), "fewer classes, smaller cross-entropy");
    let grads = l.total.backward().unwrap();
    for (name, var) in sub.vars().unwrap() {
        assert!(grads.get(var.as_tensor()).is_some(), "{name}");
    }
    assert!(d.clone().with_loss_vocab(&[]).is_err());
    assert!(d.with_loss_vocab(&[VOCAB as u32]).is_err());
}
