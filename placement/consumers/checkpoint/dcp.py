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
last step writes ``.metadata`` and renames the directory to ``DST``.
"""

from __future__ import annotations

import bisect
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

from placement.consumers.checkpoint._entries import _doc_groups
from placement.consumers.checkpoint._rules import BUCKET, SHARD, UNKNOWN_MSG, classify, resolve_layer
from placement.formats import atomic_write_text, fsync_dir
from placement.core.model import InvalidInputError
from placement.core.permutation import PARAMETER_NAMES, check_permutation, read_expert_permutation

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


@dataclass(frozen=True)
class _Spec:
    """Everything a worker needs to permute one storage file (picklable, a few KB)."""

    src: str
    tmp: str
    stack: str
    layers: tuple[tuple[int, tuple[int, ...]], ...]
    keep_router: bool
    num_layers: int | None
    bucket_layout: tuple[tuple[Any, ...], ...] | None
    cache_bytes: int
    form: str = "torch_dist"  # or "fsdp_dtensor" (Megatron FSDP)


# ---------------------------------------------------------------------------------------------
# The plan: for every entry, where each of its chunks' data comes from
# ---------------------------------------------------------------------------------------------
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, sizes)
Piece = tuple[tuple[int, ...], tuple[int, ...], str, tuple[int, ...]]  # dst offsets, sizes, src fqn, src offsets


class _Plan:
    """Where every chunk of the permuted checkpoint takes its data from (built from ``.metadata``).

    Raises :class:`InvalidInputError` for an entry it cannot permute, before anything is written.
    """

    def __init__(self, md: Any, spec: _Spec) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        self.md = md
        self.spec = spec
        self.perms = {layer: list(perm) for layer, perm in spec.layers}
        self.tensors: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], list[Piece]]] = {}
        self.objects: dict[str, str] = {}  # target object fqn -> source object fqn
        self.changed: set[str] = set()
        self.routers: set[int] = set()
        self.weights: set[int] = set()
        num_layers = spec.num_layers
        found = _infer_dcp_num_layers(spec.stack, md.state_dict_metadata, spec.form)
        if num_layers is not None and found is not None and spec.form == "torch_dist" and spec.stack == "megatron" \
                and found != num_layers:
            raise InvalidInputError(
                f"num_layers: the permutation says {num_layers} decoder layers, the checkpoint's stacked "
                f"decoder.layers.* tensors hold {found}"
            )
        self.num_layers = num_layers if num_layers is not None else found
        self.layout = _BucketLayout(spec.bucket_layout) if spec.bucket_layout is not None else None
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                self._plan_tensor(fqn, tuple(int(x) for x in item.size))
            elif isinstance(item, BytesStorageMetadata):
                self._plan_object(fqn)
        self.chunks = _ChunkIndex(md)

    # tensors ----------------------------------------------------------------------------------
    def _plan_tensor(self, fqn: str, shape: tuple[int, ...]) -> None:
        hit = classify(self.spec.stack, self.spec.form, fqn)
        if hit is None:
            return
        if hit.kind == "bucket":
            if self.layout is None:
                raise InvalidInputError(
                    f"{fqn}: distributed-optimizer bucket state (Megatron-Core's dp_reshardable layout), whose expert "
                    "rows only the optimizer's bucket layout locates: pass bucket_layout (write_megatron_bucket_layout)"
                )
            bucket_pieces = self.layout.plan(fqn, self.perms, keep_router=self.spec.keep_router)
            if bucket_pieces is not None:
                self.tensors[fqn] = bucket_pieces
                self.changed.add(fqn)
            return
        if hit.kind in ("unknown", "extra", "grouped"):
            raise InvalidInputError(f"{fqn}: {UNKNOWN_MSG}; refusing to permute the checkpoint without it")
        if hit.optimizer and len(shape) == 0:
            return
        if self.spec.keep_router and not hit.weight and hit.kind == "axis":
            return
        role = self.routers if hit.router else self.weights if hit.weight else None
        if hit.kind == "named":
            self._plan_named(fqn, hit, shape, role)
            return
        axis, la = hit.axis if hit.axis >= 0 else len(shape) + hit.axis, hit.layer_axis
        fixed = None if la is not None else resolve_layer(hit, 0, self.num_layers, fqn)
        layers = [fixed] if fixed is not None else list(range(shape[la] if la is not None and la < len(shape) else 0))
        todo = {l: self.perms[l] for l in layers if l in self.perms}
        if not todo:
            return
        for l, perm in todo.items():
            if len(shape) <= axis or shape[axis] != len(perm):
                raise InvalidInputError(f"{fqn}: expected {len(perm)} experts along dim {axis}, found shape {shape}")
        if not hit.optimizer and role is not None:
            role.update(todo)
        self.changed.add(fqn)
        perms = self.perms

        def pieces(off: tuple[int, ...], size: tuple[int, ...]) -> list[Piece]:
            out: list[Piece] = []
            lays: Sequence[int] = [int(fixed or 0)] if la is None else range(off[la], off[la] + size[la])
            for l in lays:
                perm = perms.get(l)
                base_off, base_size = list(off), list(size)
                if la is not None:
                    base_off[la], base_size[la] = l, 1
                lo, hi = off[axis], off[axis] + size[axis]
                p = lo
                while p < hi:
                    s = perm[p] if perm is not None else p
                    q = p + 1
                    while q < hi and (perm[q] if perm is not None else q) == s + (q - p):
                        q += 1
                    d_off, d_size = list(base_off), list(base_size)
                    d_off[axis], d_size[axis] = p, q - p
                    s_off = list(d_off)
                    s_off[axis] = s
                    out.append((tuple(d_off), tuple(d_size), fqn, tuple(s_off)))
                    p = q
            return out

        self.tensors[fqn] = pieces

    def _plan_named(self, fqn: str, hit: Any, shape: tuple[int, ...], role: set[int] | None) -> None:
        la = hit.layer_axis
        fixed = None if la is not None else resolve_layer(hit, 0, self.num_layers, fqn)
        layers = [fixed] if fixed is not None else list(range(shape[la]))
        todo = {l: self.perms[l] for l in layers if l in self.perms}
        if not todo:
            return
        md = self.md.state_dict_metadata
        for l, perm in todo.items():
            have = [e for e in range(len(perm)) if hit.group.format(expert=e) in md]
            if have != list(range(len(perm))):
                raise InvalidInputError(f"layer {l} ({hit.group}): holds experts {have[:6]} of {len(perm)}")
        if not hit.optimizer and role is not None:
            role.update(todo)
        self.changed.add(fqn)
        perms, expert, group = self.perms, int(hit.expert or 0), hit.group

        def pieces(off: tuple[int, ...], size: tuple[int, ...]) -> list[Piece]:
            if la is None:
                perm = perms.get(int(fixed or 0))
                return [(off, size, group.format(expert=perm[expert] if perm else expert), off)]
            out: list[Piece] = []
            for l in range(off[la], off[la] + size[la]):
                perm = perms.get(l)
                d_off, d_size = list(off), list(size)
                d_off[la], d_size[la] = l, 1
                out.append((tuple(d_off), tuple(d_size), group.format(expert=perm[expert] if perm else expert), tuple(d_off)))
            return out

        self.tensors[fqn] = pieces

    # objects (Megatron's per-expert _extra_state shards) ----------------------------------------
    def _plan_object(self, fqn: str) -> None:
        m = SHARD.fullmatch(fqn)
        base = m.group("base") if m else fqn
        hit = classify(self.spec.stack, self.spec.form, base)
        if hit is None or hit.kind == "bucket":
            return
        if self.spec.keep_router and not hit.weight and hit.kind == "axis":
            return
        if m is None and hit.kind == "named" and hit.layer_axis is None and self.spec.form == "fsdp_dtensor":
            # fsdp_dtensor's per-parameter group metadata of an expert: takes its source expert's
            perm = self.perms.get(resolve_layer(hit, 0, self.num_layers, fqn))
            if perm is not None:
                source = hit.group.format(expert=perm[int(hit.expert or 0)])
                if source not in self.md.state_dict_metadata:
                    raise InvalidInputError(f"{fqn}: its source {source} is not in the checkpoint")
                if source != fqn:
                    self.objects[fqn] = source
                    self.changed.add(fqn)
            return
        if m is None or hit.kind not in ("axis", "named"):
            raise InvalidInputError(f"{fqn}: a per-expert object whose expert this permutation cannot identify")
        off = [int(x) for x in m.group("off").split(".")]
        tail = "_" + m.group("shape")
        if hit.kind == "named":
            if hit.layer_axis is None:
                layer = resolve_layer(hit, 0, self.num_layers, base)
                rest = off
            else:
                layer, rest = off[0], off
            perm = self.perms.get(layer)
            if perm is None:
                return
            source = hit.group.format(expert=perm[int(hit.expert or 0)]) + "/shard_" + ".".join(map(str, rest)) + tail
        else:
            if hit.layer_axis is None:
                layer, e_pos = resolve_layer(hit, 0, self.num_layers, base), 0
            else:
                if len(off) < 2:
                    raise InvalidInputError(f"{fqn}: a per-expert object whose shard offsets {off} name no expert")
                layer, e_pos = off[0], 1
            perm = self.perms.get(layer)
            if perm is None:
                return
            if off[e_pos] >= len(perm):
                raise InvalidInputError(f"{fqn}: expert {off[e_pos]} of {len(perm)}")
            src_off = list(off)
            src_off[e_pos] = perm[off[e_pos]]
            source = base + "/shard_" + ".".join(map(str, src_off)) + tail
        if source not in self.md.state_dict_metadata:
            raise InvalidInputError(f"{fqn}: its source {source} is not in the checkpoint: merge the expert shards first")
        if source != fqn:
            self.objects[fqn] = source
            self.changed.add(fqn)

    def check_complete(self) -> None:
        for layer in self.perms:
            if layer not in self.routers and not self.spec.keep_router:
                expected = PARAMETER_NAMES.get(self.spec.stack, {}).get("router_weight", "a router weight")
                raise InvalidInputError(f"layer {layer}: checkpoint has no {expected!r} (stack={self.spec.stack}, torch_dist)")
            if layer not in self.weights:
                raise InvalidInputError(f"layer {layer}: no expert weights found under stack={self.spec.stack} naming (torch_dist)")


def _infer_dcp_num_layers(stack: str, sd_md: Mapping[str, Any], form: str = "torch_dist") -> int | None:
    """Decoder layers: Megatron stacks them along axis 0 of every ``decoder.layers.*`` tensor;
    TorchTitan and Megatron FSDP (``fsdp_dtensor``) name them ``layers.N.``."""
    import re

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if form == "fsdp_dtensor":
        from placement.consumers.checkpoint._rules import infer_num_layers

        return infer_num_layers(stack, form, [f for f in sd_md if f.startswith("model.")])
    if stack == "megatron":
        for fqn, item in sd_md.items():
            if fqn.startswith("decoder.layers.") and isinstance(item, TensorStorageMetadata) and len(item.size) >= 1:
                return int(item.size[0])
        return None
    rx = re.compile(r"(?:.*\.)?layers\.(\d+)\..*")
    top = -1
    for fqn in sd_md:
        m = rx.fullmatch(fqn)
        if m and ".mtp_layers." not in "." + fqn:
            top = max(top, int(m.group(1)))
    return None if top < 0 else top + 1


class _ChunkIndex:
    """Find the stored chunks of a tensor that overlap a box."""

    def __init__(self, md: Any) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.md = md
        self._by_fqn: dict[str, Any] = {}
        self._exact: dict[tuple[str, tuple[int, ...]], Any] = {}
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                self._by_fqn[fqn] = item
                for c in item.chunks:
                    self._exact[(fqn, tuple(int(x) for x in c.offsets))] = c
        self._sorted: dict[str, tuple[list[tuple[int, ...]], list[Any]]] = {}

    def exact(self, fqn: str, offsets: tuple[int, ...]) -> Any:
        """The stored chunk of ``fqn`` that starts at ``offsets``."""
        return self._exact[(fqn, offsets)]

    def overlapping(self, fqn: str, off: tuple[int, ...], size: tuple[int, ...]) -> list[Any]:
        c = self._exact.get((fqn, off))
        if c is not None and all(o + s <= co + cs for o, s, co, cs in zip(off, size, c.offsets, c.sizes)):
            return [c]
        if fqn not in self._sorted:
            chunks = sorted(self._by_fqn[fqn].chunks, key=lambda c: tuple(c.offsets))
            self._sorted[fqn] = ([tuple(int(x) for x in c.offsets) for c in chunks], chunks)
        starts, chunks = self._sorted[fqn]
        # chunks are sorted by offsets: those starting at or before the box's end along axis 0
        hi = bisect.bisect_right(starts, (off[0] + size[0],))
        out = []
        for c in chunks[:hi]:
            if all(o < co + cs and co < o + s for o, s, co, cs in zip(off, size, c.offsets, c.sizes)):
                out.append(c)
        return out


# ---------------------------------------------------------------------------------------------
# Megatron-Core's distributed-optimizer buckets (dp_reshardable): flat state per bucket
# ---------------------------------------------------------------------------------------------
class _BucketLayout:
    """Where each parameter lies in the flat bucket tensors (a recorded layout, see
    :func:`placement.consumers.checkpoint.megatron_dist.megatron_bucket_layout`)."""

    def __init__(self, rows: tuple[tuple[Any, ...], ...]) -> None:
        # row: (chain, dp, gbuf, dtype, bucket, start, numel, family, layer, expert, tp, rows_of)
        self.by_bucket: dict[tuple[int, int, int, str, int], list[tuple[Any, ...]]] = {}
        self.where: dict[tuple[str, int | None, int | None, int], tuple[Any, ...]] = {}
        for row in rows:
            self.by_bucket.setdefault((int(row[0]), int(row[1]), int(row[2]), str(row[3]), int(row[4])), []).append(row)
            self.where[(row[7], row[8], row[9], row[10])] = row
        for rows_ in self.by_bucket.values():
            rows_.sort(key=lambda r: r[5])

    def plan(
        self, fqn: str, perms: Mapping[int, Sequence[int]], *, keep_router: bool
    ) -> Callable[[tuple[int, ...], tuple[int, ...]], list[Piece]] | None:
        m = BUCKET.fullmatch(fqn)
        assert m is not None
        chain = int(m.group("opt")[len("chained_") : -1]) if m.group("opt") else 0
        bid = (chain, int(m.group("dp")), int(m.group("gbuf")), m.group("dtype"), int(m.group("bucket")))
        rows = self.by_bucket.get(bid)
        if rows is None:
            raise InvalidInputError(f"{fqn}: no parameters of this bucket in the bucket layout (recorded for another job?)")
        state, prefix = m.group("state"), m.group("opt")
        moved = [r for r in rows if r[8] in perms and (r[9] is not None or (r[11] and not keep_router))]
        if not moved:
            return None
        for r in moved:  # every source expert of this bucket's experts is in the layout
            if r[9] is not None:
                for p in perms[r[8]]:
                    if (r[7], r[8], p, r[10]) not in self.where:
                        raise InvalidInputError(
                            f"{fqn}: the bucket layout has no parameter {r[7]} of layer {r[8]} expert {p}: "
                            "record it on every rank"
                        )
        starts = [r[5] for r in rows]
        where = self.where

        def key_of(row: tuple[Any, ...]) -> str:
            c, dp, gbuf, dtype, bucket = row[:5]
            pre = f"chained_{c}." if prefix else ""
            return f"{pre}optimizer.distributed.dp_group_idx_{dp}.gbuf_idx_{gbuf}.dtype_{dtype}.bucket_idx_{bucket}.{state}"

        def pieces(off: tuple[int, ...], size: tuple[int, ...]) -> list[Piece]:
            lo, hi = off[0], off[0] + size[0]
            out: list[Piece] = []
            pos = lo
            i = max(bisect.bisect_right(starts, lo) - 1, 0)
            while pos < hi:
                row = rows[i] if i < len(rows) else None
                if row is None or row[5] >= hi:
                    out.append(((pos,), (hi - pos,), fqn, (pos,)))
                    break
                start, numel = row[5], row[6]
                if pos < start:  # padding before the parameter
                    end = min(start, hi)
                    out.append(((pos,), (end - pos,), fqn, (pos,)))
                    pos = end
                    continue
                end = min(start + numel, hi)
                if pos < end:
                    perm = perms.get(row[8])
                    if perm is not None and row[9] is not None:  # an expert's parameter: another expert's
                        src = where[(row[7], row[8], perm[row[9]], row[10])]
                        out.append(((pos,), (end - pos,), key_of(src), (src[5] + pos - start,)))
                    elif perm is not None and row[11] and not keep_router:  # the router: rows by expert
                        per_row = numel // len(perm)
                        p0 = pos
                        while p0 < end:
                            r, within = divmod(p0 - start, per_row)
                            stop = min(end, start + (r + 1) * per_row)
                            out.append(((p0,), (stop - p0,), fqn, (start + perm[r] * per_row + within,)))
                            p0 = stop
                    else:
                        out.append(((pos,), (end - pos,), fqn, (pos,)))
                    pos = end
                i += 1
            return out

        return pieces



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
    with open(tmp / ".metadata.tmp", "wb") as f:
        pickle.dump(md, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp / ".metadata.tmp", tmp / ".metadata")
    for child in src.iterdir():  # metadata.json, common.pt, ...: not part of the DCP data
        if child.name != ".metadata" and child.name not in files and not (tmp / child.name).exists():
            (shutil.copytree if child.is_dir() else shutil.copy2)(child, tmp / child.name)
    shutil.rmtree(tmp / JOURNAL)
    os.replace(tmp, dst)
