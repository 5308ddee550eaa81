//! SGLang's weight sync from the trainer's GPUs, slime's default transport: `/init_weights_update_group` joins the
//! trainer's torch group (torch's `TCPStore` at `master_address:master_port`, as rank `rank_offset` of
//! `world_size`; `tlt_comm::store`), `/update_weights_from_distributed` takes the tensors the trainer's rank 0 then
//! broadcasts over NCCL (one `dist.broadcast` per tensor, in the order of `names`) and swaps them in as a disk update
//! does, `/destroy_weights_update_group` leaves the group.
//!
//! The communicator is opened at the first update, as torch's NCCL group opens it at its first collective: the id
//! is read at the key `ProcessGroupNCCL` sets (`tlt_comm::store::nccl_id_key`), and the tensors arrive on the
//! server's CUDA device (`tlt_comm::nccl::NcclComm::broadcast_to_host`: received on the device, read to the host and
//! laid over the served weights; a bucket of names is a partial update, as slime sends them). On a server without a
//! CUDA device (the CPU, the simulated device) the init still joins the rendezvous, so the trainer's own init
//! returns rather than waiting out its timeout, and then answers why the group cannot be served. The routes are in
//! `crate::sync_routes`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use candle_core::Tensor;
use serde::Deserialize;
use tlt_comm::store::TcpStore;
use tlt_comm::Elem;
use tlt_model::Llama;

use crate::{Error, Result};

/// How long the rendezvous and each key wait for the trainer.
pub(crate) const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(120);

/// Most tensors one update names (a 70B Llama has under 1,000).
const MAX_TENSORS: usize = 16_384;

fn default_group() -> String {
    "weight_update_group".into()
}

fn default_backend() -> String {
    "nccl".into()
}

/// SGLang's `POST /init_weights_update_group` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitGroupRequest {
    /// The host of the trainer's rank 0 (its TCPStore).
    pub master_address: String,
    /// Its port.
    pub master_port: u16,
    /// This server's rank in the group.
    pub rank_offset: usize,
    /// Ranks in the group (the trainer's rank 0 and every engine's).
    pub world_size: usize,
    /// The group's name (its keys' prefix in the store).
    #[serde(default = "default_group")]
    pub group_name: String,
    /// `nccl` (the only one served).
    #[serde(default = "default_backend")]
    pub backend: String,
}

/// SGLang's `POST /update_weights_from_distributed` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateDistributedRequest {
    /// The tensors' HF names, in the order the trainer broadcasts them.
    pub names: Vec<String>,
    /// Their element types (`bfloat16`, `float16`, `float32`, with or without `torch.`).
    pub dtypes: Vec<String>,
    /// Their shapes.
    pub shapes: Vec<Vec<usize>>,
    /// The group they come over.
    #[serde(default = "default_group")]
    pub group_name: String,
    /// Accepted (nothing is cached across requests).
    #[serde(default)]
    pub flush_cache: Option<bool>,
    /// End the running requests now instead of letting them finish on the old weights.
    #[serde(default)]
    pub abort_all_requests: bool,
    /// The new weights' version; absent: the version stays.
    #[serde(default)]
    pub weight_version: Option<String>,
    /// Absent or null (the tensors arrive as they are).
    #[serde(default)]
    pub load_format: Option<String>,
}

/// SGLang's `POST /destroy_weights_update_group` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DestroyGroupRequest {
    /// The group to leave.
    #[serde(default = "default_group")]
    pub group_name: String,
}

/// One group this server has joined (without the `cuda` feature, joined only to refuse).
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Group {
    pub(crate) store: TcpStore,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    #[cfg(feature = "cuda")]
    pub(crate) comm: Option<tlt_comm::nccl::NcclComm>,
}

/// The weight-update groups, and what an update may name.
#[derive(Debug)]
pub struct Groups {
    /// The CUDA device the server decodes on (`None`: the CPU or the simulated device, no NCCL).
    pub(crate) ordinal: Option<usize>,
    /// Where the server decodes, as `/get_server_info` names it.
    device: String,
    /// Every parameter of the served model and its shape.
    shapes: HashMap<String, Vec<usize>>,
    joined: Mutex<HashMap<String, Group>>,
}

impl Groups {
    /// No group yet, for a server decoding `model` on `device` (`cpu`, `sim`, `cuda:N`).
    #[must_use]
    pub fn new(device: &str, model: &Llama) -> Self {
        let shapes = model.weights().named_tensors().into_iter().map(|(n, t)| (n, t.dims().to_vec())).collect();
        let ordinal = device.strip_prefix("cuda:").and_then(|n| n.parse().ok());
        Self { ordinal, device: device.into(), shapes, joined: Mutex::new(HashMap::new()) }
    }

    pub(crate) fn joined(&self) -> Result<std::sync::MutexGuard<'_, HashMap<String, Group>>> {
        self.joined.lock().map_err(|_| Error::Engine("the weight-update groups' lock is poisoned".into()))
    }

    /// Why this server cannot receive over NCCL, if it cannot.
    pub(crate) fn no_nccl(&self) -> Option<String> {
        let why = match self.ordinal {
            None => format!("this server decodes on `{}`", self.device),
            #[cfg(feature = "cuda")]
            Some(_) if !tlt_comm::nccl::available() => "NCCL (libnccl.so) does not load here".into(),
            Some(_) => return None,
        };
        Some(format!(
            "weight sync over NCCL needs a CUDA device and NCCL, and {why}: serve with --device cuda:N, or update \
             with /update_weights_from_disk"
        ))
    }

    /// Checks an update's tensors against the served model before anything is received.
    pub(crate) fn check(&self, req: &UpdateDistributedRequest) -> Result<Vec<Elem>> {
        let bad = |field: &str, reason: String| Error::Invalid { field: field.into(), reason };
        if req.names.is_empty() || req.names.len() > MAX_TENSORS {
            return Err(bad("names", format!("give 1 to {MAX_TENSORS} tensors")));
        }
        if req.dtypes.len() != req.names.len() || req.shapes.len() != req.names.len() {
            return Err(bad("names", "names, dtypes and shapes differ in length".into()));
        }
        if let Some(f) = req.load_format.as_deref() {
            return Err(bad("load_format", format!("`{f}` is not served: leave it out (tensors as they are)")));
        }
        let mut elems = Vec::with_capacity(req.names.len());
        for ((name, dtype), shape) in req.names.iter().zip(&req.dtypes).zip(&req.shapes) {
            let Some(served) = self.shapes.get(name) else {
                return Err(bad("names", format!("`{name}` is not a parameter of the served model")));
            };
            if served != shape {
                return Err(bad("shapes", format!("`{name}` is {served:?} in the served model, not {shape:?}")));
            }
            elems.push(
                Elem::from_torch(dtype)
                    .ok_or_else(|| bad("dtypes", format!("`{dtype}` is not served: bfloat16, float16 or float32")))?,
            );
        }
        Ok(elems)
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// `bytes` of a tensor of `elem` (little-endian, as the device holds them) as an f32 tensor of `shape`.
fn tensor(elem: Elem, bytes: &[u8], shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    if bytes.len() != n * elem.bytes() {
        return Err(Error::Model(format!("received {} bytes for a tensor of {n} elements", bytes.len())));
    }
    let values: Vec<f32> = match elem {
        Elem::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Elem::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Elem::Bf16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
    };
    Tensor::from_vec(values, shape, &candle_core::Device::Cpu).map_err(|e| Error::Model(e.to_string()))
}

/// The served weights with `tensors` laid over them (by HF name; the others stay), checked as a checkpoint is.
///
/// # Errors
/// [`Error::Model`] when a tensor does not fit the model.
pub fn overlay(model: &Llama, tensors: Vec<(String, Tensor)>) -> Result<Llama> {
    struct Over {
        new: HashMap<String, Tensor>,
        old: HashMap<String, Tensor>,
        path: std::path::PathBuf,
    }
    impl tlt_model::TensorSource for Over {
        fn path(&self) -> &std::path::Path {
            &self.path
        }
        fn get(&mut self, name: &str) -> tlt_model::Result<Option<Tensor>> {
            Ok(self.new.remove(name).or_else(|| self.old.get(name).cloned()))
        }
    }
    let old = model.weights().named_tensors().into_iter().collect();
    let mut src = Over { new: tensors.into_iter().collect(), old, path: "update_weights_from_distributed".into() };
    let cfg = model.config().clone();
    let weights = tlt_model::LlamaWeights::load(&cfg, &mut src).map_err(|e| Error::Model(e.to_string()))?;
    Llama::new(cfg, weights).map_err(|e| Error::Model(e.to_string()))
}

/// Receives `req`'s tensors over `group` (opening its communicator first, at the first update).
pub(crate) fn receive(
    ordinal: Option<usize>,
    group: Group,
    req: &UpdateDistributedRequest,
    elems: &[Elem],
) -> (Group, Result<Vec<(String, Tensor)>>) {
    #[cfg(feature = "cuda")]
    {
        let mut group = group;
        let out = receive_nccl(ordinal, &mut group, &req.group_name, req, elems);
        (group, out)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, req, elems);
        (group, Err(Error::Model("this build has no CUDA: weight sync over NCCL is not served".into())))
    }
}

#[cfg(feature = "cuda")]
fn receive_nccl(
    ordinal: Option<usize>,
    group: &mut Group,
    name: &str,
    req: &UpdateDistributedRequest,
    elems: &[Elem],
) -> Result<Vec<(String, Tensor)>> {
    use tlt_comm::nccl::NcclComm;
    let comm_err = |e: tlt_comm::Error| Error::Engine(format!("weight-update group `{name}`: {e}"));
    if group.comm.is_none() {
        let ordinal = ordinal.ok_or_else(|| Error::Engine("no CUDA device".into()))?;
        let id = group.store.get(&tlt_comm::store::nccl_id_key(name, 0)).map_err(comm_err)?;
        let gpu = tlt_kernels::cuda::CudaGpu::open(ordinal).map_err(|e| Error::Engine(e.to_string()))?;
        group.comm = Some(NcclComm::with_id(gpu, group.rank, group.world_size, &id).map_err(comm_err)?);
    }
    let comm = group.comm.as_ref().ok_or_else(|| Error::Engine("no communicator".into()))?;
    let mut out = Vec::with_capacity(req.names.len());
    for ((name, shape), &elem) in req.names.iter().zip(&req.shapes).zip(elems) {
        let bytes = comm.broadcast_to_host(0, elem, shape.iter().product()).map_err(comm_err)?;
        out.push((name.clone(), tensor(elem, &bytes, shape)?));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_bytes_read_as_torch_lays_them_out() {
        let v = [1.5f32, -2.25, 3.0];
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let t = tensor(Elem::F32, &bytes, &[3]).unwrap();
        assert_eq!(t.to_vec1::<f32>().unwrap(), v);
        let bytes: Vec<u8> = v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
        assert_eq!(tensor(Elem::Bf16, &bytes, &[1, 3]).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), v);
        assert!(tensor(Elem::F16, &bytes[..4], &[3]).is_err(), "a short tensor is an error");
        assert_eq!(Elem::from_torch("torch.bfloat16"), Some(Elem::Bf16));
        assert_eq!(Elem::from_torch("int8"), None);
    }
}
