"""Cheap upper bounds on a candidate's throughput, for pruning before any solve.

A candidate's predicted step (:meth:`placement.performance.StepTimeModel.predict`) is at least its
*compute-bound* step: the same pipeline with no all-to-all time, no data-parallel traffic and every
expert GPU at the mean load (``load_l >= 1`` only adds compute; communication only adds time):
``(m + (pp - 1) / vpp) * max_s sum_l c_l`` with ``c_l`` at load 1.  So
``tokens_per_step / compute_bound_step`` bounds the job tokens/s of every placement of the
candidate, whichever method places it.
"""

from __future__ import annotations

import numpy as np

from placement.plan.skeleton import stage_model

__all__ = ["compute_bound_step_s", "tokens_per_s_bound"]


def compute_bound_step_s(job: object, candidate: object) -> float:
    """Seconds of the candidate's compute-bound step (see the module docstring)."""
    c = candidate
    sm = stage_model(job, c.tp, c.cp, c.ep, c.pp, c.micro_batch, c.stage_layers, c.vpp)  # type: ignore[attr-defined]
    L = job.model.num_moe_layers  # type: ignore[attr-defined]
    pred = sm.predict(np.zeros(L), np.ones(L), None, communication=False)
    bubble = (c.pp - 1) / c.vpp  # type: ignore[attr-defined]
    per_microbatch = pred.compute_bound_step_time_s / (1.0 + bubble)  # the skeleton runs one micro-batch
    m = job.global_batch // (c.dp * c.micro_batch)  # type: ignore[attr-defined]
    return (m + bubble) * per_microbatch


def tokens_per_s_bound(job: object, candidate: object) -> float:
    """Upper bound on the candidate's predicted job tokens/s."""
    return job.tokens_per_step / compute_bound_step_s(job, candidate)  # type: ignore[attr-defined]
