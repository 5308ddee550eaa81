//! A training batch as the device's training pass reads it: the rows of several sequences packed one after the
//! other, with each row's position, sequence start and target, and the rows grouped by token for the embedding's
//! backward.

use crate::{Error, Result};

/// The packed rows of one training forward: `rows()` tokens of several sequences one after the other; row `r`
/// attends to rows `seq_start[r]..=r`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainBatch {
    pub(super) ids: Vec<i32>,
    pub(super) pos: Vec<i32>,
    pub(super) seq_start: Vec<i32>,
    pub(super) targets: Vec<i32>,
    /// Row indices grouped by token (ascending tokens, rows in order within a token).
    pub(super) order: Vec<i32>,
    /// `segments + 1` offsets into `order`.
    pub(super) seg_start: Vec<i32>,
    /// The token of each segment.
    pub(super) seg_token: Vec<i32>,
}

/// `v` as an `i32` (the kernels' index type).
fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidInput(format!("{what} {v} exceeds the device's i32 indices")))
}

impl TrainBatch {
    /// A batch of `seqs`: each sequence's input ids and, per input row, the token it predicts (`None`: not scored).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for no rows, a sequence whose targets are not one per input row, a token at or above
    /// `vocab`, or sizes beyond the device's `i32` indices.
    pub fn new(seqs: &[(&[u32], &[Option<u32>])], vocab: usize) -> Result<Self> {
        let rows: usize = seqs.iter().map(|(ids, _)| ids.len()).sum();
        if rows == 0 {
            return Err(Error::InvalidInput("a training batch needs at least one row".into()));
        }
        int("rows", rows)?;
        let mut b = Self {
            ids: Vec::with_capacity(rows),
            pos: Vec::with_capacity(rows),
            seq_start: Vec::with_capacity(rows),
            targets: Vec::with_capacity(rows),
            order: Vec::new(),
            seg_start: Vec::new(),
            seg_token: Vec::new(),
        };
        let token = |t: u32| -> Result<i32> {
            if t as usize >= vocab {
                return Err(Error::InvalidInput(format!("token {t} outside a vocabulary of {vocab}")));
            }
            int("token", t as usize)
        };
        for (s, (ids, targets)) in seqs.iter().enumerate() {
            if ids.len() != targets.len() {
                return Err(Error::InvalidInput(format!(
                    "sequence {s}: {} targets for {} input rows",
                    targets.len(),
                    ids.len()
                )));
            }
            let start = int("row", b.ids.len())?;
            for (p, (&id, t)) in ids.iter().zip(targets.iter()).enumerate() {
                b.ids.push(token(id)?);
                b.pos.push(int("position", p)?);
                b.seq_start.push(start);
                b.targets.push(t.map(token).transpose()?.unwrap_or(-1));
            }
        }
        let mut order: Vec<i32> = (0..rows).map(|r| r as i32).collect();
        order.sort_by_key(|&r| (b.ids[r as usize], r));
        for (i, &r) in order.iter().enumerate() {
            let tok = b.ids[r as usize];
            if b.seg_token.last() != Some(&tok) {
                b.seg_token.push(tok);
                b.seg_start.push(i as i32);
            }
        }
        b.seg_start.push(rows as i32);
        b.order = order;
        Ok(b)
    }

    /// A batch of prompt/response pairs as a policy update scores them: each sequence's input is its prompt and
    /// response minus the last token, and the rows from the prompt's last one on predict the response.
    ///
    /// # Errors
    /// As [`TrainBatch::new`], and for an empty prompt or response.
    pub fn responses(pairs: &[(&[u32], &[u32])], vocab: usize) -> Result<Self> {
        let mut owned = Vec::with_capacity(pairs.len());
        for (i, (prompt, response)) in pairs.iter().enumerate() {
            if prompt.is_empty() || response.is_empty() {
                return Err(Error::InvalidInput(format!("sequence {i}: empty prompt or response")));
            }
            let ids: Vec<u32> =
                prompt.iter().chain(response.iter()).take(prompt.len() + response.len() - 1).copied().collect();
            let mut targets = vec![None; ids.len()];
            for (j, &t) in response.iter().enumerate() {
                targets[prompt.len() - 1 + j] = Some(t);
            }
            owned.push((ids, targets));
        }
        let refs: Vec<(&[u32], &[Option<u32>])> = owned.iter().map(|(i, t)| (i.as_slice(), t.as_slice())).collect();
        Self::new(&refs, vocab)
    }

    /// Rows (tokens) in the batch.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// The scored rows, in row order.
    pub fn scored_rows(&self) -> impl Iterator<Item = usize> + '_ {
        self.targets.iter().enumerate().filter(|(_, &t)| t >= 0).map(|(r, _)| r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_packed_with_positions_starts_and_token_segments() {
        let b = TrainBatch::responses(&[(&[5, 6], &[7, 8]), (&[6], &[5])], 10).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.ids, [5, 6, 7, 6]);
        assert_eq!(b.pos, [0, 1, 2, 0]);
        assert_eq!(b.seq_start, [0, 0, 0, 3]);
        assert_eq!(b.targets, [-1, 7, 8, 5]);
        assert_eq!(b.seg_token, [5, 6, 7]);
        assert_eq!(b.seg_start, [0, 1, 3, 4]);
        assert_eq!(b.order, [0, 1, 3, 2], "rows grouped by token, in row order within a token");
        assert_eq!(b.scored_rows().collect::<Vec<_>>(), [1, 2, 3]);
    }

    #[test]
    fn bad_batches_are_errors() {
        assert!(TrainBatch::new(&[], 10).is_err());
        assert!(TrainBatch::new(&[(&[1, 2], &[None])], 10).is_err());
        assert!(TrainBatch::new(&[(&[10], &[None])], 10).is_err(), "token outside the vocabulary");
        assert!(TrainBatch::responses(&[(&[], &[1])], 10).is_err());
    }
}
