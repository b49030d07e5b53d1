"""Kernels side by side on one GPU, for ``tests/test_interference.py`` and docs/sm-sharing.md.

    python -m overlap_lab.experiments.gpu_interference [--device cuda|cpu] [--out DIR]

measures the probe of ``real.interference`` (each kernel alone, every ordered pair on two
streams) and writes, under ``--out``:

- ``interference_<device>.txt``: the times, in the format of ``tests/data/interference_h200.txt``
  (replace that file's ``alone``/``pair`` lines with these to replay a new measurement);
- ``interference_<device>_kernels.json.gz``: each pair's kernels as the profiler saw them (name,
  stream, start, duration, grid, block, shared memory, registers): which cuBLAS kernel ran each
  GEMM, with which grid, and how the two streams interleaved (docs/sm-sharing.md names the two
  pairs this is for).

``--device cpu`` is a dry run on tiny shapes (no streams, no device kernels): it checks the
code, not the GPU. On a GPU the probe takes about a minute (16 pairs, each twice: timed, then
profiled).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m overlap_lab.experiments.gpu_interference")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, default=Path("overlap-lab-out") / "gpu_interference")
    p.add_argument("--no-profile", action="store_true", help="times only, no kernel records")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    from overlap_lab.real.deps import no_device

    why = no_device(opts.device)
    if why is not None:
        print(f"gpu_interference: {why}; --device cpu runs the dry run")
        return 2
    import torch

    from overlap_lab.real import interference as I

    name = torch.cuda.get_device_name() if opts.device == "cuda" else "cpu (dry run)"
    doc = I.measure(opts.device, profile=not opts.no_profile, progress=print)
    doc["device_name"] = name
    doc["torch"] = torch.__version__
    doc["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    doc["command"] = " ".join(["python -m overlap_lab.experiments.gpu_interference",
                               *(argv if argv is not None else sys.argv[1:])])  # fmt: skip
    opts.out.mkdir(parents=True, exist_ok=True)
    header = [
        f"Measured on {name}, {doc['date'][:10]}, torch {doc['torch']}, by `{doc['command']}`:",
        f"each kernel alone ({I.CALLS} calls on one stream), then B issued n_b = max(3, 40 *",
        "alone_A / alone_B) + 5 times on one stream and A 20 times on another right after;",
        "per-call times in µs.",
    ]
    txt = opts.out / f"interference_{opts.device}.txt"
    txt.write_text(I.data_text(doc, header))
    print(f"wrote {txt}")
    if not opts.no_profile:
        gz = opts.out / f"interference_{opts.device}_kernels.json.gz"
        I.write_kernels(doc, str(gz))
        print(f"wrote {gz}")
        for k, shapes in I.launch_shapes(doc).items():
            for kname, grid, block, smem, regs in sorted(shapes):
                print(f"  {k}: {kname[:70]} grid {grid} block {block} smem {smem} regs {regs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
