//! Data-parallel GRPO over the ranks of a [`Comm`]: each rank decodes and scores a contiguous shard of the step's
//! groups (a group never splits, so group drafting and prefix sharing work as on one rank), the shards are
//! all-gathered so every rank holds the whole step's samples, scores and rewards (advantages, metrics and the
//! mini-batch plan are then the same everywhere), each rank runs forward and backward for the sequences of its own
//! groups only, the gradients are summed across ranks before every optimizer step (the loss is already normalised
//! by the global token and sequence counts), and every rank applies the same AdamW update.
//!
//! A request's coins are keyed by its index in the whole step ([`RolloutJob::stream_keys`]), so its tokens do
//! not depend on which rank decodes it. What differs from one rank is the order of the float sums of the
//! gradients (per rank, then across ranks): weights agree to rounding, not bit for bit.
//!
//! [`RolloutJob::stream_keys`]: super::rollout::RolloutJob

use std::ops::Range;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use tlt_comm::Comm;
use tlt_model::optim::AdamW;

use super::rollout::Sample;
use crate::grpo::LossStats;
use crate::task::Score;
use crate::{Error, Result};

/// The groups `rank` of `ranks` owns out of `groups`: a contiguous, near-equal share (sizes differ by at most one).
pub fn shard(groups: usize, ranks: usize, rank: usize) -> Range<usize> {
    let ranks = ranks.max(1);
    groups * rank / ranks..groups * (rank + 1) / ranks
}

/// What a rank contributes to the step's gathered rollout.
#[derive(Serialize, Deserialize)]
struct ShardPart {
    samples: Vec<Sample>,
    scores: Vec<Score>,
    rollout_s: f64,
}

/// CBOR bytes of `v` (binary, so every f32/f64 round-trips bit for bit, NaN included).
fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    ciborium::into_writer(v, &mut out).map_err(|e| Error::InvalidArgument(format!("encoding a rank's part: {e}")))?;
    Ok(out)
}

fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8], rank: usize) -> Result<T> {
    ciborium::from_reader(bytes).map_err(|e| Error::InvalidArgument(format!("decoding rank {rank}'s part: {e}")))
}

/// Every rank's samples and scores, in rank order (so group-major over the whole step: rank `r`'s groups come
/// from [`shard`]), and each rank's rollout seconds. `samples[i].group` is already the group's index in the step.
pub(super) fn gather_rollout(
    comm: &dyn Comm,
    samples: Vec<Sample>,
    scores: Vec<Score>,
    rollout_s: f64,
) -> Result<(Vec<Sample>, Vec<Score>, Vec<f64>)> {
    let mine = encode(&ShardPart { samples, scores, rollout_s })?;
    let parts = comm.all_gather_bytes(&mine)?;
    let (mut samples, mut scores, mut seconds) = (Vec::new(), Vec::new(), Vec::with_capacity(parts.len()));
    for (r, bytes) in parts.iter().enumerate() {
        let part: ShardPart = decode(bytes, r)?;
        if part.samples.len() != part.scores.len() {
            return Err(Error::InvalidArgument(format!(
                "rank {r} sent {} samples and {} scores",
                part.samples.len(),
                part.scores.len()
            )));
        }
        samples.extend(part.samples);
        scores.extend(part.scores);
        seconds.push(part.rollout_s);
    }
    Ok((samples, scores, seconds))
}

/// `grads` (this rank's, possibly partial) summed over every rank: on return every rank holds the same gradient
/// for every parameter that any rank had one for, or, when no rank had any (a mini-batch none of whose sequences
/// contributes), zeros for every parameter, as one rank's update takes it. One all-reduce over all parameters, in
/// `opt`'s order.
pub(super) fn all_reduce_grads(comm: &dyn Comm, opt: &AdamW, grads: Option<GradStore>) -> Result<GradStore> {
    let params = opt.params();
    let mut flat: Vec<f32> = Vec::with_capacity(params.iter().map(|(_, v)| v.elem_count() + 1).sum());
    for (_, v) in params {
        match grads.as_ref().and_then(|g| g.get(v.as_tensor())) {
            Some(g) => {
                flat.extend(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                flat.push(1.0);
            }
            None => flat.extend(std::iter::repeat_n(0.0, v.elem_count() + 1)),
        }
    }
    comm.all_reduce_sum_f32(&mut flat)?;
    let mut store = candle_core::Var::new(0f32, &Device::Cpu)?.as_tensor().backward()?;
    let none = {
        let mut at = 0;
        params.iter().all(|(_, v)| {
            at += v.elem_count() + 1;
            flat[at - 1] == 0.0
        })
    };
    let mut at = 0;
    for (_, v) in params {
        let n = v.elem_count();
        if none || flat[at + n] > 0.0 {
            let g = Tensor::from_slice(&flat[at..at + n], v.shape(), v.device())?.to_dtype(v.dtype())?;
            store.insert(v.as_tensor(), g);
        }
        at += n + 1;
    }
    Ok(store)
}

/// Every rank's loss statistics and micro-batch count of one optimizer step, merged in rank order.
pub(super) fn merge_stats(comm: &dyn Comm, stats: LossStats, micros: usize) -> Result<(LossStats, usize)> {
    let parts = comm.all_gather_bytes(&encode(&(stats, micros))?)?;
    let (mut all, mut total) = (LossStats::default(), 0);
    for (r, bytes) in parts.iter().enumerate() {
        let (s, m): (LossStats, usize) = decode(bytes, r)?;
        all.merge(&s);
        total += m;
    }
    Ok((all, total))
}

/// Rank 0's `value` on every rank, to check that all ranks run the same thing: an error naming `what` if this
/// rank's differs.
pub(super) fn check_same<T: Serialize>(comm: &dyn Comm, what: &str, value: &T) -> Result<()> {
    let mine = encode(value)?;
    let mut root = mine.clone();
    comm.broadcast_bytes(0, &mut root)?;
    if root != mine {
        return Err(Error::config(
            what,
            format!("rank {} of {} differs from rank 0's: every rank must run the same", comm.rank(), comm.size()),
        ));
    }
    Ok(())
}

/// The trainer's communicator: the job's ranks ([`tlt_comm::SelfComm`] for one).
pub(super) type SharedComm = Arc<dyn Comm>;

#[cfg(test)]
mod tests {
    use super::shard;

    #[test]
    fn shards_are_contiguous_near_equal_and_cover_the_groups() {
        for groups in 0..20 {
            for ranks in 1..6 {
                let parts: Vec<_> = (0..ranks).map(|r| shard(groups, ranks, r)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[ranks - 1].end, groups);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let (lo, hi) = (parts.iter().map(|p| p.len()).min(), parts.iter().map(|p| p.len()).max());
                assert!(hi.unwrap_or(0) - lo.unwrap_or(0) <= 1, "{groups} over {ranks}: {parts:?}");
            }
        }
    }
}
