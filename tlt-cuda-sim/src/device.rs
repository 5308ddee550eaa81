//! [`SimDevice`]: the simulated device that runs each launch at once, for kernel tests; and its buffers.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::rc::Rc;

use tlt_kernels::cuda::plan::{Buf, GemmEx, Launch};

use crate::exec::{self, Allocs, RunOptions, ALIGN};
use crate::{Error, LaunchRecord, Result};

#[derive(Debug, Default)]
struct Inner {
    allocs: RefCell<Allocs>,
    /// Launches so far.
    log: RefCell<Vec<LaunchRecord>>,
    switches: Cell<u64>,
}

/// The simulated device: allocations and launches, each launch run to completion when it is made (for kernel tests;
/// [`crate::SimGpu`] is the device with a stream). Not `Send`: a device and its buffers live on one thread.
#[derive(Debug, Clone, Default)]
pub struct SimDevice {
    inner: Rc<Inner>,
    opts: RunOptions,
}

impl SimDevice {
    /// A device that interleaves blocks under a fixed seed and runs each block's ready threads in increasing index
    /// order.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The same device (buffers shared) running ready threads in decreasing index order: a second interleaving,
    /// under which a kernel that relies on an order no barrier enforces gives other results.
    #[must_use]
    pub fn reversed(&self) -> Self {
        Self { opts: RunOptions { reverse: true, ..self.opts }, ..self.clone() }
    }

    /// The same device with `__syncthreads` turned into a no-op: a deliberately broken execution, for negative
    /// controls (a kernel whose threads share data through shared memory must then give wrong results).
    #[must_use]
    pub fn without_barriers(&self) -> Self {
        Self { opts: RunOptions { drop_barriers: true, ..self.opts }, ..self.clone() }
    }

    /// The same device (buffers shared) with its blocks interleaved under `seed`: up to 4 blocks in flight, started
    /// in an order and switched at scheduling points as `seed` draws. The same seed gives the same execution; a
    /// kernel whose blocks communicate without synchronisation gives other results under some seeds. Devices
    /// interleave under a fixed seed by default.
    #[must_use]
    pub fn with_block_seed(&self, seed: u64) -> Self {
        Self { opts: RunOptions { interleave: true, seed, ..self.opts }, ..self.clone() }
    }

    /// The same device (buffers shared) running each launch's blocks one after another in grid order (block
    /// (0,0,0) first), on the launching thread: the schedule under which a race between blocks stays hidden.
    #[must_use]
    pub fn sequential(&self) -> Self {
        Self { opts: RunOptions { interleave: false, ..self.opts }, ..self.clone() }
    }

    /// A zeroed buffer of `n` elements.
    ///
    /// # Panics
    /// When the host is out of memory (a test device).
    #[must_use]
    pub fn zeros<T: Copy>(&self, n: usize) -> SimBuf<T> {
        let align = ALIGN.max(std::mem::align_of::<T>());
        let bytes = n * std::mem::size_of::<T>();
        let p = exec::alloc_raw(bytes, align);
        self.inner.allocs.borrow_mut().insert(p as u64, bytes);
        SimBuf { ptr: p.cast(), len: n, dev: self.inner.clone(), _t: PhantomData }
    }

    /// A buffer holding `data`.
    #[must_use]
    pub fn upload<T: Copy>(&self, data: &[T]) -> SimBuf<T> {
        let b = self.zeros(data.len());
        b.write(data);
        b
    }

    /// Runs `launch` (a plan of `tlt_kernels::cuda::plan`) to completion.
    ///
    /// # Errors
    /// [`Error::UnknownKernel`], [`Error::Signature`] (argument count or kinds differ from the kernel's C++
    /// signature), [`Error::BadPointer`] (a non-null pointer outside every live buffer), [`Error::Unsupported`]
    /// (dynamic shared memory), [`Error::Launch`] (an invalid configuration, a deadlock, undefined warp use).
    pub fn launch(&self, launch: &Launch) -> Result<()> {
        let ran = exec::launch(&self.inner.allocs.borrow(), launch, self.opts);
        if let Ok(switches) = ran {
            self.inner.switches.set(self.inner.switches.get() + switches);
        }
        self.inner.log.borrow_mut().push(LaunchRecord::of(launch));
        ran.map(|_| ())
    }

    /// Runs one planned `cublasGemmEx` ([`tlt_kernels::cuda::plan::gemm`]) with cuBLAS's column-major semantics on
    /// the host: `C = op(A) · op(B)`, bf16 inputs, f32 accumulation in `k` order, a bf16 (rounded) or f32 `C`. The
    /// stand-in for cuBLAS in tests of whole device steps: it reads the operands exactly where cuBLAS would, so a
    /// wrong transpose or leading dimension gives wrong results here too.
    ///
    /// # Errors
    /// [`Error::Signature`] for non-positive sizes or leading dimensions too small, [`Error::BadPointer`] when an
    /// operand's extent is not inside one live buffer.
    pub fn gemm(&self, g: &GemmEx) -> Result<()> {
        exec::gemm(&self.inner.allocs.borrow(), g)
    }

    /// Copies `src` to `dst` (a device-to-device copy).
    ///
    /// # Errors
    /// [`Error::Signature`] for lengths that differ, [`Error::BadPointer`] for a buffer outside the live ones.
    pub fn copy<T: Copy>(&self, src: Buf<T>, dst: Buf<T>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::Signature {
                kernel: "memcpy".into(),
                detail: format!("{} elements into {}", src.len(), dst.len()),
            });
        }
        exec::copy(&self.inner.allocs.borrow(), src.addr(), dst.addr(), src.len() * std::mem::size_of::<T>())
    }

    /// The launches run so far.
    #[must_use]
    pub fn launches(&self) -> Vec<LaunchRecord> {
        self.inner.log.borrow().clone()
    }

    /// Fiber switches so far (the simulation's cost).
    #[must_use]
    pub fn switches(&self) -> u64 {
        self.inner.switches.get()
    }
}

/// A buffer of the simulated device: `len` elements of `T` in host memory followed by an inaccessible page.
pub struct SimBuf<T> {
    ptr: *mut T,
    len: usize,
    dev: Rc<Inner>,
    _t: PhantomData<T>,
}

impl<T> std::fmt::Debug for SimBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimBuf<{}>({:p}, {})", std::any::type_name::<T>(), self.ptr, self.len)
    }
}

impl<T: Copy> SimBuf<T> {
    /// The buffer as a kernel argument.
    #[must_use]
    pub fn buf(&self) -> Buf<T> {
        Buf::new(self.ptr as u64, self.len)
    }

    /// Its length in elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy of its contents.
    #[must_use]
    pub fn download(&self) -> Vec<T> {
        // SAFETY: the allocation holds `len` initialised (zeroed or written) elements of `T`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }

    /// Overwrites its contents with `data`.
    ///
    /// # Panics
    /// When `data` has another length.
    pub fn write(&self, data: &[T]) {
        assert_eq!(data.len(), self.len, "a write of {} elements into a buffer of {}", data.len(), self.len);
        // SAFETY: the allocation holds `len` elements; `data` does not overlap it (a fresh mapping).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, self.len) };
    }
}

impl<T> Drop for SimBuf<T> {
    fn drop(&mut self) {
        self.dev.allocs.borrow_mut().remove(self.ptr as u64);
        // SAFETY: the allocation came from `alloc_raw` with these sizes and is freed once.
        unsafe {
            exec::free_raw(self.ptr.cast(), self.len * std::mem::size_of::<T>(), ALIGN.max(std::mem::align_of::<T>()));
        }
    }
}
