//! The device trainer's memory options: activation checkpointing gives the resident pass's log-probabilities and
//! gradients bit for bit; the LM head in row chunks gives its log-probabilities bit for bit and its gradients within
//! f32 rounding (the head's weight gradient sums its rows in chunks; every other gradient is the same bits); and
//! `train_memory` counts exactly the bytes the trainer allocates on the simulated device.

use tlt_cuda_sim::{Schedule, SimGpu};
use tlt_kernels::cuda::SharedGpu;
use tlt_model::cuda::train::{train_memory, Arena, CudaTrainer, TrainBatch, TrainOptions};
use tlt_model::cuda::CudaLlama;
use tlt_model::optim::AdamWParams;
use tlt_model::{Llama, LlamaConfig};

const VOCAB: usize = 96;

/// Prompts and responses: 26 rows, so a head chunk of 4 rows runs 7 chunks, the last one short.
const PAIRS: [(&[u32], &[u32]); 3] =
    [(&[3, 1, 4, 1], &[7, 9, 3, 2, 3]), (&[5, 9, 2, 6, 5, 3], &[8, 4, 6]), (&[8, 9], &[2, 6, 4, 3, 3, 8, 3])];

fn model(model_type: &str, tied: bool) -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB, 64, 3);
    cfg.model_type = model_type.into();
    cfg.intermediate_size = 96;
    cfg.tie_word_embeddings = tied;
    cfg.attention_bias = model_type == "qwen2";
    Llama::random(cfg, 11).unwrap().rounded_to_bf16().unwrap()
}

/// One pass's log-probabilities, entropies and every gradient (HF names), with a loss that weighs each row's
/// log-probability by `scale` times a fixed pattern and its entropy by 0.01.
struct Pass {
    logp: Vec<f32>,
    entropy: Vec<f32>,
    grads: Vec<(String, Vec<f32>)>,
}

fn pass(dev: &SharedGpu, base: &Llama, opts: &TrainOptions, scale: f32) -> Pass {
    let gpu = CudaLlama::new(base, dev.clone(), 1, 64).unwrap();
    let mut trainer = CudaTrainer::with_options(&gpu, AdamWParams::default(), opts).unwrap();
    let batch = TrainBatch::responses(&PAIRS, VOCAB).unwrap();
    trainer.zero_grad().unwrap();
    let (logp, entropy) = trainer.forward(&gpu, &batch, 0.9, true).unwrap();
    let g: Vec<f32> = (0..logp.len()).map(|r| scale * ((r % 5) as f32 - 2.0) / 26.0).collect();
    let g_ent = vec![0.01; logp.len()];
    trainer.backward(&gpu, &g, Some(&g_ent)).unwrap();
    let grads = trainer.hf_named(&trainer.arena_to_host(Arena::Grad).unwrap()).unwrap();
    Pass { logp, entropy: entropy.unwrap(), grads }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The largest difference of two gradients relative to the larger one's largest element.
fn rel_gap(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().chain(b).fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn options(checkpoint: bool, head_rows: usize) -> TrainOptions {
    TrainOptions { max_rows: 32, checkpoint, head_rows }
}

fn equal_passes(model_type: &str, tied: bool, dev: &SharedGpu) {
    let base = model(model_type, tied);
    let resident = pass(dev, &base, &options(false, 32), 1.0);
    let checkpointed = pass(dev, &base, &options(true, 32), 1.0);
    let what = format!("{model_type} (tied {tied})");
    assert!(same_bits(&resident.logp, &checkpointed.logp), "{what}: checkpointing changed the log-probabilities");
    for ((name, a), (_, b)) in resident.grads.iter().zip(&checkpointed.grads) {
        assert!(same_bits(a, b), "{what}: checkpointing changed the gradient of {name}");
    }
    // The head in 7 chunks of 4 rows, with and without checkpointing.
    let head_grads = ["lm_head.weight", if tied { "model.embed_tokens.weight" } else { "lm_head.weight" }];
    let mut worst = 0f32;
    for chunked in [pass(dev, &base, &options(false, 4), 1.0), pass(dev, &base, &options(true, 4), 1.0)] {
        assert!(same_bits(&resident.logp, &chunked.logp), "{what}: a chunked head changed the log-probabilities");
        assert!(same_bits(&resident.entropy, &chunked.entropy), "{what}: a chunked head changed the entropies");
        for ((name, a), (_, b)) in resident.grads.iter().zip(&chunked.grads) {
            if head_grads.contains(&name.as_str()) {
                let gap = rel_gap(a, b);
                worst = worst.max(gap);
                assert!(gap <= 1e-5, "{what}: {name} with a chunked head is {gap:e} apart");
            } else {
                assert!(same_bits(a, b), "{what}: a chunked head changed the gradient of {name}");
            }
        }
    }
    // Control: a loss 0.1% larger is told apart by both comparisons.
    let other = pass(dev, &base, &options(true, 4), 1.001);
    let head = |p: &Pass| p.grads.iter().find(|(n, _)| n == head_grads[1]).unwrap().1.clone();
    let control = rel_gap(&head(&resident), &head(&other));
    assert!(control > 1e-5, "{what}: the control's gap {control:e} passes the tolerance: the test has no power");
    let layer = |p: &Pass| p.grads.iter().find(|(n, _)| n.contains("layers.0.mlp.down")).unwrap().1.clone();
    assert!(!same_bits(&layer(&resident), &layer(&other)), "{what}: the control's layer gradient is the same bits");
    println!("{what}: checkpointed = resident bit for bit; chunked head within {worst:.1e} (control {control:.1e})");
}

#[test]
fn checkpointed_and_chunked_passes_equal_the_resident_one() {
    let devs = super::devices("checkpointed_and_chunked_passes_equal_the_resident_one");
    for dev in &devs {
        equal_passes("llama", false, dev);
        equal_passes("llama", true, dev);
        equal_passes("qwen2", false, dev);
    }
}

#[test]
fn train_memory_counts_every_allocation_of_the_trainer() {
    let sim = SimGpu::new(Schedule::Lazy);
    let dev: SharedGpu = std::sync::Arc::new(sim.clone());
    for (model_type, tied) in [("llama", false), ("llama", true), ("qwen2", false)] {
        let base = model(model_type, tied);
        let gpu = CudaLlama::new(&base, dev.clone(), 1, 64).unwrap();
        let weights = base.weights().num_params();
        for opts in [options(false, 32), options(true, 32), options(true, 4), TrainOptions::new(200)] {
            let before = sim.live_bytes();
            let trainer = CudaTrainer::with_options(&gpu, AdamWParams::default(), &opts).unwrap();
            let counted = sim.live_bytes() - before;
            let planned = train_memory(gpu.config(), weights, &opts) as u64;
            println!("{model_type} (tied {tied}) {opts:?}: planned {planned} B, allocated {counted} B");
            assert_eq!(counted, planned, "{model_type} (tied {tied}) {opts:?}");
            drop(trainer);
            assert_eq!(sim.live_bytes(), before, "the trainer's memory is freed with it");
        }
        // Control: the options move the count (checkpointing saves, a bigger head chunk costs).
        let bytes = |o: &TrainOptions| train_memory(gpu.config(), weights, o);
        assert!(bytes(&options(true, 32)) < bytes(&options(false, 32)));
        assert!(bytes(&options(true, 4)) < bytes(&options(true, 32)));
    }
}

#[test]
fn bad_train_options_are_errors() {
    let dev = super::devices("bad_train_options_are_errors").remove(0);
    let gpu = CudaLlama::new(&model("llama", false), dev, 1, 64).unwrap();
    for opts in [options(true, 0), TrainOptions { max_rows: 0, ..options(true, 4) }] {
        assert!(CudaTrainer::with_options(&gpu, AdamWParams::default(), &opts).is_err(), "{opts:?}");
    }
}
