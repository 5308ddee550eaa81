//! Criterion benchmarks of the hot kernels at SmolLM2-135M sizes: skinny GEMM, tree attention and sampling.

#![allow(missing_docs, clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tlt_kernels::{gemm, probs, tree_attention_with, AttnShape, Isa, Matrix, SamplingParams, Visibility, WeightDType};

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    tlt_kernels::SeededRng::new(seed).uniform_vec(n, -1.0, 1.0)
}

fn bench_gemm(c: &mut Criterion) {
    let (n, k) = (1536, 576);
    let w = values(n * k, 1);
    let mut g = c.benchmark_group("gemm");
    for dtype in [WeightDType::F32, WeightDType::Q8_0, WeightDType::Q4_0] {
        let mat = Matrix::from_f32(n, k, &w, dtype).unwrap();
        for m in [1usize, 8] {
            let x = values(m * k, 2);
            let mut y = vec![0.0; m * n];
            g.throughput(Throughput::Bytes(mat.view().bytes() as u64));
            g.bench_with_input(BenchmarkId::new(format!("{dtype:?}_{n}x{k}"), m), &m, |b, &m| {
                b.iter(|| gemm(black_box(&x), m, mat.view(), None, &mut y).unwrap())
            });
        }
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let shape = AttnShape::new(9, 3, 64); // SmolLM2-135M
    let base = 256;
    let mut g = c.benchmark_group("tree_attention");
    // n = 1: plain decode; n = 8: a binary-ish draft tree; n = 48: a wide one (every node gathers its own
    // ancestors); a 256-token prefill chunk.
    let tree: Vec<Option<usize>> = vec![None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(3), Some(6)];
    let wide: Vec<Option<usize>> = (0..48).map(|i: usize| i.checked_sub(1).map(|p| p / 3)).collect();
    for (name, n, vis) in [
        ("decode", 1usize, Visibility::Causal),
        ("tree", 8, Visibility::Tree(&tree)),
        ("tree", 48, Visibility::Tree(&wide)),
        ("prefill", 256, Visibility::Causal),
    ] {
        let q = values(n * shape.q_width(), 3);
        let keys = values((base + n) * shape.kv_width(), 4);
        let vals = values((base + n) * shape.kv_width(), 5);
        let mut out = vec![0.0; n * shape.q_width()];
        for isa in Isa::available() {
            g.bench_function(BenchmarkId::new(name, format!("ctx{base}_n{n}_{}", isa.name())), |b| {
                b.iter(|| {
                    tree_attention_with(isa, black_box(&q), &keys, &vals, base, vis, shape, 0.125, &mut out).unwrap()
                })
            });
        }
    }
    g.finish();
}

fn bench_sampling(c: &mut Criterion) {
    let logits: Vec<f32> = values(49152, 6).iter().map(|x| x * 8.0).collect();
    let mut g = c.benchmark_group("sampling");
    let params = SamplingParams { temperature: 0.7, top_k: None, top_p: Some(0.9) };
    g.bench_function("probs_top_p_49152", |b| b.iter(|| probs(black_box(&logits), &params).unwrap()));
    let plain = SamplingParams::default();
    g.bench_function("probs_plain_49152", |b| b.iter(|| probs(black_box(&logits), &plain).unwrap()));
    g.finish();
}

criterion_group!(benches, bench_gemm, bench_attention, bench_sampling);
criterion_main!(benches);
