//! Our CUDA kernels executed in the simulated device with the host's launch plans, against CPU references: one
//! module per kernel source (`attention.rs`, `kv.rs`, `layer.rs`, `sampling.rs`, `skinny.rs`, `train.rs`,
//! `train_attention.rs`). Each test body is its own `#[test]` on a fresh device and names the kernels it launches;
//! the test fails when the device recorded no launch of one of them, and
//! [`every_kernel_is_launched_by_a_test`] checks that the bodies' names cover every kernel of ours. Coverage so
//! costs nothing beyond the tests themselves (running every body a second time, on one device, took as long as all
//! the kernel tests together).

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::collections::BTreeSet;

use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::SOURCES;

/// Declares the kernel tests of a module from its test bodies (`fn(&SimDevice)`), each with the kernels it
/// launches: `BODIES`, every body by name with its kernels (for the coverage test), and in `tests` one `#[test]` per
/// body on a fresh device that then checks each named kernel was launched.
macro_rules! kernel_tests {
    ($($body:ident => [$($kernel:ident),+ $(,)?]),+ $(,)?) => {
        /// Every test body of this module, by name, with the kernels it launches.
        pub const BODIES: &[(&str, &[&str])] = &[$((stringify!($body), &[$(stringify!($kernel)),+])),+];

        mod tests {
            $(
                #[test]
                fn $body() {
                    let dev = tlt_cuda_sim::SimDevice::new();
                    super::$body(&dev);
                    crate::assert_launched(&dev, stringify!($body), &[$(stringify!($kernel)),+]);
                }
            )+
        }
    };
}

/// Fails unless `dev` recorded a launch of each of `kernels` (the kernels test `body` says it covers).
fn assert_launched(dev: &SimDevice, body: &str, kernels: &[&str]) {
    let launched: BTreeSet<&str> = dev.launches().iter().map(|l| l.kernel).collect();
    let missing: Vec<&&str> = kernels.iter().filter(|k| !launched.contains(**k)).collect();
    assert!(missing.is_empty(), "{body} names kernels it never launched: {missing:?} (launched: {launched:?})");
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

/// The kernels the test bodies name cover every kernel tlt-kernels declares, and name only those (each body's
/// own test checks that it launched what it names).
#[test]
fn every_kernel_is_launched_by_a_test() {
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
    let declared: BTreeSet<&str> = SOURCES.iter().flat_map(|s| s.kernels.iter().copied()).collect();
    let named: BTreeSet<&str> = bodies.iter().flat_map(|b| b.iter()).flat_map(|(_, ks)| ks.iter().copied()).collect();
    assert_eq!(uncovered(&declared, &named), Vec::<&str>::new(), "kernels no test launches");
    let unknown: Vec<&&str> = named.difference(&declared).collect();
    assert!(unknown.is_empty(), "test bodies name kernels tlt-kernels does not declare: {unknown:?}");
    println!(
        "{} kernels, each launched by one of {} test bodies",
        declared.len(),
        bodies.iter().map(|b| b.len()).sum::<usize>()
    );
    // Negative control: without the bodies of one module, its kernels are reported.
    let without_kv: BTreeSet<&str> = bodies
        .iter()
        .filter(|b| !std::ptr::eq(**b, kv::BODIES))
        .flat_map(|b| b.iter())
        .flat_map(|(_, ks)| ks.iter().copied())
        .collect();
    assert_eq!(uncovered(&declared, &without_kv), vec!["commit_path_bf16", "gather_path_rows_bf16"]);
}

/// The declared kernels that no body names, in order.
fn uncovered<'a>(declared: &BTreeSet<&'a str>, named: &BTreeSet<&str>) -> Vec<&'a str> {
    declared.iter().copied().filter(|k| !named.contains(k)).collect()
}

/// Negative control of the per-test check: a body that names a kernel it never launched fails.
#[test]
fn a_body_naming_a_kernel_it_never_launched_fails() {
    let dev = SimDevice::new();
    let named = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        assert_launched(&dev, "an empty body", &["tree_accept"]);
    }));
    assert!(named.is_err(), "a kernel that was never launched passed the check");
}
