//! The online EAGLE drafter across data-parallel ranks: **rank 0 trains, the others replicate**. Every rank's
//! finished requests stream their tokens and hidden states to rank 0 as they finish (point-to-point, `FEATURES`);
//! once rank 0 has nothing left to decode or steal it trains the drafter on them while the others still decode, and
//! sends each version it publishes to the ranks still busy (`WEIGHTS`), which poll between rounds, never blocking one,
//! and hot-swap it as one process does. At the step's end every rank installs rank 0's final weights and version
//! ([`RolloutDrafter::sync_replicas`]), so checkpoints (rank 0's) and the publication after the update agree.
//!
//! The schedule's meaning across ranks: `off` trains nothing; `tail` trains in the trainer's idle time (how many
//! steps, on which features, depends on the ranks' timing); `fixed { steps }` takes exactly `steps` per RL step at
//! the step's end, on the step's features taken in in rank order (each rank's in the order it finished them), so
//! the drafter does not depend on timing: the same run gives the same drafter bit for bit, and a killed run
//! resumes to it.
//!
//! Mid-rollout one rank trains: the others are still decoding, or idle at different times. At the step's end every
//! rank is idle at once, so the drafter steps a `fixed` schedule still owes are taken by all ranks together: rank 0
//! sends its trainer's state (weights, AdamW moments, step), each rank takes a share of every batch rank 0 draws,
//! and their gradients are summed with an all-reduce ([`DrafterTrainer::step_with`]), so every rank applies the
//! update one trainer would apply to the whole batch. Measured on this machine (docs/bench/2026-11-26-ranks.md),
//! two ranks take such a step in 0.55x one rank's time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use tlt_comm::Tag;
use tlt_drafter::online::{FeatureSample, OnlineBuffer};
use tlt_drafter::train::Totals;
use tlt_drafter::RuntimeOptions;
use tlt_model::optim::ParamState;
use tlt_spec_decode::HiddenStates;

use super::{DrafterSchedule, OnlineEagle, Replica, RolloutDrafter};
use crate::trainer::parallel::{decode, encode, SharedComm};
use crate::{Error, Result};

/// A finished request's features, rank -> rank 0.
const TAG_FEATURES: Tag = 4;
/// A drafter version, rank 0 -> a busy rank.
const TAG_WEIGHTS: Tag = 5;
/// A rank's share of a joint drafter step's batch, rank 0 -> a rank.
const TAG_SHARE: Tag = 6;

/// The rank that trains.
const TRAINER: usize = 0;

/// [`FeatureSample`] on the wire.
#[derive(Serialize, Deserialize)]
struct WireSample {
    tokens: Vec<u32>,
    width: usize,
    hidden: Vec<f32>,
    response_start: usize,
    rl_step: u64,
}

/// A drafter version on the wire: its number and every trainable tensor (flat, in the trainer's order).
#[derive(Serialize, Deserialize)]
struct WireWeights {
    version: u64,
    tensors: Vec<(String, Vec<f32>)>,
}

/// The trainer's state a rank needs to join rank 0 in drafter steps: step, totals, and every tensor's in the
/// trainer's order.
#[derive(Serialize, Deserialize)]
struct WireState {
    step: u64,
    totals: Totals,
    tensors: Vec<WireTensor>,
}

/// One trainable tensor's weights, AdamW moments and update count.
#[derive(Serialize, Deserialize)]
struct WireTensor {
    weights: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    steps: u64,
}

impl Replica {
    fn is_trainer(&self) -> bool {
        self.comm.rank() == TRAINER
    }

    /// The trainer's `sample` from rank `from`: into `buffer` now, or held for the step's end (`fixed`).
    fn take_in(&self, buffer: &OnlineBuffer, from: usize, sample: FeatureSample) -> Result<()> {
        match &self.ordered {
            Some(held) => held.lock().unwrap_or_else(PoisonError::into_inner).push((from, sample)),
            None => {
                buffer.push(sample)?;
            }
        }
        Ok(())
    }

    /// The held features into `buffer`, rank by rank (a stable sort keeps each rank's own order).
    fn release(&self, buffer: &OnlineBuffer) -> Result<()> {
        let Some(held) = &self.ordered else { return Ok(()) };
        let mut held = std::mem::take(&mut *held.lock().unwrap_or_else(PoisonError::into_inner));
        held.sort_by_key(|(from, _)| *from);
        for (_, sample) in held {
            buffer.push(sample)?;
        }
        Ok(())
    }
}

/// Rank 0's weights and version, encoded.
fn weights_of(e: &OnlineEagle) -> Result<Vec<u8>> {
    let t = e.trainer.lock();
    let tensors = t
        .drafter()
        .vars()?
        .into_iter()
        .map(|(n, v)| Ok((n, v.as_tensor().flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?)))
        .collect::<Result<Vec<_>>>()?;
    encode(&WireWeights { version: e.slot.version(), tensors })
}

/// Sets the trainer's weights to `w` and publishes them as `w.version`; whether the version was new.
fn install(e: &OnlineEagle, w: WireWeights) -> Result<bool> {
    let t = e.trainer.lock();
    let vars = t.drafter().vars()?;
    if vars.len() != w.tensors.len() {
        return Err(Error::InvalidArgument(format!("a drafter of {} tensors sent {}", vars.len(), w.tensors.len())));
    }
    for ((name, var), (sent, data)) in vars.iter().zip(w.tensors) {
        if *name != sent || var.elem_count() != data.len() {
            return Err(Error::InvalidArgument(format!("drafter tensor `{sent}` does not match `{name}`")));
        }
        var.set(&Tensor::from_vec(data, var.shape(), var.device())?.to_dtype(var.dtype())?)?;
    }
    let runtime = t.runtime(&RuntimeOptions::default())?;
    drop(t);
    Ok(e.slot.publish_as(runtime, w.version))
}

fn to_wire(sample: &FeatureSample) -> WireSample {
    WireSample {
        tokens: sample.tokens.clone(),
        width: sample.hidden.width(),
        hidden: sample.hidden.as_flat().to_vec(),
        response_start: sample.response_start,
        rl_step: sample.rl_step,
    }
}

fn from_wire(w: WireSample) -> Result<FeatureSample> {
    let hidden = HiddenStates::from_flat(w.width, w.hidden)?;
    let s = FeatureSample { tokens: w.tokens, hidden, response_start: w.response_start, rl_step: w.rl_step };
    s.validate()?;
    Ok(s)
}

/// Rank 0's trainer state, encoded.
fn state_of(e: &OnlineEagle) -> Result<WireState> {
    let t = e.trainer.lock();
    let tensors = t
        .optimizer()
        .params()
        .iter()
        .zip(t.optimizer().state())
        .map(|((_, v), st)| {
            let w = v.as_tensor().flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
            Ok(WireTensor {
                weights: w,
                exp_avg: st.exp_avg.clone(),
                exp_avg_sq: st.exp_avg_sq.clone(),
                steps: st.steps,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(WireState { step: t.steps_done(), totals: t.totals(), tensors })
}

/// Makes this rank's trainer rank 0's (weights, moments, step).
fn join(e: &OnlineEagle, w: WireState) -> Result<()> {
    let mut t = e.trainer.lock();
    let params: Vec<_> = t.optimizer().params().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    if params.len() != w.tensors.len() {
        return Err(Error::InvalidArgument(format!("a drafter of {} tensors joins {}", params.len(), w.tensors.len())));
    }
    let mut moments = Vec::with_capacity(params.len());
    for ((name, var), t) in params.iter().zip(w.tensors) {
        if var.elem_count() != t.weights.len() {
            return Err(Error::InvalidArgument(format!("drafter tensor `{name}` has {} weights", t.weights.len())));
        }
        var.set(&Tensor::from_vec(t.weights, var.shape(), var.device())?.to_dtype(var.dtype())?)?;
        moments.push(ParamState { exp_avg: t.exp_avg, exp_avg_sq: t.exp_avg_sq, steps: t.steps });
    }
    t.join(w.step, w.totals, moments)?;
    Ok(())
}

impl RolloutDrafter {
    /// Makes the online EAGLE drafter one replica of a data-parallel job over `comm` (rank 0 trains; see the
    /// module docs); no background worker runs. A no-op for the model-free drafters.
    pub(crate) fn replicate(&mut self, comm: SharedComm) -> Result<()> {
        let size = comm.size();
        self.shutdown()?;
        if let Some(e) = self.eagle.as_mut() {
            e.replica = Some(Replica {
                comm,
                sent_features: AtomicU64::new(0),
                received_features: 0,
                sent_weights: vec![0; size],
                received_weights: 0,
                swaps: 0,
                idle_steps: 0,
                idle_s: 0.0,
                ordered: matches!(e.schedule, DrafterSchedule::Fixed { .. }).then(|| Mutex::new(Vec::new())),
            });
        }
        Ok(())
    }

    /// A finished request's features become training data: on the trainer rank (or without replication) they
    /// enter its buffer (held for the step's end on a `fixed` schedule), another rank sends them to the trainer.
    pub(super) fn keep_features(e: &OnlineEagle, sample: FeatureSample) -> Result<()> {
        match e.replica.as_ref() {
            None => {
                e.buffer.push(sample)?;
            }
            Some(r) if r.is_trainer() => r.take_in(&e.buffer, TRAINER, sample)?,
            Some(r) => {
                r.comm.send(TRAINER, TAG_FEATURES, &encode(&to_wire(&sample))?)?;
                r.sent_features.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Between rounds: the trainer takes in the features that arrived; another rank installs the newest version
    /// that arrived. Never blocks.
    pub(super) fn poll_replica(e: &mut OnlineEagle) -> Result<()> {
        let Some(r) = e.replica.as_mut() else { return Ok(()) };
        if r.is_trainer() {
            while let Some((from, bytes)) = r.comm.try_recv(TAG_FEATURES)? {
                r.take_in(&e.buffer, from, from_wire(decode(&bytes, from)?)?)?;
                r.received_features += 1;
            }
            return Ok(());
        }
        let mut newest = None;
        while let Some((from, bytes)) = r.comm.try_recv(TAG_WEIGHTS)? {
            r.received_weights += 1;
            newest = Some(decode::<WireWeights>(&bytes, from)?);
        }
        if let Some(w) = newest {
            if install(e, w)? {
                if let Some(r) = e.replica.as_mut() {
                    r.swaps += 1;
                }
            }
        }
        Ok(())
    }

    /// The trainer rank's idle time (its share decoded, nothing to steal): takes in arrived features, runs one
    /// drafter step, and sends each version it publishes to the ranks still decoding (`busy[r]`). Returns whether
    /// it trained (false: not the trainer, no replication, or no data yet).
    pub(crate) fn idle_step(&mut self, busy: &[bool]) -> Result<bool> {
        let Some(e) = self.eagle.as_mut() else { return Ok(false) };
        if !e.replica.as_ref().is_some_and(Replica::is_trainer) || e.schedule != DrafterSchedule::Tail {
            return Ok(false);
        }
        Self::poll_replica(e)?;
        let t0 = std::time::Instant::now();
        let published = {
            let mut t = e.trainer.lock();
            let drawn = t.draw_from_buffer(&e.buffer);
            if drawn.is_empty() {
                return Ok(false);
            }
            let samples: Vec<_> = drawn.into_iter().map(|(_, s)| s).collect();
            t.step(&samples)?;
            if t.steps_done().is_multiple_of(e.publish_every) {
                e.slot.publish(t.runtime(&RuntimeOptions::default())?);
                true
            } else {
                false
            }
        };
        let bytes = if published { Some(weights_of(e)?) } else { None };
        if let Some(r) = e.replica.as_mut() {
            r.idle_steps += 1;
            r.idle_s += t0.elapsed().as_secs_f64();
            if let Some(bytes) = bytes {
                for (rank, _) in busy.iter().enumerate().filter(|&(k, &b)| b && k != TRAINER) {
                    r.comm.send(rank, TAG_WEIGHTS, &bytes)?;
                    r.sent_weights[rank] += 1;
                }
            }
        }
        Ok(true)
    }

    /// The step's end, on every rank (collective): the trainer takes in every feature still in flight, all ranks
    /// take together the drafter steps a `fixed` schedule still owes (`min_steps` minus the trainer's idle steps;
    /// [`Self::joint_steps`]), and every rank installs the trainer's final weights and version, after draining the
    /// versions still in flight to it. Returns this rank's mid-rollout swaps (the versions it installed while
    /// decoding) and its seconds of drafter training this step.
    pub(crate) fn sync_replicas(&mut self, min_steps: u64) -> Result<(u64, f64)> {
        let Some(e) = self.eagle.as_mut() else { return Ok((0, 0.0)) };
        let Some(r) = e.replica.as_ref() else { return Ok((0, 0.0)) };
        let comm = r.comm.clone();
        let sent = r.sent_features.load(Ordering::Relaxed);
        let counts = comm.all_gather_bytes(&sent.to_le_bytes())?;
        let in_flight: u64 = counts.iter().map(|b| b.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0)).sum();
        let mut payload = Vec::new();
        if comm.rank() == TRAINER {
            while e.replica.as_ref().map_or(0, |r| r.received_features) < in_flight {
                let (from, bytes) = comm.recv(TAG_FEATURES)?;
                if let Some(r) = e.replica.as_mut() {
                    r.take_in(&e.buffer, from, from_wire(decode(&bytes, from)?)?)?;
                    r.received_features += 1;
                }
            }
            if let Some(r) = e.replica.as_ref() {
                r.release(&e.buffer)?;
            }
        }
        let joint_s = self.joint_steps(&comm, min_steps)?;
        let Some(e) = self.eagle.as_mut() else { return Ok((0, 0.0)) };
        if comm.rank() == TRAINER {
            let sent_weights = e.replica.as_ref().map(|r| r.sent_weights.clone()).unwrap_or_default();
            payload = encode(&(sent_weights, weights_of(e)?))?;
        }
        comm.broadcast_bytes(TRAINER, &mut payload)?;
        let Some(e) = self.eagle.as_mut() else { return Ok((0, 0.0)) };
        let (sent_weights, bytes): (Vec<u64>, Vec<u8>) = decode(&payload, TRAINER)?;
        if comm.rank() != TRAINER {
            let owed = sent_weights.get(comm.rank()).copied().unwrap_or(0);
            while e.replica.as_ref().map_or(owed, |r| r.received_weights) < owed {
                comm.recv(TAG_WEIGHTS)?;
                if let Some(r) = e.replica.as_mut() {
                    r.received_weights += 1;
                }
            }
            install(e, decode(&bytes, TRAINER)?)?;
        }
        let Some(r) = e.replica.as_mut() else { return Ok((0, 0.0)) };
        let done = (r.swaps, r.idle_s + joint_s);
        r.sent_features.store(0, Ordering::Relaxed);
        (r.received_features, r.received_weights, r.swaps, r.idle_steps, r.idle_s) = (0, 0, 0, 0, 0.0);
        r.sent_weights.iter_mut().for_each(|n| *n = 0);
        Ok(done)
    }

    /// The drafter steps a `fixed` schedule still owes at the step's end (`min_steps` minus rank 0's idle steps),
    /// taken by every rank together (collective): rank 0 sends its trainer's state, then for every step it draws a
    /// batch and sends each rank its share (every `size`-th sample), and all step with their gradients all-reduced.
    /// Returns this rank's seconds in them.
    fn joint_steps(&mut self, comm: &SharedComm, min_steps: u64) -> Result<f64> {
        let Some(e) = self.eagle.as_mut() else { return Ok(0.0) };
        let (rank, size) = (comm.rank(), comm.size());
        let t0 = std::time::Instant::now();
        let mut plan = Vec::new();
        if rank == TRAINER && e.schedule != DrafterSchedule::Off {
            let owed = min_steps.saturating_sub(e.replica.as_ref().map_or(0, |r| r.idle_steps));
            let state = if owed > 0 { Some(state_of(e)?) } else { None };
            plan = encode(&(owed, state))?;
        }
        comm.broadcast_bytes(TRAINER, &mut plan)?;
        let (owed, state): (u64, Option<WireState>) = if plan.is_empty() { (0, None) } else { decode(&plan, TRAINER)? };
        if let (Some(state), false) = (state, rank == TRAINER) {
            join(e, state)?;
        }
        for _ in 0..owed {
            let share: Vec<Arc<FeatureSample>> = if rank == TRAINER {
                let drawn: Vec<_> = e.trainer.lock().draw_from_buffer(&e.buffer).into_iter().map(|(_, s)| s).collect();
                for r in 1..size {
                    let theirs: Vec<WireSample> = drawn.iter().skip(r).step_by(size).map(|s| to_wire(s)).collect();
                    comm.send(r, TAG_SHARE, &encode(&(drawn.is_empty(), theirs))?)?;
                }
                if drawn.is_empty() {
                    break;
                }
                drawn.into_iter().step_by(size).collect()
            } else {
                let (from, bytes) = comm.recv(TAG_SHARE)?;
                let (stop, mine): (bool, Vec<WireSample>) = decode(&bytes, from)?;
                if stop {
                    break;
                }
                mine.into_iter().map(|w| from_wire(w).map(Arc::new)).collect::<Result<_>>()?
            };
            let mut t = e.trainer.lock();
            t.step_with(&share, |buf| comm.all_reduce_sum_f32(buf))?;
            tlt_model::chaos::kill_point("drafter.step");
            if rank == TRAINER && t.steps_done().is_multiple_of(e.publish_every) {
                e.slot.publish(t.runtime(&RuntimeOptions::default())?);
            }
        }
        Ok(if owed > 0 { t0.elapsed().as_secs_f64() } else { 0.0 })
    }
}
