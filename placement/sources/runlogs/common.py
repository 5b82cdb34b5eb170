"""What every stack's log reader shares: launcher prefixes, warm-up, the model shape, the row.

A training log as a launcher leaves it carries, before each line the program printed, prefixes the
program never wrote: Slurm's ``srun --label`` (``0: ``), PyTorch elastic's ``[rank3]:``, Open MPI's
``--tag-output`` (``[1,0]<stdout>:``), ``kubectl logs --prefix`` (``[pod/name/container] ``),
``kubectl logs --timestamps`` (RFC 3339 time), ANSI colour codes (TorchTitan colours its step
line).  :func:`clean_line` removes them; the readers then match the stacks' own format strings
anywhere in the cleaned line, and :func:`steady_state` drops the warm-up and the broken intervals.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from placement.core.model import InvalidInputError
from placement.core.perfdata import DEEPSEEK_V3, QWEN3_235B_A22B, Architecture

__all__ = [
    "SHAPE_FIELDS",
    "KNOWN_FAMILIES",
    "Interval",
    "RunRecord",
    "clean_line",
    "read_lines",
    "steady_state",
    "family_of",
    "fill_from_family",
]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# One launcher prefix at the start of a line; clean_line strips them until none is left.
_PREFIX = re.compile(
    r"^\s*(?:"
    r"\[rank\d+\]:"  # torchrun / PyTorch elastic --tee / --redirects
    r"|\d+:(?=\s)"  # srun --label
    r"|\[\d+,\d+\]<std(?:out|err)>:"  # Open MPI --tag-output
    r"|\[pod/[^\]\s]+\]"  # kubectl logs --prefix
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"  # kubectl --timestamps
    r")\s?"
)

# The fields of a row's ``shape`` (the ladder contract): Architecture's, then the MoE layout.
SHAPE_FIELDS: tuple[str, ...] = (
    "attention", "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size",
    "shared_expert_ffn_hidden_size", "vocab_size", "mtp_num_layers", "swiglu", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_query_groups",
    "kv_channels", "num_layers", "first_dense_layers", "hidden_size", "num_experts", "top_k",
    "num_groups", "groups_per_token",
)


def _shape(arch: Architecture, **moe: int) -> dict[str, Any]:
    out = {f: getattr(arch, f) for f in SHAPE_FIELDS if hasattr(arch, f)}
    out.update(moe)
    return out


# Families a log's model is recognised as (their Hugging Face config.json files: deepseek-ai/DeepSeek-V3,
# Qwen/Qwen3-235B-A22B, Qwen/Qwen3-30B-A3B).  Matched on layers, hidden size, experts and top-k.
KNOWN_FAMILIES: dict[str, dict[str, Any]] = {
    "deepseek_v3": _shape(DEEPSEEK_V3, num_layers=61, first_dense_layers=3, hidden_size=7168, num_experts=256,
                          top_k=8, num_groups=8, groups_per_token=4),
    "qwen3_235b_a22b": _shape(QWEN3_235B_A22B, num_layers=94, first_dense_layers=0, hidden_size=4096,
                              num_experts=128, top_k=8, num_groups=1, groups_per_token=1),
    "qwen3_30b_a3b": _shape(
        Architecture(attention="gqa", num_attention_heads=32, ffn_hidden_size=6144, moe_ffn_hidden_size=768,
                     shared_expert_ffn_hidden_size=0, vocab_size=151936, num_query_groups=4, kv_channels=128),
        num_layers=48, first_dense_layers=0, hidden_size=2048, num_experts=128, top_k=8, num_groups=1,
        groups_per_token=1),
}
_FAMILY_KEY = ("num_layers", "hidden_size", "num_experts", "top_k")


def family_of(shape: dict[str, Any]) -> str:
    """The known family whose layers, hidden size, experts and top-k the shape has, else a name
    built from them (``moe_<layers>l_<hidden>h_<experts>e``)."""
    for name, known in KNOWN_FAMILIES.items():
        if all(shape.get(k) == known[k] for k in _FAMILY_KEY):
            return name
    return "moe_{num_layers}l_{hidden_size}h_{num_experts}e".format(**{k: shape.get(k) for k in _FAMILY_KEY})


def fill_from_family(shape: dict[str, Any], where: str) -> dict[str, Any]:
    """``shape`` with its missing fields (``None``) taken from the known family it matches; a
    shape that matches none and lacks a field raises :class:`InvalidInputError` naming it."""
    family = family_of(shape)
    known = KNOWN_FAMILIES.get(family)
    out = dict(shape)
    for f in SHAPE_FIELDS:
        if out.get(f) is None:
            if known is None:
                raise InvalidInputError(f"{where}: the log does not say the model's {f} (and the model is no known family)")
            out[f] = known[f]
    return {f: out[f] for f in SHAPE_FIELDS}


def clean_line(line: str) -> str:
    """``line`` without ANSI colour codes, launcher prefixes and the trailing newline."""
    line = _ANSI.sub("", line).rstrip("\r\n")
    while True:
        stripped = _PREFIX.sub("", line, count=1)
        if stripped == line:
            return line
        line = stripped


def read_lines(path: str) -> list[str]:
    """The cleaned lines of a log file (undecodable bytes replaced); unreadable -> InvalidInputError."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [clean_line(raw) for raw in f]
    except OSError as e:
        raise InvalidInputError(f"{path}: cannot read: {e.strerror or e}") from None


@dataclass(frozen=True)
class Interval:
    """One logged interval: its last step, its measure (``time_s`` per iteration or
    ``tokens_per_s_per_gpu``), the stack's TFLOP/s per GPU if printed, and whether it is broken
    (skipped or NaN iterations, a non-finite loss)."""

    step: int
    value: float
    tflops_per_gpu: float | None = None
    broken: bool = False


def dedupe(intervals: Iterable[Interval]) -> list[Interval]:
    """One interval per step, the first copy kept (several ranks' or nodes' copies interleaved,
    or the same file given twice), in step order."""
    seen: dict[int, Interval] = {}
    for iv in intervals:
        seen.setdefault(iv.step, iv)
    return [seen[s] for s in sorted(seen)]


# Warm-up rule: the first two logged intervals are dropped (the first holds start-up work:
# compilation, NCCL set-up, allocator growth; Megatron-LM prints it on purpose "to document
# initialization overhead", training.py training_log), only the first one when fewer than four
# intervals are left.  Broken intervals are dropped wherever they are.
WARMUP_INTERVALS = 2


def steady_state(intervals: Sequence[Interval], where: str) -> tuple[list[Interval], str]:
    """The intervals a row is measured on, and a note of what was dropped.

    Raises InvalidInputError when no interval is left.
    """
    if not intervals:
        raise InvalidInputError(f"{where}: no training step lines found")
    warm = WARMUP_INTERVALS if len(intervals) >= 4 else min(1, len(intervals) - 1)
    kept = [iv for iv in intervals[warm:] if not iv.broken and math.isfinite(iv.value) and iv.value > 0]
    broken = sum(1 for iv in intervals[warm:] if iv not in kept)
    if not kept:
        raise InvalidInputError(f"{where}: every logged interval after the warm-up has skipped or NaN iterations")
    note = (
        f"median of {len(kept)} logged intervals (steps {kept[0].step}-{kept[-1].step}); "
        f"dropped {warm} warm-up and {broken} with skipped/NaN iterations"
    )
    return kept, note


@dataclass
class RunRecord:
    """What a reader found in one log, before it becomes a ladder row.  ``None`` = not said."""

    path: str
    stack: str
    gpus: int | None = None
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    micro_batch: int | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    precision: str = "bf16"
    dispatcher: str = "alltoall"
    dispatch_precision: str = "bf16"
    overlap: str = "none"
    expert_load: str = "routing"
    shape: dict[str, Any] = field(default_factory=dict)
    intervals: list[Interval] = field(default_factory=list)
    measure: str = "time_s"  # or "tokens_per_s_per_gpu"
    release: str = ""
    notes: list[str] = field(default_factory=list)
