//! The graph pool on a device behind the seam ([`GpuGraphBackend`] in a [`GraphExecutor`]), on the device the
//! environment gives: in CI the simulated device (`tlt-cuda-sim`'s `SimGpu`, whose graphs record launches and
//! copies and replay them in stream order), on a GPU machine the CUDA device. Replays read the static buffers and
//! equal the eager run; batches pad to the bucket ladder; a batch beyond it runs eagerly. Negative control on the
//! simulated device: a graph replayed after its input buffer was freed and allocated again is an error.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::sync::Arc;

use tlt_cuda_sim::{Schedule, SimGpu};
use tlt_cudagraph::gpu::GpuGraphBackend;
use tlt_cudagraph::{BucketPolicy, Error, Executor, GraphBackend, GraphExecutor, GraphKey, RunMode};
use tlt_kernels::cuda::{gpu, DeviceBuf, SharedGpu};

/// Static input and output buffers of `cap` f32 each.
struct DevIo {
    src: DeviceBuf<f32>,
    dst: DeviceBuf<f32>,
}

/// The forward of a key: copies its first `tokens()` inputs to the outputs.
fn copy_rows(g: &SharedGpu, key: &GraphKey, io: &mut DevIo) -> Result<(), Error> {
    let n = key.tokens();
    let run = || gpu::copy(g.as_ref(), io.src.buf().slice(0..n)?, io.dst.buf().slice(0..n)?);
    run().map_err(|e| Error::Run(Box::new(e)))
}

fn io(g: &SharedGpu, cap: usize) -> DevIo {
    DevIo { src: DeviceBuf::zeros(g.as_ref(), cap).unwrap(), dst: DeviceBuf::zeros(g.as_ref(), cap).unwrap() }
}

fn backend(g: &SharedGpu) -> GpuGraphBackend<DevIo> {
    GpuGraphBackend::new(g.clone(), |k: &GraphKey, io: &mut DevIo, g: &SharedGpu| {
        copy_rows(g, k, io).map_err(Into::into)
    })
}

fn replay_matches_eager(g: SharedGpu) {
    let eager_gpu = g.clone();
    let eager = move |k: &GraphKey, io: &mut DevIo| copy_rows(&eager_gpu, k, io);
    // Room for the batch of 9 that runs eagerly below (it is beyond the ladder of 8).
    let cap = 9 * 16;
    let mut io = io(&g, cap);
    let policy = BucketPolicy::ladder(8);
    // A batch of 5 runs the graph of the smallest captured size at or above it: 5 itself. (The first GPU run's test
    // expected 6, as if the ladder held powers of two; SGLang's ladder, and ours, holds every size up to 8.)
    let padded = policy.pad(5).unwrap();
    assert_eq!(padded, 5, "the ladder holds every batch size up to 8");
    let backend = backend(&g).with_estimate(|k| 4 * k.tokens() as u64);
    let mut ex = GraphExecutor::new(backend, eager, policy, 1 << 20).unwrap();
    for round in 0..3 {
        let host: Vec<f32> = (0..cap).map(|i| (i + 1000 * round) as f32).collect();
        io.src.write(g.as_ref(), 0, &host).unwrap();
        gpu::zero(g.as_ref(), io.dst.buf()).unwrap();
        let info = ex.run(&GraphKey::verify(5, 16), &mut io).unwrap();
        assert_eq!(info.key, GraphKey::verify(padded, 16));
        assert_eq!(info.mode, if round == 0 { RunMode::Captured } else { RunMode::Replayed });
        let out = io.dst.to_host(g.as_ref()).unwrap();
        let n = info.key.tokens();
        assert_eq!(&out[..n], &host[..n], "round {round}");
        assert!(out[n..].iter().all(|&x| x == 0.0), "round {round}: the graph wrote past its rows");
    }
    let big = ex.run(&GraphKey::verify(9, 16), &mut io).unwrap();
    assert!(matches!(big.mode, RunMode::Eager(Some(_))));
    assert_eq!(ex.stats().captures, 1);
    assert!(ex.stats().bytes_in_use >= 4 * 80);
}

#[test]
fn replay_reads_the_static_buffers_and_matches_eager() {
    let test = "replay_reads_the_static_buffers_and_matches_eager";
    for g in tlt_cuda_sim::test_devices(test, &SimGpu::schedules()).unwrap() {
        replay_matches_eager(g);
    }
}

/// A graph captured over buffers that were then freed and allocated again (the "inputs moved" fault: a graph keeps
/// the addresses it was captured with) fails to replay on the simulated device, instead of reading freed memory.
#[test]
fn a_graph_replayed_after_its_inputs_moved_is_an_error() {
    let g: SharedGpu = Arc::new(SimGpu::new(Schedule::Lazy));
    let mut backend = backend(&g);
    let mut first = io(&g, 64);
    let key = GraphKey::decode(4);
    let captured = backend.capture(&key, &mut first).unwrap();
    backend.replay(&captured.graph, &key, &mut first).unwrap();
    g.synchronize().unwrap();
    // The buffers move: dropped, and new ones allocated (perhaps at the same addresses).
    drop(first);
    let mut moved = io(&g, 64);
    let e = backend.replay(&captured.graph, &key, &mut moved).unwrap_err();
    println!("negative control: a graph replayed after its inputs moved: {e}");
    assert!(e.to_string().contains("freed or moved"), "{e}");
}
