"""Exporters: a placement in the files real stacks read, and a reader for each to parse it back.

Every exporter takes the :class:`~placement.core.model.Instance` the placement was solved for and the
:class:`~placement.core.model.Placement` (already passed through :func:`placement.core.checker.check`), and
returns text; :func:`export_file` does the checks and writes the text atomically.  What each stack
reads, and the source files that say so, is in ``docs/formats.md``.

========== ================================================ =====================================
format     what is written                                  consumed by
========== ================================================ =====================================
sglang     ``{"physical_to_logical_map": [L][P]}``, one row  ``--init-expert-location FILE.json``
           per transformer layer (dense rows trivial)
vllm       ``physical_to_logical_map (L, P)``,               vLLM EPLB state (vLLM has no loader:
                                                            for inspection or a plugin)
           ``logical_to_physical_map (L, E, R+1)`` padded
           with -1, ``logical_replica_count (L, E)``; L =
           MoE layers
vllm-      ``moe_layer_count``, ``layer_list`` of            the vllm-ascend plugin's
ascend     ``device_list[r].device_expert``                 ``expert_map_path`` (Ascend NPUs only)
megatron   per MoE layer the permutation ``phy2log``:       :mod:`placement.consumers.checkpoint` applied to
torchtitan new expert slot ``p`` takes old expert              a Megatron-Core / TorchTitan state
           ``phy2log[p]``                                   dict, offline
slurm      one host name per line, line ``i`` = rank ``i``  ``SLURM_HOSTFILE`` with
           (and ``OUT.gpus``: per host CUDA_VISIBLE_DEVICES, ``srun --distribution=arbitrary``
           ``OUT.launch.sh``: :mod:`placement.consumers.launch`)       (or torchrun, where the layout allows)
hybridep   ``sh`` file of ``export NAME=VALUE`` lines        DeepEP HybridEP / Megatron ``flex``
           (value chosen per rank when EP groups differ)
maxtext    mesh axes and shape, the device order as         a ``jax.sharding.Mesh`` built from it;
           (process, local device) pairs, and per MoE       the permutation applied to MaxText's
           layer ``phy2log`` with the tensor paths and      scanned checkpoint
           their expert / layer axes (:mod:`placement.consumers.maxtext`)
========== ================================================ =====================================

One module per format family: :mod:`~placement.consumers.export.sglang`,
:mod:`~placement.consumers.export.vllm` (vllm and vllm-ascend),
:mod:`~placement.consumers.export.permutation` (megatron, torchtitan),
:mod:`~placement.consumers.export.slurm`, :mod:`~placement.consumers.export.hybridep`,
:mod:`placement.consumers.maxtext`; :mod:`~placement.consumers.export.driver` holds the ``--format``
registry and :func:`export_file`.  Every public name is importable from this package.
"""

from __future__ import annotations

from placement.consumers.export._text import _json_text  # noqa: F401 (tests print documents as exported)
from placement.consumers.export.driver import (
    FORMATS,
    ExportFormat,
    LaunchWarning,
    export_apply,
    export_file,
    export_text,
    load_for_export,
    require_placement_of,
)
from placement.consumers.export.hybridep import (
    hybridep_env,
    hybridep_env_text,
    hybridep_rank2n,
    hybridep_small_node_groups,
    parse_env_text,
    parse_hybridep_env_text,
)
from placement.consumers.export.permutation import expert_permutation
from placement.consumers.export.sglang import parse_sglang_expert_location, sglang_expert_location, sglang_layout_problem
from placement.consumers.export.slurm import (
    parse_slurm_hostfile,
    parse_slurm_launch,
    slurm_gpus_path,
    slurm_gpus_text,
    slurm_hostfile_text,
)
from placement.consumers.export.vllm import (
    parse_vllm_ascend_expert_map,
    parse_vllm_eplb_maps,
    vllm_ascend_expert_map,
    vllm_eplb_maps,
)
from placement.core.checker import check, deepep_violations, group_breaks  # noqa: F401 (part of this module's namespace)
from placement.core.permutation import PERMUTATION_DIRECTION, parse_expert_permutation

__all__ = [
    "require_placement_of",
    "ExportFormat",
    "LaunchWarning",
    "FORMATS",
    "PERMUTATION_DIRECTION",
    "sglang_expert_location",
    "sglang_layout_problem",
    "parse_sglang_expert_location",
    "vllm_eplb_maps",
    "parse_vllm_eplb_maps",
    "vllm_ascend_expert_map",
    "parse_vllm_ascend_expert_map",
    "expert_permutation",
    "parse_expert_permutation",
    "slurm_hostfile_text",
    "slurm_gpus_text",
    "slurm_gpus_path",
    "parse_slurm_hostfile",
    "parse_slurm_launch",
    "hybridep_rank2n",
    "hybridep_small_node_groups",
    "hybridep_env",
    "hybridep_env_text",
    "parse_hybridep_env_text",
    "parse_env_text",
    "export_text",
    "load_for_export",
    "export_file",
    "export_apply",
]
