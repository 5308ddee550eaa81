//! Batch invariance of the device decoder: a row's logits are the same bits decoded alone, decoded beside 63 other
//! sequences, and computed as any node of a verify tree (a chain, a branching tree, and trees beside other
//! sequences' trees), for Llama, Qwen2 and Qwen3 shapes, over a context whose nodes' keys cross a boundary between
//! two of split attention's key chunks. This is what makes speculative decoding commit exactly plain decoding's tokens on a device. The
//! negative control chooses the GEMMs' K split from the row count and must fail the same comparison.

use super::{devices, tiny};
use tlt_kernels::cuda::plan::Chunks;
use tlt_kernels::cuda::SharedGpu;
use tlt_model::cuda::{CudaLlama, DeviceSeq};

/// Positions of the cache.
const MAX_LEN: usize = 512;
/// Slots: the probe's decode slot (0), its verify slot (1) and 64 others.
const SLOTS: usize = 66;

/// A verify case: its name, nodes, parents (`None`: a causal chain) and, per node, the decode row it must equal
/// (an index into `[t0, a, b, c]`'s rows).
type Case<'a> = (&'a str, &'a [u32], Option<&'a [i32]>, [usize; 4]);

fn bits(logits: &[f32], row: usize, vocab: usize) -> Vec<u32> {
    logits[row * vocab..(row + 1) * vocab].iter().map(|v| v.to_bits()).collect()
}

/// The other sequences' committed lengths (slot `s`: 3 to 19 positions).
fn other_len(s: usize) -> usize {
    s % 17 + 3
}

/// Row bits of every comparison, with a description of the first that differs (`None`: all equal).
fn first_difference(model_type: &str, dev: SharedGpu, split_by_rows: bool) -> Option<String> {
    let model = tiny(model_type);
    let vocab = model.config().vocab_size;
    let mut gpu = CudaLlama::new(&model, dev, SLOTS, MAX_LEN).unwrap();
    // The probe's committed prefix: its nodes' logical key positions (prefix + 1 ..= prefix + 3) cross the end of
    // the second key chunk, so the tail is gathered across a chunk boundary and the combine sums several chunks.
    let chunks = Chunks::for_cache(gpu.cache_dims().attn, MAX_LEN, gpu.gpu().info().target_blocks());
    assert!(2 * chunks.chunk_len + 2 <= MAX_LEN, "the case needs two chunks and a tree: {chunks:?}");
    let prefix = 2 * chunks.chunk_len - 2;
    let prompt: Vec<u32> = (0..prefix).map(|i| ((i * 29 + 7) % vocab) as u32).collect();
    gpu.forward(&[DeviceSeq { slot: 0, prefix_len: 0, tokens: &prompt, parents: None }]).unwrap();
    gpu.fork_slot(0, 1, prefix).unwrap();
    let others: Vec<Vec<u32>> =
        (0..SLOTS).map(|s| (0..other_len(s)).map(|i| ((i * 13 + s) % vocab) as u32).collect()).collect();
    let prefills: Vec<DeviceSeq> =
        (2..SLOTS).map(|s| DeviceSeq { slot: s, prefix_len: 0, tokens: &others[s], parents: None }).collect();
    gpu.forward(&prefills).unwrap();
    gpu.split_gemms_by_rows(split_by_rows);
    let (t0, a, b, c) = (5u32, 11u32, 23u32, 31u32);
    let decode = |gpu: &mut CudaLlama, prefix: usize, tok: u32| {
        let t = [tok];
        let out = gpu.forward(&[DeviceSeq { slot: 0, prefix_len: prefix, tokens: &t, parents: None }]).unwrap();
        bits(&gpu.logits_to_host(&out).unwrap(), 0, vocab)
    };
    // Plain decoding of the paths t0 -> a -> c and t0 -> b, alone.
    let l0 = decode(&mut gpu, prefix, t0);
    let la = decode(&mut gpu, prefix + 1, a);
    let lc = decode(&mut gpu, prefix + 2, c);
    let lb = decode(&mut gpu, prefix + 1, b);
    // t0 again, beside 63 other sequences' decode steps, the probe at position 37.
    let toks: Vec<[u32; 1]> = (0..SLOTS).map(|s| [((s * 7 + 3) % vocab) as u32]).collect();
    let mut batch: Vec<DeviceSeq> = (2..SLOTS)
        .filter(|&s| s != 39)
        .map(|s| DeviceSeq { slot: s, prefix_len: other_len(s), tokens: &toks[s], parents: None })
        .collect();
    let probe = [t0];
    batch.insert(37, DeviceSeq { slot: 0, prefix_len: prefix, tokens: &probe, parents: None });
    let out = gpu.forward(&batch).unwrap();
    if bits(&gpu.logits_to_host(&out).unwrap(), 37, vocab) != l0 {
        return Some(format!("{model_type}: t0 beside 63 others differs from t0 alone"));
    }
    // Verify trees on slot 1 (the same committed prefix): every node's row is its path's decode row.
    let want = [&l0, &la, &lb, &lc];
    let tree = [t0, a, b, c];
    let parents = [-1i32, 0, 0, 1];
    let chain = [t0, a, c];
    let chain_parents = [-1i32, 0, 1];
    let cases: [Case; 3] = [
        ("branching tree", &tree, Some(&parents), [0, 1, 2, 3]),
        ("chain tree", &chain, Some(&chain_parents), [0, 1, 3, usize::MAX]),
        ("causal chain", &chain, None, [0, 1, 3, usize::MAX]),
    ];
    for (what, nodes, par, rows) in cases {
        for beside in [false, true] {
            let other_tree = [1u32, 2, 3];
            let other_parents = [-1i32, 0, 0];
            let mut seqs = vec![DeviceSeq { slot: 1, prefix_len: prefix, tokens: nodes, parents: par }];
            if beside {
                for s in [2, 9, 30] {
                    let parents = par.map(|_| &other_parents[..]);
                    seqs.push(DeviceSeq { slot: s, prefix_len: other_len(s), tokens: &other_tree, parents });
                }
                seqs.rotate_left(1);
            }
            let at = if beside { seqs.len() - 1 } else { 0 };
            let out = gpu.forward(&seqs).unwrap();
            let host = gpu.logits_to_host(&out).unwrap();
            for (node, &w) in rows.iter().enumerate().filter(|(n, _)| *n < nodes.len()) {
                if bits(&host, at * out.n_max + node, vocab) != *want[w] {
                    return Some(format!("{model_type}: {what} (beside others: {beside}) node {node}"));
                }
            }
        }
    }
    None
}

#[test]
fn a_rows_logits_are_the_same_bits_alone_beside_63_others_and_as_a_verify_node() {
    for model_type in ["llama", "qwen2", "qwen3"] {
        for dev in devices("a_rows_logits_are_the_same_bits_alone_beside_63_others_and_as_a_verify_node") {
            if let Some(d) = first_difference(model_type, dev, false) {
                panic!("not batch-invariant: {d}");
            }
        }
        println!("{model_type}: decode alone = beside 63 others = every verify node, by bits");
    }
}

#[test]
fn the_negative_control_a_k_split_chosen_from_the_rows_breaks_it() {
    for dev in devices("the_negative_control_a_k_split_chosen_from_the_rows_breaks_it").into_iter().take(1) {
        let d = first_difference("llama", dev, true);
        assert!(d.is_some(), "an M-dependent GEMM split went unnoticed");
        println!("negative control: {}", d.unwrap_or_default());
    }
}
