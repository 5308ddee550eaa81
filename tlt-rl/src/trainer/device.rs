//! Where the trainer's rollouts run: the policy's inference copy on the CPU, or on a CUDA device (feature `cuda`)
//! through `tlt_spec_decode::cuda::CudaTarget`, built once (sized for the step's requests and longest answer) and
//! refreshed with the policy's weights in place before every rollout (graphs stay captured). The EAGLE drafter's
//! forward runs on the same device (`tlt_drafter::cuda::CudaDrafter`, shared by the rollouts' proposers); its
//! training, the model-free drafters and the update stay on the CPU. **The CUDA path has not yet run on a GPU.**

use tlt_model::{Device, Llama};
use tlt_scheduler::AdaptiveDecoder;

use super::drafter::RolloutDrafter;
use super::rollout::{run_rollout, Observer, RolloutJob, RolloutOutput};
use crate::{Error, Result};

/// The rollout backend of a trainer.
#[derive(Debug, Default)]
pub(crate) struct RolloutDevice {
    device: Device,
    /// The device target, once a rollout has built it.
    #[cfg(feature = "cuda")]
    gpu: std::sync::Mutex<Option<tlt_spec_decode::cuda::CudaTarget>>,
}

impl RolloutDevice {
    /// Rollouts on `device`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a CUDA device in a build without the `cuda` feature.
    pub(crate) fn new(device: Device) -> Result<Self> {
        if device.is_cuda() && !cfg!(feature = "cuda") {
            return Err(Error::config(
                "device",
                format!("{device}: this build has no CUDA (enable tlt-rl's `cuda` feature)"),
            ));
        }
        Ok(Self {
            device,
            #[cfg(feature = "cuda")]
            gpu: std::sync::Mutex::default(),
        })
    }

    /// Runs `job` with the weights of `model` (the policy's inference copy).
    ///
    /// # Errors
    /// As the rollout, and the device's errors (no driver, out of memory).
    pub(crate) fn rollout(
        &self,
        model: &Llama,
        job: RolloutJob<'_>,
        decoder: &mut AdaptiveDecoder,
        drafter: Option<&mut RolloutDrafter>,
        obs: &mut dyn Observer,
    ) -> Result<RolloutOutput> {
        match self.device {
            Device::Cpu => run_rollout(model, job, decoder, drafter, obs),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                use tlt_spec_decode::cuda::CudaTarget;
                let slots = job.prompts.len() * job.group_size;
                let longest = job.prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
                let positions = longest + job.params.max_new_tokens + tlt_kernels::cuda::MAX_TREE_NODES + 1;
                let mut gpu =
                    self.gpu.lock().map_err(|_| Error::InvalidArgument("the GPU target's lock is poisoned".into()))?;
                match gpu.as_ref() {
                    Some(t) if t.capacity().0 >= slots && t.capacity().1 >= positions => t.update_weights(model)?,
                    _ => {
                        // Positions rounded up so that slightly longer prompts later do not rebuild it.
                        *gpu = Some(CudaTarget::new(model, ordinal, slots, positions.next_multiple_of(256), 2 << 30)?);
                    }
                }
                let target = gpu.as_ref().ok_or_else(|| Error::InvalidArgument("no GPU target".into()))?;
                run_rollout(target, job, decoder, drafter, obs)
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(Error::config("device", "this build has no CUDA (enable tlt-rl's `cuda` feature)")),
        }
    }
}
