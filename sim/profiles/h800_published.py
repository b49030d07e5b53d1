"""The built-in profile ``h800-published``: DeepSeek's published isolated H800 benchmarks as rows.

    python -m overlap_lab.sim.profiles.h800_published   # rewrites h800-published.json

Every row is one cell of a published table, converted from TFLOP/s to µs (``us = flops /
TFLOP/s``) and citing its cell. GEMM rows carry their FLOPs, so the simulator reads them as
throughputs (``sim.profile``): the dense table's six shapes are DeepSeek-V3's own layer GEMMs
(fused q_a+kv_a 2112×7168, q_b 24576×1536, kv_b 32768×512, o_proj 7168×16384, shared-expert
gate_up 4096×7168 and down 7168×2048), each row carrying its shape, so an op made of some of
them is timed from their own rows (``attn.prepare`` from q_a+kv_a and q_b, ``attn.o_proj`` from
o_proj, ``shared_experts`` from gate_up and down) and any other FP8 GEMM from their pool at M
tokens; the grouped tables (expert gate_up 4096×7168 and down 7168×2048) pool per layout into one
``grouped_gemm`` throughput at the FLOPs of gate_up + down (a grouped op's rows per expert follow
routing, so its shape cannot be read off its FLOPs per token). Below the smallest row (M = 64, or
the masked table's 1,024 tokens) split ops take the smallest row's throughput on work padded to
a whole M tile, held to their HBM bytes' read time (``sim.profile``, "Lookup").

Not rows, and why: FlashMLA publishes peaks (3000 GB/s memory-bound, 580 TFLOP/s compute-bound),
not a table over sizes; the roofline's attention efficiencies (``sim.cost``: 0.9 × 3350 GB/s,
0.6 × 989 TFLOP/s) already sit at those peaks. DeepEP's tables time communication, which the link
model carries (``experiments/exp_deepep_tables.py`` checks it against every row).
"""

from __future__ import annotations

import json
from pathlib import Path

DEEPGEMM = "DeepGEMM README (2025-03-25, commit 8002b769)"
SMS = 132  # H800 SXM; DeepGEMM's persistent kernels use every SM by default
#: The configuration the rows hold for: the h800 preset's fields a compute row may depend on
#: (``sim.profile.DEPENDABLE``). An override of one (``--hbm-gbps``) drops the rows depending on
#: it; any other override (links, communication SMs, a renamed copy) keeps them all.
GPU_FIELDS = {"arch": "hopper", "num_sms": SMS, "hbm_gbps": 3350.0, "bf16_tflops": 989.4,
              "fp8_tflops": 1978.9}  # fmt: skip

#: dense FP8 GEMMs: (N, K) -> {M: TFLOP/s}
NORMAL: dict[tuple[int, int], dict[int, int]] = {
    (2112, 7168): {64: 206, 128: 352, 4096: 1009},
    (24576, 1536): {64: 289, 128: 535, 4096: 1125},
    (32768, 512): {64: 219, 128: 358, 4096: 751},
    (7168, 16384): {64: 336, 128: 645, 4096: 1426},
    (4096, 7168): {64: 287, 128: 533, 4096: 1265},
    (7168, 2048): {64: 295, 128: 510, 4096: 1168},
}
#: grouped FP8 GEMMs: layout -> {(groups, M per group): {(N, K): TFLOP/s}}
GROUPED: dict[str, dict[tuple[int, int], dict[tuple[int, int], int]]] = {
    "contiguous": {
        (4, 8192): {(4096, 7168): 1346, (7168, 2048): 1214},
        (8, 4096): {(4096, 7168): 1346, (7168, 2048): 1214},
    },
    "masked": {
        (1, 1024): {(4096, 7168): 1233, (7168, 2048): 925},
        (2, 512): {(4096, 7168): 1040, (7168, 2048): 916},
        (4, 256): {(4096, 7168): 932, (7168, 2048): 815},
    },
}


def _us(flops: float, tflops: float) -> float:
    return flops / (tflops * 1e6)  # 1 TFLOP/s = 1e6 FLOP/µs


def build() -> dict:
    rows = []
    for (n, k), by_m in NORMAL.items():
        for m, tf in by_m.items():
            flops = 2.0 * m * n * k
            rows.append({
                "op": "gemm", "dtype": "fp8", "size": m, "sms": SMS, "us": _us(flops, tf),
                "flops": flops, "shape": [[n, k]],
                "source": f"{DEEPGEMM}, normal GEMM M={m} N×K={n}×{k}: {tf} TFLOP/s",
            })  # fmt: skip
    for layout, configs in GROUPED.items():
        for (g, m), by_shape in configs.items():
            total = sum(2.0 * g * m * n * k for n, k in by_shape)  # gate_up + down of the experts
            for (n, k), tf in by_shape.items():
                flops = 2.0 * g * m * n * k
                rows.append({
                    "op": "grouped_gemm", "dtype": "fp8", "size": total, "size_unit": "flops",
                    "sms": SMS, "us": _us(flops, tf), "flops": flops,
                    "source": f"{DEEPGEMM}, grouped {layout} {g}×{m} N×K={n}×{k}: {tf} TFLOP/s",
                })  # fmt: skip
    return {
        "format": "overlap-lab-profile/1",
        "device": "NVIDIA H800 SXM5 (132 SMs)",
        "date": "2025-03-25",
        "software": {"DeepGEMM": "8002b769"},
        "source": "DeepSeek's published isolated H800 kernel benchmarks (github.com/deepseek-ai/"
        "DeepGEMM README); see overlap_lab/sim/profiles/h800_published.py",
        "notes": " ".join(__doc__.split("\n\n", 2)[2].split()),
        "gpu": GPU_FIELDS,
        "rows": rows,
    }


def main() -> None:
    path = Path(__file__).with_name("h800-published.json")
    path.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n")
    print(path)


if __name__ == "__main__":
    main()
