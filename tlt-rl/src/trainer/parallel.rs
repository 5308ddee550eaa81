//! Data-parallel GRPO over the ranks of a [`Comm`]: each rank decodes and scores a contiguous shard of the step's
//! groups (a group never splits, so group drafting and prefix sharing work as on one rank), the shards are
//! all-gathered so every rank holds the whole step's samples, scores and rewards (advantages, metrics and the
//! mini-batch plan are then the same everywhere), each rank runs forward and backward for the sequences of its own
//! groups only, the gradients are summed across ranks before every optimizer step (the loss is already normalised
//! by the global token and sequence counts), and every rank applies the same AdamW update.
//!
//! A request's coins are keyed by its index in the whole step ([`RolloutJob::stream_keys`]), so its tokens do
//! not depend on which rank decodes it; that makes **work stealing** lossless: a rank out of work asks the others,
//! which give it the back half of the groups they have not started ([`answer_steals`]), between rounds, without
//! ever blocking one. The gradients stay with the groups' owners, so stealing changes who decodes, never the
//! update. What differs from one rank is the order of the float sums of the
//! gradients (per rank, then across ranks): weights agree to rounding, not bit for bit.
//!
//! [`RolloutJob::stream_keys`]: super::rollout::RolloutJob

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use tlt_comm::{Comm, Tag};
use tlt_model::optim::AdamW;

use super::types::Sample;
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
    /// Groups it decoded for another rank.
    stolen: usize,
    /// Drafter versions it installed mid-rollout.
    swaps: u64,
}

/// The step's rollout as every rank holds it after [`gather_rollout`].
pub(super) struct Gathered {
    /// Every sample, group-major in the step's group order (a group's samples in their stream-key order).
    pub samples: Vec<Sample>,
    /// Their scores.
    pub scores: Vec<Score>,
    /// Each rank's rollout seconds.
    pub rollout_s: Vec<f64>,
    /// Groups decoded by a rank other than their owner.
    pub stolen: usize,
    /// Drafter versions installed mid-rollout, all ranks.
    pub swaps: u64,
}

/// CBOR bytes of `v` (binary, so every f32/f64 round-trips bit for bit, NaN included).
pub(super) fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    ciborium::into_writer(v, &mut out).map_err(|e| Error::InvalidArgument(format!("encoding a rank's part: {e}")))?;
    Ok(out)
}

pub(super) fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8], rank: usize) -> Result<T> {
    ciborium::from_reader(bytes).map_err(|e| Error::InvalidArgument(format!("decoding rank {rank}'s part: {e}")))
}

/// Every rank's samples and scores (`samples[i].group` already the group's index in the step; a group's samples
/// all on one rank, in stream-key order), put in the step's group order, with each rank's rollout seconds and
/// how many groups it `stole`.
pub(super) fn gather_rollout(
    comm: &dyn Comm,
    samples: Vec<Sample>,
    scores: Vec<Score>,
    rollout_s: f64,
    stolen: usize,
    swaps: u64,
) -> Result<Gathered> {
    let mine = encode(&ShardPart { samples, scores, rollout_s, stolen, swaps })?;
    let parts = comm.all_gather_bytes(&mine)?;
    let (mut samples, mut scores, mut seconds) = (Vec::new(), Vec::new(), Vec::with_capacity(parts.len()));
    let (mut stolen, mut swaps) = (0, 0);
    for (r, bytes) in parts.iter().enumerate() {
        let part: ShardPart = decode(bytes, r)?;
        stolen += part.stolen;
        swaps += part.swaps;
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
    // Stable: each group's samples keep their order.
    let mut pairs: Vec<(Sample, Score)> = samples.into_iter().zip(scores).collect();
    pairs.sort_by_key(|(s, _)| s.group);
    let (samples, scores) = pairs.into_iter().unzip();
    Ok(Gathered { samples, scores, rollout_s: seconds, stolen, swaps })
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

/// Work stealing's messages: a rank out of work asks the other ranks (`STEAL`), one at a time until one gives it
/// groups; each asked rank answers once (`GRANT`, the groups it gives, maybe none); and a rank with nothing left to
/// decode or steal says so (`DONE`) and keeps answering requests until every rank has. Every request is answered before its sender's `DONE`, so no message
/// outlives the step.
const TAG_STEAL: Tag = 1;
const TAG_GRANT: Tag = 2;
const TAG_DONE: Tag = 3;

/// How long a waiting rank sleeps between polls.
const POLL: Duration = Duration::from_micros(200);

/// The busy side, between rounds: answers every request that has arrived with the back half (rounded up) of the
/// groups still `waiting` that nothing was granted from yet (job-local indices; `to_step` maps them to the step's),
/// and returns the job-local groups given away. With `give` false every request gets an empty grant.
pub(super) fn answer_steals(
    comm: &dyn Comm,
    waiting: &[usize],
    to_step: &dyn Fn(usize) -> usize,
    give: bool,
) -> Result<Vec<usize>> {
    let mut pool = waiting.to_vec();
    let mut given = Vec::new();
    while let Some((from, _)) = comm.try_recv(TAG_STEAL)? {
        let n = if give { pool.len().div_ceil(2) } else { 0 };
        let grant = pool.split_off(pool.len() - n);
        let groups: Vec<usize> = grant.iter().map(|&g| to_step(g)).collect();
        comm.send(from, TAG_GRANT, &encode(&groups)?)?;
        given.extend(grant);
    }
    Ok(given)
}

/// Answers requests with empty grants and records `DONE`s; whether anything arrived.
fn serve_idle(comm: &dyn Comm, done: &mut [bool]) -> Result<bool> {
    let mut any = false;
    while let Some((from, _)) = comm.try_recv(TAG_STEAL)? {
        comm.send(from, TAG_GRANT, &encode(&Vec::<usize>::new())?)?;
        any = true;
    }
    while let Some((from, _)) = comm.try_recv(TAG_DONE)? {
        if let Some(d) = done.get_mut(from) {
            *d = true;
        }
        any = true;
    }
    Ok(any)
}

/// The idle side: asks the ranks not yet done for work, one at a time from the next rank on, and returns the first
/// grant that holds groups (the back half of that rank's unstarted ones; empty: nothing left to steal anywhere).
/// One victim per request bounds what a thief takes: asking every rank at once, the first rank to run dry among
/// many took half of all queued work and became the new tail. `done[r]` records the ranks that said `DONE`.
pub(super) fn ask_for_work(comm: &dyn Comm, done: &mut [bool]) -> Result<Vec<usize>> {
    let (me, n) = (comm.rank(), comm.size());
    for victim in (1..n).map(|k| (me + k) % n) {
        if done[victim] {
            continue;
        }
        comm.send(victim, TAG_STEAL, &[])?;
        let since = std::time::Instant::now();
        let granted = loop {
            if let Some((from, bytes)) = comm.try_recv(TAG_GRANT)? {
                break decode::<Vec<usize>>(&bytes, from)?;
            }
            let served = serve_idle(comm, done)?;
            comm.check_wait(&format!("rank {victim}'s answer to a request for work"), since)?;
            if !served {
                std::thread::sleep(POLL);
            }
        };
        if !granted.is_empty() {
            return Ok(granted);
        }
    }
    Ok(Vec::new())
}

/// Says `DONE` to every rank and answers requests until every rank has said it, running `idle` (given which ranks
/// are still busy; it returns whether it did anything) while there is nothing to answer: the drafter's training on
/// the trainer rank.
pub(super) fn finish_rollout(
    comm: &dyn Comm,
    done: &mut [bool],
    idle: &mut dyn FnMut(&[bool]) -> Result<bool>,
) -> Result<()> {
    let me = comm.rank();
    for r in (0..comm.size()).filter(|&r| r != me) {
        comm.send(r, TAG_DONE, &[])?;
    }
    done[me] = true;
    let since = std::time::Instant::now();
    while !done.iter().all(|&d| d) {
        if !serve_idle(comm, done)? {
            let busy: Vec<bool> = done.iter().map(|d| !d).collect();
            let worked = idle(&busy)?;
            let waiting: Vec<String> = (0..done.len()).filter(|&r| !done[r]).map(|r| r.to_string()).collect();
            comm.check_wait(&format!("rank(s) {} to finish their rollout", waiting.join(", ")), since)?;
            if !worked {
                std::thread::sleep(POLL);
            }
        }
    }
    Ok(())
}

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
