//! Tree attention's position invariance, by bits: a token's output depends only on its own visible key rows in
//! order (the committed prefix, then its ancestors by depth), never on where the round started, on its siblings or
//! on how many tokens share the call. So a verify tree's node, a prefill chunk's token and a plain decode step at the
//! same position give the same bits, which is what lets speculative decoding commit plain decoding's tokens with
//! plain decoding's log-probabilities. The control: the same keys in another order (the same softmax, up to
//! rounding) must change the bits, or the comparison could not see an order change at all.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use tlt_kernels::{tree_attention_with, AttnShape, Isa, Visibility};

fn values(n: usize, seed: u64) -> Vec<f32> {
    tlt_kernels::SeededRng::new(seed).uniform_vec(n, -2.0, 2.0)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// A random problem: queries for `n` new tokens, keys and values for `base + n` rows.
struct Case {
    shape: AttnShape,
    base: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Case {
    fn new(shape: AttnShape, base: usize, n: usize, seed: u64) -> Self {
        let kvw = shape.kv_width();
        Self {
            shape,
            base,
            q: values(n * shape.q_width(), seed),
            k: values((base + n) * kvw, seed + 1),
            v: values((base + n) * kvw, seed + 2),
        }
    }

    fn row<'a>(&self, x: &'a [f32], r: usize, width: usize) -> &'a [f32] {
        &x[r * width..(r + 1) * width]
    }

    /// Token `i`'s output decoded alone: one causal step over the prefix and `path`'s rows (new-token indices,
    /// ending with `i`) laid out contiguously, so its position is `base + path.len() - 1`.
    fn decode_alone(&self, isa: Isa, path: &[usize], prefix_order: &[usize]) -> Vec<f32> {
        let (kvw, qw) = (self.shape.kv_width(), self.shape.q_width());
        let rows: Vec<usize> = prefix_order.iter().copied().chain(path.iter().map(|&x| self.base + x)).collect();
        let gather = |src: &[f32]| -> Vec<f32> { rows.iter().flat_map(|&r| self.row(src, r, kvw).to_vec()).collect() };
        let (k, v) = (gather(&self.k), gather(&self.v));
        let i = *path.last().unwrap();
        let mut out = vec![0.0; qw];
        let at = rows.len() - 1;
        tree_attention_with(isa, self.row(&self.q, i, qw), &k, &v, at, Visibility::Causal, self.shape, 0.3, &mut out)
            .unwrap();
        out
    }
}

/// Root-to-node paths of a tree given by `parents`.
fn paths(parents: &[Option<usize>]) -> Vec<Vec<usize>> {
    (0..parents.len())
        .map(|i| {
            let mut path = vec![i];
            while let Some(p) = parents[*path.last().unwrap()] {
                path.push(p);
            }
            path.reverse();
            path
        })
        .collect()
}

/// Every node of the tree, beside its siblings, against its path decoded alone; `None` when all bits agree.
fn first_tree_difference(isa: Isa, c: &Case, parents: &[Option<usize>]) -> Option<String> {
    let qw = c.shape.q_width();
    let mut out = vec![0.0; parents.len() * qw];
    tree_attention_with(isa, &c.q, &c.k, &c.v, c.base, Visibility::Tree(parents), c.shape, 0.3, &mut out).unwrap();
    let prefix: Vec<usize> = (0..c.base).collect();
    paths(parents).iter().enumerate().find_map(|(i, path)| {
        let alone = c.decode_alone(isa, path, &prefix);
        (bits(&alone) != bits(&out[i * qw..(i + 1) * qw]))
            .then(|| format!("{isa:?} {:?} base {} node {i} (path {path:?})", c.shape, c.base))
    })
}

fn tree_from(raw: &[(bool, prop::sample::Index)]) -> Vec<Option<usize>> {
    raw.iter().enumerate().map(|(i, (root, p))| if *root || i == 0 { None } else { Some(p.index(i)) }).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_tree_node_is_the_bits_of_its_path_decoded_alone(
        raw in prop::collection::vec((prop::bool::weighted(0.15), any::<prop::sample::Index>()), 1..48),
        base in 0usize..100,
        d_pick in 0usize..3,
        kvh in 1usize..3,
        ratio in 1usize..=3,
        seed in any::<u64>(),
    ) {
        let shape = AttnShape::new(kvh * ratio, kvh, [8, 64, 80][d_pick]);
        let c = Case::new(shape, base, raw.len(), seed);
        for isa in Isa::available() {
            let diff = first_tree_difference(isa, &c, &tree_from(&raw));
            prop_assert!(diff.is_none(), "{}", diff.unwrap_or_default());
        }
    }

    #[test]
    fn a_prefill_chunk_is_the_bits_of_decoding_token_by_token(
        n in 1usize..80,
        base in 0usize..100,
        d_pick in 0usize..3,
        seed in any::<u64>(),
    ) {
        let shape = AttnShape::new(6, 2, [8, 64, 80][d_pick]);
        let c = Case::new(shape, base, n, seed);
        let qw = shape.q_width();
        for isa in Isa::available() {
            let mut chunk = vec![0.0; n * qw];
            tree_attention_with(isa, &c.q, &c.k, &c.v, base, Visibility::Causal, shape, 0.3, &mut chunk).unwrap();
            let prefix: Vec<usize> = (0..base).collect();
            for i in 0..n {
                let path: Vec<usize> = (0..=i).collect();
                let alone = c.decode_alone(isa, &path, &prefix);
                prop_assert_eq!(bits(&alone), bits(&chunk[i * qw..(i + 1) * qw]), "{:?} token {}", isa, i);
            }
        }
    }
}

#[test]
fn the_control_the_same_keys_in_another_order_change_the_bits() {
    let shape = AttnShape::new(9, 3, 64);
    let parents = [None, Some(0), Some(0), Some(1), Some(2), Some(4)];
    let c = Case::new(shape, 70, parents.len(), 17);
    for isa in Isa::available() {
        assert_eq!(first_tree_difference(isa, &c, &parents), None, "{isa:?}: the case itself must agree");
        let path = &paths(&parents)[5];
        let forward: Vec<usize> = (0..c.base).collect();
        let reversed: Vec<usize> = forward.iter().rev().copied().collect();
        let (a, b) = (c.decode_alone(isa, path, &forward), c.decode_alone(isa, path, &reversed));
        let close = a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + x.abs()));
        assert!(close, "{isa:?}: a permuted prefix is the same attention up to rounding");
        assert_ne!(bits(&a), bits(&b), "{isa:?}: the bit comparison cannot see the keys' order");
    }
}
