//! # tlt-cuda-sim
//!
//! Our CUDA C kernels (`tlt-kernels/cuda/*.cu`), executed on the CPU in a simulation of CUDA's execution model, so
//! that CI tests them before they meet a GPU (as Triton's interpreter and Numba's CUDA simulator do for theirs).
//!
//! The `.cu` files are compiled with the host C++ compiler against `csrc/cuda_sim.h` (thread and block indices,
//! `__shared__`, `__syncthreads`, warp shuffles and votes, atomics, intrinsics). A launch runs its blocks one after
//! another; a block's threads are fibers scheduled cooperatively: each runs until it reaches a barrier or a warp
//! exchange, or returns. So a missing barrier shows up as a stale read, and the undefined behaviour a GPU would
//! hide (a barrier some threads never reach, a shuffle from a lane that has returned) is an error of the launch.
//! Buffers ([`SimBuf`]) are host memory whose last byte is followed by an inaccessible page: a kernel that runs
//! past a buffer's end faults.
//!
//! Launches are [`tlt_kernels::cuda::plan::Launch`]es: exactly what the host code computes for a GPU (the same
//! launch configuration, the same arguments), checked here against the kernel's C++ signature (count and kind of
//! every argument) and against the live allocations (every pointer).
//!
//! ```
//! use tlt_cuda_sim::SimDevice;
//! use tlt_kernels::cuda::plan;
//!
//! let dev = SimDevice::new();
//! let x = dev.upload(&[1.0f32, -2.0, 3.0]);
//! let y = dev.upload(&[half::bf16::from_f32(0.5); 3]);
//! dev.launch(&plan::add_to_residual(x.buf(), y.buf())?)?;
//! assert_eq!(x.download(), [1.5, -1.5, 3.5]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr};
use std::marker::PhantomData;
use std::rc::Rc;

use tlt_kernels::cuda::plan::{Arg, Buf, GemmEx, Launch};

mod ffi {
    use std::ffi::{c_char, c_void};

    /// One entry of the generated kernel table (`build.rs`).
    #[repr(C)]
    pub struct RawKernel {
        pub name: *const c_char,
        pub call: unsafe extern "C" fn(*mut *mut c_void),
        pub kinds: *const c_char,
    }

    extern "C" {
        pub static tlt_sim_kernels: [RawKernel; 0];
        pub static tlt_sim_kernel_count: usize;
        #[allow(clippy::too_many_arguments)]
        pub fn tlt_sim_run(
            call: unsafe extern "C" fn(*mut *mut c_void),
            params: *mut *mut c_void,
            grid: *const u32,
            block: *const u32,
            reverse: i32,
            drop_barriers: i32,
            switches: *mut u64,
            err: *mut c_char,
            err_len: usize,
        ) -> i32;
        pub fn tlt_sim_alloc(bytes: usize, align: usize) -> *mut c_void;
        pub fn tlt_sim_free(p: *mut c_void, bytes: usize, align: usize);
    }
}

/// Errors of the simulated device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No kernel of that name was compiled.
    #[error("no kernel `{0}` in the simulated device")]
    UnknownKernel(String),
    /// The launch's arguments do not match the kernel's C++ signature.
    #[error("launch of `{kernel}`: {detail}")]
    Signature {
        /// The kernel.
        kernel: String,
        /// What does not match.
        detail: String,
    },
    /// A pointer argument is not inside a live allocation of this device.
    #[error("launch of `{kernel}`: argument {arg} ({addr:#x}) points into no live buffer")]
    BadPointer {
        /// The kernel.
        kernel: String,
        /// The argument's position.
        arg: usize,
        /// The address.
        addr: u64,
    },
    /// The kernel misbehaved: a deadlock at a barrier or warp exchange, a shuffle from a returned lane, or an
    /// invalid launch configuration.
    #[error("launch of `{kernel}` failed: {message}")]
    Launch {
        /// The kernel.
        kernel: String,
        /// What happened.
        message: String,
    },
    /// Something the simulation does not model (dynamic shared memory).
    #[error("not simulated: {0}")]
    Unsupported(String),
}

/// Result of the simulated device.
pub type Result<T> = std::result::Result<T, Error>;

/// One kernel the simulated device can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelInfo {
    /// Its `extern "C"` name.
    pub name: &'static str,
    /// The kinds of its parameters, in order: `p` pointer, `i` int, `f` float, `u` unsigned long long.
    pub kinds: &'static str,
}

/// Every kernel compiled into the simulated device, in source order.
#[must_use]
pub fn kernels() -> Vec<KernelInfo> {
    // SAFETY: the table is a static array of `tlt_sim_kernel_count` entries (build.rs), initialised before main;
    // its strings are static NUL-terminated literals.
    unsafe {
        let table = std::slice::from_raw_parts(ffi::tlt_sim_kernels.as_ptr(), ffi::tlt_sim_kernel_count);
        table
            .iter()
            .map(|k| KernelInfo {
                name: CStr::from_ptr(k.name).to_str().unwrap_or("?"),
                kinds: CStr::from_ptr(k.kinds).to_str().unwrap_or("?"),
            })
            .collect()
    }
}

fn raw_kernel(name: &str) -> Option<&'static ffi::RawKernel> {
    // SAFETY: as in `kernels`.
    unsafe {
        let table = std::slice::from_raw_parts(ffi::tlt_sim_kernels.as_ptr(), ffi::tlt_sim_kernel_count);
        table.iter().find(|k| CStr::from_ptr(k.name).to_bytes() == name.as_bytes())
    }
}

/// A launch as the device recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchRecord {
    /// The kernel.
    pub kernel: &'static str,
    /// Blocks.
    pub grid: [u32; 3],
    /// Threads per block.
    pub block: [u32; 3],
}

#[derive(Debug, Default)]
struct Inner {
    /// Live allocations: start address -> end address (exclusive).
    allocs: RefCell<BTreeMap<u64, u64>>,
    /// Launches so far: kernel, grid, block.
    log: RefCell<Vec<LaunchRecord>>,
    switches: Cell<u64>,
}

/// The simulated device: allocations and launches. Not `Send`: a device and its buffers live on one thread.
#[derive(Debug, Clone, Default)]
pub struct SimDevice {
    inner: Rc<Inner>,
    reverse: bool,
    drop_barriers: bool,
}

impl SimDevice {
    /// A device that runs each block's ready threads in increasing index order.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The same device (buffers shared) running ready threads in decreasing index order: a second interleaving,
    /// under which a kernel that relies on an order no barrier enforces gives other results.
    #[must_use]
    pub fn reversed(&self) -> Self {
        Self { reverse: true, ..self.clone() }
    }

    /// The same device with `__syncthreads` turned into a no-op: a deliberately broken execution, for negative
    /// controls (a kernel whose threads share data through shared memory must then give wrong results).
    #[must_use]
    pub fn without_barriers(&self) -> Self {
        Self { drop_barriers: true, ..self.clone() }
    }

    /// A zeroed buffer of `n` elements.
    ///
    /// # Panics
    /// When the host is out of memory (a test device).
    #[must_use]
    pub fn zeros<T: Copy>(&self, n: usize) -> SimBuf<T> {
        let align = ALIGN.max(std::mem::align_of::<T>());
        let bytes = n * std::mem::size_of::<T>();
        // SAFETY: plain allocation; the result is checked for null below.
        let p = unsafe { ffi::tlt_sim_alloc(bytes, align) };
        assert!(!p.is_null(), "the simulated device could not allocate {bytes} bytes");
        let addr = p as u64;
        self.inner.allocs.borrow_mut().insert(addr, addr + bytes as u64);
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
        let kernel = launch.kernel.to_string();
        let k = raw_kernel(launch.kernel).ok_or_else(|| Error::UnknownKernel(kernel.clone()))?;
        // SAFETY: a static NUL-terminated string of the table.
        let kinds = unsafe { CStr::from_ptr(k.kinds) }.to_bytes();
        if kinds.len() != launch.args.len() {
            return Err(Error::Signature {
                kernel,
                detail: format!("{} arguments for {} parameters", launch.args.len(), kinds.len()),
            });
        }
        if launch.shared_bytes > 0 {
            return Err(Error::Unsupported(format!("{} bytes of dynamic shared memory", launch.shared_bytes)));
        }
        let allocs = self.inner.allocs.borrow();
        let mut cells = Vec::with_capacity(kinds.len());
        for (i, (a, &kind)) in launch.args.iter().zip(kinds).enumerate() {
            let (want, bits) = match *a {
                Arg::Ptr(p) => (b'p', p),
                Arg::I32(x) => (b'i', u64::from(x as u32)),
                Arg::F32(x) => (b'f', u64::from(x.to_bits())),
                Arg::U64(x) => (b'u', x),
            };
            if want != kind {
                return Err(Error::Signature {
                    kernel,
                    detail: format!("argument {i} is {a:?}, the parameter is `{}`", kind as char),
                });
            }
            if let Arg::Ptr(p) = *a {
                let inside = p == 0 || allocs.range(..=p).next_back().is_some_and(|(&s, &e)| p >= s && p <= e);
                if !inside {
                    return Err(Error::BadPointer { kernel, arg: i, addr: p });
                }
            }
            cells.push(bits);
        }
        drop(allocs);
        let mut params: Vec<*mut c_void> = cells.iter_mut().map(|c| (c as *mut u64).cast()).collect();
        let mut err = vec![0u8; 1024];
        let mut switches = 0u64;
        // SAFETY: `call` is the trampoline of this kernel; `params` holds one 8-byte cell per parameter, of the
        // parameter's kind (checked above; ints and floats in the low bytes, little endian), and every non-null
        // pointer lies in a live allocation whose length the plan checked against the kernel's indexing.
        let rc = unsafe {
            ffi::tlt_sim_run(
                k.call,
                params.as_mut_ptr(),
                launch.grid.as_ptr(),
                launch.block.as_ptr(),
                i32::from(self.reverse),
                i32::from(self.drop_barriers),
                &mut switches,
                err.as_mut_ptr().cast::<c_char>(),
                err.len(),
            )
        };
        self.inner.switches.set(self.inner.switches.get() + switches);
        self.inner.log.borrow_mut().push(LaunchRecord {
            kernel: launch.kernel,
            grid: launch.grid,
            block: launch.block,
        });
        if rc != 0 {
            let message =
                CStr::from_bytes_until_nul(&err).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            return Err(Error::Launch { kernel, message });
        }
        Ok(())
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
        let kernel = "cublasGemmEx".to_string();
        let bad = |detail: String| Error::Signature { kernel: kernel.clone(), detail };
        let (m, n, k) = (g.m, g.n, g.k);
        if m <= 0 || n <= 0 || k <= 0 {
            return Err(bad(format!("sizes m {m}, n {n}, k {k}")));
        }
        let (m, n, k) = (m as usize, n as usize, k as usize);
        // Stored (rows, cols) of each operand, column-major.
        let (ra, ca) = if g.trans_a { (k, m) } else { (m, k) };
        let (rb, cb) = if g.trans_b { (n, k) } else { (k, n) };
        let operands = [
            ("A", g.a, g.lda, ra, ca, 2usize),
            ("B", g.b, g.ldb, rb, cb, 2),
            ("C", g.c, g.ldc, m, n, if g.c_f32 { 4 } else { 2 }),
        ];
        let allocs = self.inner.allocs.borrow();
        for (i, &(what, addr, ld, rows, cols, size)) in operands.iter().enumerate() {
            if ld < 0 || (ld as usize) < rows {
                return Err(bad(format!("{what}: leading dimension {ld} below its {rows} rows")));
            }
            let end = addr + (((cols - 1) * ld as usize + rows) * size) as u64;
            let inside = allocs.range(..=addr).next_back().is_some_and(|(&s, &e)| addr >= s && end <= e);
            if !inside {
                return Err(Error::BadPointer { kernel: kernel.clone(), arg: i, addr });
            }
        }
        drop(allocs);
        let elems = |rows: usize, cols: usize, ld: i32| (cols - 1) * ld as usize + rows;
        // SAFETY: each operand's whole column-major extent was checked to lie inside one live allocation; A and B
        // are read only, C written only, and a test device runs nothing else meanwhile.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(g.a as *const half::bf16, elems(ra, ca, g.lda)),
                std::slice::from_raw_parts(g.b as *const half::bf16, elems(rb, cb, g.ldb)),
            )
        };
        let at = |i: usize, l: usize| if g.trans_a { a[l + i * g.lda as usize] } else { a[i + l * g.lda as usize] };
        let bt = |l: usize, j: usize| if g.trans_b { b[j + l * g.ldb as usize] } else { b[l + j * g.ldb as usize] };
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0f32;
                for l in 0..k {
                    acc += at(i, l).to_f32() * bt(l, j).to_f32();
                }
                let at_c = i + j * g.ldc as usize;
                // SAFETY: inside C's checked extent.
                unsafe {
                    if g.c_f32 {
                        *(g.c as *mut f32).add(at_c) = acc;
                    } else {
                        *(g.c as *mut half::bf16).add(at_c) = half::bf16::from_f32(acc);
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies `src` to `dst` (a device-to-device copy).
    ///
    /// # Errors
    /// [`Error::Signature`] for lengths that differ, [`Error::BadPointer`] for a buffer outside the live ones.
    pub fn copy<T: Copy>(&self, src: Buf<T>, dst: Buf<T>) -> Result<()> {
        let kernel = "memcpy".to_string();
        if src.len() != dst.len() {
            return Err(Error::Signature { kernel, detail: format!("{} elements into {}", src.len(), dst.len()) });
        }
        let bytes = (src.len() * std::mem::size_of::<T>()) as u64;
        let allocs = self.inner.allocs.borrow();
        for (i, addr) in [src.addr(), dst.addr()].into_iter().enumerate() {
            let inside = allocs.range(..=addr).next_back().is_some_and(|(&s, &e)| addr >= s && addr + bytes <= e);
            if !inside {
                return Err(Error::BadPointer { kernel: kernel.clone(), arg: i, addr });
            }
        }
        // SAFETY: both ranges lie inside live allocations (checked); `copy` allows overlap.
        unsafe { std::ptr::copy(src.addr() as *const T, dst.addr() as *mut T, src.len()) };
        Ok(())
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

/// Buffers start 16-byte aligned (what a 16-byte vector access needs; `cudaMalloc` gives 256), and end at most 15
/// bytes before their guard page.
const ALIGN: usize = 16;

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
        self.dev.allocs.borrow_mut().remove(&(self.ptr as u64));
        // SAFETY: the allocation came from `tlt_sim_alloc` with these sizes and is freed once.
        unsafe {
            ffi::tlt_sim_free(
                self.ptr.cast(),
                self.len * std::mem::size_of::<T>(),
                ALIGN.max(std::mem::align_of::<T>()),
            );
        }
    }
}
