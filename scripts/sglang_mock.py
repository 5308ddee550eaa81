"""A reference mock of SGLang's native HTTP API: the answers' shapes are SGLang's, the tokens are fake.

Usage: python3 sglang_mock.py [--host 127.0.0.1] [--port 30000 (0: a free one)] [--enable-metrics]
           [--speculative-algorithm NAME [--speculative-num-draft-tokens 4]] [--weight-version default]
           [--token-delay 0.02] [--vocab-size 32000] [--eos-token-id 2]

Prints `SGLANG_MOCK_PORT=<port>` once it listens. Python's standard library only (http.server).

No model runs: a request's tokens are a hash of (its prompt ids, `sampling_seed` if given else its rid, the position),
so unseeded samples of one prompt differ and seeded ones repeat; from the 9th token on, 1 in 24 is the EOS token,
which stops the request (as does any of `stop_token_ids`, which a token below `--vocab-size` matches by chance). Each token takes `--token-delay` seconds, so that requests stay in flight
long enough to be paused or aborted. Log-probs are hashes too (negative). The text is the tokens written `<id>` (no
tokenizer).

What it answers, with the shapes read in SGLang's source (sgl-project/sglang; no code of it is copied here):
- `python/sglang/srt/entrypoints/http_server.py` (stored version 0025436e): `GET /health`, `/health_generate` (200,
  empty body); `POST /generate` (the single-request form: `input_ids` or `text`, `sampling_params`, `return_logprob`,
  `rid`); `POST /abort_request` (`rid` or `abort_all`; 200, empty body); `POST /pause_generation` and
  `/continue_generation` (`{"message": ..., "status": "ok"}`); `GET|POST /flush_cache` (text; 400 while requests run
  or wait); `GET /get_weight_version` (`{"weight_version"}`); `GET /metrics` only with `--enable-metrics`, as SGLang.
- `python/sglang/srt/managers/tokenizer_manager.py` (stored version 001067ff), `_handle_batch_output` and
  `add_logprob_to_meta_info` / `detokenize_logprob_tokens` / `_calculate_spec_decoding_metrics`: an answer is
  `{"text", "output_ids", "meta_info"}`; `meta_info` holds `id`, `finish_reason`, `prompt_tokens`, `weight_version`,
  `num_retractions`; with `return_logprob` `input_token_logprobs`, `output_token_logprobs` (one `[logprob, token_id,
  text-or-null]` per output token; the text is null unless `return_text_in_logprobs`) and
  `output_token_logprobs_length`; then `reasoning_tokens`, `completion_tokens`, `cached_tokens`; once finished
  `e2e_latency`; with a speculative algorithm and at least one verify step, `spec_accept_rate`,
  `spec_accept_length`, `spec_num_correct_drafts`, `spec_num_proposed_drafts`, `spec_verify_ct`, the aliases
  `spec_accepted_drafts` / `spec_proposed_drafts`, and `spec_correct_drafts_histogram` / `spec_accept_histogram`.
  (Older SGLang releases named these `spec_accept_token_num` / `spec_draft_token_num`, the names slime's
  `Sample.SpecInfo` reads; this mock follows the version above.) The mock's speculative counts are made up: every
  verify step yields 2 tokens.
  `input_token_logprobs` is one entry for the last prompt position: with `logprob_start_len` -1 (the default)
  SGLang's scheduler starts the prompt log-probs at `len(prompt) - 1` (`scheduler.py`, `handle_generate_request`);
  the mock puts null as its log-prob, a value it does not claim (slime does not read the field).
- `python/sglang/srt/managers/schedule_batch.py`: `finish_reason` is `{"type": "stop", "matched": <token id>}`,
  `{"type": "length", "length": <max_new_tokens>}` or `{"type": "abort", "message", "status_code", "err_type"}`.
- The control semantics, from `tokenizer_manager.py` (`generate_request`, `abort_request`, `pause_generation`,
  `continue_generation`) and `scheduler.py` (`abort_request`, `pause_generation`): while paused (any mode) a new
  request waits before it is admitted and does not count as running; mode `abort` (the default) aborts what runs
  and answers once nothing runs; `in_place` keeps the running requests where they are; `retract` is served as
  `in_place` plus a retraction counted in `num_retractions`. `abort_all` (or a `rid`, matched as a prefix) marks the
  running requests to finish with `abort` after one more decode step (so, in place, after `/continue_generation`);
  requests held while paused are not aborted.
- `/metrics` (with `--enable-metrics`): SGLang's gauges `sglang:num_running_reqs` and `sglang:num_queue_reqs`
  (`python/sglang/srt/metrics/collector.py`), with one label, `model_name`. `scripts/check_slime_client.py` reads the
  running count from there (`--server-kind sglang`), as it reads `tlt_serve_running_requests` from tlt-serve.

Not served: batched prompts, streaming, stop strings, top-k log-probs, weight updates, `/v1/*`, `/v1/loads`.
"""

import argparse
import hashlib
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


# The first position where a fake token may be the EOS token (then 1 in 24 is): a request runs at least this many
# steps unless aborted, so that a client can see it running and pause it.
EOS_FROM = 8


class Engine:
    """The tokenizer manager's pause gate and the scheduler's running requests, under one condition variable."""

    def __init__(self, args):
        self.args = args
        self.cond = threading.Condition()
        self.gate_paused = False  # tokenizer_manager.is_pause: new requests wait before admission
        self.engine_paused = False  # scheduler paused in place: running requests do not step
        self.running = {}  # rid -> request state (dict)

    # --- requests ---

    def generate(self, body):
        ids = body.get("input_ids")
        if ids is None and isinstance(body.get("text"), str):
            ids = list(body["text"].encode("utf-8"))
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": {"message": "this mock serves one prompt per request: `input_ids` (a list of ints) or `text`"}}
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        stop_ids = set(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos", False):
            stop_ids.add(self.args.eos_token_id)
        seed = params.get("sampling_seed")
        rid = body.get("rid") or uuid.uuid4().hex
        key = f"seed:{seed}" if seed is not None else f"rid:{rid}"
        created = time.time()

        with self.cond:
            # The tokenizer manager's gate: requests wait while paused, before the scheduler sees them.
            self.cond.wait_for(lambda: not self.gate_paused)
            state = {"to_finish": None, "retractions": 0}
            self.running[rid] = state
            self.cond.notify_all()

        out, lps, finish = [], [], None
        try:
            while finish is None:
                with self.cond:
                    self.cond.wait_for(lambda: not self.engine_paused)
                    to_finish = state["to_finish"]
                if len(out) >= max_new:
                    finish = to_finish or {"type": "length", "length": max_new}
                    break
                time.sleep(self.args.token_delay)
                h = int.from_bytes(hashlib.blake2b(f"{key}|{ids}|{len(out)}".encode(), digest_size=8).digest(), "little")
                tok = h % self.args.vocab_size
                if len(out) >= EOS_FROM and (h >> 40) % 24 == 0:
                    tok = self.args.eos_token_id
                out.append(tok)
                lps.append(-((h >> 20) % 100000) / 10000.0 - 1e-3)
                if to_finish is not None:  # the decode step an aborted request still runs
                    finish = to_finish
                elif tok in stop_ids:
                    finish = {"type": "stop", "matched": tok}
        finally:
            with self.cond:
                self.running.pop(rid, None)
                self.cond.notify_all()

        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": self.args.weight_version,
            "num_retractions": state["retractions"],
        }
        if body.get("return_logprob"):
            text_in = bool(body.get("return_text_in_logprobs"))
            meta["input_token_logprobs"] = [[None, ids[-1], f"<{ids[-1]}>" if text_in else None]]
            meta["output_token_logprobs"] = [[lp, t, f"<{t}>" if text_in else None] for lp, t in zip(lps, out)]
            meta["output_token_logprobs_length"] = len(out)
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(out)
        meta["cached_tokens"] = 0
        meta["e2e_latency"] = time.time() - created
        if self.args.speculative_algorithm and out:
            k = self.args.speculative_num_draft_tokens
            verify_ct = (len(out) + 1) // 2
            correct = len(out) - verify_ct
            proposed = verify_ct * (k - 1)
            if proposed > 0:
                meta["spec_accept_rate"] = correct / proposed
                meta["spec_accept_length"] = len(out) / verify_ct
                meta["spec_num_correct_drafts"] = correct
                meta["spec_num_proposed_drafts"] = proposed
                meta["spec_verify_ct"] = verify_ct
                meta["spec_accepted_drafts"] = correct
                meta["spec_proposed_drafts"] = proposed
            histogram = [0] * k
            histogram[1] = correct
            histogram[0] = verify_ct - correct
            meta["spec_correct_drafts_histogram"] = histogram
            meta["spec_accept_histogram"] = histogram
        return 200, {"text": "".join(f"<{t}>" for t in out), "output_ids": out, "meta_info": meta}

    # --- control ---

    def abort(self, rid="", abort_all=False):
        with self.cond:
            for r, state in self.running.items():
                if (abort_all or (rid and r.startswith(rid))) and state["to_finish"] is None:
                    state["to_finish"] = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            self.cond.notify_all()

    def pause(self, mode):
        with self.cond:
            self.gate_paused = True
            if mode in ("in_place", "retract"):
                self.engine_paused = True
                if mode == "retract":
                    for state in self.running.values():
                        state["retractions"] += 1
                return
        # `abort`: abort what runs until nothing does.
        while True:
            self.abort(abort_all=True)
            with self.cond:
                if self.cond.wait_for(lambda: not self.running, timeout=1.0):
                    return

    def resume(self):
        with self.cond:
            self.gate_paused = False
            self.engine_paused = False
            self.cond.notify_all()

    def idle(self):
        with self.cond:
            return not self.running

    def metrics(self):
        with self.cond:
            n = len(self.running)
        label = '{model_name="sglang-mock"}'
        return (
            "# HELP sglang:num_running_reqs The number of running requests.\n"
            "# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{label} {float(n)}\n"
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
            "# TYPE sglang:num_queue_reqs gauge\n"
            f"sglang:num_queue_reqs{label} 0.0\n"
        )


FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def handler(engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send(self, status, body=b"", content_type="application/json"):
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            elif isinstance(body, str):
                body = body.encode()
            self.send_response(status)
            if body:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def body(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            if not raw.strip():
                return {}
            return json.loads(raw)

        def do_GET(self):
            path = self.path.split("?")[0]
            if path in ("/health", "/health_generate"):
                self.send(200)
            elif path == "/get_weight_version":
                self.send(200, {"weight_version": engine.args.weight_version})
            elif path == "/flush_cache":
                self.flush()
            elif path == "/metrics" and engine.args.enable_metrics:
                self.send(200, engine.metrics(), "text/plain; version=0.0.4")
            else:
                self.send(404, {"detail": "Not Found"})

        def flush(self):
            self.send(200 if engine.idle() else 400, FLUSHED, "text/plain")

        def do_POST(self):
            path = self.path.split("?")[0]
            try:
                body = self.body()
            except json.JSONDecodeError as e:
                self.send(400, {"error": {"message": f"bad JSON: {e}"}})
                return
            if path == "/generate":
                status, out = engine.generate(body)
                self.send(status, out)
            elif path == "/abort_request":
                engine.abort(rid=body.get("rid") or "", abort_all=bool(body.get("abort_all")))
                self.send(200)
            elif path == "/pause_generation":
                mode = body.get("mode", "abort")
                if mode not in ("abort", "in_place", "retract"):
                    self.send(400, {"error": {"message": f"unknown mode {mode!r}"}})
                    return
                engine.pause(mode)
                self.send(200, {"message": "Generation paused successfully.", "status": "ok"})
            elif path == "/continue_generation":
                engine.resume()
                self.send(200, {"message": "Generation continued successfully.", "status": "ok"})
            elif path == "/flush_cache":
                self.flush()
            else:
                self.send(404, {"detail": "Not Found"})

    return Handler


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--token-delay", type=float, default=0.02)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--eos-token-id", type=int, default=2)
    args = p.parse_args()
    if args.speculative_num_draft_tokens < 2:
        p.error("--speculative-num-draft-tokens must be at least 2")
    server = ThreadingHTTPServer((args.host, args.port), handler(Engine(args)))
    server.daemon_threads = True
    print(f"SGLANG_MOCK_PORT={server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
