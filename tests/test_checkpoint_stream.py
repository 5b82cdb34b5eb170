"""The streaming DCP permutation: DeepSeek-V3's Megatron key layout (MTP, dp_reshardable buckets),
TorchTitan's expert-parallel chunks, parallel workers, resume after a failure, and a memory
ceiling that does not grow with the checkpoint.

The expected checkpoints are computed here by indexing the source tensors (not by the code under
test); the synthetic checkpoints come from ``benchmarks/checkpoint_stream.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

from benchmarks.checkpoint_stream import Shape, _Writer, permutation_doc, write_checkpoint  # noqa: E402
from placement import checkpoint as ck  # noqa: E402
from placement.consumers.checkpoint import dcp as ck_dcp  # noqa: E402
from placement.core.model import InvalidInputError  # noqa: E402
from placement.core.permutation import PERMUTATION_KIND, PERMUTATION_VERSION  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = Shape(moe_layers=2, dense_layers=1, hidden=16, moe_ffn=8, dense_ffn=16, experts=8, ep=4, vocab=32)


def _read_all(path: Path) -> tuple[dict, dict]:
    """(tensors, objects' bytes) of a DCP directory, whole, read with torch's own loader."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata()
    tensors = {k: torch.zeros(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    objects = {k: None for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}

    class Raw(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            objects[read_item.dest_index.fqn] = value.read()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({**tensors, **{k: b"" for k in objects}}, storage_reader=dcp.FileSystemReader(str(path)),
                 planner=Raw(flatten_state_dict=False), no_dist=True)
    return tensors, objects


def _expected_megatron(src_t: dict, src_o: dict, layout: dict, doc: dict, s: Shape) -> tuple[dict, dict]:
    perms = {int(k): v for k, v in doc["layers"].items()}
    L = s.num_layers
    want = {}
    for key, t in src_t.items():
        new = t.clone()
        if key.startswith(("decoder.layers.mlp.experts.experts.", "decoder.layers.mlp.router.")):
            for layer in range(s.dense_layers, L):
                new[layer] = t[layer][torch.tensor(perms[layer])]
        elif key.startswith(("mtp.layers.0.transformer_layer.mlp.experts.experts.", "mtp.layers.0.transformer_layer.mlp.router.")):
            new = t[torch.tensor(perms[L])]
        want[key] = new
    # buckets: an expert's slices come from its source expert's; router rows are permuted in place
    fields = layout["fields"]
    rows = [dict(zip(fields, r)) for r in layout["params"]]
    where = {(r["family"], r["layer"], r["expert"]): r for r in rows}

    def bucket_key(r: dict, state: str) -> str:
        return (f"chained_{r['chain']}.optimizer.distributed.dp_group_idx_{r['dp']}.gbuf_idx_{r['gbuf']}."
                f"dtype_{r['dtype']}.bucket_idx_{r['bucket']}.{state}")

    for r in rows:
        if r["layer"] not in perms:
            continue
        for state in ("param", "exp_avg", "exp_avg_sq"):
            key = bucket_key(r, state)
            seg = slice(r["start"], r["start"] + r["numel"])
            if r["expert"] is not None:
                src = where[(r["family"], r["layer"], perms[r["layer"]][r["expert"]])]
                want[key][seg] = src_t[bucket_key(src, state)][src["start"]: src["start"] + src["numel"]]
            elif r["router"]:
                block = src_t[key][seg].reshape(s.experts, -1)
                want[key][seg] = block[torch.tensor(perms[r["layer"]])].reshape(-1)
    objects = {}
    for key, value in src_o.items():
        objects[key] = value
        if "_extra_state/shard_" in key:
            base, _, tail = key.partition("/shard_")
            off, _, shape = tail.partition("_")
            parts = [int(x) for x in off.split(".")]
            if key.startswith("mtp."):
                parts[0] = perms[L][parts[0]]
            else:
                parts[1] = perms[parts[0]][parts[1]]
            objects[key] = src_o[f"{base}/shard_{'.'.join(map(str, parts))}_{shape}"]
    return want, objects


def _write(tmp_path: Path, s: Shape = SMALL) -> tuple[Path, Path, dict]:
    src = tmp_path / "src"
    layout = write_checkpoint(src, s, random=True)
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    return src, tmp_path / "layout.json", layout


def test_megatron_dsv3_layout_with_mtp_and_dp_reshardable_buckets_is_permuted_exactly(tmp_path):
    src, layout_path, layout = _write(tmp_path)
    doc = permutation_doc(SMALL, seed=3)
    stats = ck.DcpStats()
    changed = ck.permute_dcp(src, tmp_path / "dst", doc, bucket_layout=layout_path, workers=2, cache_bytes=0, stats=stats)
    assert stats.files_done == stats.files_total == SMALL.ep and stats.finalized
    src_t, src_o = _read_all(src)
    got_t, got_o = _read_all(tmp_path / "dst")
    want_t, want_o = _expected_megatron(src_t, src_o, layout, doc, SMALL)
    assert set(got_t) == set(want_t) and set(got_o) == set(want_o)
    for key, t in want_t.items():
        assert torch.equal(got_t[key], t), key
    assert got_o == want_o
    assert "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight" in changed
    assert any(k.startswith("chained_1.optimizer.distributed.dp_group_idx_3.") for k in changed)
    assert sorted(os.listdir(tmp_path)) == ["dst", "layout.json", "src"]  # no partial directory left
    for name in ("metadata.json", "common.pt"):
        assert (tmp_path / "dst" / name).read_bytes() == (src / name).read_bytes()


def test_dp_reshardable_buckets_without_their_layout_are_refused_naming_the_key(tmp_path):
    src, _, _ = _write(tmp_path)
    with pytest.raises(InvalidInputError, match=r"chained_\d\.optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_0\..*bucket_layout"):
        ck.permute_dcp(src, tmp_path / "dst", permutation_doc(SMALL))
    assert not (tmp_path / "dst").exists() and not (tmp_path / ".dst.partial").exists()
    code = ck.main(["megatron-torch-dist", json.dumps(permutation_doc(SMALL)), str(src), str(tmp_path / "dst"), "--quiet"])
    assert code == 2


def test_the_command_line_takes_the_bucket_layout_and_workers(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PLACEMENT_PROGRESS", "1")  # draw the bar into the captured stream
    src, layout_path, _ = _write(tmp_path)
    (tmp_path / "perm.json").write_text(json.dumps(permutation_doc(SMALL, seed=1)))
    code = ck.main(["megatron-torch-dist", str(tmp_path / "perm.json"), str(src), str(tmp_path / "dst"),
                    "--bucket-layout", str(layout_path), "--workers", "1", "--cache-mb", "1"])
    assert code == 0
    err = capsys.readouterr().err
    assert "checkpoint: storage files" in err and "100%" in err  # the bytes-done bar


def test_torchtitan_expert_parallel_chunks_and_mtp_are_assembled_from_their_source_chunks(tmp_path):
    """Under EP a TorchTitan expert tensor is stored as E/ep-expert chunks: a permuted chunk takes
    rows from several source chunks (and from the MTP layer's own tensors)."""
    E, ep, H, F, layers = 8, 4, 6, 4, 2
    src = tmp_path / "src"
    src.mkdir()
    w = _Writer(src, ep)
    gen = torch.Generator().manual_seed(0)
    names = [f"layers.{l}.moe.experts.w1" for l in range(layers)] + ["mtp_layers.0.moe.experts.w1"]
    for base in names:
        for fqn in (base, f"optimizer.state.{base}.exp_avg"):
            for r in range(ep):
                w.tensor(r, fqn, (E, F, H), torch.float32, (r * E // ep, 0, 0), torch.randn(E // ep, F, H, generator=gen))
        router = base.replace("experts.w1", "router.gate.weight")
        w.tensor(0, router, (E, H), torch.float32, (0, 0), torch.randn(E, H, generator=gen))
    w.tensor(0, "tok_embeddings.weight", (5, H), torch.float32, (0, 0), torch.randn(5, H, generator=gen))
    w.close()
    perms = {0: [3, 7, 1, 5, 0, 2, 6, 4], 1: [7, 6, 5, 4, 3, 2, 1, 0], 2: [1, 0, 3, 2, 5, 4, 7, 6]}
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "torchtitan", "num_experts": E,
           "layers": {str(k): v for k, v in perms.items()}}
    ck.permute_dcp(src, tmp_path / "dst", doc, cache_bytes=0)
    a, _ = _read_all(src)
    b, _ = _read_all(tmp_path / "dst")
    for key, t in a.items():
        layer = 2 if key.startswith(("mtp_layers.", "optimizer.state.mtp_layers.")) else int(key.split("layers.")[1][0]) \
            if "layers." in key else None
        want = t if layer is None else t[torch.tensor(perms[layer])]
        assert torch.equal(b[key], want), key


def test_a_journal_entry_is_durable_only_after_the_file_it_records(tmp_path, monkeypatch):
    """A crash must not leave a journal entry (the resume skips its file) for a storage file whose
    data or rename is not on disk: file fsynced, renamed, its folder fsynced, then the entry written
    to a temporary, fsynced, renamed and the journal folder fsynced.  Recorded from os.fsync and
    os.replace (fsync'ed descriptors named through /proc/self/fd, so Linux only)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")
    src, layout_path, _ = _write(tmp_path)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b, *args, **kw):
        events.append(("replace", f"{os.path.realpath(a)} -> {os.path.realpath(b)}"))
        return real_replace(a, b, *args, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ck.permute_dcp(src, tmp_path / "dst", permutation_doc(SMALL, seed=5), bucket_layout=layout_path)
    monkeypatch.undo()
    tmp = os.path.realpath(tmp_path / ".dst.partial")
    entries = [i for i, (kind, what) in enumerate(events) if kind == "replace" and what.endswith(".distcp.json")]
    assert len(entries) == SMALL.ep
    for i in entries:
        temp, entry = events[i][1].split(" -> ")
        rel = os.path.basename(entry)[: -len(".json")]
        stored = next(k for k, (kind, what) in enumerate(events) if kind == "replace" and what.endswith(f"-> {tmp}/{rel}"))
        assert events.index(("fsync", f"{tmp}/{rel}.part")) < stored < events.index(("fsync", tmp), stored) < i
        assert ("fsync", temp) in events[stored:i]  # the entry's own bytes
        assert ("fsync", os.path.dirname(entry)) in events[i:]  # and its rename


def test_the_finished_checkpoint_is_renamed_into_place_only_after_its_files_are_on_disk(tmp_path, monkeypatch):
    """The last steps: ``.metadata`` written to a temporary, fsynced and renamed; the files copied
    beside the DCP data (metadata.json, common.pt) fsynced before their rename; the partial folder
    fsynced after the last of them (and the journal's removal), only then renamed to DST, and DST's
    parent fsynced after that rename.  Recorded from os.fsync and os.replace (Linux only)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")
    src, layout_path, _ = _write(tmp_path)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b, *args, **kw):
        events.append(("replace", f"{os.path.realpath(a)} -> {os.path.realpath(b)}"))
        return real_replace(a, b, *args, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dst = tmp_path / "dst"
    ck.permute_dcp(src, dst, permutation_doc(SMALL, seed=5), bucket_layout=layout_path)
    monkeypatch.undo()
    tmp, dst_real = os.path.realpath(tmp_path / ".dst.partial"), os.path.realpath(dst)
    (last,) = [i for i, e in enumerate(events) if e == ("replace", f"{tmp} -> {dst_real}")]
    assert last == max(i for i, (kind, _) in enumerate(events) if kind == "replace")
    # every file DST holds was fsynced (under its temporary name) and renamed before the move
    renamed = {what.split(" -> ")[1]: (i, what.split(" -> ")[0]) for i, (kind, what) in enumerate(events[:last])
               if kind == "replace"}
    side = sorted(p.name for p in src.iterdir() if not p.name.endswith(".distcp") and p.name != ".metadata")
    assert side == ["common.pt", "metadata.json"]
    for name in [".metadata", *side]:
        i, temp = renamed[f"{tmp}/{name}"]
        assert ("fsync", temp) in events[:i], name
    into_tmp = max(i for i, _ in renamed.values())
    assert ("fsync", tmp) in events[into_tmp:last]  # the renames inside the folder, before it moves
    assert ("fsync", str(tmp_path.resolve())) in events[last:]  # the move itself
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    for name in side:
        assert (dst / name).read_bytes() == (src / name).read_bytes()


def test_a_half_copied_side_file_is_copied_again_on_resume(tmp_path, monkeypatch):
    """A crash while copying metadata.json / common.pt leaves only ``NAME.part``: the rerun copies
    the file again instead of keeping a truncated one."""
    src, layout_path, _ = _write(tmp_path)
    doc = permutation_doc(SMALL, seed=5)
    real = ck_dcp._copy_durably

    def crash(source, target):
        Path(str(target) + ".part").write_bytes((source.read_bytes())[:3])  # half a copy
        raise OSError("power cut (injected)")

    monkeypatch.setattr(ck_dcp, "_copy_durably", crash)
    dst = tmp_path / "dst"
    with pytest.raises(OSError, match="injected"):
        ck.permute_dcp(src, dst, doc, bucket_layout=layout_path)
    partial = tmp_path / ".dst.partial"
    assert not dst.exists() and not any(p.name in ("common.pt", "metadata.json") for p in partial.iterdir())
    monkeypatch.setattr(ck_dcp, "_copy_durably", real)
    stats = ck.DcpStats()
    ck.permute_dcp(src, dst, doc, bucket_layout=layout_path, stats=stats)
    assert stats.files_skipped == SMALL.ep and stats.finalized
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    for name in ("common.pt", "metadata.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()


def test_an_interrupted_run_resumes_from_its_journal_and_writes_the_same_bytes(tmp_path, monkeypatch):
    src, layout_path, _ = _write(tmp_path)
    doc = permutation_doc(SMALL, seed=5)
    clean = tmp_path / "clean"
    ck.permute_dcp(src, clean, doc, bucket_layout=layout_path)
    real = ck_dcp._permute_file
    calls = []

    def failing(spec, rel):
        calls.append(rel)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return real(spec, rel)

    monkeypatch.setattr(ck_dcp, "_permute_file", failing)
    dst = tmp_path / "dst"
    with pytest.raises(OSError, match="injected"):
        ck.permute_dcp(src, dst, doc, bucket_layout=layout_path)
    assert not dst.exists()
    journal = tmp_path / ".dst.partial" / ck_dcp.JOURNAL
    assert len([p for p in journal.iterdir() if p.name.endswith(".distcp.json")]) == 1
    # another permutation may not take over the partial directory
    with pytest.raises(InvalidInputError, match="partial output of another permutation"):
        ck.permute_dcp(src, dst, permutation_doc(SMALL, seed=6), bucket_layout=layout_path)
    monkeypatch.setattr(ck_dcp, "_permute_file", real)
    stats = ck.DcpStats()
    ck.permute_dcp(src, dst, doc, bucket_layout=layout_path, stats=stats)
    assert stats.files_skipped == 1 and stats.files_done == SMALL.ep - 1
    assert sorted(os.listdir(dst)) == sorted(os.listdir(clean))
    for name in os.listdir(clean):
        if name.endswith(".distcp"):
            assert (dst / name).read_bytes() == (clean / name).read_bytes(), name
    assert _read_all(dst)[0].keys() == _read_all(clean)[0].keys()


_PEAK = """
import json, resource, sys
sys.path.insert(0, {root!r})
from placement.consumers.checkpoint import permute_dcp
permute_dcp(sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read()), bucket_layout=sys.argv[4], cache_bytes=4 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_peak_memory_does_not_grow_with_the_checkpoint(tmp_path):
    """A ~190 MB and a ~3 MB checkpoint of the same layout: the permuting process's peak resident
    memory differs by far less than the checkpoints do (the whole-checkpoint reader it replaces
    grew by the checkpoint's size)."""
    peaks, sizes = [], []
    for name, shape in (("small", Shape(moe_layers=1, hidden=32, moe_ffn=16, dense_ffn=32, experts=64, vocab=256)),
                        ("large", Shape(moe_layers=2, hidden=256, moe_ffn=128, dense_ffn=256, experts=64, vocab=256))):
        root = tmp_path / name
        root.mkdir()
        layout = write_checkpoint(root / "src", shape)
        (root / "layout.json").write_text(json.dumps(layout))
        (root / "perm.json").write_text(json.dumps(permutation_doc(shape)))
        sizes.append(sum(p.stat().st_size for p in (root / "src").iterdir()))
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK.format(root=str(ROOT)), str(root / "src"), str(root / "dst"), str(root / "perm.json"),
             str(root / "layout.json")], capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks.append(int(proc.stdout.split()[-1]))
    assert sizes[1] > 150e6 and sizes[0] < 10e6
    assert peaks[1] - peaks[0] < 0.15 * (sizes[1] - sizes[0]), (peaks, sizes)


def test_in_memory_mtp_keys_of_both_megatron_releases_are_layer_num_layers():
    """0.16.1 names the MTP inner layer ``transformer_layer``, core_v0.19 / main ``mtp_model_layer``:
    both are permuted as layer ``num_layers + j`` (2 decoder layers here), router and experts."""
    E, H = 4, 3
    perm = [2, 3, 0, 1]
    for inner in ("transformer_layer", "mtp_model_layer"):
        sd = {"decoder.layers.1.self_attention.linear_proj.weight": torch.zeros(H, H),
              f"mtp.layers.0.{inner}.mlp.router.weight": torch.arange(E * H, dtype=torch.float32).reshape(E, H)}
        for e in range(E):
            sd[f"mtp.layers.0.{inner}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.full((2, H), float(e))
        doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "megatron", "num_experts": E,
               "layers": {"2": perm}}
        out = ck.apply_exported_permutation(sd, doc, only_present=True)
        assert torch.equal(out[f"mtp.layers.0.{inner}.mlp.router.weight"], sd[f"mtp.layers.0.{inner}.mlp.router.weight"][perm])
        for p, old in enumerate(perm):
            assert torch.equal(out[f"mtp.layers.0.{inner}.mlp.experts.local_experts.{p}.linear_fc1.weight"],
                               torch.full((2, H), float(old)))

