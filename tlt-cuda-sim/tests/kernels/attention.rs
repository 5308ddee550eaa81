//! The attention-side kernels (`attention.cu`) executed in the simulated device with the host's launch plans:
//! RoPE + KV write at non-zero positions, and tree / causal / decode attention against an f64 reference over
//! contexts of 1, 31, 32, 33, 512 and 4,096 keys, GQA groups 1 to 8, head dims 64 and 128, batch > 1 and layer 1 of
//! 2, for the serial tree kernel and the split-K kernel (one chunk, an H100's chunking, as many chunks as allowed). Every key matters to the comparison (probe keys with large values, where a dropped or doubled key moves the
//! output by far more than the tolerance); negative controls: barriers dropped, a grid one node short, a
//! reference missing one key.

#![allow(clippy::unwrap_used, clippy::needless_range_loop)] // Tests: a panic is the failure report; indices mirror the kernels.

mod invariance;
#[path = "../../../tlt-kernels/tests/shared/split_chunks.rs"]
mod split_chunks;

use crate::common::{round_bf16, to_bf16, to_f32, variants, Rng};
use half::bf16;
use invariance::{
    batch_dependent_chunks_fail_the_invariance_test,
    split_attention_rows_are_the_same_bits_alone_in_a_batch_and_in_a_tree,
};
use tlt_cuda_sim::{SimBuf, SimDevice};
use tlt_kernels::cuda::plan::{self, Chunks, Launch, RowBufs, SeqBufs, SplitParts};
use tlt_kernels::cuda::{ancestor_masks, CacheDims, TreeDims};
use tlt_kernels::AttnShape;

/// Values of probe keys: a dropped or doubled probe moves an output by about `PROBE / keys`.
const PROBE: f32 = 64.0;

/// One attention case: sequences with their prefixes, node counts and (tree mode) parents.
#[derive(Clone)]
struct Case {
    name: String,
    attn: AttnShape,
    n_max: usize,
    prefix: Vec<usize>,
    n_nodes: Vec<usize>,
    /// Per sequence, the parents of its nodes (tree mode); `None`: a causal chunk.
    parents: Option<Vec<Vec<i32>>>,
    /// Small q and k (near-uniform weights, probe keys) or large ones (a peaked softmax).
    peaked: bool,
}

/// A case's inputs on the device and on the host.
struct Inputs {
    cache: CacheDims,
    tree: TreeDims,
    q: Vec<f32>,
    kc: Vec<f32>,
    vc: Vec<f32>,
    slots: Vec<i32>,
    anc: Option<Vec<u64>>,
}

fn inputs(c: &Case, seed: u64) -> Inputs {
    let mut rng = Rng::new(seed);
    let a = c.attn;
    let batch = c.prefix.len();
    let max_len = c.prefix.iter().zip(&c.n_nodes).map(|(p, n)| p + n).max().unwrap().max(1) + 3;
    // Sequences in shuffled cache slots of a 2-layer cache; attention reads layer 1.
    let slots_n = batch + 2;
    let cache = CacheDims { layers: 2, slots: slots_n, max_len, attn: a };
    let tree = TreeDims { batch, n_max: c.n_max };
    let slots: Vec<i32> = (0..batch).map(|b| ((b * 7 + 1) % slots_n) as i32).collect();
    let (qk, v) = if c.peaked { (2.0, 1.0) } else { (0.25, 1.0) };
    let q = round_bf16(&rng.vec(tree.nodes() * a.n_heads * a.head_dim, -qk, qk));
    let kc = round_bf16(&rng.vec(cache.len(), -qk, qk));
    let mut vc = round_bf16(&rng.vec(cache.len(), -v, v));
    if !c.peaked {
        for b in 0..batch {
            let total = c.prefix[b] + c.n_nodes[b];
            let probes = [0, 31, 32, c.prefix[b].saturating_sub(1), c.prefix[b], total.saturating_sub(1)];
            for &t in probes.iter().filter(|&&t| t < total) {
                let start = cache.layer_len() + (slots[b] as usize * max_len + t) * cache.row();
                for x in &mut vc[start..start + cache.row()] {
                    *x = if rng.coin() < 0.5 { -PROBE } else { PROBE };
                }
            }
        }
    }
    let anc = c.parents.as_ref().map(|ps| {
        let mut m = vec![0u64; tree.nodes()];
        for (b, p) in ps.iter().enumerate() {
            m[b * c.n_max..b * c.n_max + p.len()].copy_from_slice(&ancestor_masks(p).unwrap());
        }
        m
    });
    Inputs { cache, tree, q, kc, vc, slots, anc }
}

/// The f64 reference of `tree_attention_bf16` on layer 1; `skip`: a (sequence, key) left out (a negative
/// control). Rows of nodes past a sequence's count stay 0.
fn reference(c: &Case, x: &Inputs, skip: Option<(usize, usize)>) -> Vec<f32> {
    let a = c.attn;
    let (hd, group) = (a.head_dim, a.n_heads / a.n_kv_heads);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; x.q.len()];
    for b in 0..c.prefix.len() {
        let (prefix, nn) = (c.prefix[b], c.n_nodes[b]);
        let base = x.cache.layer_len() + x.slots[b] as usize * x.cache.max_len * x.cache.row();
        for i in 0..nn {
            let total = prefix + if x.anc.is_some() { nn } else { i + 1 };
            let mask = x.anc.as_ref().map_or(0, |m| m[b * c.n_max + i]);
            let visible = |t: usize| {
                t < total && Some((b, t)) != skip && (t < prefix || x.anc.is_none() || (mask >> (t - prefix)) & 1 == 1)
            };
            for h in 0..a.n_heads {
                let kvh = h / group;
                let qo = ((b * c.n_max + i) * a.n_heads + h) * hd;
                let key = |t: usize| base + t * x.cache.row() + kvh * hd;
                let scores: Vec<(usize, f64)> = (0..total)
                    .filter(|&t| visible(t))
                    .map(|t| {
                        let dot =
                            (0..hd).map(|d| f64::from(x.q[qo + d] * scale) * f64::from(x.kc[key(t) + d])).sum::<f64>();
                        (t, dot)
                    })
                    .collect();
                let mx = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s.1 - mx).exp()).sum();
                for d in 0..hd {
                    let o: f64 = scores.iter().map(|&(t, s)| (s - mx).exp() * f64::from(x.vc[key(t) + d])).sum();
                    out[qo + d] = (o / sum) as f32;
                }
            }
        }
    }
    out
}

/// Which attention kernel a run uses.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kernel {
    /// `tree_attention_bf16`: one block per (KV head, node), serial over the keys.
    Tree,
    /// `attention_split_bf16` (its chunks combined by their last block) with chunks of `chunk_len` keys (0: one
    /// chunk over the whole cache).
    Split { chunk_len: usize },
    /// `attention_split_bf16` with the plan's chunking for a device of `resident` blocks ([`Chunks::for_cache`]).
    SplitCache { resident: usize },
}

impl Kernel {
    /// The chunking of a split kernel for a cache of `max_len` positions.
    fn chunks(self, attn: AttnShape, max_len: usize) -> Chunks {
        match self {
            Self::Tree | Self::Split { chunk_len: 0 } => {
                Chunks { n_splits: 1, chunk_len: max_len.next_multiple_of(16) }
            }
            Self::Split { chunk_len } => Chunks { n_splits: max_len.div_ceil(chunk_len), chunk_len },
            Self::SplitCache { resident } => Chunks::for_cache(attn, max_len, resident),
        }
    }
}

/// Runs the case's plan for `kernel` on `dev` and returns `out`; `alter` may change the launches first. The split
/// kernel's arrival counters must be left zero (so that a replayed graph starts as the first launch did).
fn run(dev: &SimDevice, c: &Case, x: &Inputs, kernel: Kernel, alter: impl Fn(&mut Vec<Launch>)) -> Vec<f32> {
    let (out, arrivals) = run_from(dev, c, x, kernel, alter, 0);
    assert!(arrivals.iter().all(|&n| n == 0), "{kernel:?} {}: arrival counters left at {arrivals:?}", c.name);
    out
}

/// [`run`] with the split kernel's arrival counters starting at `arrivals` (0: as the plan requires); returns `out`
/// and the counters after the launches.
fn run_from(
    dev: &SimDevice,
    c: &Case,
    x: &Inputs,
    kernel: Kernel,
    alter: impl Fn(&mut Vec<Launch>),
    arrivals: i32,
) -> (Vec<f32>, Vec<i32>) {
    let to_i32 = |v: &[usize]| v.iter().map(|&n| n as i32).collect::<Vec<_>>();
    let (q, kc, vc) = (dev.upload(&to_bf16(&x.q)), dev.upload(&to_bf16(&x.kc)), dev.upload(&to_bf16(&x.vc)));
    let out: SimBuf<bf16> = dev.zeros(x.q.len());
    let (slot, prefix, nodes) = (dev.upload(&x.slots), dev.upload(&to_i32(&c.prefix)), dev.upload(&to_i32(&c.n_nodes)));
    let anc = x.anc.as_ref().map(|m| dev.upload(m));
    let seq = SeqBufs { slot: slot.buf(), prefix_len: prefix.buf(), n_nodes: nodes.buf() };
    let anc_buf = anc.as_ref().map(SimBuf::buf);
    let (mut launches, parts) = match kernel {
        Kernel::Tree => {
            let l = plan::tree_attention(x.cache, 1, x.tree, q.buf(), kc.buf(), vc.buf(), out.buf(), seq, anc_buf);
            (vec![l.unwrap()], None)
        }
        Kernel::Split { .. } | Kernel::SplitCache { .. } => {
            let a = x.cache.attn;
            let chunks = kernel.chunks(a, x.cache.max_len);
            let [po, pml, pa] = chunks.part_lens(x.tree, a);
            let parts = (dev.zeros::<f32>(po), dev.zeros::<f32>(pml), dev.upload(&vec![arrivals; pa]));
            let bufs = Some(SplitParts { o: parts.0.buf(), ml: parts.1.buf(), arrivals: parts.2.buf() });
            let l =
                plan::attention(x.cache, 1, x.tree, chunks, q.buf(), kc.buf(), vc.buf(), out.buf(), seq, anc_buf, bufs);
            (l.unwrap(), Some(parts))
        }
    };
    alter(&mut launches);
    for l in &launches {
        if let Err(e) = dev.launch(l) {
            // A broken execution (a negative control) may fail the launch instead: NaN output, a miss to every
            // comparison (on a healthy device the caller's comparison fails with it).
            eprintln!("{kernel:?} {}: the launch failed: {e}", c.name);
            return (vec![f32::NAN; x.q.len()], Vec::new());
        }
    }
    (to_f32(&out.download()), parts.map_or_else(Vec::new, |p| p.2.download()))
}

/// Elements of `got` off `want` by more than bf16 rounding (2^-8 relative) plus f32 accumulation (2^-12 of the
/// value range): the first such index.
fn first_miss(got: &[f32], want: &[f32]) -> Option<usize> {
    let close = |g: f32, w: f32| (g - w).abs() <= w.abs() * 2f32.powi(-8) + 2f32.powi(-12);
    got.iter().zip(want).position(|(&g, &w)| g.is_nan() || !close(g, w))
}

/// The kernels every case runs: the serial tree kernel, and the split kernel with one chunk, with chunks of one
/// 16-key tile (warps 1 to 3 idle), of 64 keys (one tile a warp), and the plan's chunking for an H100 or H200 (264
/// resident blocks: chunks of 128 keys and more).
const KERNELS: [Kernel; 5] = [
    Kernel::Tree,
    Kernel::Split { chunk_len: 0 },
    Kernel::Split { chunk_len: 16 },
    Kernel::Split { chunk_len: 64 },
    Kernel::SplitCache { resident: 264 },
];

/// Runs case `c` through every kernel of [`KERNELS`] on both interleavings against the f64 reference; returns the
/// worst error as a fraction of [`first_miss`]'s tolerance (at most 1) of the tree kernel and of the split kernel.
fn check(dev: &SimDevice, c: &Case, seed: u64) -> Worst {
    check_with(dev, c, seed, &KERNELS)
}

/// [`check`] through `kernels`.
fn check_with(dev: &SimDevice, c: &Case, seed: u64, kernels: &[Kernel]) -> Worst {
    let x = inputs(c, seed);
    let want = reference(c, &x, None);
    let mut worst = Worst::default();
    for (order, dev) in variants(dev) {
        for &kernel in kernels {
            let got = run(&dev, c, &x, kernel, |_| {});
            if let Some(i) = first_miss(&got, &want) {
                panic!("{order} {kernel:?} {}: element {i}: {} vs {}", c.name, got[i], want[i]);
            }
            let w = if kernel == Kernel::Tree { &mut worst.tree } else { &mut worst.split };
            for (&g, &want) in got.iter().zip(&want) {
                *w = w.max((g - want).abs() / (want.abs() * 2f32.powi(-8) + 2f32.powi(-12)));
            }
        }
    }
    worst
}

/// The worst errors of [`check`], as fractions of the tolerance.
#[derive(Debug, Default, Clone, Copy)]
struct Worst {
    tree: f32,
    split: f32,
}

impl Worst {
    fn max(self, o: Self) -> Self {
        Self { tree: self.tree.max(o.tree), split: self.split.max(o.split) }
    }
}

impl std::fmt::Display for Worst {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tree kernel {:.2}, split kernel {:.2}", self.tree, self.split)
    }
}

fn decode(n_heads: usize, n_kv: usize, hd: usize, keys: [usize; 2], peaked: bool) -> Case {
    Case {
        name: format!("decode h{n_heads}/kv{n_kv} d{hd} keys {keys:?}{}", if peaked { " peaked" } else { "" }),
        attn: AttnShape::new(n_heads, n_kv, hd),
        n_max: 1,
        prefix: keys.iter().map(|k| k - 1).collect(),
        n_nodes: vec![1, 1],
        parents: None,
        peaked,
    }
}

/// Query groups 1 to 8 as (heads, kv heads).
const GROUPS: [(usize, usize); 8] = [(2, 2), (4, 2), (6, 2), (8, 2), (5, 1), (12, 2), (7, 1), (16, 2)];

pub fn decode_attention_over_contexts_groups_and_head_dims(dev: &SimDevice) {
    let (mut ran, mut worst) = (Vec::new(), Worst::default());
    for (i, &(h, kv)) in GROUPS.iter().enumerate() {
        for hd in [64, 128] {
            for keys in [[1, 31], [32, 33], [512, 33]] {
                worst = worst.max(check(dev, &decode(h, kv, hd, keys, false), (i * 1000 + hd + keys[0]) as u64));
            }
            ran.push(format!("group {} d{hd}", h / kv));
        }
    }
    // 4,096 keys (128 tiles) for the smallest and largest groups, near-uniform and peaked.
    for (h, kv) in [(2, 2), (16, 2)] {
        for hd in [64, 128] {
            worst = worst.max(check(dev, &decode(h, kv, hd, [4096, 1], false), 4096 + hd as u64));
            worst = worst.max(check(dev, &decode(h, kv, hd, [4096, 2048], true), 8192 + hd as u64));
        }
    }
    println!(
        "decode attention (tree_attention_bf16; attention_split_bf16 in 1 chunk, chunks of 16 and 64 keys, \
         an H100's chunking): {}; keys 1, 31, 32, 33, 512 (batch 2); 4,096 for groups 1 and 8; worst error {worst} of the \
         bf16 tolerance (2^-8 relative + 2^-12)",
        ran.join(", ")
    );
}

fn tree_case(peaked: bool) -> Case {
    Case {
        name: format!("tree batch 3{}", if peaked { " peaked" } else { "" }),
        attn: AttnShape::new(8, 2, 64),
        n_max: 8,
        prefix: vec![0, 33, 100],
        n_nodes: vec![8, 5, 1],
        parents: Some(vec![vec![-1, 0, 0, 1, 1, 2, 5, 3], vec![-1, 0, 1, 0, 3], vec![-1]]),
        peaked,
    }
}

fn causal_case() -> Case {
    Case {
        name: "causal chunk batch 2".into(),
        attn: AttnShape::new(6, 3, 128),
        n_max: 40,
        prefix: vec![0, 17],
        n_nodes: vec![40, 23],
        parents: None,
        peaked: false,
    }
}

pub fn tree_and_causal_chunk_attention(dev: &SimDevice) {
    let worst = [tree_case(false), tree_case(true), causal_case()]
        .iter()
        .map(|c| check(dev, c, 77))
        .fold(Worst::default(), Worst::max);
    println!(
        "tree_attention_bf16, attention_split_bf16: trees of 8/5/1 nodes after prefixes \
         0/33/100; causal chunks of 40/23 after 0/17; worst error {worst} of the bf16 tolerance"
    );
}

/// Verify-8 (a chain) and decode at 16,384 and 32,768 keys (one sequence, groups of 4 and 8, head dims 128 and 64),
/// and trees of 64 and 40 nodes (4 row tiles of 16 nodes with groups of 1; 32 tiles of 2 nodes with groups of 8):
/// the split kernel with an H100's chunking and with chunks of 64 keys, against the f64 reference.
pub fn long_contexts_and_wide_trees(dev: &SimDevice) {
    let split = [Kernel::SplitCache { resident: 264 }, Kernel::Split { chunk_len: 64 }];
    let mut worst = Worst::default();
    let chain: Vec<i32> = (-1..7).collect();
    for (keys, attn) in [(16_384, AttnShape::new(4, 1, 128)), (32_768, AttnShape::new(8, 1, 64))] {
        for n in [1, 8] {
            let c = Case {
                name: format!("{} keys, {n} nodes, {attn:?}", keys),
                attn,
                n_max: n,
                prefix: vec![keys - n],
                n_nodes: vec![n],
                parents: (n > 1).then(|| vec![chain.clone()]),
                peaked: false,
            };
            worst = worst.max(check_with(dev, &c, keys as u64 + n as u64, &split));
        }
    }
    let mut rng = Rng::new(64);
    let parents: Vec<i32> = (0..64).map(|i| if i == 0 { -1 } else { (rng.coin() * f64::from(i)) as i32 }).collect();
    for (attn, peaked) in [(AttnShape::new(2, 2, 64), false), (AttnShape::new(16, 2, 128), true)] {
        let c = Case {
            name: format!("tree of 64 nodes {attn:?}"),
            attn,
            n_max: 64,
            prefix: vec![300, 0],
            n_nodes: vec![64, 40],
            parents: Some(vec![parents.clone(), parents[..40].to_vec()]),
            peaked,
        };
        worst = worst.max(check_with(dev, &c, 640, &KERNELS));
    }
    println!(
        "attention_split_bf16: verify-8 and decode at 16,384 keys (groups of 4, d128) and 32,768 keys \
         (groups of 8, d64); trees of 64 and 40 nodes (groups of 1 and 8); worst error {worst} of the bf16 tolerance"
    );
}

/// The tensor-core product (`mma_bf16_probe`) equals the CPU's on values whose products and sums are exact in f32;
/// the control: B read transposed (another fragment layout) is caught.
pub fn mma_probe_is_the_cpu_product(dev: &SimDevice) {
    let mut rng = Rng::new(16);
    // Multiples of 1/8 in [-2, 2]: every product and sum of 16 is exact in f32, so any order gives the same bits.
    let a: Vec<f32> = (0..256).map(|_| (rng.coin() * 32.0).floor() as f32 / 8.0 - 2.0).collect();
    let b: Vec<f32> = (0..128).map(|_| (rng.coin() * 32.0).floor() as f32 / 8.0 - 2.0).collect();
    let product = |b: &[f32], transposed: bool| -> Vec<f32> {
        let at = |k: usize, n: usize| if transposed { b[(n * 16 + k) % 128] } else { b[k * 8 + n] };
        (0..128).map(|e| (0..16).map(|k| a[(e / 8) * 16 + k] * at(k, e % 8)).sum()).collect()
    };
    let (ab, bb, d) = (dev.upload(&to_bf16(&a)), dev.upload(&to_bf16(&b)), dev.zeros::<f32>(128));
    dev.launch(&plan::mma_probe(ab.buf(), bb.buf(), d.buf()).unwrap()).unwrap();
    let got = d.download();
    assert_eq!(got, product(&b, false), "the product");
    assert_ne!(got, product(&b, true), "a transposed B must differ");
    assert!(plan::mma_probe(ab.buf(), ab.buf(), d.buf()).is_err(), "a 16 x 16 B is refused");
    println!("mma_bf16_probe: a 16x16 by 16x8 product equals the CPU's bit for bit; a transposed B differs");
}

pub fn negative_controls_are_caught(dev: &SimDevice) {
    let c = tree_case(false);
    let x = inputs(&c, 5);
    let want = reference(&c, &x, None);
    let split = Kernel::Split { chunk_len: 16 };
    for kernel in [Kernel::Tree, split] {
        assert_eq!(
            first_miss(&run(dev, &c, &x, kernel, |_| {}), &want),
            None,
            "{kernel:?}: the unaltered run must pass"
        );
        // A broken execution: no barriers, so threads read shared tiles before they are written.
        let broken = run(&dev.without_barriers(), &c, &x, kernel, |_| {});
        assert!(first_miss(&broken, &want).is_some(), "{kernel:?}: dropping __syncthreads went unnoticed");
        // A launch short of blocks (the tree kernel: one node; the split kernel: its second KV head, 2 of 2, whose
        // blocks are the grid's upper half): those rows are never written.
        let short =
            run(dev, &c, &x, kernel, |l| if kernel == Kernel::Tree { l[0].grid[1] -= 1 } else { l[0].grid[0] /= 2 });
        assert!(first_miss(&short, &want).is_some(), "{kernel:?}: a grid one block short went unnoticed");
    }
    // The split kernel's arrival counters not zeroed before the launch: no block (or the wrong one) combines the
    // chunks, and the output is not the attention.
    let long = decode(4, 2, 64, [1000, 700], false);
    let xl = inputs(&long, 9);
    for start in [1, -1] {
        let (stale, _) = run_from(dev, &long, &xl, split, |l| assert_eq!(l.len(), 1, "one launch"), start);
        assert!(
            first_miss(&stale, &reference(&long, &xl, None)).is_some(),
            "arrivals starting at {start} went unnoticed"
        );
    }
    // The comparison sees a single missing key, even among 4,096.
    let long = decode(2, 2, 64, [4096, 1], false);
    let xl = inputs(&long, 3);
    for kernel in [Kernel::Tree, split] {
        let got = run(dev, &long, &xl, kernel, |_| {});
        assert_eq!(first_miss(&got, &reference(&long, &xl, None)), None);
        for key in [0, 31, 32, 4095] {
            let missing = reference(&long, &xl, Some((0, key)));
            assert!(first_miss(&got, &missing).is_some(), "{kernel:?}: a reference without key {key} still matched");
        }
    }
    println!("negative controls: barriers dropped, grid one block short, arrival counters not zeroed, a reference without one of 4,096 keys");
}

/// The multi-chunk test of `tlt-kernels/tests/cuda.rs` (there on a GPU) on the simulated device's seam (`SimGpu`,
/// its stream running late): several chunks, the CPU's tree attention, arrival counters zero after the launch and
/// after two graph replays.
#[test]
fn split_attention_over_several_chunks_and_graph_replays_on_the_seam() {
    for schedule in [tlt_cuda_sim::Schedule::Lazy, tlt_cuda_sim::Schedule::Seeded(3)] {
        let sim = tlt_cuda_sim::SimGpu::new(schedule);
        println!("{schedule:?}: {}", split_chunks::split_attention_over_several_chunks(&sim));
    }
}

#[test]
fn split_attention_chunks_are_fixed_per_cache_and_fill_a_wave() {
    use tlt_kernels::cuda::plan::{row_tiles, CHUNK_ALIGN, MIN_SPLIT_LEN};
    // Batch-1 decode of SmolLM2 (3 KV heads, groups of 3) on an H100 or H200 (264 resident blocks): 88 chunks a
    // wave; a 4,096-key cache gets the shortest chunks (128 keys, 32 chunks), a 32,784-key one 86 chunks of 384.
    let smol = AttnShape::new(9, 3, 64);
    assert_eq!(Chunks::for_cache(smol, 4096, 264), Chunks { n_splits: 32, chunk_len: 128 });
    assert_eq!(Chunks::for_cache(smol, 32_784, 264), Chunks { n_splits: 86, chunk_len: 384 });
    // An 8B model (8 KV heads): 33 chunks a wave.
    let llama = AttnShape::new(32, 8, 128);
    assert_eq!(row_tiles(8, 4), 2);
    assert_eq!(Chunks::for_cache(llama, 32_784, 264), Chunks { n_splits: 33, chunk_len: 1024 });
    for (max_len, resident) in [(1, 264), (33, 264), (4096, 1), (5000, 1000), (4097, 264), (100_000, 8)] {
        for attn in [AttnShape::new(2, 2, 64), smol, llama] {
            let c = Chunks::for_cache(attn, max_len, resident);
            assert!(c.chunk_len.is_multiple_of(CHUNK_ALIGN) && c.chunk_len >= MIN_SPLIT_LEN, "{max_len}: {c:?}");
            assert!(c.n_splits * c.chunk_len >= max_len && (c.n_splits - 1) * c.chunk_len < max_len, "{c:?}");
            assert!(c.n_splits == 1 || attn.n_kv_heads * c.n_splits <= resident.max(attn.n_kv_heads), "{c:?}");
        }
    }
    // The same chunking whatever the batch or tree (for_shape ignores them); the old rule's depends on them.
    let one = TreeDims { batch: 1, n_max: 1 };
    let wide = TreeDims { batch: 64, n_max: 8 };
    assert_eq!(Chunks::for_shape(one, llama, 4096, 264), Chunks::for_shape(wide, llama, 4096, 264));
    assert_ne!(Chunks::batch_dependent(one, llama, 4096, 264), Chunks::batch_dependent(wide, llama, 4096, 264));
}

/// One shape of the gpu-bench sweep as split attention runs it: blocks that have keys, and the waves of them.
struct WaveRow {
    model: &'static str,
    context: usize,
    batch: usize,
    nodes: usize,
    chunks: Chunks,
    blocks: usize,
    waves: f64,
}

/// The gpu-bench context sweep (`gpu-bench --contexts`: a cache of context + 16 positions, decode at batch 1 and
/// 64, verify-8 at batch 1) as split attention cuts it on a device of `resident` blocks a wave.
fn sweep_waves(resident: usize, rule: impl Fn(TreeDims, AttnShape, usize) -> Chunks) -> Vec<WaveRow> {
    use tlt_kernels::cuda::plan::row_tiles;
    let models = [
        ("SmolLM2-135M", AttnShape::new(9, 3, 64)),
        ("Llama-3-8B", AttnShape::new(32, 8, 128)),
        ("Qwen3-8B", AttnShape::new(32, 8, 128)),
    ];
    let mut rows = Vec::new();
    for (model, attn) in models {
        for context in [512, 4096, 16_384, 32_768] {
            let max_len = context + 16;
            for (batch, nodes) in [(1, 1), (64, 1), (1, 8)] {
                let tree = TreeDims { batch, n_max: nodes };
                let chunks = rule(tree, attn, max_len);
                // A row tile's keys: the prefix and its deepest node (decode: the row itself).
                let keys = context + nodes;
                let tiles = row_tiles(nodes, attn.n_heads / attn.n_kv_heads) * attn.n_kv_heads * batch;
                let blocks = tiles * keys.div_ceil(chunks.chunk_len).min(chunks.n_splits);
                let waves = blocks as f64 / resident as f64;
                rows.push(WaveRow { model, context, batch, nodes, chunks, blocks, waves });
            }
        }
    }
    rows
}

/// Whether `waves` ends just past a whole wave: more than one wave, the last under a quarter full.
fn just_past_a_wave(waves: f64) -> bool {
    waves > 1.0 && waves.fract() > 0.0 && waves.fract() < 0.25
}

/// The wave test: which shapes of the gpu-bench sweep land just past a wave of split attention on an H200 (132 SMs,
/// [`plan::ATTENTION_BLOCKS_PER_SM`] resident blocks each; the simulated device reports that residency too). With
/// the chunks of [`Chunks::for_cache`] none of batch 1 (decode, verify-8) does, and no shape wastes more than 10% of
/// its waves; the old batch-dependent rule put Llama-3-8B's verify-8 one block a chunk past a wave (the negative
/// control: the same check finds it).
#[test]
fn split_attention_fills_whole_waves_over_the_gpu_bench_sweep() {
    let sim = tlt_cuda_sim::SimGpu::new(tlt_cuda_sim::Schedule::Eager);
    let info = tlt_kernels::cuda::Gpu::info(&sim);
    assert_eq!(info.attention_blocks_per_sm, plan::ATTENTION_BLOCKS_PER_SM, "the simulated device's residency");
    assert_eq!(info.target_blocks(), info.multiprocessors * plan::ATTENTION_BLOCKS_PER_SM);
    let resident = 132 * plan::ATTENTION_BLOCKS_PER_SM;
    let rows = sweep_waves(resident, |_, a, m| Chunks::for_cache(a, m, resident));
    println!("split attention on an H200 ({resident} resident blocks), the gpu-bench sweep:");
    println!("| model | context | batch | nodes | chunk | chunks | blocks | waves | last wave | just past |");
    let mut past = Vec::new();
    for r in &rows {
        let last = if r.waves.fract() == 0.0 { 1.0 } else { r.waves.fract() };
        let flag = just_past_a_wave(r.waves);
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.0}% | {} |",
            r.model,
            r.context,
            r.batch,
            r.nodes,
            r.chunks.chunk_len,
            r.chunks.n_splits,
            r.blocks,
            r.waves,
            100.0 * last,
            if flag { "YES" } else { "" }
        );
        if flag {
            past.push(format!("{} ctx {} b{} n{}", r.model, r.context, r.batch, r.nodes));
        }
        // Batch 1 (the latency-bound shapes) never lands just past a wave.
        assert!(r.batch > 1 || !flag, "{} ctx {} verify-{}: {:.2} waves", r.model, r.context, r.nodes, r.waves);
        // No shape wastes more than 10% of its waves' time on an unfilled last wave.
        let efficiency = r.waves / r.waves.ceil();
        assert!(r.waves < 1.0 || efficiency > 0.9, "{} ctx {} b{}: {:.2} waves", r.model, r.context, r.batch, r.waves);
    }
    println!("just past a wave: {}", if past.is_empty() { "none".to_string() } else { past.join(", ") });
    // The negative control: the old rule (chunks from the batch, div_ceil) at the shape.
    let old = sweep_waves(resident, |t, a, m| Chunks::batch_dependent(t, a, m, resident));
    let bad: Vec<_> = old.iter().filter(|r| r.batch == 1 && just_past_a_wave(r.waves)).collect();
    assert!(
        bad.iter().any(|r| r.model == "Llama-3-8B" && r.nodes == 8),
        "the old rule's verify-8 second wave went unnoticed"
    );
    println!(
        "the old batch-dependent rule: {} batch-1 shapes just past a wave (e.g. {} ctx {} verify-8: {} blocks, {:.2} waves)",
        bad.len(),
        bad[0].model,
        bad[0].context,
        bad[0].blocks,
        bad[0].waves
    );
}

/// RoPE (rotate-half pairs) at each row's position, in f32 from f64 angles, as the kernel computes it.
fn rotate(x: &[f32], pos: f64, inv_freq: &[f64]) -> Vec<f32> {
    let half = x.len() / 2;
    let mut out = x.to_vec();
    for i in 0..half {
        let (s, c) = (pos * inv_freq[i]).sin_cos();
        let (s, c) = (s as f32, c as f32);
        out[i] = x[i] * c - x[i + half] * s;
        out[i + half] = x[i + half] * c + x[i] * s;
    }
    round_bf16(&out)
}

pub fn rope_kv_write_rotates_at_non_zero_positions_and_writes_the_cache(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (h, kv, hd, theta) in [(4, 2, 64, 10_000.0f64), (8, 8, 128, 500_000.0)] {
            let a = AttnShape::new(h, kv, hd);
            let cache = CacheDims { layers: 2, slots: 3, max_len: 48, attn: a };
            let rows = 5;
            let mut rng = Rng::new(hd as u64);
            let q = round_bf16(&rng.vec(rows * h * hd, -2.0, 2.0));
            let k = round_bf16(&rng.vec(rows * cache.row(), -2.0, 2.0));
            let v = round_bf16(&rng.vec(rows * cache.row(), -2.0, 2.0));
            let inv_freq: Vec<f64> = (0..hd / 2).map(|i| theta.powf(-2.0 * i as f64 / hd as f64)).collect();
            // Row 3 is padding (slot -1: q rotated, nothing written); row 4's destination is past max_len.
            let (slot, pos, dst) = ([2, 0, 2, -1, 1], [0, 1, 1000, 7, 40_000], [0, 47, 5, 3, 48]);
            let (qb, kb, vb) = (dev.upload(&to_bf16(&q)), dev.upload(&to_bf16(&k)), dev.upload(&to_bf16(&v)));
            let (kc, vc) = (dev.zeros::<bf16>(cache.len()), dev.zeros::<bf16>(cache.len()));
            let (sb, pb, db, fb) = (dev.upload(&slot), dev.upload(&pos), dev.upload(&dst), dev.upload(&inv_freq));
            let meta = RowBufs { slot: sb.buf(), pos: pb.buf(), dst: db.buf() };
            let l =
                plan::rope_kv_write(cache, 1, rows, qb.buf(), kb.buf(), vb.buf(), kc.buf(), vc.buf(), meta, fb.buf());
            dev.launch(&l.unwrap()).unwrap();
            let (mut want_q, mut want_k, mut want_v) = (Vec::new(), vec![0f32; cache.len()], vec![0f32; cache.len()]);
            for r in 0..rows {
                let p = f64::from(pos[r]);
                for hh in 0..h {
                    want_q.extend(rotate(&q[(r * h + hh) * hd..][..hd], p, &inv_freq));
                }
                if slot[r] < 0 || dst[r] as usize >= cache.max_len {
                    continue;
                }
                for kh in 0..kv {
                    let src = (r * kv + kh) * hd;
                    let to = cache.layer_len() + ((slot[r] as usize * cache.max_len + dst[r] as usize) * kv + kh) * hd;
                    want_k[to..to + hd].copy_from_slice(&rotate(&k[src..src + hd], p, &inv_freq));
                    want_v[to..to + hd].copy_from_slice(&v[src..src + hd]);
                }
            }
            let close = |g: &[f32], w: &[f32]| g.iter().zip(w).all(|(a, b)| (a - b).abs() <= b.abs() * 2f32.powi(-7));
            assert!(close(&to_f32(&qb.download()), &want_q), "{order} h{h} d{hd}: q");
            assert!(close(&to_f32(&kc.download()), &want_k), "{order} h{h} d{hd}: k cache");
            assert_eq!(to_f32(&vc.download()), want_v, "{order} h{h} d{hd}: v cache");
        }
    }
    println!("rope_kv_write_bf16: positions 0, 1, 1000, 7, 40,000; theta 1e4 d64 GQA 2, 5e5 d128; a padded row, a row past max_len");
}

/// The fused q/k/v epilogue equals its parts: bias, per-head RMSNorm (Qwen3), RoPE, the cache write.
pub fn qkv_rope_kv_write_equals_bias_norm_rope_and_write(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (h, kv, hd, bias, norm) in
            [(4, 2, 64, false, false), (6, 2, 64, true, false), (8, 4, 128, false, true), (4, 2, 16, true, true)]
        {
            let a = AttnShape::new(h, kv, hd);
            let cache = CacheDims { layers: 2, slots: 3, max_len: 48, attn: a };
            let (qd, kvd) = (h * hd, kv * hd);
            let rows = 4;
            let mut rng = Rng::new(qd as u64 + u64::from(bias) + 2 * u64::from(norm));
            let qkv = round_bf16(&rng.vec(rows * (qd + 2 * kvd), -2.0, 2.0));
            let b = round_bf16(&rng.vec(qd + 2 * kvd, -0.5, 0.5));
            let (qn, kn) = (round_bf16(&rng.vec(hd, 0.5, 1.5)), round_bf16(&rng.vec(hd, 0.5, 1.5)));
            let inv_freq: Vec<f64> = (0..hd / 2).map(|i| 1e4f64.powf(-2.0 * i as f64 / hd as f64)).collect();
            let (slot, pos, dst) = ([1, 2, -1, 0], [5, 300, 2, 47], [5, 0, 1, 47]);
            let qkvb = dev.upload(&to_bf16(&qkv));
            let (bb, qnb, knb) = (dev.upload(&to_bf16(&b)), dev.upload(&to_bf16(&qn)), dev.upload(&to_bf16(&kn)));
            let (q_out, kc, vc) =
                (dev.zeros::<bf16>(rows * qd), dev.zeros::<bf16>(cache.len()), dev.zeros::<bf16>(cache.len()));
            let (sb, pb, db, fb) = (dev.upload(&slot), dev.upload(&pos), dev.upload(&dst), dev.upload(&inv_freq));
            let meta = RowBufs { slot: sb.buf(), pos: pb.buf(), dst: db.buf() };
            let l = plan::qkv_rope_kv_write(
                cache,
                1,
                rows,
                qkvb.buf(),
                bias.then(|| bb.buf()),
                norm.then(|| (qnb.buf(), knb.buf())),
                q_out.buf(),
                kc.buf(),
                vc.buf(),
                meta,
                fb.buf(),
                1e-6,
            );
            dev.launch(&l.unwrap()).unwrap();
            let (mut want_q, mut want_k, mut want_v) = (Vec::new(), vec![0f32; cache.len()], vec![0f32; cache.len()]);
            for r in 0..rows {
                let row: Vec<f32> =
                    (0..qd + 2 * kvd).map(|e| qkv[r * (qd + 2 * kvd) + e] + if bias { b[e] } else { 0.0 }).collect();
                let head = |hh: usize| {
                    let x = &row[hh * hd..(hh + 1) * hd];
                    if !norm {
                        return x.to_vec();
                    }
                    let w = if hh < h { &qn } else { &kn };
                    let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / hd as f64;
                    let inv = (1.0 / (ms + 1e-6).sqrt()) as f32;
                    x.iter().zip(w).map(|(&v, &g)| v * inv * g).collect()
                };
                for hh in 0..h {
                    want_q.extend(rotate(&head(hh), f64::from(pos[r]), &inv_freq));
                }
                if slot[r] < 0 {
                    continue;
                }
                let to = cache.layer_len() + (slot[r] as usize * cache.max_len + dst[r] as usize) * kvd;
                for kh in 0..kv {
                    want_k[to + kh * hd..][..hd].copy_from_slice(&rotate(&head(h + kh), f64::from(pos[r]), &inv_freq));
                }
                want_v[to..to + kvd].copy_from_slice(&round_bf16(&row[qd + kvd..]));
            }
            let close =
                |g: &[f32], w: &[f32]| g.iter().zip(w).all(|(a, b)| (a - b).abs() <= b.abs() * 2f32.powi(-7) + 1e-3);
            let ctx = format!("{order} h{h} kv{kv} d{hd} bias {bias} norm {norm}");
            assert!(close(&to_f32(&q_out.download()), &want_q), "{ctx}: q");
            assert!(close(&to_f32(&kc.download()), &want_k), "{ctx}: k cache");
            assert_eq!(to_f32(&vc.download()), want_v, "{ctx}: v cache");
        }
    }
    println!("qkv_rope_kv_write_bf16: plain (GQA 2, d64), with q/k/v bias (Qwen2), with q/k head norms (Qwen3, d128); a padded row");
}

/// Rows past a grid's y limit (65,535): the fused q/k/v epilogue puts rows in grid.x, so a prefill of 65,537 rows
/// runs whole; the last row's q and its cache write against the reference (the control: the old grid, rows in y,
/// is past the limit a launch takes).
pub fn qkv_rope_kv_write_takes_more_rows_than_a_grid_y(dev: &SimDevice) {
    let a = AttnShape::new(1, 1, 16);
    let cache = CacheDims { layers: 1, slots: 1, max_len: 8, attn: a };
    let rows = 65_537;
    let width = 3 * a.head_dim;
    let mut rng = Rng::new(65_537);
    let last = round_bf16(&rng.vec(width, -2.0, 2.0));
    let mut qkv = vec![0f32; rows * width];
    qkv[(rows - 1) * width..].copy_from_slice(&last);
    let inv_freq: Vec<f64> = (0..a.head_dim / 2).map(|i| 1e4f64.powf(-2.0 * i as f64 / a.head_dim as f64)).collect();
    // Every row padding (slot -1) but the last, which writes cache position 5 at RoPE position 70,000.
    let mut slot = vec![-1i32; rows];
    slot[rows - 1] = 0;
    let (pos, dst) = (vec![70_000i32; rows], vec![5i32; rows]);
    let qkvb = dev.upload(&to_bf16(&qkv));
    let (q_out, kc, vc) =
        (dev.zeros::<bf16>(rows * a.head_dim), dev.zeros::<bf16>(cache.len()), dev.zeros::<bf16>(cache.len()));
    let (sb, pb, db, fb) = (dev.upload(&slot), dev.upload(&pos), dev.upload(&dst), dev.upload(&inv_freq));
    let meta = RowBufs { slot: sb.buf(), pos: pb.buf(), dst: db.buf() };
    let l = plan::qkv_rope_kv_write(
        cache,
        0,
        rows,
        qkvb.buf(),
        None,
        None,
        q_out.buf(),
        kc.buf(),
        vc.buf(),
        meta,
        fb.buf(),
        1e-6,
    )
    .unwrap();
    assert_eq!(l.grid, [rows as u32, 3, 1], "rows in grid.x, head vectors in y");
    assert!(l.grid[0] > plan::MAX_GRID_Y, "the negative control: rows in y would be refused");
    dev.launch(&l).unwrap();
    let got_q = to_f32(&q_out.download());
    let want_q = rotate(&last[..16], 70_000.0, &inv_freq);
    let want_k = rotate(&last[16..32], 70_000.0, &inv_freq);
    let close = |g: &[f32], w: &[f32]| g.iter().zip(w).all(|(a, b)| (a - b).abs() <= b.abs() * 2f32.powi(-7) + 1e-3);
    assert!(close(&got_q[(rows - 1) * 16..], &want_q), "the last row's q");
    assert!(got_q[..(rows - 1) * 16].iter().all(|&x| x == 0.0), "zero rows rotate to zero");
    assert!(close(&to_f32(&kc.download())[5 * 16..6 * 16], &want_k), "the last row's k in the cache");
    assert_eq!(to_f32(&vc.download())[5 * 16..6 * 16], last[32..], "the last row's v in the cache");
    println!("qkv_rope_kv_write_bf16: 65,537 rows (grid.x), the last one's q, k and v against the reference");
}

kernel_tests!(
    decode_attention_over_contexts_groups_and_head_dims => [attention_split_bf16, tree_attention_bf16],
    tree_and_causal_chunk_attention => [attention_split_bf16, tree_attention_bf16],
    long_contexts_and_wide_trees => [attention_split_bf16, tree_attention_bf16],
    mma_probe_is_the_cpu_product => [mma_bf16_probe],
    negative_controls_are_caught => [attention_split_bf16, tree_attention_bf16],
    split_attention_rows_are_the_same_bits_alone_in_a_batch_and_in_a_tree => [attention_split_bf16],
    batch_dependent_chunks_fail_the_invariance_test => [attention_split_bf16],
    rope_kv_write_rotates_at_non_zero_positions_and_writes_the_cache => [rope_kv_write_bf16],
    qkv_rope_kv_write_equals_bias_norm_rope_and_write => [qkv_rope_kv_write_bf16],
    qkv_rope_kv_write_takes_more_rows_than_a_grid_y => [qkv_rope_kv_write_bf16],
);
