//! EAGLE-3's reduced draft vocabulary: `d2t` offsets and the `t2d` mask.
//!
//! The draft LM head scores only `N` "used" target tokens. The maps follow SpecForge/EAGLE-3 and the SGLang/vLLM
//! loaders: `used` is sorted ascending, `d2t[i] = used[i] - i` is an int64 OFFSET (draft id `i` is target id
//! `i + d2t[i]`), and `t2d[j]` is true iff target id `j` is used.

use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

/// A reduced draft vocabulary over a target vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VocabMap {
    used: Vec<u32>,
    vocab_size: usize,
}

impl VocabMap {
    /// The top-`n` target ids by `counts` (`counts.len()` = the target vocabulary), with every id in `keep`
    /// (EOS) forced in, sorted ascending. Ties, and the zero-count padding needed when fewer than `n` distinct
    /// tokens were seen, go to the lowest ids (SpecForge pads with ids `0..`).
    ///
    /// Forced ids displace the lowest-ranked counted ids. Errors if `n` is 0 or exceeds the vocabulary, or if a
    /// `keep` id is out of range or there are more distinct `keep` ids than `n`.
    pub fn from_counts(counts: &[u64], n: usize, keep: &[u32]) -> Result<Self> {
        let vocab_size = counts.len();
        if n == 0 || n > vocab_size {
            return Err(Error::config("draft_vocab_size", n, "must be in 1..=vocab_size"));
        }
        let mut forced: Vec<u32> = keep.to_vec();
        forced.sort_unstable();
        forced.dedup();
        if let Some(&bad) = forced.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(Error::config("keep", bad, "token id outside the target vocabulary"));
        }
        if forced.len() > n {
            return Err(Error::config("keep", forced.len(), "more forced ids than draft_vocab_size"));
        }
        let mut ranked: Vec<u32> = (0..vocab_size as u32).collect();
        ranked.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        let mut used = forced.clone();
        used.extend(ranked.into_iter().filter(|id| forced.binary_search(id).is_err()).take(n - forced.len()));
        used.sort_unstable();
        Ok(Self { used, vocab_size })
    }

    /// [`Self::from_counts`] over the tokens of `tokens` (e.g. the loss-bearing tokens of a training set).
    pub fn from_tokens(
        tokens: impl IntoIterator<Item = u32>,
        vocab_size: usize,
        n: usize,
        keep: &[u32],
    ) -> Result<Self> {
        let mut counts = vec![0u64; vocab_size];
        for t in tokens {
            let slot = counts
                .get_mut(t as usize)
                .ok_or_else(|| Error::config("tokens", t, "token id outside the target vocabulary"))?;
            *slot += 1;
        }
        Self::from_counts(&counts, n, keep)
    }

    /// The identity map (draft vocabulary = target vocabulary).
    pub fn identity(vocab_size: usize) -> Self {
        Self { used: (0..vocab_size as u32).collect(), vocab_size }
    }

    /// Rebuilds the map from checkpoint `d2t` offsets, checking every target id is in range and the ids are
    /// strictly increasing (sorted, distinct). When `t2d` is given it must mark exactly those ids.
    pub fn from_d2t(d2t: &[i64], t2d: Option<&[bool]>, vocab_size: usize) -> Result<Self> {
        let mut used = Vec::with_capacity(d2t.len());
        for (i, &off) in d2t.iter().enumerate() {
            let id = (i as i64).checked_add(off).filter(|&id| id >= 0 && (id as u64) < vocab_size as u64).ok_or_else(
                || Error::InconsistentVocabMap {
                    reason: format!(
                        "d2t[{i}] = {off} maps to target id {} outside 0..{vocab_size}",
                        i as i128 + off as i128
                    ),
                },
            )?;
            if let Some(&prev) = used.last() {
                if id as u32 <= prev {
                    return Err(Error::InconsistentVocabMap {
                        reason: format!("target ids must increase: draft {i} -> {id} after {prev}"),
                    });
                }
            }
            used.push(id as u32);
        }
        if used.is_empty() {
            return Err(Error::InconsistentVocabMap { reason: "d2t is empty".into() });
        }
        let map = Self { used, vocab_size };
        if let Some(t2d) = t2d {
            if t2d.len() != vocab_size {
                return Err(Error::InconsistentVocabMap {
                    reason: format!("t2d has {} entries for a {vocab_size}-token vocabulary", t2d.len()),
                });
            }
            if let Some(j) = (0..vocab_size).find(|&j| t2d[j] != map.contains(j as u32)) {
                return Err(Error::InconsistentVocabMap {
                    reason: format!(
                        "t2d[{j}] = {} but d2t {} target id {j}",
                        t2d[j],
                        if t2d[j] { "lacks" } else { "has" }
                    ),
                });
            }
        }
        Ok(map)
    }

    /// Number of draft tokens `N`.
    pub fn draft_vocab_size(&self) -> usize {
        self.used.len()
    }

    /// Size of the target vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The used target ids, ascending: draft id `i` is target id `used()[i]`.
    pub fn used(&self) -> &[u32] {
        &self.used
    }

    /// Whether the draft vocabulary is the whole target vocabulary.
    pub fn is_identity(&self) -> bool {
        self.used.len() == self.vocab_size
    }

    /// Whether target id `id` is in the draft vocabulary.
    pub fn contains(&self, id: u32) -> bool {
        self.used.binary_search(&id).is_ok()
    }

    /// The target id of draft id `i`.
    pub fn to_target(&self, i: usize) -> Option<u32> {
        self.used.get(i).copied()
    }

    /// The draft id of target id `id`, if it is used.
    pub fn to_draft(&self, id: u32) -> Option<usize> {
        self.used.binary_search(&id).ok()
    }

    /// `d2t[i] = used[i] - i` (int64 offsets, SGLang/vLLM convention `target = i + d2t[i]`).
    pub fn d2t(&self) -> Vec<i64> {
        self.used.iter().enumerate().map(|(i, &id)| id as i64 - i as i64).collect()
    }

    /// `t2d[j] = (j is used)`, over the full target vocabulary.
    pub fn t2d(&self) -> Vec<bool> {
        let mut mask = vec![false; self.vocab_size];
        for &id in &self.used {
            mask[id as usize] = true;
        }
        mask
    }

    /// The used ids as a `[N]` u32 tensor (for `index_select` of head rows or logit columns).
    pub fn used_tensor(&self, dev: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(&self.used, self.used.len(), dev)?)
    }

    /// The draft LM head initialised from the target's: row `i` = target head row `used[i]` (not `d2t[i]`,
    /// which is an offset). `head: [vocab, hidden]`; returns `[N, hidden]`.
    pub fn init_head(&self, head: &Tensor) -> Result<Tensor> {
        let (v, _) = head.dims2()?;
        if v != self.vocab_size {
            return Err(Error::VocabMismatch { drafter: self.vocab_size, target: v });
        }
        Ok(head.index_select(&self.used_tensor(head.device())?, 0)?.to_dtype(head.dtype())?.contiguous()?)
    }

    /// `d2t` as an int64 tensor.
    pub fn d2t_tensor(&self, dev: &Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.d2t(), self.used.len(), dev)?.to_dtype(DType::I64)?)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests: a panic is the failure report.
mod tests {
    use super::*;

    #[test]
    fn top_n_with_eos_forced_and_padding() {
        // Ids 5 and 2 are frequent, 7 is EOS (never seen); 6 ids requested from 4 distinct tokens seen.
        let mut counts = vec![0u64; 10];
        counts[5] = 9;
        counts[2] = 4;
        counts[8] = 1;
        counts[9] = 1;
        let m = VocabMap::from_counts(&counts, 6, &[7]).unwrap();
        // Forced 7, then 5, 2, 8, 9 by count, then padding from id 0.
        assert_eq!(m.used(), &[0, 2, 5, 7, 8, 9]);
        assert_eq!(m.d2t(), vec![0, 1, 3, 4, 4, 4]);
        assert_eq!(m.t2d().iter().filter(|&&b| b).count(), 6);
        // EOS displaces the least frequent token when the budget is tight.
        let m = VocabMap::from_counts(&counts, 3, &[7]).unwrap();
        assert_eq!(m.used(), &[2, 5, 7]);
    }

    #[test]
    fn from_d2t_checks_consistency() {
        let m = VocabMap::from_counts(&[3, 0, 5, 1, 0, 2], 3, &[]).unwrap();
        assert_eq!(VocabMap::from_d2t(&m.d2t(), Some(&m.t2d()), 6).unwrap(), m);
        assert!(matches!(VocabMap::from_d2t(&[0, 9], None, 6), Err(Error::InconsistentVocabMap { .. })));
        assert!(matches!(VocabMap::from_d2t(&[2, 0], None, 6), Err(Error::InconsistentVocabMap { .. })));
        let mut t2d = m.t2d();
        t2d[1] = true;
        assert!(matches!(VocabMap::from_d2t(&m.d2t(), Some(&t2d), 6), Err(Error::InconsistentVocabMap { .. })));
        assert!(VocabMap::from_d2t(&m.d2t(), Some(&t2d[..5]), 6).is_err());
        assert!(VocabMap::from_d2t(&[i64::MAX, 0], None, 6).is_err());
    }
}
