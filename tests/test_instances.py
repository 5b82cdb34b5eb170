"""The committed instances are exactly what `python -m placement.instances instances/` builds."""

from __future__ import annotations

import pytest

from placement.formats import read_instance
from placement.instances import SPECS, build_all
from tests.conftest import INSTANCES


@pytest.mark.parametrize("name", ["tiny", "dsv3_256"])
def test_regenerates_byte_for_byte(tmp_path, name):
    build_all(tmp_path, [name])
    for suffix in (".json", ".npz"):
        assert (tmp_path / f"{name}{suffix}").read_bytes() == (INSTANCES / f"{name}{suffix}").read_bytes()


def test_headline_instance_matches_the_design():
    """docs/design.md section 8: 15 racks of 18 x 4 GPUs, 1,024 free, TP1 CP1 PP16 EP64 DP64, ..."""
    inst = read_instance(INSTANCES / "dsv3_1024.json")
    m, p, c = inst.model, inst.parallel, inst.cluster
    assert (m.num_layers, m.num_moe_layers, m.num_experts, m.top_k) == (61, 58, 256, 8)
    assert (m.num_groups, m.groups_per_token, m.hidden_size) == (8, 4, 7168)
    assert (m.dispatch_bytes_per_token, m.combine_bytes_per_token) == (7392, 14336)
    assert (p.tp, p.cp, p.pp, p.ep, p.dp, p.order) == (1, 1, 16, 64, 64, "tp-cp-ep-dp-pp")
    assert (p.seq_len, p.micro_batch, p.global_batch) == (4096, 1, 8192)
    assert (c.num_domains, c.trays_per_domain, c.gpus_per_tray, c.num_gpus) == (15, 18, 4, 1080)
    assert int(c.available.sum()) == 1024
    down_trays = {int(h) for h in c.gpu2host[~c.available]}
    assert len(down_trays) == 14 and len({h // 18 for h in down_trays}) > 1  # scattered over racks
    assert set(SPECS) >= {"dsv3_1024", "dsv3_256", "dsv3_ep256", "qwen3_256", "tiny"}
