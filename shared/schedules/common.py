"""What every schedule module shares: its knobs, declared once as knob records."""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU, HOST_COSTS, HostCosts
from overlap_lab.shared.inputs.knobs import knob, validate_all

DEEPEP_MODES = ("auto", "normal", "low_latency")
MAX_TOKENS = 1 << 20  # tokens of one batch or sequence a knob may name
MAX_SEQS = 1 << 16  # requests per GPU


def _modes_fit_iterations(modes: tuple[str, ...], cfg: ScheduleConfig) -> str | None:
    if len(modes) > cfg.iterations:
        return f"lists {len(modes)} modes for --iterations {cfg.iterations}"
    return None


@dataclass(frozen=True)
class ScheduleConfig:
    """Knobs of the schedules; each schedule reads the ones that concern it (its ``KNOBS``).

    None means "the system's own default" (taken from upstream or the hardware preset). Every
    field is a :func:`~overlap_lab.shared.inputs.knobs.knob`: its help, unit, range and validator are
    declared here once (``schedules.schedule_knobs()``), and ``__post_init__`` runs each knob's
    one validator; the command line builds its options from these records.

    ``comm_sms`` is read by three schedules, with one meaning each (``resolve_comm_sms`` below resolves
    and checks it against the GPU for all three): sbo and tbo+sbo, the SMs of DeepEP's
    low-latency combine send (SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS; default: the GPU preset's
    ``sbo_comm_sms``); deepseek (prefill), the SMs of the communication partition (default: 24 of
    an H800's 132, scaled); vllm-dbo (prefill), VLLM_DBO_COMM_SMS, capped at DeepEP's 20 (0: SM
    control off).
    """

    comm_sms: int | None = knob(
        None, "SBO / DeepSeek communication SMs (default: GPU preset)", unit="SMs", lo=0, hi=1023
    )
    sbo_mode: int = knob(
        1, "SBO: 1 combine<->down GEMM, 2 combine<->shared, 3 dispatch<->shared", lo=1, hi=3
    )
    tbo_threshold: float = knob(
        0.48, "SGLang tbo_token_distribution_threshold", unit="fraction", lo=0.01, hi=0.5
    )
    delta_stages: int | None = knob(
        None, "TBO: None = the strategy's own (decode 2, prefill 0)", unit="stages", lo=0, hi=16
    )
    iterations: int = knob(
        4, "sglang-overlap / pp: scheduler iterations simulated", unit="iterations", lo=1, hi=64
    )
    micro_batches: int | None = knob(
        None, "pp: micro-batches in flight (None = pp_size)", unit="micro-batches", lo=1, hi=64
    )
    deepep_mode: str = knob(
        "auto", "auto: low_latency for decode, normal for prefill (SGLang)", choices=DEEPEP_MODES
    )
    cuda_graph: bool | None = knob(None, "None: decode uses CUDA graphs, prefill does not")
    dbo_decode_token_threshold: int = knob(
        32, "vLLM --dbo-decode-token-threshold", unit="tokens", lo=0, hi=MAX_TOKENS
    )
    dbo_prefill_token_threshold: int = knob(
        512, "vLLM --dbo-prefill-token-threshold", unit="tokens", lo=0, hi=MAX_TOKENS
    )
    host: HostCosts = knob(HOST_COSTS, "host (CPU) costs of the scheduler loop", unit="µs")
    dp_ranks_disagree: bool = knob(False, "TBO: some DP rank cannot split (or runs another mode)")
    dp_peer_tokens: tuple[int, ...] = knob(
        (), "vllm-dbo: other DP ranks' tokens (empty: as this)", unit="tokens", lo=0, hi=MAX_TOKENS
    )
    # sglang-overlap (SGLang's CPU-GPU overlap scheduler, docs/schedules.md):
    disable_overlap_schedule: bool = knob(False, "--disable-overlap-schedule (event_loop_normal)")
    disable_consecutive_prefill_overlap: bool = knob(
        False, "SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP"
    )
    spec_v2: bool = knob(False, "the batches are spec-v2 (overlapped speculative decoding)")
    grammar: bool = knob(False, "requests carry a grammar (structured output)")
    return_logprob: bool = knob(False, "copy logprobs to the host with next_token_ids")
    iteration_modes: tuple[str, ...] = knob(
        (),
        '"prefill"/"decode" per iteration; last one repeats',
        choices=("prefill", "decode"),
        check=_modes_fit_iterations,
    )
    max_running_requests: int | None = knob(
        None, "FutureMap sizing (None: largest running batch)", unit="requests", lo=1, hi=MAX_SEQS
    )
    chunked_prefill_size: int | None = knob(
        8192, "FutureMap sizing; None: chunked prefill off", unit="tokens", lo=1, hi=MAX_TOKENS
    )
    context_len: int | None = knob(
        None, "FutureMap sizing (None: longest sequence simulated)", unit="tokens", lo=1, hi=1 << 24
    )

    def __post_init__(self) -> None:
        validate_all(self)

    def resolved_deepep_mode(self, mode: str) -> str:
        """SGLang's `auto`: low-latency kernels for decode, normal kernels for prefill."""
        if self.deepep_mode != "auto":
            return self.deepep_mode
        return "low_latency" if mode == "decode" else "normal"

    def use_cuda_graph(self, mode: str) -> bool:
        return self.cuda_graph if self.cuda_graph is not None else mode == "decode"


def resolve_comm_sms(cfg: ScheduleConfig, gpu: GPU, *, default: int, least: int = 1) -> int:
    """``--comm-sms`` or the schedule's own ``default``, checked against the GPU: the one check
    of the knob beyond its range, for every schedule that reads it (its meaning per schedule: ScheduleConfig).
    ``least`` is 0 where zero SMs means "no SM partition" (vllm-dbo), else 1."""
    n = default if cfg.comm_sms is None else cfg.comm_sms
    if not least <= n < gpu.num_sms:
        raise ConfigError(
            f"--comm-sms must lie in {least}..{gpu.num_sms - 1} on {gpu.name}, got {n}"
        )
    return n
