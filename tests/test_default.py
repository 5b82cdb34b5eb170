"""The default layout: sorted available GPUs, contiguous experts, Megatron rank order."""

from __future__ import annotations

import numpy as np
import pytest

from placement.core.checker import check, deepep_violations, violates_group_preservation
from placement.core.model import InfeasibleError
from solvers.default import default_placement, default_rank2gpu
from tests.conftest import random_instance


def test_default_uses_sorted_available_gpus(tiny):
    pl = default_placement(tiny)
    assert check(tiny, pl) == []
    free = np.flatnonzero(tiny.cluster.available)
    assert list(pl.rank2gpu) == list(free[: tiny.parallel.world_size])
    assert (pl.phy2log == np.arange(tiny.model.num_experts)).all()
    assert violates_group_preservation(tiny, pl) == []


def test_megatron_rank_order():
    """tp-cp-ep-dp-pp: tp fastest, then cp, then dp; pp slowest; EP groups consecutive."""
    rng = np.random.default_rng(0)
    inst = random_instance(rng, tp=2, cp=1, dp=4, ep=4, pp=2, num_domains=4)
    par = inst.parallel
    assert list(par.rank_coords["tp"][:4]) == [0, 1, 0, 1]
    assert list(par.rank2dp[:8]) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(par.rank2stage) == [0] * 8 + [1] * 8
    assert par.stage_ep_groups.tolist() == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]]


def test_not_enough_gpus_is_infeasible():
    rng = np.random.default_rng(0)
    inst = random_instance(rng, num_domains=1, trays_per_domain=1, gpus_per_tray=4, ep=4, dp=4, pp=2)
    with pytest.raises(InfeasibleError, match="needs 8 GPUs"):
        default_rank2gpu(inst)


def test_deepep_rule_checker():
    rng = np.random.default_rng(0)
    inst = random_instance(rng, num_domains=2, trays_per_domain=2, gpus_per_tray=2, ep=4, dp=4, pp=1)
    from placement.core.model import Placement

    ok = Placement(np.array([0, 1, 4, 5]), np.tile(np.arange(8), (3, 1)))
    assert deepep_violations(inst, ok) == []
    uneven = Placement(np.array([0, 1, 2, 4]), np.tile(np.arange(8), (3, 1)))
    interleaved = Placement(np.array([0, 4, 1, 5]), np.tile(np.arange(8), (3, 1)))
    assert deepep_violations(inst, uneven) and deepep_violations(inst, interleaved)
