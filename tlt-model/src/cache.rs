//! An explicit, batched key/value cache with tentative tree entries.
//!
//! Each sequence owns, per layer, its keys and values token-major (`[len, kv_dim]`). A tree-verify forward
//! appends its N nodes *tentatively*; [`KvCache::commit`] then keeps exactly the accepted root-to-node path
//! (compacted right after the committed prefix) and drops the rest.

use crate::{Error, Result};

/// Handle of one sequence inside a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub usize);

#[derive(Debug, Clone)]
struct SeqCache {
    /// Per layer: keys then values, each `[len + pending, kv_dim]` row-major.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Committed tokens.
    len: usize,
    /// Parents of the tentative tree nodes stored after `len` (`None` = attached to the committed prefix).
    pending: Option<Vec<Option<usize>>>,
}

/// Key/value cache for a batch of sequences of a model with `n_layers` layers and `kv_dim` key width.
#[derive(Debug, Clone)]
pub struct KvCache {
    n_layers: usize,
    kv_dim: usize,
    seqs: Vec<Option<SeqCache>>,
}

impl KvCache {
    /// An empty cache.
    pub fn new(n_layers: usize, kv_dim: usize) -> Self {
        Self { n_layers, kv_dim, seqs: Vec::new() }
    }

    /// Width of one token's keys (or values) in one layer.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Starts an empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        let seq = SeqCache {
            keys: vec![Vec::new(); self.n_layers],
            values: vec![Vec::new(); self.n_layers],
            len: 0,
            pending: None,
        };
        if let Some(free) = self.seqs.iter().position(Option::is_none) {
            self.seqs[free] = Some(seq);
            SeqId(free)
        } else {
            self.seqs.push(Some(seq));
            SeqId(self.seqs.len() - 1)
        }
    }

    /// Copies the committed state of `seq` into a new sequence (e.g. one prompt, many samples).
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let src = self.get(seq)?;
        if src.pending.is_some() {
            return Err(Error::PendingTree(seq.0));
        }
        let copy = src.clone();
        let id = self.add_sequence();
        self.seqs[id.0] = Some(copy);
        Ok(id)
    }

    /// Frees a sequence; its id may be reused.
    pub fn remove(&mut self, seq: SeqId) -> Result<()> {
        self.get(seq)?;
        self.seqs[seq.0] = None;
        Ok(())
    }

    /// Committed length of `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.get(seq)?.len)
    }

    /// Number of live sequences.
    pub fn num_sequences(&self) -> usize {
        self.seqs.iter().flatten().count()
    }

    /// Whether `seq` holds tentative tree entries.
    pub fn has_pending(&self, seq: SeqId) -> Result<bool> {
        Ok(self.get(seq)?.pending.is_some())
    }

    /// Rolls `seq` back to its first `len` tokens, dropping any tentative entries.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let kv_dim = self.kv_dim;
        let s = self.get_mut(seq)?;
        if len > s.len {
            return Err(Error::InvalidInput(format!(
                "truncate sequence {} to {len}: only {} tokens committed",
                seq.0, s.len
            )));
        }
        for buf in s.keys.iter_mut().chain(s.values.iter_mut()) {
            buf.truncate(len * kv_dim);
        }
        s.len = len;
        s.pending = None;
        Ok(())
    }

    /// Keeps the tentative nodes `accepted` (a path from a root of the pending tree, in order) and drops
    /// every other tentative node. An empty `accepted` discards the whole tree.
    pub fn commit(&mut self, seq: SeqId, accepted: &[usize]) -> Result<()> {
        let kv_dim = self.kv_dim;
        let s = self.get_mut(seq)?;
        let parents = s
            .pending
            .take()
            .ok_or_else(|| Error::InvalidInput(format!("commit on sequence {} without a pending tree", seq.0)))?;
        let is_path = accepted.iter().enumerate().all(|(i, &node)| {
            node < parents.len() && parents[node] == if i == 0 { None } else { Some(accepted[i - 1]) }
        });
        if !is_path {
            s.pending = Some(parents);
            return Err(Error::NotAPath { seq: seq.0, accepted: accepted.to_vec() });
        }
        let base = s.len;
        for buf in s.keys.iter_mut().chain(s.values.iter_mut()) {
            for (i, &node) in accepted.iter().enumerate() {
                // Nodes of a path have increasing indices (parents precede children), so moving
                // node -> i (with i <= node) never overwrites a node still to be moved.
                let (dst, src) = ((base + i) * kv_dim, (base + node) * kv_dim);
                if dst != src {
                    buf.copy_within(src..src + kv_dim, dst);
                }
            }
            buf.truncate((base + accepted.len()) * kv_dim);
        }
        s.len = base + accepted.len();
        Ok(())
    }

    /// Drops every row after the committed prefix `base` of `seq` (undoing a failed forward).
    pub(crate) fn rollback_to(&mut self, seq: SeqId, base: usize) -> Result<()> {
        let kv_dim = self.kv_dim;
        let s = self.get_mut(seq)?;
        for buf in s.keys.iter_mut().chain(s.values.iter_mut()) {
            buf.truncate(base * kv_dim);
        }
        s.len = base;
        s.pending = None;
        Ok(())
    }

    /// Keys and values of `layer` for `seq`: committed rows then tentative rows.
    pub(crate) fn layer(&self, seq: SeqId, layer: usize) -> Result<(&[f32], &[f32])> {
        let s = self.get(seq)?;
        Ok((&s.keys[layer], &s.values[layer]))
    }

    /// Appends rows to `layer` of `seq` (shared by causal appends and tree nodes).
    pub(crate) fn append(&mut self, seq: SeqId, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let s = self.get_mut(seq)?;
        s.keys[layer].extend_from_slice(keys);
        s.values[layer].extend_from_slice(values);
        Ok(())
    }

    /// Marks the end of a forward that added `n` tokens to `seq`: committed at once for causal input,
    /// tentative for a tree.
    pub(crate) fn finish_forward(&mut self, seq: SeqId, n: usize, tree: Option<Vec<Option<usize>>>) -> Result<()> {
        let s = self.get_mut(seq)?;
        match tree {
            Some(parents) => s.pending = Some(parents),
            None => s.len += n,
        }
        Ok(())
    }

    fn get(&self, seq: SeqId) -> Result<&SeqCache> {
        self.seqs.get(seq.0).and_then(Option::as_ref).ok_or(Error::UnknownSequence(seq.0))
    }

    fn get_mut(&mut self, seq: SeqId) -> Result<&mut SeqCache> {
        self.seqs.get_mut(seq.0).and_then(Option::as_mut).ok_or(Error::UnknownSequence(seq.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(cache: &mut KvCache, seq: SeqId, rows: &[f32]) {
        for l in 0..cache.n_layers() {
            cache.append(seq, l, rows, rows).unwrap();
        }
    }

    #[test]
    fn commit_keeps_exactly_the_path() {
        let mut c = KvCache::new(2, 1);
        let s = c.add_sequence();
        filled(&mut c, s, &[10.0, 11.0]);
        c.finish_forward(s, 2, None).unwrap();
        // Tree: 0 root, 1 and 2 children of 0, 3 child of 2.
        filled(&mut c, s, &[0.0, 1.0, 2.0, 3.0]);
        c.finish_forward(s, 4, Some(vec![None, Some(0), Some(0), Some(2)])).unwrap();
        assert!(matches!(c.commit(s, &[0, 1, 3]), Err(Error::NotAPath { .. })));
        assert!(c.has_pending(s).unwrap(), "a rejected commit leaves the tree pending");
        c.commit(s, &[0, 2, 3]).unwrap();
        assert_eq!(c.len(s).unwrap(), 5);
        assert_eq!(c.layer(s, 1).unwrap().0, &[10.0, 11.0, 0.0, 2.0, 3.0]);
        c.truncate(s, 3).unwrap();
        assert_eq!(c.layer(s, 0).unwrap().1, &[10.0, 11.0, 0.0]);
        assert!(c.truncate(s, 4).is_err());
    }

    #[test]
    fn ids_fork_and_remove() {
        let mut c = KvCache::new(1, 2);
        let a = c.add_sequence();
        filled(&mut c, a, &[1.0, 2.0]);
        c.finish_forward(a, 1, None).unwrap();
        let b = c.fork(a).unwrap();
        assert_eq!(c.layer(b, 0).unwrap().0, &[1.0, 2.0]);
        c.remove(a).unwrap();
        assert!(matches!(c.len(a), Err(Error::UnknownSequence(0))));
        assert_eq!(c.add_sequence(), a, "freed slots are reused");
        assert_eq!(c.num_sequences(), 2);
    }
}
