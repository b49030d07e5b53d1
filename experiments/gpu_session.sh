#!/bin/bash
# One GPU session of the validation loop (real/README.md, "On a GPU"): one call of at most ten
# minutes on one H100/H200 with torch (CUDA) and triton, Python 3.12, no network, no simpy.
# In this order, each step under a hard limit (their sum below SESSION_S, 570 s by default; a
# step starts only if its limit still fits, so the call ends on time):
#   1. the kernel table (experiments/gpu_session_steps.py kernels: every op class the executor
#      runs against the device's best; it compiles DeepGEMM's kernels, cached for the loops);
#   2. the loop on decode 32 and 128, BF16 GEMMs (the loop's own budget covers calibration and
#      schedules: on the H200, 2026-11-27, decode 32 took 104 s for 11 schedules, decode 128's
#      calibration 49 s; the schedules run in the order given, the verdict's first), then on
#      prefill 4096;
#   3. the loop on decode 32 in FP8 (DeepGEMM), then prefill FP8 serial and sglang-overlap,
#      where deep_gemm imports;
#   4. the interference measurement (experiments/gpu_interference.py);
#   5. the GPU tests (gpu_session_steps.py pytest: written to pytest_gpu.log as they end, a
#      per-test limit, DeepGEMM's JIT test last), in the time left.
# Everything lands under $OUT: each command's archive and log, the results files
# (kernels_<preset>.{json,md}, gpu_<preset>[_fp8].{json,md}: commit them to experiments/results)
# and env.txt. A command stopped at its time limit still leaves its archive (rewritten after
# every schedule) and the GPU tests' log.
#
# Usage, from the checkout's root: OUT=/some/folder bash experiments/gpu_session.sh [WHEELS]
# WHEELS (default .whl, a folder git ignores, carried with the checkout) holds the wheels
# real/README.md downloads: simpy (required), and optionally DeepGEMM
# (tokenspeed-deepgemm) and FlashMLA (sgl-flash-mla), both used by every run when present.
set -u
OUT=${OUT:?set OUT to the folder the results go to}
WHL=${1:-.whl}
SESSION_S=${SESSION_S:-570}
mkdir -p "$OUT/results"
exec > >(tee -a "$OUT/session.log") 2>&1

SITE=/tmp/site
rm -rf "$SITE" /tmp/ol && mkdir -p "$SITE" /tmp/ol/overlap_lab
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHL"/*.whl \
    || { echo "session: the wheels in $WHL did not install"; exit 2; }
# the namespace mapped onto the checkout (pyproject.toml's package-dir table; no build step)
cp -r overlap_lab/. /tmp/ol/overlap_lab/
for d in shared sim real experiments; do ln -sfn "$PWD/$d" "/tmp/ol/overlap_lab/$d"; done
export PYTHONPATH=/tmp/ol:$SITE PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PY="python3 -P"

{
    nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
    $PY -c "import sys, torch, triton; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))"
    $PY -c "from overlap_lab.real.deps import probe; print({k: v.get('version') for k, v in probe().items()})"
    date -u
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

fits() {  # a step of $1 seconds still fits in the session
    if [ $((SECONDS + $1)) -gt "$SESSION_S" ]; then
        echo "== skipped: $1 s do not fit in the $((SESSION_S - SECONDS)) s left"
        return 1
    fi
}

loop() {  # name, hard limit in seconds, then the loop's options
    local name=$1 limit=$2
    shift 2
    fits "$limit" || return 0
    echo "== $name ($(date -u +%T))"
    timeout --signal=TERM "$limit" $PY -m overlap_lab.experiments.gpu_validation \
        --out "$OUT" --name "$name" --results "$OUT/results" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $? after ${SECONDS}s of the session; last line:"
    tail -n 1 "$OUT/$name.log"
}

if fits 90; then
    echo "== kernel table ($(date -u +%T))"
    timeout 90 $PY -m overlap_lab.experiments.gpu_session_steps kernels --out "$OUT" \
        > "$OUT/kernels.log" 2>&1
    echo "   exit $? after ${SECONDS}s of the session; last line:"
    tail -n 1 "$OUT/kernels.log"
fi
# pp left out: its two stages run in one process (excluded from the verdict), 139 ms a step
loop bf16_decode 210 --modes decode --gemm-dtype bf16 --budget-s 190 --schedules \
    serial,comm-only,tbo,sbo,sbo-off,tbo+sbo,vllm-dbo,deepseek,lightllm,sglang-overlap
loop bf16_prefill 75 --modes prefill --gemm-dtype bf16 --budget-s 55 --schedules \
    serial,comm-only,tbo,sbo,sbo-off,tbo+sbo,vllm-dbo,deepseek,lightllm,sglang-overlap
if $PY -c "import deep_gemm" 2> /dev/null; then
    loop fp8_decode 55 --modes decode --batches 32 --budget-s 40
    loop fp8_prefill 40 --modes prefill --schedules serial,sglang-overlap --budget-s 30
else
    echo "== FP8 skipped: deep_gemm does not import (add its wheel to $WHL)"
    $PY -c "import deep_gemm" 2>&1 | tail -n 3
fi
if fits 25; then
    echo "== interference ($(date -u +%T))"
    timeout 25 $PY -m overlap_lab.experiments.gpu_interference --out "$OUT" \
        > "$OUT/interference.log" 2>&1
    echo "   exit $?; session ${SECONDS}s"
fi
if fits 60; then
    echo "== GPU tests ($(date -u +%T))"
    timeout 60 $PY -m overlap_lab.experiments.gpu_session_steps pytest --out "$OUT" \
        --limit-s 55 > "$OUT/pytest.log" 2>&1
    echo "   exit $?; session ${SECONDS}s; $(tail -n 1 "$OUT/pytest.log")"
fi
ls -la "$OUT" "$OUT/results"
