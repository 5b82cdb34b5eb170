"""Megatron-LM and Megatron-Bridge training logs.

Format strings read at their source (NVIDIA/Megatron-LM @d98e8a64, 2026-08-22;
NVIDIA-NeMo/Megatron-Bridge @067f987d, 2026-08-22):

- Megatron-LM ``megatron/training/arguments.py`` ``_print_args``: a header
  ``------------------------ arguments ------------------------``, then one line per argument,
  ``'  {} {} {}'.format(arg, '.' * (48 - len(arg)), value)`` sorted case-insensitively, then
  ``-------------------- end of arguments ---------------------`` (rank 0 only).
- Megatron-LM ``megatron/training/training.py`` ``training_log``: every ``log_interval``
  iterations, on the last rank, `` [YYYY-mm-dd HH:MM:SS.ffffff] iteration {:8d}/{:8d} |`` then
  ``consumed samples: {:12d} |``, ``elapsed time per iteration (ms): {:.1f} |`` (the interval's
  mean), ``throughput per GPU (TFLOP/s/GPU): {:.1f} |`` (with ``--log-throughput``), ``learning
  rate``, ``global batch size: {:5d} |``, each loss ``{}: {:.6E} |``, ``loss scale``, ``grad
  norm``, ``number of skipped iterations: {:3d} |``, ``number of nan iterations: {:3d} |``.
- Megatron-LM ``megatron/training/vocab_utils.py``: `` > padded vocab (size: {}) with {} dummy
  tokens (new size: {})`` (the vocabulary is padded after the arguments are printed).
- Megatron-Bridge ``src/megatron/bridge/training/config.py`` ``log_non_default_values`` (called by
  ``training/setup.py`` ``maybe_log_and_save_config`` on rank 0): ``Configuration Summary
  (Non-Default Values vs Megatron Core)``, sections ``[model] Non-default values (vs Mcore
  <Class>):`` with ``  {field}: {current!r}  (Mcore default: {default!r})`` and ``[train]:``,
  ``[dataset]:`` ... with ``  {field}: {value!r}``.  Its iteration line is Megatron-LM's
  (``training/utils/train_utils.py`` ``training_log``, the timestamp without microseconds).
  Fields at Megatron Core's defaults are not printed: :data:`MCORE_DEFAULTS` holds those defaults
  (megatron-core 0.16.1 ``TransformerConfig`` / ``MLATransformerConfig``; tests check them against
  the installed package).  The world size is not printed: give ``--gpus``.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

from placement.core.model import InvalidInputError
from placement.sources.runlogs.common import Interval, RunRecord

__all__ = ["MCORE_DEFAULTS", "looks_like_lm", "looks_like_bridge", "read_lm", "read_bridge"]

_ARGS_HEADER = "------------------------ arguments ------------------------"
_ARG_LINE = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*) (\.+) (.*)$")
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|(.*)$")
_PADDED_VOCAB = re.compile(r"> padded vocab \(size: (\d+)\) with (\d+) dummy tokens \(new size: (\d+)\)")
_BRIDGE_HEADER = "Configuration Summary (Non-Default Values vs Megatron Core)"
_BRIDGE_SECTION = re.compile(r"^\[(\w+)\](?: Non-default values \(vs Mcore (\w+)\))?:\s*$")
_BRIDGE_FIELD = re.compile(r"^\s+(\w+): (.*?)(?:  \(Mcore default: .*\))?\s*$")
_BRIDGE_VOCAB = re.compile(r"Using preset vocab_size: (\d+) over the tokenizer vocab_size")

# Megatron Core 0.16.1 TransformerConfig defaults of the fields a row needs (MLATransformerConfig
# overrides the last five and multi_latent_attention).
MCORE_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
    "expert_model_parallel_size": 1, "ffn_hidden_size": None, "num_query_groups": None,
    "kv_channels": None, "num_moe_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None, "moe_layer_freq": 1, "moe_router_num_groups": None,
    "moe_router_group_topk": None, "mtp_num_layers": None, "gated_linear_unit": False,
    "multi_latent_attention": False, "fp8": None, "fp8_recipe": "delayed", "fp4": None,
    "moe_token_dispatcher_type": "allgather", "moe_flex_dispatcher_backend": "deepep",
    "overlap_moe_expert_parallel_comm": False, "moe_router_force_load_balancing": False,
}
MLA_DEFAULTS: dict[str, Any] = {
    "multi_latent_attention": True, "q_lora_rank": 512, "kv_lora_rank": 512, "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
}


def _value(text: str) -> Any:
    """A printed Python value (``str()`` or ``repr()``): literal where it parses, else the text."""
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def looks_like_lm(lines: list[str]) -> bool:
    return any(_ARGS_HEADER in ln for ln in lines)


def looks_like_bridge(lines: list[str]) -> bool:
    return any(_BRIDGE_HEADER in ln for ln in lines)


def _merge(cfg: dict[str, Any], key: str, value: Any, where: str) -> None:
    if key in cfg and cfg[key] != value:
        raise InvalidInputError(f"{where}: two runs in one file: {key} is {cfg[key]!r} and {value!r}")
    cfg[key] = value


def _intervals(lines: list[str], where: str) -> list[Interval]:
    out: list[Interval] = []
    for ln in lines:
        m = _ITERATION.search(ln)
        if not m:
            continue
        fields: dict[str, str] = {}
        for part in m.group(3).split("|"):
            key, sep, val = part.partition(":")
            if sep:
                fields[key.strip()] = val.strip()
        t_ms = fields.get("elapsed time per iteration (ms)")
        if t_ms is None:
            continue  # a line cut by an interleaved write: the intact copy or the next interval counts
        try:
            time_s = float(t_ms) / 1e3
            tflops = fields.get("throughput per GPU (TFLOP/s/GPU)")
            skipped = int(fields.get("number of skipped iterations", "0"))
            nans = int(fields.get("number of nan iterations", "0"))
            losses = [float(v) for k, v in fields.items() if k.endswith("loss") and k != "loss scale"]
        except ValueError:
            continue
        broken = skipped > 0 or nans > 0 or not all(math.isfinite(x) for x in losses)
        out.append(Interval(int(m.group(1)), time_s, float(tflops) if tflops else None, broken))
    return out


_FREQ_PATTERN = re.compile(r"^\(?\s*\[0\]\s*\*\s*(\d+)\s*\+\s*\[1\]\s*\*\s*(\d+)\s*\)?$")


def _moe_first_dense(freq: Any, num_layers: int, where: str) -> int:
    """Leading dense layers from ``moe_layer_freq`` (an int: every k-th layer MoE; a list of 0/1;
    or the pattern as typed, ``([0]*3+[1]*58)``, when printed before evaluation)."""
    if isinstance(freq, str):
        m = _FREQ_PATTERN.match(freq.strip())
        if m:
            freq = [0] * int(m.group(1)) + [1] * int(m.group(2))
    if isinstance(freq, int):
        if freq == 1:
            return 0
        raise InvalidInputError(f"{where}: moe_layer_freq={freq} (MoE every {freq} layers) is not leading dense layers then MoE")
    if isinstance(freq, list) and len(freq) == num_layers and all(v in (0, 1) for v in freq):
        first = freq.index(1) if 1 in freq else num_layers
        if all(v == 1 for v in freq[first:]):
            return first
    raise InvalidInputError(f"{where}: moe_layer_freq={freq!r} is not leading dense layers then MoE layers")


def _record(cfg: dict[str, Any], where: str, stack: str) -> RunRecord:
    """A RunRecord from a Megatron configuration (Megatron-LM argument names)."""

    def need(key: str, what: str) -> Any:
        v = cfg.get(key)
        if v is None:
            raise InvalidInputError(f"{where}: the log does not say {key} ({what})")
        return v

    layers = int(need("num_layers", "the model's layers"))
    hidden = int(need("hidden_size", "the model's hidden size"))
    heads = int(need("num_attention_heads", "the model's attention heads"))
    experts = int(need("num_experts", "the number of routed experts: not an MoE run?"))
    mla = bool(cfg.get("multi_latent_attention"))
    gqa_groups = cfg.get("num_query_groups") if cfg.get("group_query_attention", True) else None
    shape: dict[str, Any] = {
        "attention": "mla" if mla else "gqa",
        "num_attention_heads": heads,
        "ffn_hidden_size": int(cfg.get("ffn_hidden_size") or 4 * hidden),
        "moe_ffn_hidden_size": int(cfg.get("moe_ffn_hidden_size") or cfg.get("ffn_hidden_size") or 4 * hidden),
        "shared_expert_ffn_hidden_size": int(cfg.get("moe_shared_expert_intermediate_size") or 0),
        "vocab_size": cfg.get("padded_vocab_size"),
        "mtp_num_layers": int(cfg.get("mtp_num_layers") or 0),
        "swiglu": bool(cfg.get("swiglu")),
        "q_lora_rank": int(cfg.get("q_lora_rank") or 0) if mla else 0,
        "kv_lora_rank": int(cfg.get("kv_lora_rank") or 0) if mla else 0,
        "qk_head_dim": int(cfg.get("qk_head_dim") or 0) if mla else 0,
        "qk_pos_emb_head_dim": int(cfg.get("qk_pos_emb_head_dim") or 0) if mla else 0,
        "v_head_dim": int(cfg.get("v_head_dim") or 0) if mla else 0,
        "num_query_groups": 0 if mla else int(gqa_groups or heads),
        "kv_channels": 0 if mla else int(cfg.get("kv_channels") or hidden // heads),
        "num_layers": layers,
        "first_dense_layers": _moe_first_dense(cfg.get("moe_layer_freq", 1), layers, where),
        "hidden_size": hidden,
        "num_experts": experts,
        "top_k": int(cfg.get("moe_router_topk") or 2),
        "num_groups": int(cfg.get("moe_router_num_groups") or 1),
        "groups_per_token": int(cfg.get("moe_router_group_topk") or 1),
    }
    notes = []
    if cfg.get("fp4"):
        precision = "nvfp4"
    elif cfg.get("fp8"):
        precision = "mxfp8" if cfg.get("fp8_recipe") == "mxfp8" else "fp8"
    else:
        precision = "bf16"
    kind = cfg.get("moe_token_dispatcher_type", "allgather")
    if kind == "flex" or cfg.get("moe_enable_deepep"):
        dispatcher = "hybridep" if cfg.get("moe_flex_dispatcher_backend") == "hybridep" else "deepep"
    else:
        dispatcher = "alltoall"
        if kind != "alltoall":
            notes.append(f"moe_token_dispatcher_type {kind} priced as alltoall")
    vpp = cfg.get("virtual_pipeline_model_parallel_size") or 1
    return RunRecord(
        path=where,
        stack=stack,
        gpus=cfg.get("world_size"),
        tp=int(cfg.get("tensor_model_parallel_size") or 1),
        cp=int(cfg.get("context_parallel_size") or 1),
        pp=int(cfg.get("pipeline_model_parallel_size") or 1),
        vpp=int(vpp),
        ep=int(cfg.get("expert_model_parallel_size") or 1),
        micro_batch=cfg.get("micro_batch_size"),
        global_batch=cfg.get("global_batch_size"),
        seq_len=cfg.get("seq_length"),
        precision=precision,
        dispatcher=dispatcher,
        # MXFP8 on the wire only with moe_dispatch_fwd_dtype (ncclep); HybridEP sends BF16
        # (Megatron-LM @d98e8a64 megatron/core/transformer/moe/fused_a2a.py: "HybridEP dispatcher
        # does not support fp8 dispatch now").
        dispatch_precision="fp8" if cfg.get("moe_dispatch_fwd_dtype") == "mxfp8" else "bf16",
        overlap="1f1b" if cfg.get("overlap_moe_expert_parallel_comm") else "none",
        expert_load="balanced" if cfg.get("moe_router_force_load_balancing") else "routing",
        shape=shape,
        notes=notes,
    )


def read_lm(path: str, lines: list[str]) -> RunRecord:
    """A Megatron-LM log: its arguments block, padded-vocabulary line and iteration lines."""
    cfg: dict[str, Any] = {}
    inside = False
    for ln in lines:
        if _ARGS_HEADER in ln:
            inside = True
            continue
        if "end of arguments" in ln:
            inside = False
            continue
        m = _ARG_LINE.search(ln) if inside else None
        if m and len(m.group(2)) == 48 - len(m.group(1)):  # _print_args pads every name to 48
            _merge(cfg, m.group(1), _value(m.group(3)), path)
        v = _PADDED_VOCAB.search(ln)
        if v:
            _merge(cfg, "padded_vocab_size", int(v.group(3)), path)
    rec = _record(cfg, path, "Megatron-LM")
    rec.intervals = _intervals(lines, path)
    return rec


# Megatron-Bridge field names -> Megatron-LM argument names.
_BRIDGE_NAMES = {"num_moe_experts": "num_experts", "gated_linear_unit": "swiglu", "seq_length": "seq_length",
                 "sequence_length": "seq_length"}


def read_bridge(path: str, lines: list[str]) -> RunRecord:
    """A Megatron-Bridge log: its configuration summary and iteration lines."""
    model: dict[str, Any] = {}
    other: dict[str, Any] = {}
    section = None
    mcore_class = ""
    for ln in lines:
        if ln.startswith("=" * 70):
            section = None
            continue
        s = _BRIDGE_SECTION.match(ln.strip())
        if s:
            section = s.group(1)
            if s.group(2):
                mcore_class = s.group(2)
            continue
        v = _BRIDGE_VOCAB.search(ln)
        if v:
            _merge(other, "padded_vocab_size", int(v.group(1)), path)
        f = _BRIDGE_FIELD.match(ln) if section in ("model", "train", "dataset") else None
        if f:
            key = _BRIDGE_NAMES.get(f.group(1), f.group(1))
            _merge(model if section == "model" else other, key, _value(f.group(2)), path)
    if not mcore_class:
        raise InvalidInputError(f"{path}: the configuration summary has no [model] section (the model's shape)")
    defaults = {_BRIDGE_NAMES.get(k, k): v for k, v in MCORE_DEFAULTS.items()}
    if mcore_class == "MLATransformerConfig":
        defaults.update(MLA_DEFAULTS)
    cfg = {**defaults, **model, **{k: v for k, v in other.items() if k not in model}}
    cfg["group_query_attention"] = cfg.get("num_query_groups") is not None
    cfg.pop("world_size", None)
    rec = _record(cfg, path, "Megatron-Bridge")
    rec.intervals = _intervals(lines, path)
    return rec
