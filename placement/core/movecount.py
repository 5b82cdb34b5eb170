"""What a re-placement moves, counted from the data model alone (no file, no checker, no solver).

The accounting the solvers price moves with and :mod:`placement.predict.moves` reports them with; the
rules (bytes per replica, counting by GPU, move time) are written out in :mod:`placement.predict.moves`.
The request itself, :class:`placement.core.model.MoveRequest`, lives in the data model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from placement.core.model import Instance, InvalidInputError, Placement

__all__ = [
    "WEIGHT_BYTES_PER_PARAM",
    "OPTIMIZER_BYTES_PER_PARAM",
    "MoveCount",
    "expert_params",
    "replica_state_bytes",
    "total_state_bytes",
    "replica_gpus",
    "count_moves",
]

WEIGHT_BYTES_PER_PARAM = 2.0  # BF16 weights
OPTIMIZER_BYTES_PER_PARAM = 12.0  # FP32 master copy + Adam exp_avg + exp_avg_sq (FP32 each)


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
