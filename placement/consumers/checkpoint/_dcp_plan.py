"""The plan of :func:`placement.consumers.checkpoint.dcp.permute_dcp`: for every entry of a
``torch.distributed.checkpoint`` directory, where each of its stored chunks takes its data from
(built from ``.metadata`` alone, before anything is written), with Megatron-Core's
``dp_reshardable`` distributed-optimizer buckets located through a recorded bucket layout.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from placement.consumers.checkpoint._rules import BUCKET, SHARD, UNKNOWN_MSG, classify, resolve_layer
from placement.core.model import InvalidInputError
from placement.core.permutation import PARAMETER_NAMES


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
