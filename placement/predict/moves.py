"""What a re-placement moves: expert state bytes per replica, moves counted by GPU, their time.

A re-placement replaces a *previous* placement (the one training runs with) by a new one for the
same instance shape.  Every expert replica whose GPU changes moves its state once:

* **Per replica** (expert ``e`` of MoE layer ``l`` in one EP group): ``P`` parameters, with ``P``
  ``= f * hidden_size * moe_ffn_hidden_size`` (``f = 3`` for SwiGLU's three matrices, 2 without;
  the same count :class:`placement.predict.performance.StepTimeModel` uses for the data-parallel
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
from typing import Any

from placement.core.model import Instance, InvalidInputError, MoveRequest, Placement
from placement.core.movecount import (
    OPTIMIZER_BYTES_PER_PARAM,
    WEIGHT_BYTES_PER_PARAM,
    MoveCount,
    count_moves,
    expert_params,
    replica_gpus,
    replica_state_bytes,
    total_state_bytes,
)

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


def check_previous(instance: Instance, previous: Placement, where: str = "previous") -> None:
    """Raise :class:`InvalidInputError` ``"<where>: <field>: ..."`` if ``previous`` does not fit the
    instance's shape (ranks, MoE layers, experts, GPUs)."""
    from placement.core.checker import check

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
    from placement.predict.report import report

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
