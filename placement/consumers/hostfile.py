"""The Slurm launch files for a rank layout: ``SLURM_HOSTFILE`` and the GPU each local rank takes.

Megatron-Core and TorchTitan accept no expert map and no rank map; what a user can apply is where
Slurm starts each task.  With ``srun --distribution=arbitrary`` Slurm starts task ``i`` on the host
named on line ``i`` of the file that ``SLURM_HOSTFILE`` points to, so the hostfile below, one host
per rank line, puts every global rank on the right tray (host)::

    placement export --format slurm PLACEMENT -o job.hosts   # job.hosts, job.gpus, job.launch.sh
    export SLURM_HOSTFILE=$PWD/job.hosts
    srun --ntasks=$WORLD --distribution=arbitrary --gpu-bind=none ./job.launch.sh srun python train.py ...

(the launcher, :mod:`placement.consumers.launch`, sets every rank's ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``CUDA_VISIBLE_DEVICES``)

(``--ntasks`` must equal the number of lines; ``--nodes`` the number of distinct hosts.)

Which GPU of the host: a host's tasks get ``SLURM_LOCALID`` 0, 1, ... in the order of their global
ranks, and Megatron-Core and TorchTitan use the local rank as the CUDA device index.  So *a host's
ranks take its visible GPUs in rank order*.  When a host runs all of its ``gpus_per_tray`` GPUs and
the layout gives them to its ranks in rank order (what :func:`solvers.layout.plan_layout` and the
default layout emit), nothing else is needed.  When a host runs ``k < gpus_per_tray`` ranks of the
job (a GPU down, or a spare), the placement names which physical GPUs; the launch maps them with
``CUDA_VISIBLE_DEVICES`` set per host to those GPUs' local indices in rank order
(:func:`cuda_visible_devices`, written beside the hostfile as ``HOST GPU,GPU,...`` lines), with
Slurm's own GPU binding off (``--gpu-bind=none``).  :func:`local_rank_mismatches` lists the hosts
where plain local-rank order would pick a GPU other than the one the placement says.
"""

from __future__ import annotations

import numpy as np

from placement.core.model import Instance, InvalidInputError

__all__ = [
    "slurm_hostfile",
    "host_local_gpus",
    "cuda_visible_devices",
    "cuda_visible_devices_file",
    "local_rank_mismatches",
    "SRUN_USAGE",
]

SRUN_USAGE = (
    "export SLURM_HOSTFILE=<hostfile>; "
    "srun --ntasks=<world> --distribution=arbitrary --gpu-bind=none <launcher that sets CUDA_VISIBLE_DEVICES per host>"
)


def _check(instance: Instance, rank2gpu: np.ndarray) -> np.ndarray:
    r2g = np.asarray(rank2gpu, dtype=np.int64).reshape(-1)
    world = instance.parallel.world_size
    if r2g.shape[0] != world:
        raise InvalidInputError(f"rank2gpu: expected {world} ranks (tp*cp*dp*pp), found {r2g.shape[0]}")
    cl = instance.cluster
    bad = np.flatnonzero((r2g < 0) | (r2g >= cl.num_gpus))
    if bad.size:
        raise InvalidInputError(f"rank2gpu[{int(bad[0])}]: GPU {int(r2g[bad[0]])} does not exist (cluster has {cl.num_gpus})")
    if len(np.unique(r2g)) != len(r2g):
        raise InvalidInputError("rank2gpu: a GPU runs more than one rank")
    return r2g


def slurm_hostfile(instance: Instance, rank2gpu: np.ndarray) -> str:
    """The ``SLURM_HOSTFILE`` text: line ``i`` names the host (tray) of global rank ``i``.

    Parameters
    ----------
    instance : the problem (host names come from ``instance.cluster.host_name``).
    rank2gpu : (world,) physical GPU of each global rank.

    Returns
    -------
    str, ``world`` lines, each ending in a newline.

    Examples
    --------
    >>> import numpy as np
    >>> from placement.core.model import Cluster
    >>> from types import SimpleNamespace
    >>> cl = Cluster(1, 2, 2, np.ones(4, dtype=bool), 900.0, 100.0)
    >>> inst = SimpleNamespace(cluster=cl, parallel=SimpleNamespace(world_size=3))
    >>> print(slurm_hostfile(inst, np.array([2, 3, 0])), end="")
    rack00-tray01
    rack00-tray01
    rack00-tray00
    """
    r2g = _check(instance, rank2gpu)
    cl = instance.cluster
    return "".join(f"{cl.host_name(int(cl.gpu2host[g]))}\n" for g in r2g)


def host_local_gpus(instance: Instance, rank2gpu: np.ndarray) -> dict[int, list[tuple[int, int]]]:
    """Per host: ``[(rank, local GPU index), ...]`` in rank order (the order of ``SLURM_LOCALID``)."""
    r2g = _check(instance, rank2gpu)
    cl = instance.cluster
    out: dict[int, list[tuple[int, int]]] = {}
    for r, g in enumerate(r2g):
        out.setdefault(int(cl.gpu2host[g]), []).append((r, int(g) % cl.gpus_per_tray))
    return out


def cuda_visible_devices(instance: Instance, rank2gpu: np.ndarray) -> dict[str, str]:
    """Per host name: the ``CUDA_VISIBLE_DEVICES`` value that makes local rank ``j`` use the GPU the
    placement gives the host's ``j``-th rank (local GPU indices in rank order, comma separated)."""
    cl = instance.cluster
    return {
        cl.host_name(h): ",".join(str(local) for _, local in pairs)
        for h, pairs in sorted(host_local_gpus(instance, rank2gpu).items())
    }


def cuda_visible_devices_file(instance: Instance, rank2gpu: np.ndarray) -> str:
    """``HOST GPU,GPU,...`` lines (hosts sorted), for a launcher to look its host up in."""
    return "".join(f"{h} {v}\n" for h, v in cuda_visible_devices(instance, rank2gpu).items())


def local_rank_mismatches(instance: Instance, rank2gpu: np.ndarray) -> list[str]:
    """Hosts where "local rank ``j`` uses GPU ``j``" differs from the placement (then the launch
    needs :func:`cuda_visible_devices`); empty when plain local-rank order is right everywhere."""
    cl = instance.cluster
    out = []
    for h, pairs in sorted(host_local_gpus(instance, rank2gpu).items()):
        locals_ = [local for _, local in pairs]
        if locals_ != list(range(len(locals_))):
            out.append(
                f"{cl.host_name(h)}: ranks {[r for r, _ in pairs]} run on local GPUs {locals_}; "
                f"set CUDA_VISIBLE_DEVICES={','.join(map(str, locals_))}"
            )
    return out
