"""Shared fixtures: the committed tiny instance and a builder of random small instances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from placement.core.model import Cluster, Instance, MoEModel, ParallelLayout, Placement, Routing

# Under pytest-xdist, tests marked ``exclusive`` run alone (tests/machine_share.py).
pytest_plugins = ("tests.machine_share",)

ROOT = Path(__file__).resolve().parent.parent
INSTANCES = ROOT / "instances"


@pytest.fixture(scope="session")
def tiny():
    from placement.formats import read_instance

    return read_instance(INSTANCES / "tiny.json")


def random_instance(
    rng: np.random.Generator,
    *,
    num_experts: int = 8,
    top_k: int = 2,
    ep: int = 4,
    dp: int = 4,
    tp: int = 1,
    cp: int = 1,
    pp: int = 2,
    num_domains: int = 3,
    trays_per_domain: int = 2,
    gpus_per_tray: int = 2,
    tokens: int = 6,
    moe_layers: int = 3,
    num_groups: int = 1,
    groups_per_token: int = 1,
    cost_mode: str = "per_domain",
) -> Instance:
    """A random small instance with uniformly random routing and every GPU available."""
    num_layers = moe_layers
    bounds = np.linspace(0, num_layers, pp + 1).astype(int)
    stage_layers = tuple(tuple(range(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:]))
    model = MoEModel("rand", num_layers, tuple(range(num_layers)), num_experts, top_k, num_groups,
                     groups_per_token, 128, 132, 256)
    par = ParallelLayout(tp, cp, ep, dp, pp, "tp-cp-ep-dp-pp", stage_layers, 64, 1, dp * 2)
    n_gpus = num_domains * trays_per_domain * gpus_per_tray
    cl = Cluster(num_domains, trays_per_domain, gpus_per_tray, np.ones(n_gpus, dtype=bool), 900.0, 100.0)

    def window() -> np.ndarray:
        keys = rng.random((num_layers, dp, tokens, num_experts))
        return np.sort(np.argsort(keys, axis=-1)[..., :top_k], axis=-1)

    return Instance("rand", model, par, cl, Routing(window(), window()), cost_mode)  # type: ignore[arg-type]


def random_placement(rng: np.random.Generator, inst: Instance) -> Placement:
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
    p2l = np.stack([rng.permutation(inst.model.num_experts) for _ in range(inst.model.num_moe_layers)])
    return Placement(r2g, p2l)


# Under pytest-xdist (``--dist loadfile``) files are handed to the workers in collection order, so
# the suite ends when the last long file does: the long files go first, so that the many short ones
# fill the end.  Tests marked ``exclusive`` go last (a file of them after every other file, one
# among other tests at the end of its file): by then nothing that .ci/run starts beside the suite
# (the type check without extras) still runs.  Seconds: one run on the 2-core build machine.
LONG_FILES_FIRST = (
    "test_notebooks.py",  # 260
    "test_calibration.py",  # 185
    "stacks/test_migrate_stacks.py",  # 70
    "stacks/test_replicas_stacks.py",  # 65
    "test_dispatch.py",  # 60
    "test_experts.py",  # 50
    "test_lower_bounds.py",  # 45
    "test_instances.py",  # 35
    "stacks/test_megatron.py",  # 25
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).resolve().parent
    rank = {tests_dir / name: i for i, name in enumerate(LONG_FILES_FIRST)}

    def key(item: pytest.Item) -> tuple[bool, int]:
        return item.get_closest_marker("exclusive") is not None, rank.get(Path(item.path), len(rank))

    items.sort(key=key)  # stable: the rest keep their order
