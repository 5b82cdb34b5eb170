"""``torch.distributed.checkpoint`` directories, streamed: Megatron-Core ``torch_dist`` and TorchTitan.

A permutation only moves data between positions of the same shape, so the permuted checkpoint has
the source's tensors, chunks and storage files: each storage file ``F.distcp`` of the source
becomes a file ``F.distcp`` of the destination holding the same items in the same order.  An item
that holds no moved expert is copied byte for byte (in pieces of :data:`COPY_PIECE_BYTES`); a
chunk that does is assembled from the source chunks its experts come from (read once each through
a cache of at most ``cache_bytes``) and written with ``torch.save`` as DCP's own writer does; a
per-expert object (Megatron's ``_extra_state/shard_L.E_...``) takes the bytes of its source
expert's object.  Only the storage offsets and lengths in ``.metadata`` change.

So the memory of a worker is bounded by ``cache_bytes`` plus the largest chunk, whatever the size
of the checkpoint, and the files are independent tasks: they run on ``workers`` local processes or
on any :class:`placement.core.executor.Executor` (:mod:`placement.core.ray_executor`: hosts sharing the
file system), or are split over the ranks of a ``torch.distributed`` job (``distributed=True``).

Atomic and resumable: everything is written under ``.DST.partial`` beside the destination; a
finished storage file is renamed into place and then recorded in the journal
(``.DST.partial/.placement-journal/``); a rerun with the same inputs skips the recorded files; the
last step writes ``.metadata`` and renames the directory to ``DST``.  Every rename follows the
fsync of what it names and is followed by the fsync of its folder (the storage files, the journal
entries, ``.metadata``, the copied ``metadata.json`` / ``common.pt``, and ``DST`` itself), so after
a crash the journal never names a file that is not on disk.

Where each chunk's data comes from (the plan, built from ``.metadata`` before anything is written)
is :mod:`placement.consumers.checkpoint._dcp_plan`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from placement.consumers.checkpoint._dcp_plan import _Plan, _Spec
from placement.consumers.checkpoint._entries import _doc_groups
from placement.formats import atomic_write_bytes, atomic_write_text, fsync_dir
from placement.core.model import InvalidInputError
from placement.core.permutation import check_permutation, read_expert_permutation

__all__ = ["permute_dcp", "DcpStats", "COPY_PIECE_BYTES", "DEFAULT_CACHE_BYTES"]

COPY_PIECE_BYTES = 16 << 20  # raw copies go through a buffer of this size
DEFAULT_CACHE_BYTES = 64 << 20  # source chunks kept for reuse by a worker
JOURNAL = ".placement-journal"
_DONE = "done.json"


@dataclass
class DcpStats:
    """What one :func:`permute_dcp` call did (for progress and the benchmark).

    Attributes
    ----------
    files_total, files_done, files_skipped : storage files in the checkpoint / written by this
        call / found finished in the journal (a resumed run).
    bytes_read, bytes_written : bytes of storage files read / written by this call.
    changed : entry names that were permuted or renamed, sorted.
    finalized : this call wrote ``.metadata`` and renamed the directory into place.
    """

    files_total: int = 0
    files_done: int = 0
    files_skipped: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    changed: list[str] = field(default_factory=list)
    finalized: bool = False


# ---------------------------------------------------------------------------------------------
# One storage file
# ---------------------------------------------------------------------------------------------
_PLANS: dict[str, _Plan] = {}  # per worker process: the plan of the spec being run


def _plan_for(spec: _Spec) -> _Plan:
    key = hashlib.sha256(pickle.dumps(spec)).hexdigest()
    if key not in _PLANS:
        _PLANS.clear()
        _PLANS[key] = _Plan(_read_metadata(Path(spec.src)), spec)
    return _PLANS[key]


def _read_metadata(src: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(src)).read_metadata()


class _Cache:
    """Source chunks read from disk, least recently used dropped beyond ``limit_bytes``."""

    def __init__(self, src: Path, plan: _Plan, limit_bytes: int) -> None:
        self.src, self.plan, self.limit = src, plan, limit_bytes
        self.items: OrderedDict[tuple[str, tuple[int, ...]], Any] = OrderedDict()
        self.nbytes = 0
        self.bytes_read = 0

    def chunk(self, fqn: str, offsets: tuple[int, ...]) -> Any:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        key = (fqn, offsets)
        t = self.items.get(key)
        if t is not None:
            self.items.move_to_end(key)
            return t
        info = self.plan.md.storage_data[MetadataIndex(fqn, offsets)]
        if getattr(info, "transform_descriptors", None):
            raise InvalidInputError(f"{fqn}: stored with transforms {info.transform_descriptors}; not supported")
        with open(self.src / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        self.bytes_read += len(data)
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        del data
        size = t.numel() * t.element_size()
        while self.items and self.nbytes + size > self.limit:
            _, old = self.items.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
        if size <= self.limit:
            self.items[key] = t
            self.nbytes += size
        return t


def _assemble(plan: _Plan, cache: _Cache, fqn: str, chunk: Any) -> Any | None:
    """The permuted content of one stored chunk, or None when it is unchanged."""
    import torch

    off = tuple(int(x) for x in chunk.offsets)
    size = tuple(int(x) for x in chunk.sizes)
    pieces = plan.tensors[fqn](off, size)
    if all(src == fqn and s_off == d_off for d_off, _, src, s_off in pieces):
        return None
    dtype = plan.md.state_dict_metadata[fqn].properties.dtype
    out = torch.empty(size, dtype=dtype)
    for d_off, d_size, src, s_off in pieces:
        # the piece's box in source coordinates, and where it lands in the output chunk
        for c in plan.chunks.overlapping(src, s_off, d_size):
            c_off = tuple(int(x) for x in c.offsets)
            lo = [max(s, co) for s, co in zip(s_off, c_off)]
            hi = [min(s + n, co + int(cs)) for s, n, co, cs in zip(s_off, d_size, c_off, c.sizes)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            t = cache.chunk(src, c_off)
            src_view = t[tuple(slice(l - co, h - co) for l, h, co in zip(lo, hi, c_off))]
            dst_view = out[tuple(slice(l - s + d - o, h - s + d - o) for l, h, s, d, o in zip(lo, hi, s_off, d_off, off))]
            dst_view.copy_(src_view)
    return out


def _permute_file(spec: _Spec, rel: str) -> dict[str, Any]:
    """Write ``tmp/rel`` from ``src/rel``; return (and journal) its items' new storage records."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # copies of small pieces: the intra-op pool only spins (one file per worker)
    try:
        return _permute_file_body(spec, rel)
    finally:
        torch.set_num_threads(threads)


def _permute_file_body(spec: _Spec, rel: str) -> dict[str, Any]:
    import torch

    plan = _plan_for(spec)
    src, tmp = Path(spec.src), Path(spec.tmp)
    journal = tmp / JOURNAL / (rel + ".json")
    if journal.is_file():
        return {**json.loads(journal.read_text()), "skipped": True}
    items = sorted(
        ((idx, info) for idx, info in plan.md.storage_data.items() if info.relative_path == rel), key=lambda x: x[1].offset
    )
    cache = _Cache(src, plan, spec.cache_bytes)
    records = []
    part = tmp / (rel + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(src / rel, "rb") as fin, open(part, "wb") as fout:
        for idx, info in items:
            start = fout.tell()
            new = None
            if idx.offset is not None and idx.fqn in plan.tensors:
                new = _assemble(plan, cache, idx.fqn, plan.chunks.exact(idx.fqn, tuple(int(x) for x in idx.offset)))
            descriptors = getattr(info, "transform_descriptors", None)
            if new is not None:
                torch.save(new, fout)
                descriptors = None
                del new
            elif idx.offset is None and idx.fqn in plan.objects:
                source = plan.md.storage_data[_object_index(plan, plan.objects[idx.fqn])]
                with open(src / source.relative_path, "rb") as fobj:
                    _copy_range(fobj, fout, source.offset, source.length)
                cache.bytes_read += source.length
                descriptors = getattr(source, "transform_descriptors", None)
            else:
                _copy_range(fin, fout, info.offset, info.length)
                cache.bytes_read += info.length
            length = fout.tell() - start
            written += length
            records.append([idx.fqn, None if idx.offset is None else list(idx.offset), start, length, descriptors])
        fout.flush()
        os.fsync(fout.fileno())
    os.replace(part, tmp / rel)
    fsync_dir((tmp / rel).parent)  # the rename is on disk before the journal says the file is done
    result = {"file": rel, "items": records, "bytes_read": cache.bytes_read, "bytes_written": written}
    journal.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(journal, json.dumps(result))  # fsyncs the entry and its folder
    return result


def _object_index(plan: _Plan, fqn: str) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(fqn)


def _copy_range(fin: Any, fout: Any, offset: int, length: int) -> None:
    fin.seek(offset)
    left = length
    while left > 0:
        data = fin.read(min(left, COPY_PIECE_BYTES))
        if not data:
            raise InvalidInputError(f"{getattr(fin, 'name', 'a storage file')}: truncated (item at {offset}, {length} bytes)")
        fout.write(data)
        left -= len(data)


def _run_task(task: tuple[_Spec, str]) -> dict[str, Any]:
    return _permute_file(*task)


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------
def permute_dcp(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    doc: Mapping[str, Any] | str,
    *,
    stack: Literal["megatron", "torchtitan"] | None = None,
    num_groups: int | None = None,
    keep_router: bool = False,
    num_layers: int | None = None,
    bucket_layout: Mapping[str, Any] | str | os.PathLike | None = None,
    workers: int = 1,
    executor: Any = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    distributed: bool = False,
    progress: Callable[[int, int], None] | None = None,
    stats: DcpStats | None = None,
) -> list[str]:
    """Permute a ``torch.distributed.checkpoint`` directory ``src`` into a new directory ``dst``, streamed.

    Megatron-Core ``torch_dist`` (``stack="megatron"``; ``metadata.json`` and ``common.pt`` are
    copied unchanged), Megatron FSDP's ``fsdp_dtensor`` (``stack="megatron"``, recognised by its
    ``model.`` names: per-expert entries by name, group metadata objects included) or TorchTitan
    (``stack="torchtitan"``).  Per-expert tensors (weights,
    router rows, the router's bias and counters, their optimizer moments and master weights, MTP
    layers' too), Megatron's per-expert ``_extra_state`` objects and, with ``bucket_layout``,
    Megatron's ``dp_reshardable`` distributed-optimizer buckets are permuted; everything else is
    copied byte for byte.  See the module docstring for the streaming, memory and resume rules.

    Parameters
    ----------
    src, dst : path
        Source checkpoint directory; destination, which must not exist.
    doc : permutation document, its JSON text, or the path of its file
    stack : "megatron" or "torchtitan"; the document's by default
    num_groups : int, optional
        Overrides the document's group rule (1: no group constraint).
    keep_router : bool
        Move the experts only, for :mod:`placement.consumers.runtime` (see :func:`permute_entries`); also
        when the document says ``apply: runtime``.
    num_layers : int, optional
        Decoder layers (MTP layer ``J`` is layer ``num_layers + J``); by default the document's
        ``num_layers`` (``placement export`` writes it), else read from the checkpoint (Megatron:
        the stacked layer axis, which must agree with the document's; TorchTitan: the
        ``layers.N`` names).
    bucket_layout : mapping, JSON path, optional
        Megatron-Core's ``dp_reshardable`` optimizer: where each parameter lies in the buckets,
        as :func:`placement.consumers.checkpoint.write_megatron_bucket_layout` records it.
    workers : int
        Local processes (ignored when ``executor`` is given).
    executor : placement.core.executor.Executor, optional
        Runs the per-file tasks (e.g. a Ray executor over hosts sharing the file system).
    cache_bytes : int
        Bytes of source chunks a worker keeps for reuse (the memory ceiling, with the largest chunk).
    distributed : bool
        Split the files over the ranks of the initialised ``torch.distributed`` job; rank 0 writes
        ``.metadata`` and renames after a barrier.
    progress : callable(done, total), optional
        :data:`placement.core.progress.ProgressCallback`: bytes of the source's storage files finished
        (this call's and the journal's) and in all, after every file.
    stats : DcpStats, optional
        Filled with what the call did.

    Returns
    -------
    list of str
        The entry names that were permuted or renamed, sorted.

    Raises
    ------
    InvalidInputError
        ``src`` is not a DCP directory, ``dst`` exists, an entry cannot be permuted, or a
        partial directory of another permutation is in the way.
    InfeasibleError
        A permutation breaks expert groups of a group-limited model.
    """
    layers, meta = read_expert_permutation(doc if isinstance(doc, str) else dict(doc))
    chosen = stack or meta.get("stack")
    if chosen not in ("megatron", "torchtitan"):
        raise InvalidInputError(f"stack: expected megatron or torchtitan, found {chosen!r}")
    keep_router = keep_router or meta.get("apply") == "runtime"  # a document for placement.consumers.runtime's map
    groups = 1 if keep_router else (_doc_groups(meta) if num_groups is None else num_groups)
    if num_layers is None and isinstance(meta.get("num_layers"), int):
        num_layers = int(meta["num_layers"])  # placement export writes the model's decoder layers
    perms = tuple(sorted((int(l), tuple(int(x) for x in check_permutation(int(l), p, groups))) for l, p in layers.items()))
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not (src / ".metadata").is_file():
        raise InvalidInputError(f"{src}: not a torch.distributed.checkpoint directory (no .metadata)")
    if dst.exists():
        raise InvalidInputError(f"{dst}: exists; refusing to overwrite")
    if cache_bytes < 0:
        raise InvalidInputError(f"cache_bytes: expected >= 0, found {cache_bytes}")
    layout = None
    if bucket_layout is not None:
        from placement.consumers.checkpoint.buckets import read_bucket_layout

        layout = read_bucket_layout(bucket_layout)
    tmp = dst.parent / f".{dst.name}.partial"
    form = _megatron_form(src) if chosen == "megatron" else "torch_dist"
    spec = _Spec(str(src), str(tmp), chosen, perms, keep_router, num_layers, layout, int(cache_bytes), form)
    plan = _plan_for(spec)  # refuses what it cannot permute, before anything is written
    plan.check_complete()
    stats = stats if stats is not None else DcpStats()
    stats.changed = sorted(plan.changed)
    rank, world = 0, 1
    if distributed:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InvalidInputError("distributed=True: torch.distributed is not initialised")
        rank, world = dist.get_rank(), dist.get_world_size()
    manifest = json.dumps({"src": str(src), "stack": chosen, "layers": perms, "keep_router": keep_router,
                           "num_layers": plan.num_layers, "layout": hashlib.sha256(pickle.dumps(layout)).hexdigest()})
    if rank == 0:
        _open_partial(tmp, manifest)
    if distributed:
        dist.barrier()
        if rank != 0:
            _open_partial(tmp, manifest)
    files = sorted({info.relative_path for info in plan.md.storage_data.values()})
    sizes = {rel: (src / rel).stat().st_size for rel in files}
    total = sum(sizes.values())
    stats.files_total = len(files)
    mine = [rel for i, rel in enumerate(_balanced(files, sizes)) if i % world == rank]
    todo = [rel for rel in mine if not (tmp / JOURNAL / (rel + ".json")).is_file()]
    stats.files_skipped = len(mine) - len(todo)
    done = [sum(sizes[rel] for rel in mine if rel not in todo)]
    if progress is not None:
        progress(done[0], total)

    def account(result: Mapping[str, Any]) -> None:
        _account(stats, result)
        done[0] += sizes[str(result["file"])]
        if progress is not None:
            progress(done[0], total)

    own_executor = None
    if executor is not None or (workers > 1 and len(todo) > 1):
        _PLANS.clear()  # the workers build their own; this process re-reads the metadata at the end
        del plan
    if executor is None and workers > 1 and len(todo) > 1:
        from placement.core.executor import make_executor

        executor = own_executor = make_executor("local", workers=min(workers, len(todo)))
    try:
        if executor is None:
            for rel in todo:
                account(_permute_file(spec, rel))
        else:
            for result in executor.map(_run_task, [(spec, rel) for rel in todo]):
                account(result)
    finally:
        if own_executor is not None:
            own_executor.close()
    if distributed:
        dist.barrier()
        if rank == 0:
            _finalize(src, dst, tmp, files)
            stats.finalized = True
        dist.barrier()
    else:
        _finalize(src, dst, tmp, files)
        stats.finalized = True
    return stats.changed


def _megatron_form(src: Path) -> str:
    """``fsdp_dtensor`` for Megatron FSDP's checkpoints (``torch.distributed.checkpoint.save`` of
    ``{"model": ..., "optimizer": ...}``: names under ``model.``), else ``torch_dist``."""
    md = _read_metadata(src)
    return "fsdp_dtensor" if any(str(f).startswith("model.") for f in md.state_dict_metadata) else "torch_dist"


def _account(stats: DcpStats, result: Mapping[str, Any]) -> None:
    if not result.get("skipped"):
        stats.files_done += 1
        stats.bytes_read += int(result["bytes_read"])
        stats.bytes_written += int(result["bytes_written"])
    else:
        stats.files_skipped += 1


def _balanced(files: Sequence[str], sizes: Mapping[str, int]) -> list[str]:
    """Files largest first (ties by name): dealt round-robin, the ranks' shares stay even."""
    return sorted(files, key=lambda rel: (-sizes[rel], rel))


def _open_partial(tmp: Path, manifest: str) -> None:
    """Create ``tmp`` (or resume it when its manifest is this call's)."""
    mark = tmp / JOURNAL / "manifest.json"
    if tmp.exists():
        if mark.is_file() and mark.read_text(encoding="utf-8") == manifest:
            return
        raise InvalidInputError(f"{tmp}: a partial output of another permutation; remove it to start again")
    (tmp / JOURNAL).mkdir(parents=True, exist_ok=True)
    atomic_write_text(mark, manifest)


def _finalize(src: Path, dst: Path, tmp: Path, files: Sequence[str]) -> None:
    """All files journaled: write ``.metadata`` with the new storage records and rename into place."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage: dict[Any, Any] = {}
    for rel in files:
        journal = tmp / JOURNAL / (rel + ".json")
        if not journal.is_file():
            raise InvalidInputError(f"{tmp}: {rel} is not finished; rerun to resume")
        for fqn, offset, start, length, descriptors in json.loads(journal.read_text())["items"]:
            index = MetadataIndex(fqn, offset)
            storage[index] = _StorageInfo(rel, start, length, descriptors)
    md = _read_metadata(src)
    md.storage_data = {idx: storage[idx] for idx in md.storage_data}
    atomic_write_bytes(tmp / ".metadata", pickle.dumps(md))  # temporary, fsync, rename, fsync the folder
    for child in src.iterdir():  # metadata.json, common.pt, ...: not part of the DCP data
        if child.name != ".metadata" and child.name not in files and not (tmp / child.name).exists():
            _copy_durably(child, tmp / child.name)
    shutil.rmtree(tmp / JOURNAL)
    fsync_dir(tmp)  # the copies' renames and the journal's removal are on disk before the folder moves
    os.replace(tmp, dst)
    fsync_dir(dst.parent)  # and the move itself


def _copy_durably(source: Path, target: Path) -> None:
    """Copy the file or folder ``source`` to ``target`` through ``target.part``: every copied file
    fsynced, then renamed, so a ``target`` that exists is whole (a resumed run keeps it)."""
    part = target.with_name(target.name + ".part")
    if part.is_dir():
        shutil.rmtree(part)
    elif part.exists():
        part.unlink()
    if source.is_dir():
        shutil.copytree(source, part)
        for root, _, names in os.walk(part):
            for name in names:
                _fsync_file(Path(root) / name)
            fsync_dir(Path(root))
    else:
        shutil.copy2(source, part)
        _fsync_file(part)
    os.replace(part, target)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
