//! Device buffers recycled across the launches of one stream (feature `cuda`): a forward asks for scratch buffers
//! by type and length, and each goes back to the shelf when dropped, for the next forward of the same shape instead
//! of a fresh allocation. Safe only for buffers used on one stream: a buffer handed back while kernels that use it
//! are still queued is given only to launches queued after them.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

use super::device::drv;
use crate::error::Result;

#[derive(Debug, Default)]
struct Shelves {
    /// Idle buffers by (element type, length).
    idle: HashMap<(TypeId, usize), Vec<Box<dyn Any + Send>>>,
    /// Bytes of the idle buffers.
    bytes: usize,
    /// The most idle bytes kept; a buffer handed back beyond it is freed.
    cap: usize,
}

/// Scratch buffers of one stream, recycled (at most `cap` idle bytes kept).
#[derive(Debug, Clone)]
pub struct Recycler {
    shelves: Arc<Mutex<Shelves>>,
}

impl Recycler {
    /// A recycler keeping at most `cap` idle bytes.
    #[must_use]
    pub fn new(cap: usize) -> Self {
        Self { shelves: Arc::new(Mutex::new(Shelves { cap, ..Shelves::default() })) }
    }

    /// A buffer of `n` elements of `T` (at least 1) on `stream`: an idle one of that length if any (its contents
    /// are what its last user left), else a new zeroed one.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when an allocation fails.
    pub fn take<T: DeviceRepr + ValidAsZeroBits + 'static>(
        &self,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<Scratch<T>> {
        let n = n.max(1);
        let reused = {
            let mut s = self.shelves.lock().unwrap_or_else(PoisonError::into_inner);
            let got = s.idle.get_mut(&(TypeId::of::<CudaSlice<T>>(), n)).and_then(Vec::pop);
            let got = got.and_then(|b| b.downcast::<CudaSlice<T>>().ok());
            if got.is_some() {
                s.bytes -= n * std::mem::size_of::<T>();
            }
            got
        };
        let buf = match reused {
            Some(b) => *b,
            None => stream.alloc_zeros::<T>(n).map_err(drv("alloc"))?,
        };
        Ok(Scratch { buf: Some(buf), home: self.shelves.clone() })
    }

    /// Bytes of the idle buffers.
    #[must_use]
    pub fn idle_bytes(&self) -> usize {
        self.shelves.lock().unwrap_or_else(PoisonError::into_inner).bytes
    }
}

/// A scratch buffer that goes back to its [`Recycler`] when dropped.
#[derive(Debug)]
pub struct Scratch<T: 'static> {
    buf: Option<CudaSlice<T>>,
    home: Arc<Mutex<Shelves>>,
}

impl<T> Deref for Scratch<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        // Present from construction until drop.
        self.buf.as_ref().unwrap_or_else(|| unreachable!("a scratch buffer is present until dropped"))
    }
}

impl<T> DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        self.buf.as_mut().unwrap_or_else(|| unreachable!("a scratch buffer is present until dropped"))
    }
}

impl<T: 'static> Drop for Scratch<T> {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let bytes = buf.len() * std::mem::size_of::<T>();
        let mut s = self.home.lock().unwrap_or_else(PoisonError::into_inner);
        if s.bytes + bytes <= s.cap {
            s.bytes += bytes;
            s.idle.entry((TypeId::of::<CudaSlice<T>>(), buf.len())).or_default().push(Box::new(buf));
        }
    }
}
