//! One decoder forward on a device as a program of operations over buffer descriptors: kernel launches
//! ([`tlt_kernels::cuda::plan`]), GEMMs and copies, issued to a [`DeviceOps`]. `CudaLlama` (feature `cuda`) runs the
//! program on a CUDA stream (eagerly or captured into a graph); tests run the very same program on the simulated
//! device (`tlt-cuda-sim`) against the CPU decoder and count its launches. Host-side, no CUDA needed.

mod layout;
mod parity;
mod program;
pub mod roofline;

pub use layout::{layout, tree_rows_bucket, DeviceSeq, MetaBufs, StepLayout, StepMeta};
pub use parity::{row_parity, RowParity, BF16_ROW_TOL};
pub use program::{DeviceOps, LayerBufs, LinearBufs, StepBufs, StepProgram, WeightBufs};
