//! The routes of SGLang's weight sync from the trainer's GPUs ([`crate::distributed`]).

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Json;
use serde_json::json;
use tlt_comm::store::TcpStore;

use crate::distributed::{
    receive, DestroyGroupRequest, Group, InitGroupRequest, UpdateDistributedRequest, RENDEZVOUS_TIMEOUT,
};
use crate::reply::answer;
use crate::state::AppState;
use crate::Error;

fn blocking_failed() -> Error {
    Error::Engine("the weight-update group's task failed (see the server's log)".into())
}

/// `POST /init_weights_update_group`.
pub(crate) async fn init(
    State(s): State<Arc<AppState>>,
    body: std::result::Result<Json<InitGroupRequest>, JsonRejection>,
) -> Response {
    answer(s, body, async |s: &AppState, req: InitGroupRequest| {
        let bad = |field: &str, reason: String| Error::Invalid { field: field.into(), reason };
        if req.backend != "nccl" {
            return Err(bad("backend", format!("`{}` is not served: nccl", req.backend)));
        }
        if req.world_size < 2 || req.rank_offset == 0 || req.rank_offset >= req.world_size {
            let reason = format!("rank {} of {}: the trainer is rank 0, this server 1 to world_size - 1", req.rank_offset, req.world_size);
            return Err(bad("rank_offset", reason));
        }
        if req.group_name.is_empty() || req.group_name.len() > 256 {
            return Err(bad("group_name", "give a name of 1 to 256 bytes".into()));
        }
        if s.groups.joined()?.contains_key(&req.group_name) {
            return Err(Error::Busy(format!("group `{}` is already joined: destroy it first", req.group_name)));
        }
        let r = req.clone();
        let store = tokio::task::spawn_blocking(move || {
            let mut store = TcpStore::connect(&r.master_address, r.master_port, RENDEZVOUS_TIMEOUT)?;
            store.join()?;
            Ok::<_, tlt_comm::Error>(store)
        })
        .await
        .map_err(|_| blocking_failed())?
        .map_err(|e| Error::Engine(e.to_string()))?;
        if let Some(why) = s.groups.no_nccl() {
            // Joined, so the trainer's rendezvous completes; it reads the refusal from this answer.
            return Err(Error::Invalid { field: "backend".into(), reason: why });
        }
        let group = Group {
            store,
            rank: req.rank_offset,
            world_size: req.world_size,
            #[cfg(feature = "cuda")]
            comm: None,
        };
        s.groups.joined()?.insert(req.group_name.clone(), group);
        tracing::info!(group = req.group_name, rank = req.rank_offset, world = req.world_size, "joined a weight-update group");
        Ok(json!({"success": true, "message": format!("joined group `{}` as rank {} of {}", req.group_name, req.rank_offset, req.world_size)}))
    })
    .await
}

/// `POST /destroy_weights_update_group`.
pub(crate) async fn destroy(
    State(s): State<Arc<AppState>>,
    body: std::result::Result<Json<DestroyGroupRequest>, JsonRejection>,
) -> Response {
    answer(s, body, async |s: &AppState, req: DestroyGroupRequest| match s.groups.joined()?.remove(&req.group_name) {
        Some(_) => Ok(json!({"success": true, "message": format!("left group `{}`", req.group_name)})),
        None => Err(Error::Invalid {
            field: "group_name".into(),
            reason: format!("no group `{}` is joined", req.group_name),
        }),
    })
    .await
}

/// `POST /update_weights_from_distributed`: checks the tensors against the served model, receives them (the
/// trainer broadcasts right after posting), then swaps them in between rounds as a disk update does.
pub(crate) async fn update(
    State(s): State<Arc<AppState>>,
    body: std::result::Result<Json<UpdateDistributedRequest>, JsonRejection>,
) -> Response {
    answer(s, body, async |s: &AppState, req: UpdateDistributedRequest| {
        let elems = s.groups.check(&req)?;
        // Taken before the group leaves the map, so that a refused concurrent update cannot drop it.
        let _one = crate::control::OneUpdate::take(&s.stats.updating)?;
        let Some(group) = s.groups.joined()?.remove(&req.group_name) else {
            return Err(Error::Invalid {
                field: "group_name".into(),
                reason: format!("no group `{}` is joined: init it first", req.group_name),
            });
        };
        let ordinal = s.groups.ordinal;
        let r = req.clone();
        let (group, received) = tokio::task::spawn_blocking(move || receive(ordinal, group, &r, &elems))
            .await
            .map_err(|_| blocking_failed())?;
        s.groups.joined()?.insert(req.group_name.clone(), group);
        let tensors = received?;
        let n = tensors.len();
        let weights = crate::worker::Weights::Tensors(tensors);
        let aborted = crate::control::swap_in(s, weights, req.weight_version.clone(), req.abort_all_requests).await?;
        Ok(json!({"success": true, "message": format!("updated {n} tensors from group `{}`", req.group_name),
            "num_paused_requests": aborted, "weight_version": &*s.stats.version()}))
    })
    .await
}
