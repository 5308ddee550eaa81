//! Tells the crates that build our CUDA C kernels themselves where the sources are: `links = "tlt_kernels"` hands
//! `cuda_dir` to the build scripts of direct dependents as `DEP_TLT_KERNELS_CUDA_DIR` (tlt-cuda-sim compiles the
//! kernels as host C++). The directory is this package's own `cuda/`, so it is found in a published crate too.

fn main() {
    let here = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:cuda_dir={here}/cuda");
    println!("cargo:rerun-if-changed=build.rs");
}
