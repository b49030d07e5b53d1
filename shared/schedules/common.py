"""What every schedule module shares: its knobs."""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.hardware import HOST_COSTS, HostCosts

DEEPEP_MODES = ("auto", "normal", "low_latency")


@dataclass(frozen=True)
class ScheduleConfig:
    """Knobs of the schedules; each schedule reads the ones that concern it.

    None means "the system's own default" (taken from upstream or the hardware preset).
    """

    comm_sms: int | None = None  # SBO / DeepSeek communication SMs (default: GPU preset)
    sbo_mode: int = 1  # SBO: 1 combine<->down GEMM, 2 combine<->shared, 3 dispatch<->shared
    tbo_threshold: float = 0.48  # SGLang tbo_token_distribution_threshold
    delta_stages: int | None = None  # TBO: None = the strategy's own (decode 2, prefill 0)
    iterations: int = 4  # sglang-overlap / pp: scheduler iterations simulated
    micro_batches: int | None = None  # pp: micro-batches in flight (None = pp_size)
    deepep_mode: str = "auto"  # auto: low_latency for decode, normal for prefill (SGLang)
    cuda_graph: bool | None = None  # None: decode uses CUDA graphs, prefill does not
    dbo_decode_token_threshold: int = 32  # vLLM --dbo-decode-token-threshold
    dbo_prefill_token_threshold: int = 512  # vLLM --dbo-prefill-token-threshold
    host: HostCosts = HOST_COSTS  # host (CPU) costs of the scheduler loop
    dp_ranks_disagree: bool = False  # TBO: some DP rank cannot split (or runs another mode)
    dp_peer_tokens: tuple[int, ...] = ()  # vllm-dbo: other DP ranks' tokens (empty: as this)
    # sglang-overlap (SGLang's CPU-GPU overlap scheduler, docs/schedules.md):
    disable_overlap_schedule: bool = False  # --disable-overlap-schedule (event_loop_normal)
    disable_consecutive_prefill_overlap: bool = False  # SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP
    spec_v2: bool = False  # the batches are spec-v2 (overlapped speculative decoding)
    grammar: bool = False  # requests carry a grammar (structured output)
    return_logprob: bool = False  # copy logprobs to the host with next_token_ids
    iteration_modes: tuple[str, ...] = ()  # "prefill"/"decode" per iteration; last one repeats
    max_running_requests: int | None = None  # FutureMap sizing (None: largest running batch)
    chunked_prefill_size: int | None = 8192  # FutureMap sizing; None: chunked prefill off
    context_len: int | None = None  # FutureMap sizing (None: longest sequence simulated)

    def __post_init__(self) -> None:
        if self.comm_sms is not None and self.comm_sms < 0:
            raise ConfigError(f"--comm-sms must be >= 0, got {self.comm_sms}")
        if self.sbo_mode not in (1, 2, 3):
            raise ConfigError(f"--sbo-mode must be 1, 2 or 3, got {self.sbo_mode}")
        if not 0.0 < self.tbo_threshold <= 0.5:
            raise ConfigError(f"--tbo-threshold must lie in (0, 0.5], got {self.tbo_threshold}")
        if self.delta_stages is not None and self.delta_stages < 0:
            raise ConfigError(f"--delta-stages must be >= 0, got {self.delta_stages}")
        if not isinstance(self.dp_ranks_disagree, bool):
            raise ConfigError(f"dp_ranks_disagree must be a bool, got {self.dp_ranks_disagree!r}")
        if tuple(self.iteration_modes) != self.iteration_modes:
            object.__setattr__(self, "iteration_modes", tuple(self.iteration_modes))
        bad = [m for m in self.iteration_modes if m not in ("prefill", "decode")]
        if bad:
            raise ConfigError(f"--iteration-modes takes prefill/decode, got {bad[0]!r}")
        if len(self.iteration_modes) > self.iterations:
            raise ConfigError(
                f"--iteration-modes lists {len(self.iteration_modes)} modes for "
                f"--iterations {self.iterations}"
            )
        for knob in ("max_running_requests", "chunked_prefill_size", "context_len"):
            v = getattr(self, knob)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                flag = "--" + knob.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive integer, got {v!r}")
        peers = self.dp_peer_tokens
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in peers):
            raise ConfigError(f"--dp-peer-tokens must be non-negative integers, got {peers!r}")
        if self.dbo_decode_token_threshold < 0 or self.dbo_prefill_token_threshold < 0:
            raise ConfigError("--dbo-*-token-threshold must be >= 0")
        if self.iterations < 1:
            raise ConfigError(f"--iterations must be >= 1, got {self.iterations}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ConfigError(f"--micro-batches must be >= 1, got {self.micro_batches}")
        if self.deepep_mode not in DEEPEP_MODES:
            raise ConfigError(
                f"--deepep-mode must be one of {', '.join(DEEPEP_MODES)}, got {self.deepep_mode!r}"
            )

    def resolved_deepep_mode(self, mode: str) -> str:
        """SGLang's `auto`: low-latency kernels for decode, normal kernels for prefill."""
        if self.deepep_mode != "auto":
            return self.deepep_mode
        return "low_latency" if mode == "decode" else "normal"

    def use_cuda_graph(self, mode: str) -> bool:
        return self.cuda_graph if self.cuda_graph is not None else mode == "decode"
