"""verl's rollout-server contract through `python/tlt_verl` (the adapter) against an SGLang API: tlt-serve's, or the
reference mock's (`scripts/sglang_mock.py`, started with `--enable-metrics`).

Usage: python3 check_verl_adapter.py BASE_URL PROMPT_IDS_JSON [--server-kind tlt-serve|sglang]
           [--update-weights-from DIR]

verl itself needs torch and Ray, so it is not installed here: the script drives the adapter the way verl's agent loop
drives its servers (volcengine/verl b178a3cd, `verl/experimental/agent_loop/agent_loop.py`: the agent loop's
sampling parameters `temperature`, `top_p`, `top_k` -1, `repetition_penalty` 1.0, `logprobs`, a fresh uuid4 request
id per call, many calls at once; `verl/workers/rollout/replica.py`: `TokenOutput`, the replica's hooks and registry).
Checks, in order, one line each; the first failure exits non-zero:
- the translation of verl's sampling parameters into SGLang's `/generate` body (no server);
- a rollout: every prompt x 4 concurrent `generate` calls, unseeded at T = 1: `token_ids` and `log_probs` of the
  same length, log-probs <= 0, `stop_reason` 'completed', the weight version; a prompt's samples differ;
  `logprobs` false: `log_probs` None;
- seeds (`seed` -> `sampling_seed`): the same seed twice (concurrently) gives the same tokens and log-prob bits,
  another seed other tokens; greedy (verl's `val_kwargs`: temperature 0) twice the same tokens (tlt-serve; the mock does
  not model greedy decoding);
- `max_tokens` past the context clamped as verl clamps it, a prompt past the context refused before sending, a
  refused parameter (`repetition_penalty` 1.3) raised with the field's name (tlt-serve: the mock has no context
  length and accepts any parameter), `image_data` refused;
- aborts of requests in flight (held there by an in-place pause, ordered for each server as
  `check_slime_client.py` orders them): `abort_request(request_id)` on one of 3, then `abort_all_requests()`: all 3
  answer `stop_reason` 'aborted' with tokens and log-probs of the same length;
- `clear_kv_cache()` when idle (True), `wake_up()` / `sleep()` (no-ops), `get_weight_version()`; with
  `--update-weights-from DIR` (a checkpoint the server can load), `update_weights_from_disk(DIR, version)` and the
  next answer tagged with that version;
- `TltServeReplica` (the replica for an external server): its handle generates, its hooks reach the server;
- verl's registry path against stand-ins (in-memory modules `verl.workers.rollout.replica` and `ray` with the shapes
  of verl's `RolloutReplica`, `RolloutReplicaRegistry`, `RolloutMode` and pydantic `TokenOutput`, and Ray's
  `remote`/`.remote()`; no verl code): `register_with_verl()`, `RolloutReplicaRegistry.get("tlt-serve")`, the
  replica built as `AgentLoopManager` builds one (`replica_rank`, `config` with `custom.tlt_serve_addresses`,
  `prompt_length`, `response_length`), `init_standalone()`, then `server_handle.generate.remote(request_id=...,
  prompt_ids=..., sampling_params=..., image_data=None, video_data=None)` as `AsyncLLMServerManager` calls it,
  answered with the stand-in `TokenOutput` (without `max_tokens`: verl's default length), and the replica's hooks.
"""

import argparse
import asyncio
import json
import os
import sys
import types
import urllib.error
import urllib.request
import uuid
from enum import Enum

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import tlt_verl  # noqa: E402
from tlt_verl import TltServeError, TltServeReplica, TltServeServer, to_sglang_request  # noqa: E402


def agent_loop_params(**over):
    # AgentLoopWorker.generate_sequences' sampling_params (calculate_log_probs on), plus a length as the loop's
    # callers set one.
    p = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
    p.update(over)
    return p


def rid():
    return uuid.uuid4().hex


async def raw(base, method, path, body=None):
    """A plain HTTP call (the script's own sync points, not the adapter's): (status, text)."""
    def call():
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if os.environ.get("TLT_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['TLT_API_KEY']}"
        req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
    return await asyncio.to_thread(call)


async def running(base, kind):
    _, text = await raw(base, "GET", "/metrics")
    if kind == "tlt-serve":
        # Running and waiting: requests that arrive while paused wait for the continue, as SGLang holds them.
        names = ("tlt_serve_running_requests ", "tlt_serve_waiting_requests ")
        return sum(float(l.split()[1]) for l in text.splitlines() if l.startswith(names))
    samples = [l for l in text.splitlines() if l.startswith("sglang:num_running_reqs")]
    assert samples, "no sglang:num_running_reqs in /metrics (start the mock with --enable-metrics)"
    return sum(float(l.rsplit(None, 1)[1]) for l in samples)


def check_output(out, max_len, stop="completed"):
    assert len(out.token_ids) == len(out.log_probs), out
    assert 0 < len(out.token_ids) <= max_len, out
    assert all(isinstance(t, int) for t in out.token_ids) and all(lp <= 0.0 for lp in out.log_probs), out
    assert out.stop_reason == stop, out


def check_translation():
    body = to_sglang_request([1, 2, 3], agent_loop_params(max_tokens=16, seed=7, top_p=None), "r1")
    assert body == {"rid": "r1", "input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "repetition_penalty": 1.0, "max_new_tokens": 16, "sampling_seed": 7}}, body
    body = to_sglang_request([1, 2, 3], {"max_new_tokens": 9, "max_tokens": 4, "top_k": 5, "logprobs": False}, "r2")
    assert body["sampling_params"] == {"max_new_tokens": 9, "top_k": 5} and body["return_logprob"] is False, body
    # verl's clamp to the context, and its default length (response_length + prompt_length - len(prompt)).
    assert to_sglang_request([1] * 10, {"max_tokens": 100}, "r", 64)["sampling_params"]["max_new_tokens"] == 54
    assert to_sglang_request([1] * 10, {}, "r", 64, 20)["sampling_params"]["max_new_tokens"] == 20
    assert "max_new_tokens" not in to_sglang_request([1], {}, "r")["sampling_params"]
    try:
        to_sglang_request([1] * 65, {}, "r", 64)
        raise AssertionError("a prompt past the context was not refused")
    except ValueError:
        pass
    params = agent_loop_params(max_tokens=3)
    to_sglang_request([1], params, "r")
    assert params == agent_loop_params(max_tokens=3), "the caller's sampling_params were changed"
    print("ok translation: max_tokens -> max_new_tokens (clamped to the context), logprobs -> return_logprob, "
          "top_k -1 left out, seed -> sampling_seed, None left out")


async def check_server(base, prompts, kind, update_dir):
    server = TltServeServer(base)
    assert await server.health(), "GET /health"

    # A rollout: every prompt x 4 at once, unseeded.
    group = [p for p in prompts for _ in range(4)]
    outs = await asyncio.gather(*[server.generate(p, agent_loop_params(max_tokens=16), rid()) for p in group])
    for out in outs:
        check_output(out, 16)
        assert out.extra_fields["weight_version"], out
    for i in range(0, len(outs), 4):
        assert len({tuple(o.token_ids) for o in outs[i:i + 4]}) > 1, "a prompt's 4 unseeded samples are all the same"
    out = await server.generate(prompts[0], agent_loop_params(max_tokens=8, logprobs=False), rid())
    assert out.log_probs is None and 0 < len(out.token_ids) <= 8 and out.stop_reason == "completed", out
    print(f"ok rollout: {len(group)} concurrent generate calls: token_ids and log_probs of the same length, "
          f"stop_reason 'completed', weight_version {outs[0].extra_fields['weight_version']!r}; logprobs false: None")

    # Seeds and greedy.
    seeded = lambda s: agent_loop_params(temperature=0.7, seed=s, max_tokens=12)
    a, b, c = await asyncio.gather(*[server.generate(prompts[0], seeded(s), rid()) for s in (7, 7, 8)])
    check_output(a, 12)
    assert a.token_ids == b.token_ids, (a, b)
    # Log-probs by the bit: the two requests share rounds (each verifying its tree beside the other's) and must still
    # see the same numbers, as a request alone does.
    assert a.log_probs == b.log_probs, (a, b)
    assert a.token_ids != c.token_ids, (a, c)
    line = "ok seeds: the same seed twice (concurrently) the same tokens and log-prob bits, another seed other tokens"
    if kind == "tlt-serve":
        greedy = agent_loop_params(temperature=0.0, top_k=-1, top_p=1.0, max_tokens=12)
        g1, g2 = await asyncio.gather(*[server.generate(prompts[1], greedy, rid()) for _ in range(2)])
        check_output(g1, 12)
        assert g1.token_ids == g2.token_ids, (g1, g2)
        line += "; greedy twice the same tokens"
    print(line)

    # Lengths and refusals.
    ctx = await server.max_model_len()
    if kind == "tlt-serve":
        assert isinstance(ctx, int), f"no context_length from /get_server_info: {ctx!r}"
        out = await server.generate(prompts[0], agent_loop_params(max_tokens=10**9), rid())
        check_output(out, ctx - len(prompts[0]))
        try:
            await server.generate([prompts[0][0]] * (ctx + 1), agent_loop_params(max_tokens=4), rid())
            raise AssertionError("a prompt past the context was sent")
        except ValueError:
            pass
        try:
            await server.generate(prompts[0], agent_loop_params(max_tokens=4, repetition_penalty=1.3), rid())
            raise AssertionError("repetition_penalty 1.3 was not refused")
        except TltServeError as e:
            assert e.status == 400 and "repetition_penalty" in str(e), e
            refusal = str(e)
        line = (f"ok lengths: max_tokens 10**9 clamped to the context ({ctx}): {len(out.token_ids)} tokens, "
                f"{out.stop_reason}; a prompt past it refused; repetition_penalty 1.3 raised: {refusal}")
    else:
        assert ctx is None, ctx
        line = "ok lengths: no context length from this server (the mock has no /get_server_info): no clamp"
    try:
        await server.generate(prompts[0], agent_loop_params(max_tokens=4), rid(), image_data=["an image"])
        raise AssertionError("image_data was not refused")
    except NotImplementedError:
        pass
    print(line + "; image_data refused")

    # Aborts of requests in flight. tlt-serve holds requests that arrive during an in-place pause as waiting, where
    # abort_all ends them, so they are paused first; SGLang holds them before admission, where abort_all does not
    # reach them, so there they are sent first and paused once they run (see check_slime_client.py).
    ids = [rid() for _ in range(3)]
    long = agent_loop_params(max_tokens=64, ignore_eos=True)
    if kind == "tlt-serve":
        status, text = await raw(base, "POST", "/pause_generation", {"mode": "in_place"})
        assert status == 200, text
    tasks = [asyncio.create_task(server.generate(prompts[i % len(prompts)], long, r)) for i, r in enumerate(ids)]
    for _ in range(3000):
        if await running(base, kind) >= len(ids):
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the requests did not reach the server")
    if kind == "sglang":
        status, text = await raw(base, "POST", "/pause_generation", {"mode": "in_place"})
        assert status == 200, text
    one = await server.abort_request(ids[0])
    assert one["aborted"] and one["request_id"] == ids[0], one
    rest = await server.abort_all_requests()
    assert set(ids[1:]) <= set(rest["request_ids"]), rest
    if kind == "tlt-serve":
        assert one["num_aborted_requests"] == 1 and rest["aborted_count"] == 2, (one, rest)
    status, text = await raw(base, "POST", "/continue_generation", {})
    assert status == 200, text
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for out in outs:
        assert out.stop_reason == "aborted" and len(out.token_ids) == len(out.log_probs) < 64, out
    print(f"ok aborts in flight: abort_request(id) {one}, abort_all_requests() counted {rest['aborted_count']}; "
          f"all {len(outs)} answered stop_reason 'aborted' with {[len(o.token_ids) for o in outs]} tokens")

    # Hooks and weights.
    assert await server.clear_kv_cache() is True, "flush_cache when idle"
    assert await server.wake_up() is None and await server.sleep() is None
    version = await server.get_weight_version()
    out = await server.generate(prompts[0], agent_loop_params(max_tokens=4), rid())
    assert out.extra_fields["weight_version"] == version, (out, version)
    line = f"ok hooks: clear_kv_cache when idle, wake_up/sleep no-ops, weight version {version!r}"
    if update_dir:
        answer = await server.update_weights_from_disk(update_dir, "verl-step-1")
        assert answer["success"] is True, answer
        assert await server.get_weight_version() == "verl-step-1"
        out = await server.generate(prompts[0], agent_loop_params(max_tokens=4), rid())
        check_output(out, 4)
        assert out.extra_fields["weight_version"] == "verl-step-1", out
        line += f"; update_weights_from_disk -> {answer.get('weight_version', 'verl-step-1')!r}, next answer tagged so"
    print(line)

    # The replica for an external server.
    replica = TltServeReplica(base, replica_rank=0)
    assert replica.server_address == base.split("://", 1)[1]
    out = await replica.server_handle.generate(prompts[1], agent_loop_params(max_tokens=6), rid())
    check_output(out, 6)
    assert await replica.clear_kv_cache() is True
    assert (await replica.abort_all_requests())["request_ids"] == []
    await replica.wake_up()
    await replica.sleep()
    assert await replica.get_weight_version() == await server.get_weight_version()
    print(f"ok TltServeReplica: address {replica.server_address}, handle generates, hooks reach the server")
    await replica.server_handle.close()
    await server.close()


def install_verl_stand_ins():
    """In-memory `verl.workers.rollout.replica` and `ray` with the shapes the adapter relies on (module docstring)."""
    from pydantic import BaseModel

    ray = types.ModuleType("ray")

    class Method:
        def __init__(self, bound):
            self.bound = bound

        def remote(self, *args, **kwargs):
            return self.bound(*args, **kwargs)  # a coroutine: awaited as Ray's ObjectRef is

    class Actor:
        def __init__(self, obj):
            self._obj = obj

        def __getattr__(self, name):
            return Method(getattr(self._obj, name))

    class ActorClass:
        def __init__(self, cls):
            self.cls = cls

        def options(self, **kwargs):
            return self

        def remote(self, *args, **kwargs):
            return Actor(self.cls(*args, **kwargs))

    ray.remote = ActorClass

    replica = types.ModuleType("verl.workers.rollout.replica")

    class TokenOutput(BaseModel):
        token_ids: list[int]
        log_probs: list[float] | None = None
        routed_experts: object | None = None
        stop_reason: str | None = None
        num_preempted: int | None = None

    class RolloutMode(Enum):
        HYBRID = "hybrid"
        COLOCATED = "colocated"
        STANDALONE = "standalone"

    class RolloutReplica:
        def __init__(self, replica_rank, config, model_config, gpus_per_node=8, is_reward_model=False):
            self.replica_rank = replica_rank
            self.config = config
            self.model_config = model_config
            self.rollout_mode = None
            self.workers = []
            self.servers = []
            self._server_address = None
            self._server_handle = None

        @property
        def server_address(self):
            return self._server_address

        @property
        def server_handle(self):
            return self._server_handle

    class RolloutReplicaRegistry:
        _registry = {}

        @classmethod
        def register(cls, name, loader):
            cls._registry[name] = loader

        @classmethod
        def get(cls, name):
            return cls._registry[name]()

    replica.TokenOutput, replica.RolloutMode = TokenOutput, RolloutMode
    replica.RolloutReplica, replica.RolloutReplicaRegistry = RolloutReplica, RolloutReplicaRegistry
    sys.modules["ray"] = ray
    for name in ("verl", "verl.workers", "verl.workers.rollout"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["verl.workers.rollout.replica"] = replica
    return replica


async def check_verl_path(base, prompts, replica_mod):
    tlt_verl.register_with_verl()
    cls = replica_mod.RolloutReplicaRegistry.get("tlt-serve")
    assert issubclass(cls, replica_mod.RolloutReplica), cls
    config = types.SimpleNamespace(custom={"tlt_serve_addresses": [base]}, max_model_len=None, prompt_length=8,
                                   response_length=8)
    replica = cls(replica_rank=0, config=config, model_config=None, gpus_per_node=8)
    await replica.init_standalone()
    assert replica.rollout_mode == replica_mod.RolloutMode.STANDALONE and replica.server_address == base.split("://")[1]
    handle = replica.server_handle
    # AsyncLLMServerManager.generate's call; no max_tokens: verl's default, response_length + prompt_length - len.
    calls = [handle.generate.remote(request_id=rid(), prompt_ids=p, sampling_params=agent_loop_params(),
                                    image_data=None, video_data=None) for p in prompts]
    outs = await asyncio.gather(*calls)
    for p, out in zip(prompts, outs):
        assert isinstance(out, replica_mod.TokenOutput), type(out)
        check_output(out, 16 - len(p))
    assert await replica.clear_kv_cache() is True
    assert (await replica.abort_all_requests())["request_ids"] == []
    await replica.wake_up()
    await replica.sleep()
    await replica.resume_all_requests()
    try:
        cls(replica_rank=1, config=config, model_config=None)
        raise AssertionError("a replica rank without an address was accepted")
    except ValueError:
        pass
    print(f"ok verl stand-ins: registered as 'tlt-serve', replica {type(replica).__name__} launched standalone, "
          f"server_handle.generate.remote(...) answered verl's TokenOutput ({[len(o.token_ids) for o in outs]} tokens, "
          "verl's default length), hooks through the handle")
    await handle._obj.close()


def verl_importable():
    try:
        import verl.workers.rollout.replica  # noqa: F401
    except ImportError as e:
        print(f"verl does not import ({e}): the registry path runs against stand-ins")
        return False
    return True


def check_verl_itself(base, prompts):
    """verl 0.9's own classes: its `RolloutConfig`, `get_rollout_replica_class` dispatch and `LLMServerManager.create`
    in standalone mode (one replica per `n_gpus_per_node * nnodes / (tp * dp * pp)`), a real local Ray, verl's
    global load balancer and `LLMServerClient.generate` as the agent loop calls it; verl's pydantic `TokenOutput`."""
    import ray
    import verl
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.llm_server import LLMServerManager
    from verl.workers.rollout.replica import RolloutReplica, TokenOutput as VerlTokenOutput, get_rollout_replica_class

    tlt_verl.register_with_verl()
    cls = get_rollout_replica_class("tlt-serve")
    assert issubclass(cls, RolloutReplica), cls
    rollout = RolloutConfig(name="tlt-serve", nnodes=1, n_gpus_per_node=1, tensor_model_parallel_size=1,
                            prompt_length=8, response_length=8, custom={"tlt_serve_addresses": [base]})
    config = types.SimpleNamespace(actor_rollout_ref=types.SimpleNamespace(rollout=rollout, model=None))
    # As a verl job puts `python/` on every Ray node's PYTHONPATH (the README's instruction): here, the local node's.
    here = os.path.dirname(os.path.dirname(os.path.abspath(tlt_verl.__file__)))
    path = os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH", "")] if p)
    env = {"PYTHONPATH": path}
    if os.environ.get("TLT_API_KEY"):
        env["TLT_API_KEY"] = os.environ["TLT_API_KEY"]  # how a key reaches the adapter in verl's actors
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        manager = LLMServerManager.create(config)
        (replica,) = manager.get_replicas()
        assert isinstance(replica, cls) and manager.get_addresses() == [base.split("://")[1]], manager.get_addresses()
        client = manager.get_client()

        async def rollout_step():
            outs = await asyncio.gather(*[client.generate(rid(), prompt_ids=p, sampling_params=agent_loop_params())
                                          for p in prompts])
            await replica.clear_kv_cache()
            aborted = await replica.abort_all_requests(reject_request=False)
            await replica.resume_generation()
            await replica.release_kv_cache()
            await replica.resume_kv_cache()
            return outs, aborted

        outs, aborted = asyncio.run(rollout_step())
        for p, out in zip(prompts, outs):
            assert isinstance(out, VerlTokenOutput), type(out)
            check_output(out, 16 - len(p))
            assert out.extra_fields["weight_version"] and "min_global_steps" in out.extra_fields, out
        assert aborted["request_ids"] == [], aborted
    finally:
        ray.shutdown()
    print(f"ok verl {verl.__version__} itself: get_rollout_replica_class('tlt-serve') a RolloutReplica, "
          f"LLMServerManager.create (standalone, real Ray) launched {type(replica).__name__}, LLMServerClient.generate "
          f"through verl's load balancer answered verl's TokenOutput ({[len(o.token_ids) for o in outs]} tokens), "
          "the replica's hooks (clear, abort, resume, KV release/resume) reached the server")


async def check_key(base, prompts):
    """With the server's key in `TLT_API_KEY`, every check above went through it; an adapter without it is refused."""
    keyless = TltServeServer(base, api_key="")
    try:
        await keyless.generate(prompts[0], agent_loop_params(max_tokens=4), rid())
    except TltServeError as e:
        assert e.status == 401, e
    else:
        raise AssertionError("the server answered an adapter without its API key")
    finally:
        await keyless.close()
    print("ok key: the adapter sent the API key (TLT_API_KEY) on every request; without it the server answers 401")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("prompts")
    ap.add_argument("--server-kind", choices=["tlt-serve", "sglang"], default="tlt-serve")
    ap.add_argument("--update-weights-from")
    ap.add_argument("--api-key", help="the server's key, given to the adapter as verl's actors get it: TLT_API_KEY")
    args = ap.parse_args()
    if args.api_key:
        os.environ["TLT_API_KEY"] = args.api_key
    base, prompts = args.base.rstrip("/"), json.loads(args.prompts)
    check_translation()
    asyncio.run(check_server(base, prompts, args.server_kind, args.update_weights_from))
    if args.api_key:
        asyncio.run(check_key(base, prompts))
    if verl_importable():
        check_verl_itself(base, prompts)
    else:
        replica_mod = install_verl_stand_ins()
        asyncio.run(check_verl_path(base, prompts, replica_mod))
    print("verl adapter: all checks passed")


if __name__ == "__main__":
    main()
