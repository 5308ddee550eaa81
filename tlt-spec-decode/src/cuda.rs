//! [`Target`] on a CUDA device: `tlt_model::cuda::CudaLlama` driven by the engine, with verification on the device
//! ([`Target::forward_verify`]): the target's token at every tree node is drawn there (`sample_rows`, the coupled
//! rule of [`verify_coupled`](crate::verify_coupled)), the trees are walked there (`tree_accept`), and only the
//! accepted paths, the committed tokens' log-probs and largest probabilities, and the accepted nodes' hidden rows
//! (when recording) cross to the host. Built on the device seam (`tlt_kernels::cuda::Gpu`): CI runs it on the
//! simulated device against host verification; a CUDA device comes from `tlt_kernels::cuda::CudaGpu` (feature
//! `cuda`).
//!
//! The KV cache's slots belong to the device model and are lent to [`CudaState`]s (one per engine), which give them
//! back when sequences are removed or the state is dropped. Commits are deferred and applied as one launch before
//! the state's next forward.

use std::sync::{Arc, Mutex, MutexGuard};

use tlt_kernels::cuda::{SharedGpu, MAX_TREE_NODES};
use tlt_model::cuda::{CudaLlama, DeviceSeq, StepOutput};
use tlt_model::{Llama, Tap};

use crate::device_verify::{DeviceHidden, DeviceVerifier};
use crate::{Error, Result, SeqHandle, Target, TargetInput, TargetOutput, Verified, VerifySpec};

fn dev_err(e: impl std::fmt::Display) -> Error {
    Error::Target(e.to_string())
}

/// The device model and its verifier, used by one forward at a time.
#[derive(Debug)]
struct Device {
    // Dropped before the model, whose device they use.
    verifier: DeviceVerifier,
    model: CudaLlama,
}

/// Which of the cache's slots are lent out.
type SlotPool = Arc<Mutex<Vec<bool>>>;

fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock().map_err(|_| Error::Target("a CUDA target's lock was poisoned by a panic".into()))
}

/// A [`Target`] on a CUDA device: [`CudaLlama`] with device-side verification.
#[derive(Debug)]
pub struct CudaTarget {
    device: Mutex<Device>,
    slots: SlotPool,
    vocab: usize,
    hidden_size: usize,
    max_len: usize,
    eos: Vec<u32>,
}

/// One sequence of a [`CudaState`].
#[derive(Debug, Clone)]
struct CudaSeq {
    slot: Option<usize>,
    /// Positions in the cache (committed and fed).
    len: usize,
    /// The pending tree's parents (node 0: `None`).
    pending: Option<Vec<Option<usize>>>,
}

/// The engine-side state of a [`CudaTarget`]: its sequences, the slots they hold and the commits not yet applied.
#[derive(Debug)]
pub struct CudaState {
    slots: SlotPool,
    seqs: Vec<Option<CudaSeq>>,
    /// `(slot, prefix, path)` of commits to apply before the next forward.
    commits: Vec<(usize, usize, Vec<i32>)>,
}

impl Drop for CudaState {
    fn drop(&mut self) {
        if let Ok(mut used) = self.slots.lock() {
            for s in self.seqs.iter().flatten() {
                if let Some(slot) = s.slot {
                    used[slot] = false;
                }
            }
        }
    }
}

impl CudaState {
    fn get_mut(&mut self, seq: SeqHandle) -> Result<&mut CudaSeq> {
        self.seqs
            .get_mut(seq.0)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::Target(format!("unknown sequence {}", seq.0)))
    }

    /// Lends a free slot to `seq` if it has none.
    fn ensure_slot(&mut self, seq: SeqHandle) -> Result<usize> {
        if let Some(slot) = self.get_mut(seq)?.slot {
            return Ok(slot);
        }
        let slot = {
            let mut used = lock(&self.slots)?;
            let free = used.iter().position(|u| !u).ok_or_else(|| {
                Error::Target(format!("all {} KV-cache slots of the CUDA target are in use", used.len()))
            })?;
            used[free] = true;
            free
        };
        self.get_mut(seq)?.slot = Some(slot);
        Ok(slot)
    }

    /// Applies the deferred commits in one launch.
    fn flush(&mut self, model: &mut CudaLlama) -> Result<()> {
        if self.commits.is_empty() {
            return Ok(());
        }
        let commits = std::mem::take(&mut self.commits);
        let seqs: Vec<(usize, usize)> = commits.iter().map(|c| (c.0, c.1)).collect();
        let paths: Vec<Vec<i32>> = commits.into_iter().map(|c| c.2).collect();
        model.commit(&seqs, &paths).map_err(dev_err)
    }
}

impl CudaTarget {
    /// `model`'s weights on `gpu` as bf16, a KV cache of `slots` sequences of `max_len` positions, and CUDA graphs
    /// for decode and verify shapes up to `slots` sequences (within `graph_budget` bytes; 0: no graphs).
    ///
    /// # Errors
    /// [`Error::Target`] when the device fails, or for a model the device kernels do not handle.
    pub fn new(model: &Llama, gpu: SharedGpu, slots: usize, max_len: usize, graph_budget: u64) -> Result<Self> {
        let mut m = CudaLlama::new(model, gpu, slots, max_len).map_err(dev_err)?;
        if graph_budget > 0 {
            m.enable_graphs(slots, graph_budget);
        }
        Ok(Self::from_model(m))
    }

    /// A target over a device model already built (e.g. [`CudaLlama::synthetic`]).
    pub fn from_model(model: CudaLlama) -> Self {
        let cfg = model.config();
        let (vocab, hidden_size, eos) = (cfg.vocab_size, cfg.hidden_size, cfg.eos_ids());
        let dims = model.cache_dims();
        Self {
            device: Mutex::new(Device { verifier: DeviceVerifier::new(model.gpu().clone(), hidden_size), model }),
            slots: Arc::new(Mutex::new(vec![false; dims.slots])),
            vocab,
            hidden_size,
            max_len: dims.max_len,
            eos,
        }
    }

    /// Copies `model`'s weights (same configuration) into the device buffers in place ([`CudaLlama::update_weights`]):
    /// a trainer's weight sync after each policy update; graphs stay valid. Sequences of existing states keep their
    /// cache entries, computed with the old weights.
    ///
    /// # Errors
    /// [`Error::Target`] for another configuration or a failed copy.
    pub fn update_weights(&self, model: &Llama) -> Result<()> {
        lock(&self.device)?.model.update_weights(model).map_err(dev_err)
    }

    /// Which hidden features the target returns, side by side (default `[Tap::FinalNorm]`; `Tap::eagle3` for EAGLE-3
    /// drafters, as `TappedLlama` on the CPU). The final norm alone is packed on the device for the accepted nodes;
    /// other taps come back whole and are picked on the host.
    ///
    /// # Errors
    /// [`Error::Target`] for an invalid tap list.
    pub fn set_taps(&self, taps: &[Tap]) -> Result<()> {
        lock(&self.device)?.model.set_taps(taps).map_err(dev_err)
    }

    /// Sequences the KV cache holds at once, and positions per sequence.
    pub fn capacity(&self) -> (usize, usize) {
        (lock(&self.slots).map_or(0, |s| s.len()), self.max_len)
    }

    /// Runs `f` on the device model (graph statistics, weight bytes, the device).
    ///
    /// # Errors
    /// If the lock was poisoned.
    pub fn with_model<R>(&self, f: impl FnOnce(&CudaLlama) -> R) -> Result<R> {
        Ok(f(&lock(&self.device)?.model))
    }

    /// Runs `f` on the device model, mutably: a trainer on the same device updates its weights in place
    /// (`tlt_model::cuda::train::CudaTrainer`) between rollouts.
    ///
    /// # Errors
    /// If the lock was poisoned.
    pub fn with_model_mut<R>(&self, f: impl FnOnce(&mut CudaLlama) -> R) -> Result<R> {
        Ok(f(&mut lock(&self.device)?.model))
    }

    /// Checks a batch before anything changes.
    fn check(&self, state: &CudaState, inputs: &[TargetInput<'_>]) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for input in inputs {
            let i = input.seq.0;
            let seq = state
                .seqs
                .get(i)
                .and_then(Option::as_ref)
                .ok_or_else(|| Error::Target(format!("unknown sequence {i}")))?;
            if !seen.insert(i) {
                return Err(Error::Target(format!("sequence {i} appears twice in one forward")));
            }
            if seq.pending.is_some() {
                return Err(Error::Target(format!("sequence {i} has a pending tree")));
            }
            if input.tokens.is_empty() {
                return Err(Error::Target(format!("sequence {i}: no new tokens")));
            }
            if let Some(&t) = input.tokens.iter().find(|&&t| t as usize >= self.vocab) {
                return Err(Error::Target(format!("token {t} is outside the vocabulary of size {}", self.vocab)));
            }
            if seq.len + input.tokens.len() > self.max_len {
                return Err(Error::Target(format!(
                    "sequence {i}: {} + {} positions exceed the cache's {}",
                    seq.len,
                    input.tokens.len(),
                    self.max_len
                )));
            }
            if let Some(parents) = input.tree {
                let ok = parents.len() == input.tokens.len()
                    && parents.len() <= MAX_TREE_NODES
                    && parents.first() == Some(&None)
                    && parents.iter().enumerate().skip(1).all(|(n, p)| p.is_some_and(|p| p < n));
                if !ok {
                    return Err(Error::InvalidTree(format!("sequence {i}: bad parents {parents:?}")));
                }
            }
        }
        Ok(())
    }

    /// The forward shared by [`Target::forward`] and [`Target::forward_verify`]: checks, lends slots, applies the
    /// deferred commits, runs the device forward and records the new tokens in the state.
    fn run(&self, dev: &mut Device, state: &mut CudaState, inputs: &[TargetInput<'_>]) -> Result<StepOutput> {
        self.check(state, inputs)?;
        let mut slots = Vec::with_capacity(inputs.len());
        for input in inputs {
            slots.push(state.ensure_slot(input.seq)?);
        }
        state.flush(&mut dev.model)?;
        // A one-node tree is a decode step on the device (its node sits where a causal append puts it), so plain
        // rounds run the decode shapes.
        let parents: Vec<Option<Vec<i32>>> = inputs
            .iter()
            .map(|i| i.tree.filter(|p| p.len() > 1).map(|p| p.iter().map(|p| p.map_or(-1, |p| p as i32)).collect()))
            .collect();
        let seqs: Vec<DeviceSeq<'_>> = (inputs.iter().zip(&slots).zip(&parents))
            .map(|((input, &slot), parents)| -> Result<DeviceSeq<'_>> {
                let prefix_len = state.seqs[input.seq.0].as_ref().map_or(0, |s| s.len);
                Ok(DeviceSeq { slot, prefix_len, tokens: input.tokens, parents: parents.as_deref() })
            })
            .collect::<Result<_>>()?;
        let out = dev.model.forward(&seqs).map_err(dev_err)?;
        for input in inputs {
            let seq = state.get_mut(input.seq)?;
            match input.tree {
                Some(p) => seq.pending = Some(p.to_vec()),
                None => seq.len += input.tokens.len(),
            }
        }
        Ok(out)
    }

    /// Verification of `out` on the device (see the module docs and [`VerifyProgram`]).
    fn verify_on_device(
        &self,
        dev: &mut Device,
        out: &StepOutput,
        inputs: &[TargetInput<'_>],
        hidden: bool,
        spec: VerifySpec<'_>,
    ) -> Result<Vec<Verified>> {
        let Device { model, verifier } = dev;
        // The final norm alone (the default): the accepted nodes' rows are packed on the device. Other taps: every
        // row comes back and the accepted ones are picked on the host.
        let all_rows;
        let rows = match (hidden, model.taps() == [Tap::FinalNorm]) {
            (false, _) => DeviceHidden::None,
            (true, true) => DeviceHidden::Packed(model.hidden(out).map_err(dev_err)?),
            (true, false) => {
                all_rows = model.hidden_to_host(out).map_err(dev_err)?;
                DeviceHidden::Host { rows: &all_rows, width: self.hidden_size * model.taps().len() }
            }
        };
        let logits = model.logits(out).map_err(dev_err)?;
        verifier.verify(out.batch, out.n_max, self.vocab, logits, rows, inputs, spec)
    }
}

impl Target for CudaTarget {
    type State = CudaState;

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn eos_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    /// The cache's positions less room for the largest draft tree the device verifies.
    fn max_context(&self) -> Option<usize> {
        Some(self.max_len.saturating_sub(MAX_TREE_NODES).max(1))
    }

    fn new_state(&self) -> CudaState {
        CudaState { slots: self.slots.clone(), seqs: Vec::new(), commits: Vec::new() }
    }

    /// A sequence without a slot yet: it gets one at its first forward (an error then if none is free).
    fn new_sequence(&self, state: &mut CudaState) -> SeqHandle {
        state.seqs.push(Some(CudaSeq { slot: None, len: 0, pending: None }));
        SeqHandle(state.seqs.len() - 1)
    }

    fn remove(&self, state: &mut CudaState, seq: SeqHandle) -> Result<()> {
        let s = state.get_mut(seq)?.clone();
        if let Some(slot) = s.slot {
            state.commits.retain(|c| c.0 != slot);
            lock(&state.slots)?[slot] = false;
        }
        state.seqs[seq.0] = None;
        Ok(())
    }

    fn truncate(&self, state: &mut CudaState, seq: SeqHandle, len: usize) -> Result<()> {
        let s = state.get_mut(seq)?;
        if len > s.len {
            return Err(Error::Target(format!("sequence {} has {} positions, cannot keep {len}", seq.0, s.len)));
        }
        s.len = len;
        s.pending = None;
        Ok(())
    }

    fn forward(&self, state: &mut CudaState, inputs: &[TargetInput<'_>], hidden: bool) -> Result<TargetOutput> {
        let mut dev = lock(&self.device)?;
        let out = self.run(&mut dev, state, inputs)?;
        let mut res = TargetOutput { vocab: self.vocab, ..TargetOutput::default() };
        let n_max = out.n_max;
        if inputs.iter().any(|i| i.logits) {
            let all = dev.model.logits_to_host(&out).map_err(dev_err)?;
            let mut row = 0;
            for (b, input) in inputs.iter().enumerate() {
                if input.logits {
                    let n = input.tokens.len();
                    res.logits.extend_from_slice(&all[b * n_max * self.vocab..(b * n_max + n) * self.vocab]);
                    res.logit_rows.push(row..row + n);
                    row += n;
                } else {
                    res.logit_rows.push(row..row);
                }
            }
        } else {
            res.logit_rows = vec![0..0; inputs.len()];
        }
        if hidden {
            let width = self.hidden_size * dev.model.taps().len();
            let all = dev.model.hidden_to_host(&out).map_err(dev_err)?;
            let mut rows = Vec::new();
            let mut row = 0;
            for (b, input) in inputs.iter().enumerate() {
                let n = input.tokens.len();
                rows.extend_from_slice(&all[b * n_max * width..(b * n_max + n) * width]);
                res.hidden_rows.push(row..row + n);
                row += n;
            }
            res.hidden_size = width;
            res.hidden = Some(rows);
        }
        Ok(res)
    }

    /// Verifies on the device unless top-k or top-p is asked for (not implemented there: `Ok(None)`, the state
    /// untouched, and the engine verifies on the host).
    fn forward_verify(
        &self,
        state: &mut CudaState,
        inputs: &[TargetInput<'_>],
        hidden: bool,
        spec: VerifySpec<'_>,
    ) -> Result<Option<Vec<Verified>>> {
        if spec.params.top_k.is_some() || spec.params.top_p.is_some() {
            return Ok(None);
        }
        if spec.coins.len() != inputs.len() {
            return Err(Error::ShapeMismatch { what: "coins", expected: inputs.len(), got: spec.coins.len() });
        }
        if let Some(i) = inputs.iter().position(|i| i.tree.is_none() || !i.logits) {
            return Err(Error::Target(format!("input {i}: target-side verification needs a tree with logits")));
        }
        let mut dev = lock(&self.device)?;
        let out = self.run(&mut dev, state, inputs)?;
        self.verify_on_device(&mut dev, &out, inputs, hidden, spec).map(Some)
    }

    fn fork(&self, state: &mut CudaState, seq: SeqHandle) -> Result<Option<SeqHandle>> {
        let s = state.get_mut(seq)?.clone();
        if s.pending.is_some() {
            return Err(Error::Target(format!("sequence {} has a pending tree", seq.0)));
        }
        let Some(src) = s.slot else {
            // Nothing cached yet: an empty sequence is the copy.
            return Ok(Some(self.new_sequence(state)));
        };
        let handle = self.new_sequence(state);
        let dst = state.ensure_slot(handle)?;
        let mut dev = lock(&self.device)?;
        state.flush(&mut dev.model)?;
        dev.model.fork_slot(src, dst, s.len).map_err(dev_err)?;
        state.get_mut(handle)?.len = s.len;
        Ok(Some(handle))
    }

    fn commit(&self, state: &mut CudaState, seq: SeqHandle, path: &[usize]) -> Result<()> {
        let s = state.get_mut(seq)?;
        let parents =
            s.pending.as_ref().ok_or_else(|| Error::Target(format!("sequence {} has no pending tree", seq.0)))?;
        if !crate::tree::is_root_path_of(parents, path) {
            return Err(Error::InvalidTree(format!("sequence {}: {path:?} is not a root path", seq.0)));
        }
        let slot = s.slot.ok_or_else(|| Error::Target(format!("sequence {} has no slot", seq.0)))?;
        let prefix = s.len;
        s.len += path.len();
        s.pending = None;
        // Node i was written at position prefix + i: a path of nodes 0, 1, 2, ... is already in place (every plain
        // round, and a chain accepted in full).
        if path.iter().enumerate().any(|(k, &n)| k != n) {
            state.commits.push((slot, prefix, path.iter().map(|&p| p as i32).collect()));
        }
        Ok(())
    }
}
