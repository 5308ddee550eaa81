//! Training on the device (`CudaTrainer`) against the CPU's candle autograd in f32, on the device the environment
//! gives (the simulated one in CI, every kernel of the training pass included): the same log-probabilities within
//! bf16 tolerance, gradients with cosine >= 0.999 overall (>= 0.99 per tensor) and the same norm within 5%, then the
//! same greedy tokens after 3 AdamW steps on both; the device update is deterministic (two runs, the same bits);
//! bad calls are errors.

use candle_core::{Device, Tensor};
use tlt_kernels::cuda::SharedGpu;
use tlt_model::cuda::train::{Arena, CudaTrainer, TrainBatch};
use tlt_model::cuda::{CudaLlama, DeviceSeq};
use tlt_model::device_step::row_parity;
use tlt_model::optim::{AdamW, AdamWParams};
use tlt_model::{KvCache, Llama, LlamaConfig, LogitsFor, SeqInput};

/// Prompts and responses of the batch, and each sequence's advantage.
const PROMPTS: [&[u32]; 3] = [&[3, 1, 4, 1], &[5, 9, 2, 6, 5, 3], &[8, 9]];
const RESPONSES: [&[u32]; 3] = [&[7, 9, 3, 2, 3], &[8, 4, 6], &[2, 6, 4, 3, 3, 8, 3]];
const ADV: [f32; 3] = [1.0, -0.5, 0.7];

fn tiny(model_type: &str) -> Llama {
    let mut cfg = LlamaConfig::tiny(96, 64, 2);
    cfg.model_type = model_type.into();
    cfg.intermediate_size = 96;
    // bf16 weights on both sides: the comparison measures the device's bf16 activations only.
    Llama::random(cfg, 7).unwrap().rounded_to_bf16().unwrap()
}

fn pairs() -> Vec<(&'static [u32], &'static [u32])> {
    PROMPTS.iter().copied().zip(RESPONSES.iter().copied()).collect()
}

fn tokens() -> usize {
    RESPONSES.iter().map(|r| r.len()).sum()
}

/// The CPU's response log-probabilities (sequence by sequence) and the loss
/// `L = -sum_s adv_s sum_t logp_st / tokens` (differentiable).
fn cpu_loss(model: &Llama, adv: [f32; 3]) -> (Vec<Vec<f32>>, Tensor) {
    let mut logps = Vec::new();
    let mut loss = Tensor::new(0f32, &Device::Cpu).unwrap();
    for ((p, r), adv) in pairs().into_iter().zip(adv) {
        let ids: Vec<u32> = p.iter().chain(r.iter()).take(p.len() + r.len() - 1).copied().collect();
        let mut targets = vec![0u32; ids.len()];
        targets[p.len() - 1..].copy_from_slice(r);
        let n = ids.len();
        let ids = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
        let targets = Tensor::from_vec(targets, (1, n), &Device::Cpu).unwrap();
        let lp = model.token_logprobs(&ids, &targets).unwrap();
        let lp = lp.squeeze(0).unwrap().narrow(0, p.len() - 1, r.len()).unwrap();
        logps.push(lp.to_vec1::<f32>().unwrap());
        loss = (loss + (lp.sum_all().unwrap() * f64::from(-adv / tokens() as f32)).unwrap()).unwrap();
    }
    (logps, loss)
}

/// The device's response log-probabilities (in the CPU's per-sequence shape) after a forward, then its backward of
/// the same loss.
fn device_pass(trainer: &mut CudaTrainer, model: &CudaLlama, batch: &TrainBatch) -> Vec<Vec<f32>> {
    let (logp, _) = trainer.forward(model, batch, 1.0, false).unwrap();
    let mut g = vec![0f32; logp.len()];
    let mut out = Vec::new();
    let mut rows = batch.scored_rows();
    for (r, adv) in RESPONSES.iter().zip(ADV) {
        let mut seq = Vec::new();
        for _ in 0..r.len() {
            let row = rows.next().unwrap();
            seq.push(logp[row]);
            g[row] = -adv / tokens() as f32;
        }
        out.push(seq);
    }
    trainer.backward(model, &g, None).unwrap();
    out
}

/// The response log-probabilities from the device decoder's own prefill (its bf16 pipeline, other attention
/// kernels): what the training forward must reproduce closely.
fn decoder_logp(model: &mut CudaLlama) -> Vec<Vec<f32>> {
    let v = model.config().vocab_size;
    pairs()
        .into_iter()
        .map(|(p, r)| {
            let ids: Vec<u32> = p.iter().chain(r.iter()).take(p.len() + r.len() - 1).copied().collect();
            let out = model.forward(&[DeviceSeq { slot: 0, prefix_len: 0, tokens: &ids, parents: None }]).unwrap();
            let logits = model.logits_to_host(&out).unwrap();
            r.iter()
                .enumerate()
                .map(|(j, &t)| {
                    let row = &logits[(p.len() - 1 + j) * v..(p.len() + j) * v];
                    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let lse = f64::from(max) + row.iter().map(|&x| f64::from(x - max).exp()).sum::<f64>().ln();
                    (f64::from(row[t as usize]) - lse) as f32
                })
                .collect()
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
    let na: f64 = a.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    dot / (na * nb).max(1e-30)
}

/// Greedy continuation of `prompt` by `n` tokens on the CPU, with the logit row each token was picked from.
fn cpu_greedy(model: &Llama, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache: KvCache = model.new_cache();
    let seq = cache.add_sequence();
    let (mut out, mut rows, mut input) = (Vec::new(), Vec::new(), prompt.to_vec());
    for _ in 0..n {
        let logits = model
            .forward(&mut cache, &[SeqInput { seq, tokens: &input, tree: None, logits: LogitsFor::Last }], &[])
            .unwrap()
            .logits
            .to_vec2::<f32>()
            .unwrap();
        let row = logits.last().unwrap().clone();
        let next = argmax(&row);
        out.push(next);
        rows.push(row);
        input = vec![next];
    }
    (out, rows)
}

/// The device decoder's last logit row after prefilling `tokens`.
fn device_last_row(model: &mut CudaLlama, tokens: &[u32]) -> Vec<f32> {
    let step = model.forward(&[DeviceSeq { slot: 0, prefix_len: 0, tokens, parents: None }]).unwrap();
    let logits = model.logits_to_host(&step).unwrap();
    let v = model.config().vocab_size;
    logits[(tokens.len() - 1) * v..tokens.len() * v].to_vec()
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

fn parity(model_type: &str, dev: SharedGpu) {
    let base = tiny(model_type);
    let mut cpu = base.clone();
    let vars = cpu.make_trainable().unwrap();
    let hp = AdamWParams::default();
    let mut opt = AdamW::new(vars.clone(), hp).unwrap();
    let mut gpu = CudaLlama::new(&base, dev, 1, 64).unwrap();
    let mut trainer = CudaTrainer::new(&gpu, hp, 32).unwrap();
    let batch = TrainBatch::responses(&pairs(), 96).unwrap();

    // One pass: log-probabilities and gradients.
    let (cpu_logp, loss) = cpu_loss(&cpu, ADV);
    let store = loss.backward().unwrap();
    let flat =
        |v: &candle_core::Var| store.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let cpu_grads: Vec<(String, Vec<f32>)> = vars.iter().map(|(n, v)| (n.clone(), flat(v))).collect();
    trainer.zero_grad().unwrap();
    let dev_logp = device_pass(&mut trainer, &gpu, &batch);
    let rel = |a: f32, b: f32| (a - b).abs() / (1.0 + b.abs());
    let worst = cpu_logp.iter().flatten().zip(dev_logp.iter().flatten()).map(|(&a, &b)| rel(a, b)).fold(0f32, f32::max);
    let dec = decoder_logp(&mut gpu);
    let worst_dec = dec.iter().flatten().zip(dev_logp.iter().flatten()).map(|(&a, &b)| rel(a, b)).fold(0f32, f32::max);
    // The training forward is the decoder's own bf16 pipeline (measured: 1e-7 apart, other attention kernels);
    // against the CPU's f32 it is bf16 activations apart (measured: 1% of |logp| on this model's large logits).
    // Qwen2: the training forward rounds the q/k/v bias sum to bf16 before RoPE, the decoder adds it in f32 inside
    // its RoPE kernel: one more bf16 rounding (measured 1.4% here, as far from the decoder as the CPU is).
    let dec_tol = if model_type == "llama" { 1e-4 } else { 0.02 };
    assert!(worst_dec <= dec_tol, "{model_type}: log-probabilities differ from the device decoder's by {worst_dec}");
    assert!(worst <= 0.02, "{model_type}: log-probabilities differ from the CPU's by {worst} (relative)");
    let dev_grads = trainer.hf_named(&trainer.arena_to_host(Arena::Grad).unwrap()).unwrap();
    assert_eq!(dev_grads.len(), cpu_grads.len(), "{model_type}: every CPU parameter has a device gradient");
    let (mut all_cpu, mut all_dev, mut worst_cos) = (Vec::new(), Vec::new(), 1f64);
    for (name, want) in &cpu_grads {
        let got = &dev_grads.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no device gradient {name}")).1;
        assert_eq!(got.len(), want.len(), "{name}");
        let c = cosine(got, want);
        worst_cos = worst_cos.min(c);
        assert!(c >= 0.99, "{model_type}: {name}: gradient cosine {c}");
        all_cpu.extend_from_slice(want);
        all_dev.extend_from_slice(got);
    }
    let c = cosine(&all_dev, &all_cpu);
    let (nd, nc) = (norm(&all_dev), norm(&all_cpu));
    // Negative control: the gradient of a slightly different loss (the last advantage 0.7 -> 0.5) is told apart.
    let other = cpu_loss(&cpu, [ADV[0], ADV[1], 0.5]).1.backward().unwrap();
    let other: Vec<f32> = vars
        .iter()
        .flat_map(|(_, v)| other.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    let c_other = cosine(&all_dev, &other);
    assert!(
        c_other < 0.999,
        "{model_type}: the control's cosine {c_other} passes the threshold: the test has no power"
    );
    assert!(c >= 0.999, "{model_type}: global gradient cosine {c}");
    assert!((nd / nc - 1.0).abs() <= 0.05, "{model_type}: gradient norms {nd} vs {nc}");
    let dn = trainer.grad_norm().unwrap();
    assert!((dn / nd - 1.0).abs() < 1e-6, "{model_type}: grad_norm {dn} vs the host's {nd}");
    println!("{model_type}: logp within {worst:.4} (CPU), {worst_dec:.1e} (device decoder), gradient cosine {c:.6} (worst tensor {worst_cos:.5}), norms {nd:.5} / {nc:.5}, control {c_other:.4}");

    // Three AdamW steps on both sides (the first from the gradients above), then the same greedy tokens.
    let (lr, prompt) = (0.005, PROMPTS[0]);
    let (before, _) = cpu_greedy(&cpu, prompt, 6);
    let mut store = Some(store);
    for _ in 0..3 {
        let grads = match store.take() {
            Some(g) => g,
            None => {
                trainer.zero_grad().unwrap();
                device_pass(&mut trainer, &gpu, &batch);
                cpu_loss(&cpu, ADV).1.backward().unwrap()
            }
        };
        opt.step(&grads, lr, None).unwrap();
        trainer.step(&mut gpu, lr, None).unwrap();
    }
    // lr 0.005: Adam's first steps move every weight by about lr times the sign of its gradient, so at lr 0.05 the
    // elements whose tiny gradients differ in sign between bf16 and f32 moved the two models 0.9 row std apart
    // (measured); at 0.005 the greedy continuation still changes (asserted below).
    // The CPU's greedy path; at each of its steps the device decoder, fed the same prefix, picks the same token
    // unless the CPU's top two logits are a near tie (`row_parity`'s rule; the CPU's weights are f32 after the
    // steps, the device's the bf16 rounding of its f32 masters).
    let (cpu_after, rows) = cpu_greedy(&cpu, prompt, 6);
    let mut prefix = prompt.to_vec();
    let (mut agree, mut worst_row) = (0, 0f32);
    for (k, (tok, want)) in cpu_after.iter().zip(&rows).enumerate() {
        let got = device_last_row(&mut gpu, &prefix);
        let p = row_parity(&got, want, 0.1);
        assert!(p.argmax_equal || p.near_tie, "{model_type}: greedy token {k} after 3 steps: {p:?}");
        assert!(p.rel_diff <= 0.25, "{model_type}: logits after 3 steps {p:?} (measured <= 0.06 std)");
        agree += usize::from(p.argmax_equal);
        worst_row = worst_row.max(p.rel_diff);
        prefix.push(*tok);
    }
    println!("{model_type}: greedy before {before:?}, after {cpu_after:?}: device agrees on {agree}/6 (rows within {worst_row:.3} std)");
    assert_ne!(cpu_after, before, "{model_type}: 3 steps at lr {lr} should change the greedy continuation");
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt()
}

#[test]
fn device_training_matches_the_cpu_llama() {
    for d in super::devices("device_training_matches_the_cpu_llama") {
        parity("llama", d);
    }
}

#[test]
fn device_training_matches_the_cpu_qwen2() {
    for d in super::devices("device_training_matches_the_cpu_qwen2") {
        parity("qwen2", d);
    }
}

/// Two trainers from the same weights, fed the same batches, end with the same bits (master weights, the decoder's
/// bf16 weights through its logits): the device update has no order-dependent reduction, so TLT's updates (same
/// rollouts) equal the baseline's.
fn deterministic(dev: SharedGpu) {
    let base = tiny("llama");
    let batch = TrainBatch::responses(&pairs(), 96).unwrap();
    let run = || {
        let mut gpu = CudaLlama::new(&base, dev.clone(), 1, 64).unwrap();
        let mut trainer =
            CudaTrainer::new(&gpu, AdamWParams { weight_decay: 0.01, ..AdamWParams::default() }, 32).unwrap();
        for _ in 0..2 {
            trainer.zero_grad().unwrap();
            device_pass(&mut trainer, &gpu, &batch);
            trainer.step(&mut gpu, 0.01, Some(0.5)).unwrap();
        }
        let logits = {
            let out = gpu.forward(&[DeviceSeq { slot: 0, prefix_len: 0, tokens: PROMPTS[1], parents: None }]).unwrap();
            gpu.logits_to_host(&out).unwrap()
        };
        (trainer.arena_to_host(Arena::Master).unwrap(), logits)
    };
    let (a, b) = (run(), run());
    assert!(a.0.iter().zip(&b.0).all(|(x, y)| x.to_bits() == y.to_bits()), "master weights differ between runs");
    assert!(a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits()), "decoder logits differ between runs");
    let start = CudaTrainer::new(&CudaLlama::new(&base, dev, 1, 64).unwrap(), AdamWParams::default(), 1).unwrap();
    assert_ne!(start.arena_to_host(Arena::Master).unwrap(), a.0, "two steps changed nothing");
}

#[test]
fn device_update_is_deterministic() {
    for d in super::devices("device_update_is_deterministic") {
        deterministic(d);
    }
}

#[test]
fn bad_training_calls_are_errors() {
    let dev = super::devices("bad_training_calls_are_errors").remove(0);
    let base = tiny("llama");
    let gpu = CudaLlama::new(&base, dev.clone(), 1, 64).unwrap();
    let mut trainer = CudaTrainer::new(&gpu, AdamWParams::default(), 8).unwrap();
    assert!(trainer.backward(&gpu, &[0.0; 4], None).is_err(), "a backward with no forward");
    let long = TrainBatch::responses(&pairs(), 96).unwrap();
    assert!(trainer.forward(&gpu, &long, 1.0, false).is_err(), "a batch over max_rows");
    let short = TrainBatch::responses(&[(&[1, 2], &[3, 4])], 96).unwrap();
    assert!(trainer.forward(&gpu, &short, 0.0, false).is_err(), "temperature 0");
    let (logp, _) = trainer.forward(&gpu, &short, 1.0, false).unwrap();
    assert!(trainer.backward(&gpu, &vec![0.0; logp.len() + 1], None).is_err(), "gradients of another length");
    assert!(trainer.backward(&gpu, &logp, Some(&logp)).is_err(), "an entropy gradient without entropy");
    let other = CudaLlama::new(&tiny("qwen2"), dev.clone(), 1, 64).unwrap();
    assert!(trainer.forward(&other, &short, 1.0, false).is_err(), "another configuration");
    let mut q3 = LlamaConfig::tiny(96, 64, 2);
    q3.model_type = "qwen3".into();
    let q3 = CudaLlama::new(&Llama::random(q3, 1).unwrap(), dev, 1, 64).unwrap();
    assert!(CudaTrainer::new(&q3, AdamWParams::default(), 8).is_err(), "Qwen3's head norms are not trained yet");
    assert!(CudaTrainer::new(&gpu, AdamWParams::default(), 0).is_err());
}

/// A trainer rebuilt from another's state by name (master weights, moments, step count: what a checkpoint holds)
/// continues exactly as the original: the next step gives the same bits, and the decoder runs the loaded weights.
fn resume(dev: SharedGpu) {
    let base = tiny("qwen2");
    let batch = TrainBatch::responses(&pairs(), 96).unwrap();
    let hp = AdamWParams { weight_decay: 0.01, ..AdamWParams::default() };
    let step = |t: &mut CudaTrainer, m: &mut CudaLlama| {
        t.zero_grad().unwrap();
        device_pass(t, m, &batch);
        t.step(m, 0.01, None).unwrap();
    };
    let mut a_model = CudaLlama::new(&base, dev.clone(), 1, 64).unwrap();
    let mut a = CudaTrainer::new(&a_model, hp, 32).unwrap();
    step(&mut a, &mut a_model);
    let mut b_model = CudaLlama::new(&base, dev, 1, 64).unwrap();
    let mut b = CudaTrainer::new(&b_model, hp, 32).unwrap();
    for arena in [Arena::Master, Arena::ExpAvg, Arena::ExpAvgSq] {
        b.load_hf(arena, &a.hf_named(&a.arena_to_host(arena).unwrap()).unwrap()).unwrap();
    }
    b.set_steps(a.steps());
    b.write_decoder(&mut b_model).unwrap();
    assert_eq!(device_last_row(&mut a_model, PROMPTS[2]), device_last_row(&mut b_model, PROMPTS[2]));
    step(&mut a, &mut a_model);
    step(&mut b, &mut b_model);
    for arena in [Arena::Master, Arena::ExpAvg, Arena::ExpAvgSq] {
        let (x, y) = (a.arena_to_host(arena).unwrap(), b.arena_to_host(arena).unwrap());
        assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "{arena:?} differs after the resumed step");
    }
    let mut named = a.hf_named(&a.arena_to_host(Arena::Master).unwrap()).unwrap();
    named[0].1.pop();
    assert!(b.load_hf(Arena::Master, &named).is_err(), "a tensor of the wrong size");
    named.remove(0);
    assert!(b.load_hf(Arena::Master, &named).is_err(), "a missing tensor");
}

#[test]
fn a_trainer_resumed_by_name_continues_exactly() {
    for d in super::devices("a_trainer_resumed_by_name_continues_exactly") {
        resume(d);
    }
}
