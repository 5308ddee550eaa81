//! # tlt-serve
//!
//! A rollout server with TLT's engine inside, for trainers that talk to their rollout engine over HTTP (slime,
//! verl's and NeMo-RL's SGLang backends, TRL's server mode): SGLang's native `/generate` and control endpoints
//! ([`routes`], [`control`]), OpenAI's `/v1/completions` and `/v1/chat/completions` ([`chat`]) in vLLM's form,
//! TRL's `vllm-serve` API ([`trl`]), on axum and
//! tokio, in front of an engine thread that batches continuously ([`worker`]): requests join the running batch at
//! round boundaries, a request with the prompt of a live one forks its prefill, and every round goes through TLT's
//! adaptive decoder (the SD gate on the live batch, the plan bandit), so speculation (prompt-lookup n-grams, or TLT's
//! online EAGLE-2 drafter trained on the served requests' hidden states: [`drafter`]) runs in the long tail. Output log-probs are the target's, from the pass that committed each token.
//!
//! Aborts (by request id, by a client gone, by a pause) and weight updates act between rounds; an update never mixes
//! two weight versions in one response. Every request is validated ([`api`]): a bad field is a 4xx with a JSON error
//! naming it. [`stats`] feeds `/metrics`; `/generate` streams server-sent events on request. Not built yet:
//! distributed (NCCL) weight updates.
//!
//! **Where it sits:** depends on tlt-model, tlt-spec-decode (the engine), tlt-scheduler (the gate and bandit),
//! tlt-drafter (the online drafter),
//! tlt-rl (its chat template renderer), axum and tokio.
//!
//! **Inside:** [`routes`] assembles the router; the handlers (`generate`, [`chat`], [`control`], [`trl`], `info`,
//! `stream`) share the state in `state.rs` and the reply shapes in `reply.rs`, and none of them imports `routes`
//! (`cargo xtask graph` draws the files' imports).

pub mod api;
pub mod backend;
pub mod chat;
pub mod control;
pub mod decode;
pub mod distributed;
pub mod drafter;
mod error;
mod generate;
pub mod guard;
mod guard_config;
mod info;
pub mod pool;
mod reply;
pub mod routes;
mod server;
pub mod server_info;
mod state;
pub mod stats;
mod stream;
mod sync_routes;
pub mod trl;
pub mod weights;
pub mod worker;

pub use error::{Error, Result};
pub use server::{bind, tune_allocator, ServeConfig, Server, CONTROL_SLOTS, LISTEN_BACKLOG};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
