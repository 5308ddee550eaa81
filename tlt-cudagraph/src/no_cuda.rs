//! Stand-in for the CUDA backend in builds without the `cuda` feature: the same names, every constructor
//! returns [`Error::NotCompiledWithCuda`], so code using the backend compiles everywhere.

use std::marker::PhantomData;

use crate::error::{Error, Result};
use crate::executor::{Captured, GraphBackend};
use crate::key::GraphKey;

/// Always `false` without the `cuda` feature.
pub fn driver_available() -> bool {
    false
}

/// Never constructed without the `cuda` feature.
#[derive(Debug)]
pub enum NoGraph {}

/// The CUDA graph backend; without the `cuda` feature it cannot be constructed.
#[derive(Debug)]
pub struct CudaGraphBackend<Io: ?Sized> {
    _io: PhantomData<fn(&mut Io)>,
    never: NoGraph,
}

impl<Io: ?Sized> CudaGraphBackend<Io> {
    /// # Errors
    /// Always [`Error::NotCompiledWithCuda`].
    pub fn new<R>(_ordinal: usize, _record: R) -> Result<Self> {
        Err(Error::NotCompiledWithCuda)
    }
}

impl<Io: ?Sized> GraphBackend<Io> for CudaGraphBackend<Io> {
    type Graph = NoGraph;

    fn capture(&mut self, _key: &GraphKey, _io: &mut Io) -> Result<Captured<NoGraph>> {
        match self.never {}
    }

    fn replay(&mut self, graph: &NoGraph, _key: &GraphKey, _io: &mut Io) -> Result<()> {
        match *graph {}
    }
}
