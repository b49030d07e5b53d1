"""The workload: a model's shapes, one rank's batch and the parallel layout, each validated.

Everything is per rank (per GPU): a Batch is what one rank's attention sees (its DP group's
requests under DP attention). ``ops.py`` turns a Workload into per-op work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.knobs import knob, validate_all
from overlap_lab.shared.inputs.preset_files import builtin, pick

DTYPES = ("bf16", "fp8")
ATTENTIONS = ("mla", "gqa")
#: Model field ranges: every published MoE fits far inside them, and the op costs they yield stay
#: far from floating-point trouble (a model file is checked against them as options are).
MAX_LAYERS = 1000
MAX_WIDTH = 1 << 20
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_EXPERTS = 1 << 16
DTYPE_BYTES = {"bf16": 2, "fp8": 1}


def _positive(owner: str, **values: int) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{owner}: {k} must be a positive integer, got {v!r}")


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The shapes that set the work of every op (names follow the HF configs).

    MLA fields are 0 for GQA models and GQA's ``head_dim`` is 0 for MLA models; ``q_lora_rank`` 0
    means a plain q projection (DeepSeek-V2-Lite). ``num_shared_experts`` shared experts of width
    ``expert_inter`` each form one dense MLP of width ``num_shared_experts * expert_inter``.
    """

    name: str = knob(help="the name every output calls the model by")
    num_layers: int = knob(help="decoder layers", unit="layers", lo=1, hi=MAX_LAYERS)
    first_k_dense: int = knob(
        help="leading layers with a dense MLP (first_k_dense_replace)",
        unit="layers",
        lo=0,
        hi=MAX_LAYERS,
    )
    hidden: int = knob(help="hidden size", unit="elements", lo=1, hi=MAX_WIDTH)
    vocab: int = knob(help="vocabulary size", unit="tokens", lo=1, hi=1 << 24)
    attention: str = knob(help="attention kind", choices=ATTENTIONS)
    num_heads: int = knob(help="attention heads", unit="heads", lo=1, hi=MAX_HEADS)
    num_kv_heads: int = knob(help="GQA kv heads (MLA: num_heads)", unit="heads", lo=1, hi=MAX_HEADS)
    head_dim: int = knob(0, "GQA head width (0 for MLA)", unit="elements", lo=0, hi=MAX_HEAD_DIM)
    q_lora_rank: int = knob(
        0, "MLA q down-projection width; 0: plain q", unit="elements", lo=0, hi=MAX_WIDTH
    )
    kv_lora_rank: int = knob(0, "MLA latent width", unit="elements", lo=0, hi=MAX_WIDTH)
    qk_nope_dim: int = knob(0, "MLA", unit="elements", lo=0, hi=MAX_HEAD_DIM)
    qk_rope_dim: int = knob(0, "MLA", unit="elements", lo=0, hi=MAX_HEAD_DIM)
    v_head_dim: int = knob(0, "MLA", unit="elements", lo=0, hi=MAX_HEAD_DIM)
    num_experts: int = knob(1, "routed experts", unit="experts", lo=1, hi=MAX_EXPERTS)
    top_k: int = knob(1, "experts per token", unit="experts", lo=1, hi=MAX_EXPERTS)
    expert_inter: int = knob(1, "expert MLP width", unit="elements", lo=1, hi=MAX_WIDTH)
    num_shared_experts: int = knob(0, "shared experts", unit="experts", lo=0, hi=MAX_EXPERTS)
    dense_inter: int = knob(1, "dense MLP width", unit="elements", lo=1, hi=MAX_WIDTH)
    n_group: int = knob(1, "expert groups (1: no group-limited routing)", lo=1, hi=MAX_EXPERTS)
    topk_group: int = knob(1, "groups a token may route to", lo=1, hi=MAX_EXPERTS)
    qk_norm: bool = knob(False, "Qwen3: RMSNorm on q and k per head")
    gemm_dtype: str = knob("bf16", "GEMM weights and inputs", choices=DTYPES)
    attn_dtype: str = knob("bf16", "attention and KV cache", choices=DTYPES)
    #: Set by ``with_layers``: a model cut to fewer layers remembers how many the full one has, so
    #: every output can say what was simulated (``label``). None: the model is not cut.
    layers_total: int | None = knob(
        None, "the full model's layers when cut (None: not cut)", unit="layers", lo=1, hi=MAX_LAYERS
    )
    mtp: int = knob(
        0,
        "multi-token-prediction modules (HF num_nextn_predict_layers); they run in decode "
        "steps with more than one token per sequence (0: off)",
        unit="modules",
        lo=0,
        hi=8,
    )

    def __post_init__(self) -> None:
        """Each field's type and sign (its range: presets and files, ``preset_files``), then
        the fields against each other."""
        m = f"model {self.name}"
        validate_all(self, m, ranged=False)
        if self.first_k_dense > self.num_layers:
            raise ConfigError(f"{m}: first_k_dense={self.first_k_dense} > {self.num_layers} layers")
        if self.layers_total is not None and self.layers_total < self.num_layers:
            raise ConfigError(f"{m}: layers_total={self.layers_total} < {self.num_layers} layers")
        if self.top_k > self.num_experts:
            raise ConfigError(f"{m}: top_k={self.top_k} > num_experts={self.num_experts}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"{m}: need n_group | num_experts and topk_group <= n_group")
        if self.attention == "mla":
            _positive(m, kv_lora_rank=self.kv_lora_rank, qk_nope_dim=self.qk_nope_dim)
            _positive(m, qk_rope_dim=self.qk_rope_dim, v_head_dim=self.v_head_dim)
        else:
            _positive(m, head_dim=self.head_dim)
            if self.num_heads % self.num_kv_heads:
                raise ConfigError(f"{m}: num_kv_heads must divide num_heads")

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's first_k_dense_replace: layers below it use a dense MLP."""
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"model {self.name}: layer {layer} outside 0..{self.num_layers - 1}")
        return layer >= self.first_k_dense

    @property
    def label(self) -> str:
        """The name every output shows: a cut model says so (``deepseek-v3[8 of 61 layers]``), so
        a truncated run is never read as the full model's; an uncut model keeps its plain name."""
        if self.layers_total is None:
            return self.name
        return f"{self.name}[{self.num_layers} of {self.layers_total} layers]"

    @property
    def shared_inter(self) -> int:
        return self.num_shared_experts * self.expert_inter

    @property
    def group_limited(self) -> bool:
        """DeepSeek-V3's node-limited routing: top-k inside the best topk_group of n_group."""
        return self.n_group > 1


def model_file_fields(data: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, defaulted) ModelConfig fields of a model file's mapping ``data``: the fields it
    must give, missing ones first, and the defaults it took that change the model.

    A file gives every field that sets the work of the model: its layers and widths, its
    attention (MLA's latent and head widths, or GQA's head width), its experts (``num_experts``,
    ``top_k``, ``expert_inter``) and, when it has dense layers, ``dense_inter``: a default there
    would be another model (top-1 routing of a top-8 model). Defaults that describe a variant
    (no shared experts, no expert groups, bf16, no q down-projection) are taken and said.
    """
    required = [
        "num_layers", "first_k_dense", "hidden", "vocab", "attention", "num_heads",
        "num_kv_heads", "num_experts", "top_k", "expert_inter",
    ]  # fmt: skip
    if data.get("attention") == "mla":
        required += ["kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"]
        variant = ["q_lora_rank"]
    else:
        required += ["head_dim"]
        variant = []
    if data.get("first_k_dense"):
        required.append("dense_inter")
    variant += ["num_shared_experts", "n_group", "topk_group", "qk_norm"]
    variant += ["gemm_dtype", "attn_dtype"]
    return tuple(required), tuple(f for f in variant if f not in data)


#: The built-in presets: one YAML file per model in ``shared/inputs/presets/models/``, each citing the
#: HuggingFace config it restates (a file of the same form is what ``--model-file`` reads; a
#: HuggingFace ``config.json`` is read directly too: ``shared.inputs.presets``).
MODELS: dict[str, ModelConfig] = builtin(
    "models", ModelConfig, ("deepseek-v3", "deepseek-v2-lite", "qwen3-30b-a3b", "qwen3-235b-a22b")
)


def get_model(name: str, **overrides) -> ModelConfig:
    """A preset by name (case-insensitive), with fields replaced; validated again."""
    return pick(MODELS, "model", name, overrides)


def moe_layers(model: ModelConfig) -> range:
    return range(model.first_k_dense, model.num_layers)


def dense_layers(model: ModelConfig) -> range:
    return range(0, model.first_k_dense)


# ----------------------------------------------------------------------------------------------
# Batch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One rank's batch for one forward step.

    prefill: sequence i computes ``extend_lens[i]`` new tokens on top of ``prefix_lens[i]`` cached
    ones. decode: sequence i has ``kv_lens[i]`` tokens in its KV cache and computes
    ``tokens_per_seq`` new ones (1; more for MTP / speculative verify), each attending causally.
    """

    mode: str
    extend_lens: tuple[int, ...] = ()
    prefix_lens: tuple[int, ...] = ()
    kv_lens: tuple[int, ...] = ()
    tokens_per_seq: int = 1

    def __post_init__(self) -> None:
        for f in ("extend_lens", "prefix_lens", "kv_lens"):
            object.__setattr__(self, f, tuple(getattr(self, f)))
        if self.mode == "prefill":
            self._check_prefill()
        elif self.mode == "decode":
            self._check_decode()
        else:
            raise ConfigError(f"batch mode must be 'decode' or 'prefill', got {self.mode!r}")

    def _check_prefill(self) -> None:
        if not self.extend_lens:
            raise ConfigError("prefill batch needs at least one sequence (extend_lens is empty)")
        if self.kv_lens:
            raise ConfigError("prefill batch takes extend_lens/prefix_lens, not kv_lens")
        if len(self.prefix_lens) != len(self.extend_lens):
            raise ConfigError(
                f"prefill batch: {len(self.prefix_lens)} prefix_lens for "
                f"{len(self.extend_lens)} extend_lens"
            )
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.extend_lens):
            raise ConfigError("prefill batch: every extend_len must be a positive integer")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.prefix_lens):
            raise ConfigError("prefill batch: every prefix_len must be a non-negative integer")

    def _check_decode(self) -> None:
        if not self.kv_lens:
            raise ConfigError("decode batch needs at least one sequence (kv_lens is empty)")
        if self.extend_lens or self.prefix_lens:
            raise ConfigError("decode batch takes kv_lens, not extend_lens/prefix_lens")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.kv_lens):
            raise ConfigError("decode batch: every kv_len must be a positive integer")
        _positive("decode batch", tokens_per_seq=self.tokens_per_seq)

    @classmethod
    def decode(
        cls,
        num_seqs: int | None = None,
        *,
        kv_len: int = 4096,
        tokens_per_seq: int = 1,
        kv_lens: Sequence[int] | None = None,
    ) -> Batch:
        """``num_seqs`` sequences of ``kv_len`` cached tokens, or explicit ``kv_lens``."""
        if kv_lens is None:
            if num_seqs is None:
                raise ConfigError("decode batch: give num_seqs or kv_lens")
            _positive("decode batch", num_seqs=num_seqs)
            kv_lens = (kv_len,) * num_seqs
        elif num_seqs is not None and num_seqs != len(kv_lens):
            raise ConfigError(f"decode batch: num_seqs={num_seqs} but {len(kv_lens)} kv_lens")
        return cls("decode", kv_lens=tuple(kv_lens), tokens_per_seq=tokens_per_seq)

    @classmethod
    def prefill(
        cls,
        num_seqs: int | None = None,
        *,
        extend_len: int = 4096,
        prefix_len: int = 0,
        extend_lens: Sequence[int] | None = None,
        prefix_lens: Sequence[int] | None = None,
    ) -> Batch:
        """``num_seqs`` sequences of ``extend_len`` new tokens over ``prefix_len`` cached ones."""
        if extend_lens is None:
            if num_seqs is None:
                raise ConfigError("prefill batch: give num_seqs or extend_lens")
            _positive("prefill batch", num_seqs=num_seqs)
            extend_lens = (extend_len,) * num_seqs
        elif num_seqs is not None and num_seqs != len(extend_lens):
            raise ConfigError(f"prefill batch: num_seqs={num_seqs} but {len(extend_lens)} lens")
        if prefix_lens is None:
            prefix_lens = (prefix_len,) * len(extend_lens)
        return cls("prefill", extend_lens=tuple(extend_lens), prefix_lens=tuple(prefix_lens))

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens) if self.mode == "prefill" else len(self.kv_lens)

    @property
    def num_tokens(self) -> int:
        if self.mode == "prefill":
            return sum(self.extend_lens)
        return self.num_seqs * self.tokens_per_seq

    def seq_tokens(self, i: int) -> int:
        """New tokens sequence i computes in this step."""
        return self.extend_lens[i] if self.mode == "prefill" else self.tokens_per_seq

    def seq_cached(self, i: int) -> int:
        """Tokens sequence i already holds in the KV cache before this step."""
        return self.prefix_lens[i] if self.mode == "prefill" else self.kv_lens[i]

    def token_offsets(self) -> tuple[int, ...]:
        """Start of each sequence's tokens in the flattened batch, plus the total at the end."""
        out, acc = [0], 0
        for i in range(self.num_seqs):
            acc += self.seq_tokens(i)
            out.append(acc)
        return tuple(out)


# ----------------------------------------------------------------------------------------------
# Parallel layout and the workload
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parallel:
    """EP over ``ep`` ranks (DeepEP), attention DP (+ TP inside a DP group), PP stages."""

    ep: int = 1
    gpus_per_node: int = 8
    dp_attention: bool = True
    attn_tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        _positive("parallel", ep=self.ep, gpus_per_node=self.gpus_per_node)
        _positive("parallel", attn_tp=self.attn_tp, pp=self.pp)
        if self.ep > self.gpus_per_node and self.ep % self.gpus_per_node:
            raise ConfigError(
                f"parallel: ep={self.ep} spans nodes, so it must be a multiple of "
                f"gpus_per_node={self.gpus_per_node}"
            )
        if self.ep % self.attn_tp:
            raise ConfigError(f"parallel: attn_tp={self.attn_tp} must divide ep={self.ep}")

    @property
    def node_peers(self) -> int:
        """EP ranks in this rank's node, itself included."""
        return min(self.ep, self.gpus_per_node)

    @property
    def world(self) -> int:
        return self.ep * self.pp


@dataclass(frozen=True)
class Workload:
    """A model, one rank's batch and the layout, checked against each other."""

    model: ModelConfig
    batch: Batch
    parallel: Parallel = Parallel()

    def __post_init__(self) -> None:
        m, p = self.model, self.parallel
        if m.num_experts % p.ep:
            raise ConfigError(f"ep={p.ep} must divide the {m.num_experts} experts of {m.name}")
        if m.num_heads % p.attn_tp:
            raise ConfigError(
                f"attn_tp={p.attn_tp} must divide the {m.num_heads} heads of {m.name}"
            )
        kv = m.num_kv_heads
        if m.attention == "gqa" and kv % p.attn_tp and p.attn_tp % kv:
            raise ConfigError(f"attn_tp={p.attn_tp} and the {kv} kv heads of {m.name} must nest")
        if p.pp > m.num_layers:
            raise ConfigError(f"pp={p.pp} exceeds the {m.num_layers} layers of {m.name}")

    @property
    def local_experts(self) -> int:
        return self.model.num_experts // self.parallel.ep

    @property
    def heads_per_rank(self) -> int:
        return self.model.num_heads // self.parallel.attn_tp

    @property
    def kv_heads_per_rank(self) -> int:
        """GQA kv heads a rank holds (replicated when attn_tp exceeds them, as SGLang does)."""
        return max(1, self.model.num_kv_heads // self.parallel.attn_tp)


def pp_stage_layers(model: ModelConfig, pp: int) -> tuple[range, ...]:
    """Contiguous layer ranges of the ``pp`` stages, the remainder going to the first stages."""
    if pp < 1 or pp > model.num_layers:
        raise ConfigError(f"pp={pp} must lie in 1..{model.num_layers}")
    base, extra = divmod(model.num_layers, pp)
    out, lo = [], 0
    for s in range(pp):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return tuple(out)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the schedule cut it: sequences [seq_lo, seq_hi), tokens [tok_lo, tok_hi).

    ``split_seq`` is true when the two-chunk split cut a sequence, so this micro-batch holds only
    part of sequence ``seq_hi - 1`` (first child) or ``seq_lo`` (second child).
    """

    index: int
    seq_lo: int
    seq_hi: int
    tok_lo: int
    tok_hi: int
    padded_tokens: int
    split_seq: bool = False

    @property
    def tokens(self) -> int:
        return self.tok_hi - self.tok_lo

    def as_meta(self) -> dict:
        d = asdict(self)
        d["tokens"] = self.tokens
        return d


def whole_batch(w: Workload) -> MicroBatch:
    """The unsplit batch as one micro-batch (index 0, no padding)."""
    n = w.batch.num_tokens
    return MicroBatch(0, 0, w.batch.num_seqs, 0, n, n)


def with_layers(cfg, num_layers: int | None):
    """The same model cut to ``num_layers`` layers, so a few layers of a full-size model still show
    its MoE schedule (and fit on one GPU): one dense layer is kept first when the model has any
    (and ``num_layers`` > 1), the rest are MoE. Works on any frozen config with ``num_layers`` and
    ``first_k_dense`` (ModelConfig, the real executor's model config)."""
    if num_layers is None or num_layers == cfg.num_layers:
        return cfg
    if not 1 <= num_layers <= cfg.num_layers:
        raise ConfigError(
            f"--layers must lie in 1..{cfg.num_layers} for {cfg.name}, got {num_layers}"
        )
    dense = min(cfg.first_k_dense, 1 if num_layers > 1 else 0)
    # a config that can remember its full depth does (ModelConfig.layers_total; cutting twice
    # keeps the first full count); others (the real executor's) are cut alone
    total = {"layers_total": getattr(cfg, "layers_total", None) or cfg.num_layers}
    extra = total if "layers_total" in getattr(cfg, "__dataclass_fields__", {}) else {}
    return replace(cfg, num_layers=num_layers, first_k_dense=dense, **extra)
