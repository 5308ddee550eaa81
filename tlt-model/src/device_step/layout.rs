//! The host side of a device forward: the batch's padded layout and the metadata the kernels read, validated.

use tlt_kernels::cuda::ancestor_masks;
use tlt_kernels::cuda::packing::Packing;
use tlt_kernels::cuda::plan::Buf;

use crate::{Error, Result};

/// One sequence's new tokens in a device forward.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSeq<'a> {
    /// Its cache slot (`< slots`).
    pub slot: usize,
    /// Its committed positions; the new tokens' K/V go to `prefix_len..prefix_len + tokens.len()`.
    pub prefix_len: usize,
    /// The new tokens.
    pub tokens: &'a [u32],
    /// `None`: a causal append (prefill chunk, decode). `Some(parents)`: a draft tree whose node 0 is the root
    /// (`parents[0] < 0`) and whose other nodes' parents precede them (at most 64 nodes). Node `i` sits at position
    /// `prefix_len + depth(i)`.
    pub parents: Option<&'a [i32]>,
}

/// The host-side layout of one forward: padded tokens and the device metadata, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepLayout {
    /// Rows per sequence (its longest run of new tokens).
    pub n_max: usize,
    /// `[batch * n_max]`: token of every row (0 in padding).
    pub tokens: Vec<i32>,
    /// `[batch * n_max]`: cache slot of every row (-1 in padding).
    pub row_slot: Vec<i32>,
    /// `[batch * n_max]`: RoPE position of every row (a tree node's prefix length + depth).
    pub row_pos: Vec<i32>,
    /// `[batch * n_max]`: cache position of every row's K/V.
    pub row_dst: Vec<i32>,
    /// `[batch]`: cache slot of every sequence.
    pub seq_slot: Vec<i32>,
    /// `[batch]`: committed positions of every sequence.
    pub seq_prefix: Vec<i32>,
    /// `[batch]`: new tokens of every sequence.
    pub seq_nodes: Vec<i32>,
    /// Ancestor masks `[batch * n_max]` when any sequence is a tree (causal ones get chain masks).
    pub anc: Option<Vec<u64>>,
}

/// Lays out and checks a batch: slots in range and distinct, tokens in the vocabulary, positions within `max_len`.
pub fn layout(seqs: &[DeviceSeq<'_>], vocab: usize, slots: usize, max_len: usize) -> Result<StepLayout> {
    let bad = |m: String| Err(Error::InvalidInput(m));
    if seqs.is_empty() {
        return bad("a device forward needs at least one sequence".into());
    }
    let n_max = seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    let any_tree = seqs.iter().any(|s| s.parents.is_some());
    let mut l = StepLayout::padding(seqs.len(), n_max, any_tree);
    for (b, s) in seqs.iter().enumerate() {
        let n = s.tokens.len();
        if n == 0 {
            return bad(format!("sequence {b} has no tokens"));
        }
        if s.slot >= slots || seqs[..b].iter().any(|o| o.slot == s.slot) {
            return bad(format!("sequence {b}: slot {} is out of range ({slots}) or used twice", s.slot));
        }
        if s.prefix_len + n > max_len {
            return bad(format!("sequence {b}: {} + {n} positions exceed the cache's {max_len}", s.prefix_len));
        }
        if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("sequence {b}: token id {t} >= vocab size {vocab}"));
        }
        let depth: Vec<usize> = match s.parents {
            None => (0..n).collect(),
            Some(p) => {
                if p.len() != n {
                    return bad(format!("sequence {b}: {} parents for {n} tokens", p.len()));
                }
                let masks = ancestor_masks(p)?;
                if let Some(anc) = l.anc.as_mut() {
                    anc[b * n_max..b * n_max + n].copy_from_slice(&masks);
                }
                masks.iter().map(|m| m.count_ones() as usize - 1).collect()
            }
        };
        if s.parents.is_none() {
            if let Some(anc) = l.anc.as_mut() {
                if n > tlt_kernels::cuda::MAX_TREE_NODES {
                    return bad(format!("sequence {b}: a causal chunk of {n} tokens cannot share a batch with trees"));
                }
                for j in 0..n {
                    anc[b * n_max + j] = if j == 63 { u64::MAX } else { (1u64 << (j + 1)) - 1 };
                }
            }
        }
        for (j, (&tok, &d)) in s.tokens.iter().zip(&depth).enumerate() {
            let r = b * n_max + j;
            l.tokens[r] = tok as i32;
            l.row_slot[r] = s.slot as i32;
            l.row_pos[r] = (s.prefix_len + d) as i32;
            l.row_dst[r] = (s.prefix_len + j) as i32;
        }
        l.seq_slot.push(s.slot as i32);
        l.seq_prefix.push(s.prefix_len as i32);
        l.seq_nodes.push(n as i32);
    }
    Ok(l)
}

/// The `n_max` a batch of trees runs at: its largest tree rounded up to a power of two (at most 64 nodes), so a
/// handful of verification shapes (and graphs) serve every tree size.
#[must_use]
pub fn tree_rows_bucket(n_max: usize) -> usize {
    n_max.next_power_of_two().min(tlt_kernels::cuda::MAX_TREE_NODES).max(n_max)
}

impl StepLayout {
    /// A layout of `batch` sequences of `n_max` rows that are all padding (token 0, no slot, position 0, masks 0
    /// when `tree`), with room for `batch` sequences' entries: what a layout is filled in from.
    #[must_use]
    pub fn padding(batch: usize, n_max: usize, tree: bool) -> Self {
        let rows = batch * n_max;
        Self {
            n_max,
            tokens: vec![0; rows],
            row_slot: vec![-1; rows],
            row_pos: vec![0; rows],
            row_dst: vec![0; rows],
            seq_slot: Vec::with_capacity(batch),
            seq_prefix: Vec::with_capacity(batch),
            seq_nodes: Vec::with_capacity(batch),
            anc: tree.then(|| vec![0u64; rows]),
        }
    }

    /// The same batch laid out with `n_max` rows per sequence (at least its own): the extra rows are padding
    /// (token 0, no slot, position 0, ancestor mask 0), which every kernel skips.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an `n_max` below the layout's.
    pub fn padded_to(&self, n_max: usize) -> Result<Self> {
        if n_max < self.n_max {
            return Err(Error::InvalidInput(format!("{} rows per sequence padded to {n_max}", self.n_max)));
        }
        let (batch, old) = (self.seq_slot.len(), self.n_max);
        let pad = |v: &[i32], fill: i32| -> Vec<i32> {
            let mut out = vec![fill; batch * n_max];
            for b in 0..batch {
                out[b * n_max..b * n_max + old].copy_from_slice(&v[b * old..(b + 1) * old]);
            }
            out
        };
        let anc = self.anc.as_ref().map(|a| {
            let mut out = vec![0u64; batch * n_max];
            for b in 0..batch {
                out[b * n_max..b * n_max + old].copy_from_slice(&a[b * old..(b + 1) * old]);
            }
            out
        });
        Ok(Self {
            n_max,
            tokens: pad(&self.tokens, 0),
            row_slot: pad(&self.row_slot, -1),
            row_pos: pad(&self.row_pos, 0),
            row_dst: pad(&self.row_dst, 0),
            seq_slot: self.seq_slot.clone(),
            seq_prefix: self.seq_prefix.clone(),
            seq_nodes: self.seq_nodes.clone(),
            anc,
        })
    }
}

/// The metadata buffers a step's kernels read, segments of one packed buffer ([`StepMeta`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetaBufs {
    /// `[rows]` tokens.
    pub tokens: Buf<i32>,
    /// `[rows]` cache slots (-1: padding).
    pub row_slot: Buf<i32>,
    /// `[rows]` RoPE positions.
    pub row_pos: Buf<i32>,
    /// `[rows]` cache positions.
    pub row_dst: Buf<i32>,
    /// `[batch]` cache slots.
    pub seq_slot: Buf<i32>,
    /// `[batch]` committed positions.
    pub seq_prefix: Buf<i32>,
    /// `[batch]` new tokens.
    pub seq_nodes: Buf<i32>,
    /// `[rows]` ancestor masks (tree shapes).
    pub anc: Option<Buf<u64>>,
}

/// A step shape's metadata packed into one buffer, so the host sends it in one copy (from a pinned staging buffer
/// on a GPU): the [`StepLayout`] arrays padded to `batch` sequences of `n_max` rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepMeta {
    batch: usize,
    n_max: usize,
    tree: bool,
    packing: Packing,
}

impl StepMeta {
    /// The packing of a `(batch, n_max)` shape, with ancestor masks when `tree`.
    #[must_use]
    pub fn new(batch: usize, n_max: usize, tree: bool) -> Self {
        let rows = batch * n_max;
        let mut segs = vec![rows * 4, rows * 4, rows * 4, rows * 4, batch * 4, batch * 4, batch * 4];
        if tree {
            segs.push(rows * 8);
        }
        Self { batch, n_max, tree, packing: Packing::new(&segs) }
    }

    /// Bytes of the packed buffer.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.packing.bytes()
    }

    /// Writes `l` into the host bytes `host`, padded: padding rows are slot-less (slot -1) at position 0 with token
    /// 0, padded sequences have slot 0, no committed keys and no nodes (every kernel skips them), padding masks 0.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `l` is not of this shape (more sequences, another `n_max`, masks on a causal
    /// shape or none on a tree shape); [`Error::Kernel`] (the packing's) when `host` is shorter than
    /// [`StepMeta::bytes`].
    pub fn write(&self, l: &StepLayout, host: &mut [u8]) -> Result<()> {
        if l.n_max != self.n_max || l.seq_slot.len() > self.batch || l.anc.is_some() != self.tree {
            return Err(Error::InvalidInput(format!(
                "a layout of {} sequences x {} rows (tree: {}) in a step shape of {} x {} (tree: {})",
                l.seq_slot.len(),
                l.n_max,
                l.anc.is_some(),
                self.batch,
                self.n_max,
                self.tree
            )));
        }
        let p = &self.packing;
        let put = |host: &mut [u8], seg: usize, v: &[i32], fill: i32| p.put(host, seg, v, fill);
        put(host, 0, &l.tokens, 0)?;
        put(host, 1, &l.row_slot, -1)?;
        put(host, 2, &l.row_pos, 0)?;
        put(host, 3, &l.row_dst, 0)?;
        put(host, 4, &l.seq_slot, 0)?;
        put(host, 5, &l.seq_prefix, 0)?;
        put(host, 6, &l.seq_nodes, 0)?;
        if let Some(a) = &l.anc {
            p.put(host, 7, a, 0u64)?;
        }
        Ok(())
    }

    /// The metadata segments of the packed device buffer `base`.
    ///
    /// # Errors
    /// [`Error::Kernel`] when `base` is shorter than [`StepMeta::bytes`].
    pub fn bufs(&self, base: Buf<u8>) -> Result<MetaBufs> {
        let p = &self.packing;
        Ok(MetaBufs {
            tokens: p.buf(base, 0)?,
            row_slot: p.buf(base, 1)?,
            row_pos: p.buf(base, 2)?,
            row_dst: p.buf(base, 3)?,
            seq_slot: p.buf(base, 4)?,
            seq_prefix: p.buf(base, 5)?,
            seq_nodes: p.buf(base, 6)?,
            anc: if self.tree { Some(p.buf(base, 7)?) } else { None },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_pads_rows_and_places_tree_nodes_by_depth() {
        let (a, t) = ([5u32, 6, 7], [1u32, 2, 3, 4]);
        let parents = [-1, 0, 0, 1];
        let seqs = [
            DeviceSeq { slot: 2, prefix_len: 10, tokens: &a, parents: None },
            DeviceSeq { slot: 0, prefix_len: 4, tokens: &t, parents: Some(&parents) },
        ];
        let l = layout(&seqs, 100, 3, 64).unwrap();
        assert_eq!(l.n_max, 4);
        assert_eq!(l.tokens, vec![5, 6, 7, 0, 1, 2, 3, 4]);
        assert_eq!(l.row_slot, vec![2, 2, 2, -1, 0, 0, 0, 0]);
        assert_eq!(l.row_pos, vec![10, 11, 12, 0, 4, 5, 5, 6]);
        assert_eq!(l.row_dst, vec![10, 11, 12, 0, 4, 5, 6, 7]);
        assert_eq!((l.seq_slot, l.seq_prefix, l.seq_nodes), (vec![2, 0], vec![10, 4], vec![3, 4]));
        assert_eq!(l.anc.unwrap(), vec![0b1, 0b11, 0b111, 0, 0b1, 0b11, 0b101, 0b1011]);
    }

    #[test]
    fn layout_rejects_bad_batches() {
        let t = [1u32, 2];
        let ok = DeviceSeq { slot: 0, prefix_len: 0, tokens: &t, parents: None };
        assert!(layout(&[], 10, 1, 8).is_err());
        assert!(layout(&[DeviceSeq { slot: 1, ..ok }], 10, 1, 8).is_err(), "slot out of range");
        assert!(layout(&[ok, ok], 10, 2, 8).is_err(), "slot twice");
        assert!(layout(&[DeviceSeq { prefix_len: 7, ..ok }], 10, 1, 8).is_err(), "past max_len");
        assert!(layout(&[DeviceSeq { tokens: &[10], ..ok }], 10, 1, 8).is_err(), "token id");
        assert!(layout(&[DeviceSeq { parents: Some(&[-1]), ..ok }], 10, 1, 8).is_err(), "parents length");
        assert!(layout(&[DeviceSeq { parents: Some(&[0, 0]), ..ok }], 10, 1, 8).is_err(), "root with a parent");
        let long = vec![1u32; 65];
        let tree = DeviceSeq { slot: 1, prefix_len: 0, tokens: &t, parents: Some(&[-1, 0]) };
        assert!(layout(&[DeviceSeq { tokens: &long, ..ok }, tree], 10, 2, 128).is_err(), "long chunk beside a tree");
        assert!(layout(&[DeviceSeq { tokens: &long, ..ok }], 10, 2, 128).is_ok(), "a long causal chunk alone");
    }

    #[test]
    fn padding_rows_keeps_every_sequence_in_place() {
        let (a, t) = ([5u32, 6], [1u32, 2, 3]);
        let seqs = [
            DeviceSeq { slot: 2, prefix_len: 10, tokens: &a, parents: Some(&[-1, 0]) },
            DeviceSeq { slot: 0, prefix_len: 4, tokens: &t, parents: Some(&[-1, 0, 0]) },
        ];
        let l = layout(&seqs, 100, 3, 64).unwrap();
        assert_eq!(tree_rows_bucket(l.n_max), 4);
        let p = l.padded_to(4).unwrap();
        assert_eq!(p.tokens, [5, 6, 0, 0, 1, 2, 3, 0]);
        assert_eq!(p.row_slot, [2, 2, -1, -1, 0, 0, 0, -1]);
        assert_eq!(p.row_pos, [10, 11, 0, 0, 4, 5, 5, 0]);
        assert_eq!(p.anc.unwrap(), [0b1, 0b11, 0, 0, 0b1, 0b11, 0b101, 0]);
        assert_eq!((p.seq_nodes, p.n_max), (vec![2, 3], 4));
        assert!(l.padded_to(2).is_err());
        assert_eq!(
            [tree_rows_bucket(1), tree_rows_bucket(5), tree_rows_bucket(33), tree_rows_bucket(64)],
            [1, 8, 64, 64]
        );
    }

    #[test]
    fn step_meta_packs_the_layout_padded_and_refuses_other_shapes() {
        let (a, t) = ([5u32, 6], [1u32, 2]);
        let seqs = [
            DeviceSeq { slot: 2, prefix_len: 10, tokens: &a, parents: None },
            DeviceSeq { slot: 0, prefix_len: 4, tokens: &t, parents: Some(&[-1, 0]) },
        ];
        let l = layout(&seqs, 100, 3, 64).unwrap();
        let meta = StepMeta::new(3, 2, true);
        let mut host = vec![0xFFu8; meta.bytes()];
        meta.write(&l, &mut host).unwrap();
        let p = &meta.packing;
        assert_eq!(p.get::<i32>(&host, 0).unwrap(), [5, 6, 1, 2, 0, 0]);
        assert_eq!(p.get::<i32>(&host, 1).unwrap(), [2, 2, 0, 0, -1, -1]);
        assert_eq!(p.get::<i32>(&host, 2).unwrap(), [10, 11, 4, 5, 0, 0]);
        assert_eq!(p.get::<i32>(&host, 4).unwrap(), [2, 0, 0]);
        assert_eq!(p.get::<i32>(&host, 5).unwrap(), [10, 4, 0]);
        assert_eq!(p.get::<i32>(&host, 6).unwrap(), [2, 2, 0]);
        assert_eq!(p.get::<u64>(&host, 7).unwrap(), [0b1, 0b11, 0b1, 0b11, 0, 0]);
        let b = meta.bufs(Buf::new(1 << 20, meta.bytes())).unwrap();
        assert_eq!((b.tokens.len(), b.seq_slot.len(), b.anc.map(|a| a.len())), (6, 3, Some(6)));
        assert!(b.anc.unwrap().addr().is_multiple_of(16) && b.row_slot.addr().is_multiple_of(16));
        assert!(StepMeta::new(1, 2, true).write(&l, &mut host).is_err(), "more sequences than the shape");
        assert!(StepMeta::new(3, 3, true).write(&l, &mut host).is_err(), "another n_max");
        assert!(StepMeta::new(3, 2, false).write(&l, &mut host).is_err(), "masks on a causal shape");
        assert!(meta.write(&l, &mut host[..8]).is_err(), "host bytes too short");
        assert!(meta.bufs(Buf::new(0, 8)).is_err(), "device buffer too short");
    }
}
