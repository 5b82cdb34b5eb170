"""Choose the pipeline layer split for a placement: which (virtual) stage holds which layers.

The step time is set by the slowest pipeline stage (:mod:`placement.predict.performance`), and a stage's
time is the sum of what it holds: decoder layers, the embedding, the MTP layers and the loss
(:func:`placement.predict.performance.stage_items`).  :func:`choose_layout` searches the chunk lists
Megatron-Core accepts (:func:`placement.core.pipeline_layout.validate_chunks`) for the one that
minimises the predicted step time of a given placement (its rank layout and expert maps fixed):

Step 1. Price every item once with the placement's metrics (:meth:`StepTimeModel.item_times_s`):
   per item the seconds it adds to a paired slot (``tau``) and to an unpaired one (``sigma``).
Step 2. A dynamic programme over contiguous splits of the item sequence ``E t ... t m L`` into
   ``pp * vpp`` non-empty chunks minimises the largest chunk weight ``(M - 1) tau + (1 + (pp-1)/vpp)
   sigma`` (``M`` micro-batches), within Megatron's rules: the MTP layers in one chunk, in a rank's
   last virtual stage.
Step 3. A local search moves single chunk boundaries by one item while the step-time objective of
   the pipeline ranks (each the sum of its ``vpp`` chunks) improves, from the programme's split and
   from the instance's own.
Step 4. Every candidate (the instance's split first) is re-scored by the evaluator and the step-time
   model with the layout applied (the MoE layers' EP groups, the pipeline sends and the data-parallel
   parameters all follow the layout), on the sampled window only; the fastest wins, ties keep the
   earlier, so the answer is never slower than the instance's split on that window.

An item's all-to-all time in steps 1-3 is its layer's under the instance's split (a layer moved to
another rank meets that rank's EP groups): step 4 prices it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from placement.predict.cost import evaluate
from placement.core.model import Instance, Placement
from placement.predict.performance import StepTimeModel, stage_items
from placement.core.pipeline_layout import chunks_from_counts, instance_chunks, render_layout, with_layout

__all__ = ["SplitChoice", "choose_layout", "item_weights", "best_bottleneck_split", "improve_split"]

MAX_LOCAL_MOVES = 10_000  # boundary moves of one local search (each an exact improvement)


@dataclass(frozen=True)
class SplitChoice:
    """What :func:`choose_layout` chose.

    chunks : the chosen chunk list (Megatron-Core order).
    name : which candidate it is (``instance``, ``balanced``, ``balanced+local``, ``instance+local``).
    step_time_s : per candidate name, the predicted step time (sampled window, mid setting).
    layouts : per candidate name, its layout string.
    """

    chunks: tuple[str, ...]
    name: str
    step_time_s: dict[str, float] = field(default_factory=dict)
    layouts: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"chosen": render_layout(self.chunks), "candidate": self.name,
                "candidates": {k: {"layout": self.layouts[k], "predicted_step_time_s": self.step_time_s[k]}
                               for k in self.step_time_s}}


def item_weights(instance: Instance, placement: Placement) -> tuple[np.ndarray, np.ndarray, int]:
    """Step 1: ``(tau, sigma, mtp_start)`` per item of the sequence ``E t_0 .. t_{L-1} m.. L``.

    ``tau``, ``sigma``: (L + mtp + 2,) seconds per micro-batch in a paired and an unpaired slot;
    ``mtp_start``: the index of the first MTP item (``L + 1``).
    """
    perf = instance.performance
    assert perf is not None
    mtp = perf.architecture.mtp_num_layers
    n = instance.model.num_layers
    model = StepTimeModel(instance)
    metrics = evaluate(instance, placement, window="sampled")
    tau, sigma, _, _ = model.item_times_s(
        metrics.alltoall_time_s_per_layer, metrics.expert_load_max_over_mean_per_layer,
        nic_bytes_per_layer=metrics.max_gpu_cross_domain_bytes_per_layer,
        nvlink_bytes_per_layer=metrics.max_gpu_nvlink_bytes_per_layer,
    )
    seq_tau = np.zeros(n + mtp + 2)
    seq_sigma = np.zeros(n + mtp + 2)
    pos = {"E": lambda j: 0, "t": lambda j: 1 + j, "m": lambda j: 1 + n + j, "L": lambda j: n + mtp + 1}
    k = 0
    for items in stage_items(instance, mtp):
        for kind, j in items:
            seq_tau[pos[kind](j)] = tau[k]
            seq_sigma[pos[kind](j)] = sigma[k]
            k += 1
    return seq_tau, seq_sigma, 1 + n


def _chunk_ok(k: int, i: int, j: int, m0: int, m1: int, first_mtp_chunk: int) -> bool:
    """Chunk ``k`` holding items ``i .. j-1`` keeps the MTP run ``m0 .. m1-1`` whole and late."""
    if m0 < i < m1 or m0 < j < m1:
        return False
    holds_mtp = m1 > m0 and i < m1 and j > m0
    return not holds_mtp or k >= first_mtp_chunk


def best_bottleneck_split(weight: np.ndarray, chunks: int, mtp_start: int, mtp: int, first_mtp_chunk: int) -> list[int] | None:
    """Step 2: chunk boundaries ``b_0 = 0 < ... < b_K = N`` minimising the largest chunk weight.

    ``weight``: (N,) per item; every chunk non-empty; the MTP run stays whole in a chunk of index
    ``>= first_mtp_chunk``.  Ties: the smallest sum of squared chunk weights.  None when no split
    exists.  ``O(K N^2)``.
    """
    n = len(weight)
    if chunks > n:
        return None
    prefix = np.concatenate([[0.0], np.cumsum(weight)])
    m0, m1 = mtp_start, mtp_start + mtp
    inf = float("inf")
    best = np.full((chunks + 1, n + 1), inf)
    best[0, 0] = 0.0
    for k in range(chunks):
        for j in range(k + 1, n - (chunks - 1 - k) + 1):
            v = inf
            for i in range(k, j):
                if best[k, i] < inf and _chunk_ok(k, i, j, m0, m1, first_mtp_chunk):
                    v = min(v, max(best[k, i], prefix[j] - prefix[i]))
            best[k + 1, j] = v
    cap = best[chunks, n]
    if cap == inf:
        return None
    cap = cap * (1 + 1e-12) + 1e-18
    sq = np.full((chunks + 1, n + 1), inf)
    arg = np.full((chunks + 1, n + 1), -1, dtype=np.int64)
    sq[0, 0] = 0.0
    for k in range(chunks):
        for j in range(k + 1, n - (chunks - 1 - k) + 1):
            for i in range(k, j):
                c = prefix[j] - prefix[i]
                if sq[k, i] == inf or c > cap or not _chunk_ok(k, i, j, m0, m1, first_mtp_chunk):
                    continue
                v = sq[k, i] + c * c
                if v < sq[k + 1, j]:
                    sq[k + 1, j], arg[k + 1, j] = v, i
    bounds = [n]
    j = n
    for k in range(chunks, 0, -1):
        j = int(arg[k, j])
        bounds.append(j)
    return bounds[::-1]


def _objective(bounds: list[int], tau_prefix: np.ndarray, sigma_prefix: np.ndarray, pp: int, slots: float,
               bubble: float) -> tuple[float, float]:
    """(step-time objective, sum of squared rank times) of a split: ranks sum their chunks."""
    b = np.asarray(bounds)
    ct = tau_prefix[b[1:]] - tau_prefix[b[:-1]]
    cs = sigma_prefix[b[1:]] - sigma_prefix[b[:-1]]
    rt = ct.reshape(-1, pp).sum(axis=0)
    rs = cs.reshape(-1, pp).sum(axis=0)
    return float(slots * rt.max() + bubble * rs.max()), float((rt * rt).sum())


def improve_split(bounds: list[int], tau: np.ndarray, sigma: np.ndarray, pp: int, micro_batches: int, vpp: int,
                  mtp_start: int, mtp: int) -> list[int]:
    """Step 3: move single boundaries by one item while ``(objective, sum of squares)`` drops.

    The objective is the pipeline formula of :mod:`placement.predict.performance` over the ranks, each the
    sum of its chunks: ``(M - 1) max_r tau_r + (1 + (pp - 1) / vpp) max_r sigma_r``.
    """
    tp_ = np.concatenate([[0.0], np.cumsum(tau)])
    sp_ = np.concatenate([[0.0], np.cumsum(sigma)])
    slots, bubble = float(micro_batches - 1), 1.0 + (pp - 1) / vpp
    first_mtp_chunk = (vpp - 1) * pp
    m0, m1 = mtp_start, mtp_start + mtp
    b = list(bounds)
    cur = _objective(b, tp_, sp_, pp, slots, bubble)
    for _ in range(MAX_LOCAL_MOVES):
        moved = False
        for k in range(1, len(b) - 1):
            for step in (-1, 1):
                x = b[k] + step
                if not b[k - 1] < x < b[k + 1]:
                    continue
                if not (_chunk_ok(k - 1, b[k - 1], x, m0, m1, first_mtp_chunk) and _chunk_ok(k, x, b[k + 1], m0, m1, first_mtp_chunk)):
                    continue
                trial = b[:k] + [x] + b[k + 1:]
                val = _objective(trial, tp_, sp_, pp, slots, bubble)
                if val[0] < cur[0] * (1 - 1e-12) or (val[0] <= cur[0] and val[1] < cur[1] * (1 - 1e-12)):
                    b, cur, moved = trial, val, True
        if not moved:
            break
    return b


def _bounds_of(chunks: tuple[str, ...]) -> list[int]:
    out = [0]
    for c in chunks:
        out.append(out[-1] + len(c))
    return out


def _chunks_of(bounds: list[int], num_layers: int, mtp: int) -> tuple[str, ...]:
    seq = "E" + "t" * num_layers + "m" * mtp + "L"
    return tuple(seq[a:b] for a, b in zip(bounds[:-1], bounds[1:]))


def choose_layout(instance: Instance, placement: Placement) -> SplitChoice:
    """The pipeline layout for ``placement`` on ``instance`` (module docstring, steps 1-4).

    The instance needs a ``performance`` block.  With ``pp = 1`` the instance's own layout is
    returned unscored.
    """
    perf = instance.performance
    if perf is None:
        raise ValueError(f"instance {instance.name!r} has no performance block")
    par = instance.parallel
    own = instance_chunks(instance)
    if par.pp == 1:
        return SplitChoice(own, "instance")
    n, mtp, vpp = instance.model.num_layers, perf.architecture.mtp_num_layers, perf.vpp
    if len(own) != par.pp * vpp:  # an instance without a layout: spread its stages over vpp
        counts = [c.count("t") for c in own]
        per_rank = [[counts[s] // vpp + (1 if v < counts[s] % vpp else 0) for v in range(vpp)] for s in range(par.pp)]
        flat = [per_rank[i % par.pp][i // par.pp] for i in range(par.pp * vpp)]
        own = chunks_from_counts(flat, par.pp * vpp - 1, mtp)
    tau, sigma, mtp_start = item_weights(with_layout(instance, own), placement)
    m = par.micro_batches_per_step
    weight = (m - 1) * tau + (1 + (par.pp - 1) / vpp) * sigma
    cands: dict[str, tuple[str, ...]] = {"instance": own}
    bal = best_bottleneck_split(weight, par.pp * vpp, mtp_start, mtp, (vpp - 1) * par.pp)
    if bal is not None:
        cands["balanced"] = _chunks_of(bal, n, mtp)
        cands["balanced+local"] = _chunks_of(improve_split(bal, tau, sigma, par.pp, m, vpp, mtp_start, mtp), n, mtp)
    cands["instance+local"] = _chunks_of(improve_split(_bounds_of(own), tau, sigma, par.pp, m, vpp, mtp_start, mtp), n, mtp)
    times: dict[str, float] = {}
    layouts: dict[str, str] = {}
    seen: dict[tuple[str, ...], str] = {}
    best_name = "instance"
    for name, chunks in cands.items():
        if chunks in seen:  # the same split twice: score it once
            times[name] = times[seen[chunks]]
        else:
            inst = with_layout(instance, chunks)
            metrics = evaluate(inst, placement, window="sampled")
            times[name] = StepTimeModel(inst).predict_metrics(metrics, placement.rank2gpu).step_time_s
            seen[chunks] = name
        layouts[name] = render_layout(chunks)
        if times[name] < times[best_name] * (1 - 1e-12):
            best_name = name
    return SplitChoice(cands[best_name], best_name, times, layouts)
