"""Small helpers the notebooks share: which solver to use, DeepSeek-V3-like instance variants, figures.

Everything here uses public names only: the package's API (``placement.solve``,
``placement.solver_names``, ``placement.DEFAULT_SOLVER``), the data model (``placement.core.model``) and
the instance builder ``placement.sources.instances`` (``SPECS`` and ``build``, in its ``__all__``: a
``dataclasses.replace``-d spec built in memory); no solver module is imported, and nothing computes
a cost of its own.
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import numpy as np

import placement
from placement.sources.instances import SPECS, build
from placement.core.model import Cluster, Instance, Placement

__all__ = [
    "QUICK",
    "budget_s",
    "SOLVER",
    "NUM_WORKERS",
    "pick_solver",
    "dsv3_variant",
    "with_available",
    "first_per_domain",
    "default_placement",
    "figures_dir",
    "save_figure",
    "gb",
    "small_png",
]


#: ``PLACEMENT_NOTEBOOK_QUICK=1`` (tests/test_notebooks.py sets it): the same cells on shorter time
#: budgets, to check that every cell runs; the committed outputs come from full runs without it.
QUICK = os.environ.get("PLACEMENT_NOTEBOOK_QUICK") == "1"


def budget_s(full: float, quick: float) -> float:
    """A time budget: ``full`` seconds, or ``quick`` under :data:`QUICK`."""
    return quick if QUICK else full


def pick_solver() -> str:
    """``"cpsat"`` when it is registered, otherwise the best solver that is (the default layout)."""
    return "cpsat" if "cpsat" in placement.solver_names() else placement.DEFAULT_SOLVER


SOLVER = pick_solver()

#: Solver processes for the notebooks' solves.  One: the instances here are small, and on a shared
#: 2-core machine starting a process pool (spawn) costs more than the parallel layers save.
NUM_WORKERS = 1


def _stage_sizes(num_dense: int, num_moe: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage: MoE layers spread evenly (earlier stages take the remainder),
    the dense layers added to the first stage."""
    if num_moe < pp:
        raise ValueError(f"moe_layers: need at least one MoE layer per stage (pp={pp}), found {num_moe}")
    base, extra = divmod(num_moe, pp)
    sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    sizes[0] += num_dense
    return tuple(sizes)


def dsv3_variant(
    name: str,
    *,
    num_domains: int,
    trays_down: int,
    ep: int,
    dp: int,
    pp: int,
    moe_layers: int,
    tokens_per_source: int,
    heldout_tokens_per_source: int | None = None,
    global_batch: int,
    seed: int,
    cost_mode: str = "per_domain",
) -> Instance:
    """A DeepSeek-V3-like instance built in memory from ``SPECS["dsv3_1024"]``.

    The model keeps DeepSeek-V3's shape (256 experts, top-8, 8 groups of which a token uses 4,
    hidden 7168, FP8 dispatch, BF16 combine) but only its first ``moe_layers`` MoE layers (after
    the 3 dense ones), so solves stay short; per-step figures are for those layers.  The cluster is
    ``num_domains`` NVL72 racks (18 trays of 4 GPUs) with ``trays_down`` trays unavailable (a seeded
    scatter).  TP 1, CP 1, sequences of 4,096 tokens, micro-batch 1.  The held-out window has
    ``heldout_tokens_per_source`` tokens per source, by default four times ``tokens_per_source``.
    """
    spec = dataclasses.replace(
        SPECS["dsv3_1024"],
        name=name,
        description=f"notebook variant {name}",
        num_layers=3 + moe_layers,
        stage_sizes=_stage_sizes(3, moe_layers, pp),
        pipeline_layout="",  # the recipe's 61-layer layout does not fit a variant's layers
        ep=ep,
        dp=dp,
        pp=pp,
        global_batch=global_batch,
        num_domains=num_domains,
        trays_down=trays_down,
        tokens_per_source=tokens_per_source,
        # 4x the sampled tokens, like the committed instances: at 16-64 tokens per source the held-out
        # window's own sampling noise (~0.3% of predicted TFLOP/s at 64) was as large as the gaps it ranks.
        heldout_tokens_per_source=heldout_tokens_per_source or 4 * tokens_per_source,
        seed=seed,
        cost_mode=cost_mode,
    )
    return build(spec)


def with_available(instance: Instance, available: np.ndarray) -> Instance:
    """``instance`` with a different set of available GPUs (same job, same routing)."""
    cluster = dataclasses.replace(instance.cluster, available=np.asarray(available, dtype=bool))
    return dataclasses.replace(instance, cluster=cluster)


def first_per_domain(cluster: Cluster, per_domain: int) -> np.ndarray:
    """(num_gpus,) bool: the first ``per_domain`` available GPUs of each domain (by tray, GPU);
    domains with fewer available GPUs contribute none (so no EP group of ``per_domain`` ranks has
    to span two racks)."""
    mask = np.zeros(cluster.num_gpus, dtype=bool)
    for d in range(cluster.num_domains):
        free = np.flatnonzero(cluster.available & (cluster.gpu2domain == d))
        if len(free) >= per_domain:
            mask[free[:per_domain]] = True
    return mask


def default_placement(instance: Instance) -> Placement:
    """The default layout (ranks on the sorted available GPUs, experts contiguous), via the API."""
    return placement.solve(instance, solver="default", time_limit_s=10.0).placement


def figures_dir() -> Path:
    """Where notebooks save the figures the README shows: ``$PLACEMENT_FIGURES_DIR`` if set (the
    tests point it at a temporary directory), otherwise the repository's ``docs/figures``."""
    env = os.environ.get("PLACEMENT_FIGURES_DIR")
    if env:
        return Path(env)
    return Path(placement.__file__).resolve().parent.parent / "docs" / "figures"


def small_png(fig, dpi: float | None = None) -> bytes:
    """``fig`` as a PNG of at most 256 colours (no dithering, no timestamp metadata).

    Line and bar plots use a few dozen colours, so the palette loses nothing visible and the file
    is about a third of matplotlib's RGBA PNG: the notebooks are committed with their outputs and
    the repository must stay small.
    """
    from PIL import Image

    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=dpi or fig.dpi, bbox_inches="tight", metadata={"Software": None})
    raw.seek(0)
    img = Image.open(raw).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                                  dither=Image.Dither.NONE)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=True)
    return out.getvalue()


def _use_small_inline_pngs() -> None:
    """In a Jupyter kernel, show matplotlib figures as :func:`small_png` (outside one, do nothing)."""
    try:
        from IPython import get_ipython
        from matplotlib.figure import Figure
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "display_formatter"):
        shell.display_formatter.formatters["image/png"].for_type(Figure, small_png)


_use_small_inline_pngs()


def save_figure(fig, filename: str) -> Path:
    """Save ``fig`` as a :func:`small_png` under :func:`figures_dir` and return the path
    (``.png`` is appended when ``filename`` has no suffix)."""
    out = figures_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    if not path.suffix:
        path = path.with_suffix(".png")
    path.write_bytes(small_png(fig, dpi=110))
    return path


def gb(x: float) -> float:
    """Bytes to GB (10^9 bytes)."""
    return float(x) / 1e9
