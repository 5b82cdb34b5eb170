"""Golden outputs: what the commands print and write on the committed instances, byte for byte.

The files in ``tests/data/golden/`` were written by the code before the package was split into
layers (commit d598e8b) and checked identical after it; a change of output is a change of these
files, made on purpose and said in its commit (``python tests/test_golden.py --write`` rewrites
them).  Solves run on ``tiny`` only (the placement file: the CLI's stdout has wall times); every
export format of that placement, ``verify``, and ``evaluate`` / ``stats`` on the committed instances.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden"
INSTANCES = ROOT / "instances"
EVALUATED = ("tiny", "dsv3_256", "dsv3_1024", "qwen3_256", "real_ep64", "real_pp_frag")
#: every export format, with the file name ending its consumer expects
EXPORTS = {"sglang": ".json", "vllm": ".json", "vllm-ascend": ".json", "megatron": ".json", "torchtitan": ".json",
           "slurm": ".sh", "hybridep": ".sh", "maxtext": ".json"}


_TIMES = re.compile(r"\(evaluated in [0-9.]+ s\)")


def _run(argv: list[str]) -> tuple[int, str]:
    from placement.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = out.getvalue() + (f"stderr:\n{err.getvalue()}" if err.getvalue() else "")
    return code, _TIMES.sub("(evaluated in T s)", text)  # wall times are not output


def outputs(work: Path) -> dict[str, bytes]:
    """Every golden output, by file name, computed now in ``work`` (a scratch folder)."""
    got: dict[str, bytes] = {}
    for name in EVALUATED:
        for cmd in ("evaluate", "stats"):
            code, text = _run([cmd, str(INSTANCES / f"{name}.json")])
            got[f"{cmd}_{name}.txt"] = f"exit {code}\n{text}".encode()
    tiny = str(INSTANCES / "tiny.json")
    solved = work / "tiny_solved.json"
    code, _ = _run(["solve", tiny, "-o", str(solved)])
    got["solve_tiny.json"] = f"exit {code}\n".encode() + solved.read_bytes()
    code, text = _run(["verify", str(solved), "--instance", tiny])
    got["verify_tiny.txt"] = f"exit {code}\n{text}".replace(str(work), "WORK").encode()
    for fmt, ending in EXPORTS.items():
        out = work / f"export_{fmt}{ending}"
        code, text = _run(["export", str(solved), "--format", fmt, "--instance", tiny, "-o", str(out)])
        text = text.replace(str(work), "WORK")
        got[f"export_tiny_{fmt}{ending}"] = f"exit {code}\n{text}".encode() + (out.read_bytes() if out.exists() else b"")
    solved_ckpt = work / "tiny_checkpoint.json"
    code, _ = _run(["solve", tiny, "--apply", "checkpoint", "-o", str(solved_ckpt)])
    got["solve_tiny_checkpoint.json"] = f"exit {code}\n".encode() + solved_ckpt.read_bytes()
    out = work / "export_maxtext_checkpoint.json"
    code, text = _run(["export", str(solved_ckpt), "--format", "maxtext", "--instance", tiny, "-o", str(out)])
    text = text.replace(str(work), "WORK")
    got["export_tiny_checkpoint_maxtext.json"] = f"exit {code}\n{text}".encode() + (out.read_bytes() if out.exists() else b"")
    return got


@pytest.fixture(scope="module")
def current(tmp_path_factory) -> dict[str, bytes]:
    return outputs(tmp_path_factory.mktemp("golden"))


def test_the_golden_set_is_complete(current):
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(current)


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.iterdir()) if GOLDEN.is_dir() else [])
def test_output_matches_its_golden_file(current, name):
    want = (GOLDEN / name).read_bytes()
    got = current.get(name)
    assert got is not None, f"{name}: no longer produced"
    # compare digests: a pytest diff of two large byte strings takes minutes
    import hashlib

    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(want).hexdigest(), (
        f"{name} changed: python tests/test_golden.py --write rewrites the golden files (say why in the commit)")


if __name__ == "__main__":  # python tests/test_golden.py --write [DIR]
    if len(sys.argv) < 2 or sys.argv[1] != "--write":
        sys.exit("usage: python tests/test_golden.py --write [DIR]")
    import tempfile

    target = Path(sys.argv[2]) if len(sys.argv) > 2 else GOLDEN
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for fname, data in outputs(Path(tmp)).items():
            (target / fname).write_bytes(data)
            print(f"wrote {target / fname}")
