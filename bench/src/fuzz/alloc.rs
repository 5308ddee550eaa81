//! A global allocator that refuses any single allocation above a cap while a fuzz worker runs, so a loader that
//! sizes a buffer from an untrusted count is caught (the process aborts with Rust's "memory allocation of N bytes
//! failed", which the parent records) instead of exhausting the machine. The cap is off (0) outside fuzzing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator with an optional cap on the size of one allocation.
pub struct Capped;

/// Bytes one allocation may take; 0: no cap.
static CAP: AtomicUsize = AtomicUsize::new(0);

/// Sets the cap (0 removes it).
pub fn set_cap(bytes: usize) {
    CAP.store(bytes, Ordering::Relaxed);
}

fn allowed(size: usize) -> bool {
    let cap = CAP.load(Ordering::Relaxed);
    cap == 0 || size <= cap
}

// SAFETY: every call forwards to `System` with the caller's layout; refusing returns null, which `GlobalAlloc`
// allows.
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !allowed(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !allowed(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !allowed(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
