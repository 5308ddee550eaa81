//! Starting a server: its settings ([`ServeConfig`]), the engine thread, the shared state and the router
//! ([`Server::start`]), and the listening socket ([`bind`]).

use crate::backend::{Backend, CpuBackend};
use crate::{
    api, distributed, drafter, guard, pool, routes, server_info, state, stats, weights, worker, Error, Result,
};

/// A server's settings besides its model.
#[derive(Debug, Clone, Default)]
pub struct ServeConfig {
    /// How the engine thread decodes.
    pub decode: worker::DecodeConfig,
    /// The model's name in answers (its path).
    pub model_name: String,
    /// The weights' version in answers. Default `"default"` (SGLang's).
    pub weight_version: Option<String>,
    /// The model's chat template, for `/v1/chat/completions` (see [`crate::chat::model_template`]); without one, chat
    /// requests are refused.
    pub chat_template: Option<tlt_rl::task::ChatTemplate>,
    /// The API key, the weight roots, the queue, batch and time bounds ([`guard::GuardConfig`]).
    pub guard: guard::GuardConfig,
    /// How the KV pool is sized (on the CPU by [`Server::start`]; a device backend is sized when it is made).
    pub pool: pool::PoolSpec,
}

/// Sets the process's allocator up for the engine thread (glibc only; elsewhere a no-op). Call it first thing in
/// `main`, before other threads start.
///
/// A round allocates and frees buffers of up to hundreds of MiB (a batch's logits: 512 rows x 49,152 tokens x 4
/// bytes is 100 MiB). With glibc's defaults a thread other than the main one gets its own arena, whose heaps are at
/// most 64 MiB and are unmapped when they empty, and anything above the dynamic mmap threshold (at most 32 MiB) is
/// mapped and unmapped per use: the engine thread then faults in and zeroes fresh pages every round (the kernel's
/// `clear_page` was ~8% of the engine thread's samples, against ~1-6% for the same rollout on the main thread). Here
/// every thread shares the main arena, blocks up to 256 MiB come from the heap, and up to 256 MiB of freed memory
/// is kept for the next round (more is returned to the system). Returns whether the settings took.
pub fn tune_allocator() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const MIB: libc::c_int = 1 << 20;
        // SAFETY: mallopt only changes glibc's malloc parameters; it is safe to call at any time.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1) == 1
                && libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * MIB) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 256 * MIB) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Connections the listening socket queues before it refuses more (tokio's default is 1,024: a burst of more
/// simultaneous clients would be reset).
pub const LISTEN_BACKLOG: u32 = 8192;

/// A listener on `host:port` with a [`LISTEN_BACKLOG`]-deep accept queue (the kernel may cap it at `somaxconn`).
///
/// # Errors
/// When the host does not resolve, or binding or listening fails.
pub async fn bind(host: &str, port: u16) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host((host, port)).await? {
        let socket = if a.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        match socket.bind(a).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last
        .unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{host} resolves to nothing"))))
}

/// Room in the engine thread's channel beyond the queued requests, for control messages.
pub const CONTROL_SLOTS: usize = 1024;

/// A running server's parts: the router to serve, and the engine thread, which ends once the router (every clone
/// of its state) is dropped.
pub struct Server {
    /// The HTTP routes.
    pub router: axum::Router,
    /// The engine thread.
    pub engine: std::thread::JoinHandle<()>,
}

impl Server {
    /// Starts the engine thread on `model` on the CPU ([`CpuBackend`], its KV pool sized by `cfg.pool`) and builds
    /// the routes in front of it.
    ///
    /// # Errors
    /// As [`Server::start_on`], and [`Error::Invalid`] for a pool that holds no request.
    pub fn start(model: tlt_model::Llama, tokenizer: Option<tokenizers::Tokenizer>, cfg: ServeConfig) -> Result<Self> {
        let backend = CpuBackend::new(model, &cfg.pool, cfg.decode.max_running)?;
        Self::start_on(backend, tokenizer, cfg)
    }

    /// Starts the engine thread on `backend` and builds the routes in front of it.
    ///
    /// # Errors
    /// [`Error::Invalid`] for invalid settings; [`Error::Model`] when the engine thread cannot start.
    pub fn start_on<B: Backend>(
        backend: B,
        tokenizer: Option<tokenizers::Tokenizer>,
        cfg: ServeConfig,
    ) -> Result<Self> {
        let model = backend.model();
        let c = model.config();
        let pool = backend.pool();
        let limits = api::Limits {
            vocab_size: c.vocab_size,
            context: c.max_position_embeddings,
            pool_tokens: pool.tokens,
            eos: c.eos_token_id.as_ref().map(tlt_model::EosTokens::ids).unwrap_or_default(),
        };
        if cfg.decode.max_running == 0 {
            return Err(Error::Invalid { field: "max_running".into(), reason: "must be at least 1".into() });
        }
        if cfg.guard.max_queued == 0 || cfg.guard.max_batch == 0 {
            let reason = "the queue and batch bounds must be at least 1";
            return Err(Error::Invalid { field: "max_queued".into(), reason: reason.into() });
        }
        cfg.decode.validate()?;
        let weight_roots = weights::WeightRoots::new(&cfg.guard.weights_dirs)?;
        if weight_roots.is_empty() {
            tracing::info!("no --weights-dir: /update_weights_from_disk refuses every path");
        }
        // Bounded: the waiting requests (at most `max_queued`, counted before they are sent) and control messages.
        let (jobs, rx) = std::sync::mpsc::sync_channel(cfg.guard.max_queued.saturating_add(CONTROL_SLOTS));
        let decode = cfg.decode.clone();
        let stats = std::sync::Arc::new(stats::Stats::default());
        *stats.weight_version.write().map_err(|_| Error::Model("the version lock is poisoned".into()))? =
            cfg.weight_version.as_deref().unwrap_or("default").into();
        let bandit = decode.speculate.then(|| decode.decoder()).transpose()?;
        let server_args = server_info::server_args(&server_info::RunningArgs {
            model_path: &cfg.model_name,
            has_tokenizer: tokenizer.is_some(),
            weight_dtype: backend.weight_dtype(),
            context_length: limits.context,
            vocab_size: limits.vocab_size,
            max_running_requests: cfg.decode.max_running.min(pool.sequences),
            pool,
            device: backend.device(),
            dtype: backend.dtype(),
            speculative_algorithm: decode.speculative_algorithm(),
            bandit: bandit.as_ref().map(|d| crate::decode::bandit_arms(d.mab())),
        });
        let groups = distributed::Groups::new(&backend.device(), backend.model());
        let tokenizer = tokenizer.map(std::sync::Arc::new);
        let engine_tokenizer = tokenizer.clone();
        let engine_stats = stats.clone();
        let gpu = backend.device_slots().map(|(gpu, ..)| gpu);
        let eagle = decode
            .eagle
            .as_ref()
            .map(|e| drafter::OnlineDrafter::new(model, e, stats.drafter.clone(), gpu))
            .transpose()?;
        let max_running = cfg.decode.max_running.min(pool.sequences);
        let engine = std::thread::Builder::new()
            .name("tlt-serve-engine".into())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| {
                    worker::run(backend, &rx, &decode, &engine_stats, eagle, engine_tokenizer);
                });
                if let Err(p) = std::panic::catch_unwind(run) {
                    let cause = p
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic without a message".into());
                    tracing::error!(%cause, "the engine thread panicked: every route answers 503 from now on");
                    let _ = engine_stats.engine_failure.set(cause);
                }
            })
            .map_err(|e| Error::Model(format!("starting the engine thread: {e}")))?;
        let state = std::sync::Arc::new(state::AppState {
            msgs: jobs,
            tokenizer,
            limits,
            model_name: cfg.model_name,
            next_id: std::sync::atomic::AtomicU64::new(0),
            next_stream: std::sync::atomic::AtomicU64::new(1),
            stats,
            chat_template: cfg.chat_template,
            max_running,
            server_args,
            weight_roots,
            guard: cfg.guard,
            groups,
        });
        Ok(Self { router: routes::router(state), engine })
    }
}
