"""Loads a LoRA adapter directory written by tlt-model (`tlt_model::peft::save_peft_dir`) with PEFT onto its base
model (an HF directory, loaded by transformers in f32 on the CPU) and compares the logits with the ones tlt-model
computed from the merged weights; then PEFT's `merge_and_unload` against the same logits.

usage: check_peft_adapter.py BASE_DIR ADAPTER_DIR EXPECTED_JSON
EXPECTED_JSON: {"ids": [...], "logits": [...] (flat, [len(ids), vocab]), "r": int, "alpha": float}
"""

import json
import sys

import torch
from peft import PeftConfig, PeftModel
from transformers import AutoModelForCausalLM


def main() -> int:
    base_dir, adapter_dir, expected_path = sys.argv[1:4]
    with open(expected_path) as f:
        exp = json.load(f)
    ids = torch.tensor([exp["ids"]])
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base.eval()
    with torch.no_grad():
        base_logits = base(ids).logits[0]
    want = torch.tensor(exp["logits"], dtype=torch.float32).reshape(base_logits.shape)
    cfg = PeftConfig.from_pretrained(adapter_dir)
    assert cfg.peft_type == "LORA" and cfg.r == exp["r"] and float(cfg.lora_alpha) == exp["alpha"], cfg
    model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits[0]
    scale = want.abs().max().item()
    diff = (logits - want).abs().max().item()
    control = (base_logits - want).abs().max().item()
    merged = model.merge_and_unload()
    with torch.no_grad():
        merged_diff = (merged(ids).logits[0] - want).abs().max().item()
    print(
        f"peft {__import__('peft').__version__}: the adapter's logits within {diff:.2e} of tlt-model's merged "
        f"forward (largest {scale:.3f}); merge_and_unload within {merged_diff:.2e}; the base alone {control:.2e} away"
    )
    tol = 1e-4 * max(1.0, scale)
    if diff > tol or merged_diff > tol:
        print(f"FAIL: beyond {tol:.1e}")
        return 1
    if control <= 100 * max(diff, 1e-7):
        print("FAIL: the control (the base without the adapter) is as close: the check has no power")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
