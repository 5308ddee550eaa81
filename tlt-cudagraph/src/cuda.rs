//! The CUDA backend: stream capture and graph launch through the driver API (`cudarc`), loaded at run time.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaGraph, CudaStream, DriverError};

use crate::error::{BoxError, Error, Result};
use crate::executor::{Captured, GraphBackend};
use crate::key::GraphKey;

fn drv(op: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Driver { op, message: e.to_string() }
}

/// Whether a CUDA driver library can be loaded (never panics).
pub fn driver_available() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and drops what it opened.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// Records the work of one key onto `stream` (kernel launches, async copies on static buffers). Called only
/// while the stream is capturing: host-device copies and synchronisation are not allowed.
pub type Recorder<Io> = dyn FnMut(&GraphKey, &mut Io, &Arc<CudaStream>) -> std::result::Result<(), BoxError>;

/// Captures graphs on one stream of one device and replays them there.
///
/// Allocate the static input/output buffers through [`CudaGraphBackend::stream`] and use them on that stream
/// only (the backend turns off cudarc's cross-stream event tracking for its context, which capture cannot
/// tolerate); the eager forward should run on the same stream.
///
/// Graph memory: every graph of a device allocates from the device's graph memory pool, so all graphs of a
/// pool share it; the bytes counted per graph are the growth of that pool's use during capture and upload
/// (`CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT`), or the caller's estimate when larger (graphs over caller-owned
/// static buffers allocate nothing themselves).
pub struct CudaGraphBackend<Io: ?Sized> {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    record: Box<Recorder<Io>>,
    estimate: fn(&GraphKey) -> u64,
}

impl<Io: ?Sized> std::fmt::Debug for CudaGraphBackend<Io> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraphBackend").field("ordinal", &self.ctx.ordinal()).finish_non_exhaustive()
    }
}

impl<Io: ?Sized> CudaGraphBackend<Io> {
    /// A backend on device `ordinal`, with its own stream.
    ///
    /// # Errors
    /// [`Error::NoDriver`] when no driver library loads (never panics), [`Error::Driver`] when the device cannot
    /// be opened.
    pub fn new(
        ordinal: usize,
        record: impl FnMut(&GraphKey, &mut Io, &Arc<CudaStream>) -> std::result::Result<(), BoxError> + 'static,
    ) -> Result<Self> {
        if !driver_available() {
            return Err(Error::NoDriver("libcuda could not be loaded".into()));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| Error::NoDriver("the driver library lacks a required symbol".into()))?
            .map_err(drv("context"))?;
        // SAFETY: cudarc's cross-stream event tracking would make captured work wait on events recorded
        // before the capture, which invalidates it. This context object is the backend's own, and all work on
        // buffers allocated through it goes through the one capture/replay stream (documented requirement), so
        // stream order alone keeps it correct.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("new_stream"))?;
        Ok(Self { ctx, stream, record: Box::new(record), estimate: |_| 0 })
    }

    /// Counts at least `estimate(key)` bytes per graph.
    #[must_use]
    pub fn with_estimate(mut self, estimate: fn(&GraphKey) -> u64) -> Self {
        self.estimate = estimate;
        self
    }

    /// The capture/replay stream (allocate static buffers on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn graph_mem_used(&self) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: the attribute is a 64-bit counter written into `v`; the device handle is the context's.
        let r = unsafe {
            sys::cuDeviceGetGraphMemAttribute(
                self.ctx.cu_device(),
                sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
                (&mut v as *mut u64).cast(),
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS {
            v
        } else {
            0
        }
    }
}

impl<Io: ?Sized> GraphBackend<Io> for CudaGraphBackend<Io> {
    type Graph = CudaGraph;

    fn capture(&mut self, key: &GraphKey, io: &mut Io) -> Result<Captured<CudaGraph>> {
        let before = self.graph_mem_used();
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("begin_capture"))?;
        let recorded = (self.record)(key, io, &self.stream);
        // Always end the capture, even when recording failed, so the stream is usable again.
        let ended = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        recorded.map_err(Error::Run)?;
        let graph = ended.map_err(drv("end_capture"))?.ok_or_else(|| Error::EmptyCapture { key: key.to_string() })?;
        graph.upload().map_err(drv("graph_upload"))?;
        let grown = self.graph_mem_used().saturating_sub(before);
        Ok(Captured { graph, bytes: grown.max((self.estimate)(key)) })
    }

    fn replay(&mut self, graph: &CudaGraph, _key: &GraphKey, _io: &mut Io) -> Result<()> {
        graph.launch().map_err(drv("graph_launch"))
    }
}
