//! Where the engine thread decodes: the [`Backend`] seam, with the CPU ([`CpuBackend`], the f32 decoder) and a device
//! behind `tlt_kernels::cuda::Gpu` ([`DeviceBackend`]: `tlt_spec_decode::cuda::CudaTarget`, bf16 weights, its KV
//! cache, CUDA graphs and verification on the device; a CUDA GPU or the simulated device). Each backend sizes its
//! KV pool ([`crate::pool::PoolSpec`]): the tokens and sequences its caches may hold, which the engine thread admits
//! requests against.

use std::sync::Arc;

use tlt_kernels::cuda::SharedGpu;
use tlt_model::Llama;
use tlt_spec_decode::cuda::CudaTarget;
use tlt_spec_decode::Target;

use crate::pool::{Beside, Pool, PoolSpec};
use crate::{Error, Result};

/// A device the engine thread decodes on: the engines' target, the weights it serves and how they change, and its
/// KV pool.
pub trait Backend: Send + 'static {
    /// What an engine is built on: a cheap handle to the shared model.
    type Target: Target + Clone + Send + 'static;
    /// The handle for a new engine.
    fn target(&self) -> Self::Target;
    /// The served model on the host: its configuration, and the embeddings and head the online drafter reads.
    fn model(&self) -> &Llama;
    /// Serves `model`'s weights from now on (same configuration). Called only while no request runs and no engine
    /// holds the old handle.
    ///
    /// # Errors
    /// [`Error::Model`] when the device copy fails.
    fn update(&mut self, model: Llama) -> Result<()>;
    /// The KV pool.
    fn pool(&self) -> Pool;
    /// The device, as `/get_server_info` names it (`cpu`, `cuda:0`, `sim`).
    fn device(&self) -> String;
    /// The KV cache's and activations' element type, as SGLang names it.
    fn dtype(&self) -> &'static str;
    /// The format the forward reads the linear layers in.
    fn weight_dtype(&self) -> tlt_kernels::WeightDType;
    /// The device and its slots' shape (sequences, positions each), for the EAGLE drafter's forward beside the
    /// target's; `None` on the CPU.
    fn device_slots(&self) -> Option<(SharedGpu, usize, usize)> {
        None
    }
}

/// The CPU: `tlt_model::Llama`'s f32 forward; a request's cache grows with its tokens.
#[derive(Debug)]
pub struct CpuBackend {
    model: Arc<Llama>,
    pool: Pool,
}

/// Bytes of KV cache one token takes in `cfg`'s model at `elem` bytes per value (keys and values of every layer).
pub fn kv_bytes_per_token(cfg: &tlt_model::LlamaConfig, elem: usize) -> usize {
    2 * cfg.num_hidden_layers * cfg.kv_dim() * elem
}

impl CpuBackend {
    /// Serves `model` on the CPU with a pool sized by `spec` against the host's memory (`/proc/meminfo`), for at most
    /// `max_running` requests at once.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a pool that holds no full request.
    pub fn new(model: Llama, spec: &PoolSpec, max_running: usize) -> Result<Self> {
        let per_token = kv_bytes_per_token(model.config(), 4);
        let pool = spec.size(max_running, per_token, crate::pool::host_memory(), None)?;
        Ok(Self { model: Arc::new(model), pool })
    }
}

impl Backend for CpuBackend {
    type Target = Arc<Llama>;

    fn target(&self) -> Arc<Llama> {
        self.model.clone()
    }

    fn model(&self) -> &Llama {
        &self.model
    }

    fn update(&mut self, model: Llama) -> Result<()> {
        self.model = Arc::new(model);
        Ok(())
    }

    fn pool(&self) -> Pool {
        self.pool
    }

    fn device(&self) -> String {
        "cpu".into()
    }

    fn dtype(&self) -> &'static str {
        "float32"
    }

    fn weight_dtype(&self) -> tlt_kernels::WeightDType {
        self.model.inference_dtype()
    }
}

/// A device behind the seam: `CudaTarget` (bf16 weights uploaded from the host model, a KV cache of fixed slots, CUDA
/// graphs, verification on the device). Weight updates are written into the device buffers in place.
#[derive(Debug)]
pub struct DeviceBackend {
    /// The host copy: the architecture check, the online drafter's embeddings and head.
    model: Llama,
    target: Arc<CudaTarget>,
    gpu: SharedGpu,
    slot_len: usize,
    pool: Pool,
    name: String,
}

/// Positions of one slot of a device cache for `cfg`'s model: a full context and the largest draft tree's tentative
/// nodes.
pub fn slot_len(cfg: &tlt_model::LlamaConfig) -> usize {
    cfg.max_position_embeddings + tlt_kernels::cuda::MAX_TREE_NODES + 1
}

/// Bytes of device memory the CUDA graphs of decode and verify shapes may hold.
pub const GRAPH_BUDGET: u64 = 1 << 28;

impl DeviceBackend {
    /// Uploads `model` to `gpu` (named `name` in answers) with a KV cache sized by `spec` against the device's memory,
    /// less what `beside` takes (the online drafter's, when it runs there): as many slots of a full context (plus
    /// the largest draft tree) as the pool's tokens hold, at most `max_running`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a pool that holds no full request; [`Error::Model`] when the device fails.
    pub fn new(
        model: Llama,
        gpu: SharedGpu,
        name: &str,
        spec: &PoolSpec,
        max_running: usize,
        beside: Beside,
    ) -> Result<Self> {
        let cfg = model.config();
        let per_token = kv_bytes_per_token(cfg, 2) + beside.per_token;
        let (free, total) = gpu.memory().map_err(|e| Error::Model(format!("{name}: {e}")))?;
        let weights = model.weights().num_params() * 2;
        let reserved = weights as u64 + GRAPH_BUDGET + beside.bytes;
        let slot_len = slot_len(cfg);
        let pool = spec.size(max_running, per_token, crate::pool::Memory { free, total, reserved }, Some(slot_len))?;
        let target = CudaTarget::new(&model, gpu.clone(), pool.sequences, slot_len, GRAPH_BUDGET)
            .map_err(|e| Error::Model(format!("{name}: {e}")))?;
        tracing::info!(device = name, slots = pool.sequences, slot_len, tokens = pool.tokens, "KV pool on the device");
        Ok(Self { model, target: Arc::new(target), gpu, slot_len, pool, name: name.into() })
    }
}

impl Backend for DeviceBackend {
    type Target = Arc<CudaTarget>;

    fn target(&self) -> Arc<CudaTarget> {
        self.target.clone()
    }

    fn model(&self) -> &Llama {
        &self.model
    }

    fn update(&mut self, model: Llama) -> Result<()> {
        self.target.update_weights(&model).map_err(|e| Error::Model(format!("{}: {e}", self.name)))?;
        self.model = model;
        Ok(())
    }

    fn pool(&self) -> Pool {
        self.pool
    }

    fn device(&self) -> String {
        self.name.clone()
    }

    fn dtype(&self) -> &'static str {
        "bfloat16"
    }

    fn weight_dtype(&self) -> tlt_kernels::WeightDType {
        tlt_kernels::WeightDType::Bf16
    }

    fn device_slots(&self) -> Option<(SharedGpu, usize, usize)> {
        Some((self.gpu.clone(), self.pool.sequences, self.slot_len))
    }
}

/// Where `tlt-serve --device` decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU.
    Cpu,
    /// CUDA device `N` (a build with the `cuda` feature).
    Cuda(usize),
    /// The simulated device (`tlt_cuda_sim`: every kernel on the CPU, for CI).
    Sim,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "sim" => Ok(Self::Sim),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("{s:?}: expected cpu, cuda, cuda:N or sim")),
        }
    }
}

impl DeviceChoice {
    /// Opens the device (none for the CPU) and its name in answers.
    ///
    /// # Errors
    /// [`Error::Model`] when the CUDA device cannot be opened (or the build has no CUDA).
    pub fn open(self) -> Result<Option<(SharedGpu, String)>> {
        match self {
            Self::Cpu => Ok(None),
            Self::Sim => Ok(Some((Arc::new(tlt_cuda_sim::SimGpu::new(tlt_cuda_sim::Schedule::Lazy)), "sim".into()))),
            Self::Cuda(n) => {
                let gpu = tlt_kernels::cuda::open_device(n).map_err(|e| Error::Model(format!("cuda:{n}: {e}")))?;
                Ok(Some((gpu, format!("cuda:{n}"))))
            }
        }
    }
}
