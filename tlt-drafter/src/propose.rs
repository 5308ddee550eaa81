//! The drafter as a `tlt_spec_decode::Drafter`: catch up on the target's features of newly committed positions,
//! then grow EAGLE-2 dynamic trees for the whole batch level by level, one batched drafter forward per level.

use std::collections::HashMap;
use std::sync::Arc;

use tlt_spec_decode::{Beam, DraftContext, DraftTree, Drafter, Plan, RequestId};

use crate::exec::{DraftExecutor, HostExecutor};
use crate::online::{WeightsReader, WeightsSlot};
use crate::runtime::{Attend, DraftRuntime, Row};
use crate::{Error, Result};

/// Per-request drafter state.
#[derive(Debug)]
struct SeqState<C> {
    cache: C,
    /// Layer output at the last committed position (the root's draft distribution comes from it).
    last_out: Vec<f32>,
}

impl<C: Default> Default for SeqState<C> {
    fn default() -> Self {
        Self { cache: C::default(), last_out: Vec::new() }
    }
}

/// An EAGLE drafter serving `tlt_spec_decode::Engine` rounds from versioned weights.
///
/// Between rounds it picks up the newest weights published to its [`WeightsSlot`] (every round uses exactly
/// one version; after a swap the per-request caches are rebuilt from the recorded target features). It needs
/// the engine to record hidden states (`Engine::record_hidden`), with the target's features as the drafter
/// was trained on: final-norm states for EAGLE-2, `TappedLlama` with `Tap::eagle3` for EAGLE-3.
///
/// The drafter's arithmetic runs where its [`DraftExecutor`] runs it: on the host by default ([`HostExecutor`]),
/// or on a CUDA device ([`EagleProposer::with_executor`] and `cuda::CudaDrafter`, feature `cuda`); the tree
/// growth above it is the same.
#[derive(Debug)]
pub struct EagleProposer<E: DraftExecutor = HostExecutor> {
    reader: WeightsReader<DraftRuntime>,
    exec: E,
    seqs: HashMap<RequestId, SeqState<E::Cache>>,
    /// Rounds proposed per weights version, in order of first use.
    rounds_by_version: Vec<(u64, u64)>,
}

impl EagleProposer {
    /// A proposer reading `slot`, drafting on the host.
    pub fn new(slot: Arc<WeightsSlot<DraftRuntime>>) -> Self {
        Self::with_executor(slot, HostExecutor)
    }

    /// A proposer with fixed weights (its own slot, version 0), drafting on the host.
    pub fn fixed(runtime: DraftRuntime) -> Self {
        Self::new(Arc::new(WeightsSlot::new(runtime)))
    }
}

impl<E: DraftExecutor> EagleProposer<E> {
    /// A proposer reading `slot`, drafting with `exec` (e.g. on a device).
    pub fn with_executor(slot: Arc<WeightsSlot<DraftRuntime>>, exec: E) -> Self {
        Self { reader: WeightsReader::new(slot), exec, seqs: HashMap::new(), rounds_by_version: Vec::new() }
    }

    /// The executor.
    pub fn executor(&self) -> &E {
        &self.exec
    }

    /// The weights version the last round used.
    pub fn version(&self) -> u64 {
        self.reader.current().version
    }

    /// Rounds proposed with each weights version, `(version, rounds)` in order of first use.
    pub fn rounds_by_version(&self) -> &[(u64, u64)] {
        &self.rounds_by_version
    }

    fn count_round(&mut self) {
        let v = self.version();
        match self.rounds_by_version.last_mut() {
            Some((last, n)) if *last == v => *n += 1,
            _ => self.rounds_by_version.push((v, 1)),
        }
    }

    /// Picks up newly published weights (dropping caches of the old ones) and makes them the executor's.
    fn refresh(&mut self) -> Result<()> {
        if self.reader.refresh() {
            self.seqs.clear(); // Caches hold keys and values of the old weights.
        }
        let cur = self.reader.current();
        self.exec.load(&cur.weights, cur.version)
    }

    /// Feeds every request's newly committed positions through the drafter (one batched forward); returns, per
    /// context, whether it has a root output to draft from.
    fn catch_up(&mut self, ctxs: &[DraftContext<'_>]) -> Result<Vec<bool>> {
        let rt = &self.reader.current().weights;
        let mut plan: Vec<(RequestId, usize, usize)> = Vec::new(); // (request, first position, end)
        for c in ctxs {
            let hidden = c.hidden.ok_or_else(|| Error::InvalidArgument("EAGLE drafting needs hidden states".into()))?;
            let fed = c.history.len().saturating_sub(1);
            if hidden.len() != fed {
                return Err(Error::InvalidArgument(format!(
                    "request {}: {} hidden rows for {fed} fed positions",
                    c.request.0,
                    hidden.len()
                )));
            }
            let st = self.seqs.entry(c.request).or_default();
            if E::committed(&st.cache) > fed {
                *st = SeqState::default(); // The history went back (a new request under a reused id).
            }
            plan.push((c.request, E::committed(&st.cache), fed));
        }
        let mut rows = Vec::new();
        for (c, &(_, from, to)) in ctxs.iter().zip(&plan) {
            let hidden = c.hidden.ok_or_else(|| Error::InvalidArgument("missing hidden states".into()))?;
            for t in from..to {
                let row = hidden.row(t).ok_or_else(|| Error::InvalidArgument(format!("no hidden row {t}")))?;
                let feature = rt.feature_of(row)?;
                rows.push(Row { token: c.history[t + 1], feature, pos: t });
            }
        }
        if rows.is_empty() {
            return Ok(plan
                .iter()
                .map(|&(id, _, _)| self.seqs.get(&id).is_some_and(|s| !s.last_out.is_empty()))
                .collect());
        }
        let h = rt.hidden_size();
        // Disjoint mutable caches of the batch, in context order.
        let mut states: Vec<(RequestId, SeqState<E::Cache>)> =
            plan.iter().map(|&(id, _, _)| (id, self.seqs.remove(&id).unwrap_or_default())).collect();
        let mut start = 0;
        let mut groups = Vec::new();
        let mut ranges = Vec::new();
        for ((_, st), &(_, from, to)) in states.iter_mut().zip(&plan) {
            let r = start..start + (to - from);
            start = r.end;
            ranges.push(r.clone());
            groups.push((&mut st.cache, r, Attend::Causal));
        }
        let out = self.exec.forward(rt, &rows, &mut groups, 0).map(|f| f.out);
        drop(groups);
        let out = out?;
        for ((_, st), r) in states.iter_mut().zip(&ranges) {
            E::commit(&mut st.cache, r.len());
            if !r.is_empty() {
                st.last_out = out[(r.end - 1) * h..r.end * h].to_vec();
            }
        }
        let ready = states.iter().map(|(_, s)| !s.last_out.is_empty()).collect();
        self.seqs.extend(states);
        Ok(ready)
    }
}

/// Where a drafted node lives during one round.
#[derive(Debug, Clone)]
struct NodeState {
    /// Its layer output (the feature of its children).
    out: Vec<f32>,
    /// Its row among the cache's tentative rows.
    slot: usize,
}

impl<E: DraftExecutor> Drafter for EagleProposer<E> {
    fn needs_hidden(&self) -> bool {
        true
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, plan: &Plan) -> tlt_spec_decode::Result<DraftTree> {
        let mut v = self.propose_batch(std::slice::from_ref(ctx), plan)?;
        v.pop().ok_or_else(|| tlt_spec_decode::Error::InvalidArgument("no tree".into()))
    }

    fn propose_batch(&mut self, ctxs: &[DraftContext<'_>], plan: &Plan) -> tlt_spec_decode::Result<Vec<DraftTree>> {
        self.propose_all(ctxs, plan).map_err(|e| tlt_spec_decode::Error::InvalidArgument(format!("drafter: {e}")))
    }

    fn prepare(&mut self, ctxs: &[DraftContext<'_>]) -> tlt_spec_decode::Result<()> {
        self.refresh().map_err(to_sd)?;
        self.catch_up(ctxs).map(drop).map_err(to_sd)
    }

    fn release(&mut self, request: RequestId) {
        self.seqs.remove(&request);
    }
}

impl<E: DraftExecutor> EagleProposer<E> {
    fn propose_all(&mut self, ctxs: &[DraftContext<'_>], plan: &Plan) -> Result<Vec<DraftTree>> {
        self.refresh()?;
        self.count_round();
        let ready = self.catch_up(ctxs)?;
        let roots: Vec<u32> = ctxs.iter().map(|c| c.history.last().copied().unwrap_or(0)).collect();
        let reader = &self.reader;
        let exec = &mut self.exec;
        let rt = &reader.current().weights;
        let h = rt.hidden_size();
        // Per tree: committed length, root output, drafted node states, tentative parents.
        let mut states: Vec<SeqState<E::Cache>> =
            ctxs.iter().map(|c| self.seqs.remove(&c.request).unwrap_or_default()).collect();
        let mut nodes: Vec<HashMap<usize, NodeState>> = vec![HashMap::new(); ctxs.len()];
        let mut parents: Vec<Vec<Option<usize>>> = vec![Vec::new(); ctxs.len()];
        let result = DraftTree::eagle2_many(&roots, plan, |beams: &[Beam<'_>]| {
            let mut cands: Vec<Option<Vec<(u32, f32)>>> = vec![None; beams.len()];
            // Roots: their distribution comes from the catch-up output (one batched head for all of them).
            let roots: Vec<usize> = (0..beams.len()).filter(|&i| beams[i].node == 0).collect();
            let ready_roots: Vec<usize> = roots.iter().copied().filter(|&i| ready[beams[i].tree]).collect();
            for &i in &roots {
                cands[i] = Some(Vec::new());
            }
            if !ready_roots.is_empty() {
                let a: Vec<f32> =
                    ready_roots.iter().flat_map(|&i| states[beams[i].tree].last_out.iter().copied()).collect();
                let top = exec.top_k(rt, &a, plan.top_k).map_err(to_sd)?;
                for (&i, c) in ready_roots.iter().zip(top) {
                    cands[i] = Some(c);
                }
            }
            // Other beams: one batched forward, grouped per tree.
            let mut order: Vec<usize> = (0..beams.len()).filter(|&i| beams[i].node != 0).collect();
            order.sort_by_key(|&i| beams[i].tree);
            if !order.is_empty() {
                let mut feats: Vec<Vec<f32>> = Vec::with_capacity(order.len());
                for &i in &order {
                    let b = &beams[i];
                    let parent = b.parent.unwrap_or(0);
                    feats.push(if parent == 0 {
                        states[b.tree].last_out.clone()
                    } else {
                        nodes[b.tree].get(&parent).map(|n| n.out.clone()).unwrap_or_default()
                    });
                }
                let rows: Vec<Row<'_>> = order
                    .iter()
                    .zip(&feats)
                    .map(|(&i, f)| {
                        let b = &beams[i];
                        let depth = b.tokens.len() - 1;
                        Row {
                            token: *b.tokens.last().unwrap_or(&0),
                            feature: f,
                            pos: (E::committed(&states[b.tree].cache) + depth).saturating_sub(1),
                        }
                    })
                    .collect();
                // Tentative parents per tree, extended with this level's rows.
                let mut start = 0;
                let mut spans: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
                for t in 0..ctxs.len() {
                    let mine: Vec<usize> = order.iter().copied().filter(|&i| beams[i].tree == t).collect();
                    if mine.is_empty() {
                        continue;
                    }
                    for &i in &mine {
                        let b = &beams[i];
                        let p = b.parent.filter(|&p| p != 0).and_then(|p| nodes[t].get(&p).map(|n| n.slot));
                        nodes[t].insert(b.node, NodeState { out: Vec::new(), slot: parents[t].len() });
                        parents[t].push(p);
                    }
                    spans.push((t, start..start + mine.len()));
                    start += mine.len();
                }
                let mut groups = Vec::new();
                let mut rest: &mut [SeqState<E::Cache>] = &mut states;
                let mut offset = 0;
                for (t, r) in &spans {
                    let (_, tail) = rest.split_at_mut(t - offset);
                    let (st, tail) =
                        tail.split_first_mut().ok_or_else(|| to_sd(Error::InvalidArgument("tree".into())))?;
                    groups.push((&mut st.cache, r.clone(), Attend::Tree(&parents[*t])));
                    rest = tail;
                    offset = t + 1;
                }
                let fwd = exec.forward(rt, &rows, &mut groups, plan.top_k).map_err(to_sd)?;
                drop(groups);
                for ((j, &i), c) in order.iter().enumerate().zip(fwd.candidates) {
                    let b = &beams[i];
                    if let Some(n) = nodes[b.tree].get_mut(&b.node) {
                        n.out = fwd.out[j * h..(j + 1) * h].to_vec();
                    }
                    cands[i] = Some(c);
                }
            }
            Ok(cands.into_iter().map(Option::unwrap_or_default).collect())
        });
        for (c, mut st) in ctxs.iter().zip(states) {
            exec.truncate_tentative(rt, &mut st.cache);
            self.seqs.insert(c.request, st);
        }
        result.map_err(|e| Error::InvalidArgument(e.to_string()))
    }
}

fn to_sd(e: Error) -> tlt_spec_decode::Error {
    tlt_spec_decode::Error::InvalidArgument(format!("drafter: {e}"))
}
