//! Optimisation shared by every trainer of the workspace (the policy's GRPO update in `tlt-rl`, the drafters'
//! offline and online training in `tlt-drafter`): [`AdamW`] with visible, checkpointable state, gradient clipping
//! by global norm, and the [`LrSchedule`] (linear warmup, then constant, linear or cosine decay to a floor).

mod adamw;
mod schedule;

pub(crate) use adamw::clip_coef;
pub use adamw::{clip_grad_norm, AdamW, AdamWParams, GradNorm, ParamState};
pub use schedule::{LrSchedule, ScheduleKind};
