"""Megatron-Core ``torch_dist`` checkpoints, and the bucket layout of its distributed optimizer.

Megatron-Core saves the distributed optimizer's state in one of these layouts
(``metadata["distrib_optim_sharding_type"]``, ``DistributedOptimizer.sharded_state_dict`` in
``megatron/core/optimizer/distrib_optimizer.py``, 0.16.1 and core_v0.19.0):

- ``dp_reshardable`` (the default of ``megatron.training``'s ``--ckpt-format torch_dist``): each
  bucket's flat state as one tensor per state, ``[chained_N.]optimizer.distributed.dp_group_idx_G.
  gbuf_idx_I.dtype_(P, G).bucket_idx_B.{param,exp_avg,exp_avg_sq}``, of the bucket's unpadded
  length, each parameter's slice at its offset in the bucket.  The checkpoint does not say which
  parameter lies where (only ``per_bucket_numel``): the layout is derived by the optimizer from
  the model, so it is recorded from the live optimizer with :func:`write_megatron_bucket_layout`
  (any job building the same model and parallel layout gives the same layout) and passed to
  :func:`placement.consumers.checkpoint.permute_dcp` as ``bucket_layout``.  An expert's slices take those
  of its source expert (on another expert-parallel rank's bucket when it moves across ranks),
  the router weight's rows are permuted inside its slice.
- ``fully_reshardable`` / ``fully_sharded_model_space``: model-space tensors
  ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<model key>``, permuted like the model.
- ``fsdp_dtensor`` (Megatron FSDP only): a plain ``torch.distributed.checkpoint`` save of
  ``{"model": ..., "optimizer": ...}``: per-parameter DTensors ``model.module.<name>`` (the FP32
  main weights), ``optimizer.state.module.module.module.<name>.{exp_avg,exp_avg_sq,step}`` and
  ``optimizer.param_to_group_meta.<...>.<field>`` objects, experts by global id
  (``handle_experts_in_state_dict``: ``...local_experts.{e}.``, ``...linear_fc1.weight{e}``, SwiGLU
  ``weight{e}_w`` / ``_v``).  Recognised by its ``model.`` names and permuted by name; read from
  source, not run here (Megatron FSDP needs CUDA).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from placement.consumers.checkpoint.buckets import (  # noqa: F401  (re-exported)
    BUCKET_LAYOUT_KIND,
    megatron_bucket_layout,
    read_bucket_layout,
    write_megatron_bucket_layout,
)
from placement.consumers.checkpoint.dcp import permute_dcp

__all__ = [
    "BUCKET_LAYOUT_KIND",
    "megatron_bucket_layout",
    "write_megatron_bucket_layout",
    "read_bucket_layout",
    "permute_megatron_dist",
]

def permute_megatron_dist(
    src: str | os.PathLike, dst: str | os.PathLike, doc: Mapping[str, Any] | str, **kwargs: Any
) -> list[str]:
    """:func:`placement.consumers.checkpoint.permute_dcp` with ``stack="megatron"``."""
    return permute_dcp(src, dst, doc, stack="megatron", **kwargs)
