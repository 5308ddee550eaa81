//! Where the trainer's rollouts run: the policy's inference copy on the CPU, or on a device behind the seam
//! (`tlt_kernels::cuda::Gpu`: a CUDA device with the `cuda` feature, or one handed in with
//! [`super::Trainer::with_gpu`], e.g. the simulated device in CI) through `tlt_spec_decode::cuda::CudaTarget`, built
//! once (sized for the step's requests and longest answer) and refreshed with the policy's weights in place before
//! every rollout (graphs stay captured). The EAGLE drafter's forward runs on the same device and stream
//! (`tlt_drafter::cuda::CudaDrafter`, shared by the rollouts' proposers); its training and the model-free drafters
//! stay on the CPU. The policy update runs on the device too ([`RolloutDevice::update_policy`],
//! `super::update_device`), on the target's own weights: once it has, rollouts no longer copy weights from the host.

use std::sync::{Arc, Mutex};

use tlt_model::optim::ParamState;
use tlt_model::{Device, Llama};
use tlt_scheduler::AdaptiveDecoder;
use tlt_spec_decode::cuda::CudaTarget;

use super::drafter::RolloutDrafter;
use super::memory::{cache_positions, GRAPH_BUDGET};
use super::rollout::{run_rollout, Observer, RolloutJob, RolloutOutput};
use super::types::GpuHandle;
use super::update::{policy_update, TrainSeq, UpdateContext, UpdateStats};
use super::update_device::{DeviceTrain, DeviceUpdate};
use crate::{Error, Result};

/// The rollout backend of a trainer.
#[derive(Debug)]
pub(crate) struct RolloutDevice {
    handle: Arc<GpuHandle>,
    /// The device target, once a rollout has built it.
    target: Mutex<Option<CudaTarget>>,
    /// The policy update on the device, once one has run: from then on the target's weights are the trained ones.
    train: Mutex<Option<DeviceTrain>>,
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
        Ok(Self::on(Arc::new(GpuHandle::new(device))))
    }

    /// Rollouts on the device of `handle`.
    pub(crate) fn on(handle: Arc<GpuHandle>) -> Self {
        Self { handle, target: Mutex::new(None), train: Mutex::new(None) }
    }

    /// The device handle (shared with the drafter's device executor).
    pub(crate) fn handle(&self) -> &Arc<GpuHandle> {
        &self.handle
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
        if !self.handle.on_device() {
            return run_rollout(model, job, decoder, drafter, obs);
        }
        let slots = job.prompts.len() * job.group_size;
        let longest = job.prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
        let positions = cache_positions(longest, job.params.max_new_tokens);
        let mut target =
            self.target.lock().map_err(|_| Error::InvalidArgument("the GPU target's lock is poisoned".into()))?;
        let trained_here =
            self.train.lock().map_err(|_| Error::InvalidArgument("a lock is poisoned".into()))?.is_some();
        match target.as_ref() {
            // The device update wrote its weights into the target in place: nothing to copy.
            Some(t) if t.capacity().0 >= slots && t.capacity().1 >= positions && trained_here => {}
            Some(t) if t.capacity().0 >= slots && t.capacity().1 >= positions => t.update_weights(model)?,
            _ => {
                // Positions rounded up so that slightly longer prompts later do not rebuild it.
                let gpu = self.handle.gpu()?;
                *target = Some(CudaTarget::new(model, gpu, slots, positions.next_multiple_of(256), GRAPH_BUDGET)?);
            }
        }
        let target = target.as_ref().ok_or_else(|| Error::InvalidArgument("no GPU target".into()))?;
        run_rollout(target, job, decoder, drafter, obs)
    }

    /// Runs the policy update ([`policy_update`] over `seqs`) on the rollouts' device, on the rollout engine's own
    /// weights (updated in place), then mirrors the new f32 weights into `opt`'s variables (the host policy; the
    /// moments stay on the device: [`Self::optimizer_state`]). The first call builds the device trainer from `opt` (a fresh run's or a resumed
    /// checkpoint's state) with the training pass's buffers as `opts` plans them.
    ///
    /// # Errors
    /// Before any rollout (no device model yet), for an architecture the device update does not cover, and the
    /// update's and the device's errors.
    pub(crate) fn update_policy(
        &self,
        ctx: &UpdateContext,
        opt: &mut tlt_model::optim::AdamW,
        opts: &tlt_model::cuda::train::TrainOptions,
        seqs: &[TrainSeq],
        stats: &mut UpdateStats,
    ) -> Result<()> {
        let poisoned = || Error::InvalidArgument("a device lock is poisoned".into());
        let target = self.target.lock().map_err(|_| poisoned())?;
        let target = target
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("a device update needs a rollout before it".into()))?;
        let mut train = self.train.lock().map_err(|_| poisoned())?;
        target.with_model_mut(|model| -> Result<()> {
            let t = match train.as_mut() {
                Some(t) => t,
                None => train.insert(DeviceTrain::new(model, opt, ctx.reference, opts)?),
            };
            policy_update(ctx, &mut DeviceUpdate { train: t, policy: model }, seqs, stats)?;
            t.mirror_weights_to_host(opt)
        })?
    }

    /// The optimizer state of the device update (moments and steps, in `opt`'s parameter order), or `None` when the
    /// update has not run on the device: what a checkpoint saves instead of the host optimizer's stale moments.
    ///
    /// # Errors
    /// A poisoned lock, or the device's errors.
    pub(crate) fn optimizer_state(&self, opt: &tlt_model::optim::AdamW) -> Result<Option<Vec<ParamState>>> {
        let train = self.train.lock().map_err(|_| Error::InvalidArgument("a device lock is poisoned".into()))?;
        train.as_ref().map(|t| t.optimizer_state(opt)).transpose()
    }
}
