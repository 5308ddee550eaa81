//! The device decoder's step program ([`tlt_model::device_step::StepProgram`], what `CudaLlama` runs on a GPU)
//! executed on the simulated device (`tlt-cuda-sim`: our kernels as host C++, a column-major CPU GEMM standing in
//! for cuBLAS) against the CPU decoder on tiny Llama, Qwen2 (biases) and Qwen3 (q/k norms, decoupled head_dim)
//! models: a batched prefill, a decode step and a tree verification, all with bf16 weights, caches and activations.
//! Also counts the launches of one decode layer.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use candle_core::Tensor;
use half::bf16;
use tlt_cuda_sim::{SimBuf, SimDevice};
use tlt_kernels::cuda::plan::{Buf, GemmEx, Launch};
use tlt_kernels::cuda::CacheDims;
use tlt_kernels::AttnShape;
use tlt_model::device_step::{
    layout, row_parity, tree_rows_bucket, DeviceOps, DeviceSeq, LayerBufs, LinearBufs, StepBufs, StepLayout, StepMeta,
    StepProgram, WeightBufs, BF16_ROW_TOL,
};
use tlt_model::{Llama, LlamaConfig, LogitsFor, SeqInput};

/// The simulated device as a step program's executor, counting what it runs.
struct SimOps {
    dev: SimDevice,
    launches: Vec<&'static str>,
    gemms: usize,
}

fn sim_err(e: tlt_cuda_sim::Error) -> tlt_model::Error {
    tlt_model::Error::InvalidInput(e.to_string())
}

impl DeviceOps for SimOps {
    fn launch(&mut self, launch: &Launch) -> tlt_model::Result<()> {
        self.launches.push(launch.kernel);
        self.dev.launch(launch).map_err(sim_err)
    }

    fn gemm(&mut self, gemm: &GemmEx) -> tlt_model::Result<()> {
        self.gemms += 1;
        self.dev.gemm(gemm).map_err(sim_err)
    }

    fn copy_f32(&mut self, src: Buf<f32>, dst: Buf<f32>) -> tlt_model::Result<()> {
        self.dev.copy(src, dst).map_err(sim_err)
    }
}

/// A tiny random model of `model_type` whose weights are bf16 values (the device holds exactly them).
fn tiny(model_type: &str, seed: u64) -> Llama {
    let mut cfg = LlamaConfig::tiny(64, 64, 2);
    cfg.model_type = model_type.into();
    if model_type == "qwen3" {
        cfg.head_dim = Some(32);
    }
    Llama::random(cfg, seed).unwrap().rounded_to_bf16().unwrap()
}

/// Device memory of a test: keeps every buffer alive.
struct Mem {
    dev: SimDevice,
    bf16: Vec<SimBuf<bf16>>,
    f32: Vec<SimBuf<f32>>,
    other: Vec<SimBuf<f64>>,
    bytes: Vec<SimBuf<u8>>,
}

impl Mem {
    fn bf(&mut self, t: &Tensor) -> Buf<bf16> {
        let v: Vec<bf16> = t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(bf16::from_f32).collect();
        self.bf16.push(self.dev.upload(&v));
        self.bf16.last().unwrap().buf()
    }

    fn zeros_bf(&mut self, n: usize) -> Buf<bf16> {
        self.bf16.push(self.dev.zeros(n));
        self.bf16.last().unwrap().buf()
    }

    fn zeros_f(&mut self, n: usize) -> Buf<f32> {
        self.f32.push(self.dev.zeros(n));
        self.f32.last().unwrap().buf()
    }
}

/// Rows of `parts` stacked (the fused projections' weights and biases, as `CudaLlama` uploads them).
fn stack(parts: &[&Tensor]) -> Tensor {
    Tensor::cat(parts, 0).unwrap()
}

fn weights(mem: &mut Mem, m: &Llama) -> WeightBufs {
    let w = m.weights();
    let layers = w
        .layers
        .iter()
        .map(|l| {
            let p = &l.proj;
            let mut fused = |lins: &[&tlt_model::Linear]| {
                let ws: Vec<&Tensor> = lins.iter().map(|x| &x.weight).collect();
                let bs: Option<Vec<&Tensor>> = lins.iter().map(|x| x.bias.as_ref()).collect();
                let weight = stack(&ws);
                let (out, inp) = weight.dims2().unwrap();
                LinearBufs { w: mem.bf(&weight), b: bs.map(|b| mem.bf(&stack(&b))), out, inp }
            };
            let qkv = fused(&[&p.q_proj, &p.k_proj, &p.v_proj]);
            let o = fused(&[&p.o_proj]);
            let gate_up = fused(&[&p.gate_proj, &p.up_proj]);
            let down = fused(&[&p.down_proj]);
            LayerBufs {
                in_norm: mem.bf(&l.input_layernorm),
                post_norm: mem.bf(&l.post_attention_layernorm),
                qkv,
                o,
                gate_up,
                down,
                qk_norm: l.qk_norm.as_ref().map(|n| (mem.bf(&n.q_norm), mem.bf(&n.k_norm))),
            }
        })
        .collect();
    let inv = mem.dev.upload(&m.config().rope_inv_freq());
    mem.other.push(inv);
    WeightBufs {
        embed: mem.bf(&w.embed_tokens),
        head: w.lm_head.as_ref().map(|h| mem.bf(h)),
        norm: mem.bf(&w.norm),
        layers,
        inv_freq: mem.other.last().unwrap().buf(),
    }
}

/// Step buffers for `l`, its metadata written as `CudaLlama` writes it (padding rows slot-less).
fn step_bufs(mem: &mut Mem, program: &StepProgram<'_>, l: &StepLayout, batch: usize) -> StepBufs {
    let cfg = program.cfg;
    let rows = batch * l.n_max;
    // The metadata packed as `CudaLlama` packs it (one buffer, one copy), padding rows slot-less.
    let meta = StepMeta::new(batch, l.n_max, l.anc.is_some());
    let mut host = vec![0u8; meta.bytes()];
    meta.write(l, &mut host).unwrap();
    mem.bytes.push(mem.dev.upload(&host));
    let meta = meta.bufs(mem.bytes.last().unwrap().buf()).unwrap();
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let tree = tlt_kernels::cuda::TreeDims { batch, n_max: l.n_max };
    let (po, pml) = program.chunks(batch, l.n_max).part_lens(tree, cfg.num_attention_heads, cfg.head_dim());
    StepBufs {
        batch,
        n_max: l.n_max,
        meta,
        x: mem.zeros_f(rows * h),
        xn: mem.zeros_bf(rows * h),
        qkv: mem.zeros_bf(rows * (cfg.q_dim() + 2 * cfg.kv_dim())),
        q: mem.zeros_bf(rows * cfg.q_dim()),
        attn: mem.zeros_bf(rows * cfg.q_dim()),
        parts: (mem.zeros_f(po), mem.zeros_f(pml)),
        o: mem.zeros_bf(rows * h),
        gate_up: mem.zeros_bf(rows * 2 * i),
        act: mem.zeros_bf(rows * i),
        logits: mem.zeros_f(rows * cfg.vocab_size),
        taps: Vec::new(),
    }
}

fn read_f32(mem: &Mem, b: Buf<f32>) -> Vec<f32> {
    mem.f32.iter().find(|x| x.buf() == b).unwrap().download()
}

/// The largest |device - cpu| over `rows` pairs in CPU row standard deviations, and whether every row passes
/// ([`row_parity`]: the argmax agrees unless the CPU row is a near tie, within 0.1 std).
fn compare(dev: &[&[f32]], cpu: &[Vec<f32>]) -> (f32, bool) {
    let rows: Vec<_> = dev.iter().zip(cpu).map(|(d, c)| row_parity(d, c, 0.1)).collect();
    (rows.iter().map(|p| p.rel_diff).fold(0f32, f32::max), rows.iter().all(|p| p.argmax_equal || p.near_tie))
}

#[test]
fn the_step_program_on_the_simulated_device_matches_the_cpu_decoder() {
    for arch in ["llama", "qwen2", "qwen3"] {
        let cpu = tiny(arch, 7);
        let cfg = cpu.config().clone();
        let dev = SimDevice::new();
        let mut mem = Mem { dev: dev.clone(), bf16: vec![], f32: vec![], other: vec![], bytes: vec![] };
        let w = weights(&mut mem, &cpu);
        let attn = AttnShape::new(cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let cache = CacheDims { layers: cfg.num_hidden_layers, slots: 2, max_len: 512, attn };
        let (kc, vc) = (mem.zeros_bf(cache.len()), mem.zeros_bf(cache.len()));
        // As many key chunks as allowed (4 of 128 over 512 positions): sequence a's 150 keys span two of them, so
        // the split kernel's combine merges chunks, and skips empty ones.
        let program =
            StepProgram { cfg: &cfg, cache, k_cache: kc, v_cache: vc, w: &w, layer_taps: &[], target_blocks: 1 << 20 };
        assert_eq!(program.chunks(2, 1).n_splits, 4);
        let mut ops = SimOps { dev: dev.clone(), launches: vec![], gemms: 0 };
        // `padded`: as `CudaLlama` runs trees under graphs, rows bucketed to a power of two and one more sequence
        // of padding (a graph bucket's).
        let mut run = |mem: &mut Mem, seqs: &[DeviceSeq<'_>], padded: bool| {
            let mut l = layout(seqs, cfg.vocab_size, cache.slots, cache.max_len).unwrap();
            if padded {
                l = l.padded_to(tree_rows_bucket(l.n_max)).unwrap();
            }
            let b = step_bufs(mem, &program, &l, seqs.len() + usize::from(padded));
            program.record(&mut ops, &b).unwrap();
            (read_f32(mem, b.logits), l.n_max)
        };

        // CPU side: two sequences.
        let (pa, pb): (Vec<u32>, Vec<u32>) = ((0..150).map(|i| (i * 7 + 1) % 64).collect(), vec![40, 3, 17, 9, 22]);
        let mut cc = cpu.new_cache();
        let (sa, sb) = (cc.add_sequence(), cc.add_sequence());
        let pre = |cc: &mut tlt_model::KvCache, seq, t: &[u32]| {
            let inp = [SeqInput { seq, tokens: t, tree: None, logits: LogitsFor::All }];
            cpu.forward(cc, &inp, &[]).unwrap().logits.to_vec2::<f32>().unwrap()
        };
        let (ca, cb) = (pre(&mut cc, sa, &pa), pre(&mut cc, sb, &pb));

        // 1. A batched prefill of both prompts (a causal chunk each).
        let seqs = [
            DeviceSeq { slot: 0, prefix_len: 0, tokens: &pa, parents: None },
            DeviceSeq { slot: 1, prefix_len: 0, tokens: &pb, parents: None },
        ];
        let (logits, n_max) = run(&mut mem, &seqs, false);
        let v = cfg.vocab_size;
        let row = |r: usize| &logits[r * v..(r + 1) * v];
        let dev_rows: Vec<&[f32]> = (0..pa.len()).map(row).chain((0..pb.len()).map(|j| row(n_max + j))).collect();
        let cpu_rows: Vec<Vec<f32>> = ca.iter().chain(&cb).cloned().collect();
        let (prefill, ok1) = compare(&dev_rows, &cpu_rows);

        // 2. One decode step of both.
        let (ta, tb) = ([11u32], [5u32]);
        let seqs = [
            DeviceSeq { slot: 0, prefix_len: pa.len(), tokens: &ta, parents: None },
            DeviceSeq { slot: 1, prefix_len: pb.len(), tokens: &tb, parents: None },
        ];
        let (logits, _) = run(&mut mem, &seqs, false);
        let dec = cpu.decode(&mut cc, &[(sa, ta[0]), (sb, tb[0])]).unwrap().to_vec2::<f32>().unwrap();
        let (decode, ok2) = compare(&[&logits[..v], &logits[v..2 * v]], &dec);

        // 3. A draft tree of 5 nodes after sequence a's committed tokens, run padded (8 rows, a padding sequence).
        let (tree_tok, parents) = ([30u32, 2, 8, 44, 1], [-1i32, 0, 0, 1, 1]);
        let seqs = [DeviceSeq { slot: 0, prefix_len: pa.len() + 1, tokens: &tree_tok, parents: Some(&parents) }];
        let (logits, n_max) = run(&mut mem, &seqs, true);
        assert_eq!(n_max, 8);
        let cpu_parents: Vec<Option<usize>> = parents.iter().map(|&p| usize::try_from(p).ok()).collect();
        let inp = [SeqInput { seq: sa, tokens: &tree_tok, tree: Some(&cpu_parents), logits: LogitsFor::All }];
        let ver = cpu.forward(&mut cc, &inp, &[]).unwrap().logits.to_vec2::<f32>().unwrap();
        let dev_rows: Vec<&[f32]> = (0..tree_tok.len()).map(|r| &logits[r * v..(r + 1) * v]).collect();
        let (verify, ok3) = compare(&dev_rows, &ver);

        // Negative control: the same tree verified without its ancestor masks (a causal chunk) is off by far more.
        if arch == "llama" {
            let seqs = [DeviceSeq { slot: 0, prefix_len: pa.len() + 1, tokens: &tree_tok, parents: None }];
            let (wrong, _) = run(&mut mem, &seqs, false);
            let rows: Vec<&[f32]> = (0..tree_tok.len()).map(|r| &wrong[r * v..(r + 1) * v]).collect();
            let (off, _) = compare(&rows, &ver);
            println!("negative control: the tree read as a causal chunk is off by {off:.3} row std");
            assert!(off > BF16_ROW_TOL, "a masking error went unnoticed ({off})");
        }
        println!(
            "{arch}: device (bf16) vs CPU (f32) logits, max |diff| / row std: prefill {prefill:.3}, decode {decode:.3}, verify {verify:.3}; argmax {}",
            if ok1 && ok2 && ok3 { "agrees" } else { "DIFFERS" }
        );
        // bf16 weights are exact on both sides; what differs is bf16 activations, caches and GEMM outputs on the
        // device (7 significant bits: 2^-8 relative per rounding, a few dozen roundings deep through 2 layers).
        let tol = BF16_ROW_TOL;
        assert!(prefill < tol && decode < tol && verify < tol, "{arch}: {prefill} {decode} {verify}");
        assert!(ok1 && ok2 && ok3, "{arch}: argmax differs on a row with a clear margin");
    }
}

/// Launches (kernels and GEMMs) of one decode step, per decoder layer, on the simulated device: at most 10 with
/// split attention's combine (a 4,096-position cache at batch 1 splits the keys into chunks).
#[test]
fn launches_per_decode_layer() {
    for arch in ["llama", "qwen2", "qwen3"] {
        let cpu = tiny(arch, 3);
        let cfg = cpu.config().clone();
        let dev = SimDevice::new();
        let mut mem = Mem { dev: dev.clone(), bf16: vec![], f32: vec![], other: vec![], bytes: vec![] };
        let w = weights(&mut mem, &cpu);
        let attn = AttnShape::new(cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let cache = CacheDims { layers: cfg.num_hidden_layers, slots: 1, max_len: 4096, attn };
        let (kc, vc) = (mem.zeros_bf(cache.len()), mem.zeros_bf(cache.len()));
        let program =
            StepProgram { cfg: &cfg, cache, k_cache: kc, v_cache: vc, w: &w, layer_taps: &[], target_blocks: 264 };
        assert!(program.chunks(1, 1).n_splits > 1, "the case must exercise the combine");
        let tok = [3u32];
        let l = layout(&[DeviceSeq { slot: 0, prefix_len: 4, tokens: &tok, parents: None }], 64, 1, 4096).unwrap();
        let b = step_bufs(&mut mem, &program, &l, 1);
        let mut ops = SimOps { dev, launches: vec![], gemms: 0 };
        program.record(&mut ops, &b).unwrap();
        // Outside the layers: the embedding, the first layer's input norm and the LM head's GEMM.
        let total = ops.launches.len() + ops.gemms;
        let layers = cfg.num_hidden_layers;
        assert_eq!((total - 3) % layers, 0);
        let per_layer = (total - 3) / layers;
        let kernels: Vec<&str> = ops.launches[2..2 + (ops.launches.len() - 2) / layers].to_vec();
        println!("{arch} decode: {per_layer} launches per layer: {} GEMMs and {kernels:?}", per_layer - kernels.len());
        assert_eq!(per_layer, 10, "{arch}: launches per decode layer");
    }
}
