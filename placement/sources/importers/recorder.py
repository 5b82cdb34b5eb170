"""A router recorder for PyTorch MoE models that writes Megatron's router-trace schema.

For stacks that keep no per-token routing (TorchTitan keeps only per-step ``tokens_per_expert``
counts in ``torchtitan/models/common/moe.py``, 0.3.0) or releases without Megatron-LM's tracer
(the megatron-core 0.16.1 wheel has no ``router_trace`` module): forward hooks on the routers
write ``router_trace_rank{rank}.jsonl`` with the records ``placement import --from megatron``
(or ``--from torchtitan``) reads::

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 1, "rank": 0,
     "num_tokens": 4096, "topk": 8, "top_indices": [[...], ...]}

``layer`` is the router's layer position inside the rank's pipeline stage, counting dense layers
too (``parallel.stage_layers[stage][layer]`` is the model layer), as in Megatron's traces.  A
multi-token-prediction head's router (``mtp_routers``) writes ``"block": "mtp", "mtp_idx": j,
"layer": 0``, as Megatron-LM's tracer does (``router_trace.py``, main); the importer reads it as
model layer ``num_layers + j`` when the instance has MTP MoE layers.

With :mod:`placement.consumers.runtime`'s expert map installed the recorded ids are **logical** (the map
remaps after the router: Megatron-Core's ``MoELayer.route`` wrapper, TorchTitan's pre-hook on
``routed_experts``), whether the recorder is created before or after the map.

Router outputs understood: any tuple holding an integer tensor of expert ids ``(..., top_k)``
(TorchTitan's ``TokenChoiceTopKRouter`` returns ``(scores, expert_ids (B, L, K), scores_BLE)``)
or a boolean routing map ``(tokens, num_experts)`` (Megatron-Core's ``TopKRouter`` returns
``(probs, routing_map)``).  torch is imported only by the functions that need it.

Typical use in a training loop::

    rec = RouterRecorder(out_dir, rank=torch.distributed.get_rank(),
                         routers=torchtitan_routers(model))
    for step in ...:
        train_step(...)
        rec.advance_step()
    rec.close()
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "RouterRecorder",
    "torchtitan_routers",
    "torchtitan_mtp_routers",
    "megatron_routers",
    "megatron_mtp_routers",
    "expert_ids_of",
]


def expert_ids_of(output: Any) -> Any:
    """The ``(tokens, top_k)`` int64 expert ids in a router's output (a torch tensor), or None."""
    import torch

    items = output if isinstance(output, (tuple, list)) else (output,)
    for item in items:
        if isinstance(item, torch.Tensor) and item.dtype in (torch.int64, torch.int32, torch.int16) and item.dim() >= 2:
            return item.detach().reshape(-1, item.shape[-1]).to("cpu", torch.int64)
    for item in items:
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool and item.dim() == 2:
            per_token = item.sum(dim=1)
            if per_token.numel() and bool((per_token != per_token[0]).any()):
                raise ValueError("routing map with a varying number of experts per token (token dropping?)")
            k = int(per_token[0]) if per_token.numel() else 0
            _, experts = item.detach().cpu().nonzero(as_tuple=True)
            return experts.reshape(item.shape[0], k).to(torch.int64)
    return None


class RouterRecorder:
    """Forward hooks on routers that append Megatron-schema JSONL records, one per call.

    Parameters
    ----------
    output_dir : folder of ``router_trace_rank{rank}.jsonl`` (created; an existing file is replaced).
    rank : this process's global rank.
    routers : stage-local layer position -> router module.
    max_steps : stop recording after this many steps (None: never).
    mtp_routers : MTP head index -> router module (the last pipeline stage's).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        rank: int,
        routers: Mapping[int, Any],
        max_steps: int | None = None,
        mtp_routers: Mapping[int, Any] | None = None,
    ) -> None:
        self.rank = int(rank)
        self.step = 0
        self.max_steps = max_steps
        self.records: list[dict] = []
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(output_dir) / f"router_trace_rank{self.rank}.jsonl"
        self.path.write_text("")
        self._handles = [module.register_forward_hook(self._hook(int(layer))) for layer, module in sorted(routers.items())]
        self._handles += [
            module.register_forward_hook(self._hook(0, mtp_idx=int(j))) for j, module in sorted((mtp_routers or {}).items())
        ]

    def _hook(self, layer: int, mtp_idx: int | None = None) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if self.max_steps is not None and self.step >= self.max_steps:
                return
            ids = expert_ids_of(output)
            if ids is None:
                return
            record = {
                "step": self.step,
                "stage": "pre_dispatch",
                "block": "decoder" if mtp_idx is None else "mtp",
                "layer": layer,
                "rank": self.rank,
                "num_tokens": int(ids.shape[0]),
                "topk": int(ids.shape[1]),
                "top_indices": ids.tolist(),
            }
            if mtp_idx is not None:
                record["mtp_idx"] = mtp_idx
            self.records.append(record)

        return hook

    def flush(self) -> None:
        """Append the buffered records to the file."""
        if not self.records:
            return
        with self.path.open("a") as fh:
            for rec in self.records:
                fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self.records.clear()

    def advance_step(self) -> None:
        """End the current step (call once per optimizer step): flush and count."""
        self.flush()
        self.step += 1

    def close(self) -> None:
        """Flush and remove the hooks."""
        self.flush()
        for h in self._handles:
            h.remove()
        self._handles.clear()


_TT_ROUTER = re.compile(r"^layers\.(\d+)\.moe\.router$")
_TT_MTP_ROUTER = re.compile(r"^mtp_layers\.(\d+)\.moe\.router$")
_MC_ROUTER = re.compile(r"decoder\.layers\.(\d+)\.mlp\.router$")
# 0.16.1: mtp.layers.J.transformer_layer; core_v0.19.0 and main: mtp.layers.J.mtp_model_layer
_MC_MTP_ROUTER = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.mlp\.router$")


def torchtitan_routers(model: Any) -> dict[int, Any]:
    """Routers of a TorchTitan decoder (``layers.<id>.moe.router``) by stage-local layer position.

    TorchTitan keeps the global layer ids as the keys of ``model.layers`` on every pipeline stage,
    so the position is the id's rank among the stage's layer ids (dense layers included).
    """
    layer_ids = sorted(int(k) for k in model.layers.keys())
    out: dict[int, Any] = {}
    for name, module in model.named_modules():
        m = _TT_ROUTER.match(name)
        if m:
            out[layer_ids.index(int(m.group(1)))] = module
    return out


def megatron_routers(model: Any) -> dict[int, Any]:
    """Routers of a Megatron-Core GPTModel chunk (``decoder.layers.<i>.mlp.router``): ``i`` is local."""
    out: dict[int, Any] = {}
    for name, module in model.named_modules():
        m = _MC_ROUTER.search(name)
        if m:
            out[int(m.group(1))] = module
    return out


def megatron_mtp_routers(model: Any) -> dict[int, Any]:
    """MTP heads' routers of a Megatron-Core GPTModel (last stage) by head index ``j``."""
    out: dict[int, Any] = {}
    for name, module in model.named_modules():
        m = _MC_MTP_ROUTER.search(name)
        if m:
            out[int(m.group(1))] = module
    return out


def torchtitan_mtp_routers(model: Any) -> dict[int, Any]:
    """MTP layers' routers of a TorchTitan ``MTPDecoder`` (``mtp_layers.<j>.moe.router``, main) by ``j``."""
    out: dict[int, Any] = {}
    for name, module in model.named_modules():
        m = _TT_MTP_ROUTER.match(name)
        if m:
            out[int(m.group(1))] = module
    return out
