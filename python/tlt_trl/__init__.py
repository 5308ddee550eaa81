"""TRL's `GRPOTrainer` (trl 1.16) with tlt-serve as its generation server, the trainer unchanged.

TRL's server mode (`GRPOConfig(use_vllm=True, vllm_mode="server")`) builds a `VLLMClient` in
`trl.generation.vllm_generation.VLLMGeneration._init_vllm` and syncs weights through it on every new step:
`update_named_params(metadata, named_params)` then `reset_prefix_cache()`. TRL's own client needs vLLM installed
and sends the tensors over vLLM's NCCL weight-transfer engine, which needs a CUDA device on the trainer
(`init_communicator` raises `NotImplementedError` on any other device). This module keeps everything else of TRL's
client (its session and retries, `generate` over `/v1/completions`, `parse_logprobs`, `get_server_info`,
`reset_prefix_cache`) and replaces only the weight transport with tlt-serve's SGLang disk update:

- `TltClient.update_named_params` writes the tensors TRL streams (TRL's names, which are the HF checkpoint's) with
  the trainer model's `config.json` and tokenizer into a new directory under the weights directory (written under a
  temporary name, then renamed), posts `/update_weights_from_disk` with it and the step as the weight version, and
  keeps the last two directories;
- `TltClient.init_communicator` checks that the server answers and that a weights directory is set; there is no
  group to join;
- every request carries `Authorization: Bearer <key>` when a key is set (tlt-serve's `--api-key`).

`install(weights_dir=None, api_key=None)` makes TRL's server mode build this client: it wraps
`VLLMGeneration._init_vllm` so that, in server mode only, TRL's `VLLMClient` is this class and TRL's "is vLLM
installed" check passes while TRL builds it (vLLM is not needed in the trainer process with this client), and it
hands the client the trainer's model config and tokenizer for the checkpoints. The weights directory (default: the
environment's `TLT_WEIGHTS_DIR`) must be one the server reads (`tlt-serve --weights-dir`, on a filesystem both
see); the key defaults to `TLT_API_KEY`.

Usage:

    import tlt_trl
    tlt_trl.install(weights_dir="/shared/tlt-weights")
    trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="server",
                          vllm_server_base_url="http://host:30000"), ...)
    trainer.train()
"""

import contextlib
import os
import shutil

KEEP = 2
"""Synced checkpoints kept under the weights directory (the one being served and the one before)."""


class TltClientError(RuntimeError):
    """A weight sync tlt-serve refused, or a client set up without what it needs."""


def _client_class():
    from trl.generation.vllm_client import VLLMClient

    class TltClient(VLLMClient):
        """TRL's `VLLMClient` with the weights synced through tlt-serve's `/update_weights_from_disk`."""

        weights_dir = None
        api_key = None
        hf_config = None
        tokenizer = None

        def __init__(self, base_url=None, host="0.0.0.0", server_port=8000, group_port=51216,
                     connection_timeout=0.0):
            # TRL's `__init__` refuses to run without vLLM installed; everything else it does is kept.
            from trl.generation import vllm_client

            with _patched(vllm_client, "is_vllm_available", lambda *a, **k: True):
                super().__init__(base_url=base_url, host=host, server_port=server_port, group_port=group_port,
                                 connection_timeout=connection_timeout)
            self._step = 0
            self._synced = []

        def __setattr__(self, name, value):
            # TRL's `__init__` builds its session, then checks the server with it: key the session as it is set.
            if name == "session" and self.api_key:
                value.headers["Authorization"] = f"Bearer {self.api_key}"
            super().__setattr__(name, value)

        def init_communicator(self, device=0):
            """Checks the server and the weights directory; nothing to join (no NCCL group on this path)."""
            del device
            if not self.weights_dir:
                raise TltClientError("no weights directory: pass tlt_trl.install(weights_dir=...) or set "
                                     "TLT_WEIGHTS_DIR to a directory the server reads (tlt-serve --weights-dir)")
            os.makedirs(self.weights_dir, exist_ok=True)
            self.get_server_info()

        def update_named_params(self, metadata, named_params):
            """Writes the streamed tensors as a checkpoint and has the server load it (`/update_weights_from_disk`)."""
            from safetensors.torch import save_file

            if self.hf_config is None:
                raise TltClientError("no model config: build the trainer after tlt_trl.install()")
            names = [m[0] for m in metadata]
            tensors = {}
            for name, tensor in named_params:
                tensors[name] = tensor.detach().to("cpu").contiguous().clone()
            if list(tensors) != names:
                raise TltClientError(f"streamed tensors {list(tensors)[:4]}... differ from the announced {names[:4]}...")
            self._step += 1
            final = os.path.join(self.weights_dir, f"trl-sync-{os.getpid()}-{self._step}")
            tmp = final + ".partial"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            self.hf_config.to_json_file(os.path.join(tmp, "config.json"))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            version = str(self._step)
            answer = self._post(f"{self.base_url}/update_weights_from_disk",
                                json={"model_path": final, "weight_version": version})
            if not answer.get("success", False):
                raise TltClientError(f"tlt-serve refused the weights: {answer.get('message', answer)}")
            self._synced.append(final)
            while len(self._synced) > KEEP:
                shutil.rmtree(self._synced.pop(0), ignore_errors=True)

        def close_communicator(self):
            """Nothing to close."""

    return TltClient


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def install(weights_dir=None, api_key=None):
    """Makes TRL's server mode use tlt-serve's weight sync (see the module's documentation); returns the client
    class. Call before building the trainer."""
    from trl.generation import vllm_generation

    client = _client_class()
    client.weights_dir = weights_dir or os.environ.get("TLT_WEIGHTS_DIR")
    client.api_key = api_key or os.environ.get("TLT_API_KEY")
    cls = vllm_generation.VLLMGeneration
    original = getattr(cls, "_tlt_original_init_vllm", cls._init_vllm)

    def _init_vllm(self):
        if self.mode != "server":
            return original(self)
        with _patched(vllm_generation, "VLLMClient", client), \
                _patched(vllm_generation, "is_vllm_available", lambda *a, **k: True):
            client.hf_config = getattr(self.model, "config", None)
            client.tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
            return original(self)

    cls._tlt_original_init_vllm = original
    cls._init_vllm = _init_vllm
    return client


def synced_dirs(client):
    """The checkpoint directories `client` has synced and kept, oldest first (for tests and clean-up)."""
    return list(client._synced)


__all__ = ["install", "TltClientError", "KEEP", "synced_dirs"]
