"""vLLM routed-experts captures: a small file format, its writer and its reader.

What vLLM gives (read in ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`` and
``vllm/outputs.py`` of vllm-project/vllm at commits 00bd149 and 003d3ee; vLLM cannot be installed
for CPU, so the tests use fixtures built to this schema): with ``enable_return_routed_experts``
the worker's ``RoutedExpertsCapturer`` fills an int32 buffer ``(tokens, num_hidden_layers,
num_experts_per_tok)`` per data-parallel rank (only tensor-parallel rank 0 keeps it), and every
finished request carries ``CompletionOutput.routed_experts``, a numpy array ``[seq_len,
layer_num, topk]``.  vLLM writes no file: :func:`save_routed_experts` stores one data-parallel
rank's outputs as an ``.npz`` that :func:`read_calls` reads::

    dp_rank                   one int: the vLLM data-parallel rank that served the requests
    request_000000, ...       one (tokens, num_hidden_layers, top_k) int array per request, in order
    physical_to_logical_map   optional (num_hidden_layers, physical experts): when EPLB put
                              physical ids in the capture; omitted, ids are taken as logical

Rows of dense layers are ignored (the capturer leaves them 0); negative ids are padding (the token
is dropped).  A request is the unit of time: the first requests form the fit window, the last ones
the held-out window.  EPLB's load window (per-expert counts) is refused: an instance needs
per-token ids.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from placement.formats import _npz_bytes, atomic_write_bytes
from placement.sources.importers.core import IdChecker, LoadedIds, RouterCall, check_phy2log_map
from placement.core.model import InvalidInputError, MoEModel

__all__ = ["read_calls", "save_routed_experts"]

_REQUEST = re.compile(r"request_(\d+)$")


def save_routed_experts(path: str | os.PathLike[str], dp_rank: int, outputs: Iterable[Any]) -> int:
    """Write one data-parallel rank's routed experts as the ``.npz`` :func:`read_calls` reads.

    ``outputs``: vLLM ``RequestOutput`` objects (``.outputs[i].routed_experts``), ``CompletionOutput``
    objects, or plain ``(tokens, layers, top_k)`` arrays, in the order they were served.  Returns the
    number of requests written.  The file is written atomically.
    """
    arrays: dict[str, np.ndarray] = {"dp_rank": np.array(int(dp_rank), dtype=np.int64)}
    n = 0
    for out in outputs:
        completions = getattr(out, "outputs", None)
        items = completions if completions is not None else [out]
        for item in items:
            routed = getattr(item, "routed_experts", item)
            if routed is None:
                raise InvalidInputError("routed_experts is None: start vLLM with enable_return_routed_experts=True")
            arrays[f"request_{n:06d}"] = np.asarray(routed, dtype=np.int32)
            n += 1
    atomic_write_bytes(path, _npz_bytes(arrays))
    return n


def read_calls(paths: Sequence[str | os.PathLike[str]], model: MoEModel,
               on_bytes: Callable[[int], None] | None = None) -> Iterator[RouterCall]:
    """One :class:`RouterCall` per (request, MoE layer) of the given ``.npz`` captures.

    ``on_bytes`` is called with each file's size once it is read (progress; it only observes)."""
    checker = IdChecker(model)
    k = model.top_k
    for p in sorted({str(x) for x in paths}):
        path = Path(p)
        if not path.is_file():
            raise InvalidInputError(f"{path}: capture file not found or not a regular file")
        try:
            raw = path.read_bytes()
            npz = np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as exc:  # noqa: BLE001
            raise InvalidInputError(f"{path}: not a readable .npz (truncated or corrupt): {exc}") from None
        if on_bytes is not None:
            on_bytes(len(raw))
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise InvalidInputError(f"{path}: expected an .npz of routed experts per request")
        with npz:
            try:
                names = list(npz.files)
                requests = sorted((int(m.group(1)), n) for n in names if (m := _REQUEST.match(n)))
                if not requests:
                    raise InvalidInputError(
                        f"{path}: no request_* arrays: expert counts (EPLB's load window) cannot build an "
                        f"instance, which needs per-token ids; save CompletionOutput.routed_experts "
                        f"with placement.sources.importers.vllm.save_routed_experts"
                    )
                if "dp_rank" not in names:
                    raise InvalidInputError(f"{path}: dp_rank: missing")
                dp = npz["dp_rank"]
                if dp.size != 1 or dp.ndim > 1 or dp.dtype.kind not in "iu":
                    raise InvalidInputError(f"{path}: dp_rank: expected one integer")
                dp = dp.reshape(())
                p2l = None
                if "physical_to_logical_map" in names:
                    p2l = npz["physical_to_logical_map"].astype(np.int64)
                    check_phy2log_map(p2l, model, str(path), "physical_to_logical_map")
                layers = list(model.moe_layers)
                for number, name in requests:
                    where = f"{path}: {name}"
                    a = npz[name]
                    if a.dtype.kind not in "iu" or a.ndim != 3 or a.shape[1] != model.num_layers or a.shape[2] != k:
                        raise InvalidInputError(
                            f"{where}: expected integer (tokens, num_layers={model.num_layers}, top_k={k}), "
                            f"found {a.dtype} {a.shape}"
                        )
                    sub = a[:, layers, :].astype(np.int64)  # (tokens, moe layers, k)
                    valid = ~(sub < 0).any(axis=(1, 2))
                    for j, layer in enumerate(layers):
                        ids = sub[valid, j, :]
                        if p2l is not None:
                            if ids.size and ids.max() >= p2l.shape[1]:
                                raise InvalidInputError(
                                    f"{where} (layer {layer}): physical expert id {int(ids.max())} is outside "
                                    f"[0, {p2l.shape[1]})"
                                )
                            ids = p2l[layer][ids]
                        ids = checker.check(ids, f"{where} (layer {layer})")
                        yield RouterCall(
                            where=f"{where} (layer {layer})",
                            step=number,
                            layer=layer,
                            num_tokens=int(ids.shape[0]),
                            load=LoadedIds(ids),
                            source=int(dp),
                        )
            except InvalidInputError:
                raise
            except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
                raise InvalidInputError(f"{path}: not a readable .npz (truncated or corrupt): {exc}") from None
