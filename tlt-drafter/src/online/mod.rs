//! Online drafter training from rollouts: a bounded buffer of rollout samples, versioned weight publication
//! (the engine picks up new weights between verify rounds, never a torn read), and a background trainer that
//! runs micro-steps on an idle worker and stops within one micro-step when preempted.

mod buffer;
mod persist;
mod publish;
mod trainer;

pub use buffer::{BufferConfig, BufferStats, FeatureSample, OnlineBuffer};
pub use publish::{Versioned, WeightsReader, WeightsSlot};
pub use trainer::{BackgroundTrainer, MicroStepOutcome, TrainerStats};
