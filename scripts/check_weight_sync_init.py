"""slime's trainer side of `connect_rollout_engines_from_distributed`, up to the group's rendezvous: it posts
`/init_weights_update_group` to the engine (in a thread, as slime's Ray call runs beside it), then opens the group
itself with torch's own rendezvous as rank 0 (`init_process_group`'s TCPStore, which waits until every rank has
joined), then reads the engine's answer. Prints the answer's status and message as JSON; exits 0 when the
rendezvous completed (whatever the engine answered).
"""

import argparse
import datetime
import json
import socket
import threading
import urllib.request

from torch.distributed.distributed_c10d import rendezvous


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--group-name", default="weight_update_group")
    args = ap.parse_args()
    with socket.socket() as sock:
        sock.bind(("", 0))
        master_port = sock.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": master_port, "rank_offset": 1, "world_size": 2,
            "group_name": args.group_name, "backend": "nccl"}
    answer = {}

    def post():
        req = urllib.request.Request(f"{args.url}/init_weights_update_group", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                answer.update(status=r.status, body=json.loads(r.read()))
        except urllib.error.HTTPError as e:
            answer.update(status=e.code, body=json.loads(e.read()))

    t = threading.Thread(target=post)
    t.start()
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{master_port}", 0, 2,
                                         timeout=datetime.timedelta(seconds=60)))
    t.join()
    print(json.dumps({"rendezvous": "complete", "world_size": world, **answer}))


if __name__ == "__main__":
    main()
