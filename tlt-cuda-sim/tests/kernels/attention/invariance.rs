//! Batch invariance of split attention (`attention_split_bf16` with [`Chunks::for_cache`]): a row's output bits are
//! the same decoding alone, decoding beside 63 other sequences, and as any node of a verify tree (a chain, branching
//! trees, alone or beside other trees) over the same keys, for the model shapes of the GPU sweep; every row against
//! the f64 reference. The negative control: the old batch-dependent chunking ([`Chunks::batch_dependent`]) fails the
//! same comparison.

use half::bf16;
use tlt_cuda_sim::{SimBuf, SimDevice};
use tlt_kernels::cuda::plan::{self, Chunks, SeqBufs, SplitParts};
use tlt_kernels::cuda::{ancestor_masks, CacheDims, TreeDims};
use tlt_kernels::AttnShape;

use super::first_miss;
use crate::common::{round_bf16, to_bf16, to_f32, Rng};

/// One sequence of an attention call: the K/V rows of its slot from position 0 (the rest of the slot holds junk,
/// as stale tree nodes do), its prefix, and its nodes (parents: a tree; `None`: one decode row).
struct Seq {
    k: Vec<f32>,
    v: Vec<f32>,
    prefix: usize,
    parents: Option<Vec<i32>>,
}

impl Seq {
    fn nodes(&self) -> usize {
        self.parents.as_ref().map_or(1, Vec::len)
    }
}

/// A committed prefix and a tree of draft nodes over it: keys, values and queries of each.
struct Story {
    prefix: usize,
    parents: Vec<i32>,
    /// `[prefix + nodes, row]`: the prefix's keys, then node j's.
    k: Vec<f32>,
    v: Vec<f32>,
    /// `[nodes, n_heads * head_dim]`.
    q: Vec<f32>,
}

impl Story {
    fn new(rng: &mut Rng, attn: AttnShape, prefix: usize, parents: Vec<i32>) -> Self {
        let row = attn.n_kv_heads * attn.head_dim;
        let n = parents.len();
        let k = round_bf16(&rng.vec((prefix + n) * row, -0.5, 0.5));
        let v = round_bf16(&rng.vec((prefix + n) * row, -1.0, 1.0));
        let q = round_bf16(&rng.vec(n * attn.n_heads * attn.head_dim, -0.5, 0.5));
        Self { prefix, parents, k, v, q }
    }

    /// Node j's ancestors from the root to j.
    fn path(&self, j: usize) -> Vec<usize> {
        let mut p = vec![j];
        while let Some(&up) = p.last().and_then(|&i| self.parents.get(i)).filter(|&&up| up >= 0) {
            p.push(up as usize);
        }
        p.reverse();
        p
    }

    /// The verify call's sequence: the prefix, then every node at cache position prefix + j.
    fn verify(&self) -> Seq {
        Seq { k: self.k.clone(), v: self.v.clone(), prefix: self.prefix, parents: Some(self.parents.clone()) }
    }

    /// Plain decoding's sequence when node j is decoded: the prefix and j's ancestors committed, j the new row.
    fn decode(&self, j: usize, row: usize) -> Seq {
        let pick = |x: &[f32]| {
            let mut out = x[..self.prefix * row].to_vec();
            for &a in &self.path(j) {
                out.extend_from_slice(&x[(self.prefix + a) * row..(self.prefix + a + 1) * row]);
            }
            out
        };
        Seq { k: pick(&self.k), v: pick(&self.v), prefix: self.prefix + self.path(j).len() - 1, parents: None }
    }

    fn query(&self, j: usize, width: usize) -> &[f32] {
        &self.q[j * width..(j + 1) * width]
    }
}

/// Runs one attention call over `seqs` (queries `q`, `[batch, n_max, n_heads, head_dim]`) with `chunks`; returns the
/// output and checks the arrival counters are left zero.
fn call(
    dev: &SimDevice,
    attn: AttnShape,
    max_len: usize,
    seqs: &[Seq],
    n_max: usize,
    q: &[f32],
    chunks: Chunks,
) -> Vec<bf16> {
    let batch = seqs.len();
    let cache = CacheDims { layers: 1, slots: batch, max_len, attn };
    let tree = TreeDims { batch, n_max };
    let row = cache.row();
    // Junk everywhere first (stale positions past a sequence's keys), then each sequence in a reversed slot.
    let mut rng = Rng::new(batch as u64 * 31 + n_max as u64);
    let (mut kc, mut vc) = (round_bf16(&rng.vec(cache.len(), -4.0, 4.0)), round_bf16(&rng.vec(cache.len(), -4.0, 4.0)));
    let slots: Vec<i32> = (0..batch).map(|b| (batch - 1 - b) as i32).collect();
    for (s, &slot) in seqs.iter().zip(&slots) {
        let at = slot as usize * max_len * row;
        kc[at..at + s.k.len()].copy_from_slice(&s.k);
        vc[at..at + s.v.len()].copy_from_slice(&s.v);
    }
    let tree_mode = seqs.iter().any(|s| s.parents.is_some());
    let anc = tree_mode.then(|| {
        let mut m = vec![0u64; tree.nodes()];
        for (b, s) in seqs.iter().enumerate() {
            let p = s.parents.clone().unwrap_or_else(|| vec![-1]);
            m[b * n_max..b * n_max + p.len()].copy_from_slice(&ancestor_masks(&p).unwrap());
        }
        m
    });
    let to_i32 = |v: Vec<usize>| v.into_iter().map(|n| n as i32).collect::<Vec<_>>();
    let (kb, vb) = (dev.upload(&to_bf16(&kc)), dev.upload(&to_bf16(&vc)));
    let qb = dev.upload(&to_bf16(q));
    let out: SimBuf<bf16> = dev.zeros(q.len());
    let slot = dev.upload(&slots);
    let prefix = dev.upload(&to_i32(seqs.iter().map(|s| s.prefix).collect()));
    let nodes = dev.upload(&to_i32(seqs.iter().map(Seq::nodes).collect()));
    let anc = anc.as_ref().map(|m| dev.upload(m));
    let seq = SeqBufs { slot: slot.buf(), prefix_len: prefix.buf(), n_nodes: nodes.buf() };
    let [po, pml, pa] = chunks.part_lens(tree, attn);
    let parts = (dev.zeros::<f32>(po), dev.zeros::<f32>(pml), dev.zeros::<i32>(pa));
    let bufs = SplitParts { o: parts.0.buf(), ml: parts.1.buf(), arrivals: parts.2.buf() };
    let launches = plan::attention(
        cache,
        0,
        tree,
        chunks,
        qb.buf(),
        kb.buf(),
        vb.buf(),
        out.buf(),
        seq,
        anc.as_ref().map(SimBuf::buf),
        (chunks.n_splits > 1).then_some(bufs),
    )
    .unwrap();
    assert_eq!(launches.len(), 1);
    assert_eq!(launches[0].kernel, "attention_split_bf16");
    dev.launch(&launches[0]).unwrap();
    assert!(parts.2.download().iter().all(|&n| n == 0), "arrival counters left non-zero");
    out.download()
}

/// The f64 reference of one decode row (query `q`, keys and values `seq.k`, `seq.v` up to the row's own).
fn reference(attn: AttnShape, seq: &Seq, q: &[f32]) -> Vec<f32> {
    let (hd, group, row) = (attn.head_dim, attn.n_heads / attn.n_kv_heads, attn.n_kv_heads * attn.head_dim);
    let keys = seq.prefix + 1;
    let scale = 1.0 / f64::from(hd as f32).sqrt();
    let mut out = vec![0f32; attn.n_heads * hd];
    for h in 0..attn.n_heads {
        let at = |t: usize| t * row + (h / group) * hd;
        let s: Vec<f64> = (0..keys)
            .map(|t| (0..hd).map(|d| f64::from(q[h * hd + d]) * f64::from(seq.k[at(t) + d])).sum::<f64>() * scale)
            .collect();
        let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum();
        for d in 0..hd {
            let o: f64 = (0..keys).map(|t| (s[t] - mx).exp() * f64::from(seq.v[at(t) + d])).sum();
            out[h * hd + d] = (o / sum) as f32;
        }
    }
    out
}

/// How a test picks the chunking of each call (batch, n_max).
type Rule<'a> = &'a dyn Fn(TreeDims) -> Chunks;

/// Rows whose bits differ between the ways of computing them, out of the rows compared (every node of every story,
/// each as a decode row alone, the same row in a batch of 64 decode rows, and the node in verify calls: the chain
/// alone at n_max 8, every story's tree together at n_max 20, the chain beside a second tree at n_max 8).
fn differing_rows(dev: &SimDevice, attn: AttnShape, max_len: usize, stories: &[Story], rule: Rule) -> (usize, usize) {
    let (row, width) = (attn.n_kv_heads * attn.head_dim, attn.n_heads * attn.head_dim);
    let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let nodes: Vec<(usize, usize)> =
        stories.iter().enumerate().flat_map(|(s, st)| (0..st.parents.len()).map(move |j| (s, j))).collect();
    // (a) Each node's decode row alone, checked against the f64 reference.
    let alone: Vec<Vec<u16>> = nodes
        .iter()
        .map(|&(s, j)| {
            let seq = stories[s].decode(j, row);
            let q = stories[s].query(j, width);
            let out = call(dev, attn, max_len, std::slice::from_ref(&seq), 1, q, rule(TreeDims { batch: 1, n_max: 1 }));
            let want = reference(attn, &seq, q);
            if let Some(i) = first_miss(&to_f32(&out), &want) {
                panic!("{attn:?} story {s} node {j}: element {i}: {} vs {}", out[i], want[i]);
            }
            bits(&out)
        })
        .collect();
    let mut differ = 0;
    let mut compared = 0;
    let mut compare = |got: &[u16], k: usize| {
        compared += 1;
        differ += usize::from(got != alone[k].as_slice());
    };
    // (b) All of them in one batch of 64 decode rows, between sequences of random lengths.
    let mut rng = Rng::new(64);
    let mut seqs = Vec::new();
    let mut q = Vec::new();
    let mut at = Vec::new();
    for b in 0..64 {
        if b % 2 == 1 && at.len() < nodes.len() || 64 - b <= nodes.len() - at.len() {
            let (s, j) = nodes[at.len()];
            at.push(b);
            seqs.push(stories[s].decode(j, row));
            q.extend_from_slice(stories[s].query(j, width));
        } else {
            let prefix = rng.below(max_len - 1);
            let (k, v) = (
                round_bf16(&rng.vec((prefix + 1) * row, -0.5, 0.5)),
                round_bf16(&rng.vec((prefix + 1) * row, -1.0, 1.0)),
            );
            seqs.push(Seq { k, v, prefix, parents: None });
            q.extend(round_bf16(&rng.vec(width, -0.5, 0.5)));
        }
    }
    assert_eq!(at.len(), nodes.len(), "every node has its row in the batch of 64");
    let out = call(dev, attn, max_len, &seqs, 1, &q, rule(TreeDims { batch: 64, n_max: 1 }));
    for (k, &b) in at.iter().enumerate() {
        compare(&bits(&out[b * width..(b + 1) * width]), k);
    }
    // (c) As nodes of verify trees: (calls, n_max) with the stories each holds.
    let other = Story::new(&mut rng, attn, 90, vec![-1, 0, 1, 1, 0, 4, 2, 6]);
    let calls: [(Vec<&Story>, usize); 3] =
        [(vec![&stories[0]], 8), (stories.iter().collect(), 20), (vec![&other, &stories[0]], 8)];
    for (members, n_max) in calls {
        let seqs: Vec<Seq> = members.iter().map(|s| s.verify()).collect();
        let mut q = vec![0f32; members.len() * n_max * width];
        for (b, s) in members.iter().enumerate() {
            q[b * n_max * width..][..s.q.len()].copy_from_slice(&s.q);
        }
        let out = call(dev, attn, max_len, &seqs, n_max, &q, rule(TreeDims { batch: members.len(), n_max }));
        for (b, s) in members.iter().enumerate() {
            let Some(si) = stories.iter().position(|x| std::ptr::eq(x, *s)) else { continue };
            for j in 0..s.parents.len() {
                let k = nodes.iter().position(|&n| n == (si, j)).unwrap();
                compare(&bits(&out[(b * n_max + j) * width..][..width]), k);
            }
        }
    }
    (differ, compared)
}

/// The stories of a shape: a chain of 8 over 253 keys (its nodes cross the chunk boundary at 256), a branching tree
/// of 8 over 173 (crossing the tile at 176), and a tree of 20 nodes, depth 6, over 125 (crossing 128).
fn stories(attn: AttnShape, seed: u64) -> Vec<Story> {
    let mut rng = Rng::new(seed);
    let wide = vec![-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 7, 9, 10, 11, 12, 13, 14, 16];
    vec![
        Story::new(&mut rng, attn, 253, (-1..7).collect()),
        Story::new(&mut rng, attn, 173, vec![-1, 0, 0, 1, 1, 2, 5, 3]),
        Story::new(&mut rng, attn, 125, wide),
    ]
}

/// The cache of these tests: 400 positions; on an H100 or H200 (264 resident blocks) chunks of 128 keys.
const MAX_LEN: usize = 400;

pub fn split_attention_rows_are_the_same_bits_alone_in_a_batch_and_in_a_tree(dev: &SimDevice) {
    let shapes = [
        ("SmolLM2-135M", AttnShape::new(9, 3, 64)),
        ("Llama-3-8B / Qwen3-8B", AttnShape::new(32, 8, 128)),
        ("groups of 1 (16 nodes a row tile)", AttnShape::new(4, 4, 64)),
    ];
    let mut report = Vec::new();
    for (i, (name, attn)) in shapes.into_iter().enumerate() {
        let st = stories(attn, 100 + i as u64);
        let cache = Chunks::for_cache(attn, MAX_LEN, 264);
        assert_eq!(cache.chunk_len, 128, "{name}: the H100's chunking of a 400-key cache");
        let (differ, n) = differing_rows(dev, attn, MAX_LEN, &st, &|_| cache);
        assert_eq!(differ, 0, "{name}: {differ} of {n} rows differ from the row decoded alone");
        report.push(format!("{name} {n} rows"));
        if i == 0 {
            // Another fixed chunking (64 keys: 7 chunks): as invariant.
            let short = Chunks { n_splits: MAX_LEN.div_ceil(64), chunk_len: 64 };
            let (differ, n) = differing_rows(dev, attn, MAX_LEN, &st, &|_| short);
            assert_eq!(differ, 0, "{name}, chunks of 64: {differ} of {n} rows differ");
        }
    }
    println!(
        "split attention, chunks of 128 keys (an H100's for a 400-key cache): every node of a chain of 8, a tree of 8 \
         and a tree of 20 is the same bits decoded alone, in a batch of 64 and as a verify node (alone, beside \
         other trees): {}; SmolLM2 also with chunks of 64",
        report.join(", ")
    );
}

/// The negative control: with the chunk count taken from the batch (the old rule), the same comparison fails.
pub fn batch_dependent_chunks_fail_the_invariance_test(dev: &SimDevice) {
    let mut report = Vec::new();
    for (i, attn) in [AttnShape::new(9, 3, 64), AttnShape::new(32, 8, 128)].into_iter().enumerate() {
        let st = stories(attn, 100 + i as u64);
        let (differ, n) = differing_rows(dev, attn, MAX_LEN, &st, &|t| Chunks::batch_dependent(t, attn, MAX_LEN, 264));
        assert!(differ > 0, "{attn:?}: chunks from the batch went unnoticed ({n} rows compared)");
        report.push(format!("{differ} of {n} rows of {attn:?}"));
    }
    println!("negative control: the batch-dependent chunking changes the bits of {}", report.join(", "));
}
