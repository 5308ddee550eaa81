"""verl's token-in-token-out rollout server contract, served by an external tlt-serve (or SGLang) over HTTP.

verl's agent loop does not talk HTTP to its rollout servers: `AsyncLLMServerManager.generate` calls a Ray actor,
`server.generate.remote(request_id=..., prompt_ids=..., sampling_params=..., image_data=..., video_data=...)`, and
reads a `TokenOutput`. This module is such a server object, `TltServeServer`, whose methods turn those calls into
SGLang's native HTTP API (which tlt-serve serves), plus `TltServeReplica`, a rollout replica for a server launched
outside verl (its address given), and `verl_replica_class()` / `register_with_verl()`, the same replica as a subclass
of verl's `RolloutReplica` for verl's replica registry (only where verl is importable).

The interface shapes come from volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29);
no verl code is copied here:
- `verl/workers/rollout/replica.py`: `TokenOutput(BaseModel)` with `token_ids: list[int]`,
  `log_probs: Optional[list[float]]`, `routed_experts`, `stop_reason: Optional[str]` ("'completed', 'aborted', or
  None for unknown") and `num_preempted: Optional[int]`; `RolloutMode` (HYBRID, COLOCATED, STANDALONE);
  `RolloutReplica(replica_rank, config, model_config, gpus_per_node=8, is_reward_model=False)` with
  `init_hybrid(worker_group)`, `init_hybrid_colocated(worker_group, resource_pool)`, `init_colocated(resource_pool)`,
  `init_standalone()`, abstract `get_ray_class_with_init_args()` and `launch_servers()`, the properties
  `server_address` / `server_handle`, and `wake_up`, `sleep`, `abort_all_requests`, `resume_all_requests`,
  `clear_kv_cache`, `start_profile(**kwargs)`, `stop_profile` (each awaiting the same method on its server actors);
  `RolloutReplicaRegistry.register(name, loader)` / `.get(name)`, where `loader()` returns the replica class.
- `verl/workers/rollout/sglang_rollout/async_sglang_server.py`: `SGLangHttpServer.generate(self, prompt_ids,
  sampling_params, request_id, image_data=None, video_data=None) -> TokenOutput`: `max_new_tokens`, else vLLM's
  `max_tokens`, else `response_length + prompt_length - len(prompt_ids)`, clamped to `max_model_len -
  len(prompt_ids)` (a prompt longer than that is a ValueError); `logprobs` popped into `return_logprob`; the rest of
  the dict sent as SGLang's `sampling_params` with `rid` = `request_id`; tokens and log-probs read from
  `meta_info.output_token_logprobs` (`[logprob, token_id, _]`), else `output_ids`. `wake_up` / `sleep` skip in
  standalone mode ("skip wake_up in standalone mode"); `clear_kv_cache` releases the KV cache.
- `verl/workers/rollout/vllm_rollout/vllm_async_server.py`: `generate(..., priority=0)` sets
  `stop_reason` from the finish reason: "abort" -> "aborted", "stop" or "length" -> "completed", else the reason
  itself (verl's SGLang server at that commit leaves `stop_reason` None); `abort_all_requests() -> {"aborted_count",
  "request_ids"}`, `abort_request(request_id) -> {"aborted", "request_id"}`.
- `verl/experimental/agent_loop/agent_loop.py`: the sampling parameters the agent loop sends,
  `dict(temperature, top_p, top_k, repetition_penalty=1.0, logprobs=calculate_log_probs)` (`val_kwargs` for
  validation), and `AsyncLLMServerManager.generate` above (a new uuid4 request id per turn).

What is translated for SGLang's `/generate`: `max_tokens` -> `max_new_tokens` (and the clamp above, with the
server's `context_length` from `/get_server_info` when `max_model_len` is not given); `logprobs` -> the top-level
`return_logprob`; `top_k` of 0 or below -> left out (SGLang's "off"); `seed` -> `sampling_seed`; keys whose value is
None -> left out; anything else is sent as it is (tlt-serve refuses, by name, what it does not serve, e.g.
`repetition_penalty` other than 1). `TokenOutput.num_preempted` is SGLang's `meta_info.num_retractions` when the
server sends it; `extra_fields` carries `weight_version` and the raw finish reason (verl versions whose `TokenOutput`
lacks that field drop it: pydantic ignores unknown fields).

Not served here: `image_data` / `video_data` (a NotImplementedError: tlt-serve serves text models), routed experts,
and verl's own weight synchronization (`CheckpointEngineManager` pushes tensors to the rollout workers over
NCCL/CUDA IPC); save the policy and call `update_weights_from_disk` instead. `wake_up` and `sleep` are no-ops (an
external server keeps its memory, as verl's servers do in standalone mode); profiling calls are no-ops.

Using it from verl (`scripts/check_verl_adapter.py` checks the HTTP contract, and the registry path in verl 0.9.1
itself: `LLMServerManager.create` in standalone mode on a local Ray, its load balancer and `LLMServerClient.generate`;
against stand-ins shaped as above where verl does not import). Put this directory's parent (`python/`) on `PYTHONPATH` of
every Ray node, give the server addresses in the rollout config's extension dict and register the replica before
verl builds its `AgentLoopManager`, in the same process:

    import tlt_verl; tlt_verl.register_with_verl()      # RolloutReplicaRegistry.register("tlt-serve", ...)

    actor_rollout_ref.rollout.name=tlt-serve
    +actor_rollout_ref.rollout.custom.tlt_serve_addresses='["10.0.0.5:30000"]'   # one per replica rank

(`custom` is `RolloutConfig`'s extension dict, absent from verl's YAML, hence the `+`; or
`TLT_SERVE_ADDRESSES=10.0.0.5:30000,...` in the environment of the process that builds the replicas). verl's hybrid
workers also look `rollout.name` up in a second table (`verl/workers/rollout/base.py`, `get_rollout_class`), which
this module does not extend.

Without verl, the classes are plain asyncio clients:

    server = TltServeServer("127.0.0.1:30000")
    out = await server.generate([1, 2, 3], {"temperature": 1.0, "max_tokens": 64, "logprobs": True}, "req-1")
    out.token_ids, out.log_probs, out.stop_reason

HTTP goes through aiohttp (what verl's own SGLang HTTP client, `http_server_engine.py`, uses).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

__all__ = [
    "TokenOutput",
    "TltServeError",
    "TltServeServer",
    "TltServeReplica",
    "to_sglang_request",
    "token_output",
    "verl_replica_class",
    "register_with_verl",
]

# SGLang's `meta_info.finish_reason.type` -> verl's `TokenOutput.stop_reason` (as verl's vLLM server maps vLLM's).
STOP_REASONS = {"abort": "aborted", "stop": "completed", "length": "completed"}


@dataclass
class TokenOutput:
    """verl's `TokenOutput`, for when verl is not importable (same field names)."""

    token_ids: list[int]
    log_probs: Optional[list[float]] = None
    routed_experts: Optional[Any] = None
    stop_reason: Optional[str] = None
    num_preempted: Optional[int] = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


_VERL_IMPORT_TRIED = False


def _token_output_cls():
    """verl's `TokenOutput` when `verl.workers.rollout.replica` imports (tried once), else this module's."""
    global _VERL_IMPORT_TRIED
    mod = sys.modules.get("verl.workers.rollout.replica")
    if mod is None and not _VERL_IMPORT_TRIED:
        _VERL_IMPORT_TRIED = True
        try:
            import verl.workers.rollout.replica as mod  # noqa: F811
        except ImportError:
            mod = None
    return getattr(mod, "TokenOutput", TokenOutput) if mod is not None else TokenOutput


class TltServeError(RuntimeError):
    """An answer other than 200 (or one that does not parse as SGLang's)."""

    def __init__(self, message: str, status: Optional[int] = None, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


def _id_list(prompt_ids) -> list[int]:
    if hasattr(prompt_ids, "tolist"):  # a tensor or an array
        prompt_ids = prompt_ids.tolist()
    return [int(t) for t in prompt_ids]


def to_sglang_request(
    prompt_ids,
    sampling_params: dict[str, Any],
    request_id: str,
    max_model_len: Optional[int] = None,
    default_max_new_tokens: Optional[int] = None,
) -> dict[str, Any]:
    """The body of SGLang's `POST /generate` for verl's `generate(prompt_ids, sampling_params, request_id)`.

    `sampling_params` is not changed (verl's servers pop from theirs; a Ray call hands them a copy)."""
    ids = _id_list(prompt_ids)
    params = {k: v for k, v in dict(sampling_params).items() if v is not None}
    if "max_new_tokens" in params:
        max_new = params.pop("max_new_tokens")
        params.pop("max_tokens", None)
    else:
        max_new = params.pop("max_tokens", default_max_new_tokens)
    if max_model_len is not None:
        possible = max_model_len - len(ids)
        if possible < 0:
            raise ValueError(
                f"Prompt length ({len(ids)}) exceeds the model's maximum context length ({max_model_len})."
            )
        max_new = possible if max_new is None else max(0, min(int(max_new), possible))
    if max_new is not None:
        params["max_new_tokens"] = int(max_new)
    return_logprob = bool(params.pop("logprobs", False))
    if "top_k" in params and int(params["top_k"]) <= 0:
        del params["top_k"]
    if "seed" in params:
        params["sampling_seed"] = params.pop("seed")
    return {"rid": request_id, "input_ids": ids, "sampling_params": params, "return_logprob": return_logprob}


def token_output(answer: dict[str, Any], return_logprob: bool):
    """verl's `TokenOutput` of one SGLang `/generate` answer."""
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        raise TltServeError(f"not an SGLang /generate answer: {answer!r:.300}", body=answer)
    meta = answer["meta_info"]
    if return_logprob:
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise TltServeError("return_logprob was sent but meta_info has no output_token_logprobs", body=answer)
        token_ids = [int(e[1]) for e in entries]
        log_probs = [float(e[0]) for e in entries]
        if "output_ids" in answer and [int(t) for t in answer["output_ids"]] != token_ids:
            raise TltServeError("output_ids differ from the tokens of output_token_logprobs", body=answer)
    else:
        token_ids = [int(t) for t in answer["output_ids"]]
        log_probs = None
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    return _token_output_cls()(
        token_ids=token_ids,
        log_probs=log_probs,
        stop_reason=STOP_REASONS.get(kind, kind),
        num_preempted=meta.get("num_retractions"),
        extra_fields={"weight_version": meta.get("weight_version"), "finish_reason": kind},
    )


_UNKNOWN = object()


class TltServeServer:
    """verl's rollout server contract (`SGLangHttpServer` / `vLLMHttpServer`'s methods) for a server at `address`.

    `address`: `host:port` or a URL (`http://host:port`). `max_model_len`: the context length the clamp of
    `max_new_tokens` uses; None: the server's `context_length` from `/get_server_info`, if it answers one.
    `prompt_length` and `response_length`: verl's defaults for a request without `max_tokens`/`max_new_tokens`
    (else the server's default). `timeout`: seconds for one request in all (None: no limit; rollouts can be long).
    `max_connections`: aiohttp's connection limit (0: none; verl sends a whole batch at once). `api_key`: sent as
    `Authorization: Bearer <key>` on every request (tlt-serve's and SGLang's `--api-key`); None: the environment's
    `TLT_API_KEY` (how a key reaches servers verl builds in its Ray actors); empty: none.

    Usable directly (`await server.generate(...)`) or as a Ray actor (`ray.remote(TltServeServer)`), as verl uses
    its servers. One aiohttp session per event loop."""

    def __init__(
        self,
        address: str,
        *,
        max_model_len: Optional[int] = None,
        prompt_length: Optional[int] = None,
        response_length: Optional[int] = None,
        timeout: Optional[float] = None,
        max_connections: int = 0,
        api_key: Optional[str] = None,
    ):
        address = address.rstrip("/")
        self.base_url = address if "://" in address else f"http://{address}"
        self.address = self.base_url.split("://", 1)[1]
        self._max_model_len = _UNKNOWN if max_model_len is None else max_model_len
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.timeout = timeout
        self.max_connections = max_connections
        self.api_key = os.environ.get("TLT_API_KEY", "") if api_key is None else api_key
        self._session: Optional[aiohttp.ClientSession] = None
        self._session_loop = None
        self._inflight: set[str] = set()

    # --- HTTP ---

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=30),
                headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None,
            )
            self._session_loop = loop
        return self._session

    async def close(self):
        """Closes this event loop's session."""
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    async def _request(self, method: str, path: str, body: Any = None, ok=(200,)) -> tuple[int, Any]:
        """(status, JSON answer, or text when it is not JSON, or None when empty); a status not in `ok` raises."""
        async with self._client().request(method, self.base_url + path, json=body) as r:
            text = await r.text()
            status = r.status
        try:
            answer = json.loads(text) if text.strip() else None
        except ValueError:
            answer = text
        if status not in ok:
            message = answer.get("error", answer) if isinstance(answer, dict) else answer
            if isinstance(message, dict):
                message = message.get("message", message)
            raise TltServeError(f"{method} {path}: {status} {message}", status=status, body=answer)
        return status, answer

    # --- verl's server methods ---

    async def max_model_len(self) -> Optional[int]:
        """The context length: as given, else the server's `/get_server_info` `context_length` (None without)."""
        if self._max_model_len is _UNKNOWN:
            status, info = await self._request("GET", "/get_server_info", ok=(200, 404))
            n = info.get("context_length") if status == 200 and isinstance(info, dict) else None
            self._max_model_len = n if isinstance(n, int) else None
        return self._max_model_len

    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str, image_data=None,
                       video_data=None):
        """verl's `generate`: one `POST /generate`; a `TokenOutput` (see the module docstring)."""
        if image_data or video_data:
            raise NotImplementedError("tlt-serve serves text models: image_data and video_data are not sent")
        default = None
        if self.response_length is not None and self.prompt_length is not None:
            default = self.response_length + self.prompt_length - len(_id_list(prompt_ids))
        body = to_sglang_request(prompt_ids, sampling_params, request_id, await self.max_model_len(), default)
        self._inflight.add(request_id)
        try:
            _, answer = await self._request("POST", "/generate", body)
        finally:
            self._inflight.discard(request_id)
        return token_output(answer, body["return_logprob"])

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """`POST /abort_request` with `rid`: the request ends, its `generate` answering `stop_reason` "aborted"
        with what it had generated. vLLM server's answer shape: `{"aborted", "request_id"}`."""
        known = request_id in self._inflight
        _, answer = await self._request("POST", "/abort_request", {"rid": request_id})
        n = answer.get("num_aborted_requests") if isinstance(answer, dict) else None  # tlt-serve's; SGLang: empty
        return {"aborted": bool(n) if n is not None else known, "request_id": request_id, "num_aborted_requests": n}

    async def abort_all_requests(self) -> dict[str, Any]:
        """`POST /abort_request` with `abort_all` (every request on the server, this client's or not).
        `{"aborted_count", "request_ids"}`: the server's count when it answers one, else the number of this
        client's requests in flight; the ids are this client's requests in flight."""
        ids = sorted(self._inflight)
        _, answer = await self._request("POST", "/abort_request", {"abort_all": True})
        n = answer.get("num_aborted_requests") if isinstance(answer, dict) else None
        return {"aborted_count": n if n is not None else len(ids), "request_ids": ids}

    async def clear_kv_cache(self) -> bool:
        """`POST /flush_cache`: True when flushed; False when the server refused because requests run (SGLang's
        400; tlt-serve keeps no cache across requests, so there is nothing to lose)."""
        status, _ = await self._request("POST", "/flush_cache", ok=(200, 400))
        return status == 200

    async def wake_up(self):
        """A no-op: the external server keeps its weights and memory (verl's servers skip it in standalone mode)."""

    async def sleep(self):
        """A no-op (see `wake_up`)."""

    async def start_profile(self, **kwargs):
        """A no-op: the server is not profiled through verl."""

    async def stop_profile(self):
        """A no-op."""

    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                       abort_all_requests: bool = False) -> dict[str, Any]:
        """`POST /update_weights_from_disk`: the server loads the checkpoint at `model_path` (a path on the server's
        machine) and serves it from then on, tagged `weight_version`; its answer (`success`, `message`,
        `num_paused_requests`). Raises unless it succeeded."""
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        _, answer = await self._request("POST", "/update_weights_from_disk", body)
        if not isinstance(answer, dict) or answer.get("success") is False:
            raise TltServeError(f"update_weights_from_disk did not succeed: {answer!r}", body=answer)
        return answer

    async def get_weight_version(self) -> Optional[str]:
        """`GET /get_weight_version`."""
        _, answer = await self._request("GET", "/get_weight_version")
        return answer.get("weight_version") if isinstance(answer, dict) else None

    async def health(self) -> bool:
        """`GET /health` answered 200."""
        try:
            await self._request("GET", "/health")
            return True
        except (TltServeError, aiohttp.ClientError, OSError):
            return False

    def get_server_address(self) -> tuple[str, int]:
        """(host, port), as verl's servers answer it."""
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)


class _ReplicaMethods:
    """A replica's methods, each calling its one server (`self._call(name, ...)`)."""

    async def wake_up(self):
        await self._call("wake_up")

    async def sleep(self):
        await self._call("sleep")

    async def clear_kv_cache(self):
        return await self._call("clear_kv_cache")

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """Ends every running request (`reject_request` is accepted: requests sent while none runs are served)."""
        return await self._call("abort_all_requests")

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        return await self._call("abort_request", request_id)

    async def resume_generation(self):
        """A no-op: aborted requests have answered with what they had, and new ones are served."""

    resume_all_requests = resume_generation  # verl before 0.9's name

    async def release_kv_cache(self):
        """A no-op: the external server keeps its memory."""

    async def resume_kv_cache(self):
        """A no-op: the external server keeps its memory."""

    async def start_profile(self, **kwargs):
        await self._call("start_profile", **kwargs)

    async def stop_profile(self):
        await self._call("stop_profile")

    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                       abort_all_requests: bool = False) -> dict[str, Any]:
        return await self._call("update_weights_from_disk", model_path, weight_version, abort_all_requests)

    async def get_weight_version(self) -> Optional[str]:
        return await self._call("get_weight_version")


class TltServeReplica(_ReplicaMethods):
    """`RolloutReplica`'s role for a server launched outside verl: one server at `address`; `server_handle` is the
    in-process `TltServeServer` (verl's is a Ray actor: see `verl_replica_class`), `server_address` is
    `host:port`. `client_kwargs` go to `TltServeServer`."""

    def __init__(self, address: str, replica_rank: int = 0, **client_kwargs):
        self.replica_rank = replica_rank
        self._server_handle = TltServeServer(address, **client_kwargs)
        self._server_address = self._server_handle.address
        self.servers = [self._server_handle]

    @property
    def server_address(self) -> str:
        return self._server_address

    @property
    def server_handle(self) -> TltServeServer:
        return self._server_handle

    async def _call(self, name: str, *args, **kwargs):
        return await getattr(self._server_handle, name)(*args, **kwargs)


def addresses_from(config) -> list[str]:
    """The servers' addresses: the rollout config's `custom.tlt_serve_addresses` (a list, or a comma-separated
    string), else `$TLT_SERVE_ADDRESSES`."""
    custom = getattr(config, "custom", None) if not isinstance(config, dict) else config.get("custom")
    addrs = None
    if custom is not None:
        addrs = custom.get("tlt_serve_addresses") if hasattr(custom, "get") else None
    if addrs is None:
        addrs = os.environ.get("TLT_SERVE_ADDRESSES")
    if isinstance(addrs, str):
        addrs = [a.strip() for a in addrs.split(",") if a.strip()]
    if not addrs:
        raise ValueError("no tlt-serve address: set actor_rollout_ref.rollout.custom.tlt_serve_addresses "
                         "or TLT_SERVE_ADDRESSES")
    return list(addrs)


_VERL_REPLICA = None


def verl_replica_class():
    """`TltServeReplica` as a subclass of verl's `RolloutReplica` (the loader verl's registry takes). Its server is
    a Ray actor of `TltServeServer` for the address of its `replica_rank` (`addresses_from(config)`); every
    `init_*` launches nothing and takes no GPU, workers or resource pool."""
    global _VERL_REPLICA
    if _VERL_REPLICA is not None:
        return _VERL_REPLICA
    import ray
    from verl.workers.rollout.replica import RolloutMode, RolloutReplica

    class TltServeVerlReplica(_ReplicaMethods, RolloutReplica):
        def __init__(self, replica_rank, config, model_config, gpus_per_node=8, is_reward_model=False, **kwargs):
            super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, **kwargs)
            addrs = addresses_from(self.config)
            if replica_rank >= len(addrs):
                raise ValueError(f"replica {replica_rank} has no tlt-serve address ({len(addrs)} given: {addrs})")
            self._tlt_address = addrs[replica_rank]

        def get_ray_class_with_init_args(self):
            raise NotImplementedError("tlt-serve runs outside verl: its replica has no rollout workers")

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def init_hybrid(self, worker_group):
            self.rollout_mode = RolloutMode.STANDALONE
            await self.launch_servers()

        async def init_hybrid_colocated(self, worker_group, resource_pool):
            await self.init_hybrid(worker_group)

        async def init_colocated(self, resource_pool):
            await self.init_hybrid(None)

        async def init_standalone(self):
            await self.init_hybrid(None)

        async def launch_servers(self):
            cfg = self.config
            server = ray.remote(TltServeServer).remote(
                self._tlt_address,
                max_model_len=getattr(cfg, "max_model_len", None),
                prompt_length=getattr(cfg, "prompt_length", None),
                response_length=getattr(cfg, "response_length", None),
            )
            self.servers = [server]
            self._server_handle = server
            self._server_address = self._tlt_address.split("://", 1)[-1]

        async def _call(self, name: str, *args, **kwargs):
            return await getattr(self._server_handle, name).remote(*args, **kwargs)

    _VERL_REPLICA = TltServeVerlReplica
    return _VERL_REPLICA


def register_with_verl(name: str = "tlt-serve") -> None:
    """`RolloutReplicaRegistry.register(name, verl_replica_class)`; an ImportError without verl."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(name, verl_replica_class)
