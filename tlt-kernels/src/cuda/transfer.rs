//! Packed host-device transfers through pinned memory (feature `cuda`): [`Staged`] sends a step's inputs in one
//! asynchronous copy from a pinned write-combined staging buffer, [`Fetched`] brings a step's packed results back in
//! one copy into a pinned buffer. Both are laid out by [`super::packing::Packing`].

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use super::device::drv;
use super::plan::Buf;
use crate::error::{Error, Result};

/// `s` as a launch plan's buffer: its device address, no stream-ordering guard. For buffers of a context whose
/// event tracking is off and that are used on one stream only, where stream order alone keeps them correct.
pub fn buf_of<T>(s: &CudaSlice<T>, stream: &CudaStream) -> Buf<T> {
    let (ptr, _) = s.device_ptr(stream);
    Buf::new(ptr, s.len())
}

/// A zeroed pinned host buffer of `bytes` bytes (`flags`: `cuMemHostAlloc`'s).
fn pinned(stream: &Arc<CudaStream>, bytes: usize, flags: u32) -> Result<PinnedHostSlice<u8>> {
    // SAFETY: the memory is zeroed right below, before anything reads it.
    let mut p =
        unsafe { stream.context().alloc_pinned_with_flags::<u8>(bytes.max(1), flags) }.map_err(drv("pinned alloc"))?;
    p.as_mut_slice().map_err(drv("pinned alloc"))?.fill(0);
    Ok(p)
}

/// Inputs sent in one copy: a pinned write-combined staging buffer (the host only writes it) and the device buffer
/// it lands in, of the same size, grown when a larger packing comes.
#[derive(Debug)]
pub struct Staged {
    staging: PinnedHostSlice<u8>,
    dev: CudaSlice<u8>,
}

impl Staged {
    /// Buffers of `bytes` bytes.
    ///
    /// # Errors
    /// [`Error::Cuda`] when an allocation fails.
    pub fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        let staging = pinned(stream, bytes, sys::CU_MEMHOSTALLOC_WRITECOMBINED)?;
        let dev = stream.alloc_zeros::<u8>(staging.len()).map_err(drv("alloc"))?;
        Ok(Self { staging, dev })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.dev.len()
    }

    /// Lets `fill` write the first `bytes` bytes of the staging buffer (after the previous copy from it finished),
    /// then sends the buffer in one asynchronous copy on `stream`; the device buffer, as a plan's buffer.
    ///
    /// # Errors
    /// `fill`'s error, or [`Error::Cuda`] when a wait, an allocation or the copy fails.
    pub fn send(
        &mut self,
        stream: &Arc<CudaStream>,
        bytes: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<Buf<u8>> {
        if bytes > self.staging.len() {
            *self = Self::new(stream, bytes.max(2 * self.staging.len()))?;
        }
        let host = self.staging.as_mut_slice().map_err(drv("staging wait"))?;
        fill(&mut host[..bytes])?;
        stream.memcpy_htod(&self.staging, &mut self.dev).map_err(drv("upload"))?;
        Ok(buf_of(&self.dev, stream))
    }

    /// The device buffer, as a plan's buffer.
    pub fn buf(&self, stream: &CudaStream) -> Buf<u8> {
        buf_of(&self.dev, stream)
    }
}

/// Results read back in one copy: a device buffer the kernels write and a pinned host buffer of the same size.
#[derive(Debug)]
pub struct Fetched {
    dev: CudaSlice<u8>,
    host: PinnedHostSlice<u8>,
}

impl Fetched {
    /// Buffers of `bytes` bytes.
    ///
    /// # Errors
    /// [`Error::Cuda`] when an allocation fails.
    pub fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        let host = pinned(stream, bytes, 0)?;
        let dev = stream.alloc_zeros::<u8>(host.len()).map_err(drv("alloc"))?;
        Ok(Self { dev, host })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.dev.len()
    }

    /// The device buffer, as a plan's buffer.
    pub fn buf(&self, stream: &CudaStream) -> Buf<u8> {
        buf_of(&self.dev, stream)
    }

    /// Copies the first `bytes` bytes back after the work queued on `stream` and waits for them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for more bytes than the buffer holds; [`Error::Cuda`] when the copy or the wait
    /// fails.
    pub fn fetch(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<&[u8]> {
        if bytes > self.dev.len() {
            return Err(Error::InvalidArgument(format!("{bytes} bytes from a result buffer of {}", self.dev.len())));
        }
        stream.memcpy_dtoh(&self.dev.slice(0..bytes), &mut self.host).map_err(drv("download"))?;
        let host = self.host.as_slice().map_err(drv("download wait"))?;
        Ok(&host[..bytes])
    }
}
