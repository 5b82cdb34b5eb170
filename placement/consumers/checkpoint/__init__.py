"""Apply an expert permutation to a checkpoint: in memory, or offline on the files real stacks write.

Megatron-Core, TorchTitan and MaxText place expert ``j`` on EP rank ``j // (E / ep)`` and read no
expert map, so a placement is applied by renumbering the experts of each MoE layer in the
checkpoint: new expert ``p`` takes old expert ``perm[p]`` (the placement's ``phy2log`` row) for
**every per-expert tensor**: the expert weights and biases, the router weight rows, the router's
per-expert bias and balancing buffers, per-expert FP8 scaling state, and the optimizer's moments
and master weights of all of these.  Moving them together leaves the model's function and its next
optimizer step unchanged: a token that picked old expert ``e`` now picks slot ``log2phy[e]``,
which holds the same weights, with the same score.  With group-limited routing that holds only
when each group of ``E / G`` contiguous ids maps onto one block of ``E / G`` contiguous slots, so
other permutations are refused (:func:`placement.core.permutation.check_permutation`); to use them,
keep the router logical and install the dispatch-time map of :mod:`placement.consumers.runtime`.

Entry points (``docs/checkpoints.md`` has the file layouts and the stack versions they were read
from):

- :func:`apply_permutation` / :func:`apply_exported_permutation`: an in-memory state dict
  (``stack`` = ``megatron``, ``torchtitan`` or ``hf``; torch tensors or numpy arrays).
- :func:`permute_dcp`: a ``torch.distributed.checkpoint`` directory, streamed storage file by
  storage file over processes or hosts, atomic and resumable (:mod:`placement.consumers.checkpoint.dcp`):
  Megatron-Core's ``torch_dist`` format (:mod:`placement.consumers.checkpoint.megatron_dist`: sharded keys
  without layer numbers, layers and experts as axes 0 and 1, MTP layers, per-expert
  ``_extra_state`` objects, the distributed optimizer's model-space moments and, with a recorded
  bucket layout, its default ``dp_reshardable`` buckets) or a TorchTitan checkpoint
  (:mod:`placement.consumers.checkpoint.torchtitan`).
- :func:`permute_megatron_legacy`: Megatron's legacy per-rank ``mp_rank_TT_PPP[_EEE]`` files,
  merged over the expert-parallel ranks, permuted, split again.
- :func:`permute_orbax`: an Orbax PyTree checkpoint of a MaxText model (scanned layers).

MTP layers are model layers ``num_layers + J`` (``J`` the MTP layer's index).  Every offline entry
point refuses before writing anything when a tensor's expert axis cannot be identified (the message
names the tensor), writes the result into a temporary directory beside the destination and renames
it into place: the destination either does not exist or holds the complete permuted checkpoint.  ``python -m placement.consumers.checkpoint`` is the
command line (exit codes 0 ok, 2 invalid input, 3 infeasible, 1 other).
"""

from __future__ import annotations

from placement.consumers.checkpoint._entries import (
    STACKS,
    Form,
    Stack,
    apply_exported_permutation,
    apply_permutation,
    permute_entries,
)
from placement.consumers.checkpoint.cli import main
from placement.consumers.checkpoint.dcp import DcpStats, permute_dcp
from placement.consumers.checkpoint.megatron_dist import (
    megatron_bucket_layout,
    permute_megatron_dist,
    read_bucket_layout,
    write_megatron_bucket_layout,
)
from placement.consumers.checkpoint.megatron_legacy import permute_megatron_legacy
from placement.consumers.checkpoint.orbax import MAXTEXT_DOC_KIND, permute_orbax
from placement.consumers.checkpoint.torchtitan import permute_torchtitan_dcp
from placement.core.permutation import MAXTEXT_EXPERT_PATHS, PARAMETER_NAMES

__all__ = [
    "Stack",
    "STACKS",
    "Form",
    "PARAMETER_NAMES",
    "MAXTEXT_EXPERT_PATHS",
    "MAXTEXT_DOC_KIND",
    "apply_permutation",
    "apply_exported_permutation",
    "permute_entries",
    "permute_dcp",
    "permute_megatron_dist",
    "permute_torchtitan_dcp",
    "DcpStats",
    "megatron_bucket_layout",
    "write_megatron_bucket_layout",
    "read_bucket_layout",
    "permute_megatron_legacy",
    "permute_orbax",
    "main",
]
