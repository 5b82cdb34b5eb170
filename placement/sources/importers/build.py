"""Build an instance from recorded routing: the model, layout and cluster sections plus traces.

The sections come from JSON files holding the instance format's ``model``, ``parallel`` and
``cluster`` objects (docs/formats.md), either alone or inside a whole instance file, so that
``--base instances/dsv3_256.json`` takes all three from a committed instance and ``--parallel
my_parallel.json`` overrides one.  They are validated exactly as an instance is: each section
against its schema (errors name that file and field) and then together (``read_instance``'s
checks), before any trace is read; nothing is written unless everything is valid.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from placement.formats import INSTANCE_SPEC, _load_json, read_instance
import placement.sources.importers.core as core
from placement.core.model import COST_MODES, Instance, InvalidInputError
from placement.formats.schema import validate

__all__ = ["SOURCES", "import_instance", "read_sections"]

SOURCES = ("megatron", "torchtitan", "sglang", "vllm")
SECTIONS = ("model", "parallel", "cluster")


def read_sections(
    *,
    base: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
    parallel: str | os.PathLike[str] | None = None,
    cluster: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The instance document without routing: sections from ``base`` overridden by the others.

    Returns a dict with ``model``, ``parallel``, ``cluster`` and, from ``base``, ``name``,
    ``description`` and ``cost_mode`` when present.
    """
    doc: dict[str, Any] = {}
    origin: dict[str, Path] = {}
    if base is not None:
        where = Path(base)
        raw, _ = _load_json(where, "instance")
        if not isinstance(raw, dict):
            raise InvalidInputError(f"{where}: expected an instance object")
        for key in SECTIONS:
            if key not in raw:
                raise InvalidInputError(f"{where}: {key}: missing (a base instance holds model, parallel and cluster)")
            doc[key], origin[key] = raw[key], where
        for key in ("name", "description", "cost_mode"):
            if key in raw:
                doc[key] = raw[key]
    for key, path in (("model", model), ("parallel", parallel), ("cluster", cluster)):
        if path is None:
            continue
        where = Path(path)
        raw, _ = _load_json(where, key)
        if isinstance(raw, dict) and isinstance(raw.get(key), dict):
            raw = raw[key]  # a whole instance file given for one section
        doc[key], origin[key] = raw, where
    for key in SECTIONS:
        if key not in doc:
            raise InvalidInputError(f"--{key}: required (or --base INSTANCE.json)")
        validate(doc[key], INSTANCE_SPEC.fields[key], str(origin[key]), key)
    return doc


def _dummy_topk(model: dict, parallel: dict) -> np.ndarray:
    k = model["top_k"]
    row = np.arange(k, dtype=np.uint16 if model["num_experts"] <= 65535 else np.int64)
    return np.broadcast_to(row, (len(model["moe_layers"]), parallel["dp"], 1, k)).copy()


def _parts(doc: dict[str, Any], name: str, cost_mode: str, description: str) -> Instance:
    """Model, layout and cluster validated and built by the instance reader itself.

    The sections go through ``read_instance`` with a one-token placeholder routing, so every check
    and every default is the reader's own; its errors are re-labelled with the user's files.
    """
    full = {
        "schema_version": 1,
        "name": name,
        "description": description,
        "cost_mode": cost_mode,
        "model": doc["model"],
        "parallel": doc["parallel"],
        "cluster": doc["cluster"],
        "routing": {"file": "placeholder.npz"},
    }
    with tempfile.TemporaryDirectory(prefix="placement-import-") as tmp:
        path = Path(tmp) / "placeholder.json"
        path.write_text(json.dumps(full))
        topk = _dummy_topk(doc["model"], doc["parallel"])
        np.savez(Path(tmp) / "placeholder.npz", topk=topk, heldout_topk=topk)
        try:
            return read_instance(path)
        except InvalidInputError as exc:
            msg = str(exc)
            prefix = f"{path}: "
            if msg.startswith(prefix):
                msg = "model/parallel/cluster: " + msg[len(prefix) :]
            raise InvalidInputError(msg) from None


def _calls(source: str, traces: Sequence[str | os.PathLike[str]], inst: Instance,
           on_bytes: Callable[[int], None] | None = None) -> Iterator[core.RouterCall]:
    model = inst.model
    if source in ("sglang", "vllm") and model.mtp_moe_layers:
        raise InvalidInputError(
            f"model.moe_layers: {source} traces have no rows for MTP layers ({list(model.mtp_moe_layers)}); "
            "list the decoder's MoE layers only"
        )
    if source in ("megatron", "torchtitan"):
        import placement.sources.importers.megatron as megatron

        for t in traces:
            if Path(t).suffix in (".pt", ".pth", ".npy", ".npz"):
                raise InvalidInputError(
                    f"{t}: --from {source} reads router traces (router_trace_rank*.jsonl); expert counts such as "
                    f"TorchTitan's tokens_per_expert cannot build an instance, which needs per-token ids: record "
                    f"them with placement.sources.importers.recorder"
                )
        return megatron.read_calls(traces, model, on_bytes)
    if source == "sglang":
        import placement.sources.importers.sglang as sglang

        par = inst.parallel
        l2s = par.layer2stage
        stage_moe = [[la for la in model.moe_layers if l2s[la] == s] for s in range(par.pp)]

        def layers_of(rank: int) -> list[int]:
            if 0 <= rank < par.world_size:
                return stage_moe[int(par.rank2stage[rank])]
            return list(model.moe_layers)  # the core names the bad rank

        return sglang.read_calls(traces, model, layers_of, on_bytes)
    if source == "vllm":
        import placement.sources.importers.vllm as vllm

        return vllm.read_calls(traces, model, on_bytes)
    raise InvalidInputError(f"--from: expected one of {', '.join(SOURCES)}, found {source!r}")


def _trace_bytes(traces: Sequence[str | os.PathLike[str]]) -> int:
    """Bytes of the distinct trace files (those that cannot be read count 0: the readers say why)."""
    total = 0
    for p in sorted({str(t) for t in traces}):
        try:
            total += Path(p).stat().st_size
        except (OSError, ValueError):
            pass
    return total


def import_instance(
    source: str,
    traces: Sequence[str | os.PathLike[str]],
    *,
    base: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
    parallel: str | os.PathLike[str] | None = None,
    cluster: str | os.PathLike[str] | None = None,
    name: str | None = None,
    cost_mode: str | None = None,
    heldout_steps: int | None = None,
    max_tokens_per_source: int = core.DEFAULT_MAX_TOKENS_PER_SOURCE,
    windows: int = 1,
    on_progress: Callable[[int, int], None] | None = None,
) -> Instance:
    """An instance whose routing windows come from recorded traces.

    Parameters
    ----------
    source : ``megatron``, ``torchtitan`` (traces written by :mod:`placement.sources.importers.recorder`),
        ``sglang`` (``per_token`` dumps) or ``vllm`` (captures saved by
        :func:`placement.sources.importers.vllm.save_routed_experts`).
    traces : the trace files (every rank's, in any order).
    base, model, parallel, cluster : where the instance's sections come from (see the module).
    name, cost_mode : default: the base's, else ``imported`` and ``per_domain``.
    heldout_steps : steps (forward passes, requests) in the held-out window; default a quarter.
    max_tokens_per_source : cap on the tokens kept per source and window.
    windows : cut the fit steps into this many time-ordered sampled windows (``routing.window_tokens``,
        for ``placement solve --fit``); 1 = one sampled window.
    on_progress : called with ``(bytes of trace files read, bytes of all trace files)`` as the
        readers scan them (a :data:`placement.core.progress.ProgressCallback`); it only observes.

    Raises
    ------
    InvalidInputError
        One line naming the file and record (or field) at fault.
    """
    if source not in SOURCES:
        raise InvalidInputError(f"--from: expected one of {', '.join(SOURCES)}, found {source!r}")
    if not traces:
        raise InvalidInputError("TRACES: expected at least one trace file")
    if max_tokens_per_source < 1:
        raise InvalidInputError(f"--max-tokens-per-source: expected a positive integer, found {max_tokens_per_source}")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise InvalidInputError(f"--windows: expected a positive integer, found {windows!r}")
    doc = read_sections(base=base, model=model, parallel=parallel, cluster=cluster)
    name = name if name is not None else str(doc.get("name", "imported"))
    cost_mode = cost_mode if cost_mode is not None else str(doc.get("cost_mode", "per_domain"))
    if cost_mode not in COST_MODES:
        raise InvalidInputError(f"--cost-mode: expected one of {', '.join(COST_MODES)}, found {cost_mode!r}")
    description = f"routing imported from {source} traces" + (
        f"; sections from {Path(base).name}" if base is not None else ""
    )
    skeleton = _parts(doc, name, cost_mode, description)
    options = core.ImportOptions(
        heldout_steps=heldout_steps,
        max_tokens_per_source=max_tokens_per_source,
        aligned_steps=source in ("megatron", "torchtitan"),
        windows=windows,
    )
    on_bytes = None
    if on_progress is not None:
        report = on_progress
        total = _trace_bytes(traces)
        done = [0]

        def on_bytes(n: int) -> None:
            done[0] += n
            report(min(done[0], total), total)

    result = core.build_routing(
        _calls(source, traces, skeleton, on_bytes), skeleton.model, skeleton.parallel, options, label=f"--from {source} traces"
    )
    provenance = {
        "importer": source,
        "files": sorted(Path(t).name for t in traces),
        **result.provenance,
    }
    return replace(skeleton, routing=result.routing, extra={"generator": provenance}, sha256="")
