"""Cheap upper bounds on a candidate's throughput, for pruning before any solve.

A candidate's predicted step (:meth:`placement.predict.performance.StepTimeModel.predict`) is at least its
*compute-bound* step: the same pipeline with no all-to-all time, no data-parallel traffic and every
expert GPU at the mean load (``load_l >= 1`` only adds compute; communication only adds time):
``(m + (pp - 1) / vpp) * max_s sum_l c_l`` with ``c_l`` at load 1.  So
``tokens_per_step / compute_bound_step`` bounds the job tokens/s of every placement of the
candidate, whichever method places it.

The bound is tightened, still valid, by a lower bound on each MoE layer's expert load
(:func:`load_lower_bound`): the evaluator's ``max over EP groups of max GPU / group mean`` is at
least the busiest EP rank's pairs summed over the stage's EP groups over their summed means (a
maximum of ratios is at least the ratio of the sums), and with ``s = E / ep`` experts on each of
``ep`` ranks the busiest rank holds at least ``max(total / ep, max_k (a_{k ep - k + 1} + ... +
a_{k ep + 1}) + (s - k - 1) a_E)`` pairs (``a`` the experts' pair counts sorted descending: of the
``k ep + 1`` largest, some rank holds ``k + 1``; its other experts hold at least the smallest
count each).  The counts are the sampled window's, regrouped for the candidate's ``dp``; the
bound holds for the sampled-window prediction, which the plan ranks by.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np


from placement.plan.skeleton import stage_model

if TYPE_CHECKING:  # pragma: no cover
    from placement.formats.job import Job
    from placement.plan.candidates import Candidate


__all__ = ["compute_bound_step_s", "tokens_per_s_bound", "load_lower_bound"]


def load_lower_bound(topk: np.ndarray, num_experts: int, ep: int) -> list[float]:
    """(L,) lower bounds on the evaluator's expert load max/mean of every MoE layer for any map.

    ``topk``: (L, dp, T, k) the window's expert ids (see the module docstring).
    """
    L = topk.shape[0]
    s = num_experts // ep
    out: list[float] = []
    for li in range(L):
        a = np.sort(np.bincount(topk[li].reshape(-1).astype(np.int64), minlength=num_experts).astype(np.float64))[::-1]
        total = float(a.sum())
        if total <= 0:
            out.append(1.0)
            continue
        best = total / ep
        prefix = np.concatenate([[0.0], np.cumsum(a)])
        for k in range(0, s):
            hi = k * ep + 1  # the k*ep + 1 largest counts: some rank holds k + 1 of them
            if hi > num_experts:
                break
            lo = hi - (k + 1)
            best = max(best, float(prefix[hi] - prefix[lo]) + (s - k - 1) * float(a[-1]))
        out.append(max(1.0, best * ep / total))
    return out


def compute_bound_step_s(job: Job, candidate: Candidate, load: list[float] | None = None) -> float:
    """Seconds of the candidate's compute-bound step (see the module docstring).

    ``load``: (L,) lower bounds on the expert load max/mean per MoE layer (default 1: balanced).
    """
    c = candidate
    sm = stage_model(job, c.tp, c.cp, c.ep, c.pp, c.micro_batch, c.stage_layers, c.vpp)
    L = job.model.num_moe_layers
    pred = sm.predict([0.0] * L, [1.0] * L if load is None else load, None, communication=False)
    bubble = (c.pp - 1) / c.vpp
    per_microbatch = pred.compute_bound_step_time_s / (1.0 + bubble)  # the skeleton runs one micro-batch
    m = job.global_batch // (c.dp * c.micro_batch)
    return (m + bubble) * per_microbatch


def tokens_per_s_bound(job: Job, candidate: Candidate, load: list[float] | None = None) -> float:
    """Upper bound on the candidate's predicted job tokens/s (``load`` as :func:`compute_bound_step_s`)."""
    return job.tokens_per_step / compute_bound_step_s(job, candidate, load)
