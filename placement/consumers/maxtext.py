"""JAX/MaxText: the device order of the mesh and the expert permutation of a scanned checkpoint.

What MaxText does (``AI-Hypercomputer/maxtext`` @e591f30, read with the project's code search):

- ``src/maxtext/utils/maxtext_utils.py``, ``create_device_mesh(config, devices=None)``: with one
  slice it reshapes ``devices`` (default ``jax.devices()``) to the ICI parallelism of
  ``config.mesh_axes`` through ``jax.experimental.mesh_utils.create_device_mesh``;
  ``get_mesh_from_config`` wraps the array in ``jax.sharding.Mesh(devices_array,
  config.mesh_axes)``.  The mesh axes (``src/maxtext/configs/base.yml``) are
  :data:`MAXTEXT_MESH_AXES`, and ``ici_<axis>_parallelism`` sets each size.
- ``jax/_src/mesh_utils.py`` (jax 0.10.2) ``create_device_mesh`` *sorts GPU devices by id* before
  reshaping (``np.asarray(sorted(devices, key=lambda d: d.id)).reshape(...)``), so a device order
  handed to MaxText's ``create_device_mesh`` on GPUs is ignored.  Build the mesh from this file's
  order with ``jax.sharding.Mesh`` directly (``np.array(devices).reshape(mesh_shape)``, row-major;
  e.g. by replacing ``maxtext_utils.create_device_mesh``), which is what the tests do on CPU.
- ``src/maxtext/layers/moe.py``: routed experts are sharded over the ``expert`` mesh axis in
  contiguous blocks (shard ``i`` holds experts ``i * E/ep ... (i+1) * E/ep - 1``:
  ``num_experts_per_shard * expert_shard_id``); DeepSeek group-limited routing reshapes the gate
  logits to ``(..., n_routing_groups, E / n_routing_groups)``: groups of contiguous expert ids,
  so under group-limited routing only group-preserving permutations keep the model's function.
- ``src/maxtext/checkpoint_conversion/standalone_scripts/convert_deepseek_family_ckpt.py``: the
  scanned checkpoint holds ``decoder.dense_layers`` (the first ``first_num_dense_layers``) and
  ``decoder.moe_layers``; in ``moe_layers.DeepSeekMoeBlock_0.MoeBlock_0`` the expert weights
  ``wi_0``, ``wi_1``, ``wo`` are ``(E, L, ...)`` (``stack_shape = (num_experts, layer_value)``),
  ``gate.kernel`` is ``(hidden, L, E)`` and ``gate.bias`` (DeepSeek's ``e_score_correction_bias``)
  ``(E, L)`` (stacked ``(L, ...)`` then transposed ``(1, 0, 2)`` / ``(1, 0)``); ``L`` counts MoE
  layers, so MoE layer ``l`` of the model is index ``l`` on the layer axis.  The tree is saved as
  ``TrainState(params={"params": jax_weights})`` (``src/maxtext/checkpoint_conversion/utils/utils.py``,
  ``save_weights_to_checkpoint``): the paths are under ``params/params`` (``tree_root``).

Processes: MaxText on GPUs runs one JAX process per host with all of its GPUs.  A process index
is given to every host the job uses, in order of first appearance in the device order, and each
host's ``CUDA_VISIBLE_DEVICES`` lists its GPUs in the order they appear, so ``local_device`` ``j``
of a process is its ``j``-th visible GPU (``jax.local_devices()[j]``).  Launch host ``i`` as JAX
process ``i`` (``jax.distributed.initialize(process_id=i, ...)``, or a ``SLURM_HOSTFILE`` listing
the hosts in this order with one task per host).
"""

from __future__ import annotations

import numpy as np

from placement.core.model import InfeasibleError, Instance, Placement

__all__ = [
    "MAXTEXT_COMMIT",
    "MAXTEXT_MESH_AXES",
    "MAXTEXT_EXPERT_TENSORS",
    "MAXTEXT_KIND",
    "mesh_shape",
    "maxtext_export",
    "device_coordinates",
]

MAXTEXT_COMMIT = "e591f30cbbf217ed67ef71263ec0538239f9c3b8"
MAXTEXT_KIND = "placement.maxtext"
# src/maxtext/configs/base.yml @e591f30: mesh_axes
MAXTEXT_MESH_AXES: tuple[str, ...] = (
    "diloco", "data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
    "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive",
)  # fmt: skip
_MOE_BLOCK = "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0"
# (path under the parameter tree, expert axis, layer axis), from convert_deepseek_family_ckpt.py @e591f30
MAXTEXT_EXPERT_TENSORS: tuple[tuple[str, int, int], ...] = (
    (f"{_MOE_BLOCK}/wi_0", 0, 1),
    (f"{_MOE_BLOCK}/wi_1", 0, 1),
    (f"{_MOE_BLOCK}/wo", 0, 1),
    (f"{_MOE_BLOCK}/gate/kernel", 2, 1),
    (f"{_MOE_BLOCK}/gate/bias", 0, 1),
)
# MaxText's config key for each mesh axis (maxtext_utils.create_device_mesh's ici_map)
_ICI_KEY = {
    "diloco": "ici_diloco_parallelism", "data": "ici_data_parallelism", "stage": "ici_pipeline_parallelism",
    "fsdp": "ici_fsdp_parallelism", "fsdp_transpose": "ici_fsdp_transpose_parallelism",
    "context": "ici_context_parallelism", "context_usp_ulysses": "ici_context_usp_ulysses_parallelism",
    "context_autoregressive": "ici_context_autoregressive_parallelism", "tensor": "ici_tensor_parallelism",
    "tensor_sequence": "ici_tensor_sequence_parallelism", "expert": "ici_expert_parallelism",
    "autoregressive": "ici_autoregressive_parallelism",
}  # fmt: skip


def _refusal(instance: Instance) -> str | None:
    p, m = instance.parallel, instance.model
    if p.tp > 1 or p.cp > 1:
        return (
            f"maxtext: tp={p.tp} cp={p.cp}: MaxText shards experts over the expert axis and their hidden "
            "dimension over the tensor axis (expert-tensor-parallel = tp), while the placement models "
            "expert-tensor-parallel 1 with tp and cp folded into the EP groups; export tp=1 cp=1 instances"
        )
    tail = tuple(range(m.num_layers - m.num_moe_layers, m.num_layers))
    if m.moe_layers != tail:
        return (
            f"maxtext: MoE layers {list(m.moe_layers)[:6]}... are not the last {m.num_moe_layers} layers: MaxText's "
            "DeepSeek decoder scans first_num_dense_layers dense layers, then only MoE layers"
        )
    return None


def mesh_shape(instance: Instance) -> dict[str, int]:
    """Size of every MaxText mesh axis: ``stage`` = pp, ``data`` = EP groups per stage, ``expert`` = ep."""
    p = instance.parallel
    sizes = dict.fromkeys(MAXTEXT_MESH_AXES, 1)
    sizes.update(stage=p.pp, data=p.ep_groups_per_stage, expert=p.ep)
    return sizes


def device_coordinates(instance: Instance) -> np.ndarray:
    """(pp, dp / ep, ep) global rank at mesh coordinates (stage, data, expert).

    ``data`` is the EP group inside the stage and ``expert`` the EP rank, so expert shard ``e`` of
    the mesh is EP rank ``e``, which holds physical slots ``e * E/ep ...`` as the placement says.
    """
    return np.asarray(instance.parallel.stage_ep_groups)


def maxtext_export(instance: Instance, placement: Placement) -> dict:
    """The ``maxtext`` document: mesh axes and sizes, the device order, processes, expert maps.

    Returns
    -------
    dict
        ``mesh_axes`` (MaxText's names), ``mesh_shape`` (one size per axis), ``ici_parallelism``
        (the ``ici_*_parallelism`` config values that give that shape), ``devices``: row-major over
        ``mesh_shape``, one ``[process_index, local_device]`` pair per mesh position (world,),
        ``ranks``: the global rank at each position, ``processes``: per process index its host and
        ``CUDA_VISIBLE_DEVICES``, ``device_order_is_process_major``, and ``experts``: the tensors
        (path, expert axis, layer axis) and ``layers``: per MoE layer index (the layer axis
        position) the permutation ``phy2log`` (new slot ``p`` takes old expert ``layers[l][p]``).

    Raises
    ------
    InfeasibleError
        tp or cp above 1, MoE layers that are not the model's last layers, or a group-breaking
        permutation under group-limited routing.
    """
    from placement.core.permutation import PERMUTATION_DIRECTION, group_fields, require_whole_groups

    problem = _refusal(instance)
    if problem:
        raise InfeasibleError(problem)
    m, cl = instance.model, instance.cluster
    p2l = np.asarray(placement.phy2log, dtype=np.int64)
    breaks = require_whole_groups(
        p2l, m, f"maxtext: MaxText routes within {m.groups_per_token} of {m.num_groups} groups of contiguous expert ids, "
        f"so the expert permutation must keep groups whole",
    )
    shape = mesh_shape(instance)
    coords = device_coordinates(instance)  # (stage, data, expert) -> rank
    axis_pos = {a: i for i, a in enumerate(MAXTEXT_MESH_AXES)}
    ranks: list[int] = []
    for index in np.ndindex(*[shape[a] for a in MAXTEXT_MESH_AXES]):
        ranks.append(int(coords[index[axis_pos["stage"]], index[axis_pos["data"]], index[axis_pos["expert"]]]))
    r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    process_of_host: dict[int, int] = {}
    visible: dict[int, list[int]] = {}
    devices: list[list[int]] = []
    for r in ranks:
        g = int(r2g[r])
        h = int(cl.gpu2host[g])
        if h not in process_of_host:
            process_of_host[h] = len(process_of_host)
            visible[h] = []
        visible[h].append(g % cl.gpus_per_tray)
        devices.append([process_of_host[h], len(visible[h]) - 1])
    processes = [
        {"process_index": i, "host": cl.host_name(h), "cuda_visible_devices": ",".join(map(str, visible[h]))}
        for h, i in sorted(process_of_host.items(), key=lambda hi: hi[1])
    ]
    first_dense = m.num_layers - m.num_moe_layers
    return {
        "kind": MAXTEXT_KIND,
        "version": 1,
        "maxtext_commit": MAXTEXT_COMMIT,
        "instance": {"name": instance.name, "sha256": instance.sha256},
        "mesh_axes": list(MAXTEXT_MESH_AXES),
        "mesh_shape": [shape[a] for a in MAXTEXT_MESH_AXES],
        "ici_parallelism": {_ICI_KEY[a]: shape[a] for a in MAXTEXT_MESH_AXES},
        "num_slices": 1,
        "devices": devices,
        "ranks": ranks,
        "device_order_is_process_major": devices == sorted(devices),
        "processes": processes,
        "experts": {
            "direction": PERMUTATION_DIRECTION,
            **group_fields(instance, breaks),
            "first_num_dense_layers": first_dense,
            # TrainState(params={"params": jax_weights}) in checkpoint_conversion/utils/utils.py
            "tree_root": "params/params",
            "tensors": [{"path": path, "expert_axis": ea, "layer_axis": la} for path, ea, la in MAXTEXT_EXPERT_TENSORS],
            "layers": {str(li): [int(x) for x in row] for li, row in enumerate(p2l)},
        },
    }
