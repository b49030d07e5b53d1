"""Predicted vs measured on one device, in one command per mode: ``python -m overlap_lab.experiments.gpu_validation``.

For every schedule, at decode batches 32 and 128 and one prefill size, on 4 layers of
DeepSeek-V3 shape (EP 32 emulated on one GPU by the ``emulated`` backend):
1. calibration: ``serial`` measured at the token counts the schedules run (the batch and its
   half, for micro-batched schedules) under torch.profiler: each op's duration is the sum of
   its kernels' DEVICE times (``overlap_lab.device_time``; graph replays where the op ran in
   one, with the gaps between its own kernels), never its CUDA-event span, which holds launch
   gaps; made a profile by the simulator's own calibration path
   (``sim.calibrate.profile_from_trace``). The gap a replayed graph leaves before each kernel
   is measured too (serial's unprofiled replay step less its kernels' device time, per kernel)
   and predicted with (``GPU.graph_kernel_gap_us``), and so are the executor's launches: the
   wait before a replayed graph's first kernel (``GPU.graph_launch_us``, per graph by its
   first segment: ``overlap_lab.graph_launch``) and each eager op's
   host steps and read-backs, scaled by serial's unprofiled run (``predict.calibrate``);
2. prediction: ``overlap_lab.simulate(schedule, ..., profile=that profile)`` of the Program as
   the executor ran it (``predict.as_executed``: the executor's host spans for the Program's
   host work, not SGLang's scheduler costs; every SM for an op whose SM limit the run reports
   not enforced; no op the run launched no kernel for). Compute ops a profile row cannot name
   (outside ``sim.profile.PROFILED_OPS``: SBO's and LightLLM's split expert kernels) get class
   rows measured in a short run of the schedule itself recorded with its kernels (device time,
   ``own_rows``): no roofline rows in a validation; each row says per op class where the
   predicted durations came from (``cost_sources``) and lists any op the roofline still times
   (``roofline_ops``). Communication: one link model on both sides (``shared.ir.links``: the
   emulated backend times each send by the bytes of the Program's own flows, ``--link-bytes``,
   and holds a normal kernel by its channels' rate on its SMs, as the simulator does); the
   ``comm-only`` case (dispatch and combine alone) checks it, target within 5 %;
3. measurement: the schedule on the device (CUDA graphs replayed for the step time, plus an
   eager pass for per-op spans; the trace meta says which number is which);
4. comparison: step time, exposed communication, per-op error; a markdown table, a JSON file,
   the predicted and measured traces (Chrome JSON) and figures, all packed into ONE archive
   ``<out>/<name>.tar.gz`` (``--out``; on a machine that hands back a folder, that folder),
   with what a replay needs (the calibration runs and own-rows runs with their kernel records).

``--replay ARCHIVE`` re-judges a recorded archive offline with today's calibration and
simulator (``replay``; no GPU); ``convert`` makes an archive from before replays replayable,
``residual`` attributes what a replay of an older executor's recording leaves.

``--device cpu`` is a dry run of exactly the same path on a scaled-down model (tiny-mla, CPU
tensors, the emulated backend's data path, one timed run): its times are host wall-clock and
meaningless, the table says so and its last line says that it judged nothing. It runs in CI
(tests/test_real_validation.py).
``--device cuda`` without a GPU prints one line and exits 2. ``pp`` runs both pipeline stages in
one process on one GPU: it is measured and predicted but left out of the error medians and the
ranking. Options: ``--modes decode,prefill``, ``--batches 32,128``, ``--prefill 4096``,
``--schedules a,b``, ``--layers 4``, ``--ep 32``, ``--kv-len 2048``, ``--repeats 5``,
``--warmup 2``, ``--budget-s 540`` (cases left when it is spent are recorded as skipped),
``--pytest`` (run the GPU tests first), ``--name`` (the archive's name), ``--results`` (where
``gpu_<device>.{json,md}`` go: experiments/results on a GPU), ``--kernels`` (also the kernel
table, ``kernels_<device>.{json,md}``), ``--link-bytes program|routing``, ``--gemm-dtype
model|bf16`` (a BF16 loop where the executor could run FP8).

The LAST line printed is the verdict (:func:`verdict_line`): median |step-time error| <= 5 %,
max <= 10 %, the same ranking on both sides (schedules within 2 % tied), exposed communication
within 10 % or 50 µs, and the comm-only case within 5 % where it ran: PASS/FAIL with the numbers.
The exit status does not depend on it (errors and failed GPU tests do).

From other code (``overlap-lab validate --device cuda|cpu``): ``run_validation(parse(argv))``
returns the report (``report["table"]``, ``report["archive"]``, per case and schedule the
comparison of ``overlap_lab.validate.compare``, the simulator's validation).

The package, by job: ``driver`` (the loop and its command line), ``context`` (what the cases
share, and the measured and recorded runs), ``comm_only`` (the communication-only case),
``predict`` (the calibration, the prediction as executed and the comparison), ``verdict``
(PASS/FAIL), ``report`` (the table, the figures, the results files), ``archive`` (the one
archive), ``environment`` (the machine, the GPU tests), ``replay`` (an archive re-judged),
``convert`` and ``residual`` (recordings from before replays).
"""

from overlap_lab.experiments.gpu_validation.archive import Archive
from overlap_lab.experiments.gpu_validation.comm_only import (
    COMM_ONLY,
    COMM_OPS,
    comm_kernels,
    comm_only,
    comm_program,
)
from overlap_lab.experiments.gpu_validation.context import (
    Context,
    Setup,
    case_workload,
    loop_precision,
)
from overlap_lab.experiments.gpu_validation.driver import (
    CPU_DEFAULTS,
    GPU_DEFAULTS,
    NO_GPU,
    main,
    parse,
    run_case,
    run_validation,
)
from overlap_lab.experiments.gpu_validation.environment import (
    ROOT,
    device_preset,
    environment,
    run_pytest,
)
from overlap_lab.experiments.gpu_validation.predict import (
    CalibrationRun,
    as_executed,
    build,
    calibrate,
    calibrate_profile,
    comparison,
    judge,
    measured_step,
    own_rows,
    predict,
    prediction_workload,
    roofline_ops,
    sources_text,
)
from overlap_lab.experiments.gpu_validation.replay import replay, replay_setup
from overlap_lab.experiments.gpu_validation.report import (
    merged,
    results_stem,
    table,
    write_kernel_table,
    write_results,
)
from overlap_lab.experiments.gpu_validation.verdict import (
    DRY_RUN_LINE,
    NOT_COMPARABLE,
    TARGETS,
    discordant_pairs,
    not_comparable,
    ranking,
    summarize,
    verdict,
    verdict_line,
)

__all__ = [
    "COMM_ONLY",
    "COMM_OPS",
    "CPU_DEFAULTS",
    "DRY_RUN_LINE",
    "GPU_DEFAULTS",
    "NOT_COMPARABLE",
    "NO_GPU",
    "ROOT",
    "TARGETS",
    "Archive",
    "CalibrationRun",
    "Context",
    "Setup",
    "as_executed",
    "build",
    "calibrate",
    "calibrate_profile",
    "case_workload",
    "comm_kernels",
    "comm_only",
    "comm_program",
    "comparison",
    "device_preset",
    "discordant_pairs",
    "environment",
    "judge",
    "loop_precision",
    "main",
    "measured_step",
    "merged",
    "not_comparable",
    "own_rows",
    "parse",
    "predict",
    "prediction_workload",
    "ranking",
    "replay",
    "replay_setup",
    "results_stem",
    "roofline_ops",
    "run_case",
    "run_pytest",
    "run_validation",
    "sources_text",
    "summarize",
    "table",
    "verdict",
    "verdict_line",
    "write_kernel_table",
    "write_results",
]
