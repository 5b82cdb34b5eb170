"""Instances without routing statistics: what the memory model and the bounds read.

The step-time model (:class:`placement.predict.performance.StepTimeModel`) counts FLOPs and parameters
per stage from an instance's model, layout and ``performance`` block only; a *skeleton* instance
gives it those with a one-token placeholder routing, so that memory and bounds use the same
counts as the predictions of the solved candidates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
from functools import lru_cache

import numpy as np

from placement.core.model import Cluster, Instance, ParallelLayout, Routing
from placement.predict.performance import StepTimeModel

if TYPE_CHECKING:  # pragma: no cover
    from placement.formats.job import Job


__all__ = ["layout_of", "skeleton_instance", "stage_model"]


def layout_of(job: Job, tp: int, cp: int, ep: int, dp: int, pp: int, micro_batch: int,
              stage_layers: tuple[tuple[int, ...], ...], global_batch: int | None = None) -> ParallelLayout:
    """The :class:`ParallelLayout` of a candidate of ``job`` (a :class:`~placement.formats.job.Job`)."""
    return ParallelLayout(
        tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, order=job.order,
        stage_layers=stage_layers, seq_len=job.seq_len,
        micro_batch=micro_batch,
        global_batch=job.global_batch if global_batch is None else global_batch,
    )


_ONE_GPU = Cluster(num_domains=1, trays_per_domain=1, gpus_per_tray=1, available=np.ones(1, dtype=bool),
                   nvlink_gbps=900.0, scaleout_gbps=100.0)


def skeleton_instance(job: Job, parallel: ParallelLayout, vpp: int, cluster: Cluster | None = None) -> Instance:
    """An instance of ``job`` with ``parallel``, ``vpp`` and a one-token placeholder routing."""
    m = job.model
    topk = np.zeros((m.num_moe_layers, parallel.dp, 1, m.top_k), dtype=np.uint16)
    topk[..., :] = np.arange(m.top_k, dtype=np.uint16)
    return Instance(
        name=f"{job.name}-skeleton",
        model=m,
        parallel=parallel,
        cluster=cluster or _ONE_GPU,
        routing=Routing(topk, topk),
        cost_mode=job.cost_mode,
        performance=dataclasses.replace(job.performance, vpp=vpp),
    )


@lru_cache(maxsize=4096)
def _stage_model_cached(job: Job, tp: int, cp: int, ep: int, pp: int, micro_batch: int,
                        stage_layers: tuple[tuple[int, ...], ...], vpp: int) -> StepTimeModel:
    par = layout_of(job, tp, cp, ep, ep // _gcd(ep, tp * cp), pp, micro_batch, stage_layers,
                    global_batch=micro_batch * (ep // _gcd(ep, tp * cp)))
    return StepTimeModel(skeleton_instance(job, par, vpp))


def _gcd(a: int, b: int) -> int:
    import math

    return math.gcd(a, b)


def stage_model(job: Job, tp: int, cp: int, ep: int, pp: int, micro_batch: int,
                stage_layers: tuple[tuple[int, ...], ...], vpp: int) -> StepTimeModel:
    """A :class:`StepTimeModel` of a skeleton with the smallest valid ``dp`` and one micro-batch per step.

    Its per-stage parameter counts (``dense_params_per_gpu``, ``expert_params_per_gpu``) and its
    compute per micro-batch do not depend on ``dp``; cached per argument tuple.
    """
    return _stage_model_cached(job, tp, cp, ep, pp, micro_batch, stage_layers, vpp)
