"""Bad input, end to end: every case exits 2 with one stderr line naming the field, and writes nothing.

Each case runs ``placement solve INSTANCE -o DIR/p.json`` (or ``evaluate --placement`` for
placement files) in process and checks the exit code, that stderr is exactly one line naming the
field (or the file), that stdout is empty and that the output folder stays empty.  The cases of
``tests/test_formats.py`` are not repeated here.  Hypothesis then mutates the tiny instance, its
``.npz`` and a placement file at random: the result must be exit 0 (a valid, complete file) or a
one-line exit 2/3, never a traceback or exit 1.

Policy decided here (and documented in docs/api.md, "Bad input"): a GPU listed in ``unavailable_gpus`` whose
tray is also in ``unavailable_trays`` is refused as contradictory, like a duplicate.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import tempfile
import tracemalloc
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placement.core.checker import check
from placement.cli import main
from placement.formats import MAX_GPUS, read_instance, read_placement
from tests.conftest import INSTANCES

TINY_DOC: dict = json.loads((INSTANCES / "tiny.json").read_text())
TINY_NPZ: bytes = (INSTANCES / "tiny.npz").read_bytes()
# Deeper fuzzing: PLACEMENT_FUZZ_EXAMPLES=2000 PLACEMENT_FUZZ_RANDOM=1 pytest tests/test_badinput.py -k fuzz
FUZZ_EXAMPLES = int(os.environ.get("PLACEMENT_FUZZ_EXAMPLES", "60"))
FUZZ_RANDOM = os.environ.get("PLACEMENT_FUZZ_RANDOM") == "1"


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def write_case(folder: Path, doc: Any = None, text: str | None = None, npz: bytes | None = None) -> Path:
    """The tiny instance in ``folder``, with its JSON replaced by ``doc``/``text``, its npz by ``npz``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny.json"
    if text is None:
        text = json.dumps(TINY_DOC if doc is None else doc, allow_nan=True)
    path.write_text(text)
    (folder / "tiny.npz").write_bytes(TINY_NPZ if npz is None else npz)
    return path


def mutated(fn: Callable[[dict], Any]) -> dict:
    doc = copy.deepcopy(TINY_DOC)
    fn(doc)
    return doc


def npz_bytes(**arrays: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def tiny_arrays() -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(TINY_NPZ)) as z:
        return {k: z[k] for k in z.files}


def with_array(key: str, fn: Callable[[np.ndarray], np.ndarray]) -> bytes:
    arrays = tiny_arrays()
    arrays[key] = fn(arrays[key])
    return npz_bytes(**arrays)


def assert_refused(argv: list[str], out_dir: Path, field: str, code: int = 2) -> str:
    got, stdout, err = run(argv)
    assert got == code, f"exit {got}: {err}"
    assert stdout == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert field in err, f"{field!r} not named in: {err}"
    assert "internal" not in err
    assert os.listdir(out_dir) == [], "something was written"
    return err


def solve_argv(path: Path, out_dir: Path) -> list[str]:
    return ["solve", str(path), "-o", str(out_dir / "p.json")]


# ---------------------------------------------------------------------------------------------
# Instance JSON
# ---------------------------------------------------------------------------------------------
def _set(*keys_and_value: Any) -> Callable[[dict], None]:
    *keys, value = keys_and_value

    def fn(doc: dict) -> None:
        node = doc
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value

    return fn


def _del(*keys: str) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        node = doc
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]

    return fn


INSTANCE_CASES: list[tuple[str, Callable[[dict], None], str]] = [
    # wrong types
    ("string for an integer", _set("parallel", "ep", "8"), "parallel.ep"),
    ("float for an integer", _set("model", "num_experts", 16.0), "model.num_experts"),
    ("boolean for an integer", _set("cluster", "gpus_per_tray", True), "cluster.gpus_per_tray"),
    ("null for a number", _set("cluster", "scaleout_gbps", None), "cluster.scaleout_gbps"),
    ("list for an object", _set("model", []), "model"),
    ("object for a list", _set("model", "moe_layers", {"0": 1}), "model.moe_layers"),
    ("number for a string", _set("cost_mode", 1), "cost_mode"),
    ("string for a list item", _set("cluster", "unavailable_gpus", ["3"]), "cluster.unavailable_gpus[0]"),
    ("unknown cost mode", _set("cost_mode", "per_token"), "cost_mode"),
    ("missing key", _del("parallel", "stage_layers"), "parallel.stage_layers"),
    ("unknown key", _set("cluster", "gpus", 4), "cluster.gpus"),
    # non-finite numbers
    ("NaN bandwidth", _set("cluster", "nvlink_gbps", float("nan")), "NaN"),
    ("infinite bandwidth", _set("cluster", "scaleout_gbps", float("inf")), "Infinity"),
    ("negative infinite bandwidth", _set("cluster", "scaleout_gbps", float("-inf")), "-Infinity"),
    # negative or zero sizes
    ("zero experts", _set("model", "num_experts", 0), "model.num_experts"),
    ("negative ep", _set("parallel", "ep", -8), "parallel.ep"),
    ("zero GPUs per tray", _set("cluster", "gpus_per_tray", 0), "cluster.gpus_per_tray"),
    ("zero sequence length", _set("parallel", "seq_len", 0), "parallel.seq_len"),
    ("zero bandwidth", _set("cluster", "scaleout_gbps", 0), "cluster.scaleout_gbps"),
    ("negative dispatch bytes", _set("model", "dispatch_bytes_per_token", -1), "model.dispatch_bytes_per_token"),
    ("negative GPU id", _set("cluster", "unavailable_gpus", [-1]), "cluster.unavailable_gpus[0]"),
    ("negative tray", _set("cluster", "unavailable_trays", [[0, -1]]), "cluster.unavailable_trays[0][1]"),
    ("tiny bandwidth", _set("cluster", "nvlink_gbps", 1e-300), "cluster.nvlink_gbps"),
    # huge values: refused before anything is allocated
    ("10**30 domains", _set("cluster", "num_domains", 10**30), "cluster.num_domains"),
    ("10**30 GPU id", _set("cluster", "unavailable_gpus", [10**30]), "cluster.unavailable_gpus"),
    ("10**30 MoE layer", _set("model", "moe_layers", [1, 2, 10**30]), "model.moe_layers"),
    ("10**30 sequence length", _set("parallel", "seq_len", 10**30), "parallel.seq_len"),
    ("a million x a million trays", lambda d: d["cluster"].update(num_domains=10**6, trays_per_domain=10**6), "cluster"),
    ("a million-rank job", lambda d: d["parallel"].update(dp=10**6, ep=8), "parallel"),
    ("experts x layers too many",
     lambda d: d["model"].update(num_experts=10**6, num_layers=100, moe_layers=list(range(100))), "model.num_experts"),
    # mismatched shapes and inconsistent sizes
    ("stages != pp", _set("parallel", "pp", 3), "parallel.stage_layers"),
    ("top_k over num_experts", _set("model", "top_k", 17), "model.top_k"),
    ("groups do not divide experts", _set("model", "num_groups", 3), "model.num_groups"),
    ("groups_per_token over groups", _set("model", "groups_per_token", 5), "model.groups_per_token"),
    ("moe layers not ascending", _set("model", "moe_layers", [2, 1, 3]), "model.moe_layers"),
    ("global batch not a multiple", _set("parallel", "global_batch", 33), "parallel.global_batch"),
    ("routing shape vs dp", _set("parallel", "dp", 16), "routing.topk"),
    ("routing shape vs layers", lambda d: d["model"].update(moe_layers=[1, 2]), "routing.topk"),
    # duplicates and contradictory availability
    ("duplicate tray", _set("cluster", "unavailable_trays", [[3, 1], [3, 1]]), "cluster.unavailable_trays"),
    ("tray out of range", _set("cluster", "unavailable_trays", [[5, 0]]), "cluster.unavailable_trays[0]"),
    ("GPU in an unavailable tray", _set("cluster", "unavailable_gpus", [14]), "cluster.unavailable_gpus"),
    # host names end up in SLURM host files
    ("host_format attribute access", _set("cluster", "host_format", "{domain.__class__}"), "cluster.host_format"),
    ("host_format huge width", _set("cluster", "host_format", "{host:>1000000000}"), "cluster.host_format"),
    ("host_format positional field", _set("cluster", "host_format", "n{0}"), "cluster.host_format"),
    ("host_format newline", _set("cluster", "host_format", "rack\n{host}"), "cluster.host_format"),
    ("host_format same name twice", _set("cluster", "host_format", "r{tray}"), "cluster.host_format"),
    ("host_format constant", _set("cluster", "host_format", "node"), "cluster.host_format"),
    # the routing file reference
    ("absolute routing path", _set("routing", "file", "/etc/passwd"), "routing.file"),
    ("routing path with NUL", _set("routing", "file", "tiny\u0000.npz"), "routing.file"),
    ("empty routing path", _set("routing", "file", ""), "routing.file"),
    ("routing path is a folder", _set("routing", "file", "."), "routing.file"),
    ("newline in a key", _set("model", "bad\nkey", 1), "model.bad\\nkey"),
    # the performance block (predicted step time)
    ("unknown GPU kind", _set("performance", "gpu", "a100"), "performance.gpu"),
    ("negative efficiency", _set("performance", "gemm_efficiency", -0.3), "performance.gemm_efficiency"),
    ("efficiency over 1", _set("performance", "gemm_efficiency", 1.5), "performance.gemm_efficiency"),
    ("vpp not dividing a stage's layers", _set("performance", "vpp", 2), "performance.vpp"),
    ("unknown overlap mode", _set("performance", "overlap", "dualpipe"), "performance.overlap"),
    ("negative layer overhead", _set("performance", "layer_overhead_s", -1e-3), "performance.layer_overhead_s"),
    ("misspelt performance key", _set("performance", "gemm_eficiency", 0.4), "performance.gemm_eficiency"),
    ("gqa without query groups", _set("performance", "architecture", "num_query_groups", 0),
     "performance.architecture.num_query_groups"),
    ("zero grad bytes", _set("model", "dispatch_grad_bytes_per_token", 0), "model.dispatch_grad_bytes_per_token"),
]


@pytest.mark.parametrize("name,mutate,field", INSTANCE_CASES, ids=[c[0] for c in INSTANCE_CASES])
def test_bad_instance(tmp_path, name, mutate, field):
    path = write_case(tmp_path / "in", mutated(mutate))
    (tmp_path / "out").mkdir()
    assert_refused(solve_argv(path, tmp_path / "out"), tmp_path / "out", field)


TEXT_CASES = [
    ("truncated JSON", json.dumps(TINY_DOC)[:300], "malformed JSON"),
    ("empty file", "", "malformed JSON"),
    ("not an object", "[1, 2, 3]", "expected an object"),
    ("duplicate key", json.dumps(TINY_DOC)[:-1] + ', "name": "again"}', "duplicate key 'name'"),
    ("deep nesting", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("4300-digit integer", json.dumps(TINY_DOC).replace('"num_domains": 5', '"num_domains": 1' + "0" * 5000), "digits"),
    ("1e999 overflows to infinity", json.dumps(TINY_DOC).replace('"nvlink_gbps": 900.0', '"nvlink_gbps": 1e999'),
     "cluster.nvlink_gbps"),
    ("a bare NaN constant", json.dumps(TINY_DOC).replace('"top_k": 4', '"top_k": NaN'), "NaN"),
]


@pytest.mark.parametrize("name,text,field", TEXT_CASES, ids=[c[0] for c in TEXT_CASES])
def test_malformed_instance_text(tmp_path, name, text, field):
    path = write_case(tmp_path / "in", text=text)
    (tmp_path / "out").mkdir()
    err = assert_refused(solve_argv(path, tmp_path / "out"), tmp_path / "out", field)
    assert str(path) in err


def test_not_utf8(tmp_path):
    path = write_case(tmp_path / "in")
    path.write_bytes(b"\xff\xfe{}")
    (tmp_path / "out").mkdir()
    assert_refused(solve_argv(path, tmp_path / "out"), tmp_path / "out", "not UTF-8")


@pytest.mark.parametrize("kind", ["directory", "fifo", "device"])
def test_instance_that_is_not_a_regular_file(tmp_path, kind):
    (tmp_path / "out").mkdir()
    if kind == "directory":
        path = tmp_path / "in"
        path.mkdir()
    elif kind == "fifo":
        path = tmp_path / "fifo.json"
        os.mkfifo(path)  # reading it would block forever
    else:
        path = Path("/dev/zero")  # reading it would fill memory
    assert_refused(solve_argv(path, tmp_path / "out"), tmp_path / "out", str(path))


def test_huge_sizes_allocate_nothing(tmp_path):
    """Sizes like 10**6 x 10**6 x 1024 GPUs are refused from the document, not by a MemoryError."""
    doc = mutated(lambda d: d["cluster"].update(num_domains=10**6, trays_per_domain=10**6, gpus_per_tray=1024))
    path = write_case(tmp_path / "in", doc)
    (tmp_path / "out").mkdir()
    tracemalloc.start()
    try:
        assert_refused(solve_argv(path, tmp_path / "out"), tmp_path / "out", "cluster")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20e6, f"peak {peak / 1e6:.0f} MB while refusing"
    assert 10**6 * 10**6 > MAX_GPUS


# ---------------------------------------------------------------------------------------------
# The routing .npz
# ---------------------------------------------------------------------------------------------
def _npy_header_only(shape: tuple[int, ...], dtype: str = "<u1") -> bytes:
    """An .npy member whose header claims ``shape`` but which holds no data (a zip bomb's head)."""
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": dtype, "fortran_order": False, "shape": shape})
    return member.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _zip_with_duplicate() -> bytes:
    members = _tiny_members()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name
        with zipfile.ZipFile(buf, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)
            zf.writestr("topk.npy", members["topk.npy"])
    return buf.getvalue()


def _tiny_members() -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(TINY_NPZ)) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


NPZ_CASES: list[tuple[str, Callable[[], bytes], str]] = [
    ("empty file", lambda: b"", "routing.file"),
    ("random bytes", lambda: bytes(range(256)) * 4, "routing.file"),
    ("truncated", lambda: TINY_NPZ[: len(TINY_NPZ) - 40], "routing.file"),
    ("pickled objects", lambda: npz_bytes(topk=np.array([{"a": 1}], dtype=object), heldout_topk=np.zeros(1)),
     "routing.file"),
    ("pickled objects in a well-shaped array", lambda: with_array("heldout_topk", lambda a: a.astype(object)),
     "routing.file"),
    ("float routing", lambda: with_array("topk", lambda a: a.astype(np.float32)), "routing.topk"),
    ("bool routing", lambda: with_array("topk", lambda a: a > 3), "routing.topk"),
    ("string routing", lambda: with_array("heldout_topk", lambda a: a.astype("U2")), "routing.heldout_topk"),
    ("missing held-out window", lambda: npz_bytes(topk=tiny_arrays()["topk"]), "routing.heldout_topk"),
    ("an extra array", lambda: npz_bytes(**tiny_arrays(), extra=np.zeros(3)), "routing.file"),
    ("expert id out of range", lambda: with_array("topk", lambda a: np.where(a == 0, 16, a)), "routing.topk"),
    ("negative expert id", lambda: with_array("topk", lambda a: a.astype(np.int16) - 1), "routing.topk"),
    ("an expert twice in a token", lambda: with_array("topk", lambda a: np.repeat(a[..., :1], 4, axis=-1)),
     "routing.topk"),
    ("no tokens", lambda: with_array("topk", lambda a: a[:, :, :0]), "routing.topk"),
    ("one dimension too many", lambda: with_array("topk", lambda a: a[None]), "routing.topk"),
    ("0-d array", lambda: with_array("heldout_topk", lambda a: np.array(3, dtype=a.dtype)), "routing.heldout_topk"),
    ("header claims 10**12 tokens (zip bomb)",
     lambda: _zip({**_tiny_members(), "topk.npy": _npy_header_only((3, 8, 10**12, 4))}), "routing.topk"),
    ("header claims more data than stored",
     lambda: _zip({**_tiny_members(), "topk.npy": _npy_header_only((3, 8, 32, 4))}), "routing.topk"),
    ("trailing bytes after the data",
     lambda: _zip({**_tiny_members(), "topk.npy": _tiny_members()["topk.npy"] + b"\0" * 8}), "routing.topk"),
    ("member stored twice", lambda: _zip_with_duplicate(), "routing.file"),
]


@pytest.mark.parametrize("name,make,field", NPZ_CASES, ids=[c[0] for c in NPZ_CASES])
def test_bad_routing_npz(tmp_path, name, make, field):
    path = write_case(tmp_path / "in", npz=make())
    (tmp_path / "out").mkdir()
    assert_refused(solve_argv(path, tmp_path / "out"), tmp_path / "out", field)


def test_routing_symlink_escaping_the_folder(tmp_path):
    path = write_case(tmp_path / "in", mutated(_set("routing", "file", "link.npz")))
    (tmp_path / "secret.npz").write_bytes(TINY_NPZ)
    (tmp_path / "in" / "link.npz").symlink_to(tmp_path / "secret.npz")
    (tmp_path / "out").mkdir()
    assert_refused(solve_argv(path, tmp_path / "out"), tmp_path / "out", "escapes the instance's folder")


def test_routing_fifo_does_not_block(tmp_path):
    path = write_case(tmp_path / "in", mutated(_set("routing", "file", "fifo.npz")))
    os.mkfifo(tmp_path / "in" / "fifo.npz")
    (tmp_path / "out").mkdir()
    assert_refused(solve_argv(path, tmp_path / "out"), tmp_path / "out", "routing.file")


# ---------------------------------------------------------------------------------------------
# Output paths and flags: refused before any work
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra,field",
    [
        (["--time-limit", "nan"], "--time-limit"),
        (["--time-limit", "-1"], "--time-limit"),
        (["--time-limit", "inf"], "--time-limit"),
        (["--workers", "0"], "--workers"),
        (["--seed", "-3"], "--seed"),
        (["--seed", "x"], "--seed"),
        (["--consumer", "nccl"], "--consumer"),
    ],
)
def test_bad_flags(tmp_path, extra, field):
    (tmp_path / "out").mkdir()
    assert_refused(solve_argv(INSTANCES / "tiny.json", tmp_path / "out") + extra, tmp_path / "out", field)


def test_output_folder_missing_or_a_directory(tmp_path):
    code, _, err = run(["solve", str(INSTANCES / "tiny.json"), "-o", str(tmp_path / "no" / "p.json")])
    assert code == 2 and "--output" in err and err.count("\n") == 1
    code, _, err = run(["solve", str(INSTANCES / "tiny.json"), "-o", str(tmp_path)])
    assert code == 2 and "is a directory" in err
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Placement files
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def placement_doc() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.json"
        assert run(["solve", str(INSTANCES / "tiny.json"), "-o", str(out)])[0] == 0
        return json.loads(out.read_text())


PLACEMENT_CASES: list[tuple[str, Callable[[dict], None], str]] = [
    ("rank2gpu too short", lambda d: d["rank2gpu"].pop(), "rank2gpu"),
    ("rank2gpu not a list", _set("rank2gpu", "0,1,2"), "rank2gpu"),
    ("string GPU id", lambda d: d["rank2gpu"].__setitem__(0, "0"), "rank2gpu[0]"),
    ("float GPU id", lambda d: d["rank2gpu"].__setitem__(0, 0.0), "rank2gpu[0]"),
    ("negative GPU id", lambda d: d["rank2gpu"].__setitem__(0, -1), "rank2gpu[0]"),
    ("GPU id out of range", lambda d: d["rank2gpu"].__setitem__(0, 40), "rank2gpu[0]"),
    ("10**30 GPU id", lambda d: d["rank2gpu"].__setitem__(0, 10**30), "rank2gpu[0]"),
    ("duplicate GPU", lambda d: d["rank2gpu"].__setitem__(0, d["rank2gpu"][1]), "rank2gpu"),
    ("an unavailable GPU", lambda d: d["rank2gpu"].__setitem__(0, 14), "rank2gpu[0]"),
    ("a layer missing", lambda d: d["phy2log"].pop(), "phy2log"),
    ("no layers", _set("phy2log", []), "phy2log"),
    ("ragged layers", lambda d: d["phy2log"][0].pop(), "phy2log"),
    ("not a permutation", lambda d: d["phy2log"][1].__setitem__(0, d["phy2log"][1][1]), "phy2log[1]"),
    ("expert id out of range", lambda d: d["phy2log"][2].__setitem__(3, 99), "phy2log[2]"),
    ("expert id NaN", lambda d: d["phy2log"][0].__setitem__(0, float("nan")), "NaN"),
    ("wrong kind", _set("kind", "instance"), "kind"),
    ("missing rank2gpu", _del("rank2gpu"), "rank2gpu"),
    ("schema version 2", _set("schema_version", 2), "schema_version"),
]


@pytest.mark.parametrize("name,mutate,field", PLACEMENT_CASES, ids=[c[0] for c in PLACEMENT_CASES])
def test_bad_placement_file(tmp_path, placement_doc, name, mutate, field):
    doc = copy.deepcopy(placement_doc)
    mutate(doc)
    path = tmp_path / "in" / "p.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc, allow_nan=True))
    (tmp_path / "out").mkdir()
    assert_refused(["evaluate", str(INSTANCES / "tiny.json"), "--placement", str(path)], tmp_path / "out", field)


# ---------------------------------------------------------------------------------------------
# Hypothesis: random mutations never crash
# ---------------------------------------------------------------------------------------------
def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


INSTANCE_PATHS = _paths(TINY_DOC)

odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(-2, 20), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(0, 5), max_size=2),
)
mutation = st.tuples(
    st.sampled_from(["delete", "rename", "replace", "nudge"]),
    st.integers(0, 10**6),  # which path (modulo the paths still present)
    odd_values,
    st.text(min_size=1, max_size=8),
    st.integers(-3, 3),
)


def apply_mutations(doc: Any, mutations: list[tuple]) -> Any:
    for op, which, value, new_key, delta in mutations:
        paths = _paths(doc)
        if not paths:
            return value  # the whole document replaced
        path = paths[which % len(paths)]
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        if op == "delete":
            del parent[key]
        elif op == "rename" and isinstance(parent, dict):
            parent[new_key] = parent.pop(key)
        elif op == "nudge" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] = parent[key] * 2 if delta == 0 else parent[key] + delta
        elif op == "nudge" and isinstance(parent[key], list) and parent[key]:
            parent[key].append(copy.deepcopy(parent[key][delta % len(parent[key])]))
        else:
            parent[key] = value
    return doc


def check_outcome(code: int, stdout: str, err: str, out: Path, instance_path: Path) -> None:
    assert code in (0, 2, 3), f"exit {code}: {err}"
    assert "internal" not in err and "Traceback" not in err, err
    if code == 0:
        placement, _ = read_placement(out)
        assert check(read_instance(instance_path), placement) == []
    else:
        assert stdout == "" and err.count("\n") == 1, err
        assert not out.exists()
        assert os.listdir(out.parent) == []


FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=not FUZZ_RANDOM,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(st.lists(mutation, min_size=1, max_size=3))
def test_fuzz_instance_json(mutations):
    doc = apply_mutations(copy.deepcopy(TINY_DOC), mutations)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_case(Path(tmp) / "in", doc)
        out = Path(tmp) / "out" / "p.json"
        out.parent.mkdir()
        check_outcome(*run(solve_argv(path, out.parent)), out, path)


@st.composite
def npz_mutations(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "arrays"]))
    if kind == "bytes":
        data = bytearray(TINY_NPZ)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "cut", "insert"]))
            at = draw(st.integers(0, max(0, len(data) - 1)))
            if op == "flip" and data:
                data[at] ^= draw(st.integers(1, 255))
            elif op == "cut":
                del data[at:]
            else:
                data[at:at] = draw(st.binary(min_size=1, max_size=16))
        return bytes(data)
    arrays: dict[str, Any] = tiny_arrays()
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(arrays) + ["extra"]))
        op = draw(st.sampled_from(["drop", "dtype", "value", "shape"]))
        if op == "drop":
            arrays.pop(key, None)
            continue
        if key not in arrays:
            arrays[key] = np.zeros(2, dtype=np.int8)
            continue
        a = np.asarray(arrays[key])
        if op == "dtype":
            dtype = draw(st.sampled_from(["i1", "u8", ">i4", "f8", "bool", "U3", "O", "c8"]))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # lossy casts are the point
                try:
                    arrays[key] = a.astype(dtype)
                except (ValueError, TypeError):
                    pass
        elif op == "value" and a.size and a.dtype.kind in "iub":
            a = a.astype(np.int64)
            a.reshape(-1)[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from([-1, 16, 255, 2**40, 3]))
            arrays[key] = a
        elif a.ndim:
            arrays[key] = draw(st.sampled_from([a[None], a[..., :1], a.reshape(-1), a[:0], a.swapaxes(0, -1)]))
    return npz_bytes(**arrays)


@FUZZ
@given(npz_mutations())
def test_fuzz_routing_npz(npz):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_case(Path(tmp) / "in", npz=npz)
        out = Path(tmp) / "out" / "p.json"
        out.parent.mkdir()
        code, stdout, err = run(solve_argv(path, out.parent))
        check_outcome(code, stdout, err, out, path)
        if code:
            assert "routing." in err


@FUZZ
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_fuzz_placement_file(placement_doc, mutations):
    doc = apply_mutations(copy.deepcopy(placement_doc), mutations)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.json"
        path.write_text(json.dumps(doc, allow_nan=True))
        code, stdout, err = run(["evaluate", str(INSTANCES / "tiny.json"), "--placement", str(path), "--json"])
        assert code in (0, 2), f"exit {code}: {err}"
        assert "internal" not in err, err
        if code:
            assert stdout == "" and err.count("\n") == 1, err
        else:
            json.loads(stdout)


def test_tiny_is_valid_to_begin_with(tmp_path):
    path = write_case(tmp_path / "in")
    (tmp_path / "out").mkdir()
    code, _, err = run(solve_argv(path, tmp_path / "out"))
    assert code == 0, err
    shutil.rmtree(tmp_path / "out")
