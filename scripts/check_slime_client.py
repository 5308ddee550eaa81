"""slime's rollout requests and parsing against tlt-serve's SGLang API.

Usage: python3 check_slime_client.py BASE_URL PROMPT_IDS_JSON

slime is not on PyPI, so its client code cannot be installed here: this script sends the payloads slime's rollout
builds and parses the answers the way it does (THUDM/slime, `slime/rollout/sglang_rollout.py`: `GenerateState`'s
`sampling_params`, `generate`'s payload and its reading of `meta_info`, the abort of what still runs once a rollout
has enough samples), with `requests`. Checks, in order: `/health_generate`; a GRPO-style group (every prompt x 4
samples, unseeded, sent at once) with slime's default sampling parameters (`stop` null, `skip_special_tokens`,
`no_stop_trim`, `spaces_between_special_tokens`) parsed into tokens, log-probs and a status; slime's abort (requests in flight,
held by an in-place pause so that they surely are, then `/abort_request` with `abort_all`: each answers `abort`);
`/pause_generation` (SGLang's default mode), `/continue_generation`, `/flush_cache` when idle, `/get_weight_version`. Prints one line per
check; exits non-zero on the first failure.
"""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests


def post(url, payload):
    r = requests.post(url, json=payload, timeout=120)
    if r.status_code != 200:
        raise SystemExit(f"POST {url}: {r.status_code} {r.text}")
    return r.json()


def sampling_params(max_new_tokens):
    # slime's GenerateState.sampling_params with its defaults (rollout_stop and rollout_stop_token_ids unset).
    return dict(temperature=0.8, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, stop=None,
                stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                spaces_between_special_tokens=False)


def running(base):
    """`tlt_serve_running_requests` from /metrics."""
    text = requests.get(f"{base}/metrics", timeout=60).text
    return float(next(l.split()[1] for l in text.splitlines() if l.startswith("tlt_serve_running_requests ")))


def parse(output):
    """What slime's `generate` takes from an answer: response tokens, their log-probs, the status."""
    meta = output["meta_info"]
    tokens = [item[1] for item in meta["output_token_logprobs"]] if "output_token_logprobs" in meta else []
    log_probs = [item[0] for item in meta["output_token_logprobs"]] if "output_token_logprobs" in meta else []
    status = {"length": "TRUNCATED", "abort": "ABORTED", "stop": "COMPLETED"}[meta["finish_reason"]["type"]]
    return output["text"], tokens, log_probs, status, meta.get("weight_version")


def main():
    base, prompts = sys.argv[1], json.loads(sys.argv[2])
    assert requests.get(f"{base}/health_generate", timeout=60).status_code == 200
    print("ok /health_generate")

    group = [p for p in prompts for _ in range(4)]
    payload = lambda ids, n: {"input_ids": ids, "sampling_params": sampling_params(n), "return_logprob": True}
    with ThreadPoolExecutor(max_workers=len(group)) as pool:
        outs = list(pool.map(lambda ids: post(f"{base}/generate", payload(ids, 16)), group))
    samples = [parse(o) for o in outs]
    for o, (text, tokens, log_probs, status, version) in zip(outs, samples):
        assert tokens == o["output_ids"] and len(log_probs) == len(tokens) == o["meta_info"]["completion_tokens"]
        assert all(lp <= 0.0 for lp in log_probs) and status in ("TRUNCATED", "COMPLETED") and version, o
        assert isinstance(text, str)
    distinct = {tuple(t) for _, t, _, _, _ in samples[:4]}
    assert len(distinct) > 1, "a prompt's 4 unseeded samples are all the same"
    print(f"ok rollout: {len(group)} requests parsed as slime does (tokens, log-probs, status, weight_version)")

    # Abort: requests in flight, then what still runs is aborted, as slime does once it has enough samples. The
    # server is paused in place first so that they are surely still running when the abort comes (on this tiny
    # model a request would otherwise finish within milliseconds).
    post(f"{base}/pause_generation", {"mode": "in_place"})
    answers = []
    def long_request(ids):
        answers.append(post(f"{base}/generate", payload(ids, 64)))
    threads = [threading.Thread(target=long_request, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while running(base) < len(prompts):
        assert time.time() < deadline, "the requests were not admitted"
        time.sleep(0.01)
    aborted = post(f"{base}/abort_request", {"abort_all": True})
    for t in threads:
        t.join()
    post(f"{base}/continue_generation", {})
    for o in answers:
        _, tokens, log_probs, status, _ = parse(o)
        assert len(log_probs) == len(tokens) and status == "ABORTED", o
    assert aborted["num_aborted_requests"] == len(prompts), aborted
    print(f"ok abort_all: {len(answers)} requests in flight answered 'abort', parsed as slime does")

    post(f"{base}/pause_generation", {})
    post(f"{base}/continue_generation", {})
    assert requests.post(f"{base}/flush_cache", timeout=60).status_code == 200
    version = requests.get(f"{base}/get_weight_version", timeout=60).json()["weight_version"]
    print(f"ok pause/continue, flush_cache when idle, weight_version {version!r}")


if __name__ == "__main__":
    main()
