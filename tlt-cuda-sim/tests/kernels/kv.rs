//! The commit of accepted paths (`kv.cu`) executed in the simulated device with the host's launch plans, against a
//! sequential reference: K/V rows of every layer moved behind each sequence's prefix (paths that skip nodes, stay in
//! place, reach past `max_len`, or are longer than `max_path`), and the accepted nodes' hidden rows packed for the
//! host (node indices out of range skipped).

#![allow(clippy::unwrap_used, clippy::needless_range_loop)] // Tests: a panic is the failure report; indices mirror the kernels.

use crate::common::{round_bf16, to_bf16, to_f32, variants, Rng};
use half::bf16;
use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::plan::{self, SeqBufs};
use tlt_kernels::cuda::{CacheDims, TreeDims};
use tlt_kernels::AttnShape;

pub fn commit_path_moves_accepted_rows_in_every_layer(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        let cache = CacheDims { layers: 3, slots: 4, max_len: 20, attn: AttnShape::new(4, 2, 8) };
        let (batch, max_path) = (4, 5);
        let row = cache.row();
        let mut rng = Rng::new(3);
        let k = round_bf16(&rng.vec(cache.len(), -2.0, 2.0));
        let v = round_bf16(&rng.vec(cache.len(), -2.0, 2.0));
        let slot = [3, 0, 2, 1];
        let prefix = [4, 0, 15, 2];
        // Sequence 0 stays in place; 1 skips nodes; 2 runs past max_len (prefix 15 + node 6); 3 accepts more nodes
        // than max_path (clamped).
        let path: [[i32; 5]; 4] = [[0, 1, 2, 0, 0], [0, 2, 5, 6, 9], [0, 1, 3, 6, 7], [0, 1, 3, 4, 8]];
        let n_acc = [3, 5, 5, 7];
        let (kb, vb) = (dev.upload(&to_bf16(&k)), dev.upload(&to_bf16(&v)));
        let (sb, pb, nb) = (dev.upload(&slot), dev.upload(&prefix), dev.upload(&[0i32; 4]));
        let (pathb, accb) = (dev.upload(&path.concat()), dev.upload(&n_acc));
        let seq = SeqBufs { slot: sb.buf(), prefix_len: pb.buf(), n_nodes: nb.buf() };
        let l = plan::commit_path(cache, batch, max_path, kb.buf(), vb.buf(), seq, pathb.buf(), accb.buf()).unwrap();
        dev.launch(&l).unwrap();
        let (mut wk, mut wv) = (k.clone(), v.clone());
        for layer in 0..cache.layers {
            for b in 0..batch {
                let base = (layer * cache.slots + slot[b] as usize) * cache.max_len * row;
                for kk in 0..(n_acc[b] as usize).min(max_path) {
                    let src = path[b][kk] as usize;
                    if src == kk {
                        continue;
                    }
                    if prefix[b] as usize + src >= cache.max_len || src < kk {
                        break;
                    }
                    let (from, to) = (base + (prefix[b] as usize + src) * row, base + (prefix[b] as usize + kk) * row);
                    wk.copy_within(from..from + row, to);
                    wv.copy_within(from..from + row, to);
                }
            }
        }
        assert_ne!(wk, k, "the case moves rows");
        assert_eq!(to_f32(&kb.download()), wk, "{order}: k cache");
        assert_eq!(to_f32(&vb.download()), wv, "{order}: v cache");
    }
    println!("commit_path_bf16: 3 layers x 4 slots; paths in place, skipping, past max_len, longer than max_path");
}

pub fn gather_path_rows_packs_the_accepted_nodes(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        let tree = TreeDims { batch: 3, n_max: 6 };
        let (max_path, width) = (4, 300);
        let mut rng = Rng::new(5);
        let src = round_bf16(&rng.vec(tree.nodes() * width, -1.0, 1.0));
        let path: [[i32; 4]; 3] = [[0, 2, 5, 0], [0, 99, 1, 2], [0, -3, 0, 0]];
        let n_acc = [3, 4, 9];
        let (sb, pb, ab) = (dev.upload(&to_bf16(&src)), dev.upload(&path.concat()), dev.upload(&n_acc));
        let dst = dev.upload(&vec![bf16::from_f32(7.0); tree.batch * max_path * width]);
        dev.launch(&plan::gather_path_rows(tree, max_path, width, sb.buf(), dst.buf(), pb.buf(), ab.buf()).unwrap())
            .unwrap();
        let mut want = vec![7f32; tree.batch * max_path * width];
        for b in 0..tree.batch {
            for kk in 0..(n_acc[b] as usize).min(max_path) {
                let node = path[b][kk];
                if node < 0 || node as usize >= tree.n_max {
                    continue;
                }
                let from = (b * tree.n_max + node as usize) * width;
                want[(b * max_path + kk) * width..][..width].copy_from_slice(&src[from..from + width]);
            }
        }
        assert_eq!(to_f32(&dst.download()), want, "{order}");
    }
    println!("gather_path_rows_bf16: 3 sequences, width 300; node indices 99 and -3 skipped, n_acc past max_path");
}

kernel_tests!(
    commit_path_moves_accepted_rows_in_every_layer => [commit_path_bf16],
    gather_path_rows_packs_the_accepted_nodes => [gather_path_rows_bf16],
);
