"""The trainer's side of a weight-update group, as slime and SGLang open it, against tlt-comm's TCPStore client.

Rank 0 of a torch job of `--world-size` ranks: torch's own `rendezvous("tcp://127.0.0.1:PORT")` hosts the TCPStore
(its constructor waits until every rank has joined, so the other side must join as torch's clients do), then the
group is made as SGLang's `init_custom_process_group` makes it (a `PrefixStore(group_name, store)` handed to torch's
`_new_process_group_helper` with the NCCL backend). The store torch hands the NCCL backend is caught on its way in
(`ProcessGroupNCCL` itself refuses to be built without a GPU), and the script does with it what
`ProcessGroupNCCL::broadcastUniqueNCCLID` does at the group's first collective: rank 0 sets key "0" to the 128-byte
NCCL unique id (random bytes here).

The other rank (the Rust test) reads the id at the key its code computes, writes it back under `tlt/got` in the
plain store and adds 5 to `tlt/count`; this script checks both and exits 0 when they match.
"""

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--group-name", default="weight_update_group")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    timeout = datetime.timedelta(seconds=args.timeout_s)

    # slime's trainer: init_process_group(backend="nccl", init_method=f"tcp://{master_address}:{master_port}",
    # world_size=..., rank=0, group_name=...), SGLang's init_custom_process_group.
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{args.port}", 0, args.world_size, timeout=timeout))
    store.set_timeout(timeout)
    raw = store
    store = PrefixStore(args.group_name, store)

    # torch 2.14 registers its NCCL backend as a plugin on first use (from its entry points).
    Backend._ensure_backend_registered("nccl")
    plugin = Backend._plugins["NCCL"]
    caught = []

    def catching(opts, backend_options):
        caught.append(opts.store)
        return dist.ProcessGroup(opts.store, opts.group_rank, opts.group_size)

    Backend._plugins["NCCL"] = Backend._BackendPlugin(catching, plugin.extended_api)
    try:
        pg, _ = _new_process_group_helper(
            world_size, rank, [], "nccl", store, group_name=args.group_name, timeout=timeout
        )
    finally:
        Backend._plugins["NCCL"] = plugin
    (nccl_store,) = caught
    nccl_id = os.urandom(128)
    nccl_store.set("0", nccl_id)

    got = raw.get("tlt/got")
    count = raw.add("tlt/count", 0)
    ok = got == nccl_id and count == 5
    print(
        f"torch {torch.__version__} TCPStore at 127.0.0.1:{args.port}, world size {world_size}, group "
        f"{args.group_name!r}: the other rank read the NCCL id {'as set' if got == nccl_id else 'WRONG'} "
        f"({len(got)} bytes), its add left tlt/count at {count}"
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
