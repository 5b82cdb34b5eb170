"""The calibration ladder's file format: measured runs as rows, their checks and their JSON Schema.

A *ladder* is a JSON file of measured training runs (``{"version": 1, "rows": [...]}``; the row
schema is in docs/formats.md and ``placement/schemas/ladder.schema.json``).  The package ships the
published one, ``placement/data/ladder.json``.  :func:`read_ladder` checks a file; a malformed row
raises :class:`~placement.core.model.InvalidInputError` naming the file, the row and the field.
The fits on these rows are in :mod:`placement.predict.calibration`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from placement.core.model import InvalidInputError
from placement.core.perfdata import DISPATCHERS, GPU_KINDS, OVERLAP_MODES, PRECISIONS, Architecture
from placement.formats.schema import Any_, Bool, Int, List, Num, Obj, Str, to_json_schema, validate

_BIG = 1_000_000
#: Why a HybridEP row cannot dispatch in FP8 (Megatron-Core 0.16.1 and Megatron-LM main).
HYBRIDEP_FP8_DISPATCH = (
    "fp8 with dispatcher hybridep: HybridEP dispatches in BF16 only (Megatron-Core 0.16.1 "
    "megatron/core/transformer/moe/fused_a2a.py, hybrid_ep_dispatch: 'HybridEP dispatcher does not "
    "support fp8 dispatch now'); use bf16"
)

_ARCH_FIELDS = {f.name for f in dataclasses.fields(Architecture)}
SHAPE_SPEC = Obj(
    "The model's shape: placement.core.perfdata.Architecture's fields plus the MoE layout (Megatron's names).",
    {
        "attention": Str("mla (multi-head latent attention) or gqa (also MHA).", ("mla", "gqa")),
        "num_attention_heads": Int("Attention heads.", 1, _BIG),
        "ffn_hidden_size": Int("Dense layers' MLP hidden size.", 1, _BIG),
        "moe_ffn_hidden_size": Int("One routed expert's hidden size.", 1, _BIG),
        "shared_expert_ffn_hidden_size": Int("Shared expert hidden size; 0 = none.", 0, _BIG),
        "vocab_size": Int("Padded vocabulary size.", 1, 100 * _BIG),
        "mtp_num_layers": Int("Multi-token-prediction layers of the run (0 = none).", 0, 16),
        "swiglu": Bool("SwiGLU MLPs (three GEMMs)."),
        "q_lora_rank": Int("MLA query LoRA rank; 0 = none.", 0, _BIG),
        "kv_lora_rank": Int("MLA key/value LoRA rank.", 0, _BIG),
        "qk_head_dim": Int("MLA query/key head size without RoPE.", 0, _BIG),
        "qk_pos_emb_head_dim": Int("MLA RoPE part of the query/key head.", 0, _BIG),
        "v_head_dim": Int("MLA value head size.", 0, _BIG),
        "num_query_groups": Int("GQA key/value heads.", 0, _BIG),
        "kv_channels": Int("GQA head size.", 0, _BIG),
        "num_layers": Int("Decoder layers (without MTP).", 1, 100_000),
        "first_dense_layers": Int("Leading dense decoder layers (DeepSeek-V3: 3).", 0, 100_000),
        "hidden_size": Int("Hidden size.", 1, _BIG),
        "num_experts": Int("Routed experts per MoE layer.", 1, _BIG),
        "top_k": Int("Routed experts per token.", 1, _BIG),
        "num_groups": Int("Expert groups of group-limited routing (1 = none).", 1, _BIG),
        "groups_per_token": Int("Groups a token may route to.", 1, _BIG),
    },
    optional=frozenset(
        {
            "mtp_num_layers",
            "swiglu",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
            "num_query_groups",
            "kv_channels",
        }
    ),
)

ROW_SPEC = Obj(
    "One measured training run.",
    {
        "name": Str("Unique name of the row."),
        "source": Str("Where the figures were published (title, URL, section)."),
        "release": Str("Software release or document the figures belong to."),
        "date": Str("Publication date, YYYY-MM-DD."),
        "gpu": Str("GPU kind (docs/formats.md).", tuple(GPU_KINDS)),
        "precision": Str("Precision of the GEMMs.", PRECISIONS),
        "family": Str("Model family (deepseek_v3, qwen3_235b_a22b, qwen3_30b_a3b, ...): the unit of leave-one-family-out."),
        "shape": SHAPE_SPEC,
        "gpus": Int("GPUs of the job.", 1, _BIG),
        "tp": Int("Tensor-parallel size.", 1, _BIG),
        "cp": Int("Context-parallel size.", 1, _BIG),
        "pp": Int("Pipeline-parallel size.", 1, _BIG),
        "vpp": Int("Virtual pipeline stages per GPU (1 = none).", 1, _BIG),
        "ep": Int("Expert-parallel size.", 1, _BIG),
        "dp": Int("Data-parallel size: gpus / (tp * cp * pp).", 1, _BIG),
        "micro_batch": Int("Micro-batch size, sequences.", 1, _BIG),
        "global_batch": Int("Global batch size, sequences.", 1, _BIG),
        "seq_len": Int("Sequence length, tokens.", 1, _BIG),
        "dispatcher": Str("All-to-all backend.", tuple(DISPATCHERS)),
        "dispatch_precision": Str("Precision of the forward dispatch copies.", ("fp8", "bf16")),
        "overlap": Str("EP all-to-all overlap (Megatron-Core's combined 1F1B) or none.", OVERLAP_MODES),
        "recompute": Str("Recomputed modules as published (free text; not modelled)."),
        "cuda_graphs": Str("CUDA graph setting of the recipe (free text; not modelled)."),
        "expert_load": Str("balanced (forced-balanced benchmark) or routing (priced as balanced here).", ("balanced", "routing")),
        "tokens_per_s_per_gpu": Num("Published tokens/s per GPU.", exclusive_minimum=0),
        "tflops_per_gpu": Num("Published model TFLOP/s per GPU.", exclusive_minimum=0),
        "fit": Bool("Whether the fit uses this row."),
        "note": Str("Anything a reader needs to know about the row."),
    },
    optional=frozenset(
        {
            "release",
            "date",
            "cp",
            "vpp",
            "dispatcher",
            "dispatch_precision",
            "overlap",
            "recompute",
            "cuda_graphs",
            "expert_load",
            "tokens_per_s_per_gpu",
            "tflops_per_gpu",
            "fit",
            "note",
        }
    ),
)
LADDER_SPEC = Obj(
    "Measured training runs to calibrate the step-time model on (placement calibrate).",
    {"version": Int("Format version.", 1, 1), "rows": List("The runs.", ROW_SPEC, 1)},
)


_TOP_SPEC = Obj(LADDER_SPEC.desc, {"version": LADDER_SPEC.fields["version"], "rows": List("The runs.", Any_("A row."), 1)})


def ladder_schema() -> dict:
    """The ladder's JSON Schema (``placement/schemas/ladder.schema.json``)."""
    return to_json_schema(LADDER_SPEC, "placement calibration ladder")


@dataclass(frozen=True)
class LadderRow:
    """One measured run (fields as in :data:`ROW_SPEC`)."""

    name: str
    source: str
    gpu: str
    precision: str
    family: str
    shape: dict
    gpus: int
    tp: int
    pp: int
    ep: int
    dp: int
    micro_batch: int
    global_batch: int
    seq_len: int
    release: str = ""
    date: str = ""
    cp: int = 1
    vpp: int = 1
    dispatcher: str = "hybridep"
    dispatch_precision: str = "bf16"
    overlap: str = "none"
    recompute: str = ""
    cuda_graphs: str = ""
    expert_load: str = "balanced"
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    fit: bool = False
    note: str = ""

    @property
    def architecture(self) -> Architecture:
        """The shape's :class:`~placement.core.perfdata.Architecture` (MTP as the row ran it)."""
        return Architecture(**{k: v for k, v in self.shape.items() if k in _ARCH_FIELDS})

    @property
    def configuration(self) -> tuple:
        """What makes two rows the same configuration (a release re-run of it is not a new one)."""
        return (
            self.family, self.gpu, self.precision, self.gpus, self.tp, self.cp, self.pp, self.vpp, self.ep,
            self.micro_batch, self.global_batch, self.seq_len, self.dispatcher, self.overlap,
        )

    @property
    def published(self) -> tuple[str, float]:
        """``("tflops", value)`` when TFLOP/s is published, else ``("tokens", tokens/s)``."""
        if self.tflops_per_gpu is not None:
            return "tflops", float(self.tflops_per_gpu)
        assert self.tokens_per_s_per_gpu is not None
        return "tokens", float(self.tokens_per_s_per_gpu)


def default_ladder_path() -> Path:
    """The published ladder shipped with the package."""
    return Path(str(resources.files("placement") / "data" / "ladder.json"))


def _row_error(where: str, i: int, name: str, field: str, msg: str) -> InvalidInputError:
    return InvalidInputError(f"{where}: rows[{i}] ({name}).{field}: {msg}")


def read_ladder(path: str | os.PathLike[str]) -> list[LadderRow]:
    """Read and check a ladder file; a malformed row raises :class:`InvalidInputError` naming the
    file, the row (index and name) and the field."""
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise InvalidInputError(f"{where}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{where}: not JSON: {e.msg} at line {e.lineno}") from None
    return ladder_rows(doc, where)


def ladder_rows(doc: Any, where: str) -> list[LadderRow]:
    """Check a ladder document already in memory (``{"version": 1, "rows": [...]}``, what
    :func:`placement.sources.runlogs.rows_document` builds); errors name ``where``."""
    validate(doc, _TOP_SPEC, where)
    rows: list[LadderRow] = []
    seen: set[str] = set()
    for i, raw in enumerate(doc["rows"]):
        name = raw.get("name", "?") if isinstance(raw, dict) else "?"
        validate(raw, ROW_SPEC, where, f"rows[{i}] ({name})")
        row = LadderRow(**raw)
        _check_row(where, i, row, seen)
        seen.add(row.name)
        rows.append(row)
    return rows


def _check_row(where: str, i: int, r: LadderRow, seen: set[str]) -> None:
    def fail(field: str, msg: str) -> InvalidInputError:
        return _row_error(where, i, r.name, field, msg)

    if r.name in seen:
        raise fail("name", f"duplicate row name {r.name!r}")
    if r.tokens_per_s_per_gpu is None and r.tflops_per_gpu is None:
        raise fail("tflops_per_gpu", "a row needs tokens_per_s_per_gpu or tflops_per_gpu")
    if r.gpus != r.tp * r.cp * r.pp * r.dp:
        raise fail("dp", f"gpus={r.gpus} is not tp*cp*pp*dp = {r.tp * r.cp * r.pp * r.dp}")
    if (r.tp * r.cp * r.dp) % r.ep:
        raise fail("ep", f"ep={r.ep} does not divide tp*cp*dp = {r.tp * r.cp * r.dp}")
    if r.global_batch % (r.micro_batch * r.dp):
        raise fail("global_batch", f"{r.global_batch} is not a multiple of micro_batch*dp = {r.micro_batch * r.dp}")
    if r.dispatcher == "hybridep" and r.dispatch_precision == "fp8":
        raise fail("dispatch_precision", HYBRIDEP_FP8_DISPATCH)
    if r.precision not in GPU_KINDS[r.gpu].peak_dense_tflops:
        raise fail("precision", f"no {r.precision} peak for {r.gpu}")
    sh = r.shape
    def shape_fail(field: str, msg: str) -> InvalidInputError:
        return fail(f"shape.{field}", msg)

    needed = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim") if sh["attention"] == "mla" else (
        "num_query_groups", "kv_channels")
    for key in needed:
        if sh.get(key, 0) < 1:
            raise shape_fail(key, f"expected an integer >= 1 for {sh['attention']} attention")
    if sh["attention"] == "gqa" and sh["num_attention_heads"] % sh["num_query_groups"]:
        raise shape_fail("num_query_groups", "must divide num_attention_heads")
    if sh["first_dense_layers"] >= sh["num_layers"]:
        raise shape_fail("first_dense_layers", f"{sh['first_dense_layers']} leaves no MoE layer of {sh['num_layers']}")
    if sh["top_k"] > sh["num_experts"]:
        raise shape_fail("top_k", f"{sh['top_k']} exceeds num_experts={sh['num_experts']}")
    if sh["num_experts"] % sh["num_groups"] or sh["groups_per_token"] > sh["num_groups"]:
        raise shape_fail("num_groups", "must divide num_experts and be >= groups_per_token")
    if sh["top_k"] > sh["groups_per_token"] * (sh["num_experts"] // sh["num_groups"]):
        raise shape_fail("top_k", "exceeds the experts of groups_per_token groups")
    if sh["num_experts"] % r.ep:
        raise fail("ep", f"ep={r.ep} does not divide num_experts={sh['num_experts']}")
    mtp = sh.get("mtp_num_layers", 0)
    if r.pp * r.vpp > sh["num_layers"] + 2 + mtp:
        raise fail("vpp", f"pp*vpp={r.pp * r.vpp} exceeds the model's layer slots")
    if r.overlap == "1f1b":
        if r.pp > 1 and r.vpp < 2:
            raise fail("vpp", f"overlap 1f1b with pp={r.pp} needs vpp > 1 (Megatron-Core refuses it)")
        if r.ep < 2:
            raise fail("overlap", "overlap 1f1b needs ep > 1")
