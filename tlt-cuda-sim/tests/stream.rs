//! The simulated device's stream (`SimGpu`, the seam `tlt_kernels::cuda::Gpu` with a stream that runs work late),
//! through the host code that runs on it on a GPU: the packed transfers (`Staged`, `Fetched`). Checks that work
//! really is asynchronous, that the transfers are correct under every schedule, and that each rule of the seam's
//! ordering is enforced: a read of pinned memory before its copy was waited for sees poison and is recorded, a
//! write into a staging buffer a queued copy still reads is an error, freeing pinned memory under a queued copy is
//! recorded, and a capture refuses host transfers and waits.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::sync::Arc;

use tlt_cuda_sim::{Fault, Schedule, SimGpu};
use tlt_kernels::cuda::plan;
use tlt_kernels::cuda::{gpu, DeviceBuf, Fetched, SharedGpu, Staged};

/// A staging fill of `byte`.
fn fill(byte: u8) -> impl FnOnce(&mut [u8]) -> tlt_kernels::Result<()> {
    move |h| {
        h.fill(byte);
        Ok(())
    }
}

fn dev(schedule: Schedule) -> (SimGpu, SharedGpu) {
    let sim = SimGpu::new(schedule);
    (sim.clone(), Arc::new(sim))
}

/// One round of what a step does: send inputs, run a kernel on them, fetch results.
fn round(g: &SharedGpu, staged: &mut Staged, fetched: &mut Fetched, x: &[f32]) -> tlt_kernels::Result<Vec<f32>> {
    let n = x.len();
    let input = staged.send(n * 4, |host| {
        host.copy_from_slice(gpu::bytes_of(x));
        Ok(())
    })?;
    let inp = plan::Buf::<f32>::new(input.addr(), n);
    // y = x + 1 (bf16 ones added to the f32 input, as the residual add does), into the fetched buffer.
    let ones = DeviceBuf::from_host(g.as_ref(), &vec![half::bf16::ONE; n])?;
    let out = plan::Buf::<f32>::new(fetched.buf().addr(), n);
    gpu::copy(g.as_ref(), inp, out)?;
    g.launch(&plan::add_to_residual(out, ones.buf())?)?;
    let bytes = fetched.fetch(n * 4)?;
    Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

#[test]
fn transfers_are_correct_under_every_schedule_and_the_stream_is_asynchronous() {
    for schedule in SimGpu::schedules() {
        let (sim, g) = dev(schedule);
        let (mut staged, mut fetched) = (Staged::new(&g, 64).unwrap(), Fetched::new(&g, 64).unwrap());
        for r in 0..8 {
            let x: Vec<f32> = (0..16).map(|i| (i + 100 * r) as f32).collect();
            let y = round(&g, &mut staged, &mut fetched, &x).unwrap();
            assert_eq!(y, x.iter().map(|v| v + 1.0).collect::<Vec<_>>(), "{schedule:?} round {r}");
        }
        // A larger packing grows the buffers (after waiting for the copy from the old staging buffer).
        let x: Vec<f32> = (0..100).map(|i| i as f32).collect();
        assert_eq!(round(&g, &mut staged, &mut Fetched::new(&g, 400).unwrap(), &x).unwrap()[99], 100.0);
        assert!(sim.races().is_empty(), "{schedule:?}: {:?}", sim.races());
        let later = sim.ran_later();
        println!("{schedule:?}: {later} operations ran after the call that queued them returned");
        if schedule == Schedule::Lazy {
            assert!(later > 20, "the lazy stream ran its work at once: {later}");
        }
        if schedule == Schedule::Eager {
            assert_eq!(later, 0);
        }
    }
}

#[test]
fn a_read_before_the_wait_sees_poison_and_is_recorded() {
    for schedule in [Schedule::Lazy, Schedule::Eager, Schedule::Seeded(5)] {
        let (sim, g) = dev(schedule);
        let sim = sim.with_fault(Fault::NoSynchronize);
        let (mut staged, mut fetched) = (Staged::new(&g, 64).unwrap(), Fetched::new(&g, 64).unwrap());
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let y = round(&g, &mut staged, &mut fetched, &x).unwrap();
        println!("{schedule:?}: the fetch without its wait read {y:?}; recorded: {:?}", sim.races());
        assert!(y.iter().all(|v| v.is_nan()), "{schedule:?}: {y:?} (0xFF bytes are NaN)");
        assert_eq!(sim.races().len(), 1);
    }
}

#[test]
fn a_staging_buffer_rewritten_under_a_queued_copy_is_an_error() {
    let (sim, g) = dev(Schedule::Lazy);
    let _ = sim.clone().with_fault(Fault::NoEventWaits);
    let mut staged = Staged::new(&g, 64).unwrap();
    staged.send(16, fill(1)).unwrap();
    let e = staged.send(16, fill(2)).unwrap_err();
    println!("a staging buffer rewritten before its copy ran: {e}");
    assert!(e.to_string().contains("still uses"), "{e}");
    // Without the fault the second send waits for the first copy, and both land in order.
    let (_, g) = dev(Schedule::Lazy);
    let mut staged = Staged::new(&g, 64).unwrap();
    let first = staged.send(16, fill(1)).unwrap();
    let a = DeviceBuf::<u8>::zeros(g.as_ref(), 16).unwrap();
    gpu::copy(g.as_ref(), plan::Buf::<u8>::new(first.addr(), 16), a.buf()).unwrap();
    staged.send(16, fill(2)).unwrap();
    assert_eq!(a.to_host(g.as_ref()).unwrap(), vec![1u8; 16], "the first copy read the second fill");
}

#[test]
fn pinned_memory_freed_under_a_queued_copy_is_recorded() {
    let (sim, g) = dev(Schedule::Lazy);
    let dst = DeviceBuf::<u8>::zeros(g.as_ref(), 8).unwrap();
    let mut pinned = g.alloc_pinned(8, true).unwrap();
    g.pinned_write(&mut pinned).unwrap().fill(7);
    g.upload_pinned(&pinned, dst.buf().addr(), 8).unwrap();
    drop(pinned);
    println!("freed under a queued copy: {:?}", sim.races());
    assert_eq!(sim.races().len(), 1, "the free went unrecorded");
}

#[test]
fn a_capture_refuses_host_transfers_and_waits() {
    let (_, g) = dev(Schedule::Lazy);
    let a = DeviceBuf::<f32>::from_host(g.as_ref(), &[1.0, 2.0]).unwrap();
    let b = DeviceBuf::<f32>::zeros(g.as_ref(), 2).unwrap();
    g.begin_capture().unwrap();
    gpu::copy(g.as_ref(), a.buf(), b.buf()).unwrap();
    assert!(g.synchronize().is_err(), "a wait during a capture");
    let e = g.end_capture().unwrap_err();
    assert!(e.to_string().contains("invalidated"), "{e}");
    // A clean capture records, runs nothing until replayed, and replays in stream order.
    g.begin_capture().unwrap();
    gpu::copy(g.as_ref(), a.buf(), b.buf()).unwrap();
    let graph = g.end_capture().unwrap().unwrap();
    assert_eq!(b.to_host(g.as_ref()).unwrap(), [0.0, 0.0], "a capture ran its work");
    g.replay(&graph).unwrap();
    assert_eq!(b.to_host(g.as_ref()).unwrap(), [1.0, 2.0]);
    g.begin_capture().unwrap();
    assert!(g.end_capture().unwrap().is_none(), "an empty capture is no graph");
}
