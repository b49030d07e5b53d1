"""The event loop's CPU time on single-rank DeepSeek-V3 cases, for comparing two revisions.

    python -m overlap_lab.experiments.bench_engine_ab

prints one JSON line: per case, ``Engine.run`` CPU ms (best of 15 after a warm-up) and the step
time (which tells the revisions' models apart). Every layer is simulated (``fast_forward=False``
where the revision has the fast-forward, ``sim.fastforward``): this times the event loop;
``--fast-forward`` times the runs as ``overlap-lab sim`` makes them (construction included, where
the fast-forward finds the repeated layers). Issue 8's budget (the SM model may not slow the
simulator by more than 1.5x) was checked with it: run it once per revision, interleaved, the old
one installed with ``pip install --no-deps --target DIR`` from its ``git archive`` and put first
on ``PYTHONPATH`` (the results are in ``experiments/results/bench_sim.md``). It times only the
interpreter; ``bench_sim`` times whole runs.
"""

from __future__ import annotations

import json
import time

#: (schedule, mode): decode is 128 sequences of 4K context, prefill 4 x 4096 tokens, EP 32
CASES = (
    ("serial", "decode"),
    ("tbo", "decode"),
    ("serial", "prefill"),
    ("tbo", "prefill"),
    ("deepseek", "prefill"),
)


def main(repeats: int = 15, fast_forward: bool = False) -> dict[str, tuple[float, float]]:
    import inspect

    from overlap_lab.shared.inputs.hardware import get_gpu
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
    from overlap_lab.shared.schedules import build
    from overlap_lab.sim.engine import Engine

    kw = {}
    if "fast_forward" in inspect.signature(Engine).parameters:  # (older revisions lack it)
        kw["fast_forward"] = fast_forward
    elif fast_forward:
        raise SystemExit("this revision has no fast-forward")

    def run(program):
        if fast_forward:  # the whole run, as `overlap-lab sim` makes it
            return Engine(program, gpu, **kw).run()
        eng = Engine(program, gpu, **kw)  # the event loop alone
        t = time.process_time()
        trace = eng.run()
        return trace, time.process_time() - t

    gpu = get_gpu("h800")
    out = {}
    for schedule, mode in CASES:
        b = (
            Batch.decode(128, kv_len=4096)
            if mode == "decode"
            else Batch.prefill(4, extend_len=4096)
        )
        w = Workload(get_model("deepseek-v3"), b, Parallel(ep=32))
        program = build(schedule, w, gpu)
        Engine(program, gpu, **kw).run()  # warm-up: imports and caches
        best, trace = float("inf"), None
        for _ in range(repeats):
            t = time.process_time()
            trace = run(program)
            took = time.process_time() - t
            if not fast_forward:
                trace, took = trace
            best = min(best, took)
        out[f"{schedule}_{mode}"] = (round(best * 1e3, 1), round(trace.step_time_us, 1))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    import sys

    main(fast_forward="--fast-forward" in sys.argv[1:])
