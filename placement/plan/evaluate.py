"""Evaluation of one candidate: its instance, its placements, their scores (runs in a worker).

:func:`run_task` is what the executor runs: module-level, its argument and result picklable and
deterministic (the routing arrays, the seed and the time limit travel in the :class:`Task`).

Methods, per candidate:

- ``default``: the candidate's default layout (ranks on the free GPUs in sorted order, experts
  contiguous), scored (cheap);
- ``segment``: the rack-segment rule (NVIDIA's published DeepSeek-V3 runs, Slurm ``--segment``):
  every EP group inside one rack, ranks only on racks' whole EP-group slices, the rest idle
  (:func:`segment_rank2gpu`), scored with contiguous experts (cheap);
- ``cpsat``: :func:`placement.api.solve` with the ``step_time`` objective (rank layout and expert
  maps, ``num_workers=1``), its work sized by the task's ``time_limit_s`` and its wall clock held by
  the task's ``wall_limit_s``, a safety net that a normal run never reaches (when it does, the
  variant's details carry ``wall_clock_cut: true``);
- ``segment+cpsat``: the segment layout with the expert maps ``cpsat`` finds for it (``solve``
  with ``layout="fixed"`` on the cluster restricted to the segment's GPUs).

Every variant is scored by the one evaluator (:func:`placement.predict.report.report`, which adds
:mod:`placement.predict.performance`'s predictions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from placement.core.model import Cluster, Instance, Placement, Routing

__all__ = ["Task", "Variant", "TaskResult", "regroup", "build_instance", "segment_rank2gpu", "run_task", "summary"]

Method = Literal["default", "segment", "cpsat", "segment+cpsat"]


def regroup(topk: np.ndarray, dp: int) -> np.ndarray:
    """(L, S, T, k) -> (L, dp, S*T // dp, k): the window's tokens dealt to ``dp`` sources.

    The tokens, in source-major order, are cut into ``dp`` equal consecutive runs (a smaller job's
    replica reads the data of several sources; a larger job's sources split one source's stream);
    the ``S*T mod dp`` last tokens are dropped.  ``dp == S`` returns the array unchanged.
    """
    L, S, T, k = topk.shape
    if dp == S:
        return topk
    per = (S * T) // dp
    flat = topk.reshape(L, S * T, k)[:, : dp * per]
    return np.ascontiguousarray(flat.reshape(L, dp, per, k))


@dataclass(frozen=True)
class Task:
    """One unit of work for the executor."""

    job: Any  # placement.formats.job.Job
    cluster: Cluster
    candidate: Any  # placement.plan.candidates.Candidate
    method: Method
    time_limit_s: float
    seed: int
    fit_topk: np.ndarray = field(repr=False, compare=False)  # (L, S, T, k) base routing, window 0
    heldout_topk: np.ndarray = field(repr=False, compare=False)  # (L, S, T', k), window 1
    provenance: dict = field(default_factory=dict, compare=False)
    # The solve's wall-clock safety net (seconds from its start; None: ``time_limit_s``).  The work
    # is sized by ``time_limit_s`` alone, so this changes nothing unless it fires.
    wall_limit_s: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Variant:
    """One placement of a candidate and its scores (the evaluator's report, trimmed)."""

    name: str  # cpsat | default | segment | segment+cpsat
    figures: dict  # summary(): predicted step time, tokens/s, TFLOP/s, bytes, both windows
    placement: Placement = field(repr=False)
    result: Any = field(default=None, repr=False)  # solvers.SolveResult of a cpsat solve
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TaskResult:
    key: str
    method: Method
    variants: tuple[Variant, ...]
    note: str = ""  # why a method did not apply


def build_instance(job: Any, cluster: Cluster, candidate: Any, fit_topk: np.ndarray, heldout_topk: np.ndarray,
                   provenance: dict | None = None) -> Instance:
    """The candidate's :class:`Instance`: the job's model, the candidate's layout, the cluster, its routing."""
    from placement.plan.skeleton import layout_of

    c = candidate
    par = layout_of(job, c.tp, c.cp, c.ep, c.dp, c.pp, c.micro_batch, c.stage_layers)
    name = f"{job.name}-" + c.key.replace(" ", "-")
    return Instance(
        name=name,
        model=job.model,
        parallel=par,
        cluster=cluster,
        routing=Routing(regroup(fit_topk, c.dp), regroup(heldout_topk, c.dp)),
        cost_mode=job.cost_mode,
        description=f"{job.name} as {c.key} (placement plan)",
        performance=dataclasses.replace(job.performance, vpp=c.vpp),
        extra={"generator": {"function": "placement.plan.evaluate.regroup", "num_sources": c.dp, **(provenance or {})}},
    )


def segment_rank2gpu(instance: Instance) -> np.ndarray | None:
    """(world,) the rack-segment rule's layout, or None when the EP groups do not fit whole in racks.

    Racks in order; each gives its lowest ``floor(free / ep) * ep`` free GPUs (whole EP-group
    slices); rank ``r`` runs on the ``r``-th of those GPUs.  EP groups are ``ep`` consecutive
    global ranks (order ``tp-cp-ep-dp-pp``, expert tensor parallel 1), so each lands in one rack.
    """
    par, cl = instance.parallel, instance.cluster
    ep, world = par.ep, par.world_size
    chosen: list[np.ndarray] = []
    free = cl.available_gpus
    doms = cl.gpu2domain[free]
    for d in range(cl.num_domains):
        g = free[doms == d]
        chosen.append(g[: (len(g) // ep) * ep])
    gpus = np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)
    if len(gpus) < world:
        return None
    return gpus[:world].astype(np.int64)


_SUMMARY_KEYS = (
    "predicted_step_time_s",
    "predicted_tokens_per_s_per_gpu",
    "predicted_tflops_per_gpu",
    "cross_domain_bytes_per_step",
    "alltoall_time_s_per_step",
    "expert_load_max_over_mean",
)


def summary(metrics: dict, world: int, tokens_per_step: int) -> dict:
    """The figures a plan ranks by, from the evaluator's report (both windows)."""
    out: dict = {}
    for prefix in ("", "heldout_"):
        for key in _SUMMARY_KEYS:
            if prefix + key in metrics:
                out[prefix + key] = float(metrics[prefix + key])
        step = float(metrics[prefix + "predicted_step_time_s"])
        out[prefix + "predicted_job_tokens_per_s"] = tokens_per_step / step
    return out


def _identity(instance: Instance, rank2gpu: np.ndarray) -> Placement:
    m = instance.model
    return Placement(rank2gpu, np.tile(np.arange(m.num_experts), (m.num_moe_layers, 1)))


def run_task(task: Task) -> TaskResult:
    """Place and score one candidate with one method (see the module docstring)."""
    from placement.api import solve
    from placement.predict.report import report
    from solvers.default import default_rank2gpu

    inst = build_instance(task.job, task.cluster, task.candidate, task.fit_topk, task.heldout_topk, task.provenance)
    world, tokens = inst.parallel.world_size, task.job.tokens_per_step
    key = task.candidate.key
    if task.method == "default":
        default = _identity(inst, default_rank2gpu(inst))
        return TaskResult(key, "default", (Variant("default", summary(report(inst, default), world, tokens), default),))
    if task.method == "cpsat":
        res = solve(inst, time_limit_s=task.time_limit_s, wall_limit_s=task.wall_limit_s, seed=task.seed, num_workers=1,
                    objective="step_time")
        return TaskResult(key, "cpsat", (Variant("cpsat", summary(res.metrics, world, tokens), res.placement, res,
                                                 _solve_details(res)),))
    seg = segment_rank2gpu(inst)
    if seg is None:
        return TaskResult(key, task.method, (), "the EP groups do not fit whole in the racks' free GPUs")
    if task.method == "segment":
        plain = _identity(inst, seg)
        return TaskResult(key, "segment", (Variant("segment", summary(report(inst, plain), world, tokens), plain),))
    available = np.zeros(inst.cluster.num_gpus, dtype=bool)
    available[seg] = True
    fixed = dataclasses.replace(inst, cluster=dataclasses.replace(inst.cluster, available=available))
    res = solve(fixed, time_limit_s=task.time_limit_s, wall_limit_s=task.wall_limit_s, seed=task.seed, num_workers=1,
                objective="step_time", layout="fixed")
    assert np.array_equal(res.placement.rank2gpu, seg)
    res = dataclasses.replace(res, metrics=report(inst, res.placement))
    return TaskResult(key, "segment+cpsat", (Variant("segment+cpsat", summary(res.metrics, world, tokens), res.placement, res,
                                                     _solve_details(res)),))


def _solve_details(res: Any) -> dict:
    """A solved variant's details: status, interrupted, and ``wall_clock_cut: true`` only when the
    solve's safety net ended some work (the plan may then depend on the machine's load)."""
    out = {"status": res.status, "interrupted": bool(res.details.get("interrupted", False))}
    if res.wall_clock_cut:
        out["wall_clock_cut"] = True
    return out
