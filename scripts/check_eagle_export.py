#!/usr/bin/env python3
"""Check an EAGLE-3 draft checkpoint directory against what SGLang and vLLM load.

Usage: check_eagle_export.py DIR [--target-vocab-size V] [--target-hidden-size H] [--target-num-layers L]

Needs only the `safetensors` and `numpy` packages (numpy reads the d2t/t2d values). Exits 0 and prints
"OK: ..." when the checkpoint passes, else prints one "FAIL: ..." line per problem and exits 1.

The expectations are written out explicitly from the loaders (see shared/reference/eagle-format.md, section 2):
- SGLang `python/sglang/srt/models/llama_eagle3.py` `LlamaForCausalLMEagle3.load_weights`: bare names; a name that
  is not a parameter gets a `model.` prefix; q/k/v are fused into `qkv_proj` and gate/up into `gate_up_proj`;
  `d2t` becomes `hot_token_id = d2t + arange`; unknown names are SKIPPED SILENTLY (so we fail on them).
- vLLM `vllm/model_executor/models/llama_eagle3.py` `Eagle3LlamaForCausalLM.load_weights`: `midlayer.` ->
  `layers.0.`, `model.` prefixed to everything but `lm_head`, `d2t` -> `draft_id_to_target_id`, `t2d` skipped,
  `embed_tokens` loaded only if present.
- SpecForge export checklist: required `fc.weight`, `norm.weight`, `lm_head.weight`, `t2d`, `d2t`; no key containing
  "embed"; no `draft_model.` prefix; bf16 weights (f16/f32 accepted); d2t int64 offsets; t2d bool.
"""

import argparse
import json
import os
import sys

import numpy as np
from safetensors import safe_open

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FLOAT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
LAYER_WEIGHTS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "input_layernorm", "hidden_norm", "post_attention_layernorm",
)

# Parameters of each engine's drafter module and the checkpoint tensors that feed them (fused shards).
SGLANG_PARAMS = {
    "model.fc.weight": ["fc.weight"],
    "model.midlayer.self_attn.qkv_proj.weight": [f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"],
    "model.midlayer.self_attn.o_proj.weight": ["midlayer.self_attn.o_proj.weight"],
    "model.midlayer.mlp.gate_up_proj.weight": ["midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"],
    "model.midlayer.mlp.down_proj.weight": ["midlayer.mlp.down_proj.weight"],
    "model.midlayer.input_layernorm.weight": ["midlayer.input_layernorm.weight"],
    "model.midlayer.hidden_norm.weight": ["midlayer.hidden_norm.weight"],
    "model.midlayer.post_attention_layernorm.weight": ["midlayer.post_attention_layernorm.weight"],
    "model.norm.weight": ["norm.weight"],
    "lm_head.weight": ["lm_head.weight"],
}


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}


def fuse(name):
    return ".".join(FUSED.get(part, part) for part in name.split("."))


def sglang_name(name):
    """Where SGLang's load_weights puts a checkpoint tensor (None: skipped on purpose)."""
    if name == "t2d":
        return None
    if name == "d2t":
        return "hot_token_id"
    return name if name.startswith("lm_head") else "model." + fuse(name)


def vllm_name(name):
    """Where vLLM's load_weights puts a checkpoint tensor (None: skipped on purpose)."""
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id"
    name = fuse(name.replace("midlayer.", "layers.0.", 1))
    return name if name.startswith("lm_head") else "model." + name


VLLM_PARAMS = {vllm_name(n) for shards in SGLANG_PARAMS.values() for n in shards} | {"draft_id_to_target_id"}


def check(directory, target_vocab=None, target_hidden=None, target_layers=None):
    fails = []
    fail = fails.append
    cfg_path = os.path.join(directory, "config.json")
    st_path = os.path.join(directory, "model.safetensors")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        return [f"config.json unreadable: {e}"]
    if not os.path.exists(st_path):
        return ["model.safetensors missing (SGLang/vLLM read a single-file export)"]

    # ---- config.json ----
    archs = cfg.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        fail(f"architectures {archs} names neither of {ARCHITECTURES}")
    if cfg.get("model_type") != "llama":
        fail(f"model_type {cfg.get('model_type')!r} != 'llama'")
    if cfg.get("num_hidden_layers") != 1:
        fail(f"num_hidden_layers {cfg.get('num_hidden_layers')!r} != 1 (keep one layer for portability)")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "max_position_embeddings", "draft_vocab_size"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg.get(key) <= 0:
            fail(f"{key} must be a positive integer, got {cfg.get(key)!r}")
    for key in ("rms_norm_eps", "rope_theta"):
        if not isinstance(cfg.get(key), (int, float)) or isinstance(cfg.get(key), bool):
            fail(f"{key} must be a number (legacy top-level form older serving stacks read), got {cfg.get(key)!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        fail(f"hidden_act {cfg.get('hidden_act')!r} != 'silu'")
    if cfg.get("tie_word_embeddings") is not False:
        fail(f"tie_word_embeddings must be false, got {cfg.get('tie_word_embeddings')!r}")
    torch_dtype = cfg.get("torch_dtype")
    if torch_dtype not in FLOAT_DTYPES:
        fail(f"torch_dtype {torch_dtype!r} not one of {sorted(FLOAT_DTYPES)}")
    if cfg.get("attention_bias"):
        fail("attention_bias must be false for LlamaForCausalLMEagle3")
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not (isinstance(scaling, dict) and ("rope_type" in scaling or "type" in scaling)):
        fail(f"rope_scaling must be null or a legacy dict with rope_type/type, got {scaling!r}")
    if "rope_parameters" in cfg and "rope_theta" not in cfg:
        fail("rope_parameters without legacy rope_theta: older SGLang/vLLM ignore it")
    if fails:
        return fails
    h, vocab, n_draft = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    big_h = cfg.get("target_hidden_size") or h
    if n_draft > vocab:
        fail(f"draft_vocab_size {n_draft} > vocab_size {vocab}")
    if target_vocab is not None and vocab != target_vocab:
        fail(f"vocab_size {vocab} != target vocab {target_vocab} (t2d and the shared embedding are target-sized)")
    if target_hidden is not None and big_h != target_hidden:
        fail(f"fc input implies target hidden {big_h}, target has {target_hidden}")
    # Layer ids: SGLang reads eagle_config ids as "output of layer k" (+1), vLLM top-level ids as "input of layer k".
    sgl = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vll = cfg.get("eagle_aux_hidden_state_layer_ids")
    if (sgl is None) != (vll is None):
        fail("layer ids given for one engine only: write eagle_config.eagle_aux_hidden_state_layer_ids (SGLang) "
             "AND top-level eagle_aux_hidden_state_layer_ids (vLLM) = the former + 1, or neither")
    elif sgl is not None:
        if len(sgl) != 3 or len(vll) != 3 or any(v != s + 1 for s, v in zip(sgl, vll)):
            fail(f"eagle_config ids {sgl} (+1) disagree with top-level ids {vll}")
        if target_layers is not None and any(not 0 < v <= target_layers for v in vll):
            fail(f"layer ids {vll} outside 1..={target_layers}")

    # ---- tensors: names, shapes, dtypes ----
    expected = {"fc.weight": [h, 3 * big_h], "norm.weight": [h], "lm_head.weight": [n_draft, h]}
    shapes = {
        "self_attn.q_proj": [heads * head_dim, 2 * h], "self_attn.k_proj": [kv_heads * head_dim, 2 * h],
        "self_attn.v_proj": [kv_heads * head_dim, 2 * h], "self_attn.o_proj": [h, heads * head_dim],
        "mlp.gate_proj": [inter, h], "mlp.up_proj": [inter, h], "mlp.down_proj": [h, inter],
        "input_layernorm": [h], "hidden_norm": [h], "post_attention_layernorm": [h],
    }
    for part in LAYER_WEIGHTS:
        expected[f"midlayer.{part}.weight"] = shapes[part]
    want_dtype = FLOAT_DTYPES[torch_dtype]
    with safe_open(st_path, framework="np") as f:
        names = set(f.keys())
        info = {n: (f.get_slice(n).get_dtype(), list(f.get_slice(n).get_shape())) for n in names}
        for name in sorted(names):
            if name.startswith("model.") or name.startswith("draft_model."):
                fail(f"{name}: names must be bare (vLLM would load model.model.*, SGLang skips it)")
            elif "embed" in name and big_h == h:
                fail(f"{name}: embeddings are shared from the target and must not be exported")
            elif name not in expected and name not in ("d2t", "t2d") and "embed" not in name:
                fail(f"{name}: unknown tensor (SGLang skips it silently)")
        for name, shape in expected.items():
            if name not in names:
                fail(f"{name}: missing")
                continue
            dtype, got = info[name]
            if got != shape:
                fail(f"{name}: shape {got} != {shape}")
            if dtype != want_dtype:
                fail(f"{name}: dtype {dtype} != {want_dtype} (torch_dtype {torch_dtype})")
        if big_h != h and "embed_tokens.weight" not in names:
            fail("target_hidden_size differs from hidden_size: SGLang will not share the target embedding, "
                 "so embed_tokens.weight must be exported")
        # Engine name mappings: every parameter of each engine's module is fed, nothing lands elsewhere.
        present = sorted(n for n in names if n in expected or n in ("d2t", "t2d"))
        sgl_fed = {sglang_name(n) for n in present} - {None}
        for param, shards in SGLANG_PARAMS.items():
            if not all(s in names for s in shards):
                fail(f"SGLang parameter {param} lacks shards {[s for s in shards if s not in names]}")
        if not sgl_fed <= set(SGLANG_PARAMS) | {"hot_token_id"}:
            fail(f"SGLang would not find parameters {sorted(sgl_fed - set(SGLANG_PARAMS) - {'hot_token_id'})}")
        if "hot_token_id" not in sgl_fed and n_draft != vocab:
            fail("SGLang: no d2t for a reduced draft vocabulary")
        vllm_fed = {vllm_name(n) for n in present} - {None}
        if not vllm_fed <= VLLM_PARAMS:
            fail(f"vLLM would not find parameters {sorted(vllm_fed - VLLM_PARAMS)}")
        if not (VLLM_PARAMS - {"draft_id_to_target_id"}) <= vllm_fed:
            fail(f"vLLM parameters left unloaded: {sorted(VLLM_PARAMS - {'draft_id_to_target_id'} - vllm_fed)}")

        # ---- d2t / t2d values ----
        if "d2t" not in names or "t2d" not in names:
            if n_draft != vocab:
                fail("d2t and t2d are required when draft_vocab_size < vocab_size (SpecForge exports both)")
        else:
            if info["d2t"] != ("I64", [n_draft]):
                fail(f"d2t: {info['d2t']} != ('I64', [{n_draft}]): int64 offsets")
            if info["t2d"] != ("BOOL", [vocab]):
                fail(f"t2d: {info['t2d']} != ('BOOL', [{vocab}])")
            if not fails:
                d2t = f.get_tensor("d2t")
                t2d = f.get_tensor("t2d")
                ids = np.arange(n_draft, dtype=np.int64) + d2t
                if ids.min() < 0 or ids.max() >= vocab:
                    fail(f"d2t maps draft ids to target ids outside 0..{vocab}")
                elif not np.all(np.diff(ids) > 0):
                    fail("d2t target ids (i + d2t[i]) must be strictly increasing")
                else:
                    if int(t2d.sum()) != n_draft:
                        fail(f"t2d marks {int(t2d.sum())} ids, draft_vocab_size is {n_draft}")
                    if not bool(t2d[ids].all()):
                        fail("t2d does not mark every target id of d2t")
    return fails


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--target-vocab-size", type=int)
    p.add_argument("--target-hidden-size", type=int)
    p.add_argument("--target-num-layers", type=int)
    a = p.parse_args()
    fails = check(a.dir, a.target_vocab_size, a.target_hidden_size, a.target_num_layers)
    for msg in fails:
        print(f"FAIL: {msg}")
    if fails:
        sys.exit(1)
    print(f"OK: {a.dir} loads as an EAGLE-3 drafter in SGLang (LlamaForCausalLMEagle3) and vLLM (Eagle3LlamaForCausalLM)")


if __name__ == "__main__":
    main()
