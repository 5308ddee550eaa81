//! CUDA backend tests (`--features cuda`). Without a driver they check that construction fails cleanly; with
//! one (`cargo xtask test --gpu`) they check capture, replay and the pool on a real device.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use tlt_cudagraph::cuda::{driver_available, CudaGraphBackend};
use tlt_cudagraph::{BucketPolicy, Error, Executor, GraphExecutor, GraphKey, RunMode};

struct DevIo {
    src: CudaSlice<f32>,
    dst: CudaSlice<f32>,
}

fn copy_rows(stream: &Arc<CudaStream>, key: &GraphKey, io: &mut DevIo) -> Result<(), Error> {
    let n = key.tokens();
    let src = io.src.slice(0..n);
    let mut dst = io.dst.slice_mut(0..n);
    stream.memcpy_dtod(&src, &mut dst).map_err(|e| Error::Run(Box::new(e)))
}

#[test]
fn no_driver_is_an_error_not_a_panic() {
    if driver_available() {
        return;
    }
    let r = CudaGraphBackend::<DevIo>::new(0, |_: &GraphKey, _: &mut DevIo, _: &Arc<CudaStream>| Ok(()));
    assert!(matches!(r, Err(Error::NoDriver(_))), "{r:?}");
}

#[test]
fn replay_reads_the_static_buffers_and_matches_eager() {
    if !driver_available() {
        assert!(std::env::var_os("TLT_REQUIRE_GPU").is_none(), "TLT_REQUIRE_GPU is set but no CUDA driver was found");
        eprintln!("skipped: no CUDA driver");
        println!("skipped: no CUDA driver");
        return;
    }
    let backend = CudaGraphBackend::<DevIo>::new(0, |k: &GraphKey, io: &mut DevIo, s: &Arc<CudaStream>| {
        copy_rows(s, k, io).map_err(|e| e.into())
    })
    .unwrap()
    .with_estimate(|k| 4 * k.tokens() as u64);
    let stream = backend.stream().clone();
    let eager_stream = stream.clone();
    let eager = move |k: &GraphKey, io: &mut DevIo| copy_rows(&eager_stream, k, io);
    let cap = 8 * 16;
    let mut io = DevIo { src: stream.alloc_zeros::<f32>(cap).unwrap(), dst: stream.alloc_zeros::<f32>(cap).unwrap() };
    let mut ex = GraphExecutor::new(backend, eager, BucketPolicy::ladder(8), 1 << 20).unwrap();
    for round in 0..3 {
        let host: Vec<f32> = (0..cap).map(|i| (i + 1000 * round) as f32).collect();
        stream.memcpy_htod(&host, &mut io.src).unwrap();
        stream.memset_zeros(&mut io.dst).unwrap();
        let info = ex.run(&GraphKey::verify(5, 16), &mut io).unwrap();
        assert_eq!(info.key, GraphKey::verify(6, 16));
        assert_eq!(info.mode, if round == 0 { RunMode::Captured } else { RunMode::Replayed });
        let out = stream.clone_dtoh(&io.dst).unwrap();
        stream.synchronize().unwrap();
        assert_eq!(&out[..96], &host[..96], "round {round}");
        assert!(out[96..].iter().all(|&x| x == 0.0));
    }
    let big = ex.run(&GraphKey::verify(9, 16), &mut io).unwrap();
    assert!(matches!(big.mode, RunMode::Eager(Some(_))));
    assert_eq!(ex.stats().captures, 1);
    assert!(ex.stats().bytes_in_use >= 4 * 96);
}
