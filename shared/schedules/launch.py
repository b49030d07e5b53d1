"""How a configuration is launched on the system that runs it: the records a schedule module's
``launch_flags(deployment)`` hook returns, and the flags systems share (docs/tune.md).

A schedule module owns its flags (``shared.schedules.launch_flags`` asks it, and gives a schedule
that declares none a :class:`ServerLaunch` saying so). The helpers here hold what several schedules of
one system share: SGLang's parallel layout, DeepEP, batch and speculative-decoding flags
(``sglang``), vLLM's (``vllm``) and LightLLM's (``lightllm``). Every flag names the upstream file
whose argument parser (or environment table) defines it; a knob a system has no flag for is
listed in :attr:`ServerLaunch.unmapped` with the reason, never dropped.

Upstream files, by repository (github.com/<repository>):

- SGLang (sgl-project/sglang): ``python/sglang/srt/server_args.py``: ``ServerArgs``, whose
  fields are the server's flags (``tp_size`` -> ``--tp-size``, its docstring's rule);
  ``python/sglang/srt/environ.py``: its environment variables;
  ``python/sglang/srt/layers/moe/token_dispatcher/deepep.py``: ``DeepEPConfig`` (the JSON of
  ``--deepep-config``).
- vLLM (vllm-project/vllm): ``vllm/engine/arg_utils.py``: ``EngineArgs.add_cli_args`` (the
  flags, over ``vllm/config/parallel.py``'s ``ParallelConfig`` fields); ``vllm/envs.py``.
- LightLLM (ModelTC/lightllm): ``lightllm/server/api_cli.py``: ``make_argument_parser``.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from typing import Any

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Workload

SGLANG_ARGS = "SGLang python/sglang/srt/server_args.py"
SGLANG_ENV = "SGLang python/sglang/srt/environ.py"
SGLANG_DEEPEP = "SGLang python/sglang/srt/layers/moe/token_dispatcher/deepep.py (DeepEPConfig)"
VLLM_ARGS = "vLLM vllm/engine/arg_utils.py (EngineArgs.add_cli_args)"
VLLM_ENV = "vLLM vllm/envs.py"
LIGHTLLM_ARGS = "LightLLM lightllm/server/api_cli.py"
LIGHTLLM_ENV = (
    "LightLLM lightllm/models/deepseek2/layer_infer/transformer_layer_infer.py (MOE_MODE)"
)


@dataclass(frozen=True)
class Deployment:
    """What a launch is for: one rank's ``workload`` (the model, sequences per GPU, the layout),
    the ``gpu``, the schedule's ``cfg`` (a ``ScheduleConfig``), the ``gpus`` of the deployment
    (several instances where they exceed ``ep × pp``) and ``model_path``, the weights' path the
    server loads."""

    workload: Workload
    gpu: GPU
    cfg: Any
    gpus: int
    model_path: str

    @property
    def instances(self) -> int:
        return max(1, self.gpus // self.workload.parallel.world)

    @property
    def dp_size(self) -> int:
        p = self.workload.parallel
        return p.ep // p.attn_tp if p.dp_attention else 1

    @property
    def drafts(self) -> int:
        """Draft tokens per step (multi-token prediction): decode tokens per sequence - 1."""
        b = self.workload.batch
        return b.tokens_per_seq - 1 if b.mode == "decode" and self.workload.model.mtp > 0 else 0

    @property
    def deepep_mode(self) -> str:
        return self.cfg.resolved_deepep_mode(self.workload.batch.mode)


@dataclass(frozen=True)
class Flag:
    """One launch setting: a flag (``--tp-size``) or, with ``env``, an environment variable; its
    value (None: a switch); the upstream file that defines it; ``carries``: what of the
    configuration it sets (a knob's name, ``batch``, ``ep``...); ``note``: what else to know."""

    name: str
    value: Any = None
    source: str = ""
    carries: str = ""
    env: bool = False
    note: str = ""

    def text(self) -> str:
        if self.env:
            return f"{self.name}={shlex.quote(str(self.value))}"
        return self.name if self.value is None else f"{self.name} {shlex.quote(str(self.value))}"


@dataclass(frozen=True)
class ServerLaunch:
    """A configuration as its system's launch command: ``system`` (None: no public system runs
    the schedule), ``command``, its ``flags`` and, per knob without an upstream flag, why
    (``unmapped``: (knob, reason))."""

    system: str | None
    command: str = ""
    flags: tuple[Flag, ...] = ()
    unmapped: tuple[tuple[str, str], ...] = ()

    def carried(self) -> set[str]:
        return {f.carries for f in self.flags if f.carries}

    def shell(self) -> str:
        """The command line: environment variables first, then the command and its flags."""
        if self.system is None:
            return ""
        env = [f.text() for f in self.flags if f.env]
        args = [f.text() for f in self.flags if not f.env]
        return " ".join([*env, self.command, *args])

    def text(self) -> str:
        """The command, then one line per flag with its source, then what has no flag."""
        if self.system is None:
            lines = ["no public system runs this schedule: no launch flags"]
        else:
            lines = [f"{self.system}:", f"  {self.shell()}", "  flag sources:"]
            for f in self.flags:
                note = f"; {f.note}" if f.note else ""
                lines.append(f"    {f.text().split(' ')[0]:<40} {f.source}{note}")
        if self.unmapped:
            lines.append("  no upstream flag:")
            lines += [f"    {k}: {why}" for k, why in self.unmapped]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "command": self.shell(),
            "flags": [
                {
                    "flag": f.name,
                    "value": f.value,
                    "env": f.env,
                    "source": f.source,
                    "carries": f.carries,
                    "note": f.note,
                }
                for f in self.flags
            ],  # fmt: skip
            "unmapped": [{"knob": k, "why": why} for k, why in self.unmapped],
        }


def no_launch(name: str, why: str | None = None) -> ServerLaunch:
    """The launch of a schedule whose module declares no ``launch_flags``."""
    return ServerLaunch(None, unmapped=(("schedule", why or f"{name} declares no launch flags"),))


# ---- SGLang -----------------------------------------------------------------------------------


def sglang_flag(field: str, value: Any = None, carries: str = "", note: str = "") -> Flag:
    """An SGLang server flag: ``ServerArgs``'s field ``field`` (``tp_size`` -> ``--tp-size``)."""
    return Flag("--" + field.replace("_", "-"), value, f"{SGLANG_ARGS} ServerArgs.{field}",
                carries, note=note)  # fmt: skip


def sglang(
    d: Deployment,
    extra: tuple[Flag, ...] = (),
    unmapped: tuple[tuple[str, str], ...] = (),
    *,
    running: int | None = None,
) -> ServerLaunch:
    """SGLang's server (``python -m sglang.launch_server``) for ``d``: the layout (one instance
    of ``ep × pp`` GPUs; ``tp_size`` is its GPUs per stage, DP attention one DP rank per
    ``attn_tp`` GPUs), DeepEP, the decode batch (``max_running_requests`` counts every DP rank,
    ``server_args.py`` divides it by ``dp_size``), a prefill step's tokens
    (``chunked_prefill_size`` is divided by ``dp_size`` under DP attention, likewise), the MTP
    draft tokens (NEXTN), then ``extra``, the schedule's own. ``running``: sequences in flight
    per DP rank where they are not the batch (a pipeline's micro-batches)."""
    p, b = d.workload.parallel, d.workload.batch
    flags = [sglang_flag("model_path", d.model_path, "model"), sglang_flag("tp_size", p.ep, "ep")]
    if p.dp_attention and d.dp_size > 1:
        flags += [sglang_flag("enable_dp_attention", None, "dp_attention"),
                  sglang_flag("dp_size", d.dp_size, "attn_tp")]  # fmt: skip
    flags += [sglang_flag("ep_size", p.ep, "ep")]
    if p.pp > 1:
        flags.append(sglang_flag("pp_size", p.pp, "pp"))
    nodes = math.ceil(p.world / p.gpus_per_node)
    if nodes > 1:
        flags.append(
            sglang_flag("nnodes", nodes, note="with --node-rank and --dist-init-addr per node")
        )
    backend = (
        "deepep_v2" if d.gpu.deepep_release == "v2" and d.deepep_mode == "normal" else "deepep"
    )
    flags += [sglang_flag("moe_a2a_backend", backend, "deepep_release"),
              sglang_flag("deepep_mode", d.cfg.deepep_mode, "deepep_mode")]  # fmt: skip
    if d.deepep_mode == "normal":
        n = d.gpu.deepep_normal_sms
        conf = {"normal_dispatch": {"num_sms": n}, "normal_combine": {"num_sms": n}}
        flags.append(Flag("--deepep-config", json.dumps(conf, separators=(",", ":")),
                          f"{SGLANG_ARGS} ServerArgs.deepep_config; {SGLANG_DEEPEP}",
                          "deepep_normal_sms",
                          note="DeepEP's Config also takes its chunk sizes: keep DeepEP's "
                          "tuned ones for this EP size"))  # fmt: skip
    if b.mode == "decode":
        running = b.num_seqs if running is None else running
        flags += [sglang_flag("max_running_requests", running * d.dp_size, "batch"),
                  sglang_flag("cuda_graph_max_bs", b.num_seqs, "batch")]  # fmt: skip
        if not d.cfg.use_cuda_graph(b.mode):
            flags.append(sglang_flag("disable_cuda_graph", None, "cuda_graph"))
    else:
        flags.append(sglang_flag("chunked_prefill_size", b.num_tokens * d.dp_size, "batch"))
    if d.drafts:
        flags += [sglang_flag("speculative_algorithm", "NEXTN", "mtp"),
                  sglang_flag("speculative_num_steps", d.drafts, "mtp"),
                  sglang_flag("speculative_eagle_topk", 1, "mtp"),
                  sglang_flag("speculative_num_draft_tokens", d.drafts + 1, "mtp")]  # fmt: skip
    return ServerLaunch("SGLang", "python -m sglang.launch_server", (*flags, *extra), unmapped)


def sglang_env(name: str, value: Any, carries: str) -> Flag:
    """An SGLang environment variable (``environ.py``'s ``Envs``)."""
    return Flag(name, value, f"{SGLANG_ENV} Envs.{name}", carries, env=True)


# ---- vLLM ---------------------------------------------------------------------------------------


def _vl(name: str, value: Any = None, carries: str = "", note: str = "") -> Flag:
    return Flag(name, value, VLLM_ARGS, carries, note=note)


def vllm(
    d: Deployment, extra: tuple[Flag, ...] = (), unmapped: tuple[tuple[str, str], ...] = ()
) -> ServerLaunch:
    """vLLM's server (``vllm serve``) for ``d``: data parallel attention with expert parallel
    MoE (one engine per DP rank, ``--max-num-seqs`` each), DeepEP's kernels by mode and
    release, MTP as DeepSeek's speculative method, then ``extra``."""
    p, b = d.workload.parallel, d.workload.batch
    flags = [_vl("--model", d.model_path, "model"),
             _vl("--data-parallel-size", d.dp_size, "ep"),
             _vl("--tensor-parallel-size", p.attn_tp, "attn_tp"),
             _vl("--enable-expert-parallel", None, "ep")]  # fmt: skip
    if d.gpu.deepep_release == "v2" and d.deepep_mode == "normal":
        backend = "deepep_v2"
    else:
        backend = {"normal": "deepep_high_throughput", "low_latency": "deepep_low_latency"}[
            d.deepep_mode
        ]
    flags.append(_vl("--all2all-backend", backend, "deepep_mode"))
    if b.mode == "decode":
        flags.append(_vl("--max-num-seqs", b.num_seqs, "batch"))
    else:
        flags.append(_vl("--max-num-batched-tokens", b.num_tokens, "batch"))
    if d.drafts:
        spec = {"method": "deepseek_mtp", "num_speculative_tokens": d.drafts}
        flags.append(_vl("--speculative-config", json.dumps(spec, separators=(",", ":")), "mtp"))
    return ServerLaunch("vLLM", "vllm serve", (*flags, *extra), unmapped)


def vllm_env(name: str, value: Any, carries: str) -> Flag:
    return Flag(name, value, VLLM_ENV, carries, env=True)


# ---- LightLLM -----------------------------------------------------------------------------------


def lightllm(
    d: Deployment, extra: tuple[Flag, ...] = (), unmapped: tuple[tuple[str, str], ...] = ()
) -> ServerLaunch:
    """LightLLM's server (``python -m lightllm.server.api_server``) for ``d``: ``--tp`` GPUs
    with ``--dp`` attention ranks, expert parallel MoE (``MOE_MODE=EP``), the batch, MTP, then
    ``extra``. LightLLM picks DeepEP's kernels by phase itself."""
    p, b = d.workload.parallel, d.workload.batch
    src = LIGHTLLM_ARGS
    flags = [Flag("MOE_MODE", "EP", LIGHTLLM_ENV, "ep", env=True),
             Flag("--model_dir", d.model_path, src, "model"),
             Flag("--tp", p.ep, src, "ep"),
             Flag("--dp", d.dp_size, src, "attn_tp")]  # fmt: skip
    if b.mode == "decode":
        flags += [Flag("--running_max_req_size", b.num_seqs * d.dp_size, src, "batch"),
                  Flag("--graph_max_batch_size", b.num_seqs, src, "batch")]  # fmt: skip
    if d.drafts:
        flags += [Flag("--mtp_mode", "deepseekv3", src, "mtp"),
                  Flag("--mtp_step", d.drafts, src, "mtp",
                       note="LightLLM's help says DeepSeek-V3 supports 1 step")]  # fmt: skip
    more = (("deepep_mode", "LightLLM runs DeepEP's low-latency kernels in decode and its "
             "normal ones in prefill; no flag"),)  # fmt: skip
    if d.deepep_mode != ("low_latency" if b.mode == "decode" else "normal"):
        unmapped = (*unmapped, *more)
    return ServerLaunch(
        "LightLLM", "python -m lightllm.server.api_server", (*flags, *extra), unmapped
    )
