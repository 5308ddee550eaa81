//! Split attention over several chunks through the device seam, as the decoder runs it: one body for a GPU
//! (`tlt-kernels/tests/cuda.rs`, when a driver is present) and for the simulated device (`tlt-cuda-sim`'s kernel
//! tests, in CI). Two sequences (a 6-node tree over 300 keys, a decode row over 129) against the CPU's tree
//! attention, under three chunkings of several chunks each; the arrival counters are zero after the launch and after
//! each of two replays of a captured graph, whose outputs are the eager launch's bits.

use half::bf16;
use tlt_kernels::cuda::plan::{self, Chunks, SeqBufs, SplitParts};
use tlt_kernels::cuda::{ancestor_masks, CacheDims, DeviceBuf, Gpu, TreeDims};
use tlt_kernels::{tree_attention, AttnShape, SplitMix64, Visibility};

fn values(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| bf16::from_f32((rng.next_f64() * 2.0 - 1.0) as f32).to_f32()).collect()
}

/// Runs the test on `g`; returns its report line.
///
/// # Panics
/// On a wrong output, a counter left non-zero, or a device error (it is a test).
#[allow(clippy::too_many_lines)]
pub fn split_attention_over_several_chunks(g: &dyn Gpu) -> String {
    let shape = AttnShape::new(9, 3, 64);
    let cache = CacheDims { layers: 1, slots: 2, max_len: 512, attn: shape };
    let (row, width) = (cache.row(), shape.n_heads * shape.head_dim);
    let parents = [-1i32, 0, 0, 1, 2, 4];
    let (n_max, prefix) = (parents.len(), [300usize, 128]);
    let mut rng = SplitMix64::new(11);
    // Sequence b in slot 1 - b: its keys from position 0 (prefix, then its nodes), junk past them.
    let (mut kh, mut vh) = (values(&mut rng, cache.len()), values(&mut rng, cache.len()));
    for x in kh.iter_mut().chain(vh.iter_mut()) {
        *x *= 4.0;
    }
    let q = values(&mut rng, 2 * n_max * width);
    let nodes = [n_max, 1];
    let mut want = vec![0f32; q.len()];
    for b in 0..2 {
        let at = (1 - b) * cache.max_len * row;
        let len = prefix[b] + nodes[b];
        let (k, v) = (values(&mut rng, len * row), values(&mut rng, len * row));
        kh[at..at + len * row].copy_from_slice(&k);
        vh[at..at + len * row].copy_from_slice(&v);
        let cpu: Vec<Option<usize>> = parents[..nodes[b]].iter().map(|&p| usize::try_from(p).ok()).collect();
        let (qs, out) =
            (&q[b * n_max * width..][..nodes[b] * width], &mut want[b * n_max * width..][..nodes[b] * width]);
        tree_attention(qs, &k, &v, prefix[b], Visibility::Tree(&cpu), shape, 0.125, out).unwrap();
    }
    let to_bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let (kc, vc) = (DeviceBuf::from_host(g, &to_bf(&kh)).unwrap(), DeviceBuf::from_host(g, &to_bf(&vh)).unwrap());
    let qd = DeviceBuf::from_host(g, &to_bf(&q)).unwrap();
    let mut masks = vec![0u64; 2 * n_max];
    masks[..n_max].copy_from_slice(&ancestor_masks(&parents).unwrap());
    masks[n_max] = 1;
    let anc = DeviceBuf::from_host(g, &masks).unwrap();
    let slot = DeviceBuf::from_host(g, &[1i32, 0]).unwrap();
    let pre = DeviceBuf::from_host(g, &[prefix[0] as i32, prefix[1] as i32]).unwrap();
    let nn = DeviceBuf::from_host(g, &[nodes[0] as i32, nodes[1] as i32]).unwrap();
    let seq = SeqBufs { slot: slot.buf(), prefix_len: pre.buf(), n_nodes: nn.buf() };
    let tree = TreeDims { batch: 2, n_max };
    let device = Chunks::for_cache(shape, cache.max_len, g.info().target_blocks());
    let mut report = Vec::new();
    for chunks in [Chunks { n_splits: 8, chunk_len: 64 }, Chunks::for_cache(shape, cache.max_len, 264), device] {
        if chunks.n_splits == 1 {
            report.push(format!("{chunks:?} (this device's: one chunk, skipped)"));
            continue;
        }
        let [po, pml, pa] = chunks.part_lens(tree, shape);
        let (o, ml) = (DeviceBuf::<f32>::zeros(g, po).unwrap(), DeviceBuf::<f32>::zeros(g, pml).unwrap());
        let arrivals = DeviceBuf::<i32>::zeros(g, pa).unwrap();
        let parts = SplitParts { o: o.buf(), ml: ml.buf(), arrivals: arrivals.buf() };
        let out = DeviceBuf::<bf16>::zeros(g, q.len()).unwrap();
        let launches = plan::attention(
            cache,
            0,
            tree,
            chunks,
            qd.buf(),
            kc.buf(),
            vc.buf(),
            out.buf(),
            seq,
            Some(anc.buf()),
            Some(parts),
        )
        .unwrap();
        assert_eq!(launches.len(), 1, "one launch: the chunks combine inside it");
        g.launch(&launches[0]).unwrap();
        let eager = out.to_host(g).unwrap();
        let counters = |when: &str| {
            let a = arrivals.to_host(g).unwrap();
            assert!(a.iter().all(|&n| n == 0), "{chunks:?}: arrival counters {a:?} after {when}");
        };
        counters("the launch");
        for (i, (&got, &w)) in eager.iter().zip(&want).enumerate() {
            let got = got.to_f32();
            assert!((got - w).abs() <= w.abs() / 64.0 + 2e-3, "{chunks:?}: element {i}: {got} vs {w}");
        }
        // Captured, then replayed twice into a zeroed output: the eager launch's bits, the counters zero again.
        g.begin_capture().unwrap();
        g.launch(&launches[0]).unwrap();
        let graph = g.end_capture().unwrap().expect("a graph of one launch");
        for replay in 1..=2 {
            g.memset_zero(out.buf().addr(), out.bytes()).unwrap();
            g.replay(&graph).unwrap();
            let got = out.to_host(g).unwrap();
            assert!(got.iter().zip(&eager).all(|(a, b)| a.to_bits() == b.to_bits()), "{chunks:?}: replay {replay}");
            counters(&format!("replay {replay}"));
        }
        report.push(format!("{} chunks of {}", chunks.n_splits, chunks.chunk_len));
    }
    format!(
        "split attention over several chunks ({}): against the CPU's tree attention; arrival counters zero after \
         the launch and after 2 graph replays (same bits)",
        report.join(", ")
    )
}
