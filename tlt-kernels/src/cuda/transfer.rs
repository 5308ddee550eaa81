//! Packed host-device transfers through pinned memory, on any [`Gpu`]: [`Staged`] sends a step's inputs in one
//! asynchronous copy from a pinned write-combined staging buffer, [`Fetched`] brings a step's packed results back in
//! one copy into a pinned buffer. Both are laid out by [`super::packing::Packing`].
//!
//! Both follow the seam's ordering rule ([`super::gpu`]): `Staged` records an event after each copy and waits for
//! it before the host writes the staging buffer again (or frees it); `Fetched` synchronises once after its copy,
//! where the host has to wait for the results anyway. (The first GPU run read the pinned buffers with no wait at
//! all: cudarc's `PinnedHostSlice` waits on an event that a context with event tracking off never records, so
//! device acceptance read zeros, "0 nodes".)

use super::gpu::{DeviceBuf, GpuEvent, PinnedMem, SharedGpu};
use super::plan::Buf;
use crate::error::{Error, Result};

/// Inputs sent in one copy: a pinned write-combined staging buffer (the host only writes it) and the device buffer
/// it lands in, of the same size, grown when a larger packing comes.
#[derive(Debug)]
pub struct Staged {
    gpu: SharedGpu,
    staging: PinnedMem,
    dev: DeviceBuf<u8>,
    /// Recorded after the last copy from `staging`: the host waits for it before touching `staging` again.
    sent: Option<GpuEvent>,
}

impl Staged {
    /// Buffers of `bytes` bytes on `gpu`.
    ///
    /// # Errors
    /// When an allocation fails.
    pub fn new(gpu: &SharedGpu, bytes: usize) -> Result<Self> {
        let staging = gpu.alloc_pinned(bytes.max(1), true)?;
        let dev = DeviceBuf::zeros(gpu.as_ref(), staging.bytes())?;
        Ok(Self { gpu: gpu.clone(), staging, dev, sent: None })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.dev.bytes()
    }

    /// Waits for the last copy from the staging buffer.
    fn settle(&mut self) -> Result<()> {
        match self.sent.take() {
            Some(e) => self.gpu.wait(&e),
            None => Ok(()),
        }
    }

    /// Lets `fill` write the first `bytes` bytes of the staging buffer (after the previous copy from it has run),
    /// then sends them in one asynchronous copy; the device buffer, as a plan's buffer (valid until the next
    /// `send`, which may grow it).
    ///
    /// # Errors
    /// `fill`'s error, or the device's when a wait, an allocation or the copy fails.
    pub fn send(&mut self, bytes: usize, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<Buf<u8>> {
        self.settle()?;
        if bytes > self.staging.bytes() {
            let grown = bytes.max(2 * self.staging.bytes());
            self.staging = self.gpu.alloc_pinned(grown, true)?;
            self.dev = DeviceBuf::zeros(self.gpu.as_ref(), grown)?;
        }
        let host = self.gpu.pinned_write(&mut self.staging)?;
        fill(&mut host[..bytes])?;
        self.gpu.upload_pinned(&self.staging, self.dev.buf().addr(), bytes)?;
        self.sent = Some(self.gpu.record()?);
        Ok(self.dev.buf())
    }

    /// The device buffer, as a plan's buffer.
    pub fn buf(&self) -> Buf<u8> {
        self.dev.buf()
    }
}

impl Drop for Staged {
    /// Pinned memory is freed at once, not in stream order: wait for the copy that may still read it.
    fn drop(&mut self) {
        if let Err(e) = self.settle() {
            // A destructor cannot return the error; the device is failing anyway.
            eprintln!("warning: waiting for a copy before freeing its pinned staging buffer failed: {e}");
        }
    }
}

/// Results read back in one copy: a device buffer the kernels write and a pinned host buffer of the same size.
#[derive(Debug)]
pub struct Fetched {
    gpu: SharedGpu,
    dev: DeviceBuf<u8>,
    host: PinnedMem,
}

impl Fetched {
    /// Buffers of `bytes` bytes on `gpu`.
    ///
    /// # Errors
    /// When an allocation fails.
    pub fn new(gpu: &SharedGpu, bytes: usize) -> Result<Self> {
        let host = gpu.alloc_pinned(bytes.max(1), false)?;
        let dev = DeviceBuf::zeros(gpu.as_ref(), host.bytes())?;
        Ok(Self { gpu: gpu.clone(), dev, host })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.dev.bytes()
    }

    /// The device buffer, as a plan's buffer.
    pub fn buf(&self) -> Buf<u8> {
        self.dev.buf()
    }

    /// Copies the first `bytes` bytes back after the work queued so far and waits for them (one synchronisation:
    /// the host needs the results before it can go on).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for more bytes than the buffer holds; the device's when the copy or the wait
    /// fails.
    pub fn fetch(&mut self, bytes: usize) -> Result<&[u8]> {
        if bytes > self.dev.bytes() {
            return Err(Error::InvalidArgument(format!("{bytes} bytes from a result buffer of {}", self.dev.bytes())));
        }
        self.gpu.download_pinned(self.dev.buf().addr(), &self.host, bytes)?;
        self.gpu.synchronize()?;
        Ok(&self.gpu.pinned_read(&self.host)?[..bytes])
    }
}
