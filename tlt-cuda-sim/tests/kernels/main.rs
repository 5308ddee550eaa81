//! Our CUDA kernels executed in the simulated device with the host's launch plans, against CPU references: one
//! module per kernel source (`attention.rs`, `kv.rs`, `layer.rs`, `sampling.rs`, `skinny.rs`, `train.rs`,
//! `train_attention.rs`). Each test body takes the device it runs on: it is its own `#[test]` on a fresh device, and
//! [`every_kernel_is_launched_by_a_test`] runs every body on one device and counts, from the launches that device
//! recorded, that each kernel of ours ran.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::collections::BTreeMap;

use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::SOURCES;

/// Declares the kernel tests of a module from its test bodies (`fn(&SimDevice)`): `BODIES`, every body by name
/// (for the coverage test), and in `tests` one `#[test]` per body on a fresh device.
macro_rules! kernel_tests {
    ($($body:ident),+ $(,)?) => {
        /// Every test body of this module, by name.
        pub const BODIES: &[(&str, fn(&tlt_cuda_sim::SimDevice))] = &[$((stringify!($body), $body)),+];

        mod tests {
            $(
                #[test]
                fn $body() {
                    super::$body(&tlt_cuda_sim::SimDevice::new());
                }
            )+
        }
    };
}

mod attention;
mod common;
mod draft_train;
mod kv;
mod layer;
mod sampling;
mod skinny;
mod train;
mod train_attention;

/// The prefix of the detector controls (`csrc/controls.cu`), the simulation's kernels that are not ours.
const CONTROL: &str = "ctl_";

/// The simulation compiles exactly the kernels tlt-kernels declares (besides the detector controls), each with
/// parameters of the kinds the launches model.
#[test]
fn the_simulation_compiles_exactly_our_kernels() {
    let mut simulated: Vec<&str> =
        tlt_cuda_sim::kernels().iter().map(|k| k.name).filter(|n| !n.starts_with(CONTROL)).collect();
    let mut declared: Vec<&str> = SOURCES.iter().flat_map(|s| s.kernels.iter().copied()).collect();
    assert!(declared.iter().all(|k| !k.starts_with(CONTROL)), "a kernel of ours is named like a control");
    simulated.sort_unstable();
    declared.sort_unstable();
    assert_eq!(simulated, declared, "the simulation compiles exactly the kernels tlt-kernels declares");
    for k in tlt_cuda_sim::kernels() {
        assert!(k.kinds.chars().all(|c| "pifu".contains(c)), "{}: a parameter of an unmodelled type", k.name);
    }
    println!("simulated kernels ({} of ours):", declared.len());
    for k in tlt_cuda_sim::kernels() {
        println!("  {} ({})", k.name, k.kinds);
    }
}

/// Every test body runs on one device; every kernel tlt-kernels declares must be among the launches it recorded.
#[test]
fn every_kernel_is_launched_by_a_test() {
    let dev = SimDevice::new();
    let bodies = [
        attention::BODIES,
        draft_train::BODIES,
        kv::BODIES,
        layer::BODIES,
        sampling::BODIES,
        skinny::BODIES,
        train::BODIES,
        train_attention::BODIES,
    ];
    for (name, body) in bodies.iter().flat_map(|b| b.iter()) {
        body(&dev);
        println!("ran {name}");
    }
    let mut counts: BTreeMap<&str, usize> = SOURCES.iter().flat_map(|s| s.kernels.iter().map(|&k| (k, 0))).collect();
    for l in dev.launches() {
        *counts.entry(l.kernel).or_default() += 1;
    }
    println!("launches recorded per kernel ({} launches):", dev.launches().len());
    for (k, n) in &counts {
        println!("  {k}: {n}");
    }
    let missing: Vec<&str> = counts.iter().filter(|(_, &n)| n == 0).map(|(&k, _)| k).collect();
    assert!(missing.is_empty(), "kernels no test launches: {missing:?}");
}
