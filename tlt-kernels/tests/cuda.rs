//! The CUDA path without and with a GPU.
//!
//! - NVRTC (no GPU needed): every source compiles for sm_80 and sm_90 with no register spills, and a broken source
//!   comes back as a compile error with its line. `cargo xtask test` fetches NVRTC from the pinned PyPI wheel and
//!   sets `TLT_REQUIRE_NVRTC=1`, so there a missing NVRTC fails instead of skipping.
//! - Without a driver: every entry point returns an error, never panics.
//! - With a driver (`cargo xtask test --gpu` sets `TLT_REQUIRE_GPU=1`): the kernels against the CPU kernels.
#![allow(clippy::unwrap_used, clippy::too_many_arguments)] // Tests: a panic is the failure report.

use tlt_kernels::cuda::{compile, driver_available, nvrtc_available, CudaGpu, KernelSource, CI_ARCHS, SOURCES};
use tlt_kernels::Error;

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// Whether NVRTC tests can run; panics when `TLT_REQUIRE_NVRTC=1` and it cannot be loaded.
fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_available() {
        return true;
    }
    assert!(!required("TLT_REQUIRE_NVRTC"), "TLT_REQUIRE_NVRTC=1 but libnvrtc.so.13 cannot be loaded");
    eprintln!("SKIP {test}: libnvrtc.so.13 is not on LD_LIBRARY_PATH (`cargo xtask test` provides it)");
    false
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_spills() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm80_and_sm90_without_spills") {
        return;
    }
    println!("| file | kernel | arch | registers | spill st/ld (B) | stack (B) | smem (B) |\n|---|---|---|---:|---:|---:|---:|");
    for source in SOURCES {
        for &arch in CI_ARCHS {
            let c = compile(source, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(!c.cubin.is_empty(), "{} sm_{arch}: empty CUBIN", source.file);
            for &name in source.kernels {
                let k = c
                    .kernels
                    .iter()
                    .find(|k| k.name == name)
                    .unwrap_or_else(|| panic!("{} sm_{arch}: no ptxas report for {name}:\n{}", source.file, c.log));
                assert_eq!(k.arch, format!("sm_{arch}"));
                println!(
                    "| {} | {name} | sm_{arch} | {} | {}/{} | {} | {} |",
                    source.file, k.registers, k.spill_stores, k.spill_loads, k.stack_bytes, k.shared_bytes
                );
                assert!(!k.spills(), "{} sm_{arch}: {name} spills registers: {k:?}", source.file);
                assert!(k.registers > 0 && k.registers <= 255, "{k:?}");
            }
            assert_eq!(c.kernels.len(), source.kernels.len(), "{}: unexpected kernels in\n{}", source.file, c.log);
        }
    }
}

#[test]
fn a_broken_source_is_a_compile_error_with_its_line() {
    if !nvrtc_or_skip("a_broken_source_is_a_compile_error_with_its_line") {
        return;
    }
    let broken = KernelSource {
        file: "broken.cu",
        text: "extern \"C\" __global__ void broken(float* x) {\n    x[0] = undefined_name;\n}\n",
        kernels: &["broken"],
    };
    match compile(&broken, 90) {
        Err(Error::CudaCompile { file, arch, log }) => {
            assert_eq!((file, arch), ("broken.cu", 90));
            assert!(log.contains("broken.cu(2)") && log.contains("undefined_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn without_a_driver_the_device_path_errors() {
    if driver_available() {
        eprintln!("SKIP without_a_driver_the_device_path_errors: a CUDA driver is present");
        return;
    }
    assert!(!required("TLT_REQUIRE_GPU"), "TLT_REQUIRE_GPU=1 but no CUDA driver can be loaded");
    match CudaGpu::open(0) {
        Err(Error::CudaUnavailable(m)) => assert!(m.contains("libcuda"), "{m}"),
        other => panic!("expected CudaUnavailable, got {other:?}"),
    }
}

#[path = "shared/split_chunks.rs"]
mod split_chunks;

mod gpu {
    //! Kernel results against the CPU kernels, on a GPU only (through the device seam, as the host code runs them;
    //! `tlt-cuda-sim` runs the same plans in CI).

    /// Split attention over several chunks against the CPU, its arrival counters zero after the launch and after
    /// two graph replays (the same body runs on the simulated device in `tlt-cuda-sim`'s kernel tests).
    #[test]
    fn split_attention_over_several_chunks_and_graph_replays() {
        let Some(g) = gpu_or_skip("split_attention_over_several_chunks_and_graph_replays") else { return };
        println!("{}", super::split_chunks::split_attention_over_several_chunks(g.as_ref()));
    }

    use half::bf16;
    use std::sync::Arc;
    use tlt_kernels::cuda::plan::{self, AcceptInBufs, AcceptOutBufs, RowBufs, SeqBufs};
    use tlt_kernels::cuda::{ancestor_masks, CacheDims, CudaGpu, DeviceBuf, Elem, Gpu, TreeDims};
    use tlt_kernels::{argmax, token_logprob_pmax, tree_attention, AttnShape, SamplingParams, SplitMix64, Visibility};

    fn gpu_or_skip(test: &str) -> Option<Arc<CudaGpu>> {
        if !tlt_kernels::cuda::gpu_or_skip(test).unwrap() {
            return None;
        }
        Some(CudaGpu::open(0).unwrap_or_else(|e| panic!("{e}")))
    }

    fn bf(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|&x| bf16::from_f32(x)).collect()
    }

    fn unbf(v: &[bf16]) -> Vec<f32> {
        v.iter().map(|&x| x.to_f32()).collect()
    }

    fn randn(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
        (0..n).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect()
    }

    fn up<T: Elem>(g: &dyn Gpu, v: &[T]) -> DeviceBuf<T> {
        DeviceBuf::from_host(g, v).unwrap()
    }

    /// RoPE + cache write, then tree attention, against the CPU tree attention on the same (bf16-rounded)
    /// inputs: one sequence with a committed prefix and a 6-node tree, GQA 9/3 heads of 64 (SmolLM2's shape).
    #[test]
    fn tree_attention_matches_the_cpu_kernel() {
        let Some(g) = gpu_or_skip("tree_attention_matches_the_cpu_kernel") else { return };
        let g: &dyn Gpu = g.as_ref();
        let shape = AttnShape::new(9, 3, 64);
        let cache = CacheDims { layers: 2, slots: 2, max_len: 64, attn: shape };
        let (prefix, parents) = (37usize, [-1i32, 0, 0, 1, 2, 4]);
        let n = parents.len();
        let mut rng = SplitMix64::new(7);
        let row = cache.row();
        // Keys/values of the whole sequence, already rotated (rope is checked separately below through q/k of the
        // new rows: here the new rows go through the kernel with position 0, where RoPE is the identity).
        let keys = unbf(&bf(&randn(&mut rng, (prefix + n) * row)));
        let vals = unbf(&bf(&randn(&mut rng, (prefix + n) * row)));
        let q = unbf(&bf(&randn(&mut rng, n * 9 * 64)));
        let mut k_host = vec![bf16::ZERO; cache.len()];
        let mut v_host = vec![bf16::ZERO; cache.len()];
        let (layer, slot) = (1usize, 1usize);
        let base = layer * cache.layer_len() + slot * cache.max_len * row;
        k_host[base..base + prefix * row].copy_from_slice(&bf(&keys[..prefix * row]));
        v_host[base..base + prefix * row].copy_from_slice(&bf(&vals[..prefix * row]));
        let (kc, vc) = (up(g, &k_host), up(g, &v_host));
        let q_dev = up(g, &bf(&q));
        let (k_new, v_new) = (up(g, &bf(&keys[prefix * row..])), up(g, &bf(&vals[prefix * row..])));
        let rows_slot = up(g, &vec![slot as i32; n]);
        let rows_pos = up(g, &vec![0i32; n]);
        let rows_dst: Vec<i32> = (0..n).map(|j| (prefix + j) as i32).collect();
        let rows_dst = up(g, &rows_dst);
        let inv_freq: Vec<f64> = (0..32).map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / 64.0)).collect();
        let inv = up(g, &inv_freq);
        let meta = RowBufs { slot: rows_slot.buf(), pos: rows_pos.buf(), dst: rows_dst.buf() };
        let (kb, vb) = (kc.buf(), vc.buf());
        g.launch(
            &plan::rope_kv_write(cache, layer, n, q_dev.buf(), k_new.buf(), v_new.buf(), kb, vb, meta, inv.buf())
                .unwrap(),
        )
        .unwrap();
        let tree = TreeDims { batch: 1, n_max: n };
        let anc = up(g, &ancestor_masks(&parents).unwrap());
        let (seq_slot, seq_prefix, seq_n) = (up(g, &[slot as i32]), up(g, &[prefix as i32]), up(g, &[n as i32]));
        let seq = SeqBufs { slot: seq_slot.buf(), prefix_len: seq_prefix.buf(), n_nodes: seq_n.buf() };
        let out = up(g, &vec![bf16::ZERO; n * 9 * 64]);
        g.launch(
            &plan::tree_attention(cache, layer, tree, q_dev.buf(), kb, vb, out.buf(), seq, Some(anc.buf())).unwrap(),
        )
        .unwrap();
        let got = unbf(&out.to_host(g).unwrap());
        // CPU: node 0 is the root, fed as a new row whose parent is the last committed token.
        let cpu_parents: Vec<Option<usize>> = parents.iter().map(|&p| usize::try_from(p).ok()).collect();
        let mut want = vec![0f32; n * 9 * 64];
        tree_attention(&q, &keys, &vals, prefix, Visibility::Tree(&cpu_parents), shape, 0.125, &mut want).unwrap();
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 2e-2, "max |gpu - cpu| = {worst} (bf16 output)");
        // The tensor-core split kernel (what the decoder runs), with one chunk and with 4 chunks of 16 keys (the
        // 43 keys span 3 of them; `split_attention_over_several_chunks` runs longer ones).
        for chunks in [plan::Chunks { n_splits: 1, chunk_len: 64 }, plan::Chunks { n_splits: 4, chunk_len: 16 }] {
            let [po, pml, pa] = chunks.part_lens(tree, shape);
            let parts = (up(g, &vec![0f32; po.max(1)]), up(g, &vec![0f32; pml.max(1)]), up(g, &vec![0i32; pa.max(1)]));
            let bufs = plan::SplitParts { o: parts.0.buf(), ml: parts.1.buf(), arrivals: parts.2.buf() };
            let parts = (chunks.n_splits > 1).then_some(bufs);
            let out = up(g, &vec![bf16::ZERO; n * 9 * 64]);
            let launches = plan::attention(
                cache,
                layer,
                tree,
                chunks,
                q_dev.buf(),
                kb,
                vb,
                out.buf(),
                seq,
                Some(anc.buf()),
                parts,
            );
            for l in launches.unwrap() {
                g.launch(&l).unwrap();
            }
            let got = unbf(&out.to_host(g).unwrap());
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 2e-2, "split attention in {chunks:?}: max |gpu - cpu| = {worst} (bf16 output)");
        }
    }

    /// The tensor-core product the split attention is built on (`mma_bf16_probe`), against the CPU's on values whose
    /// products and sums are exact: a wrong reading of the PTX fragment layout fails here by name.
    #[test]
    fn the_tensor_core_product_matches_the_cpu() {
        let Some(g) = gpu_or_skip("the_tensor_core_product_matches_the_cpu") else { return };
        let g: &dyn Gpu = g.as_ref();
        let mut rng = SplitMix64::new(16);
        let mut eighths =
            |n: usize| -> Vec<f32> { (0..n).map(|_| (rng.next_f64() * 32.0).floor() as f32 / 8.0 - 2.0).collect() };
        let (a, b) = (eighths(256), eighths(128));
        let want: Vec<f32> = (0..128).map(|e| (0..16).map(|k| a[(e / 8) * 16 + k] * b[k * 8 + e % 8]).sum()).collect();
        let (ad, bd, d) = (up(g, &bf(&a)), up(g, &bf(&b)), up(g, &vec![0f32; 128]));
        g.launch(&plan::mma_probe(ad.buf(), bd.buf(), d.buf()).unwrap()).unwrap();
        assert_eq!(d.to_host(g).unwrap(), want, "mma.sync m16n8k16 against the CPU product");
    }

    /// Qwen3's q/k head norms: every head vector of 128 (Qwen3's head_dim; 40 vectors, so the last block is
    /// partly empty) normalised in place against an f64 reference on the same bf16 inputs.
    #[test]
    fn head_rms_norm_matches_the_host() {
        let Some(g) = gpu_or_skip("head_rms_norm_matches_the_host") else { return };
        let g: &dyn Gpu = g.as_ref();
        let (vectors, d, eps) = (40usize, 128usize, 1e-6f32);
        let mut rng = SplitMix64::new(5);
        let x = unbf(&bf(&randn(&mut rng, vectors * d)));
        let w = unbf(&bf(&randn(&mut rng, d)));
        let xd = up(g, &bf(&x));
        let wd = up(g, &bf(&w));
        g.launch(&plan::head_rms_norm(d, eps, xd.buf(), wd.buf()).unwrap().unwrap()).unwrap();
        let got = unbf(&xd.to_host(g).unwrap());
        let mut worst = 0f64;
        for (v, row) in x.chunks(d).enumerate() {
            let ms = row.iter().map(|&a| f64::from(a) * f64::from(a)).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            for e in 0..d {
                let want = f64::from(row[e]) * inv * f64::from(w[e]);
                worst = worst.max((f64::from(got[v * d + e]) - want).abs() / want.abs().max(1.0));
            }
        }
        assert!(worst < 1e-2, "max relative |gpu - host| = {worst} (bf16 output)");
        assert!(plan::head_rms_norm(48, eps, xd.buf(), wd.buf()).is_err(), "weight of the wrong width");
    }

    /// Greedy and sampled rows against the CPU's argmax / inverse-CDF reference, and the tree walk on a
    /// hand-built tree.
    #[test]
    fn sampling_and_tree_acceptance_match_the_host() {
        let Some(g) = gpu_or_skip("sampling_and_tree_acceptance_match_the_host") else { return };
        let g: &dyn Gpu = g.as_ref();
        let (rows, vocab) = (6usize, 49_152usize);
        let mut rng = SplitMix64::new(11);
        let logits: Vec<f32> = (0..rows * vocab).map(|_| (rng.next_f64() * 8.0) as f32).collect();
        let l = up(g, &logits);
        let (tok, lp, pm) = (up(g, &vec![0i32; rows]), up(g, &vec![0f32; rows]), up(g, &vec![0f32; rows]));
        g.launch(&plan::sample_rows(rows, vocab, 0.0, l.buf(), None, tok.buf(), lp.buf(), pm.buf()).unwrap()).unwrap();
        let got = tok.to_host(g).unwrap();
        for r in 0..rows {
            assert_eq!(got[r] as usize, argmax(&logits[r * vocab..(r + 1) * vocab]).unwrap(), "row {r}");
        }
        let coins: Vec<f64> = (0..rows).map(|_| rng.next_f64()).collect();
        let c = up(g, &coins);
        g.launch(&plan::sample_rows(rows, vocab, 0.7, l.buf(), Some(c.buf()), tok.buf(), lp.buf(), pm.buf()).unwrap())
            .unwrap();
        let (got, got_lp) = (tok.to_host(g).unwrap(), lp.to_host(g).unwrap());
        let params = SamplingParams { temperature: 0.7, ..SamplingParams::default() };
        for r in 0..rows {
            let x = &logits[r * vocab..(r + 1) * vocab];
            let p = tlt_kernels::probs(x, &params).unwrap();
            let want = tlt_kernels::categorical(&p, coins[r]).unwrap();
            // Summation order differs from the CPU's: a coin within float noise of a CDF step may land one token
            // over; anything else is a bug.
            let t = got[r] as usize;
            let (lo, hi) = (p[..t.min(want)].iter().map(|&v| f64::from(v)).sum::<f64>(), coins[r]);
            assert!(t == want || (lo - hi).abs() < 1e-5, "row {r}: gpu {t} cpu {want}");
            let (want_lp, _) = token_logprob_pmax(x, t, 0.7).unwrap();
            assert!((got_lp[r] - want_lp).abs() < 1e-4, "row {r}: log-prob {} vs {want_lp}", got_lp[r]);
        }
        // Tree: 0 -> {1: tok 5, 2: tok 7}, 1 -> 3: tok 9, 2 -> 4: tok 9. Target: root says 7, node 2 says 9,
        // node 4 says 3: accept 2 then 4, then commit 3.
        let tree = TreeDims { batch: 1, n_max: 5 };
        let parent = up(g, &[-1i32, 0, 0, 1, 2]);
        let draft = up(g, &[0i32, 5, 7, 9, 9]);
        let target = up(g, &[7i32, 1, 9, 1, 3]);
        let target_lp = up(g, &[-0.5f32, -1.0, -0.25, -1.0, -2.0]);
        let target_pm = up(g, &[0.5f32, 0.6, 0.7, 0.8, 0.9]);
        let nn = up(g, &[5i32]);
        let (path, n_acc, toks, lps, pms) =
            (up(g, &[0i32; 5]), up(g, &[0i32]), up(g, &[0i32; 5]), up(g, &[0f32; 5]), up(g, &[0f32; 5]));
        let input = AcceptInBufs {
            parent: parent.buf(),
            draft_tok: draft.buf(),
            target_tok: target.buf(),
            target_lp: target_lp.buf(),
            target_pmax: target_pm.buf(),
            n_nodes: nn.buf(),
        };
        let out = AcceptOutBufs {
            path: path.buf(),
            n_acc: n_acc.buf(),
            tokens: toks.buf(),
            logprobs: lps.buf(),
            pmax: pms.buf(),
        };
        g.launch(&plan::tree_accept(tree, input, out).unwrap()).unwrap();
        assert_eq!(n_acc.to_host(g).unwrap(), vec![3]);
        assert_eq!(&path.to_host(g).unwrap()[..3], &[0, 2, 4]);
        assert_eq!(&toks.to_host(g).unwrap()[..3], &[7, 9, 3]);
        assert_eq!(&lps.to_host(g).unwrap()[..3], &[-0.5, -0.25, -2.0]);
        assert_eq!(&pms.to_host(g).unwrap()[..3], &[0.5, 0.7, 0.9]);
    }
}
