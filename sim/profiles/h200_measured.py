"""The built-in profile ``h200-measured``: DeepGEMM and FlashMLA kernels timed alone on one H200.

    python -m overlap_lab.sim.profiles.h200_measured   # rewrites h200-measured.json

The raw rows are ``h200-measured-rows.jsonl`` beside this file, one JSON object per line, as the
benchmark printed them (measured 2026-11-26 on one NVIDIA H200 SXM, 132 SMs, driver 580.159.04,
torch 2.11.0+cu130, tokenspeed-deepgemm 2.3.0.post20251110, sgl-flash-mla 1.0.0): lines 1-45
DeepGEMM dense GEMMs ``Y = X W^T`` (``fp8_gemm_nt``, ``bf16_gemm_nt``) on five of the six shapes of
DeepGEMM's published H800 table (the sixth, 7168×2048, and the grouped shapes were not reached),
M = 64/128/4096, FP8 also with ``deep_gemm.set_num_sms`` 108 and 66; lines 46-63 FlashMLA's dense
(legacy) decode kernel, 128 heads, batch 32/64/128 × KV 1024/2048/4096 × 1 or 2 query tokens per
sequence (2: a multi-token-prediction verify step). Every profile row cites its line.

GEMM rows carry their FLOPs and their shape, as ``h800-published``'s do: an op made of measured
shapes is timed from their rows, any other GEMM from their pool per (M, SMs) and dtype. FlashMLA rows are ``attn.core`` rows sized by the FLOPs this project's
decode attention counts for that batch (``shared.ir.ops``: 2 · heads · query-key pairs ·
(kv_lora + rope + kv_lora), the KV length counting the new tokens), held to the decode kernel's
static split (``grid: persistent``) so that no prefill attention (FlashAttention-3's dynamic grid)
takes them. The FLOP axis orders the table well: two query tokens nearly double the time at one KV
length, as they double the FLOPs.

Not rows: grouped GEMMs (``experts``: the roofline), the GEMMs' SM-count rows are rows (the wave
model carries the 132-SM ones elsewhere), and the wave model's check against them is
``tests/test_profile.py`` (docs/models-and-gpus.md says where it misses).
"""

from __future__ import annotations

import json
from pathlib import Path

RAW = Path(__file__).with_name("h200-measured-rows.jsonl")
DATE = "2026-11-26"
SOFTWARE = {
    "torch": "2.11.0+cu130",
    "DeepGEMM": "tokenspeed-deepgemm 2.3.0.post20251110",
    "FlashMLA": "sgl-flash-mla 1.0.0",
    "driver": "580.159.04",
}
#: The configuration the rows hold for: the h200 preset's fields a compute row may depend on.
GPU_FIELDS = {"arch": "hopper", "num_sms": 132, "hbm_gbps": 4800.0, "bf16_tflops": 989.4,
              "fp8_tflops": 1978.9}  # fmt: skip
#: DeepSeek-V3's MLA (config.json): latent and rope widths; FlashMLA decode reads the 576-wide
#: latent per key and writes the 512-wide latent per query head.
KV_LORA, ROPE = 512, 64


def mla_decode_flops(batch: int, kv: int, s_q: int, heads: int) -> float:
    """What ``shared.ir.ops.mla_core`` counts for FlashMLA: 2·heads·pairs·(latent + kv_lora), with
    pairs = batch · (s_q · cached + s_q(s_q+1)/2) and cached = kv - s_q."""
    pairs = batch * (s_q * (kv - s_q) + s_q * (s_q + 1) / 2)
    return 2.0 * heads * pairs * (KV_LORA + ROPE + KV_LORA)


def _cite(line: int, what: str) -> str:
    lib = SOFTWARE["DeepGEMM"] if "GEMM" in what else SOFTWARE["FlashMLA"]
    return f"h200-measured-rows.jsonl line {line} ({DATE}; {lib}, {SOFTWARE['torch']}): {what}"


def build() -> dict:
    rows = []
    for i, text in enumerate(RAW.read_text().splitlines(), start=1):
        r = json.loads(text)
        if r["kind"] in ("fp8_gemm_nt", "bf16_gemm_nt"):
            dtype = r["kind"].split("_")[0]
            flops = 2.0 * r["M"] * r["N"] * r["K"]
            what = (f"DeepGEMM {dtype} GEMM M={r['M']} N×K={r['N']}×{r['K']} "
                    f"on {r['sms']} SMs: {r['us']} µs")  # fmt: skip
            rows.append({"op": "gemm", "dtype": dtype, "size": r["M"], "sms": r["sms"],
                         "us": r["us"], "flops": flops, "shape": [[r["N"], r["K"]]],
                         "source": _cite(i, what)})  # fmt: skip
        elif r["kind"] == "flash_mla_decode":
            flops = mla_decode_flops(r["B"], r["L"], r["s_q"], r["heads"])
            what = (f"FlashMLA decode batch {r['B']} KV {r['L']} s_q {r['s_q']} "
                    f"{r['heads']} heads: {r['us']} µs")  # fmt: skip
            rows.append({"op": "attn.core", "dtype": "bf16", "size": flops, "size_unit": "flops",
                         "sms": 132, "us": r["us"], "flops": flops, "grid": "persistent",
                         "source": _cite(i, what)})  # fmt: skip
        else:
            raise ValueError(f"{RAW.name} line {i}: unknown kind {r['kind']!r}")
    return {
        "format": "overlap-lab-profile/1",
        "device": "NVIDIA H200 SXM (132 SMs)",
        "date": DATE,
        "software": SOFTWARE,
        "source": "kernels timed alone on one H200 (CUDA events), raw rows in "
        "overlap_lab/sim/profiles/h200-measured-rows.jsonl; see h200_measured.py",
        "notes": " ".join(__doc__.split("\n\n", 2)[2].split()),
        "gpu": GPU_FIELDS,
        "rows": rows,
    }


def main() -> None:
    path = Path(__file__).with_name("h200-measured.json")
    path.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n")
    print(path)


if __name__ == "__main__":
    main()
