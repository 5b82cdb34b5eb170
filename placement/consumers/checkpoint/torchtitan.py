"""TorchTitan DCP checkpoints (``outputs/checkpoint/step-N``).

Model FQNs at the top level (``layers.N.moe.router.gate.weight``, ``layers.N.moe.experts.w1``
(E, hidden, dim), ``layers.N.moe.expert_bias``, ``layers.N.moe.tokens_per_expert``; TorchTitan
0.3.0's ``routed_experts.inner_experts.w1_EFD`` and ``expert_bias_E``), optimizer state as
``optimizer.state.<fqn>.<name>``, and DeepSeek-V3's MTP layers as ``mtp_layers.J.moe.*`` (model
layer ``num_layers + J``; ``torchtitan/models/deepseek_v3/mtp.py``).  Under expert parallelism
the expert tensors are DTensors sharded along the expert axis: a chunk holds ``E / ep`` experts,
assembled by :mod:`placement.consumers.checkpoint.dcp` from the chunks its experts come from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from placement.consumers.checkpoint.dcp import permute_dcp

__all__ = ["permute_torchtitan_dcp"]


def permute_torchtitan_dcp(
    src: str | os.PathLike, dst: str | os.PathLike, doc: Mapping[str, Any] | str, **kwargs: Any
) -> list[str]:
    """:func:`placement.consumers.checkpoint.permute_dcp` with ``stack="torchtitan"``."""
    return permute_dcp(src, dst, doc, stack="torchtitan", **kwargs)
