#!/bin/sh
# Rebuilds tests/data/h200_decode128_replay.tar.gz from the loop's H200 recordings of 2026-11-26
# (tests/data/README.md): the decode archive and the torch.profiler traces of serial and TBO at
# decode 128, converted to a replayable archive (experiments/gpu_validation/convert.py) with
# the serial and TBO runs only, one eager run and one graph replay of each kernel record.
# Usage, from the checkout's root: sh tests/data/build_h200_replay.sh RECORDINGS_FOLDER
set -eu
rec=$1
python -m overlap_lab.experiments.gpu_validation.convert \
    "$rec/gpu_validation_cuda_decode.tar.gz" \
    --calibration "decode_128=serial:$rec/k_decode128_serial.json.gz,tbo:$rec/k_decode128_tbo.json.gz" \
    --schedules serial,tbo --last-runs 1 --out tests/data --name h200_decode128_replay
