#!/usr/bin/env python3
"""Check that what TLT exports loads where users serve it, and computes what TLT computes.

Usage: check_export_parity.py DUMP_DIR

DUMP_DIR is written by `cargo xtask check-export` (bench/src/export_check.rs): `manifest.json` names the exported
directories and the safetensors files holding the inputs TLT ran and TLT's outputs. Three checks, each run when the
manifest has its entry:

- policy: the exported policy directory loads in Hugging Face transformers (AutoModelForCausalLM, AutoTokenizer) on
  CPU in float32; greedy generation gives the same tokens as TLT on every prompt, the prompt's last-position logits
  are compared (max abs diff), the tokenizer encodes the prompt texts to TLT's ids, and its chat template
  (`tokenizer_config.json`) renders user messages as TLT's renderer does.
- eagle3: the EAGLE-3 drafter (SGLang/vLLM format) is converted with the `speculators` package's Eagle3Converter to
  the speculators format vLLM reads, loaded as speculators' Eagle3DraftModel (eager attention, float32, the
  target's embedding), and run on TLT's inputs (one TTT step: the serving forward); its last decoder-layer output
  ("final hidden state", before the norm) and its draft logits are compared with TLT's.
- eagle2: speculators has no EAGLE-1/2 model, so the drafter (original EAGLE layout) is loaded by name into what
  SGLang's LlamaForCausalLMEagle and vLLM's EagleLlamaForCausalLM build: transformers' LlamaDecoderLayer with an
  identity input norm, `fc` over [embedding; feature], no final norm, the target's LM head. Every tensor must be
  consumed and every parameter filled.

Prints one line per check and a JSON summary (also written to DUMP_DIR/result.json); exits 1 if a check fails.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("LOGURU_LEVEL", "WARNING")  # speculators logs every remapped key at DEBUG

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# Final hidden states, float32 on both sides: max abs diff <= HIDDEN_RTOL * max |TLT's| (the residual stream of
# real models reaches thousands, e.g. 2.5e3 on SmolLM2 with massive activations, so an absolute bound would be
# meaningless; 1e-5 is ~100 float32 ulps of the largest value).
HIDDEN_RTOL = 1e-5
LOGITS_ATOL = 1e-2  # logits (tens in magnitude)
TOP1_MIN = 0.99  # draft top-1 agreement


def diff(a, b):
    return float((a.float() - b.float()).abs().max())


def hidden_ok(r, theirs, ours):
    """Records the hidden-state comparison in `r`; True when within HIDDEN_RTOL."""
    scale = float(ours.float().abs().max())
    r["hidden_max_abs_diff"] = diff(theirs, ours)
    r["hidden_max_abs"] = scale
    r["hidden_rtol"] = HIDDEN_RTOL
    return r["hidden_max_abs_diff"] <= HIDDEN_RTOL * max(scale, 1.0)


def top1(a, b):
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def target_tensor(target_dir, name):
    """One tensor of the target's HF checkpoint (single file or sharded)."""
    index = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shard = json.load(f)["weight_map"][name]
        return load_file(os.path.join(target_dir, shard))[name]
    return load_file(os.path.join(target_dir, "model.safetensors"))[name]


def check_policy(dump, m):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(m["dir"], dtype=torch.float32)
    model.eval()
    logits = load_file(os.path.join(dump, m["logits"]))
    same, worst, firsts = 0, 0.0, []
    for i, (prompt, ours) in enumerate(zip(m["prompts"], m["greedy"])):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            worst = max(worst, diff(model(ids).logits[0, -1], logits[f"p{i}"]))
            out = model.generate(ids, max_new_tokens=m["max_new_tokens"], do_sample=False,
                                 eos_token_id=m["eos"], pad_token_id=m["eos"][0], attention_mask=torch.ones_like(ids))
        theirs = out[0, len(prompt):].tolist()
        if theirs == ours:
            same += 1
        else:
            k = next((j for j, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            firsts.append({"prompt": i, "first_difference": k, "ours": ours[k:k + 4], "transformers": theirs[k:k + 4]})
    r = {"prompts": len(m["prompts"]), "greedy_identical": same, "last_logits_max_abs_diff": worst,
         "differences": firsts, "logits_atol": LOGITS_ATOL}
    ok = same == len(m["prompts"]) and worst <= LOGITS_ATOL
    if m.get("texts"):
        tok = AutoTokenizer.from_pretrained(m["dir"])
        enc = [tok(t, add_special_tokens=False)["input_ids"] for t in m["texts"]]
        r["tokenizer_identical"] = sum(a == b for a, b in zip(enc, m["prompts"]))
        r["tokenizer_class"] = type(tok).__name__
        ok = ok and r["tokenizer_identical"] == len(m["texts"])
    if m.get("chat"):
        tok = AutoTokenizer.from_pretrained(m["dir"])
        theirs = [tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True, tokenize=False)
                  for u in m["chat_users"]]
        r["chat_template_identical"] = sum(a == b for a, b in zip(theirs, m["chat"]))
        ok = ok and r["chat_template_identical"] == len(m["chat"])
    return ok, r


def check_eagle3(dump, m):
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    d = load_file(os.path.join(dump, m["inputs"]))
    with tempfile.TemporaryDirectory() as out:
        Eagle3Converter().convert(m["drafter"], out, base_model=m["target"], validate=True)
        config = Eagle3SpeculatorConfig.from_pretrained(out)
        config.transformer_layer_config._attn_implementation = "eager"  # no flex attention on CPU
        model = Eagle3DraftModel.from_pretrained(out, config=config)
    model = model.float().eval()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target_tensor(m["target"], "model.embed_tokens.weight"))
    caught = {}
    model.layers[-1].register_forward_hook(lambda _m, _i, o: caught.__setitem__("hidden", o[0] if isinstance(o, tuple) else o))
    model.lm_head.register_forward_hook(lambda _m, _i, o: caught.__setitem__("logits", o))
    t = d["aux"].shape[0]
    with torch.no_grad():
        model(hidden_states=d["aux"][None].float(), input_ids=d["input_ids"][1:][None].long(),
              document_ids=torch.zeros(1, t, dtype=torch.long), position_ids=torch.arange(t)[None], ttt_steps=1)
    h, lg = caught["hidden"][0], caught["logits"][0]
    d2t_ok = bool(torch.equal(model.d2t.long(), d["d2t"].long())) if "d2t" in d else None
    r = {"positions": t, "logits_max_abs_diff": diff(lg, d["logits"]), "top1_agreement": top1(lg, d["logits"]),
         "d2t_identical": d2t_ok, "logits_atol": LOGITS_ATOL, "top1_min": TOP1_MIN,
         "speculators_class": type(model).__name__}
    ok = (hidden_ok(r, h, d["hidden"]) and r["logits_max_abs_diff"] <= LOGITS_ATOL
          and r["top1_agreement"] >= TOP1_MIN and d2t_ok is not False)
    return ok, r


def check_eagle2(dump, m):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    d = load_file(os.path.join(dump, m["inputs"]))
    cfg = AutoConfig.from_pretrained(m["drafter"])
    cfg._attn_implementation = "eager"
    h = cfg.hidden_size
    fc = torch.nn.Linear(2 * h, h, bias=True)
    layer = LlamaDecoderLayer(cfg, 0)
    layer.input_layernorm = torch.nn.Identity()  # as both engines do for layer 0
    # Both engines prefix `model.` to every name but lm_head, then look it up in their module.
    module = torch.nn.ModuleDict({"fc": fc, "layers": torch.nn.ModuleList([layer])})
    weights = load_file(os.path.join(m["drafter"], "model.safetensors"))
    missing, unexpected = module.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    embed = target_tensor(m["target"], "model.embed_tokens.weight").float()
    try:
        head = target_tensor(m["target"], "lm_head.weight").float()
    except KeyError:
        head = embed  # tied
    t = d["feature"].shape[0]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = fc(torch.cat([embed[d["input_ids"][1:].long()], d["feature"].float()], -1))[None]
        pe = LlamaRotaryEmbedding(cfg)(x, pos)
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        lg = out @ head.T
    r = {"positions": t, "missing": missing, "unexpected": unexpected,
         "logits_max_abs_diff": diff(lg, d["logits"]), "top1_agreement": top1(lg, d["logits"]),
         "logits_atol": LOGITS_ATOL, "top1_min": TOP1_MIN,
         "reference": "transformers LlamaDecoderLayer (identity input norm), as SGLang/vLLM build it"}
    ok = (hidden_ok(r, out, d["hidden"]) and not missing and not unexpected
          and r["logits_max_abs_diff"] <= LOGITS_ATOL and r["top1_agreement"] >= TOP1_MIN)
    return ok, r


def sglang_eagle3_importable():
    try:
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3  # noqa: F401
        return "importable"
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        return f"not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    dump = sys.argv[1]
    with open(os.path.join(dump, "manifest.json")) as f:
        manifest = json.load(f)
    import speculators
    import transformers
    from importlib.metadata import version

    summary = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "speculators": version("speculators"), "python": sys.version.split()[0]},
               "sglang_eagle3": sglang_eagle3_importable(), "checks": {}}
    del speculators
    failed = False
    for name, fn in [("policy", check_policy), ("eagle3", check_eagle3), ("eagle2", check_eagle2)]:
        if name not in manifest:
            continue
        try:
            ok, r = fn(dump, manifest[name])
        except Exception as e:  # noqa: BLE001 - report and fail, do not hide which check broke
            ok, r = False, {"error": f"{type(e).__name__}: {e}"}
        r["ok"] = ok
        summary["checks"][name] = r
        failed |= not ok
        print(f"{'OK' if ok else 'FAIL'}: {name}: {json.dumps(r)}")
    with open(os.path.join(dump, "result.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary["versions"]), "| SGLang EAGLE-3 class:", summary["sglang_eagle3"])
    passed = sum(r["ok"] for r in summary["checks"].values())
    print(f"export-check: {passed} passed, {len(summary['checks']) - passed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
