//! The simulation's own detectors, proved with controls: deliberately faulty kernels (`csrc/controls.cu`, named
//! `ctl_*`) that each detector must catch. A barrier only some threads reach (a deadlock), a misaligned 16-byte
//! access and a shuffle from a lane that has returned are errors of the launch; a write one element past a buffer
//! faults on its guard page (in a child process, which must die of SIGSEGV); and a race between blocks, right when
//! blocks run one after another in grid order, gives the wrong answer under interleaving for some seed. Also: the
//! worker pool that interleaves blocks serves launches from several threads at once, failing ones among them.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use half::bf16;
use tlt_cuda_sim::{Error, SimDevice};
use tlt_kernels::cuda::plan::{Arg, Launch};

/// The environment variable that makes this test binary a child running one control.
const CHILD: &str = "TLT_CUDA_SIM_CONTROL_CHILD";

/// SIGSEGV on Linux.
const SIGSEGV: i32 = 11;

fn launch(kernel: &'static str, grid: u32, block: u32, args: Vec<Arg>) -> Launch {
    Launch { kernel, grid: [grid, 1, 1], block: [block, 1, 1], shared_bytes: 0, args }
}

/// The message of the `Error::Launch` that `result` must be.
fn launch_error(result: tlt_cuda_sim::Result<()>, kernel: &str) -> String {
    match result {
        Err(Error::Launch { kernel: k, message }) if k == kernel => message,
        other => panic!("{kernel}: expected a launch error, got {other:?}"),
    }
}

/// The device still runs launches after a control failed one (the first error ends the launch cleanly).
fn still_runs(dev: &SimDevice) {
    let x = dev.upload(&[1.0f32; 300]);
    let y = dev.upload(&[bf16::from_f32(0.5); 300]);
    dev.launch(&tlt_kernels::cuda::plan::add_to_residual(x.buf(), y.buf()).unwrap()).unwrap();
    assert_eq!(x.download(), [1.5f32; 300]);
}

#[test]
fn a_barrier_only_some_threads_reach_is_a_deadlock() {
    let dev = SimDevice::new();
    let out = dev.zeros::<f32>(64);
    for d in [dev.sequential(), dev.clone()] {
        // One block; then two blocks, interleaved.
        for grid in [1, 2] {
            let l = launch("ctl_deadlock", grid, 32, vec![Arg::Ptr(out.buf().addr())]);
            let msg = launch_error(d.launch(&l), "ctl_deadlock");
            assert!(msg.starts_with("deadlock"), "{msg}");
            assert!(msg.contains("at __syncthreads") && msg.contains("at a warp exchange"), "{msg}");
        }
        still_runs(&d);
    }
    let l = launch("ctl_deadlock", 1, 32, vec![Arg::Ptr(out.buf().addr())]);
    println!("ctl_deadlock: caught: {}", launch_error(dev.launch(&l), "ctl_deadlock"));
}

#[test]
fn a_misaligned_16_byte_access_is_an_error() {
    let dev = SimDevice::new();
    let buf = dev.zeros::<bf16>(8 * 65);
    let out = dev.zeros::<bf16>(8 * 64 * 4);
    let l = launch("ctl_misaligned", 4, 64, vec![Arg::Ptr(buf.buf().addr()), Arg::Ptr(out.buf().addr())]);
    for d in [dev.sequential(), dev.clone(), dev.reversed()] {
        let msg = launch_error(d.launch(&l), "ctl_misaligned");
        assert!(msg.contains("16-byte access") && msg.contains("not 16-byte aligned"), "{msg}");
        still_runs(&d);
    }
    println!("ctl_misaligned: caught: {}", launch_error(dev.launch(&l), "ctl_misaligned"));
}

#[test]
fn a_shuffle_from_an_exited_lane_is_an_error() {
    let dev = SimDevice::new();
    let out = dev.zeros::<f32>(32);
    let l = launch("ctl_shuffle_exited", 3, 32, vec![Arg::Ptr(out.buf().addr())]);
    for d in [dev.sequential(), dev.clone(), dev.reversed()] {
        let msg = launch_error(d.launch(&l), "ctl_shuffle_exited");
        assert!(msg.contains("thread (30,0,0): shuffle from lane 31, which has returned"), "{msg}");
        still_runs(&d);
    }
    println!("ctl_shuffle_exited: caught: {}", launch_error(dev.launch(&l), "ctl_shuffle_exited"));
}

/// The name of the overrun test, for the child run.
const OVERRUN_TEST: &str = "a_write_past_a_buffer_faults_on_its_guard_page";

#[test]
fn a_write_past_a_buffer_faults_on_its_guard_page() {
    if std::env::var_os(CHILD).is_some() {
        // The child: 2 blocks of 64 threads over 64 floats (256 bytes, so x[64] is the guard page's first byte).
        let dev = SimDevice::new();
        let x = dev.zeros::<f32>(64);
        let result = dev.launch(&launch("ctl_overrun", 2, 64, vec![Arg::Ptr(x.buf().addr()), Arg::I32(64)]));
        eprintln!("ctl_overrun: the write past the buffer did not fault ({result:?})");
        std::process::exit(0);
    }
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["--exact", OVERRUN_TEST, "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(SIGSEGV), "the child must die of SIGSEGV: {:?}; stderr: {stderr}", out.status);
    println!("ctl_overrun: caught: the child process died of signal {SIGSEGV} (SIGSEGV) writing x[64] of 64 floats");
}

#[test]
fn a_race_between_blocks_shows_under_interleaving() {
    let dev = SimDevice::new();
    let (flag, seen) = (dev.zeros::<i32>(1), dev.zeros::<i32>(1));
    let run = |d: &SimDevice| {
        flag.write(&[0]);
        seen.write(&[-1]);
        d.launch(&launch("ctl_block_race", 2, 32, vec![Arg::Ptr(flag.buf().addr()), Arg::Ptr(seen.buf().addr())]))
            .unwrap();
        seen.download()[0]
    };
    // In grid order, block 0 publishes before block 1 reads: the race stays hidden.
    assert_eq!(run(&dev.sequential()), 42, "sequential: block 1 reads what block 0 wrote");
    let seeds: Vec<u64> = (0..8).collect();
    let seen_by_seed: Vec<i32> = seeds.iter().map(|&s| run(&dev.with_block_seed(s))).collect();
    // The same seed, the same execution.
    let again: Vec<i32> = seeds.iter().map(|&s| run(&dev.with_block_seed(s))).collect();
    assert_eq!(seen_by_seed, again, "a seed's schedule is deterministic");
    assert!(seen_by_seed.iter().all(|&v| v == 0 || v == 42), "{seen_by_seed:?}");
    let wrong: Vec<u64> = seeds.iter().zip(&seen_by_seed).filter(|(_, &v)| v != 42).map(|(&s, _)| s).collect();
    assert!(!wrong.is_empty(), "no seed of {seeds:?} ran block 1 before block 0: {seen_by_seed:?}");
    println!(
        "ctl_block_race: sequential reads 42 (race hidden); interleaved seeds {seeds:?} read {seen_by_seed:?}: caught \
         under seeds {wrong:?}"
    );
}

#[test]
fn launches_from_several_threads_at_once_keep_their_schedules() {
    // What each seed's schedule gives, on this thread alone.
    let race = |dev: &SimDevice, seed: u64| {
        let (flag, seen) = (dev.zeros::<i32>(1), dev.zeros::<i32>(1));
        let args = vec![Arg::Ptr(flag.buf().addr()), Arg::Ptr(seen.buf().addr())];
        dev.with_block_seed(seed).launch(&launch("ctl_block_race", 2, 32, args)).unwrap();
        seen.download()[0]
    };
    let alone: Vec<i32> = (0..16).map(|s| race(&SimDevice::new(), s)).collect();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let dev = SimDevice::new();
                let out = dev.zeros::<f32>(64);
                let mut got = Vec::new();
                for round in 0..20 {
                    for s in 0..16 {
                        got.push(race(&dev, s));
                    }
                    if (round + t) % 3 == 0 {
                        let l = launch("ctl_deadlock", 4, 32, vec![Arg::Ptr(out.buf().addr())]);
                        assert!(matches!(dev.launch(&l), Err(Error::Launch { .. })));
                    }
                    still_runs(&dev);
                }
                got
            })
        })
        .collect();
    for t in threads {
        let got = t.join().unwrap();
        for chunk in got.chunks(16) {
            assert_eq!(chunk, alone, "a seed's schedule depends on other threads' launches");
        }
    }
    println!("4 threads x 20 rounds of 16 seeded launches and failing ones: every seed's schedule as on one thread");
}
