"""TRL's own vLLM client code (trl==1.16.0, `trl/generation/vllm_client.py`) against tlt-serve.

Usage: python3 check_trl_client.py BASE_URL PROMPT_IDS_JSON

TRL's `VLLMClient` talks to `vllm serve` over HTTP; this runs its request and parsing code unchanged against
tlt-serve: `check_server` (GET /health), `get_world_size` (GET /get_world_size), the model id from GET /v1/models,
`get_server_info` (GET /server_info: `model_config.logprobs_mode`, which `GRPOTrainer` checks, and
`weight_transfer_config`, null, so `init_communicator` refuses with TRL's own message),
`generate` (POST /v1/completions with a batch of token-id prompts, `n`, `return_token_ids`,
`return_tokens_as_token_ids`, `logprobs=0`, TRL's defaults `top_k=0`, `min_p=0`, `repetition_penalty=1`) and its
`parse_logprobs`. The package is installed with `--no-deps` (it would pull torch, transformers and vLLM, which need
a GPU build): the module's imports of torch and transformers get empty stand-ins, which the code exercised here never
touches, and the client is built without its `__init__`, which refuses to run unless vLLM is installed; the session
it builds is made the same way here. Prints one line per check, then the generated batch as JSON on the last line;
exits non-zero on the first failure.
"""

import importlib
import importlib.util
import json
import math
import os
import sys
import types


def load_vllm_client():
    """`trl.generation.vllm_client` from the installed wheel, without running trl's package `__init__`."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("trl is not importable")
    root = list(spec.submodule_search_locations)[0]
    for name, path in [("trl", root), ("trl.generation", os.path.join(root, "generation"))]:
        pkg = types.ModuleType(name)
        pkg.__path__ = [path]
        sys.modules[name] = pkg
    class Stub(types.ModuleType):
        """Any attribute is an empty class (names used in signatures, such as `torch.device`)."""

        def __getattr__(self, name):
            return type(name, (), {})

    torch = Stub("torch")
    torch.nn = Stub("torch.nn")
    transformers = Stub("transformers")
    transformers.utils = Stub("transformers.utils")
    transformers.utils.get_json_schema = lambda f: {}
    sys.modules.update({"torch": torch, "torch.nn": torch.nn, "transformers": transformers,
                        "transformers.utils": transformers.utils})
    return importlib.import_module("trl.generation.vllm_client")


def client_for(mod, base_url):
    """A `VLLMClient` as its `__init__` builds it (session with TRL's retry adapter, base URL, model id)."""
    import requests
    from requests.adapters import HTTPAdapter

    client = mod.VLLMClient.__new__(mod.VLLMClient)
    client.session = requests.Session()
    client.session.mount("http://", HTTPAdapter(pool_maxsize=mod._DEFAULT_GENERATION_CONCURRENCY))
    client.host = "127.0.0.1"
    client.base_url = base_url
    client.group_port = 51216
    client.communicator = None
    client._updating_weights = False
    client.check_server(10)
    client.model = client._get(f"{base_url}/v1/models")["data"][0]["id"]
    return client


def main():
    base_url, prompts = sys.argv[1], json.loads(sys.argv[2])
    mod = load_vllm_client()
    client = client_for(mod, base_url)
    print(f"ok check_server and /v1/models: model {client.model!r}")
    assert client.get_world_size() == 1
    print("ok get_world_size: 1")
    # GRPOTrainer reads the server's vLLM config through get_server_info (/server_info): the log-probs mode for its
    # importance-sampling check, and init_communicator the weight-transfer engine (none: TRL's NCCL weight sync is
    # not served, and init_communicator says so with its own message before touching a device).
    config = client.get_server_info()
    assert config["model_config"]["logprobs_mode"] == "processed_logprobs", config
    try:
        client.init_communicator(device=0)
    except RuntimeError as e:
        assert "no weight-transfer engine" in str(e), e
        print("ok get_server_info: logprobs_mode processed_logprobs; init_communicator: no weight-transfer engine")
    else:
        raise SystemExit("init_communicator started without a weight-transfer engine")

    n = 3
    out = client.generate(prompts, n=n, temperature=0.7, max_tokens=12, logprobs=0, generation_kwargs={"seed": 7})
    assert out["prompt_ids"] == prompts, out["prompt_ids"]
    assert len(out["completion_ids"]) == len(prompts) * n
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True):
        assert 1 <= len(ids) <= 12 and len(lps) == len(ids) == len(lp_ids), (ids, lps, lp_ids)
        for tok, lp, lp_tok in zip(ids, lps, lp_ids, strict=True):
            assert lp_tok == [tok], (tok, lp_tok)
            assert len(lp) == 1 and lp[0] is not None and lp[0] <= 0.0 and math.isfinite(lp[0]), lp
    print(f"ok generate: {len(prompts)} prompts x {n}, every token with its log-prob, parsed by TRL's parse_logprobs")

    again = client.generate(prompts, n=n, temperature=0.7, max_tokens=12, logprobs=0, generation_kwargs={"seed": 7})
    assert again["completion_ids"] == out["completion_ids"], "the same seed gave other samples"
    print("ok generate: the same seed, the same samples")

    try:
        client.generate(prompts, repetition_penalty=1.3)
    except Exception as e:  # TRL raises a bare Exception carrying the status and body
        assert "400" in str(e) and "repetition_penalty" in str(e), e
        print("ok generate: repetition_penalty 1.3 is refused with a 400 naming it")
    else:
        raise SystemExit("repetition_penalty 1.3 was accepted")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
