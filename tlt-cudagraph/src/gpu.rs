//! Graphs on a device behind the seam (`tlt_kernels::cuda::Gpu`: a CUDA device, or the simulated one in CI): the one
//! capture of the workspace ([`capture`]), used by the pool's backend ([`GpuGraphBackend`]) and by
//! `tlt_model::cuda::CudaLlama`'s shape cache.

use tlt_kernels::cuda::{GpuGraph, SharedGpu};

use crate::error::{BoxError, Error, Result};
use crate::executor::{Captured, GraphBackend};
use crate::key::GraphKey;

/// Records the work `record` queues on `gpu` into a graph (`what` names it in errors). The capture is always ended,
/// even when recording fails, so the stream is usable again; the device's graph memory that grew meanwhile is
/// counted.
///
/// Only launches, GEMMs and device copies may be queued while capturing: host transfers, waits and allocations
/// belong before it (buffers are allocated and inputs sent before the capture; a replay reads the same buffers).
///
/// # Errors
/// [`Error::Driver`] when capture cannot begin or end, [`Error::Run`] with `record`'s error, and
/// [`Error::EmptyCapture`] when nothing was recorded.
pub fn capture(
    gpu: &SharedGpu,
    what: &str,
    record: impl FnOnce() -> std::result::Result<(), BoxError>,
) -> Result<Captured<GpuGraph>> {
    let before = gpu.graph_memory();
    gpu.begin_capture().map_err(|e| Error::Driver { op: "begin_capture", message: e.to_string() })?;
    let recorded = record();
    let ended = gpu.end_capture();
    recorded.map_err(Error::Run)?;
    let graph = ended
        .map_err(|e| Error::Driver { op: "end_capture", message: e.to_string() })?
        .ok_or_else(|| Error::EmptyCapture { key: what.to_string() })?;
    Ok(Captured { graph, bytes: gpu.graph_memory().saturating_sub(before) })
}

/// Records the work of one key onto the device (kernel launches and device copies on static buffers). Called only
/// while the device captures: host transfers and waits are not allowed.
pub type Recorder<Io> = dyn FnMut(&GraphKey, &mut Io, &SharedGpu) -> std::result::Result<(), BoxError> + Send;

/// Captures graphs on one device's stream and replays them there: the backend of a [`crate::GraphExecutor`].
///
/// Allocate the static input/output buffers on the same device and send their contents before `run` (the replay
/// reads them where the capture found them). Graph memory: the bytes counted per graph are the growth of the
/// device's graph memory during capture, or the caller's estimate when larger (graphs over caller-owned static
/// buffers allocate little themselves).
pub struct GpuGraphBackend<Io: ?Sized> {
    gpu: SharedGpu,
    record: Box<Recorder<Io>>,
    estimate: fn(&GraphKey) -> u64,
}

impl<Io: ?Sized> std::fmt::Debug for GpuGraphBackend<Io> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuGraphBackend").field("device", &self.gpu.info().name).finish_non_exhaustive()
    }
}

impl<Io: ?Sized> GpuGraphBackend<Io> {
    /// A backend on `gpu` recording with `record`.
    pub fn new(
        gpu: SharedGpu,
        record: impl FnMut(&GraphKey, &mut Io, &SharedGpu) -> std::result::Result<(), BoxError> + Send + 'static,
    ) -> Self {
        Self { gpu, record: Box::new(record), estimate: |_| 0 }
    }

    /// Counts at least `estimate(key)` bytes per graph.
    #[must_use]
    pub fn with_estimate(mut self, estimate: fn(&GraphKey) -> u64) -> Self {
        self.estimate = estimate;
        self
    }

    /// The device.
    pub fn gpu(&self) -> &SharedGpu {
        &self.gpu
    }
}

impl<Io: ?Sized> GraphBackend<Io> for GpuGraphBackend<Io> {
    type Graph = GpuGraph;

    fn capture(&mut self, key: &GraphKey, io: &mut Io) -> Result<Captured<GpuGraph>> {
        let (gpu, record) = (&self.gpu, &mut self.record);
        let mut c = capture(gpu, &key.to_string(), || record(key, io, gpu))?;
        c.bytes = c.bytes.max((self.estimate)(key));
        Ok(c)
    }

    fn replay(&mut self, graph: &GpuGraph, _key: &GraphKey, _io: &mut Io) -> Result<()> {
        self.gpu.replay(graph).map_err(|e| Error::Driver { op: "graph launch", message: e.to_string() })
    }
}
