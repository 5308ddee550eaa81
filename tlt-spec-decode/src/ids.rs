//! The ids of requests and groups, shared by the engine and the drafters it drives: kept apart from both so that
//! neither file imports the other for them.

/// Identifies a request of an [`Engine`](crate::Engine) (dense, in order of
/// [`Engine::add_request`](crate::Engine::add_request)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub usize);

/// Identifies a group of requests that answer one prompt together (a GRPO group), as given to
/// [`Engine::add_request_in_group`](crate::Engine::add_request_in_group) or made by
/// [`Engine::add_group`](crate::Engine::add_group). Group drafters ([`SuffixDrafter`](crate::SuffixDrafter)) draft
/// from a request's siblings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct GroupId(pub u64);
