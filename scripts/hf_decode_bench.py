#!/usr/bin/env python3
"""The peer of `gpu-bench`: greedy decode of the same architecture shapes with HF transformers + PyTorch on the same
GPU, bf16, random weights (nothing downloaded): eager `generate`, and `compiled`: a static cache, which transformers
>= 4.50 answers by compiling the forward itself (`generation_config.compile_config`; what HF documents for fast
decoding). Our own `torch.compile(model.forward, mode="reduce-overhead")` around `generate` failed on transformers
5.17 ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run": generate keeps the
previous step's outputs), so only older transformers get it, with `torch.compiler.cudagraph_mark_step_begin()` before
each forward. Each mode and batch runs on its own: a failing one is reported and the others still run.

Decode tokens/s = batch * new_tokens / (time of generate(context + new_tokens) - time of generate(context + 1)), so
the prefill is subtracted. Medians over --repeats. Writes JSON (--out) and prints a markdown table.

    python3 scripts/hf_decode_bench.py --arch smollm2-135m --batches 1,8,64 --modes eager,compiled --out hf.json
"""
import argparse
import json
import statistics
import time
import traceback

import torch
import transformers

# Published shapes (config.json of each model), as in examples/src/bin/gpu_bench.rs.
ARCHS = {
    "smollm2-135m": dict(cls="LlamaForCausalLM", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0),
    "qwen2.5-1.5b": dict(cls="Qwen2ForCausalLM", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0),
    "qwen2.5-7b": dict(cls="Qwen2ForCausalLM", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       rope_theta=1000000.0),
    "llama3-8b": dict(cls="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                      rope_theta=500000.0),
}


def build(arch):
    spec = dict(ARCHS[arch])
    cls = getattr(transformers, spec.pop("cls"))
    cfg_cls = transformers.Qwen2Config if cls is transformers.Qwen2ForCausalLM else transformers.LlamaConfig
    cfg = cfg_cls(max_position_embeddings=32768, rms_norm_eps=1e-6, torch_dtype="bfloat16", **spec)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cfg).to(torch.bfloat16)
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def timed_generate(model, ids, new_tokens, repeats, **kw):
    times = []
    for rep in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
        torch.cuda.synchronize()
        if rep >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_rate(model, batch, context, new_tokens, repeats, **kw):
    ids = torch.randint(100, 1000, (batch, context), device="cuda")
    full = timed_generate(model, ids, new_tokens, repeats, **kw)
    first = timed_generate(model, ids, 1, repeats, **kw)
    return batch * (new_tokens - 1) / (full - first), full, first


def transformers_version():
    return tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())


class Compiled:
    """Context: `generate` on the compiled forward. transformers >= 4.50 compiles it itself for a static cache; older
    versions get our torch.compile, marking a new CUDA-graph step before each forward."""

    def __init__(self, model):
        self.model = model
        self.eager_forward = None

    def __enter__(self):
        self.model.generation_config.cache_implementation = "static"
        if transformers_version() < (4, 50):
            compiled = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)

            def stepped(*args, **kw):
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(*args, **kw)

            self.eager_forward, self.model.forward = self.model.forward, stepped
        return self

    def __exit__(self, *exc):
        if self.eager_forward is not None:
            self.model.forward = self.eager_forward
        self.model.generation_config.cache_implementation = None
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="smollm2-135m", choices=sorted(ARCHS))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    ap.add_argument("--out", default="hf-decode.json")
    a = ap.parse_args()
    model = build(a.arch)
    rows, failed = [], []
    print(f"{a.arch}: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name()}, context {a.context}, {a.new_tokens} new tokens")
    print("| batch | mode | decode tok/s | generate s |\n|---:|---|---:|---:|")
    for mode in a.modes.split(","):
        for batch in [int(b) for b in a.batches.split(",")]:
            try:
                if mode == "eager":
                    rate, full, _ = decode_rate(model, batch, a.context, a.new_tokens, a.repeats)
                elif mode == "compiled":
                    with Compiled(model):
                        rate, full, _ = decode_rate(model, batch, a.context, a.new_tokens, a.repeats)
                else:
                    raise ValueError(f"unknown mode {mode}")
            except Exception as e:  # one run's failure must not lose the others' results
                traceback.print_exc()
                failed.append(dict(batch=batch, mode=mode, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"| {batch} | {mode} | FAILED: {type(e).__name__} | - |")
                continue
            rows.append(dict(batch=batch, mode=mode, tokens_per_s=rate, generate_s=full))
            print(f"| {batch} | {mode} | {rate:.0f} | {full:.3f} |")
    out = dict(arch=a.arch, device=torch.cuda.get_device_name(), torch=torch.__version__,
               transformers=transformers.__version__, context=a.context, new_tokens=a.new_tokens, results=rows,
               failed=failed)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"JSON: {a.out}")
    if failed:
        raise SystemExit(f"{len(failed)} runs failed")


if __name__ == "__main__":
    main()
