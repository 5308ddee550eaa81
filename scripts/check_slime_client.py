"""slime's rollout requests and parsing against an SGLang API: tlt-serve's, or the reference mock's.

Usage: python3 check_slime_client.py BASE_URL PROMPT_IDS_JSON [--server-kind tlt-serve|sglang] [--schema-out FILE]
           [--router ROUTER_URL]

slime is not on PyPI, so its client code cannot be installed here: this script sends the payloads slime's rollout
builds and parses the answers the way it does (THUDM/slime, `slime/rollout/sglang_rollout.py`: `GenerateState`'s
`sampling_params`, `generate`'s payload and its reading of `meta_info`, the abort of what still runs once a rollout
has enough samples; `slime/utils/types.py`: `Sample.update_from_meta_info`; `slime/utils/http_utils.py`: an answer
that is not JSON is kept as text), with `requests`. Checks, in order: `/health_generate`; a GRPO-style group (every
prompt x 4 samples, unseeded, sent at once) with slime's default sampling parameters (`stop` null,
`skip_special_tokens`, `no_stop_trim`, `spaces_between_special_tokens`) parsed into tokens, log-probs and a status;
slime's abort (requests in flight, held by an in-place pause so that they surely are, then `/abort_request` with
`abort_all`: each answers `abort`); `/pause_generation` (SGLang's default mode), `/continue_generation`,
`/flush_cache` when idle, `/get_weight_version`. Prints one line per check; exits non-zero on the first failure.

`--server-kind` (default `tlt-serve`) selects the two things that differ between the servers, not the payloads:
- where the count of requests in the server comes from (the script's own sync point, not something slime reads):
  `tlt_serve_running_requests` plus `tlt_serve_waiting_requests` in tlt-serve's `/metrics`, or SGLang's gauge
  `sglang:num_running_reqs` (summed over its label sets; SGLang serves `/metrics` only with `--enable-metrics`);
- the order of the abort check. Both hold a request that arrives during a pause outside the queue (SGLang before
  admission, `tokenizer_manager.py`, `generate_request`), but tlt-serve counts it as waiting in its loads and
  `abort_all` ends it (so that slime's abort-until-idle loop ends), while SGLang's `abort_all` does not reach it. So
  on tlt-serve the pause comes first, then the requests, then `abort_all`; on SGLang the requests are sent first and
  paused in place once all run (the reference mock decodes slowly enough for that); its running requests end with
  `abort` after one more decode step, i.e. after `/continue_generation`.

`--router ROUTER_URL`: slime's deployment, with sglang-router in front of the engine at BASE_URL. The engine registers
with the router as slime's `SGLangEngine._register_to_router` does (`POST /workers` with its URL and `worker_type`
"regular"; the router adds it in the background, so the script waits until `GET /workers` lists it); the rollout
and eval requests go to the router's `/generate` (slime's `generate` posts there); the abort is slime's: the
workers' URLs from the router's `GET /workers`, then each worker's `/abort_request` with `abort_all` until its
`/v1/loads?include=core` counts no request (`abort_servers_until_idle`); the other control calls go to the engine,
as slime's engine actors send them. Also checked through the router: an eval request (slime's eval sampling
parameters, greedy, seeded, with stop strings), and a `/generate` option at a value the server does not serve, refused with a 400
that names it (slime would otherwise train on an answer that ignored it).

`--schema-out FILE` writes, for every answer parsed, its JSON shape: per check (`POST /generate`, `POST /generate
(aborted)`, `POST /abort_request`, ...), every key path (`$.meta_info.output_token_logprobs[][0]`: `[]` is a list's
elements, `[i]` a position in a list whose scalar elements differ in type, i.e. a tuple) with the JSON types seen
there (`object`, `array`, `string`, `integer`, `number`, `boolean`, `null`; a body that is not JSON: `text`, or
`empty`). It also writes `reads`: the paths slime (or this script) reads, per check, and who reads each.
"""

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

# What slime reads from each answer (and what this script reads besides), by key path.
SLIME_GENERATE_READS = {
    "$.text": "slime generate(): output['text']",
    "$.meta_info": "slime generate(): output['meta_info']",
    "$.meta_info.output_token_logprobs": "slime generate(): tokens and log-probs, if present",
    "$.meta_info.output_token_logprobs[]": "slime generate(): one item per response token",
    "$.meta_info.output_token_logprobs[][0]": "slime generate(): item[0], the log-prob",
    "$.meta_info.output_token_logprobs[][1]": "slime generate(): item[1], the token id",
    "$.meta_info.finish_reason": "slime Sample.update_from_meta_info(): the status",
    "$.meta_info.finish_reason.type": "slime Sample.update_from_meta_info(): length/abort/stop",
    "$.meta_info.weight_version": "slime Sample.update_from_meta_info(): weight_versions, if present",
    "$.meta_info.prompt_tokens": "slime PrefixCacheInfo.add() (.get, default 0)",
    "$.meta_info.cached_tokens": "slime PrefixCacheInfo.add() (.get, default 0)",
    "$.meta_info.completion_tokens": "slime SpecInfo.add() with --sglang-speculative-algorithm (.get, default 0)",
    "$.meta_info.spec_accept_token_num": "slime SpecInfo.add() with --sglang-speculative-algorithm (.get, default 0)",
    "$.meta_info.spec_draft_token_num": "slime SpecInfo.add() with --sglang-speculative-algorithm (.get, default 0)",
    "$.meta_info.spec_verify_ct": "slime SpecInfo.add() with --sglang-speculative-algorithm (.get, default 0)",
    "$.output_ids": "this script: equals the tokens slime parses",
}
READS = {
    "POST /generate": SLIME_GENERATE_READS,
    "POST /generate (aborted)": SLIME_GENERATE_READS,
    "GET /get_weight_version": {"$.weight_version": "this script"},
}

SHAPES = {}
LOCK = threading.Lock()


def json_type(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def shape(v, path, out):
    out.setdefault(path, set()).add(json_type(v))
    if isinstance(v, dict):
        for k, x in v.items():
            shape(x, f"{path}.{k}", out)
    elif isinstance(v, list):
        scalar = all(not isinstance(x, (dict, list)) for x in v)
        if v and scalar and len({json_type(x) for x in v}) > 1:
            for i, x in enumerate(v):  # a tuple: its positions are its fields
                shape(x, f"{path}[{i}]", out)
        else:
            for x in v:
                shape(x, f"{path}[]", out)


def record(check, answer):
    """Adds the shape of `answer` (parsed JSON, or text) to check `check`."""
    with LOCK:
        paths = SHAPES.setdefault(check, {})
        if isinstance(answer, str):
            paths.setdefault("$", set()).add("text" if answer else "empty")
        else:
            shape(answer, "$", paths)
    return answer


def parse_body(r):
    # slime's http_utils._post: the JSON, else the text.
    try:
        return r.json()
    except ValueError:
        return r.text


def post(url, payload, check=None):
    r = requests.post(url, json=payload, timeout=120)
    if r.status_code != 200:
        raise SystemExit(f"POST {url}: {r.status_code} {r.text}")
    out = parse_body(r)
    return record(check, out) if check else out


def get(url, check):
    r = requests.get(url, timeout=60)
    if r.status_code != 200:
        raise SystemExit(f"GET {url}: {r.status_code} {r.text}")
    return record(check, parse_body(r))


def eval_sampling_params(max_new_tokens, seed):
    # slime's eval_rollout_single_dataset base_sampling_params at an eval dataset's settings (greedy, stop strings
    # as `--rollout-stop` gives them), with sglang_enable_deterministic_inference's sampling_seed.
    return dict(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, stop=["</answer>", "\n\n"],
                stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                spaces_between_special_tokens=False, sampling_seed=seed)


def register_with_router(router, base):
    """slime's SGLangEngine._register_to_router, then a wait until the router lists the worker."""
    r = requests.post(f"{router}/workers", json={"url": base, "worker_type": "regular"}, timeout=60)
    r.raise_for_status()
    deadline = time.time() + 60
    while True:
        workers = requests.get(f"{router}/workers", timeout=60).json()["workers"]
        if any(w["url"] == base for w in workers):
            return workers
        assert time.time() < deadline, f"the router did not add {base}: {workers}"
        time.sleep(0.1)


def abort_servers_until_idle(router):
    """slime's abort(): the workers from the router, then abort_server_until_idle on each."""
    urls = [w["url"] for w in requests.get(f"{router}/workers", timeout=60).json()["workers"]]
    answers = []
    deadline = time.time() + 30
    for url in urls:
        while True:
            assert time.time() < deadline, f"{url} still counts requests after its aborts"
            answers.append(post(f"{url}/abort_request", {"abort_all": True}, "POST /abort_request"))
            load = requests.get(f"{url}/v1/loads?include=core", timeout=60).json()
            if num_requests_from_load(load) <= 0:
                break
            time.sleep(0.5)
    return urls, answers


def num_requests_from_load(load):
    # slime/backends/sglang_utils/server_control.py, verbatim.
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        value = load.get(key)
        if isinstance(value, int):
            return value
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


def sampling_params(max_new_tokens):
    # slime's GenerateState.sampling_params with its defaults (rollout_stop and rollout_stop_token_ids unset).
    return dict(temperature=0.8, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, stop=None,
                stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                spaces_between_special_tokens=False)


def running(base, kind):
    """The server's count of the requests it holds from /metrics (see the module docstring): tlt-serve's running and
    waiting ones (requests that arrive while it is paused wait for the continue, as SGLang holds them before its
    scheduler), SGLang's running ones."""
    text = requests.get(f"{base}/metrics", timeout=60).text
    if kind == "tlt-serve":
        names = ("tlt_serve_running_requests ", "tlt_serve_waiting_requests ")
        return sum(float(l.split()[1]) for l in text.splitlines() if l.startswith(names))
    samples = [l for l in text.splitlines() if l.startswith("sglang:num_running_reqs{") or l.startswith("sglang:num_running_reqs ")]
    assert samples, "no sglang:num_running_reqs in /metrics (SGLang serves it with --enable-metrics)"
    return sum(float(l.rsplit(None, 1)[1]) for l in samples)


def parse(output):
    """What slime's `generate` takes from an answer: response tokens, their log-probs, the status."""
    meta = output["meta_info"]
    tokens = [item[1] for item in meta["output_token_logprobs"]] if "output_token_logprobs" in meta else []
    log_probs = [item[0] for item in meta["output_token_logprobs"]] if "output_token_logprobs" in meta else []
    status = {"length": "TRUNCATED", "abort": "ABORTED", "stop": "COMPLETED"}[meta["finish_reason"]["type"]]
    return output["text"], tokens, log_probs, status, meta.get("weight_version")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("prompts")
    ap.add_argument("--server-kind", choices=["tlt-serve", "sglang"], default="tlt-serve")
    ap.add_argument("--schema-out")
    ap.add_argument("--router")
    args = ap.parse_args()
    base, prompts, kind = args.base, json.loads(args.prompts), args.server_kind
    # Where slime's rollout posts /generate: the router in front of the engine, or the engine itself.
    gen = args.router or base
    if args.router:
        workers = register_with_router(args.router, base)
        print(f"ok registered with the router as slime does: {[w['url'] for w in workers]}")

    get(f"{base}/health_generate", "GET /health_generate")
    print("ok /health_generate")

    group = [p for p in prompts for _ in range(4)]
    payload = lambda ids, n: {"input_ids": ids, "sampling_params": sampling_params(n), "return_logprob": True}
    with ThreadPoolExecutor(max_workers=len(group)) as pool:
        outs = list(pool.map(lambda ids: post(f"{gen}/generate", payload(ids, 16), "POST /generate"), group))
    samples = [parse(o) for o in outs]
    for o, (text, tokens, log_probs, status, version) in zip(outs, samples):
        assert tokens == o["output_ids"] and len(log_probs) == len(tokens) == o["meta_info"]["completion_tokens"]
        assert all(lp <= 0.0 for lp in log_probs) and status in ("TRUNCATED", "COMPLETED") and version, o
        assert isinstance(text, str)
    distinct = {tuple(t) for _, t, _, _, _ in samples[:4]}
    assert len(distinct) > 1, "a prompt's 4 unseeded samples are all the same"
    via = " through the router" if args.router else ""
    print(f"ok rollout{via}: {len(group)} requests parsed as slime does (tokens, log-probs, status, weight_version)")

    if args.router:
        # slime's eval: greedy and seeded, twice: the same answer (through the router, which may add fields).
        body = {"input_ids": prompts[0], "sampling_params": eval_sampling_params(12, 1234), "return_logprob": True}
        evals = [parse(post(f"{gen}/generate", body, "POST /generate")) for _ in range(2)]
        assert evals[0][1] == evals[1][1] and evals[0][1] and len(evals[0][2]) == len(evals[0][1]), evals
        print(f"ok eval through the router: greedy, seeded, {len(evals[0][1])} tokens, repeated exactly")
        # An option the server does not serve, at a value that would change the answer: refused by name.
        bad = {"input_ids": prompts[0], "sampling_params": sampling_params(4), "return_logprob": True,
               "top_logprobs_num": 2}
        r = requests.post(f"{gen}/generate", json=bad, timeout=60)
        assert r.status_code == 400 and "top_logprobs_num" in r.text, (r.status_code, r.text)
        print(f"ok through the router, top_logprobs_num 2 refused: {r.status_code} {r.json()['error']['message']}")

    # Abort: requests in flight, then what still runs is aborted, as slime does once it has enough samples. They are
    # held by an in-place pause so that they are surely still in the server when the abort comes (on tlt-serve's tiny
    # test model a request would otherwise finish within milliseconds; there they wait for the continue, as SGLang
    # holds requests that arrive while paused); the order depends on the server (module docstring).
    answers = []
    def long_request(ids):
        answers.append(post(f"{gen}/generate", payload(ids, 64), "POST /generate (aborted)"))
    threads = [threading.Thread(target=long_request, args=(p,)) for p in prompts]
    if kind == "tlt-serve":
        post(f"{base}/pause_generation", {"mode": "in_place"}, "POST /pause_generation (in_place)")
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while running(base, kind) < len(prompts):
        assert time.time() < deadline, "the requests did not reach the server"
        time.sleep(0.01)
    if kind == "sglang":
        post(f"{base}/pause_generation", {"mode": "in_place"}, "POST /pause_generation (in_place)")
    if args.router:
        # slime aborts every worker the router lists until none counts a request.
        urls, abort_answers = abort_servers_until_idle(args.router)
        assert urls == [base], urls
        aborted = abort_answers[0]
        post(f"{base}/continue_generation", {}, "POST /continue_generation")
    else:
        aborted = post(f"{base}/abort_request", {"abort_all": True}, "POST /abort_request")
        post(f"{base}/continue_generation", {}, "POST /continue_generation")
    for t in threads:
        t.join()
    for o in answers:
        _, tokens, log_probs, status, _ = parse(o)
        assert len(log_probs) == len(tokens) and status == "ABORTED", o
    assert len(answers) == len(prompts)
    if isinstance(aborted, dict) and "num_aborted_requests" in aborted:  # tlt-serve's; SGLang answers an empty body
        assert aborted["num_aborted_requests"] == len(prompts), aborted
    print(f"ok abort_all{via}: {len(answers)} requests in flight answered 'abort', parsed as slime does")

    post(f"{base}/pause_generation", {}, "POST /pause_generation")
    post(f"{base}/continue_generation", {}, "POST /continue_generation")
    r = requests.post(f"{base}/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    record("POST /flush_cache", parse_body(r))
    version = get(f"{base}/get_weight_version", "GET /get_weight_version")["weight_version"]
    print(f"ok pause/continue, flush_cache when idle, weight_version {version!r}")

    if args.schema_out:
        shapes = {c: {p: sorted(t) for p, t in sorted(paths.items())} for c, paths in sorted(SHAPES.items())}
        with open(args.schema_out, "w") as f:
            json.dump({"shapes": shapes, "reads": READS}, f, indent=1, sort_keys=True)
        print(f"ok schema of {sum(len(p) for p in shapes.values())} paths in {len(shapes)} answers -> {args.schema_out}")


if __name__ == "__main__":
    main()
