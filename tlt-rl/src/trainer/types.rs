//! The types the trainer's files share: a rollout's [`Sample`] (produced by the rollout, exchanged between ranks,
//! consumed by the policy update) and the device handle (`GpuHandle`) that the rollout device and the EAGLE
//! drafter's forward both hold. This module imports none of its siblings, so each of them can import it without
//! closing a circle.

use std::sync::Mutex;

use tlt_kernels::cuda::SharedGpu;
use tlt_model::Device;

use crate::{Error, Result};

/// One generated sample.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// Index of its prompt in the step (its GRPO group).
    pub group: usize,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Generated tokens (a stop token last if it stopped).
    pub tokens: Vec<u32>,
    /// The rollout's log-probabilities of `tokens` (temperature 1, as the engine records them).
    pub logprobs: Vec<f32>,
    /// It hit the length limit without stopping.
    pub truncated: bool,
}

/// The device rollouts and the EAGLE drafter's forward share: a CUDA device opened at first use (feature `cuda`), or
/// one handed in; none when rollouts run on the CPU.
#[derive(Debug)]
pub(crate) struct GpuHandle {
    /// The CUDA device to open at first use (`None`: the CPU, or a device handed in).
    ordinal: Option<usize>,
    gpu: Mutex<Option<SharedGpu>>,
}

impl GpuHandle {
    /// A handle for `device` (nothing opened yet).
    pub(crate) fn new(device: Device) -> Self {
        let ordinal = match device {
            Device::Cuda(n) => Some(n),
            Device::Cpu => None,
        };
        Self { ordinal, gpu: Mutex::new(None) }
    }

    /// A handle on a device already open.
    pub(crate) fn with(gpu: SharedGpu) -> Self {
        Self { ordinal: None, gpu: Mutex::new(Some(gpu)) }
    }

    /// Whether rollouts run on a device (not the CPU).
    pub(crate) fn on_device(&self) -> bool {
        self.ordinal.is_some() || self.gpu.lock().is_ok_and(|g| g.is_some())
    }

    /// The device, opened on first use.
    ///
    /// # Errors
    /// Without a driver (never a panic), in a build without `cuda`, or for rollouts on the CPU.
    pub(crate) fn gpu(&self) -> Result<SharedGpu> {
        let mut g =
            self.gpu.lock().map_err(|_| Error::InvalidArgument("the device handle's lock is poisoned".into()))?;
        if let Some(gpu) = g.as_ref() {
            return Ok(gpu.clone());
        }
        let ordinal =
            self.ordinal.ok_or_else(|| Error::InvalidArgument("rollouts on the CPU have no device".into()))?;
        let opened = tlt_kernels::cuda::open_device(ordinal).map_err(|e| Error::Model(e.into()))?;
        *g = Some(opened.clone());
        Ok(opened)
    }
}
