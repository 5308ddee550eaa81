//! # tlt-cuda-sim
//!
//! Our CUDA C kernels (`tlt-kernels/cuda/*.cu`), executed on the CPU in a simulation of CUDA's execution model, so
//! that CI tests them before they meet a GPU (as Triton's interpreter and Numba's CUDA simulator do for theirs).
//!
//! The `.cu` files are compiled with the host C++ compiler against `csrc/cuda_sim.h` (thread and block indices,
//! `__shared__`, `__syncthreads`, warp shuffles and votes, atomics, intrinsics). A launch runs up to 4 of its blocks
//! at once, interleaved: each on its own OS thread of a persistent pool, with a baton so that exactly one thread
//! runs at a time; blocks start in a seeded random order and the baton passes to a seeded-random block in flight at
//! every scheduling point, so the same seed gives the same execution and a race between blocks shows under some
//! seed ([`SimDevice::with_block_seed`]; [`SimDevice::sequential`] runs blocks one after another in grid order). A
//! block's threads are fibers scheduled cooperatively: each runs until it reaches a barrier or a warp exchange, or
//! returns. So a missing barrier shows up as a stale read, and the undefined behaviour a GPU would hide (a barrier
//! some threads never reach, a shuffle from a lane that has returned, a misaligned 16-byte access) is an error of
//! the launch. The simulation also holds detector controls, deliberately faulty kernels named `ctl_*` (listed by
//! [`kernels`]), that prove each detector fires.
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

use std::ffi::CStr;

use tlt_kernels::cuda::plan::Launch;

mod device;
mod exec;
mod gpu;

pub use device::{SimBuf, SimDevice};
pub use gpu::{test_devices, Fault, Schedule, SimGpu};

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
            seed: u64,
            interleave: i32,
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
    /// The host broke the seam's ordering rule (`tlt_kernels::cuda::gpu`): it wrote or freed pinned memory that a
    /// queued copy still uses.
    #[error("host-device race: {0}")]
    HostRace(String),
    /// A call a capturing stream does not allow, or a graph replayed over buffers that are gone.
    #[error("graph: {0}")]
    Graph(String),
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

impl LaunchRecord {
    fn of(l: &Launch) -> Self {
        Self { kernel: l.kernel, grid: l.grid, block: l.block }
    }
}

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
