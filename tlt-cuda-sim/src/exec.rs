//! What a simulated device executes, over a table of live allocations: a kernel launch (checked against the
//! kernel's C++ signature and every pointer against the allocations, then run on fibers by `runtime.cc`), a
//! cuBLAS-style GEMM on the host, and a device copy. Shared by [`crate::SimDevice`] (runs at once) and
//! [`crate::SimGpu`] (runs when its stream gets there).

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr};

use tlt_kernels::cuda::plan::{Arg, GemmEx, Launch};

use crate::{ffi, raw_kernel, Error, Result};

/// Buffers start 16-byte aligned (what a 16-byte vector access needs; `cudaMalloc` gives 256), and end at most 15
/// bytes before their guard page.
pub(crate) const ALIGN: usize = 16;

/// Live allocations: start address -> (end address, exclusive; allocation id). Ids are never reused, so a graph
/// can tell a buffer that was freed and another allocated at the same address.
#[derive(Debug, Default)]
pub(crate) struct Allocs {
    map: BTreeMap<u64, (u64, u64)>,
    next_id: u64,
}

impl Allocs {
    /// Registers `bytes` at `addr`; its id.
    pub(crate) fn insert(&mut self, addr: u64, bytes: usize) -> u64 {
        self.next_id += 1;
        self.map.insert(addr, (addr + bytes as u64, self.next_id));
        self.next_id
    }

    /// Bytes of every live allocation together.
    pub(crate) fn bytes(&self) -> u64 {
        self.map.iter().map(|(&s, &(e, _))| e - s).sum()
    }

    /// Forgets the allocation at `addr`.
    pub(crate) fn remove(&mut self, addr: u64) {
        self.map.remove(&addr);
    }

    /// The allocation holding `[addr, addr + bytes)` (a pointer one past the end is inside, for empty ranges):
    /// `(start, id)`.
    pub(crate) fn find(&self, addr: u64, bytes: u64) -> Option<(u64, u64)> {
        self.map
            .range(..=addr)
            .next_back()
            .filter(|(&s, &(e, _))| addr >= s && addr + bytes <= e)
            .map(|(&s, &(_, id))| (s, id))
    }

    /// The id of the live allocation starting at `addr`.
    pub(crate) fn id_at(&self, addr: u64) -> Option<u64> {
        self.map.get(&addr).map(|&(_, id)| id)
    }
}

/// `bytes` of zeroed host memory aligned to `align` followed by an inaccessible guard page.
///
/// # Panics
/// When the host is out of memory (a test device).
pub(crate) fn alloc_raw(bytes: usize, align: usize) -> *mut u8 {
    // SAFETY: plain allocation; the result is checked for null below.
    let p = unsafe { ffi::tlt_sim_alloc(bytes, align) };
    assert!(!p.is_null(), "the simulated device could not allocate {bytes} bytes");
    p.cast()
}

/// Frees what [`alloc_raw`] returned.
///
/// # Safety
/// `p` came from `alloc_raw(bytes, align)` and is freed once.
pub(crate) unsafe fn free_raw(p: *mut u8, bytes: usize, align: usize) {
    // SAFETY: the caller's contract.
    unsafe { ffi::tlt_sim_free(p.cast(), bytes, align) }
}

/// The seed of the default block schedule.
pub(crate) const DEFAULT_SEED: u64 = 0x7417_5eed;

/// How a launch's blocks and threads are scheduled. The default interleaves blocks under [`DEFAULT_SEED`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RunOptions {
    /// Run each block's ready threads in decreasing index order.
    pub(crate) reverse: bool,
    /// Make `__syncthreads` a no-op (negative controls).
    pub(crate) drop_barriers: bool,
    /// Run up to 4 blocks at once, interleaved at scheduling points as `seed` draws; false: one block after another
    /// in grid order.
    pub(crate) interleave: bool,
    /// The seed of the block order and of the switches between blocks (the same seed, the same execution).
    pub(crate) seed: u64,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self { reverse: false, drop_barriers: false, interleave: true, seed: DEFAULT_SEED }
    }
}

/// The pointer arguments of `launch` (for graph bookkeeping).
pub(crate) fn pointers(launch: &Launch) -> impl Iterator<Item = u64> + '_ {
    launch.args.iter().filter_map(|a| match *a {
        Arg::Ptr(p) if p != 0 => Some(p),
        _ => None,
    })
}

/// Runs `launch` to completion; the fiber switches it took.
///
/// # Errors
/// [`Error::UnknownKernel`], [`Error::Signature`], [`Error::BadPointer`], [`Error::Unsupported`], [`Error::Launch`].
pub(crate) fn launch(allocs: &Allocs, launch: &Launch, opts: RunOptions) -> Result<u64> {
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
            if p != 0 && allocs.find(p, 0).is_none() {
                return Err(Error::BadPointer { kernel, arg: i, addr: p });
            }
        }
        cells.push(bits);
    }
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
            i32::from(opts.reverse),
            i32::from(opts.drop_barriers),
            opts.seed,
            i32::from(opts.interleave),
            &mut switches,
            err.as_mut_ptr().cast::<c_char>(),
            err.len(),
        )
    };
    if rc != 0 {
        let message = CStr::from_bytes_until_nul(&err).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
        return Err(Error::Launch { kernel, message });
    }
    Ok(switches)
}

/// Runs one planned `cublasGemmEx` with cuBLAS's column-major semantics on the host (see [`crate::SimDevice::gemm`]).
///
/// # Errors
/// [`Error::Signature`] for non-positive sizes or leading dimensions too small, [`Error::BadPointer`] when an
/// operand's extent is not inside one live buffer.
pub(crate) fn gemm(allocs: &Allocs, g: &GemmEx) -> Result<()> {
    let kernel = "cublasGemmEx".to_string();
    let bad = |detail: String| Error::Signature { kernel: kernel.clone(), detail };
    let (m, n, k) = (g.m, g.n, g.k);
    if m <= 0 || n <= 0 || k <= 0 {
        return Err(bad(format!("sizes m {m}, n {n}, k {k}")));
    }
    if g.accumulate && !g.c_f32 {
        return Err(bad("accumulate into a bf16 C".into()));
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
    for (i, &(what, addr, ld, rows, cols, size)) in operands.iter().enumerate() {
        if ld < 0 || (ld as usize) < rows {
            return Err(bad(format!("{what}: leading dimension {ld} below its {rows} rows")));
        }
        let bytes = (((cols - 1) * ld as usize + rows) * size) as u64;
        if allocs.find(addr, bytes).is_none() {
            return Err(Error::BadPointer { kernel: kernel.clone(), arg: i, addr });
        }
    }
    let elems = |rows: usize, cols: usize, ld: i32| (cols - 1) * ld as usize + rows;
    // SAFETY: each operand's whole column-major extent was checked to lie inside one live allocation; A and B
    // are read only, C written only, and nothing else runs on the device meanwhile.
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
                if g.c_f32 && g.accumulate {
                    *(g.c as *mut f32).add(at_c) += acc;
                } else if g.c_f32 {
                    *(g.c as *mut f32).add(at_c) = acc;
                } else {
                    *(g.c as *mut half::bf16).add(at_c) = half::bf16::from_f32(acc);
                }
            }
        }
    }
    Ok(())
}

/// Copies `bytes` bytes from `src` to `dst` (a device-to-device copy; the ranges may overlap).
///
/// # Errors
/// [`Error::BadPointer`] for a range outside the live buffers.
pub(crate) fn copy(allocs: &Allocs, src: u64, dst: u64, bytes: usize) -> Result<()> {
    for (i, addr) in [src, dst].into_iter().enumerate() {
        if allocs.find(addr, bytes as u64).is_none() {
            return Err(Error::BadPointer { kernel: "memcpy".into(), arg: i, addr });
        }
    }
    // SAFETY: both ranges lie inside live allocations (checked); `copy` allows overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
    Ok(())
}

/// Zeroes `bytes` bytes at `dst`.
///
/// # Errors
/// [`Error::BadPointer`] for a range outside the live buffers.
pub(crate) fn memset_zero(allocs: &Allocs, dst: u64, bytes: usize) -> Result<()> {
    if allocs.find(dst, bytes as u64).is_none() {
        return Err(Error::BadPointer { kernel: "memset".into(), arg: 0, addr: dst });
    }
    // SAFETY: the range lies inside a live allocation (checked).
    unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
    Ok(())
}
