//! Device buffers recycled across the launches of one stream: a forward asks for scratch buffers by type and length,
//! and each goes back to the shelf when dropped, for the next forward of the same shape instead of a fresh
//! allocation. Safe because a [`Gpu`] is one stream: a buffer handed back while kernels that use it are still queued
//! is given only to launches queued after them.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};

use super::gpu::{DeviceBuf, DeviceMem, Elem, Gpu};
use crate::error::Result;

#[derive(Debug, Default)]
struct Shelves {
    /// Idle allocations by size in bytes.
    idle: HashMap<usize, Vec<DeviceMem>>,
    /// Bytes of the idle allocations.
    bytes: usize,
    /// The most idle bytes kept; an allocation handed back beyond it is freed.
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

    /// A buffer of `n` elements of `T` (at least 1) on `gpu`: an idle allocation of that size if any (its contents
    /// are what its last user left), else a new zeroed one.
    ///
    /// # Errors
    /// When an allocation fails.
    pub fn take<T: Elem>(&self, gpu: &dyn Gpu, n: usize) -> Result<Scratch<T>> {
        let n = n.max(1);
        let bytes = n * std::mem::size_of::<T>();
        let reused = {
            let mut s = self.shelves.lock().unwrap_or_else(PoisonError::into_inner);
            let got = s.idle.get_mut(&bytes).and_then(Vec::pop);
            if got.is_some() {
                s.bytes -= bytes;
            }
            got
        };
        let buf = match reused {
            Some(mem) => DeviceBuf::from_mem(mem, n)?,
            None => DeviceBuf::zeros(gpu, n)?,
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
pub struct Scratch<T: Elem> {
    buf: Option<DeviceBuf<T>>,
    home: Arc<Mutex<Shelves>>,
}

impl<T: Elem> Deref for Scratch<T> {
    type Target = DeviceBuf<T>;
    fn deref(&self) -> &DeviceBuf<T> {
        // Present from construction until drop.
        self.buf.as_ref().unwrap_or_else(|| unreachable!("a scratch buffer is present until dropped"))
    }
}

impl<T: Elem> Drop for Scratch<T> {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let mem = buf.into_mem();
        let bytes = mem.bytes();
        let mut s = self.home.lock().unwrap_or_else(PoisonError::into_inner);
        if s.bytes + bytes <= s.cap {
            s.bytes += bytes;
            s.idle.entry(bytes).or_default().push(mem);
        }
    }
}
