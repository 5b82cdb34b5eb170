"""Orbax PyTree checkpoints of MaxText MoE models (scanned or unscanned layers)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from placement.consumers.checkpoint._entries import _doc_groups, _write_dir, permute_entries
from placement.consumers.checkpoint._rules import ORBAX_SCAN_AXIS
from placement.core.model import InvalidInputError
from placement.core.permutation import MAXTEXT_EXPERT_PATHS, read_expert_permutation

__all__ = ["permute_orbax", "MAXTEXT_DOC_KIND"]


def permute_orbax(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    doc: Mapping[str, Any] | str,
    *,
    scan_layers: Sequence[int] | None = None,
    scan_axis: int | None = 1,
    num_groups: int | None = None,
) -> list[str]:
    """Permute an Orbax PyTree checkpoint of a MaxText MoE model, parameters and optimizer state.

    Every leaf whose path ends in one of :data:`MAXTEXT_EXPERT_PATHS` (``.../MoeBlock_0/wi_0``,
    ``wi_1``, ``wo``, their biases, ``gate/kernel``, ``gate/bias``), wherever it sits (``params``,
    the optimizer's ``mu`` / ``nu``), is permuted along its expert axis; any other leaf under a
    ``MoeBlock_0`` is refused.  With scanned layers (MaxText's ``scan_layers=True``) the layer axis
    is ``scan_axis`` (MaxText's ``param_scan_axis``, 1): ``wi_0`` (E, L, emb, mlp), ``gate/kernel``
    (emb, L, E), ``gate/bias`` (E, L).

    Parameters
    ----------
    src, dst : path
        The PyTree checkpoint directory (a MaxText step's ``items``); destination, must not exist.
    doc : permutation document, its JSON text, or the path of its file
        Either ``placement export --format megatron|torchtitan``'s permutation (keyed by model
        layer) or ``placement export --format maxtext``'s document (``experts.layers`` keyed by
        scan position; its ``experts.tensors`` must name the tensors this function permutes).
    scan_layers : sequence of int, optional
        Model layer index of each position along the scan axis; by default the document's MoE
        layers in order (MaxText's DeepSeek decoder scans its MoE layers as one stack).
    scan_axis : int or None
        None when layers are not scanned (then the document must hold exactly one layer).
    num_groups : int, optional
        Overrides the document's group rule.

    Returns
    -------
    list of str
        Paths (``a/b/c``) of the permuted leaves, sorted.
    """
    import orbax.checkpoint as ocp

    maxtext = _maxtext_experts(doc)
    if maxtext is not None:  # ``placement export --format maxtext``: rows are already scan positions
        by_position, groups = maxtext
        groups = groups if num_groups is None else num_groups
        layers, scan_layers = by_position, list(range(max(by_position, default=-1) + 1))
    else:
        layers, meta = read_expert_permutation(doc if isinstance(doc, str) else dict(doc))
        groups = _doc_groups(meta) if num_groups is None else num_groups
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not src.is_dir():
        raise InvalidInputError(f"{src}: not an Orbax checkpoint directory")
    if dst.exists():
        raise InvalidInputError(f"{dst}: exists; refusing to overwrite")
    order = list(scan_layers) if scan_layers is not None else sorted(layers)
    if scan_axis is None and len(layers) != 1:
        raise InvalidInputError(f"scan_axis=None (unscanned layers) needs a one-layer document, found {len(layers)} layers")
    missing = sorted(set(layers) - set(order))
    if missing:
        raise InvalidInputError(f"scan_layers: MoE layers {missing[:6]} of the document have no scan position")
    by_position = {i: layers[layer] for i, layer in enumerate(order) if layer in layers}
    if scan_axis is None:
        by_position = {0: next(iter(layers.values()))}
    import jax

    with ocp.PyTreeCheckpointer() as ckptr:
        # host numpy arrays whatever devices the checkpoint was saved from (its sharding is ignored)
        meta_tree = ckptr.metadata(str(src)).item_metadata.tree
        restore_args = jax.tree_util.tree_map(
            lambda m: ocp.RestoreArgs(restore_type=np.ndarray) if type(m).__name__ == "ArrayMetadata" else ocp.RestoreArgs(),
            meta_tree,
        )
        tree = ckptr.restore(str(src), restore_args=restore_args)
    flat = _flatten_tree(tree)
    entries = {k: np.asarray(v) if hasattr(v, "shape") else v for k, v in flat.items()}
    ORBAX_SCAN_AXIS[0] = scan_axis
    try:
        out = permute_entries(entries, by_position, stack="megatron", form="orbax", num_groups=groups)
    finally:
        ORBAX_SCAN_AXIS[0] = 1
    changed = sorted(k for k in out if out[k] is not entries[k])
    new_tree = _unflatten_tree(tree, {k: out[k] if k in changed else flat[k] for k in flat})

    def write(tmp: Path) -> None:
        target = tmp / "tree"
        with ocp.PyTreeCheckpointer() as writer:
            writer.save(str(target), new_tree)
        for child in target.iterdir():
            child.rename(tmp / child.name)
        target.rmdir()

    _write_dir(dst, write)
    return changed


MAXTEXT_DOC_KIND = "placement.maxtext"


def _maxtext_experts(doc: Mapping[str, Any] | str) -> tuple[dict[int, np.ndarray], int] | None:
    """``({scan position: phy2log}, num_groups)`` of a ``placement.consumers.maxtext`` document, else None.

    Its ``experts.tensors`` (path, expert axis, layer axis) must agree with
    :data:`MAXTEXT_EXPERT_PATHS` at scan axis 1, so both ends name the same tensors.
    """
    import json

    if isinstance(doc, str):
        text = doc
        if not doc.lstrip().startswith("{"):
            try:
                text = Path(doc).read_text(encoding="utf-8")
            except OSError:
                return None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            return None
    if not isinstance(doc, Mapping) or doc.get("kind") != MAXTEXT_DOC_KIND:
        return None
    experts = doc.get("experts")
    if not isinstance(experts, Mapping) or not isinstance(experts.get("layers"), Mapping):
        raise InvalidInputError("maxtext: experts.layers: expected an object of scan position -> permutation")
    for t in experts.get("tensors", []):
        path = str(t.get("path", ""))
        leaf = next((k for k in MAXTEXT_EXPERT_PATHS if path == k or path.endswith("/" + k)), None)
        axis = None if leaf is None else MAXTEXT_EXPERT_PATHS[leaf]
        want = None if axis is None else (axis if axis < 1 else axis + 1, 1)
        if want != (t.get("expert_axis"), t.get("layer_axis")):
            raise InvalidInputError(
                f"maxtext: experts.tensors: {t.get('path')!r} with expert axis {t.get('expert_axis')} and layer axis "
                f"{t.get('layer_axis')} is not a tensor this permutation knows as such"
            )
    layers = {}
    for key, row in experts["layers"].items():
        if not str(key).isdigit():
            raise InvalidInputError(f"maxtext: experts.layers: key {key!r} is not a scan position")
        layers[int(key)] = np.asarray(row, dtype=np.int64)
    groups = int(experts.get("num_groups", 1)) if experts.get("group_limited") else 1
    return dict(sorted(layers.items())), groups


def _flatten_tree(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out.update(_flatten_tree(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten_tree(v, f"{prefix}{i}/"))
    else:
        out[prefix.rstrip("/")] = tree
    return out


def _unflatten_tree(tree: Any, flat: Mapping[str, Any], prefix: str = "") -> Any:
    if isinstance(tree, Mapping):
        return {k: _unflatten_tree(v, flat, f"{prefix}{k}/") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unflatten_tree(v, flat, f"{prefix}{i}/") for i, v in enumerate(tree))
    return flat[prefix.rstrip("/")]

