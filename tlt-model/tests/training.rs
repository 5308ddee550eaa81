//! The training forward is differentiable end to end and trains.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use tlt_model::{Llama, LlamaConfig, LogitsFor, SeqInput};

fn tiny(model_type: &str, tied: bool) -> Llama {
    let mut cfg = LlamaConfig::tiny(24, 16, 2);
    cfg.model_type = model_type.into();
    cfg.tie_word_embeddings = tied;
    cfg.intermediate_size = 24;
    if model_type == "qwen3" {
        cfg.head_dim = Some(8); // 4 heads of 8 in a width of 16: decoupled from hidden / heads
    }
    Llama::random(cfg, 3).expect("tiny model")
}

fn batch(dtype_dev: &Device) -> (Tensor, Tensor) {
    let ids: Vec<u32> = vec![1, 5, 9, 2, 7, 3, 3, 8, 0, 4, 11, 6, 2, 2];
    let tgt: Vec<u32> = vec![5, 9, 2, 7, 3, 3, 8, 4, 11, 6, 2, 2, 1, 0];
    (Tensor::from_vec(ids, (2, 7), dtype_dev).expect("ids"), Tensor::from_vec(tgt, (2, 7), dtype_dev).expect("targets"))
}

fn loss(model: &Llama, ids: &Tensor, tgt: &Tensor) -> Tensor {
    model.token_logprobs(ids, tgt).expect("logprobs").mean_all().expect("mean").neg().expect("neg")
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for (arch, tied) in [("llama", false), ("qwen2", true), ("qwen3", false)] {
        let mut model = tiny(arch, tied);
        let vars = model.make_trainable().unwrap();
        assert_eq!(vars.len(), model.weights().named_tensors().len());
        let (ids, tgt) = batch(&Device::Cpu);
        let grads = loss(&model, &ids, &tgt).backward().unwrap();
        for (name, var) in &vars {
            let g = grads.get(var).unwrap_or_else(|| panic!("{arch}: no gradient for {name}"));
            let norm = g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm > 0.0, "{arch}: zero gradient for {name}");
        }
        if arch == "qwen3" {
            let qk = vars.iter().filter(|(n, _)| n.ends_with("q_norm.weight") || n.ends_with("k_norm.weight"));
            assert_eq!(qk.count(), 4, "two head norms per layer, named as HF names them");
        }
    }
}

#[test]
fn gradients_match_finite_differences() {
    for arch in ["qwen2", "qwen3"] {
        finite_differences(arch);
    }
}

fn finite_differences(arch: &str) {
    let mut model = tiny(arch, false).to_dtype(DType::F64).unwrap();
    let vars = model.make_trainable().unwrap();
    let (ids, tgt) = batch(&Device::Cpu);
    let grads = loss(&model, &ids, &tgt).backward().unwrap();
    let eps = 1e-5;
    let mut checked = 0;
    // Every third parameter, and every q/k head norm.
    let picked =
        vars.iter().enumerate().filter(|(i, (n, _))| i % 3 == 0 || n.contains("_norm.weight") && n.contains("attn"));
    for (_, (name, var)) in picked {
        let g = grads.get(var).expect("gradient").flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let base = var.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for idx in [0, base.len() / 2, base.len() - 1] {
            let eval = |delta: f64| -> f64 {
                let mut p = base.clone();
                p[idx] += delta;
                var.set(&Tensor::from_vec(p, var.shape(), &Device::Cpu).unwrap()).unwrap();
                loss(&model, &ids, &tgt).to_scalar::<f64>().unwrap()
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            set_back(var, &base);
            let rel = (numeric - g[idx]).abs() / numeric.abs().max(g[idx].abs()).max(1e-6);
            assert!(rel <= 1e-2, "{arch} {name}[{idx}]: analytic {} vs numeric {numeric} (rel {rel})", g[idx]);
            checked += 1;
        }
    }
    assert!(checked >= 12, "checked only {checked} entries");
}

fn set_back(var: &Var, base: &[f64]) {
    var.set(&Tensor::from_vec(base.to_vec(), var.shape(), &Device::Cpu).unwrap()).unwrap();
}

#[test]
fn adamw_reduces_the_loss_and_inference_sees_the_update() {
    let mut model = tiny("llama", true);
    let vars: Vec<Var> = model.make_trainable().unwrap().into_iter().map(|(_, v)| v).collect();
    let (ids, tgt) = batch(&Device::Cpu);
    let params = ParamsAdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, weight_decay: 0.0, ..Default::default() };
    let mut opt = AdamW::new(vars, params).unwrap();
    let first = loss(&model, &ids, &tgt).to_scalar::<f32>().unwrap();
    for _ in 0..5 {
        opt.backward_step(&loss(&model, &ids, &tgt)).unwrap();
    }
    let last = loss(&model, &ids, &tgt).to_scalar::<f32>().unwrap();
    assert!(last < first * 0.9, "loss {first} -> {last}");

    // The inference path reads the updated weights: its logits match the training forward's.
    let train = model.forward_train(&ids.get(0).unwrap().unsqueeze(0).unwrap()).unwrap();
    let train = train.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    let toks = ids.get(0).unwrap().to_vec1::<u32>().unwrap();
    let out =
        model.forward(&mut cache, &[SeqInput { seq, tokens: &toks, tree: None, logits: LogitsFor::All }], &[]).unwrap();
    let infer = out.logits.to_vec2::<f32>().unwrap();
    for (a, b) in train.iter().flatten().zip(infer.iter().flatten()) {
        assert!((a - b).abs() <= 1e-4);
    }
}

/// Activation checkpointing gives the plain backward's gradients for every parameter (tied and untied heads), and
/// the same forward values.
#[test]
fn checkpointed_backward_matches_the_plain_backward() {
    for (arch, tied) in [("llama", false), ("qwen2", true), ("qwen3", true)] {
        let mut model = tiny(arch, tied);
        let vars = model.make_trainable().unwrap();
        let (ids, tgt) = batch(&Device::Cpu);
        let head = |h: &Tensor| {
            let logits = h.broadcast_matmul(&model.weights().lm_head().t().unwrap()).unwrap();
            let logp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1).unwrap();
            logp.gather(&tgt.unsqueeze(2).unwrap(), 2).unwrap().mean_all().unwrap().neg().unwrap()
        };
        let plain_h = model.forward_train_hidden(&ids).unwrap();
        let plain = head(&plain_h).backward().unwrap();
        let (ck_h, ck) = model.forward_train_hidden_checkpointed(&ids).unwrap();
        let diff = (&plain_h - &ck_h).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{arch}: forward values differ");
        let grads = ck.backward(&model, head(&ck_h).backward().unwrap()).unwrap();
        for (name, var) in &vars {
            let a = plain.get(var).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = grads.get(var).unwrap_or_else(|| panic!("{arch}: no checkpointed gradient for {name}"));
            let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            let err = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(err <= 1e-5 * scale, "{arch} {name}: gradients differ by {err} (scale {scale})");
        }
    }
    // A loss that ignores the checkpointed states is a clear error.
    let model = tiny("llama", false);
    let (ids, _) = batch(&Device::Cpu);
    let (_, ck) = model.forward_train_hidden_checkpointed(&ids).unwrap();
    let unrelated = Var::new(1.0f32, &Device::Cpu).unwrap();
    let grads = unrelated.as_tensor().sqr().unwrap().backward().unwrap();
    assert!(ck.backward(&model, grads).is_err());
}
