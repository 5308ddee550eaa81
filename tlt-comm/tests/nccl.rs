//! NCCL on device buffers (feature `nccl`). Without a CUDA driver or NCCL (this CI), joining a communicator is an
//! [`Error::Unavailable`], not a panic. Where both load (the GPU bundle's `all` call), a one-rank communicator
//! over [`SelfComm`] (NCCL allows one rank per GPU) all-reduces and broadcasts on the device's stream, right after a
//! kernel that wrote the buffer on that stream (the ordering the first version, on the legacy default stream, did
//! not have): the sums are the identity, and a drafter-sized buffer (8 M floats, 32 MB) comes back bit for bit.
//! `TLT_REQUIRE_GPU=1` (set by the bundle) turns a missing driver or NCCL into a failure.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::time::Instant;

use tlt_comm::nccl::{available, NcclComm};
use tlt_comm::{Error, SelfComm};
use tlt_kernels::cuda::{plan, DeviceBuf, Gpu};

#[test]
fn one_rank_collectives_on_the_device_or_a_clear_error_without_one() {
    if !available() {
        assert!(
            std::env::var("TLT_REQUIRE_GPU").map_or(true, |v| v != "1"),
            "TLT_REQUIRE_GPU=1 but the CUDA driver or NCCL does not load"
        );
        let e = NcclComm::open(&SelfComm, 0).unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
        println!("no CUDA driver or NCCL here: {e}");
        return;
    }
    let comm = NcclComm::open(&SelfComm, 0).unwrap();
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let g: &dyn Gpu = comm.gpu().as_ref();
    let host: Vec<f32> = (0..8 << 20).map(|i| (i % 1000) as f32 * 0.5 - 7.0).collect();
    let buf = DeviceBuf::from_host(g, &vec![0f32; host.len()]).unwrap();
    // The buffer's contents come from a kernel queued just before the all-reduce, on the same stream.
    let src = DeviceBuf::from_host(g, &host.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<_>>()).unwrap();
    g.launch(&plan::add_to_residual(buf.buf(), src.buf()).unwrap()).unwrap();
    comm.all_reduce_sum_f32(buf.buf()).unwrap();
    let t = Instant::now();
    comm.broadcast_f32(0, buf.buf()).unwrap();
    g.synchronize().unwrap();
    let secs = t.elapsed().as_secs_f64();
    let want: Vec<f32> = host.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
    assert_eq!(buf.to_host(g).unwrap(), want, "one rank's sum and broadcast are the identity");
    assert!(matches!(comm.broadcast_f32(1, buf.buf()), Err(Error::Invalid(_))), "root out of range");
    println!("NCCL one rank: all-reduce and broadcast of 32 MB ok (broadcast {:.3} ms)", secs * 1e3);
}
