"""SGLang: the ``--init-expert-location FILE.json`` document, the layouts SGLang's EP deployment runs,
and a reader for the document."""

from __future__ import annotations

import numpy as np

from placement.consumers.export._text import _as_doc, _int_matrix
from placement.core.model import Instance, InvalidInputError, Placement


def sglang_expert_location(instance: Instance, placement: Placement) -> dict:
    """The document SGLang's ``--init-expert-location FILE.json`` reads.

    SGLang passes the JSON object as keyword arguments to ``ExpertLocationMetadata.init_by_mapping``,
    so it holds exactly one key.  Its map has one row per transformer layer (SGLang indexes it by
    the decoder layer id, ``num_layers = config.num_hidden_layers``); rows of dense layers are never
    read and hold the trivial map ``p % E``, as SGLang's own ``init_trivial`` does.  MTP MoE layers
    (index ``num_layers + j``) have no row: SGLang runs multi-token prediction as a separate draft
    model, outside this map.

    Returns
    -------
    dict
        ``{"physical_to_logical_map": [[int]]}`` of shape (num_layers, P), ``P = num_experts``
        (no redundant slots: launch with ``--ep-num-redundant-experts 0`` and ``--ep-size`` equal
        to the instance's ``ep``; physical slot ``p`` is on EP rank ``p // (P / ep)``).
    """
    m = instance.model
    p2l = np.asarray(placement.phy2log)
    num_physical = p2l.shape[1]
    rows = np.tile(np.arange(num_physical) % m.num_experts, (m.num_layers, 1))
    decoder = [i for i, layer in enumerate(m.moe_layers) if layer < m.num_layers]
    rows[[m.moe_layers[i] for i in decoder]] = p2l[decoder]
    return {"physical_to_logical_map": rows.tolist()}


def sglang_layout_problem(instance: Instance, placement: Placement) -> str | None:
    """One line saying why SGLang's EP deployment cannot run this layout, or ``None``.

    SGLang serves an EP model as one engine per EP group: ``--tp-size`` = ``--ep-size`` = ``ep``
    (``moe_ep_rank = tp_rank // (tp_size // ep_size)``), attention data-parallel over the same
    ranks, and all of the model's layers on those ranks.  Over several nodes, node ``k`` of an
    engine runs tp ranks ``k*n .. k*n+n-1`` with ``n = tp_size / nnodes``
    (``python/sglang/srt/entrypoints/engine.py``: ``tp_size_per_node``, ``tp_rank_range``; the GPU is
    ``base_gpu_id + local * gpu_id_step`` among the visible ones).  So a layout runs under SGLang
    when ``pp = tp = cp = 1`` and every EP group is equal consecutive runs of EP ranks, one run per
    host.
    """
    par, cl = instance.parallel, instance.cluster
    if par.pp > 1:
        return (
            f"sglang: pp={par.pp}: each MoE layer's map is tuned for the GPUs of its own pipeline stage, but "
            f"SGLang's EP deployment runs every layer on one EP group of {par.ep} GPUs; export a pp=1 instance"
        )
    if par.tp > 1 or par.cp > 1:
        return (
            f"sglang: tp={par.tp} cp={par.cp}: SGLang's EP launch has one attention data-parallel rank per GPU "
            "(--tp-size = --ep-size = ep, --enable-dp-attention) and no counterpart for the instance's TP/CP ranks"
        )
    r2g = np.asarray(placement.rank2gpu)
    for gi, ranks in enumerate(par.stage_ep_groups[0]):
        hosts = [int(cl.gpu2host[int(r2g[r])]) for r in ranks]
        runs: list[list[int]] = []
        for h in hosts:
            if runs and runs[-1][0] == h:
                runs[-1][1] += 1
            else:
                runs.append([h, 1])
        if len(runs) != len({h for h, _ in runs}) or len({n for _, n in runs}) != 1:
            shown = ", ".join(f"{cl.host_name(h)}:{n}" for h, n in runs[:6]) + (" ..." if len(runs) > 6 else "")
            return (
                f"sglang: EP group {gi} runs on hosts (host:consecutive EP ranks) {shown}, but SGLang gives node k "
                "of an engine the EP ranks k*n .. k*n+n-1 (n the same on every node)"
            )
    return None


def parse_sglang_expert_location(doc: dict | str, instance: Instance) -> np.ndarray:
    """(decoder MoE layers, P) ``phy2log`` back from an SGLang expert-location document (MTP
    layers have no row, :func:`sglang_expert_location`).

    Raises
    ------
    InvalidInputError
        When the document is not what SGLang would accept for this model.
    """
    doc = _as_doc(doc, "sglang expert location")
    if set(doc) != {"physical_to_logical_map"}:
        raise InvalidInputError(
            f"sglang: expected exactly the key physical_to_logical_map (SGLang passes the keys to "
            f"init_by_mapping), found {sorted(doc)}"
        )
    m = instance.model
    rows = _int_matrix(doc["physical_to_logical_map"], "sglang: physical_to_logical_map")
    if rows.shape[0] != m.num_layers:
        raise InvalidInputError(
            f"sglang: physical_to_logical_map: expected {m.num_layers} rows (one per transformer "
            f"layer), found {rows.shape[0]}"
        )
    if rows.size and (rows.min() < 0 or rows.max() >= m.num_experts):
        raise InvalidInputError(f"sglang: physical_to_logical_map: expert ids must lie in [0, {m.num_experts})")
    if rows.shape[1] % instance.parallel.ep:
        raise InvalidInputError(
            f"sglang: physical_to_logical_map: {rows.shape[1]} physical slots do not divide over ep={instance.parallel.ep}"
        )
    return rows[[layer for layer in m.moe_layers if layer < m.num_layers]]
