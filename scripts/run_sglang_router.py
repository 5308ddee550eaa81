"""sglang-router (PyPI's `sglang-router`, the Rust gateway in a wheel) started as slime starts it, on 127.0.0.1.

Usage: python3 run_sglang_router.py PORT PROMETHEUS_PORT

slime (THUDM/slime 624b824, `slime/ray/rollout.py` `_start_router`, `slime/utils/http_utils.py` `run_router`) builds
`RouterArgs` from its command line (here: the defaults), sets the host, port and Prometheus port, turns the circuit
breaker and the router's own health checks off, and calls `sglang_router.launch_router.launch_router` in a child
process; the engines then register themselves with `POST /workers` (`SGLangEngine._register_to_router`). This does
the same, bound to 127.0.0.1 only, and runs until it is killed.
"""

import sys

from sglang_router.launch_router import RouterArgs, launch_router


def main():
    port, prometheus_port = int(sys.argv[1]), int(sys.argv[2])
    args = RouterArgs()
    args.host = "127.0.0.1"
    args.port = port
    args.prometheus_host = "127.0.0.1"
    args.prometheus_port = prometheus_port
    args.disable_circuit_breaker = True
    if hasattr(args, "disable_health_check"):
        args.disable_health_check = True
    launch_router(args)


if __name__ == "__main__":
    main()
