//! LoRA on the device (`CudaLoraTrainer`) against candle's CPU autograd in f32, on the device the environment gives
//! (the simulated one in CI): with adapters `A`, `B` on every linear (`W + (alpha / r) · B · A`), the merged decoder's
//! log-probabilities equal the CPU's LoRA forward within bf16 tolerance and differ from the base model's; the
//! adapters' gradients match the CPU's (cosine, with a control that has the power to fail); steps move the adapters
//! and the merged weights but not the embedding or the norms; a trainer resumed from the adapters, moments and step
//! count continues bit for bit; and `lora_memory` is every byte it allocates. Llama (untied and tied), Qwen2 (q/k/v
//! biases) and a head_dim-128 Llama.

use candle_core::{Device, Tensor, Var};
use tlt_cuda_sim::{Schedule, SimGpu};
use tlt_kernels::cuda::{gpu, SharedGpu};
use tlt_model::cuda::train::{
    embedding_and_head, lora_memory, Arena, CudaLoraTrainer, LoraConfig, TrainBatch, TrainOptions,
};
use tlt_model::cuda::CudaLlama;
use tlt_model::optim::AdamWParams;
use tlt_model::{Llama, LlamaConfig};

const VOCAB: usize = 96;
const PAIRS: [(&[u32], &[u32]); 3] =
    [(&[3, 1, 4, 1], &[7, 9, 3, 2, 3]), (&[5, 9, 2, 6, 5, 3], &[8, 4, 6]), (&[8, 9], &[2, 6, 4, 3, 3, 8, 3])];
const LORA: LoraConfig = LoraConfig { rank: 4, alpha: 8.0 };

fn model(variant: &str) -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB, 64, 2);
    cfg.intermediate_size = 96;
    match variant {
        "llama" => {}
        "tied" => cfg.tie_word_embeddings = true,
        "qwen2" => cfg.model_type = "qwen2".into(),
        "head_dim_128" => {
            cfg.num_attention_heads = 2;
            cfg.num_key_value_heads = Some(1);
            cfg.head_dim = Some(128);
        }
        other => panic!("no variant {other}"),
    }
    Llama::random(cfg, 7).unwrap().rounded_to_bf16().unwrap()
}

fn options() -> TrainOptions {
    TrainOptions { max_rows: 32, ..TrainOptions::new(32) }
}

/// Random adapters for every PEFT name of `t`, rounded to bf16 (the device's GEMMs read bf16 copies; the CPU then
/// uses the same values).
fn adapters(t: &CudaLoraTrainer, seed: u64) -> Vec<(String, Vec<f32>)> {
    let mut rng = tlt_kernels::SplitMix64::new(seed);
    t.params()
        .iter()
        .map(|p| {
            let v = (0..p.range.len())
                .map(|_| half::bf16::from_f64((rng.next_f64() - 0.5) * 0.2).to_f32())
                .collect::<Vec<f32>>();
            (p.name.clone(), v)
        })
        .collect()
}

/// The CPU model with every linear's weight `W + s · B · A` (`A`, `B` trainable), and the adapters by PEFT name.
fn cpu_lora(
    base: &Llama,
    named: &[(String, Vec<f32>)],
    shapes: &[(String, [usize; 2])],
) -> (Llama, Vec<(String, Var)>) {
    let mut w = base.weights().clone();
    let mut vars = Vec::new();
    let s = LORA.scale();
    for (l, layer) in w.layers.iter_mut().enumerate() {
        for (module, lin) in layer.proj.named_mut() {
            let var = |which: &str| {
                let name = format!("base_model.model.model.layers.{l}.{module}.{which}.weight");
                let values = &named.iter().find(|(n, _)| *n == name).unwrap().1;
                let shape = shapes.iter().find(|(n, _)| *n == name).unwrap().1;
                (
                    name,
                    Var::from_tensor(&Tensor::from_vec(values.clone(), (shape[0], shape[1]), &Device::Cpu).unwrap())
                        .unwrap(),
                )
            };
            let (an, a) = var("lora_A");
            let (bn, b) = var("lora_B");
            let delta = (b.as_tensor().matmul(a.as_tensor()).unwrap() * s).unwrap();
            lin.weight = (&lin.weight + delta).unwrap();
            vars.push((an, a));
            vars.push((bn, b));
        }
    }
    (Llama::new(base.config().clone(), w).unwrap(), vars)
}

/// Per response row, the loss's weight on its log-probability: `adv_s / tokens` with advantages `adv`.
fn row_weights(adv: [f32; 3]) -> Vec<f32> {
    let tokens: usize = PAIRS.iter().map(|(_, r)| r.len()).sum();
    PAIRS.iter().zip(adv).flat_map(|((_, r), a)| std::iter::repeat_n(-a / tokens as f32, r.len())).collect()
}

/// The CPU's response log-probabilities and `loss = sum_rows w_r logp_r`.
fn cpu_loss(model: &Llama, adv: [f32; 3]) -> (Vec<f32>, Tensor) {
    let weights = row_weights(adv);
    let (mut logps, mut loss, mut at) = (Vec::new(), Tensor::new(0f32, &Device::Cpu).unwrap(), 0);
    for (p, r) in PAIRS {
        let ids: Vec<u32> = p.iter().chain(r.iter()).take(p.len() + r.len() - 1).copied().collect();
        let mut targets = vec![0u32; ids.len()];
        targets[p.len() - 1..].copy_from_slice(r);
        let n = ids.len();
        let ids = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
        let targets = Tensor::from_vec(targets, (1, n), &Device::Cpu).unwrap();
        let lp =
            model.token_logprobs(&ids, &targets).unwrap().squeeze(0).unwrap().narrow(0, p.len() - 1, r.len()).unwrap();
        logps.extend(lp.to_vec1::<f32>().unwrap());
        let w = Tensor::from_vec(weights[at..at + r.len()].to_vec(), r.len(), &Device::Cpu).unwrap();
        loss = (loss + (lp * w).unwrap().sum_all().unwrap()).unwrap();
        at += r.len();
    }
    (logps, loss)
}

/// The device's response log-probabilities after a forward, then the backward of the same loss.
fn device_pass(t: &mut CudaLoraTrainer, m: &CudaLlama, adv: [f32; 3]) -> Vec<f32> {
    let batch = TrainBatch::responses(&PAIRS, VOCAB).unwrap();
    let (logp, _) = t.forward(m, &batch, 1.0, false).unwrap();
    let (weights, mut g) = (row_weights(adv), vec![0f32; logp.len()]);
    let rows: Vec<usize> = batch.scored_rows().collect();
    for (&r, w) in rows.iter().zip(weights) {
        g[r] = w;
    }
    t.backward(m, &g, None).unwrap();
    rows.iter().map(|&r| logp[r]).collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
    let n = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b)).max(f64::MIN_POSITIVE)
}

const ADV: [f32; 3] = [1.0, -0.5, 0.7];

fn parity(variant: &str, dev: &SharedGpu) {
    let base = model(variant);
    let mut gpu = CudaLlama::new(&base, dev.clone(), 1, 64).unwrap();
    let mut t = CudaLoraTrainer::new(&gpu, LORA, AdamWParams::default(), &options(), 3).unwrap();
    let base_logp = {
        t.zero_grad().unwrap();
        device_pass(&mut t, &gpu, ADV)
    };
    let named = adapters(&t, 11);
    t.load_peft(Arena::Master, &named).unwrap();
    t.merge(&mut gpu).unwrap();
    let shapes: Vec<(String, [usize; 2])> = t.params().iter().map(|p| (p.name.clone(), p.shape)).collect();
    let (cpu, vars) = cpu_lora(&base, &named, &shapes);
    let (cpu_logp, loss) = cpu_loss(&cpu, ADV);
    t.zero_grad().unwrap();
    let dev_logp = device_pass(&mut t, &gpu, ADV);
    let rel = |a: f32, b: f32| (a - b).abs() / (1.0 + b.abs());
    let worst = cpu_logp.iter().zip(&dev_logp).map(|(&a, &b)| rel(a, b)).fold(0f32, f32::max);
    let moved = base_logp.iter().zip(&dev_logp).map(|(&a, &b)| rel(a, b)).fold(0f32, f32::max);
    assert!(worst <= 0.02, "{variant}: merged log-probabilities {worst} from the CPU's LoRA forward");
    // Control: the adapters move the log-probabilities far more than the bf16 tolerance (Qwen2's bias rounding
    // alone is 1.3% apart from the CPU, as for the full model's training forward).
    assert!(moved > 0.05 && moved > 4.0 * worst, "{variant}: the adapters moved the log-probabilities by {moved} only");
    // Gradients: the device holds the products without the scale (its step applies it).
    let store = loss.backward().unwrap();
    let s = LORA.scale() as f32;
    let dev = t.peft_named(&t.arena_to_host(Arena::Grad).unwrap()).unwrap();
    let (mut all_dev, mut all_cpu, mut worst_cos) = (Vec::new(), Vec::new(), 1f64);
    for (name, var) in &vars {
        let want = store.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let got: Vec<f32> = dev.iter().find(|(n, _, _)| n == name).unwrap().2.iter().map(|x| x * s).collect();
        let c = cosine(&got, &want);
        worst_cos = worst_cos.min(c);
        assert!(c >= 0.99, "{variant}: {name}: gradient cosine {c}");
        all_dev.extend(got);
        all_cpu.extend(want);
    }
    let c = cosine(&all_dev, &all_cpu);
    let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let ratio = norm(&all_dev) / norm(&all_cpu);
    let other = cpu_loss(&cpu, [ADV[0], ADV[1], 0.4]).1.backward().unwrap();
    let other: Vec<f32> = vars
        .iter()
        .flat_map(|(_, v)| other.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    let c_other = cosine(&all_dev, &other);
    assert!(c_other < 0.999, "{variant}: the control's cosine {c_other} passes: the test has no power");
    assert!(c >= 0.999, "{variant}: adapter gradient cosine {c}");
    assert!((ratio - 1.0).abs() <= 0.05, "{variant}: gradient norms {ratio} apart");
    println!(
        "{variant}: merged logp within {worst:.4} of the CPU's LoRA forward (moved {moved:.3} from the base); adapter \
         gradients cosine {c:.6} (worst tensor {worst_cos:.5}), norm ratio {ratio:.4}, control {c_other:.4}"
    );
}

#[test]
fn lora_matches_the_cpus_autograd() {
    for dev in super::devices("lora_matches_the_cpus_autograd") {
        for variant in ["llama", "tied", "qwen2", "head_dim_128"] {
            parity(variant, &dev);
        }
    }
}

/// Two LoRA steps move the adapters and the merged weights; the embedding and every norm stay; a trainer built
/// afresh and given the adapters, moments and step count continues with the same bits as the one that ran on.
#[test]
fn lora_steps_train_only_the_adapters_and_resume_bit_for_bit() {
    let dev = super::devices("lora_steps_train_only_the_adapters").remove(0);
    let base = model("tied");
    let hp = AdamWParams { weight_decay: 0.01, ..AdamWParams::default() };
    let mut gpu = CudaLlama::new(&base, dev.clone(), 1, 64).unwrap();
    let mut t = CudaLoraTrainer::new(&gpu, LORA, hp, &options(), 5).unwrap();
    let embed = |m: &CudaLlama| gpu::read(dev.as_ref(), embedding_and_head(m).0).unwrap();
    let logits = |m: &mut CudaLlama| {
        let seq = tlt_model::cuda::DeviceSeq { slot: 0, prefix_len: 0, tokens: PAIRS[1].0, parents: None };
        let out = m.forward(&[seq]).unwrap();
        m.logits_to_host(&out).unwrap()
    };
    let (embed0, logits0, adapters0) = (embed(&gpu), logits(&mut gpu), t.arena_to_host(Arena::Master).unwrap());
    let step = |t: &mut CudaLoraTrainer, m: &mut CudaLlama| {
        t.zero_grad().unwrap();
        device_pass(t, m, ADV);
        assert!(t.step(m, 0.01, Some(1.0)).unwrap().applied());
    };
    for _ in 0..2 {
        step(&mut t, &mut gpu);
    }
    let adapters2 = t.arena_to_host(Arena::Master).unwrap();
    assert_eq!(embed(&gpu), embed0, "the embedding is frozen");
    assert_ne!(adapters2, adapters0, "two steps left the adapters");
    let logits2 = logits(&mut gpu);
    assert_ne!(logits2, logits0, "the merged weights did not change the decoder");
    // The trained adapters as PEFT names them, merged on the CPU in f32: the device decoder's logits within bf16
    // tolerance (what `save_peft_dir` writes and `peft` loads: `tests/peft.rs`).
    let trained = t.peft_named(&adapters2).unwrap();
    let cpu = tlt_model::peft::merge_peft(&base, &LORA, &trained).unwrap();
    let ids = Tensor::from_vec(PAIRS[1].0.to_vec(), (1, PAIRS[1].0.len()), &Device::Cpu).unwrap();
    let cpu_logits = cpu.forward_train(&ids).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let v = VOCAB;
    let last = &cpu_logits[cpu_logits.len() - v..];
    let p = tlt_model::device_step::row_parity(&logits2[logits2.len() - v..], last, 0.1);
    assert!(p.argmax_equal && p.rel_diff <= 0.05, "the PEFT-merged CPU model against the device decoder: {p:?}");

    // Resume: a fresh trainer (another seed) given the state of the first.
    let mut gpu_b = CudaLlama::new(&base, dev.clone(), 1, 64).unwrap();
    let mut b = CudaLoraTrainer::new(&gpu_b, LORA, hp, &options(), 99).unwrap();
    for a in [Arena::Master, Arena::ExpAvg, Arena::ExpAvgSq] {
        let named: Vec<(String, Vec<f32>)> =
            t.peft_named(&t.arena_to_host(a).unwrap()).unwrap().into_iter().map(|(n, _, v)| (n, v)).collect();
        b.load_peft(a, &named).unwrap();
    }
    b.set_steps(t.steps());
    b.merge(&mut gpu_b).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&logits(&mut gpu_b)), bits(&logits2), "the resumed decoder's logits");
    step(&mut t, &mut gpu);
    step(&mut b, &mut gpu_b);
    assert_eq!(bits(&b.arena_to_host(Arena::Master).unwrap()), bits(&t.arena_to_host(Arena::Master).unwrap()));
    assert_eq!(bits(&logits(&mut gpu_b)), bits(&logits(&mut gpu)), "the resumed run's next step");
    // Control: without the moments the next step differs.
    let mut c = CudaLoraTrainer::new(&gpu_b, LORA, hp, &options(), 99).unwrap();
    let named: Vec<(String, Vec<f32>)> =
        t.peft_named(&adapters2).unwrap().into_iter().map(|(n, _, v)| (n, v)).collect();
    c.load_peft(Arena::Master, &named).unwrap();
    c.set_steps(2);
    let mut gpu_c = CudaLlama::new(&base, dev, 1, 64).unwrap();
    c.merge(&mut gpu_c).unwrap();
    step(&mut c, &mut gpu_c);
    assert_ne!(bits(&c.arena_to_host(Arena::Master).unwrap()), bits(&t.arena_to_host(Arena::Master).unwrap()));
}

#[test]
fn lora_memory_counts_every_allocation() {
    let sim = SimGpu::new(Schedule::Lazy);
    let dev: SharedGpu = std::sync::Arc::new(sim.clone());
    for variant in ["llama", "tied", "qwen2", "head_dim_128"] {
        let gpu = CudaLlama::new(&model(variant), dev.clone(), 1, 64).unwrap();
        for (lora, opts) in [(LORA, options()), (LoraConfig { rank: 1, alpha: 1.0 }, TrainOptions::new(200))] {
            let before = sim.live_bytes();
            let t = CudaLoraTrainer::new(&gpu, lora, AdamWParams::default(), &opts, 1).unwrap();
            let counted = sim.live_bytes() - before;
            let planned = lora_memory(gpu.config(), &lora, &opts) as u64;
            println!("{variant} {lora:?}: planned {planned} B, allocated {counted} B");
            assert_eq!(counted, planned, "{variant} {lora:?}");
            drop(t);
        }
    }
    let gpu = CudaLlama::new(&model("llama"), dev, 1, 64).unwrap();
    for bad in [
        LoraConfig { rank: 0, alpha: 1.0 },
        LoraConfig { rank: 4, alpha: 0.0 },
        LoraConfig { rank: 4, alpha: f64::NAN },
    ] {
        assert!(CudaLoraTrainer::new(&gpu, bad, AdamWParams::default(), &options(), 1).is_err(), "{bad:?}");
    }
}
