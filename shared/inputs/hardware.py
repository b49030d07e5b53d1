"""Hardware presets: one frozen GPU record per device, every constant with its source.

Presets store datasheet units (TFLOP/s, GB/s, GiB, µs); the cost model converts to FLOPs/µs and
bytes/µs with the helpers below. Link bandwidths are per GPU and per direction (what one GPU can
push into the fabric), because a flow in the Program is bytes one rank sends.

Values marked "estimate" are order-of-magnitude placeholders to be replaced by measurement
(calibration files); nothing here is claimed as measured by this project.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.knobs import Knob, knob, knobs, validate_all
from overlap_lab.shared.inputs.preset_files import builtin, pick

ARCHS = ("hopper", "blackwell")


@dataclass(frozen=True)
class GPU:
    """One GPU and its links. Bandwidths in GB/s (1e9 B/s) per direction, FLOP/s dense.

    Every field is a knob record (``gpu_fields()``: help, unit, and ``lo..hi``, the range an
    override from the command line may take); presets and files are checked by ``__post_init__``
    below.
    """

    name: str = knob()
    arch: str = knob(choices=ARCHS)
    num_sms: int = knob(unit="SMs", lo=1, hi=1024)
    bf16_tflops: float = knob(help="dense (no 2:4 sparsity)", unit="TFLOP/s", lo=1, hi=1e5)
    fp8_tflops: float = knob(help="dense", unit="TFLOP/s", lo=1, hi=1e5)
    hbm_gbps: float = knob(unit="GB/s", lo=10, hi=1e6)
    mem_gib: float = knob(unit="GiB", lo=1, hi=1e5)
    launch_us: float = knob(
        help="host cost of one kernel launch (CUDA driver + PyTorch dispatch)",
        unit="µs",
        lo=0,
        hi=1e4,
    )
    graph_launch_us: float = knob(help="host cost of one cudaGraphLaunch", unit="µs", lo=0, hi=1e4)
    kernel_min_us: float = knob(
        help="GPU-side floor of any kernel (launch latency, ramp, tail)", unit="µs", lo=0, hi=1e4
    )
    nvlink_gbps: float = knob(help="nominal, per GPU, per direction", unit="GB/s", lo=1, hi=1e5)
    nvlink_lat_us: float = knob(unit="µs", lo=0, hi=1e4)
    rdma_gbps: float = knob(help="one NIC per GPU, line rate", unit="GB/s", lo=1, hi=1e5)
    rdma_lat_us: float = knob(unit="µs", lo=0, hi=1e4)
    pcie_gbps: float = knob(help="per direction", unit="GB/s", lo=1, hi=1e5)
    pcie_lat_us: float = knob(unit="µs", lo=0, hi=1e4)
    sbo_comm_sms: int = knob(
        help="SGLang SBO communication SMs (SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS)",
        unit="SMs",
        lo=1,
        hi=1023,
    )
    deepep_normal_sms: int = knob(
        help="DeepEP normal kernels (Buffer.num_sms)", unit="SMs", lo=1, hi=1023, tune=(16, 32)
    )
    nvlink_eff_gbps: float = knob(
        0.0,
        "achievable by DeepEP kernels; 0 = same as nominal",
        unit="GB/s",
        lo=1,
        hi=1e5,
        zero_ok=True,
    )
    rdma_eff_gbps: float = knob(
        0.0,
        "achievable by DeepEP kernels; 0 = same as nominal",
        unit="GB/s",
        lo=1,
        hi=1e5,
        zero_ok=True,
    )
    deepep_ll_recv_us: float = knob(
        0.0,
        "fixed cost of a DeepEP low-latency receive (preset files)",
        unit="µs",
        lo=0,
        hi=1e4,
    )
    deepep_release: str = knob(
        "v1",
        "DeepEP release of the normal kernels: v1 or v2",
        choices=("v1", "v2"),
        tune=("v1", "v2"),
    )
    graph_kernel_gap_us: float = knob(
        0.0,
        "GPU-side gap before each kernel of a replayed CUDA graph",
        unit="µs",
        lo=0,
        hi=1e3,
    )

    def __post_init__(self) -> None:
        """Each field's type and sign, then what one field alone cannot say. The ranges of the
        records hold for presets, files and options (``preset_files``, the command line); a
        record built in code may go beyond them (the simulator must cope)."""
        validate_all(self, f"gpu {self.name}", ranged=False)
        for f in ("sbo_comm_sms", "deepep_normal_sms"):
            if getattr(self, f) >= self.num_sms:
                raise ConfigError(
                    f"gpu {self.name}: {f}={getattr(self, f)} must be below num_sms={self.num_sms}"
                )

    # --- unit conversions for the cost model ---------------------------------------------------
    def peak_flops_per_us(self, dtype: str) -> float:
        """Dense tensor-core FLOPs per µs for a GEMM dtype ("bf16" or "fp8")."""
        if dtype == "fp8":
            return self.fp8_tflops * 1e6
        if dtype == "bf16":
            return self.bf16_tflops * 1e6
        raise ConfigError(f"unknown dtype {dtype!r}; expected bf16 or fp8")

    @property
    def hbm_bytes_per_us(self) -> float:
        return self.hbm_gbps * 1e3

    def link_bytes_per_us(self, link: str, effective: bool = False) -> float:
        """Per-direction bandwidth of a link kind in bytes/µs (nominal, or DeepEP-achievable)."""
        nominal = {"nvlink": self.nvlink_gbps, "rdma": self.rdma_gbps, "pcie": self.pcie_gbps}
        if link not in nominal:
            raise ConfigError(f"unknown link {link!r}; expected nvlink, rdma or pcie")
        eff = {"nvlink": self.nvlink_eff_gbps, "rdma": self.rdma_eff_gbps}.get(link, 0.0)
        return (eff if effective and eff > 0 else nominal[link]) * 1e3

    def link_latency_us(self, link: str) -> float:
        lat = {"nvlink": self.nvlink_lat_us, "rdma": self.rdma_lat_us, "pcie": self.pcie_lat_us}
        if link not in lat:
            raise ConfigError(f"unknown link {link!r}; expected nvlink, rdma or pcie")
        return lat[link]


#: The built-in presets: one YAML file per GPU in ``shared/inputs/presets/gpus/``, every value with its
#: source in a comment (a file of the same form is what ``--gpu-file`` reads).
GPUS: dict[str, GPU] = builtin("gpus", GPU, ("h100", "h200", "h800", "b200"))


def get_gpu(name: str, **overrides) -> GPU:
    """A preset by name (case-insensitive), with fields replaced; validated again."""
    return pick(GPUS, "gpu", name, overrides)


def gpu_fields() -> tuple[Knob, ...]:
    """The GPU preset's field records (help, unit, override range), in field order: what a
    command line turns into hardware-override options."""
    return knobs(GPU)


@dataclass(frozen=True)
class HostCosts:
    """Per-iteration host (CPU) costs of SGLang's scheduler loop, in µs.

    ESTIMATES, order of magnitude only, chosen from the scale of SGLang's event loop (Python
    scheduling and result processing dominate at large batch); they are placeholders to be replaced
    by measurement (profiling the scheduler) and are never reported as measured. Every field is a
    knob record (``host_cost_fields()``).
    """

    recv_requests_us: float = knob(
        10.0, "recv_requests + process_input_requests, idle queue", unit="µs", lo=0, hi=1e6
    )
    schedule_base_us: float = knob(
        100.0, "get_next_batch_to_run: fixed part", unit="µs", lo=0, hi=1e6
    )
    schedule_per_req_us: float = knob(
        2.0, "per running request (prepare_for_decode, req_to_token)", unit="µs", lo=0, hi=1e6
    )
    process_result_base_us: float = knob(
        50.0, "process_batch_result: fixed part", unit="µs", lo=0, hi=1e6
    )
    process_result_per_req_us: float = knob(
        5.0, "per request (append token, check finish, logprobs)", unit="µs", lo=0, hi=1e6
    )
    detokenizer_send_us: float = knob(
        20.0, "stream_output: pickling + ZMQ send to the detokenizer", unit="µs", lo=0, hi=1e6
    )

    def __post_init__(self) -> None:
        validate_all(self, "host costs", ranged=False)

    def schedule_us(self, num_reqs: int) -> float:
        return self.schedule_base_us + self.schedule_per_req_us * num_reqs

    def process_result_us(self, num_reqs: int) -> float:
        return self.process_result_base_us + self.process_result_per_req_us * num_reqs


HOST_COSTS = HostCosts()


def host_cost_fields() -> tuple[Knob, ...]:
    """HostCosts' field records (help, unit µs, override range), in field order."""
    return knobs(HostCosts)
