"""``placement show``: the rack map is written, and what it shows matches the placement.

Expectations are computed here from the instance and the placement with plain loops (the rank
order decoded from the order string, EP groups as chunks of a stage's ranks), never through
:mod:`placement.app.show`; the counts are read back from the figure's legend and artists, and from
the SVG file itself.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("matplotlib")

from matplotlib.collections import PatchCollection  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from placement.cli import main  # noqa: E402
from placement.predict.cost import evaluate  # noqa: E402
from placement.formats import placement_document, read_instance, write_placement  # noqa: E402
from placement.core.model import Instance, InvalidInputError, Placement  # noqa: E402
from placement.app.show import draw_placement, rack_map_figure  # noqa: E402
from solvers.default import default_placement  # noqa: E402
from tests.conftest import INSTANCES, random_instance  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


# ---------------------------------------------------------------------------------------------
# The expectation, from the instance and the placement alone
# ---------------------------------------------------------------------------------------------
def expected(inst: Instance, pl: Placement) -> dict:
    par, cl = inst.parallel, inst.cluster
    sizes = {"tp": par.tp, "cp": par.cp, "dp": par.dp, "pp": par.pp}
    names = [n for n in par.order.split("-") if n != "ep"]
    stage_of = []
    for r in range(par.world_size):  # first name of the order varies fastest
        rest, coord = r, {}
        for n in names:
            coord[n] = rest % sizes[n]
            rest //= sizes[n]
        stage_of.append(coord["pp"])
    per_domain = cl.trays_per_domain * cl.gpus_per_tray
    r2g = [int(g) for g in pl.rank2gpu]
    used = set(r2g)
    straddling = set()
    straddling_gpus = 0
    for s in range(par.pp):
        ranks = [r for r in range(par.world_size) if stage_of[r] == s]
        for g, i in enumerate(range(0, len(ranks), par.ep)):
            members = ranks[i : i + par.ep]
            if len({r2g[r] // per_domain for r in members}) > 1:
                straddling.add((s, g))
                straddling_gpus += len(members)
    return {
        "stage_gpus": {s: n for s, n in sorted(Counter(stage_of).items())},
        "idle": sum(1 for g in range(cl.num_gpus) if cl.available[g] and g not in used),
        "unavailable": sum(1 for g in range(cl.num_gpus) if not cl.available[g]),
        "straddling": straddling,
        "straddling_gpus": straddling_gpus,
        "groups": par.pp * (par.tp * par.cp * par.dp // par.ep),
    }


def with_down_gpus(inst: Instance, down: list[int]) -> Instance:
    available = np.ones(inst.cluster.num_gpus, dtype=bool)
    available[down] = False
    return replace(inst, cluster=replace(inst.cluster, available=available))


def placement_on_available(rng: np.random.Generator, inst: Instance) -> Placement:
    free = np.flatnonzero(inst.cluster.available)
    r2g = rng.permutation(free)[: inst.parallel.world_size]
    p2l = np.stack([rng.permutation(inst.model.num_experts) for _ in range(inst.model.num_moe_layers)])
    return Placement(r2g, p2l)


def small_case(seed: int = 0) -> tuple[Instance, Placement]:
    """Two EP groups per stage, one tray down, idle GPUs: every kind of cell."""
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, ep=2, dp=4, pp=2, num_domains=3, trays_per_domain=3, gpus_per_tray=2)
    inst = with_down_gpus(inst, [8, 9])  # domain 1, tray 1
    return inst, placement_on_available(rng, inst)


# ---------------------------------------------------------------------------------------------
# Reading the figure back
# ---------------------------------------------------------------------------------------------
def legend_counts(fig) -> dict:
    legend = fig.legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    out: dict = {"stage_gpus": {}, "stage_color": {}}
    for text, handle in zip(labels, legend.legend_handles):
        if m := re.fullmatch(r"stage (\d+): (\d+) GPUs, \d+ MoE layers?", text):
            out["stage_gpus"][int(m[1])] = int(m[2])
            out["stage_color"][int(m[1])] = to_hex(handle.get_facecolor())
        elif m := re.fullmatch(r"idle \(free, unused\): (\d+) GPUs", text):
            out["idle"] = int(m[1])
        elif m := re.fullmatch(r"unavailable: (\d+) GPUs", text):
            out["unavailable"] = int(m[1])
        elif m := re.fullmatch(r"EP group over several domains: (\d+) of (\d+)", text):
            out["straddling"], out["groups"] = int(m[1]), int(m[2])
    return out


def cell_collections(fig) -> list[PatchCollection]:
    return [c for ax in fig.axes for c in ax.collections if str(c.get_gid()).startswith("gpus-")]


def check_figure(fig, exp: dict, inst: Instance, pl: Placement, window: str = "heldout") -> None:
    got = legend_counts(fig)
    assert got["stage_gpus"] == exp["stage_gpus"]
    assert got["idle"] == exp["idle"]
    assert got["unavailable"] == exp["unavailable"]
    assert got["straddling"] == len(exp["straddling"]) and got["groups"] == exp["groups"]
    # The cells: one per GPU of the cluster, as many of each stage's colour as the stage has GPUs.
    colls = cell_collections(fig)
    faces = [to_hex(c) for coll in colls for c in coll.get_facecolors()]
    assert len(faces) == inst.cluster.num_gpus
    count = Counter(faces)
    for s, color in got["stage_color"].items():
        assert count[color] == exp["stage_gpus"][s], f"stage {s}"
    by_gid = {coll.get_gid(): len(coll.get_paths()) for coll in colls}
    assert by_gid.get("gpus-idle", 0) == exp["idle"]
    assert by_gid.get("gpus-unavailable", 0) == exp["unavailable"]
    # Thick black edges: exactly the GPUs of the straddling EP groups.
    thick = 0
    for coll in colls:
        if coll.get_gid() in ("gpus-idle", "gpus-unavailable"):
            continue
        widths = np.broadcast_to(coll.get_linewidths(), (len(coll.get_paths()),))
        edges = [to_hex(e) for e in np.broadcast_to(coll.get_edgecolors(), (len(coll.get_paths()), 4))]
        thick += sum(1 for w, e in zip(widths, edges) if w > 0 and e == "#000000")
    assert thick == exp["straddling_gpus"]
    # One table line per straddling EP group, with the evaluator's bytes of that group.
    per_group = evaluate(inst, pl, window=window).cross_domain_bytes_per_ep_group
    lines = {t.get_gid(): t.get_text() for ax in fig.axes for t in ax.texts if str(t.get_gid()).startswith("straddler-")}
    listed = {tuple(int(x) for x in gid.split("-")[1:]) for gid in lines if re.fullmatch(r"straddler-\d+-\d+", gid)}
    assert listed == exp["straddling"]
    notes = {tuple(int(x) for x in gid.split("-")[2:]) for gid in lines if gid.startswith("straddler-note-")}
    assert notes <= exp["straddling"]  # named under the panel of its largest part (at most 3 per panel)
    if len(exp["straddling"]) <= 3:
        assert notes == exp["straddling"]
    for s, g in listed:
        value = per_group[s][g]
        assert value > 0
        number = re.search(r"\s([\d,.]+) (TB|GB|MB|kB|B)\s", lines[f"straddler-{s}-{g}"])
        assert number is not None
        scale = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1.0}[number[2]]
        assert float(number[1].replace(",", "")) * scale == pytest.approx(value, rel=1e-3)
    if not exp["straddling"]:
        assert "straddler-none" in lines


# ---------------------------------------------------------------------------------------------
def test_tiny_default_figure_matches_the_placement(tiny):
    pl = default_placement(tiny)
    exp = expected(tiny, pl)
    doc = json.loads((INSTANCES / "tiny.json").read_text())
    c = doc["cluster"]
    assert exp["unavailable"] == len(c["unavailable_trays"]) * c["gpus_per_tray"] + len(c["unavailable_gpus"]) > 0
    assert exp["idle"] > 0 and exp["straddling"]
    check_figure(rack_map_figure(tiny, pl), exp, tiny, pl)


def test_two_groups_per_stage_idle_and_down():
    inst, pl = small_case()
    exp = expected(inst, pl)
    assert exp["idle"] == 18 - 2 - 8 and exp["unavailable"] == 2
    fig = rack_map_figure(inst, pl)
    check_figure(fig, exp, inst, pl)
    # Each EP group index has its own hatch, in the legend and on the cells.
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert sum(1 for x in labels if x.startswith("EP group ") and "of each stage" in x) == 2
    hatches = {coll.get_gid(): coll.get_hatch() for coll in cell_collections(fig)}
    assert hatches["gpus-group-0"] in (None, "") and hatches["gpus-group-1"]


def test_sampled_window_bytes(tiny):
    pl = default_placement(tiny)
    check_figure(rack_map_figure(tiny, pl, window="sampled"), expected(tiny, pl), tiny, pl, window="sampled")


def test_no_straddler():
    rng = np.random.default_rng(3)
    inst = random_instance(rng, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=2, gpus_per_tray=2)
    pl = Placement(np.arange(8), np.stack([np.arange(8)] * inst.model.num_moe_layers))  # a stage per domain
    exp = expected(inst, pl)
    assert not exp["straddling"] and exp["idle"] == 4
    check_figure(rack_map_figure(inst, pl), exp, inst, pl)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([(2, 4, 1), (2, 4, 2), (4, 4, 2), (4, 8, 1)]), st.integers(0, 4))
def test_random_placements(seed, shape, n_down):
    ep, dp, pp = shape
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, ep=ep, dp=dp, pp=pp, num_domains=4, trays_per_domain=3, gpus_per_tray=2)
    inst = with_down_gpus(inst, list(rng.choice(inst.cluster.num_gpus, size=n_down, replace=False)))
    pl = placement_on_available(rng, inst)
    check_figure(rack_map_figure(inst, pl), expected(inst, pl), inst, pl)


def test_dsv3_1024_default_stays_readable():
    inst = read_instance(INSTANCES / "dsv3_1024.json")
    pl = default_placement(inst)
    exp = expected(inst, pl)
    assert len(exp["stage_gpus"]) == 16 and exp["unavailable"] == 56 and exp["idle"] == 0
    fig = rack_map_figure(inst, pl, label="default layout")
    check_figure(fig, exp, inst, pl)
    w, h = fig.get_size_inches()
    assert w <= 20 and h <= 18  # fits a screen at the figure's 120 dpi with 0.3 in GPU cells
    labels = [t for t in fig.axes[0].texts if re.fullmatch(r"\d+", t.get_text()) and t.get_fontsize() >= 6]
    assert len(labels) >= 1024  # every running GPU keeps a legible stage label


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
def svg_counts(path: Path) -> tuple[dict, Counter, int]:
    """Legend texts and fills, and cell fills, read from the SVG file."""
    root = ET.parse(path).getroot()
    groups = {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("id")}
    legend = groups["legend"]
    texts = ["".join(t.itertext()) for t in legend.iter(f"{SVG}text")]
    fills = [dict(kv.split(": ") for kv in p.get("style", "").split("; ")).get("fill") for p in legend.iter(f"{SVG}path")]
    stages = {}
    stage_texts = [t for t in texts if t.startswith("stage ")]
    for text, fill in zip(stage_texts, fills):  # stage entries come first, patch then text
        m = re.fullmatch(r"stage (\d+): (\d+) GPUs, .*", text)
        assert m
        stages[int(m[1])] = (int(m[2]), fill)
    # A hatched cell is filled with a pattern whose first rectangle carries the face colour.
    patterns = {pat.get("id"): pat.find(f"{SVG}rect").get("fill") for pat in root.iter(f"{SVG}pattern")}
    cells: Counter = Counter()
    n_cells = 0
    for gid, g in groups.items():
        if gid.startswith("gpus-"):
            for p in g.iter(f"{SVG}path"):
                fill = dict(kv.split(": ") for kv in p.get("style", "").split("; ")).get("fill", "")
                if m := re.fullmatch(r"url\(#(\w+)\)", fill):
                    fill = patterns[m[1]]
                cells[fill] += 1
                n_cells += 1
    info = {"stages": stages, "texts": texts}
    return info, cells, n_cells


def test_png_and_svg_files(tmp_path):
    inst, pl = small_case(1)
    exp = expected(inst, pl)
    png = draw_placement(inst, pl, tmp_path / "map.png")
    svg = draw_placement(inst, pl, tmp_path / "map.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    info, cells, n_cells = svg_counts(svg)
    assert n_cells == inst.cluster.num_gpus
    assert {s: n for s, (n, _) in info["stages"].items()} == exp["stage_gpus"]
    for s, (n, fill) in info["stages"].items():
        assert cells[fill] == n
    assert f"idle (free, unused): {exp['idle']} GPUs" in info["texts"]
    assert f"unavailable: {exp['unavailable']} GPUs" in info["texts"]
    assert f"EP group over several domains: {len(exp['straddling'])} of {exp['groups']}" in info["texts"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.png", "map.svg"]  # no temporary file left


def test_files_are_deterministic(tmp_path, tiny):
    pl = default_placement(tiny)
    for suffix in (".png", ".svg"):
        a = draw_placement(tiny, pl, tmp_path / f"a{suffix}").read_bytes()
        b = draw_placement(tiny, pl, tmp_path / f"b{suffix}").read_bytes()
        assert a == b
    assert b"<dc:date>" not in (tmp_path / "a.svg").read_bytes()


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def tiny_files(tmp_path, tiny):
    """A copy of the tiny instance and a placement file for it, in their own folder."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("tiny.json", "tiny.npz"):
        shutil.copy(INSTANCES / name, folder / name)
    pl = default_placement(tiny)
    doc = placement_document(tiny, pl, solver="default")
    write_placement(folder / "p.json", doc)
    return folder


def test_cli_writes_png_svg_and_default_name(tiny_files, capsys):
    inst = str(tiny_files / "tiny.json")
    assert main(["show", str(tiny_files / "p.json"), "--instance", inst, "-o", str(tiny_files / "m.svg")]) == 0
    assert main(["show", str(tiny_files / "p.json"), "--instance", inst]) == 0  # beside the placement
    assert main(["show", "default", "--instance", inst, "-o", str(tiny_files / "d.png")]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and (tiny_files / "p.png").is_file() and (tiny_files / "m.svg").is_file()
    assert (tiny_files / "d.png").read_bytes()[:4] == b"\x89PNG"


def _bad_cases(folder: Path) -> list[tuple[list[str], str]]:
    p, inst = str(folder / "p.json"), str(folder / "tiny.json")
    other = folder / "other"
    other.mkdir()
    doc = json.loads((folder / "tiny.json").read_text())
    doc["description"] = "changed: another instance"
    (other / "tiny.json").write_text(json.dumps(doc))
    shutil.copy(folder / "tiny.npz", other / "tiny.npz")
    bad = json.loads((folder / "p.json").read_text())
    down = json.loads((folder / "tiny.json").read_text())["cluster"]["unavailable_trays"][0]
    c = doc["cluster"]
    bad["rank2gpu"][0] = (down[0] * c["trays_per_domain"] + down[1]) * c["gpus_per_tray"]
    (folder / "bad.json").write_text(json.dumps(bad))
    (folder / "broken.json").write_text("{")
    return [
        ([str(folder / "missing.json"), "--instance", inst, "-o", str(folder / "m.png")], "missing.json"),
        ([p, "--instance", str(folder / "missing.json"), "-o", str(folder / "m.png")], "missing.json"),
        ([p, "--instance", inst, "-o", str(folder / "m.pdf")], "-o"),
        ([p, "--instance", inst, "-o", str(folder / "m")], "-o"),
        ([p, "--instance", inst, "-o", str(folder / "nofolder" / "m.png")], "-o"),
        ([p, "--instance", inst, "-o", str(folder)], "-o"),
        ([p, "--instance", str(other / "tiny.json"), "-o", str(folder / "m.png")], "instance.sha256"),
        ([p, "-o", str(folder / "m.png")], "--instance"),
        (["default", "--instance", inst], "-o"),
        ([str(folder / "bad.json"), "--instance", inst, "-o", str(folder / "m.png")], "rank2gpu[0]"),
        ([str(folder / "broken.json"), "--instance", inst, "-o", str(folder / "m.png")], "broken.json"),
        ([p, "--instance", inst, "-o", str(folder / "m.png"), "--window", "later"], "--window"),
    ]


def test_cli_bad_input_exits_2_and_writes_nothing(tiny_files, capsys):
    cases = _bad_cases(tiny_files)
    before = sorted(p.relative_to(tiny_files) for p in tiny_files.rglob("*"))
    for argv, field in cases:
        assert main(["show", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("placement: error:") and field in err, (argv, err)
    assert sorted(p.relative_to(tiny_files) for p in tiny_files.rglob("*")) == before


def test_without_matplotlib_exits_1(tiny_files, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    argv = ["show", str(tiny_files / "p.json"), "--instance", str(tiny_files / "tiny.json"), "-o", str(tiny_files / "m.png")]
    assert main(argv) == 1
    assert "placement[show]" in capsys.readouterr().err
    assert not (tiny_files / "m.png").exists()


def test_library_refuses_an_invalid_placement(tmp_path, tiny):
    pl = default_placement(tiny)
    r2g = np.array(pl.rank2gpu)
    r2g[0] = r2g[1]  # two ranks on one GPU
    with pytest.raises(InvalidInputError, match="runs 2 ranks"):
        draw_placement(tiny, Placement(r2g, pl.phy2log), tmp_path / "m.png")
    assert not list(tmp_path.iterdir())
