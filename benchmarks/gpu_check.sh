#!/usr/bin/env bash
# The one-GPU check, in under 5 minutes on one H100: the CUDA tests; `meshtorch plan --calibrate --device cuda`
# (this GPU's kernel numbers, to $RESULTS/gpu-calibration.json); benchmarks/gpu_step.py --quick (meshtorch
# eager and compiled vs plain PyTorch with SDPA and fused AdamW, at 124M and ~1.3B, each profiled for two more
# steps: GPU busy/idle time and top kernels); then planned vs
# measured (benchmarks/plan_vs_gpu_step.py: every variant gpu_step measured, planned on the built-in spec
# of the GPU's kind and on the calibrated file, to $RESULTS/plan_vs_gpu_step.md).
#
#   bash benchmarks/gpu_check.sh            # from anywhere; uses python3 (or $PYTHON)
#
# Needs only torch (and meshtorch's own dependencies) on the machine: meshtorch runs from src/ of this
# checkout (PYTHONPATH), nothing is installed. Without pytest the tests are skipped and said so.
# GPU_CHECK_RESULTS (default benchmarks/results) is where the benchmark writes gpu_step.{json,md}.
# GPU_CHECK_SECONDS (default 290) is the whole check's wall-clock budget: the tests get at most 150 s,
# the calibration at most 60 s, the comparison the last 30 s, the benchmark the rest. The benchmark
# starts no variant in its last 75 s (--budget-s) and is stopped at its share; it writes
# $RESULTS/gpu_step.{json,md} after every variant, so a stopped run keeps what it measured (the
# variant it was in is marked "running" there) and the comparison plans what it did measure.
# Without a GPU it runs the CPU side instead: the same tests (CUDA ones skip), the calibration's code on
# the CPU at tiny sizes (measure_gpu("cpu", quick=True) standing in for the GPU), gpu_step.py --dry-run
# and the comparison of its rows, all into a temporary directory.
# Exit status: 0 all passed; 1 a test or a benchmark variant failed (or losses differ); 3 the benchmark
# was stopped at the time budget; 2 the setup is broken (torch or meshtorch does not import).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_SECONDS:-290}"
RESULTS="${GPU_CHECK_RESULTS:-benchmarks/results}"  # where gpu_step.{json,md} go
start=$SECONDS
status=0

gpu=$("$PY" -c "import torch, meshtorch; print(int(torch.cuda.is_available()))") || {
    echo "gpu_check: torch or meshtorch (from $PWD/src) does not import with $PY"; exit 2; }
"$PY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU: CPU side only')"

# ---- the CUDA tests: tests/test_gpu_path.py whole, and the tests named or parametrised cuda/gpu in
# every other file that asks torch for a GPU
if "$PY" -c "import pytest" 2>/dev/null; then
    others=$(grep -lE "torch\.cuda\.is_available\(\)|pytest\.mark\.cuda" tests/test_*.py | grep -v "tests/test_gpu_path.py")
    echo "== tests: tests/test_gpu_path.py${others:+ and -k 'cuda or gpu' in }$(echo $others)"
    # (less the CPU's compiled training run, the CI's job: 64 s of the 150 on an H200, which left the
    # benchmark too little time for its compiled and 1b rows)
    timeout -k 5 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_path.py \
        --deselect "tests/test_gpu_path.py::test_meshtorch_train_on_the_device[compiled-cpu]"
    rc=$?
    if [ -n "$others" ]; then
        t=$((150 - (SECONDS - start))); [ $t -lt 20 ] && t=20
        timeout -k 5 $t "$PY" -m pytest -q -p no:cacheprovider -k "cuda or gpu" $others
        rc2=$?
        [ $rc2 -eq 5 ] && rc2=0  # nothing selected
        [ $rc -eq 0 ] && rc=$rc2
    fi
    [ $rc -ne 0 ] && { echo "gpu_check: tests failed (exit $rc)"; status=1; }
else
    echo "== tests: skipped (pytest is not installed for $PY)"
fi
echo "== tests took $((SECONDS - start)) s"

# ---- the calibration: meshtorch plan --calibrate --device cuda (on the CPU, its code at tiny sizes)
[ "$gpu" = "1" ] || RESULTS=$(mktemp -d)   # the dry run leaves benchmarks/results alone
mkdir -p "$RESULTS"
CALIBRATION="$RESULTS/gpu-calibration.json"
t0=$SECONDS
if [ "$gpu" = "1" ]; then
    echo "== calibration: meshtorch plan --calibrate --device cuda --calibrate-out $CALIBRATION"
    timeout -k 5 60 "$PY" -m meshtorch plan --calibrate --device cuda --calibrate-out "$CALIBRATION"
    rc=$?
else
    echo "== calibration: no GPU, so measure_gpu('cpu', quick=True) stands in (to $CALIBRATION)"
    timeout -k 5 60 "$PY" -c "import sys; from meshtorch.plan.devices import save_spec
from meshtorch.plan.gpu_calibration import measure_gpu
save_spec(measure_gpu('cpu', quick=True), sys.argv[1])" "$CALIBRATION"
    rc=$?
fi
[ $rc -ne 0 ] && { echo "gpu_check: the calibration failed (exit $rc)"; status=1; }
echo "== calibration took $((SECONDS - t0)) s"

# ---- the benchmark (the last 30 s of the budget are the comparison's)
left=$((BUDGET - (SECONDS - start) - 30))
if [ "$gpu" = "1" ]; then
    [ $left -lt 60 ] && { echo "gpu_check: only $left s left for the benchmark; not started"; exit 3; }
    echo "== benchmark: gpu_step.py --quick --profile 2 (${left} s left; no variant starts after $((left - 75)) s)"
    # --profile 2: two more steps per variant under torch.profiler, GPU busy/idle and top kernels
    timeout -k 10 "$left" "$PY" benchmarks/gpu_step.py --quick --profile 2 --budget-s $((left - 75)) --out "$RESULTS"
    rc=$?
else
    echo "== benchmark: no GPU, so gpu_step.py --dry-run (the tiny model on the CPU, eager variants)"
    timeout -k 10 "$((left > 60 ? left : 60))" "$PY" benchmarks/gpu_step.py --dry-run \
        --variants meshtorch-eager,plain-eager --out "$RESULTS"
    rc=$?
fi
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "gpu_check: the benchmark was stopped at the time budget; $RESULTS/gpu_step.md has what it measured:"
    [ "$gpu" = "1" ] && cat "$RESULTS/gpu_step.md"
    [ $status -eq 0 ] && status=3
elif [ $rc -ne 0 ]; then
    echo "gpu_check: the benchmark reports a failure (exit $rc): see its table above"
    status=1
fi

# ---- planned vs measured: what gpu_step measured, planned on the built-in spec and on the calibration
if [ -f "$RESULTS/gpu_step.json" ]; then
    # the built-in spec of this GPU's kind (meshtorch.plan.gpus; none for a GPU not in its table, which
    # is then compared with its calibration alone); the dry run prices the CPU's rows as an h100
    kind=$("$PY" -c "import torch; from meshtorch.plan.gpus import gpu_kind
k = gpu_kind(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
print(k.spec if k else ('' if torch.cuda.is_available() else 'h100'))")
    hardware=()
    [ -n "$kind" ] && hardware+=(--hardware "$kind")
    [ -f "$CALIBRATION" ] && hardware+=(--hardware "$CALIBRATION")
    echo "== planned vs measured: plan_vs_gpu_step.py ${hardware[*]}"
    timeout -k 5 60 "$PY" benchmarks/plan_vs_gpu_step.py --results "$RESULTS" "${hardware[@]}"
    rc=$?
    [ $rc -ne 0 ] && { echo "gpu_check: the comparison failed (exit $rc)"; status=1; }
else
    echo "== planned vs measured: skipped (no $RESULTS/gpu_step.json)"
fi
echo "== gpu_check: $((SECONDS - start)) s in all, exit $status"
exit $status
