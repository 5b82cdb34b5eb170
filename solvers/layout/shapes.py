"""Shapes (multisets of GPUs per domain) of a block, and how a shape's parts are laid along the
EP ranks (consecutive slices, so that equal parts meet the DeepEP/HybridEP rule by construction)."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from solvers.layout.blocks import Block

__all__ = ["shape_candidates", "slice_order", "contiguous_atom_parts", "merge_bound", "shape_of"]


def shape_of(foot: dict[int, int]) -> tuple[int, ...]:
    """The shape of a footprint ``{domain: GPUs}``: its part sizes, non-increasing."""
    return tuple(sorted(foot.values(), reverse=True))


def _partitions(rem: int, largest: int, max_parts: int, acc: list[int]) -> Iterator[tuple[int, ...]]:
    """Partitions of ``rem`` into at most ``max_parts - len(acc)`` more parts of at most
    ``largest``, non-increasing, appended to ``acc``; largest parts first."""
    if rem == 0:
        yield tuple(acc)
        return
    if len(acc) == max_parts:
        return
    for x in range(min(rem, largest), 0, -1):
        if x * (max_parts - len(acc)) < rem:
            break
        acc.append(x)
        yield from _partitions(rem - x, x, max_parts, acc)
        acc.pop()


def shape_candidates(
    n: int, unit: int, max_part: int, max_parts: int, *, equal_only: bool = False, limit: int | None = None
) -> list[tuple[int, ...]]:
    """Multisets of part sizes for a block of ``n`` GPUs, sizes non-increasing.

    Parameters
    ----------
    n : block size in GPUs.
    unit : every part is a multiple of ``unit`` (a tray, or a TP x CP group).
    max_part : the largest part any domain can take.
    max_parts : at most this many parts (domains).
    equal_only : only equal parts (the DeepEP/HybridEP rule).
    limit : stop after ``limit + 1`` shapes (so a caller can tell that there are more than
        ``limit``); the ones with the largest parts come first.

    Examples
    --------
    >>> shape_candidates(8, 2, 8, 3)
    [(8,), (6, 2), (4, 4), (4, 2, 2)]
    >>> shape_candidates(8, 1, 8, 8, equal_only=True)
    [(8,), (4, 4), (2, 2, 2, 2), (1, 1, 1, 1, 1, 1, 1, 1)]
    """
    if n % unit:
        return []
    out: list[tuple[int, ...]] = []
    if equal_only:
        for m in range(1, n // unit + 1):
            if (n // unit) % m == 0 and m <= max_parts and n // m <= max_part:
                out.append((n // m,) * m)
        return out
    for parts in _partitions(n // unit, max_part // unit, max_parts, []):
        out.append(tuple(unit * x for x in parts))
        if limit is not None and len(out) > limit:
            break
    return out


def slice_order(sizes: Sequence[int], align: int | None) -> list[int]:
    """Order of the parts along the EP ranks: larger parts first, unless another order puts more
    slice boundaries on multiples of ``align`` (the group positions of a group-preserving map: a
    boundary inside a position splits an expert group over two domains).

    Exact by dynamic programming over subsets for up to 12 parts (the subset fixes the boundary's
    position), else larger parts first.

    Examples
    --------
    >>> slice_order([68, 64, 64, 56, 4], 32)   # boundaries 68, 124, 128, 192: two aligned
    [0, 3, 4, 1, 2]
    >>> slice_order([48, 8, 4, 4], 8)
    [0, 1, 2, 3]
    """
    m = len(sizes)
    base = sorted(range(m), key=lambda i: (-sizes[i], i))
    if align is None or align <= 1 or m <= 1 or m > 12:
        return base
    rank = {i: r for r, i in enumerate(base)}
    # best[mask] = (aligned boundaries, order) over orders of the parts in ``mask`` placed first
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for mask in range(1 << m):
        if mask not in best:
            continue
        count, order = best[mask]
        pos = sum(sizes[i] for i in range(m) if mask >> i & 1)
        gain = 1 if 0 < pos < sum(sizes) and pos % align == 0 else 0
        for i in sorted(range(m), key=lambda j: rank[j]):
            if mask >> i & 1:
                continue
            nxt = mask | 1 << i
            cand = (count + gain, order + (i,))
            old = best.get(nxt)
            if old is None or cand[0] > old[0] or (cand[0] == old[0] and [rank[j] for j in cand[1]] < [rank[j] for j in old[1]]):
                best[nxt] = cand
    return list(best[(1 << m) - 1][1])


def contiguous_atom_parts(block: Block, shape: Sequence[int], align_ranks: int | None = None) -> np.ndarray:
    """(n_atoms,) part of each atom: consecutive slices of the block's atoms (part ``i`` has
    ``shape[i]`` GPUs), in the order of :func:`slice_order` (``align_ranks``: EP ranks per group
    position, for a block that is one EP group under a group-preserving map)."""
    a = block.atom_size
    sizes = [v // a for v in shape]
    align = align_ranks // a if align_ranks and align_ranks % a == 0 else None
    out = np.empty(sum(sizes), dtype=np.int64)
    pos = 0
    for i in slice_order(sizes, align):
        out[pos : pos + sizes[i]] = i
        pos += sizes[i]
    return out


def merge_bound(shape: tuple[int, ...], known: dict[tuple[int, ...], float], memo: dict[tuple[int, ...], float]) -> float:
    """Lower bound on a shape's bytes: the best over its one-step merges (merging never costs more:
    any expert map on the finer shape is one on the merged shape); ``known``: shape -> its price."""
    if shape in known:
        return known[shape]
    if len(shape) <= 1:
        return 0.0
    if shape in memo:
        return memo[shape]
    best = 0.0
    for i in range(len(shape)):
        for j in range(i + 1, len(shape)):
            merged = tuple(sorted(shape[:i] + shape[i + 1 : j] + shape[j + 1 :] + (shape[i] + shape[j],), reverse=True))
            best = max(best, merge_bound(merged, known, memo))
    memo[shape] = best
    return best
