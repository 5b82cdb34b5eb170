"""What a re-placement moves: expert state bytes per replica, moves counted by GPU, their time.

A re-placement replaces a *previous* placement (the one training runs with) by a new one for the
same instance shape.  Every expert replica whose GPU changes moves its state once:

* **Per replica** (expert ``e`` of MoE layer ``l`` in one EP group): ``P`` parameters, with ``P``
  ``= f * hidden_size * moe_ffn_hidden_size`` (``f = 3`` for SwiGLU's three matrices, 2 without;
  the same count :class:`placement.performance.StepTimeModel` uses for the data-parallel
  all-gather), times ``2`` bytes of BF16 weights plus ``12 / r`` bytes of optimizer state (an FP32
  master copy and Adam's two FP32 moments).  ``r`` is the number of replicas of the expert, the
  stage's EP groups (``tp * cp * dp / ep``), under Megatron's distributed optimizer, which shards
  the optimizer state over the expert-data-parallel group (the default, ``sharded_optimizer``),
  and 1 when every replica keeps the whole state.  DeepSeek-V3 (``P = 3 * 7168 * 2048 =
  44,040,192``) with 64 replicas: ``P * (2 + 12/64) = 96.3 MB`` per replica; unsharded, 617 MB.
* **By GPU**: a replica moves when the GPU holding it changes (``rank2gpu`` of its EP rank); it
  moves **across racks** when the two GPUs lie in different NVLink domains (the scale-out fabric)
  and **over NVLink** otherwise.  Slots of one GPU are interchangeable: a replica that changes slot
  but not GPU does not move.  Counting by GPU makes two placements with different rank layouts
  comparable as well.
* **Move time**: all moves run as one exchange; the busiest GPU sets its time, as in the
  evaluator's all-to-all: per GPU the larger of what it sends and receives, cross-rack bytes over
  its NIC (``scaleout_gbps``) plus NVLink bytes over its NVLink port (``nvlink_gbps``).

The move-cost weight of ``placement solve --move-cost W`` prices a moved byte in bytes of per-step
all-to-all: the objective is ``cross-domain all-to-all bytes per step + W * (cross-rack moved
bytes + NVLink moved bytes * scaleout_gbps / nvlink_gbps)``, i.e. a moved byte costs what a
cross-domain byte of one step costs, scaled by how much slower its link is; ``W = 1/N`` amortises
the move over the ``N`` steps the placement will serve.  ``--max-moved-bytes B`` bounds the
moved bytes (cross-rack plus NVLink) of the whole placement.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from placement.model import Instance, InvalidInputError, Placement

__all__ = [
    "WEIGHT_BYTES_PER_PARAM",
    "OPTIMIZER_BYTES_PER_PARAM",
    "MoveRequest",
    "MoveCount",
    "expert_params",
    "replica_state_bytes",
    "total_state_bytes",
    "replica_gpus",
    "count_moves",
    "check_previous",
    "load_previous",
    "parse_moved_bytes",
    "move_report",
]

WEIGHT_BYTES_PER_PARAM = 2.0  # BF16 weights
OPTIMIZER_BYTES_PER_PARAM = 12.0  # FP32 master copy + Adam exp_avg + exp_avg_sq (FP32 each)


@dataclass(frozen=True)
class MoveRequest:
    """A re-placement request: keep close to ``previous``.

    previous : the placement training runs with (same instance shape).
    max_moved_bytes : hard budget on the moved bytes (cross-rack plus NVLink) of the whole placement.
    move_cost : weight ``W`` of a moved byte in per-step all-to-all bytes (module docstring).
    expert_params : parameters per routed expert (default: from the instance's ``performance``
        block).
    sharded_optimizer : the optimizer state is sharded over the expert's replicas (Megatron's
        distributed optimizer); False: every replica holds it whole.
    """

    previous: Placement
    max_moved_bytes: float | None = None
    move_cost: float | None = None
    expert_params: int | None = None
    sharded_optimizer: bool = True

    def __post_init__(self) -> None:
        if self.max_moved_bytes is not None and self.move_cost is not None:
            raise InvalidInputError("max_moved_bytes, move_cost: give at most one of them")
        for name in ("max_moved_bytes", "move_cost"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                raise InvalidInputError(f"{name}: expected a non-negative, finite number, found {v!r}")
        p = self.expert_params
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p <= 0):
            raise InvalidInputError(f"expert_params: expected a positive integer, found {p!r}")


def expert_params(instance: Instance, override: int | None = None) -> int:
    """Parameters of one routed expert: ``f * hidden_size * moe_ffn_hidden_size`` (module docstring).

    Raises
    ------
    InvalidInputError
        Without ``override`` on an instance without a ``performance`` block (its architecture holds
        ``moe_ffn_hidden_size``).
    """
    if override is not None:
        return int(override)
    if instance.performance is None:
        raise InvalidInputError(f"{instance.name}: performance.architecture: the expert size is unknown without a "
                                "performance block; give the parameters per expert (--expert-params)")
    arch = instance.performance.architecture
    f = 3 if arch.swiglu else 2
    return int(f * instance.model.hidden_size * arch.moe_ffn_hidden_size)


def replica_state_bytes(instance: Instance, *, params: int | None = None, sharded_optimizer: bool = True) -> float:
    """Bytes one expert replica moves: ``P * (2 + 12 / r)`` (``r`` = replicas when sharded, else 1)."""
    p = expert_params(instance, params)
    r = instance.parallel.ep_groups_per_stage if sharded_optimizer else 1
    return float(p * (WEIGHT_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM / r))


def total_state_bytes(instance: Instance, bytes_per_replica: float) -> float:
    """Bytes of every expert replica of every MoE layer (what moving everything would move)."""
    m = instance.model
    return float(m.num_moe_layers * m.num_experts * instance.parallel.ep_groups_per_stage * bytes_per_replica)


def replica_gpus(instance: Instance, placement: Placement) -> np.ndarray:
    """(L, G, E) GPU holding expert ``e`` of MoE layer ``l`` in EP group ``g`` of its stage."""
    groups = instance.parallel.stage_ep_groups  # (pp, G, ep) global ranks
    e2r = placement.expert2eprank(instance.experts_per_rank)  # (L, E)
    r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    stage = np.asarray(instance.moe_layer2stage, dtype=np.int64)
    ranks = groups[stage[:, None, None], np.arange(groups.shape[1])[None, :, None], e2r[:, None, :]]
    return r2g[ranks]


@dataclass(frozen=True)
class MoveCount:
    """Replicas that change GPU between two placements, and what moving them costs.

    cross_rack_per_layer, nvlink_per_layer : (L,) replicas moved across racks / over NVLink.
    bytes_per_replica : state bytes of one replica (:func:`replica_state_bytes`).
    move_time_s : the busiest GPU's send or receive time (module docstring).
    """

    cross_rack_per_layer: np.ndarray
    nvlink_per_layer: np.ndarray
    bytes_per_replica: float
    replicas_total: int
    move_time_s: float

    @property
    def moved_replicas(self) -> int:
        return int(self.cross_rack_per_layer.sum() + self.nvlink_per_layer.sum())

    @property
    def cross_rack_bytes(self) -> float:
        return float(self.cross_rack_per_layer.sum()) * self.bytes_per_replica

    @property
    def nvlink_bytes(self) -> float:
        return float(self.nvlink_per_layer.sum()) * self.bytes_per_replica

    @property
    def moved_bytes(self) -> float:
        return self.cross_rack_bytes + self.nvlink_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "moved_replicas": self.moved_replicas,
            "moved_replicas_cross_rack": int(self.cross_rack_per_layer.sum()),
            "moved_replicas_nvlink": int(self.nvlink_per_layer.sum()),
            "replicas_total": self.replicas_total,
            "moved_share": self.moved_replicas / self.replicas_total if self.replicas_total else 0.0,
            "bytes_per_replica": self.bytes_per_replica,
            "moved_bytes": self.moved_bytes,
            "moved_bytes_cross_rack": self.cross_rack_bytes,
            "moved_bytes_nvlink": self.nvlink_bytes,
            "move_time_s": self.move_time_s,
            "moved_replicas_per_layer": [int(a + b) for a, b in zip(self.cross_rack_per_layer, self.nvlink_per_layer)],
        }


def count_moves(instance: Instance, old: Placement, new: Placement, *, bytes_per_replica: float) -> MoveCount:
    """Count, by GPU, the replicas that move from ``old`` to ``new`` (module docstring)."""
    g_old, g_new = replica_gpus(instance, old), replica_gpus(instance, new)  # (L, G, E)
    dom = instance.cluster.gpu2domain
    moved = g_old != g_new
    cross = moved & (dom[g_old] != dom[g_new])
    nvl = moved & ~cross
    L = g_old.shape[0]
    cl = instance.cluster
    n_gpus = cl.num_gpus
    cost = np.where(cross, bytes_per_replica / (cl.scaleout_gbps * 1e9), bytes_per_replica / (cl.nvlink_gbps * 1e9))
    cost = np.where(moved, cost, 0.0)
    send = np.bincount(g_old.reshape(-1), weights=cost.reshape(-1), minlength=n_gpus)
    recv = np.bincount(g_new.reshape(-1), weights=cost.reshape(-1), minlength=n_gpus)
    return MoveCount(
        cross_rack_per_layer=cross.reshape(L, -1).sum(axis=1).astype(np.int64),
        nvlink_per_layer=nvl.reshape(L, -1).sum(axis=1).astype(np.int64),
        bytes_per_replica=float(bytes_per_replica),
        replicas_total=int(moved.size),
        move_time_s=float(max(send.max(initial=0.0), recv.max(initial=0.0))),
    )


def check_previous(instance: Instance, previous: Placement, where: str = "previous") -> None:
    """Raise :class:`InvalidInputError` ``"<where>: <field>: ..."`` if ``previous`` does not fit the
    instance's shape (ranks, MoE layers, experts, GPUs)."""
    from placement.checker import check

    problems = check(instance, previous)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InvalidInputError(f"{where}: {problems[0]}{more}")


def load_previous(instance: Instance, path: str | os.PathLike[str]) -> Placement:
    """Read a previous placement file for ``instance``'s shape (any routing: its SHA is not compared).

    Raises
    ------
    InvalidInputError
        Naming the file and the field: malformed file, or a shape that is not the instance's.
    """
    from placement.formats import read_placement

    placement, _ = read_placement(path)
    check_previous(instance, placement, str(path))
    return placement


def parse_moved_bytes(text: str, instance: Instance, bytes_per_replica: float) -> float:
    """``--max-moved-bytes``: a number of bytes (``5e11``), or ``N%`` of every replica's state bytes."""
    t = text.strip()
    try:
        if t.endswith("%"):
            share = float(t[:-1])
            if not (math.isfinite(share) and 0 <= share <= 100):
                raise ValueError
            return share / 100.0 * total_state_bytes(instance, bytes_per_replica)
        v = float(t)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError
        return v
    except ValueError:
        raise InvalidInputError(f"--max-moved-bytes: expected bytes (a non-negative number) or a share "
                                f"like 10%, found {text!r}") from None


def move_report(instance: Instance, previous: Placement, new: Placement, *, bytes_per_replica: float,
                metrics: dict[str, Any] | None = None, previous_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a re-placement moves and what it gains, for the result's details and the CLI.

    Gains are previous minus new: cross-domain bytes per step (sampled and held-out windows) and,
    with a ``performance`` block, the predicted step time; ``payback_steps`` = move time over the
    predicted step-time gain (None without a gain), ``payback_steps_bytes`` = cross-rack moved
    bytes over the cross-domain bytes saved per step (held-out).
    """
    from placement.cost import report

    mc = count_moves(instance, previous, new, bytes_per_replica=bytes_per_replica)
    out: dict[str, Any] = mc.to_dict()
    now = report(instance, new) if metrics is None else metrics
    before = report(instance, previous) if previous_metrics is None else previous_metrics
    gains: dict[str, Any] = {}
    for key in ("cross_domain_bytes_per_step", "heldout_cross_domain_bytes_per_step",
                "predicted_step_time_s", "heldout_predicted_step_time_s"):
        if key in now and key in before and now[key] is not None and before[key] is not None:
            gains[key] = float(before[key]) - float(now[key])
    out["gain"] = gains
    step_gain = gains.get("heldout_predicted_step_time_s", gains.get("predicted_step_time_s"))
    out["payback_steps"] = mc.move_time_s / step_gain if step_gain is not None and step_gain > 0 else None
    byte_gain = gains.get("heldout_cross_domain_bytes_per_step", gains.get("cross_domain_bytes_per_step"))
    out["payback_steps_bytes"] = (mc.cross_rack_bytes / byte_gain if byte_gain is not None and byte_gain > 0
                                  else None)
    return out
