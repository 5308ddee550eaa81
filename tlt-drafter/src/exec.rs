//! Where the drafter's arithmetic runs. [`DraftExecutor`] is the seam between the proposer (tree growth,
//! per-request bookkeeping: host logic, device-independent) and the drafter's forward and top-k: on the host
//! ([`HostExecutor`]: the packed CPU runtime) or on a CUDA device (`cuda::CudaDrafter`, feature `cuda`).

use tlt_kernels::log_softmax;

use crate::runtime::{DraftCache, DraftRuntime, Group, Row};
use crate::Result;

/// What a forward returns: the layer outputs `[rows, H]` (each row's feature for its children) and, when asked,
/// every row's most probable draft tokens (target ids with log-probabilities, best first).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Forward {
    /// Layer outputs, `[rows, H]` row-major.
    pub out: Vec<f32>,
    /// Per row, the top-k `(target id, log-prob)` (empty when the forward was asked for none).
    pub candidates: Vec<Vec<(u32, f32)>>,
}

/// Runs a [`DraftRuntime`]'s forward and draft head somewhere, with per-sequence caches of its own kind.
///
/// The runtime is the weights' one source (published by the online trainer): a device executor copies them in
/// [`DraftExecutor::load`] whenever the version changes, and reads the runtime's shapes and vocabulary map.
pub trait DraftExecutor: std::fmt::Debug + Send {
    /// Per-sequence state: the keys and values of the drafter's layer at committed positions, plus tentative rows
    /// of the tree being drafted.
    type Cache: Default + std::fmt::Debug + Send;

    /// Makes `rt` (weights version `version`) the weights of the next forwards. Called before every round;
    /// cheap when the version is unchanged. Caches built with other weights must be dropped by the caller.
    ///
    /// # Errors
    /// When the weights cannot be copied where they run.
    fn load(&mut self, rt: &DraftRuntime, version: u64) -> Result<()>;

    /// Runs `rows`, grouped per sequence (as the runtime's own forward); with `top_k > 0` also returns each row's
    /// `top_k` most probable draft tokens.
    ///
    /// # Errors
    /// For rows or groups that disagree with the runtime, or a failed device operation.
    fn forward(
        &mut self,
        rt: &DraftRuntime,
        rows: &[Row<'_>],
        groups: &mut [Group<'_, '_, Self::Cache>],
        top_k: usize,
    ) -> Result<Forward>;

    /// The `k` most probable draft tokens of layer outputs `a` (`[rows, H]`), per row.
    ///
    /// # Errors
    /// As [`DraftExecutor::forward`].
    fn top_k(&mut self, rt: &DraftRuntime, a: &[f32], k: usize) -> Result<Vec<Vec<(u32, f32)>>>;

    /// Committed positions of a cache.
    fn committed(cache: &Self::Cache) -> usize;

    /// Marks the first `n` rows after a cache's committed positions as committed (after a causal forward).
    fn commit(cache: &mut Self::Cache, n: usize);

    /// Drops a cache's tentative rows.
    fn truncate_tentative(&mut self, rt: &DraftRuntime, cache: &mut Self::Cache);
}

/// The top `k` entries of one row of draft logits, as target ids with log-probabilities (best first, ties to the
/// smaller draft id).
pub(crate) fn top_k_of_row(row: &[f32], k: usize, rt: &DraftRuntime) -> Result<Vec<(u32, f32)>> {
    let lp = log_softmax(row).map_err(tlt_model::Error::from)?;
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Ok(Vec::new());
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    Ok(idx.into_iter().map(|i| (rt.target_id(i), lp[i])).collect())
}

/// The host executor: [`DraftRuntime`]'s own packed CPU forward and head.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostExecutor;

impl HostExecutor {
    fn candidates(rt: &DraftRuntime, a: &[f32], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        let logits = rt.logits(a)?;
        let dv = rt.draft_vocab();
        logits.chunks_exact(dv.max(1)).map(|row| top_k_of_row(row, k, rt)).collect()
    }
}

impl DraftExecutor for HostExecutor {
    type Cache = DraftCache;

    fn load(&mut self, _rt: &DraftRuntime, _version: u64) -> Result<()> {
        Ok(())
    }

    fn forward(
        &mut self,
        rt: &DraftRuntime,
        rows: &[Row<'_>],
        groups: &mut [Group<'_, '_, DraftCache>],
        top_k: usize,
    ) -> Result<Forward> {
        let out = rt.forward(rows, groups)?;
        let candidates = if top_k > 0 { Self::candidates(rt, &out, top_k)? } else { Vec::new() };
        Ok(Forward { out, candidates })
    }

    fn top_k(&mut self, rt: &DraftRuntime, a: &[f32], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        Self::candidates(rt, a, k)
    }

    fn committed(cache: &DraftCache) -> usize {
        cache.len
    }

    fn commit(cache: &mut DraftCache, n: usize) {
        cache.len += n;
    }

    fn truncate_tentative(&mut self, rt: &DraftRuntime, cache: &mut DraftCache) {
        rt.truncate_tentative(cache);
    }
}

/// An executor shared by successive proposers (a trainer makes one proposer per rollout; a device executor
/// compiles its kernels and allocates its cache once). Each call locks it.
impl<E: DraftExecutor> DraftExecutor for std::sync::Arc<parking_lot::Mutex<E>> {
    type Cache = E::Cache;

    fn load(&mut self, rt: &DraftRuntime, version: u64) -> Result<()> {
        self.lock().load(rt, version)
    }

    fn forward(
        &mut self,
        rt: &DraftRuntime,
        rows: &[Row<'_>],
        groups: &mut [Group<'_, '_, E::Cache>],
        top_k: usize,
    ) -> Result<Forward> {
        self.lock().forward(rt, rows, groups, top_k)
    }

    fn top_k(&mut self, rt: &DraftRuntime, a: &[f32], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        self.lock().top_k(rt, a, k)
    }

    fn committed(cache: &E::Cache) -> usize {
        E::committed(cache)
    }

    fn commit(cache: &mut E::Cache, n: usize) {
        E::commit(cache, n);
    }

    fn truncate_tentative(&mut self, rt: &DraftRuntime, cache: &mut E::Cache) {
        self.lock().truncate_tentative(rt, cache);
    }
}
