//! Model-free drafting from suffix indexes: [`SuffixIndex`] (a generalized suffix automaton over growing token
//! streams) and [`SuffixDrafter`] (group drafting over a GRPO group's siblings), plus [`HybridDrafter`], which
//! merges any two drafters' trees under one verify budget.

mod calibrate;
mod drafter;
mod hybrid;
mod index;

pub use calibrate::Calibration;
pub use drafter::{SuffixConfig, SuffixDrafter, SuffixStats};
pub use hybrid::{merge_trees, HybridDrafter};
pub use index::{Occurrence, StateId, SuffixIndex};
