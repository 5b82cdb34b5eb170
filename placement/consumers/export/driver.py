"""The registry of ``--format`` names and the driver: check a placement against its instance, convert
it to a format's text, and write the files atomically (:func:`export_file`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Literal

import numpy as np

from placement.consumers.export._text import _json_text
from placement.consumers.export.hybridep import hybridep_env_text
from placement.consumers.export.permutation import expert_permutation
from placement.consumers.export.sglang import sglang_expert_location, sglang_layout_problem
from placement.consumers.export.slurm import slurm_gpus_path, slurm_gpus_text, slurm_hostfile_text
from placement.consumers.export.vllm import vllm_ascend_expert_map, vllm_eplb_maps
from placement.core.checker import check
from placement.core.model import InfeasibleError, Instance, InvalidInputError, Placement, PlacementError
from placement.formats import atomic_write_text, read_instance, read_placement

ExportFormat = Literal["sglang", "vllm", "vllm-ascend", "megatron", "torchtitan", "slurm", "hybridep", "maxtext"]
FORMATS: tuple[ExportFormat, ...] = (
    "sglang", "vllm", "vllm-ascend", "megatron", "torchtitan", "slurm", "hybridep", "maxtext",
)  # fmt: skip
# Formats that can be written from the placement file alone (no layer indices, hosts or domains).
_WITHOUT_INSTANCE: frozenset[str] = frozenset({"vllm"})


class LaunchWarning(UserWarning):
    """The export is complete, but a way of launching it will not work (e.g. torchrun for a layout
    whose hosts hold non-contiguous ranks); the CLI prints it as one ``warning:`` line."""


def export_text(fmt: str, placement: Placement, instance: Instance | None, *, keep_router: bool | None = None) -> str:
    """The file contents of ``fmt`` for a placement already checked against ``instance``
    (``keep_router``: see :func:`expert_permutation`; megatron and torchtitan only; ``None``: as the
    instance's apply mode says, True for ``runtime``, the default)."""
    if fmt not in FORMATS:
        raise InvalidInputError(f"--format: expected one of {', '.join(FORMATS)}, found {fmt!r}")
    if keep_router is None:
        keep_router = fmt in ("megatron", "torchtitan") and instance is not None and instance.apply_mode == "runtime"
    if keep_router and fmt not in ("megatron", "torchtitan"):
        raise InvalidInputError(f"--keep-router: only for --format megatron or torchtitan, not {fmt}")
    if instance is None:
        if fmt not in _WITHOUT_INSTANCE:
            raise InvalidInputError(f"--instance: format {fmt} needs the instance (layer indices, hosts, domains)")
        p2l = np.asarray(placement.phy2log)
        for li, row in enumerate(p2l):  # without the instance, at least each map must be one
            if sorted(int(x) for x in row) != list(range(p2l.shape[1])):
                raise InvalidInputError(f"phy2log[{li}]: not a permutation of the {p2l.shape[1]} experts")
        return _json_text(vllm_eplb_maps(placement))
    if fmt == "sglang":
        problem = sglang_layout_problem(instance, placement)
        if problem:
            raise InfeasibleError(problem)
        return _json_text(sglang_expert_location(instance, placement))
    if fmt == "vllm":
        return _json_text(vllm_eplb_maps(placement, instance))
    if fmt == "vllm-ascend":
        return _json_text(vllm_ascend_expert_map(instance, placement))
    if fmt in ("megatron", "torchtitan"):
        return _json_text(expert_permutation(instance, placement, fmt, keep_router=keep_router))
    if fmt == "slurm":
        return slurm_hostfile_text(instance, placement)
    if fmt == "maxtext":
        from placement.consumers.maxtext import maxtext_export

        return _json_text(maxtext_export(instance, placement))
    return hybridep_env_text(instance, placement)


def load_for_export(
    placement_path: str | os.PathLike, instance_path: str | os.PathLike | None
) -> tuple[Instance | None, Placement, dict]:
    """Read the placement (and instance), check they belong together and that it is valid.

    Raises
    ------
    InvalidInputError
        On an unreadable file, an instance whose SHA-256 differs from the one the placement names,
        or a placement the checker rejects.
    """
    placement, doc = read_placement(placement_path)
    if instance_path is None:
        return None, placement, doc
    instance = read_instance(instance_path)
    require_placement_of(instance, placement, doc, placement_path, instance_path,
                         advice=": export it against the instance it was solved for")
    if "pipeline_model_parallel_layout" in doc:  # the split the solve chose (placement.predict.pipeline_split)
        from placement.core.pipeline_layout import parse_layout, with_layout

        instance = with_layout(instance, parse_layout(doc["pipeline_model_parallel_layout"]))
    return instance, placement, doc


def require_placement_of(
    instance: Instance, placement: Placement, doc: dict, placement_path: str | os.PathLike,
    instance_path: str | os.PathLike, *, advice: str = "",
) -> None:
    """Check that the placement read from ``placement_path`` (``doc``) was solved for ``instance`` and is valid.

    ``advice`` ends the SHA-256 mismatch message (what the command should be given instead).

    Raises
    ------
    InvalidInputError
        One line: the instance's SHA-256 differs from the one the placement names, or the first
        violation the checker finds (and how many more).
    """
    named = doc["instance"]
    if named["sha256"] != instance.sha256:
        raise InvalidInputError(
            f"{placement_path}: instance.sha256: the placement was made for instance {named['name']!r} "
            f"(sha256 {named['sha256'][:16]}...), but {instance_path} is {instance.name!r} "
            f"(sha256 {instance.sha256[:16]}...){advice}"
        )
    problems = check(instance, placement)
    if problems:
        more = f" (and {len(problems) - 1} more; run placement verify)" if len(problems) > 1 else ""
        raise InvalidInputError(f"{placement_path}: {problems[0]}{more}")


def export_apply(fmt: str, doc: dict, instance: Instance | None, *, apply: str | None = None,
                 keep_router: bool = False) -> str:
    """How the exported map is applied: ``apply`` when given (``keep_router``: ``runtime``), else the
    placement document's ``apply`` (what it was solved for), else the instance's (default ``runtime``).

    Raises
    ------
    InvalidInputError
        An unknown ``apply``, ``keep_router`` with ``apply="checkpoint"``, or ``keep_router`` for a
        format other than megatron or torchtitan.
    """
    from placement.core.model import APPLY_MODES, DEFAULT_APPLY

    if apply is not None and apply not in APPLY_MODES:
        raise InvalidInputError(f"--apply: expected one of {', '.join(APPLY_MODES)}, found {apply!r}")
    if keep_router:
        if fmt not in ("megatron", "torchtitan"):
            raise InvalidInputError(f"--keep-router: only for --format megatron or torchtitan, not {fmt}")
        if apply == "checkpoint":
            raise InvalidInputError("--keep-router: the keep-router permutation is for --apply runtime, not checkpoint")
        return "runtime"
    if apply is not None:
        return apply
    if doc.get("apply") in APPLY_MODES:
        return str(doc["apply"])
    return instance.apply_mode if instance is not None else DEFAULT_APPLY


def export_file(
    fmt: str,
    placement_path: str | os.PathLike,
    output_path: str | os.PathLike,
    instance_path: str | os.PathLike | None = None,
    *,
    keep_router: bool = False,
    apply: str | None = None,
) -> dict[Path, str]:
    """Check, convert and atomically write ``placement_path`` as ``fmt`` to ``output_path``.

    megatron and torchtitan write what the placement's apply mode needs (:func:`export_apply`):
    ``runtime`` a keep-router permutation (the experts move in the checkpoint, the router does not)
    that is also the map :mod:`placement.consumers.runtime` installs; ``checkpoint`` a permutation of router
    and experts together (:func:`expert_permutation`).  ``keep_router`` is the older spelling of
    ``apply="runtime"``.

    ``slurm`` also writes the per-host GPU file (:func:`slurm_gpus_path`) and the launcher script
    (:func:`placement.consumers.launch.launcher_path`, executable) beside the hostfile, and warns with
    :class:`LaunchWarning` when torchrun cannot launch the layout.  Returns ``{path: text}`` of the
    files written.  Raises ``InvalidInputError`` (exit 2) or ``InfeasibleError`` (exit 3: the stack
    cannot take this placement).
    """
    if fmt not in FORMATS:
        raise InvalidInputError(f"--format: expected one of {', '.join(FORMATS)}, found {fmt!r}")
    if instance_path is None and fmt not in _WITHOUT_INSTANCE:
        try:
            _, doc = read_placement(placement_path)
            hint = f" (the placement names instance {doc['instance']['name']!r})"
        except PlacementError:
            hint = ""
        raise InvalidInputError(f"--instance: format {fmt} needs the instance file{hint}")
    out = Path(output_path)
    if fmt == "sglang" and out.suffix != ".json":
        raise InvalidInputError(
            f"-o: {out}: SGLang reads --init-expert-location as a file only when the path ends in .json "
            "(any other string is parsed as inline JSON); name the output *.json"
        )
    instance, placement, doc = load_for_export(placement_path, instance_path)
    placement = _with_replicas(fmt, placement, doc, instance)
    mode = export_apply(fmt, doc, instance, apply=apply, keep_router=keep_router)
    files = {out: export_text(fmt, placement, instance, keep_router=mode == "runtime" and fmt in ("megatron", "torchtitan"))}
    if fmt == "slurm" and instance is not None:
        from placement.consumers.launch import launcher_path, launcher_script, torchrun_problem

        gpus = slurm_gpus_path(out)
        if gpus == out:
            raise InvalidInputError(f"-o: {out} ends in .gpus, the name of the GPU file written beside the hostfile")
        launcher = launcher_path(out)  # never equal to out: it adds ".launch.sh" to the stem
        files[gpus] = slurm_gpus_text(instance, placement)
        files[launcher] = launcher_script(instance, np.asarray(placement.rank2gpu), out.name)
        problem = torchrun_problem(instance, np.asarray(placement.rank2gpu))
        if problem is not None:
            warnings.warn(f"slurm: torchrun cannot launch this layout ({problem}); use the launcher's srun mode",
                          LaunchWarning, stacklevel=2)
    if out.is_dir():
        raise InvalidInputError(f"-o: {out} is a directory")
    if not out.parent.exists():
        raise InvalidInputError(f"-o: folder {out.parent} does not exist")
    for path, text in files.items():
        atomic_write_text(path, text)
        if path.name.endswith(".launch.sh"):
            path.chmod(path.stat().st_mode | ((path.stat().st_mode & 0o444) >> 2))  # executable where readable
    return files


# ---------------------------------------------------------------------------------------------
# Replicas (placement/formats/replicas.py)
# ---------------------------------------------------------------------------------------------
REPLICA_FORMATS = ("sglang", "vllm")


def _with_replicas(fmt: str, placement: Placement, doc: dict, instance: Instance | None) -> Placement:
    """The placement whose ``phy2log`` is the replica map (L, E + N) when ``doc`` has a ``replicas``
    block and ``fmt`` carries replicas (sglang, vllm).  The other formats write the permutation (each
    rank's first ``E / ep`` slots); a training job reads the replica block from the placement file
    (:mod:`placement.consumers.replica_runtime`).  hybridep's file is the rank layout, which replicas do not
    change: HybridEP dispatches the route's (tokens, slots) map column by column with
    ``num_of_experts_per_rank`` columns per rank (Megatron-Core 0.16.1
    ``transformer/moe/fused_a2a.py``, ``HybridEPDispatch.forward``), so a replica is one more column."""
    block = doc.get("replicas")
    if not block or not block.get("num_redundant_experts"):
        return placement
    if fmt not in REPLICA_FORMATS:
        return placement
    from placement.formats.replicas import replica_map_from_document

    if instance is None:
        raise InvalidInputError(f"--instance: {fmt} export of a placement with replicas needs the instance file")
    num_experts, ep = instance.model.num_experts, instance.parallel.ep
    from placement.formats.replicas import replica_violations

    problems = replica_violations(instance, placement, doc)
    if problems:
        raise InvalidInputError(f"placement: {problems[0]}")
    rmap = replica_map_from_document(block, num_experts, ep)
    return Placement(placement.rank2gpu, rmap.phy2log)
