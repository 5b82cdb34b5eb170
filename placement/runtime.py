"""Dispatch-time expert map for training: the router stays logical, tokens go to physical slots.

The offline checkpoint permutation (:mod:`placement.checkpoint`) renumbers the router together
with the experts, which is exact only when each expert group stays in one block of slots
(group-limited routing scores groups over contiguous ids).  This module instead keeps the router
choosing **logical** experts, so group-limited routing, the aux-loss-free bias and the balancing
counters stay untouched and in logical order, and remaps each chosen expert to the **physical**
slot that holds it, between the router and the token dispatcher.  The expert weights are stored in
physical order: permute the checkpoint with ``keep_router=True``
(``apply_permutation(..., keep_router=True)``, :func:`placement.checkpoint.permute_dcp`), so
slot ``p`` holds logical expert ``phy2log[p]``.  Any permutation is then valid for training,
group-preserving or not.

Hooks (torch is imported lazily; a hook is a plain ``register_forward_hook`` /
``register_forward_pre_hook`` and is removed with the returned handles):

- Megatron-Core (read against 0.16.1, ``megatron/core/transformer/moe/moe_layer.py`` and
  ``router.py``): a forward hook on each MoE layer's ``mlp.router``.  ``TopKRouter.forward``
  returns ``(probs, routing_map)``, both (tokens, E) in logical order, after it has updated
  ``local_tokens_per_expert`` (the aux-loss-free counter) and computed the aux losses; the hook
  returns their columns in physical order, ``probs[:, phy2log]``, which is what the dispatcher
  and the experts (stored in physical order) consume.
- TorchTitan (read against 0.3.0, ``torchtitan/models/common/moe.py``): a forward pre-hook on
  each ``MoE.routed_experts``.  ``MoE.forward`` adds the logical counts to ``tokens_per_expert_E``
  (its bias update reads them) before calling ``routed_experts(x, scores, expert_ids,
  num_tokens_per_expert)``; the hook maps ``expert_ids`` to ``log2phy[expert_ids]`` and the
  counts to physical order, ``counts[phy2log]``.

Expert parallelism needs nothing more: both stacks give EP rank ``r`` the slots
``r * E / ep ...``, so the physical order is the placement.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from placement.model import InvalidInputError
from placement.permutation import check_permutation, inverse_permutation, read_expert_permutation

__all__ = ["ExpertMap", "expert_map", "install_megatron", "install_torchtitan", "remove"]


@dataclass(frozen=True)
class ExpertMap:
    """One MoE layer's map: ``phy2log`` (E,) and its inverse ``log2phy`` (E,)."""

    layer: int
    phy2log: tuple[int, ...]

    @property
    def log2phy(self) -> tuple[int, ...]:
        return tuple(int(x) for x in inverse_permutation(self.phy2log))


def expert_map(layers_or_doc: Mapping[int, Sequence[int] | np.ndarray] | Mapping[str, Any] | str) -> dict[int, ExpertMap]:
    """``{model layer index: ExpertMap}`` from ``{layer: phy2log}`` or a permutation document / its path."""
    source: Any = layers_or_doc
    if isinstance(source, str) or "kind" in source:
        layers, _ = read_expert_permutation(source if isinstance(source, str) else dict(source))
    else:
        layers = {int(k): np.asarray(v) for k, v in source.items()}
    return {layer: ExpertMap(layer, tuple(check_permutation(layer, perm))) for layer, perm in sorted(layers.items())}


def _index(torch: Any, values: Sequence[int], device: Any) -> Any:
    return torch.as_tensor(list(values), dtype=torch.long, device=device)


def install_megatron(model: Any, layers: Any, *, strict: bool = True) -> list[Any]:
    """Install the map on every MoE layer of a Megatron-Core model (or one pipeline stage's model).

    Parameters
    ----------
    model : torch.nn.Module
        A ``GPTModel`` (or any module holding ``TransformerLayer`` s); a layer's model index is its
        ``layer_number - 1`` (Megatron numbers layers from 1, globally across pipeline stages).
    layers : ``{layer: phy2log}``, a permutation document, or its path
    strict : bool
        Every MoE layer of ``model`` must have a map (and every map a layer, unless the model is
        one pipeline stage: maps of absent layers are then ignored when ``strict=False``).

    Returns
    -------
    list
        The hook handles (pass them to :func:`remove`).
    """
    import torch

    maps = expert_map(layers)
    handles: list[Any] = []
    found: set[int] = set()
    for _, module in model.named_modules():
        mlp = getattr(module, "mlp", None)
        router = getattr(mlp, "router", None)
        if router is None or not hasattr(module, "layer_number"):
            continue
        layer = int(module.layer_number) - 1
        found.add(layer)
        if layer not in maps:
            if strict:
                raise InvalidInputError(f"layer {layer}: a Megatron MoE layer without an expert map")
            continue
        num_experts = int(router.config.num_moe_experts)
        if len(maps[layer].phy2log) != num_experts:
            raise InvalidInputError(f"layer {layer}: map has {len(maps[layer].phy2log)} experts, the router {num_experts}")
        phy2log = maps[layer].phy2log

        def hook(_mod: Any, _inputs: Any, output: Any, phy2log: tuple[int, ...] = phy2log) -> Any:
            probs, routing_map = output
            idx = _index(torch, phy2log, probs.device)
            return probs.index_select(-1, idx), routing_map.index_select(-1, idx)

        handles.append(router.register_forward_hook(hook))
    _check_found(maps, found, strict, "Megatron")
    return handles


_TITAN_LAYER = re.compile(r"(?:.*\.)?layers\.(?P<layer>\d+)\.moe")


def install_torchtitan(model: Any, layers: Any, *, strict: bool = True) -> list[Any]:
    """Install the map on every ``MoE`` module of a TorchTitan model (or a single ``MoE``).

    Parameters
    ----------
    model : torch.nn.Module
        A TorchTitan decoder (MoE modules named ``layers.{i}.moe``, ``i`` the model's layer index)
        or one ``MoE`` module (then ``layers`` must hold exactly one map).
    layers : ``{layer: phy2log}``, a permutation document, or its path
    strict : bool
        As for :func:`install_megatron`.

    Returns
    -------
    list
        The hook handles.
    """
    import torch

    maps = expert_map(layers)
    handles: list[Any] = []
    found: set[int] = set()
    for name, module in model.named_modules():
        experts = getattr(module, "routed_experts", None)
        if experts is None or not hasattr(module, "router"):
            continue
        m = _TITAN_LAYER.fullmatch(name)
        if m:
            layer = int(m.group("layer"))
        elif name == "" and len(maps) == 1:
            layer = next(iter(maps))
        else:
            raise InvalidInputError(f"{name or 'model'}: a TorchTitan MoE module whose layer index is not in its name")
        found.add(layer)
        if layer not in maps:
            if strict:
                raise InvalidInputError(f"layer {layer}: a TorchTitan MoE layer without an expert map")
            continue
        phy2log, log2phy = maps[layer].phy2log, maps[layer].log2phy

        def pre_hook(_mod: Any, args: tuple, phy2log: tuple[int, ...] = phy2log, log2phy: tuple[int, ...] = log2phy) -> tuple:
            x, scores, expert_ids, counts = args
            to_phy = _index(torch, log2phy, expert_ids.device)
            return x, scores, to_phy[expert_ids], counts.index_select(0, _index(torch, phy2log, counts.device))

        handles.append(experts.register_forward_pre_hook(pre_hook))
    _check_found(maps, found, strict, "TorchTitan")
    return handles


def _check_found(maps: Mapping[int, ExpertMap], found: set[int], strict: bool, stack: str) -> None:
    if not found:
        raise InvalidInputError(f"{stack}: the model has no MoE layer to install the expert map on")
    missing = sorted(set(maps) - found)
    if strict and missing:
        raise InvalidInputError(f"layers {missing[:6]}: expert maps for layers the {stack} model does not have")


def remove(handles: Sequence[Any]) -> None:
    """Remove hooks returned by :func:`install_megatron` / :func:`install_torchtitan`."""
    for h in handles:
        h.remove()
from placement.migrate import migrate  # noqa: E402,F401  (re-exported: placement.runtime.migrate)
