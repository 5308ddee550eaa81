#!/usr/bin/env python3
"""Golden fixtures from Hugging Face transformers for tlt-model's golden tests (`tlt-model/tests/golden_hf.rs`).

Run by hand when a fixture must change, never by CI (the Rust tests read the committed fixtures, no Python).

Setup (only PyPI is needed; PyPI's Linux torch wheel is the CUDA build, ~6 GB with its nvidia-* packages, and
runs on the CPU):

    python3 -m venv .cache/venv-golden
    .cache/venv-golden/bin/pip install torch==2.14.1 transformers==5.19.0 safetensors==0.8.0 numpy==2.4.6 \
        gguf==0.19.0
    .cache/venv-golden/bin/python scripts/golden_hf.py

`scripts/golden_hf.py --check-export [DIR]` instead loads what tlt-model's `save_hf_dir` wrote for the Qwen3 cases
(`tests/golden_hf.rs` leaves it in `target/tmp/golden-hf-export/`) with transformers' AutoModelForCausalLM and
compares its logits with the fixtures.

For each case below it builds a tiny model with seeded random weights (drawn here, not by transformers' init,
so every norm weight differs from 1 and the logits are far from uniform), saves it as an HF directory
(`config.json` + `model.safetensors`, float32) under `tlt-model/tests/fixtures/golden/<case>/`, loads it back
from that directory with transformers (float32, `attn_implementation="eager"`, CPU) and writes `golden.json`
beside it:

- `prompts`: token ids; `greedy`: 16 argmax continuations of each (full forward per step, no EOS);
  `min_margin`: the smallest top-1 minus top-2 logit gap over those steps (the script refuses gaps < 1e-3, which
  float32 noise could flip);
- `logits`: for each prompt, the teacher-forced sequence `prompt + greedy[:-1]` and the full logits rows at a few
  positions of it (first, last prompt position, a middle generated one, last), rounded to 1e-6.

Cases: `qwen3_tied` (Qwen3, head_dim 16 with hidden 32 and 4 heads, i.e. decoupled; tied embeddings; plus a GGUF
`qwen3_tied.gguf` of the same weights with llama.cpp's names and metadata, arch `qwen3`), `qwen3_bias` (Qwen3,
untied, `attention_bias: true`: biases on q, k, v and o), `qwen2` (q/k/v biases, tied) and `llama3` (Llama with
Llama-3 `rope_scaling`, original_max_position_embeddings 32 and sequences to ~60 positions). `config.json` is
written as transformers 5 writes it (`rope_parameters`), except for `qwen2` and `llama3`, rewritten to the legacy
`rope_theta` + `rope_scaling` form the Hub's checkpoints carry (transformers reads both).
"""

import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tlt-model" / "tests" / "fixtures" / "golden"
NEW_TOKENS = 16
MIN_MARGIN = 1e-3

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, rms_norm_eps=1e-6)

CASES = {
    "qwen3_tied": dict(
        cls="Qwen3",
        cfg=dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        seed=1, prompt_lens=[5, 12, 30], gguf=True, legacy_rope=False, embed_std=0.3,
    ),
    "qwen3_bias": dict(
        cls="Qwen3",
        cfg=dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                 attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        seed=2, prompt_lens=[4, 9, 25], gguf=False, legacy_rope=False,
    ),
    "qwen2": dict(
        cls="Qwen2",
        cfg=dict(COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        seed=3, prompt_lens=[6, 13, 24], gguf=False, legacy_rope=True, embed_std=0.3,
    ),
    "llama3": dict(
        cls="Llama",
        cfg=dict(COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                 max_position_embeddings=256,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}),
        seed=4, prompt_lens=[7, 20, 44], gguf=False, legacy_rope=True,
    ),
}


def random_weights(model, seed, embed_std):
    """Seeded weights: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, embed_std^2), an untied head ~ N(0, 1), norms
    ~ 1 + N(0, 0.1), biases ~ N(0, 0.1). A small `embed_std` keeps a tied model from repeating its last token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=g))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def legacy_rope(config_path):
    """Rewrites `rope_parameters` as the Hub's `rope_theta` + `rope_scaling`."""
    cfg = json.loads(config_path.read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type") == "default" else params
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def greedy(model, prompt):
    """NEW_TOKENS argmax continuations (one full forward per step) and the smallest top-1/top-2 gap."""
    seq, out, margin = list(prompt), [], float("inf")
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1]
            top = torch.topk(logits, 2).values
            margin = min(margin, float(top[0] - top[1]))
            tok = int(torch.argmax(logits))
            out.append(tok)
            seq.append(tok)
    return out, margin


def write_gguf(model, cfg, path):
    """The same weights as llama.cpp's converter writes a Qwen3 model (no q/k permutation for qwen archs)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    for name, t in model.state_dict().items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[module]}.{suffix}"
        w.add_tensor(gname, t.detach().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(name, case):
    torch.manual_seed(case["seed"])
    config_cls = getattr(transformers, case["cls"] + "Config")
    model_cls = getattr(transformers, case["cls"] + "ForCausalLM")
    config = config_cls(**case["cfg"], attn_implementation="eager")
    model = model_cls(config).float().eval()
    random_weights(model, case["seed"], case.get("embed_std", 1.0))
    model.tie_weights()

    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    if case["legacy_rope"]:
        legacy_rope(out / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if case["gguf"]:
        write_gguf(model, config, OUT / f"{name}.gguf")

    # What the Rust test compares with: the model as transformers loads it from the directory just written.
    loaded = model_cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(case["seed"])
    prompts, greedy_out, logits, min_margin = [], [], [], float("inf")
    for n in case["prompt_lens"]:
        prompt = [int(t) for t in rng.integers(0, config.vocab_size, n)]
        toks, margin = greedy(loaded, prompt)
        if margin < MIN_MARGIN:
            raise SystemExit(f"{name}: greedy top-2 gap {margin:.2e} < {MIN_MARGIN}: pick another seed")
        min_margin = min(min_margin, margin)
        seq = prompt + toks[:-1]
        with torch.no_grad():
            rows = loaded(torch.tensor([seq])).logits[0]
        positions = sorted({0, n - 1, n + NEW_TOKENS // 2, len(seq) - 1})
        logits.append({
            "tokens": seq,
            "positions": positions,
            "rows": [[round(float(x), 6) for x in rows[p]] for p in positions],
        })
        prompts.append(prompt)
        greedy_out.append(toks)
    fixture = {
        "case": name,
        "generator": f"scripts/golden_hf.py, transformers {transformers.__version__}, torch {torch.__version__}",
        "hf_class": type(loaded).__name__,
        "prompts": prompts,
        "greedy": greedy_out,
        "min_margin": min_margin,
        "logits": logits,
    }
    (out / "golden.json").write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(f"{name}: {type(loaded).__name__}, min greedy margin {min_margin:.3f}, files {sizes}")


def check_export(root):
    """Loads what `save_hf_dir` wrote (`tests/golden_hf.rs` keeps it in target/tmp/golden-hf-export/<case>) with
    transformers and compares its logits with the case's fixture. Exits 1 on a class or logits mismatch."""
    failed = False
    for case_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        fixture = json.loads((OUT / case_dir.name / "golden.json").read_text())
        model = transformers.AutoModelForCausalLM.from_pretrained(
            case_dir, dtype=torch.float32, attn_implementation="eager").eval()
        worst = 0.0
        with torch.no_grad():
            for entry in fixture["logits"]:
                rows = model(torch.tensor([entry["tokens"]])).logits[0]
                for p, want in zip(entry["positions"], entry["rows"]):
                    want = torch.tensor(want)
                    worst = max(worst, float((rows[p] - want).abs().max() / max(1.0, float(want.abs().max()))))
        ok = type(model).__name__ == fixture["hf_class"] and worst <= 1e-5
        failed |= not ok
        print(f"{case_dir.name}: transformers loads {type(model).__name__}, worst relative diff {worst:.2e}: "
              f"{'ok' if ok else 'FAIL'}")
    raise SystemExit(1 if failed else 0)


def main():
    torch.set_num_threads(1)
    if len(sys.argv) > 1 and sys.argv[1] == "--check-export":
        check_export(pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "target" / "tmp" / "golden-hf-export")
    for name, case in CASES.items():
        build(name, case)


if __name__ == "__main__":
    main()
