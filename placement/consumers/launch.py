"""The Slurm launcher: a POSIX ``sh`` script that gives every rank the environment its stack reads.

``placement export --format slurm PLACEMENT -o job.hosts --instance INSTANCE`` writes three files:
``job.hosts`` (the ``SLURM_HOSTFILE``: line ``i`` names the host of global rank ``i``),
``job.gpus`` (per host its ``CUDA_VISIBLE_DEVICES``) and ``job.launch.sh``, this module's script.
The script carries the whole rank table, so it needs neither of the other files at run time::

    # plain srun: one task per rank, Slurm starts task i on the host of line i
    export SLURM_HOSTFILE=$PWD/job.hosts
    srun --ntasks=WORLD --distribution=arbitrary --gpu-bind=none \\
         ./job.launch.sh srun sh -c 'exec python pretrain_gpt.py $PLACEMENT_MEGATRON_ARGS ...'

    # torchrun, when the layout allows it: one task per host, torchrun starts the ranks
    srun --nodes=N --ntasks-per-node=1 --nodelist=HOSTS --gpu-bind=none ./job.launch.sh torchrun train.py ...

What the stacks read, at the versions read (``docs/formats.md``):

- Megatron-LM (``NVIDIA/Megatron-LM`` @d98e8a6): ``megatron/training/arguments.py`` sets
  ``args.rank = int(os.getenv('RANK', '0'))`` and ``args.world_size = int(os.getenv("WORLD_SIZE",
  '1'))``; ``megatron/training/config/common_config.py`` reads ``LOCAL_RANK``;
  ``megatron/training/initialize.py`` calls ``torch.cuda.set_device(args.local_rank)`` and then
  ``torch.distributed.init_process_group(rank=..., world_size=...)`` without a store, i.e. torch's
  ``env://`` rendezvous, which reads ``MASTER_ADDR`` and ``MASTER_PORT``
  (``torch/distributed/rendezvous.py``, torch 2.14.1).  ``set_device(local_rank)`` indexes the
  *visible* devices, so all ranks of a host must see the same ``CUDA_VISIBLE_DEVICES``, listing
  the placement's GPUs in local-rank order (a one-GPU mask per rank would fail for local rank 1).
  Megatron-Core 0.16.1 (``megatron/core/parallel_state.py``, ``initialize_model_parallel``) sets
  ``expert_tensor_parallel_size = tensor_model_parallel_size`` when it is not given, so the
  script exports ``PLACEMENT_MEGATRON_ARGS`` with ``--expert-tensor-parallel-size`` and the other
  sizes; the rank order is Megatron-LM's ``tp-cp-ep-dp-pp``, or ``tp-cp-ep-pp-dp`` with
  ``--use-tp-pp-dp-mapping``.
- TorchTitan 0.3.0: ``torchtitan/tools/utils.py`` ``get_local_device`` reads ``LOCAL_RANK``
  (device 0 when exactly one device is visible), ``torchtitan/distributed/utils.py``
  ``init_distributed`` calls ``init_process_group`` with the ``env://`` defaults (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); ``torchtitan/train.py`` reads ``WORLD_SIZE``.
  Its meshes are ``[pp, dp_replicate, dp_shard, cp, tp]`` (dense) and ``[pp, dp_replicate, efsdp,
  ep]`` (experts) with the last name fastest (``torchtitan/distributed/parallel_dims.py``): the
  order ``tp-cp-ep-dp-pp`` with expert-tensor-parallel 1.  ``PLACEMENT_TORCHTITAN_ARGS`` is set
  when the instance's order is that one.
- ``LOCAL_WORLD_SIZE`` is what torchrun sets too; the script sets it for code that reads it.

Why torchrun cannot always run a layout: torchrun (``torch/distributed/elastic/agent/server/api.py``,
``_assign_worker_ranks``, torch 2.14.1) gives the workers of node ``n`` the global ranks
``[sum of the local world sizes of nodes < n, ... + local world size)``: *one contiguous block per
host*.  A solved layout may give a host ranks from two stages (e.g. ranks 8-11 and 40-43); such a
host cannot be one torchrun node.  :func:`torchrun_problem` says which host and why; the script's
``torchrun`` mode refuses then (exit 2) and ``srun`` mode always works.
"""

from __future__ import annotations

import numpy as np

from placement.consumers.hostfile import host_local_gpus
from placement.core.model import Instance

__all__ = [
    "DEFAULT_MASTER_PORT",
    "LAUNCH_VARIABLES",
    "MEGATRON_ORDERS",
    "launcher_path",
    "rank_environment",
    "torchrun_problem",
    "torchrun_nodes",
    "megatron_args",
    "torchtitan_args",
    "torchtitan_module_fqns",
    "launcher_script",
]

DEFAULT_MASTER_PORT = 29500
# What the script sets for every rank (srun mode), in the order it exports them.
LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
)
# Megatron-LM's rank orders (megatron/training/initialize.py) and the flag that selects each.
MEGATRON_ORDERS = {"tp-cp-ep-dp-pp": (), "tp-cp-ep-pp-dp": ("--use-tp-pp-dp-mapping",)}
TORCHTITAN_ORDER = "tp-cp-ep-dp-pp"


def launcher_path(hostfile_path):
    """Where the launcher goes: the hostfile's path with the suffix ``.launch.sh``."""
    from pathlib import Path

    out = Path(hostfile_path)
    return out.with_suffix(".launch.sh") if out.suffix else out.with_name(out.name + ".launch.sh")


def _hosts(instance: Instance, rank2gpu: np.ndarray) -> list[tuple[str, list[tuple[int, int]]]]:
    """``[(host name, [(rank, local GPU), ...]), ...]`` for the job's hosts, by host id."""
    cl = instance.cluster
    return [(cl.host_name(h), pairs) for h, pairs in sorted(host_local_gpus(instance, rank2gpu).items())]


def rank_environment(instance: Instance, rank2gpu: np.ndarray, rank: int, master_port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
    """The variables :data:`LAUNCH_VARIABLES` that global ``rank`` must see (the script's contract).

    ``LOCAL_RANK`` is the rank's position among its host's ranks in global-rank order, and
    ``CUDA_VISIBLE_DEVICES`` lists the host's placement GPUs in that order, so that local rank
    ``j`` uses visible device ``j``, the GPU the placement gives it.
    """
    r2g = np.asarray(rank2gpu, dtype=np.int64)
    cl = instance.cluster
    host_of = {r: name for name, pairs in _hosts(instance, r2g) for r, _ in pairs}
    (pairs,) = [pairs for name, pairs in _hosts(instance, r2g) if name == host_of[rank]]
    local = [r for r, _ in pairs].index(rank)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(len(r2g)),
        "LOCAL_WORLD_SIZE": str(len(pairs)),
        "MASTER_ADDR": cl.host_name(int(cl.gpu2host[int(r2g[0])])),
        "MASTER_PORT": str(master_port),
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for _, g in pairs),
    }


def torchrun_problem(instance: Instance, rank2gpu: np.ndarray) -> str | None:
    """One line saying why torchrun cannot launch this layout, or ``None`` when it can.

    torchrun gives each node one contiguous block of global ranks; a host whose ranks are not
    contiguous cannot be a torchrun node.
    """
    for name, pairs in _hosts(instance, np.asarray(rank2gpu)):
        ranks = [r for r, _ in pairs]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            runs = _runs(ranks)
            return (
                f"host {name} runs ranks {', '.join(runs[:4])}{' ...' if len(runs) > 4 else ''}, not one contiguous "
                "block, and torchrun gives each node one contiguous block of global ranks"
            )
    return None


def _runs(ranks: list[int]) -> list[str]:
    out: list[list[int]] = []
    for r in ranks:
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return [f"{a}" if a == b else f"{a}-{b}" for a, b in out]


def torchrun_nodes(instance: Instance, rank2gpu: np.ndarray) -> list[tuple[str, int, str]] | None:
    """``[(host, nproc_per_node, CUDA_VISIBLE_DEVICES), ...]`` in torchrun node-rank order, or None.

    Node rank ``n`` is the host holding the ``n``-th block of ranks (blocks sorted by first rank).
    """
    if torchrun_problem(instance, rank2gpu) is not None:
        return None
    hosts = sorted(_hosts(instance, np.asarray(rank2gpu)), key=lambda hp: hp[1][0][0])
    return [(name, len(pairs), ",".join(str(g) for _, g in pairs)) for name, pairs in hosts]


def megatron_args(instance: Instance) -> tuple[list[str], str | None]:
    """Megatron-LM's parallel-size flags for the instance, and a note when its order needs more."""
    p = instance.parallel
    args = [
        "--tensor-model-parallel-size", str(p.tp),
        "--context-parallel-size", str(p.cp),
        "--pipeline-model-parallel-size", str(p.pp),
        "--expert-model-parallel-size", str(p.ep),
        "--expert-tensor-parallel-size", str(p.etp),
    ]  # fmt: skip
    if p.pipeline_layout:
        # Unrolled ("Ett|tt|...|mL"): no "*", so an unquoted $PLACEMENT_MEGATRON_ARGS cannot glob.
        args += ["--pipeline-model-parallel-layout", "|".join(p.pipeline_layout)]
    if p.order in MEGATRON_ORDERS:
        return args + list(MEGATRON_ORDERS[p.order]), None
    return args, (
        f"Megatron-LM's command line has no flag for the rank order {p.order} (only "
        f"{' and '.join(MEGATRON_ORDERS)}): call megatron.core.parallel_state.initialize_model_parallel(order=...)"
    )


def torchtitan_args(instance: Instance) -> tuple[list[str] | None, str | None]:
    """TorchTitan 0.3.0's ``--parallelism.*`` flags and a note, or ``None`` and why it cannot run it.

    With a pipeline layout the note gives ``parallelism.module_fqns_per_model_part``
    (:func:`torchtitan_module_fqns`) for the job config: TorchTitan's command line (tyro) cannot
    spell a list of lists.
    """
    p = instance.parallel
    if p.order != TORCHTITAN_ORDER:
        return None, f"TorchTitan's meshes use the rank order {TORCHTITAN_ORDER}, the instance {p.order}"
    note = None
    if p.pipeline_layout and p.pp > 1:
        fqns, problem = torchtitan_module_fqns(instance)
        if fqns is None:
            return None, problem
        note = f"set parallelism.module_fqns_per_model_part = {fqns!r} in the TorchTitan job config"
    return [
        f"--parallelism.tensor_parallel_degree={p.tp}",
        f"--parallelism.context_parallel_degree={p.cp}",
        f"--parallelism.pipeline_parallel_degree={p.pp}",
        f"--parallelism.expert_parallel_degree={p.ep}",
        "--parallelism.data_parallel_replicate_degree=1",
        f"--parallelism.data_parallel_shard_degree={p.dp}",
    ], note


def torchtitan_module_fqns(instance: Instance) -> tuple[list[list[str]] | None, str]:
    """The layout as TorchTitan 0.3.0's ``module_fqns_per_model_part``, or ``None`` and why not.

    One list per (virtual) stage in Megatron's chunk order, which is TorchTitan's "loop" stage order
    for interleaved schedules (stage ``i`` on pipeline rank ``i % pp``,
    ``_get_pp_rank_to_stage_indices_mapping`` in ``torchtitan/distributed/pipeline_parallel.py``):
    ``E`` -> ``tok_embeddings``, ``t`` -> ``layers.<i>``, ``L`` -> ``norm``, ``lm_head``.  A layout
    with MTP layers has no TorchTitan form: its DeepSeek-V3 MTP refuses pipeline parallelism
    (``torchtitan/models/deepseek_v3/mtp.py``).
    """
    p = instance.parallel
    if any("m" in c for c in p.pipeline_layout):
        return None, ("TorchTitan 0.3.0 cannot run this pipeline layout: its MTP refuses pipeline parallelism "
                      "(torchtitan/models/deepseek_v3/mtp.py)")
    out: list[list[str]] = []
    layer = 0
    for chunk in p.pipeline_layout:
        names: list[str] = []
        for c in chunk:
            if c == "E":
                names.append("tok_embeddings")
            elif c == "t":
                names.append(f"layers.{layer}")
                layer += 1
            elif c == "L":
                names += ["norm", "lm_head"]
        out.append(names)
    return out, ""


def _words(values) -> str:
    return " ".join(str(v) for v in values)


def launcher_script(instance: Instance, rank2gpu: np.ndarray, hostfile_name: str = "job.hosts") -> str:
    """The POSIX ``sh`` launcher for the layout ``rank2gpu`` (world,) of ``instance``.

    ``srun`` mode (one task per rank): reads ``SLURM_PROCID`` as the global rank, checks that the
    task runs on the host the placement says (``SLURMD_NODENAME``, else ``hostname``) and that
    ``SLURM_NTASKS`` is the world size when set, exports :data:`LAUNCH_VARIABLES` (``MASTER_PORT``
    is kept when already set), ``PLACEMENT_MEGATRON_ARGS`` and, where it applies,
    ``PLACEMENT_TORCHTITAN_ARGS``, then ``exec``s its arguments.  ``torchrun`` mode (one task per
    host): exports ``CUDA_VISIBLE_DEVICES`` for the host and ``exec``s ``torchrun --nnodes ...
    --node-rank ... --rdzv-backend=static`` with its arguments, or exits 2 saying why the layout
    needs ``srun`` mode.
    """
    r2g = np.asarray(rank2gpu, dtype=np.int64)
    cl = instance.cluster
    hosts = _hosts(instance, r2g)
    world = len(r2g)
    host_of_rank = [""] * world
    local_of_rank = [0] * world
    for name, pairs in hosts:
        for j, (r, _) in enumerate(pairs):
            host_of_rank[r], local_of_rank[r] = name, j
    master = host_of_rank[0]
    mega, mega_note = megatron_args(instance)
    titan, titan_note = torchtitan_args(instance)
    problem = torchrun_problem(instance, r2g)
    nodes = torchrun_nodes(instance, r2g) or []
    node_rank = {name: n for n, (name, _, _) in enumerate(nodes)}
    p = instance.parallel
    lines = [
        "#!/bin/sh",
        f"# Launcher for instance {instance.name} (sha256 {instance.sha256[:16]}...), written by placement export --format slurm.",
        f"# {world} ranks on {len(hosts)} hosts; tp={p.tp} cp={p.cp} ep={p.ep} etp={p.etp} dp={p.dp} pp={p.pp}, order {p.order}.",
        "#",
        "# srun mode, one task per rank (Slurm starts task i on the host of line i of the hostfile):",
        f"#   export SLURM_HOSTFILE=$PWD/{hostfile_name}",
        f"#   srun --ntasks={world} --distribution=arbitrary --gpu-bind=none ./{launcher_path(hostfile_name).name} srun CMD ARGS...",
        "# torchrun mode, one task per host:",
        (
            f"#   srun --nodes={len(hosts)} --ntasks-per-node=1 --nodelist={','.join(n for n, _ in hosts)} --gpu-bind=none "
            f"./{launcher_path(hostfile_name).name} torchrun SCRIPT ARGS..."
            if problem is None
            else f"#   not possible for this layout: {problem}"
        ),
        "# CMD can use $PLACEMENT_MEGATRON_ARGS (Megatron-LM's parallel sizes, --expert-tensor-parallel-size included)",
        "# and $PLACEMENT_TORCHTITAN_ARGS (TorchTitan's --parallelism.* sizes) when set.",
    ]
    if mega_note:
        lines.append(f"# Note: {mega_note}.")
    if titan_note:
        lines.append(f"# Note: PLACEMENT_TORCHTITAN_ARGS is not set: {titan_note}." if titan is None
                     else f"# Note (TorchTitan): {titan_note}.")
    lines += [
        "set -eu",
        f"_pl_world={world}",
        f"_pl_master={master}",
        f"_pl_rank_host='{_words(host_of_rank)}'",
        f"_pl_rank_local='{_words(local_of_rank)}'",
        f"_pl_hosts='{_words(n for n, _ in hosts)}'",
        f"_pl_host_count='{_words(len(pairs) for _, pairs in hosts)}'",
        f"_pl_host_gpus='{_words(','.join(str(g) for _, g in pairs) for _, pairs in hosts)}'",
        f"_pl_host_node='{_words(node_rank.get(n, -1) for n, _ in hosts)}'",
        "_pl_nth() { _pl_i=$1; shift; shift \"$_pl_i\"; printf '%s' \"$1\"; }",
        "_pl_index() { _pl_want=$1; shift; _pl_k=0; for _pl_w in \"$@\"; do",
        "  if [ \"$_pl_w\" = \"$_pl_want\" ]; then printf '%s' \"$_pl_k\"; return 0; fi; _pl_k=$((_pl_k + 1)); done; return 1; }",
        "_pl_fail() { echo \"placement launch: $*\" >&2; exit 2; }",
        "_pl_me=${SLURMD_NODENAME:-$(hostname)}",
        "# shellcheck disable=SC2086",
        "_pl_h=$(_pl_index \"$_pl_me\" $_pl_hosts) || _pl_fail \"host $_pl_me runs no rank of this placement\"",
        f"export PLACEMENT_MEGATRON_ARGS='{_words(mega)}'",
    ]
    if titan is not None:
        lines.append(f"export PLACEMENT_TORCHTITAN_ARGS='{_words(titan)}'")
    lines += [
        "_pl_mode=${1:-}",
        "[ $# -ge 2 ] || _pl_fail \"usage: $0 srun CMD [ARGS...] | $0 torchrun SCRIPT [ARGS...]\"",
        "shift",
        "export CUDA_VISIBLE_DEVICES=\"$(_pl_nth \"$_pl_h\" $_pl_host_gpus)\"",
        "export MASTER_ADDR=\"$_pl_master\"",
        f"export MASTER_PORT=\"${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}\"",
        "case $_pl_mode in",
        "srun)",
        "  _pl_rank=${SLURM_PROCID:?placement launch: SLURM_PROCID is not set: run this under srun}",
        "  [ \"${SLURM_NTASKS:-$_pl_world}\" = \"$_pl_world\" ] || _pl_fail \"SLURM_NTASKS=$SLURM_NTASKS, the placement has $_pl_world ranks\"",
        "  [ \"$_pl_rank\" -lt \"$_pl_world\" ] || _pl_fail \"SLURM_PROCID=$_pl_rank is outside the placement's $_pl_world ranks\"",
        "  _pl_want=$(_pl_nth \"$_pl_rank\" $_pl_rank_host)",
        "  [ \"$_pl_want\" = \"$_pl_me\" ] || _pl_fail \"rank $_pl_rank runs on $_pl_me, the placement puts it on $_pl_want "
        f"(export SLURM_HOSTFILE={hostfile_name} and srun --distribution=arbitrary)\"",
        "  export RANK=\"$_pl_rank\"",
        "  export LOCAL_RANK=\"$(_pl_nth \"$_pl_rank\" $_pl_rank_local)\"",
        "  export WORLD_SIZE=\"$_pl_world\"",
        "  export LOCAL_WORLD_SIZE=\"$(_pl_nth \"$_pl_h\" $_pl_host_count)\"",
        "  unset _pl_rank _pl_want",
        "  ;;",
        "torchrun)",
    ]
    if problem is not None:
        lines.append(f"  _pl_fail \"torchrun cannot launch this layout: {problem}; use srun mode\"")
    else:
        lines += [
            "  _pl_node=$(_pl_nth \"$_pl_h\" $_pl_host_node)",
            f"  set -- torchrun --nnodes={len(hosts)} "
            "--nproc-per-node=\"$(_pl_nth \"$_pl_h\" $_pl_host_count)\" --node-rank=\"$_pl_node\" "
            "--master-addr=\"$MASTER_ADDR\" --master-port=\"$MASTER_PORT\" --rdzv-backend=static \"$@\"",
            "  unset _pl_node",
        ]
    lines += [
        "  ;;",
        "*) _pl_fail \"the first argument must be srun or torchrun, found '$_pl_mode'\" ;;",
        "esac",
        "unset _pl_world _pl_master _pl_rank_host _pl_rank_local _pl_hosts _pl_host_count _pl_host_gpus _pl_host_node \\",
        "  _pl_me _pl_h _pl_mode _pl_i _pl_k _pl_w",
        "exec \"$@\"",
    ]
    return "\n".join(lines) + "\n"
