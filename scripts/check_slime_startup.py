"""slime's external-engine start-up against a server's `/server_info` (or `/get_server_info`).

Usage: python3 check_slime_startup.py BASE_URL [--fp16] [--offload-rollout] [--use-rollout-routing-replay]
           [--expect-fail]

slime (THUDM/slime 624b824) runs against an engine it did not launch with `--rollout-external
--rollout-external-engine-addrs HOST:PORT`. At start-up it:
1. discovers the engine (`slime/backends/sglang_utils/external.py`: `get_server_info` asks `/server_info`, then
   `/get_server_info`; `discover_external_engines` reads `pp_size`, `tp_size`, `num_gpus`, `disaggregation_mode`,
   `encoder_only`, `disaggregation_bootstrap_port`; `ExternalEngineInfo.parallel_config` reads `tp_size`, `pp_size`,
   `ep_size`, `moe_dp_size`);
2. computes the server arguments it would have launched SGLang with (`sglang_engine.py`, `_compute_server_args`) and
   asserts, for every key of them not in `_EXTERNAL_ENGINE_SKIP_CHECK_FIELDS`, that the engine reports the same value
   (`SGLangEngine._init_external`, `_sanity_check_server_args`).

slime needs Ray, Megatron and SGLang to import, so its code is reproduced here as it stands, for one regular
(not prefill/decode) engine of one GPU: the keys and values of `_compute_server_args` before its ServerArgs merge
(that merge adds keys after the check list is taken), the skip list verbatim, and the assert. The flags are slime's
own that change the list: `--fp16` (expects `dtype` "float16"), `--offload-rollout` (expects `enable_memory_saver`
True), `--use-rollout-routing-replay` (expects `enable_return_routed_experts` True). `--expect-fail`: the assert must
fail (the negative control: a server that does not run as slime expects is caught). Needs `requests`.
"""

import argparse
import dataclasses
import sys

import requests


# slime/backends/sglang_utils/sglang_engine.py, verbatim.
_EXTERNAL_ENGINE_SKIP_CHECK_FIELDS = [
    "model_path",
    "trust_remote_code",
    "random_seed",
    "host",
    "port",
    "nccl_port",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "gpu_id_step",
    "base_gpu_id",
    "tp_size",
    "dp_size",
    "pp_size",
    "ep_size",
    "skip_server_warmup",
    "enable_draft_weights_cpu_backup",
    "enable_metrics",
    "mem_fraction_static",
]


def compute_server_args(args, host, port):
    """`_compute_server_args` for a regular engine (rank 0, one GPU per engine and per node): its kwargs before the
    ServerArgs merge, and the fields it checks on an external engine."""
    pp_size = args.sglang_pp_size
    tp_size = args.rollout_num_gpus_per_engine // pp_size
    nnodes = max(1, args.rollout_num_gpus_per_engine // args.num_gpus_per_node)
    kwargs = {
        "model_path": args.hf_checkpoint,
        "trust_remote_code": True,
        "random_seed": args.seed,
        # memory
        "enable_memory_saver": args.offload_rollout,
        # distributed
        "host": host,
        "port": port,
        "nccl_port": None,
        "nnodes": nnodes,
        "node_rank": 0,
        "dist_init_addr": f"{host}:{port}",
        "gpu_id_step": 1,
        "base_gpu_id": 0,
        # parallel
        "tp_size": tp_size,
        "dp_size": args.sglang_dp_size,
        "pp_size": pp_size,
        "ep_size": args.sglang_ep_size,
        "skip_server_warmup": True,
        "enable_draft_weights_cpu_backup": True,
        "enable_metrics": True,
    }
    if args.use_rollout_routing_replay:
        kwargs["enable_return_routed_experts"] = True
    if args.fp16:
        kwargs["dtype"] = "float16"
    fields = [k for k in kwargs.keys() if k not in _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS]
    return kwargs, fields


# slime/backends/sglang_utils/external.py, verbatim but for the logger.
def get_server_info(url, timeout=30.0):
    errors = []
    for endpoint in ("/server_info", "/get_server_info"):
        try:
            response = requests.get(f"{url}{endpoint}", timeout=timeout)
            response.raise_for_status()
            return response.json()
        except Exception as exc:
            errors.append(f"{endpoint}: {exc}")
    raise RuntimeError(f"Failed to fetch SGLang server info from {url}: {'; '.join(errors)}")


def _infer_worker_type(server_info):
    if server_info.get("encoder_only"):
        return "encoder"
    mode = server_info.get("disaggregation_mode")
    if mode in ("prefill", "decode"):
        return mode
    return "regular"


def discover(url, server_info):
    pp_size = int(server_info.get("pp_size") or server_info.get("pipeline_parallel_size") or 1)
    tp_size = int(server_info.get("tp_size") or server_info.get("tensor_parallel_size") or 1)
    num_gpus = int(server_info.get("num_gpus") or server_info.get("num_gpus_per_engine") or tp_size * pp_size)
    bootstrap_port = server_info.get("disaggregation_bootstrap_port")
    bootstrap_port = int(bootstrap_port) if bootstrap_port is not None else None
    parallel_config = {
        "tp_size": int(server_info.get("tp_size") or server_info.get("tensor_parallel_size") or num_gpus // pp_size),
        "pp_size": pp_size,
        "ep_size": int(server_info.get("ep_size") or server_info.get("expert_parallel_size") or 1),
        "moe_dp_size": int(server_info.get("moe_dp_size") or server_info.get("moe_data_parallel_size") or 1),
    }
    return _infer_worker_type(server_info), num_gpus, bootstrap_port, parallel_config


def sanity_check_server_args(actual_server_args, expect_server_args, fields):
    # SGLangEngine._init_external's _sanity_check_server_args, verbatim.
    for name in fields:
        expect_value = expect_server_args.get(name)
        actual_value = actual_server_args.get(name)
        assert (
            actual_value == expect_value
        ), f"{name=} {expect_value=} {actual_value=} {expect_server_args=} {actual_server_args=}"


@dataclasses.dataclass
class SlimeArgs:
    """The slime arguments `_compute_server_args` reads, at slime's defaults for one engine of one GPU."""

    hf_checkpoint: str = "/path/to/model"
    seed: int = 1234
    offload_rollout: bool = False
    rollout_num_gpus_per_engine: int = 1
    num_gpus_per_node: int = 8
    sglang_pp_size: int = 1
    sglang_dp_size: int = 1
    sglang_ep_size: int = 1
    use_rollout_routing_replay: bool = False
    fp16: bool = False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--offload-rollout", action="store_true")
    ap.add_argument("--use-rollout-routing-replay", action="store_true")
    ap.add_argument("--expect-fail", action="store_true")
    a = ap.parse_args()
    url = a.base.rstrip("/")
    args = SlimeArgs(offload_rollout=a.offload_rollout, fp16=a.fp16,
                     use_rollout_routing_replay=a.use_rollout_routing_replay)

    info = get_server_info(url)
    worker_type, num_gpus, bootstrap_port, parallel = discover(url, info)
    assert worker_type == "regular", worker_type
    assert num_gpus == 1 and bootstrap_port is None, (num_gpus, bootstrap_port)
    assert parallel == {"tp_size": 1, "pp_size": 1, "ep_size": 1, "moe_dp_size": 1}, parallel
    print(f"ok discovery: worker_type {worker_type}, num_gpus {num_gpus}, parallel_config {parallel}")

    host, port = url.split("//", 1)[1].rsplit(":", 1)
    expect, fields = compute_server_args(args, host, int(port))
    try:
        sanity_check_server_args(info, expect, fields)
    except AssertionError as e:
        if a.expect_fail:
            print(f"ok the start-up assert fails as expected: {str(e).split(' expect_server_args=')[0]}")
            return
        raise
    if a.expect_fail:
        sys.exit(f"the start-up assert passed over {fields}, but should have failed")
    shown = {k: info.get(k) for k in fields}
    print(f"ok slime's start-up assert over {fields}: {shown}")
    # Read by slime's router registration (model_path) and kept for the log line.
    print(f"ok server args: model_path {info['model_path']!r}, dtype {info.get('dtype')!r}, "
          f"context_length {info.get('context_length')}, max_total_tokens {info.get('max_total_tokens')}")


if __name__ == "__main__":
    main()
