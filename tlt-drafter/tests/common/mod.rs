//! Shared fixtures: tiny seeded targets, batches of real target hidden states, a finite-difference checker.
#![allow(dead_code, clippy::unwrap_used)] // Tests: a panic is the failure report; not every test uses every helper.

pub mod reference;
pub mod rollouts;

use candle_core::{DType, Device, Tensor, Var};
use tlt_model::{Llama, LlamaConfig, LogitsFor, SeqInput, Tap};

pub const VOCAB: usize = 24;
pub const HIDDEN: usize = 16;
pub const LAYERS: usize = 4;

/// A tiny seeded target: vocab 24, hidden 16, 4 heads / 2 KV heads, 4 layers. Heads of 4, except Qwen3's: 8
/// (decoupled from hidden / heads, as in Qwen3-0.6B).
pub fn target(model_type: &str, seed: u64) -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB, HIDDEN, LAYERS);
    cfg.model_type = model_type.into();
    if model_type == "qwen3" {
        cfg.head_dim = Some(8);
    }
    cfg.intermediate_size = 24;
    cfg.eos_token_id = Some(tlt_model::EosTokens::One(2));
    Llama::random(cfg, seed).unwrap()
}

/// Deterministic token rows (`rows` of `len` tokens).
pub fn tokens(rows: usize, len: usize, seed: u32) -> Vec<Vec<u32>> {
    (0..rows)
        .map(|r| (0..len).map(|i| (i as u32 * 7 + r as u32 * 5 + seed * 3 + (i * i) as u32) % VOCAB as u32).collect())
        .collect()
}

/// What the target produces for a batch of equal-length rows.
pub struct TargetOut {
    pub ids: Tensor,
    /// `[b, t, H]` final-norm hidden states.
    pub final_hidden: Tensor,
    /// `[b, t, 3H]` the three EAGLE-3 taps concatenated.
    pub aux: Tensor,
    /// `[b, t, V]` logits.
    pub logits: Tensor,
}

pub fn run_target(target: &Llama, rows: &[Vec<u32>]) -> TargetOut {
    let taps = Tap::eagle3(target.config().num_hidden_layers);
    let (b, t) = (rows.len(), rows[0].len());
    let (mut fin, mut aux, mut logits) = (vec![], vec![], vec![]);
    for row in rows {
        let mut cache = target.new_cache();
        let seq = cache.add_sequence();
        let out = target
            .forward(&mut cache, &[SeqInput { seq, tokens: row, tree: None, logits: LogitsFor::All }], &taps)
            .unwrap();
        aux.push(Tensor::cat(&[&out.taps[0], &out.taps[1], &out.taps[2]], 1).unwrap());
        fin.push(out.taps[3].clone());
        logits.push(out.logits);
    }
    let ids: Vec<u32> = rows.iter().flatten().copied().collect();
    TargetOut {
        ids: Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap(),
        final_hidden: Tensor::stack(&fin, 0).unwrap(),
        aux: Tensor::stack(&aux, 0).unwrap(),
        logits: Tensor::stack(&logits, 0).unwrap(),
    }
}

/// `[b, t]` f32 mask from rows of 0/1.
pub fn mask(rows: &[Vec<f32>]) -> Tensor {
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.iter().flatten().copied().collect::<Vec<_>>(), (b, t), &Device::Cpu).unwrap()
}

pub fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// Compares the analytic gradient of `loss` with central finite differences at a few entries of every
/// `stride`-th variable (f64). Returns the number of entries checked.
pub fn check_gradients(vars: &[(String, Var)], stride: usize, loss: impl Fn() -> Tensor) -> usize {
    let grads = loss().backward().unwrap();
    let eps = 1e-5;
    let mut checked = 0;
    for (name, var) in vars.iter().step_by(stride) {
        let g = grads.get(var).unwrap_or_else(|| panic!("no gradient for {name}"));
        let g = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let base = var.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for idx in [0, base.len() / 3, base.len() - 1] {
            let eval = |delta: f64| -> f64 {
                let mut p = base.clone();
                p[idx] += delta;
                var.set(&Tensor::from_vec(p, var.shape(), &Device::Cpu).unwrap()).unwrap();
                scalar(&loss())
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            var.set(&Tensor::from_vec(base.clone(), var.shape(), &Device::Cpu).unwrap()).unwrap();
            let tol = 1e-6 + 1e-4 * numeric.abs().max(g[idx].abs());
            assert!((numeric - g[idx]).abs() <= tol, "{name}[{idx}]: analytic {} vs numeric {numeric}", g[idx]);
            checked += 1;
        }
    }
    checked
}

/// Asserts every variable gets a gradient with a non-zero norm.
pub fn assert_all_gradients_nonzero(vars: &[(String, Var)], loss: &Tensor, what: &str) {
    let grads = loss.backward().unwrap();
    for (name, var) in vars {
        let g = grads.get(var).unwrap_or_else(|| panic!("{what}: no gradient for {name}"));
        let norm = scalar(&g.abs().unwrap().sum_all().unwrap());
        assert!(norm > 0.0, "{what}: zero gradient for {name}");
    }
}

/// Bit patterns of a 2-D f32 tensor.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// A fresh temporary directory under the system temp dir.
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tlt-drafter-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
