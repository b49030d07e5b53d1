#!/bin/bash
# One GPU session of the validation loop (real/README.md, "On a GPU"), about 10 minutes of
# device time on one H100/H200 with torch (CUDA) and triton, Python 3.12, no network, no simpy:
#   1. the GPU tests, then the loop on decode (BF16 GEMMs) with the kernel table;
#   2. the loop on prefill (BF16);
#   3. the interference measurement (real/interference.py);
#   4. the loop on decode and prefill in FP8 (DeepGEMM), where deep_gemm imports.
# Everything lands under $OUT: each command's archive and log, the results files
# (gpu_<preset>[_fp8].{json,md}, kernels_<preset>.{json,md}: commit them to experiments/results)
# and env.txt. A command stopped at its time limit still leaves its archive (rewritten after
# every schedule).
#
# Usage, from the checkout's root: OUT=/some/folder bash experiments/gpu_session.sh [WHEELS]
# WHEELS (default .whl, a folder git ignores, carried with the checkout) holds the wheels
# real/README.md downloads: simpy (required), and optionally DeepGEMM
# (tokenspeed-deepgemm) and FlashMLA (sgl-flash-mla), both used by every run when present.
set -u
OUT=${OUT:?set OUT to the folder the results go to}
WHL=${1:-.whl}
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

loop() {  # name, hard limit in seconds, then the loop's options
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T))"
    timeout --signal=TERM "$limit" $PY -m overlap_lab.experiments.gpu_validation \
        --out "$OUT" --name "$name" --results "$OUT/results" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $? after ${SECONDS}s of the session; last line:"
    tail -n 1 "$OUT/$name.log"
}

loop bf16_decode 190 --modes decode --gemm-dtype bf16 --pytest --pytest-timeout-s 80 \
    --kernels --budget-s 100
loop bf16_prefill 100 --modes prefill --gemm-dtype bf16 --budget-s 75
echo "== interference ($(date -u +%T))"
timeout 70 $PY -m overlap_lab.experiments.gpu_interference --out "$OUT" \
    > "$OUT/interference.log" 2>&1
echo "   exit $?; session ${SECONDS}s"
if $PY -c "import deep_gemm" 2> /dev/null; then
    loop fp8_decode 120 --modes decode --budget-s 90
    loop fp8_prefill 70 --modes prefill --budget-s 55
else
    echo "== FP8 skipped: deep_gemm does not import (add its wheel to $WHL)"
    $PY -c "import deep_gemm" 2>&1 | tail -n 3
fi
ls -la "$OUT" "$OUT/results"
