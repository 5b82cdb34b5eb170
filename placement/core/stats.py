"""Routing statistics of an instance: what to check before trusting a solve on it.

:func:`routing_stats` measures, on the instance's own windows, the statistics that decide how much
a placement can save and how well it carries over: tokens per source and window, expert load skew
(globally and per source), how different the sources are, how strongly a token's experts at one
layer predict its experts at a later layer (co-activation) against independent routing, and how
much the fit and held-out windows differ.  ``placement stats`` prints it; the generator's
calibration (:func:`placement.sources.generator.describe_calibration`) is built from the same functions,
so a synthetic and an imported instance are measured alike.

The per-array statistics below take ``topk``: (num_moe_layers, sources, tokens, top_k) expert
ids, the shape of an instance's ``routing.topk``; each returns one value per MoE layer
(``python -m placement.sources.realroute --stats`` tabulates them for the real instances beside their
generator twins):

- :func:`load_max_mean`: the busiest expert's (token, expert) pairs over the mean.
- :func:`partner_share`: the mean over experts of the share of an expert's co-selections (other
  experts chosen by the same token) taken by its ``top`` most frequent partners; with
  ``null=True`` the same for *independent* routing with the same per-expert loads and number of
  tokens (seeded sampling without replacement), so the ratio measures co-activation beyond what
  loads and sampling noise give.
- :func:`source_tv`: :func:`mean_pairwise_tv` per layer; with ``null=True`` after shuffling
  tokens across sources (a fresh seeded shuffle per layer).
- :func:`load_tv`: the drift between two arrays (two windows, or two checkpoints/instances): total
  variation between their global expert-load distributions.
- :func:`partner_overlap`: the mean over experts of the fraction of its ``top`` partners in one
  array that are also among its ``top`` partners in the other.

Null baselines use a fixed seed, so the result is deterministic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from placement.core.model import Instance

__all__ = [
    "routing_stats", "total_variation", "expert_counts", "mean_pairwise_tv", "coactivation_share", "normalise",
    "routing_drift", "load_max_mean", "partner_share", "source_tv", "load_tv", "partner_overlap",
    "partner_top", "realism_stats",
]


def total_variation(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Total variation between distributions along the last axis."""
    return 0.5 * np.abs(p - q).sum(axis=-1)


def normalise(counts: np.ndarray) -> np.ndarray:
    """Counts to shares along the last axis (an all-zero row stays zero)."""
    return counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1)


def expert_counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """(E,) activations of each expert among ``ids`` (any shape)."""
    return np.bincount(ids.reshape(-1).astype(np.int64), minlength=num_experts)


def source_counts(layer_topk: np.ndarray, num_experts: int) -> np.ndarray:
    """(S, E) activations per source of one layer's ``(S, T, k)`` ids."""
    num_sources, tokens, k = layer_topk.shape
    source = np.repeat(np.arange(num_sources), tokens * k)
    flat = source * num_experts + layer_topk.reshape(-1).astype(np.int64)
    return np.bincount(flat, minlength=num_sources * num_experts).reshape(num_sources, num_experts)


def mean_pairwise_tv(layer_topk: np.ndarray, num_experts: int) -> float:
    """Mean total variation between the expert histograms of all pairs of sources.

    ``layer_topk``: (S, T, k) expert ids of one layer; 0 with one source.
    """
    num_sources = layer_topk.shape[0]
    if num_sources < 2:
        return 0.0
    share = normalise(source_counts(layer_topk, num_experts))
    total = sum(float(total_variation(share[i], share[i + 1 :]).sum()) for i in range(num_sources - 1))
    return total / (num_sources * (num_sources - 1) / 2)


def coactivation_share(first: np.ndarray, later: np.ndarray, num_experts: int, top: int) -> float:
    """Share of the later-layer activations of each expert's tokens on the expert's ``top`` partners.

    ``first``, ``later``: (n, k) expert ids of the same n tokens at two layers.  For expert ``e``
    of the first layer, count the later-layer activations of the tokens routed to ``e``; the
    result is the share of those counts on the ``top`` most frequent later-layer experts, pooled
    over experts (each expert weighted by its load).
    """
    pair = first.astype(np.int64)[:, :, None] * num_experts + later.astype(np.int64)[:, None, :]
    counts = np.bincount(pair.reshape(-1), minlength=num_experts * num_experts).reshape(num_experts, num_experts)
    counts.sort(axis=1)
    return float(counts[:, num_experts - top :].sum() / max(counts.sum(), 1))


def _max_over_mean(counts: np.ndarray) -> np.ndarray:
    return counts.max(axis=-1) / np.maximum(counts.mean(axis=-1), 1e-12)


def routing_stats(instance: Instance, *, distance: int = 1) -> dict[str, Any]:
    """Statistics of the instance's routing windows.

    Parameters
    ----------
    instance : any instance (synthetic or imported); both windows are read.
    distance : MoE-layer distance of the co-activation statistic (1: consecutive MoE layers).

    Returns
    -------
    dict (JSON-ready: numbers and lists only)
        ``sources``, ``moe_layers``, ``tokens_per_source`` ({"fit", "heldout"}).
        ``load_max_over_mean`` (L,): busiest expert over the mean, fit window, all sources pooled.
        ``source_load_max_over_mean`` (L,): the same per source, averaged over sources.
        ``source_tv`` (L,) and ``source_tv_null`` (L,): mean pairwise total variation of the
        sources' expert histograms, and the same after shuffling tokens across sources (what
        sampling noise alone gives at this size).
        ``coactivation`` and ``coactivation_null`` (L - distance,): share of the later layer's
        activations of each expert's tokens on that expert's ``max(1, E // 8)`` most frequent
        partners, and the same with the later layer's tokens shuffled (independent routing with the
        same loads); uniform routing with unlimited tokens gives 1/8.
        ``window_tv`` (L,): total variation between the fit and held-out windows' load histograms.
        ``window_partner_overlap`` (L,): :func:`partner_overlap` (top-8) of the fit and held-out
        windows (empty without a held-out window).
        ``summary``: medians of the per-layer lists (and the means for ``window_tv``).
    """
    if distance < 1:
        raise ValueError(f"distance must be at least 1, got {distance}")
    E = instance.model.num_experts
    fit = instance.routing.topk
    held = instance.routing.heldout_topk
    L, S, T, k = fit.shape
    rng = np.random.default_rng(0)
    top = max(1, E // 8)

    loads = np.stack([expert_counts(fit[i], E) for i in range(L)])  # (L, E)
    per_source = np.stack([source_counts(fit[i], E) for i in range(L)])  # (L, S, E)
    shuffled = rng.permutation(S * T)
    source_tv = [mean_pairwise_tv(fit[i], E) for i in range(L)]
    source_tv_null = [mean_pairwise_tv(fit[i].reshape(S * T, k)[shuffled].reshape(S, T, k), E) for i in range(L)]
    co, co_null = [], []
    for i in range(max(0, L - distance)):
        first = fit[i].reshape(S * T, k)
        later = fit[i + distance].reshape(S * T, k)
        co.append(coactivation_share(first, later, E, top))
        co_null.append(coactivation_share(first, later[rng.permutation(S * T)], E, top))
    if held is not None:
        held_loads = np.stack([expert_counts(held[i], E) for i in range(L)])
        window_tv = total_variation(normalise(loads.astype(float)), normalise(held_loads.astype(float)))
        window_overlap = partner_overlap(fit, held, E).tolist()
        held_tokens = int(held.shape[2])
    else:
        window_tv = np.zeros(0)
        window_overlap = []
        held_tokens = 0

    def med(x: Any) -> float | None:
        return float(np.median(x)) if len(x) else None

    out: dict[str, Any] = {
        "instance": instance.name,
        "sources": int(S),
        "moe_layers": int(L),
        "num_experts": int(E),
        "top_k": int(k),
        "tokens_per_source": {"fit": int(T), "heldout": held_tokens},
        "load_max_over_mean": _max_over_mean(loads).tolist(),
        "source_load_max_over_mean": _max_over_mean(per_source).mean(axis=1).tolist(),
        "source_tv": source_tv,
        "source_tv_null": source_tv_null,
        "coactivation_distance": int(distance),
        "coactivation_partners": int(top),
        "coactivation": co,
        "coactivation_null": co_null,
        "window_tv": window_tv.tolist(),
        "window_partner_overlap": window_overlap,
    }
    out["summary"] = {
        "load_max_over_mean": med(out["load_max_over_mean"]),
        "load_max_over_mean_worst": float(max(out["load_max_over_mean"])),
        "source_load_max_over_mean": med(out["source_load_max_over_mean"]),
        "source_tv": med(source_tv),
        "source_tv_null": med(source_tv_null),
        "coactivation": med(co),
        "coactivation_null": med(co_null),
        "window_tv_mean": float(window_tv.mean()) if window_tv.size else None,
        "window_partner_overlap": med(window_overlap),
    }
    return out


def routing_drift(a: Instance, b: Instance) -> dict[str, Any]:
    """Drift between two instances of the same model (two checkpoints, clusters or recordings).

    Compares the fit windows: ``load_tv`` (L,) (:func:`load_tv`) and ``partner_overlap`` (L,)
    (:func:`partner_overlap`, top-8 partners), with their medians in ``summary``.  Raises
    ``ValueError`` when the expert count or the number of MoE layers differ.
    """
    E = a.model.num_experts
    if b.model.num_experts != E or a.routing.topk.shape[0] != b.routing.topk.shape[0]:
        raise ValueError(
            f"{a.name} and {b.name} differ in shape: {E} vs {b.model.num_experts} experts, "
            f"{a.routing.topk.shape[0]} vs {b.routing.topk.shape[0]} MoE layers"
        )
    tv = load_tv(a.routing.topk, b.routing.topk, E)
    overlap = partner_overlap(a.routing.topk, b.routing.topk, E)
    return {
        "instances": [a.name, b.name],
        "load_tv": tv.tolist(),
        "partner_overlap": overlap.tolist(),
        "summary": {"load_tv": float(np.median(tv)), "partner_overlap": float(np.median(overlap))},
    }


# ---------------------------------------------------------------------------------------------
# Per-array statistics: topk (num_moe_layers, sources, tokens, top_k) -> (num_moe_layers,)
# ---------------------------------------------------------------------------------------------
def load_max_mean(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """(num_moe_layers,) busiest expert's load over the mean load, sources pooled."""
    return np.array([_max_over_mean(expert_counts(layer, num_experts).astype(np.float64)) for layer in topk])


def _coselections(tokens: np.ndarray, num_experts: int) -> np.ndarray:
    """(E, E) counts of tokens that chose both experts (zero diagonal); ``tokens`` (N, k).

    A token that lists an expert twice counts it once (the repeat goes to a discarded id ``E``).
    """
    E = num_experts
    ids = np.sort(tokens.astype(np.int64), axis=1)
    ids[:, 1:][ids[:, 1:] == ids[:, :-1]] = E
    pair = ids[:, :, None] * (E + 1) + ids[:, None, :]
    co = np.bincount(pair.reshape(-1), minlength=(E + 1) * (E + 1)).reshape(E + 1, E + 1)[:E, :E].astype(np.float64)
    np.fill_diagonal(co, 0.0)
    return co


def _top_share(co: np.ndarray, top: int) -> float:
    tot = co.sum(axis=1)
    best = -np.sort(-co, axis=1)[:, :top].sum(axis=1)
    ok = tot > 0
    return float(np.mean(best[ok] / tot[ok]))


def _independent(loads: np.ndarray, n_tokens: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n_tokens, k) independent draws without replacement whose expected loads match ``loads`` (E,).

    Gumbel top-k on ``log w``; ``w`` is refitted a few times so that the sampled inclusion counts
    approach ``loads`` (weights proportional to loads under-represent busy experts in top-k).
    """
    target = loads / loads.sum() * n_tokens * k
    w = np.maximum(loads, 0.5)
    for _ in range(6):
        g = np.log(w)[None, :] + rng.gumbel(size=(n_tokens, loads.size))
        ids = np.argpartition(-g, k - 1, axis=1)[:, :k]
        got = np.maximum(np.bincount(ids.reshape(-1), minlength=loads.size), 0.5)
        w = w * np.maximum(target, 0.5) / got
    g = np.log(w)[None, :] + rng.gumbel(size=(n_tokens, loads.size))
    return np.argpartition(-g, k - 1, axis=1)[:, :k]


def partner_share(topk: np.ndarray, num_experts: int, top: int = 8, null: bool = False, seed: int = 0) -> np.ndarray:
    """(num_moe_layers,) mean share of an expert's co-selections taken by its ``top`` partners."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in topk:
        tokens = layer.reshape(-1, layer.shape[-1])
        if null:
            loads = expert_counts(tokens, num_experts).astype(np.float64)
            tokens = _independent(loads, tokens.shape[0], tokens.shape[1], rng)
        out.append(_top_share(_coselections(tokens, num_experts), top))
    return np.array(out)


def source_tv(topk: np.ndarray, num_experts: int, null: bool = False, seed: int = 0) -> np.ndarray:
    """(num_moe_layers,) :func:`mean_pairwise_tv` of each layer (``null``: tokens shuffled across sources)."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in topk:
        if null:
            S, T, k = layer.shape
            layer = layer.reshape(S * T, k)[rng.permutation(S * T)].reshape(S, T, k)
        out.append(mean_pairwise_tv(layer, num_experts))
    return np.array(out)


def load_tv(a: np.ndarray, b: np.ndarray, num_experts: int) -> np.ndarray:
    """(num_moe_layers,) TV between the global expert-load distributions of ``a`` and ``b`` (drift)."""
    return np.array(
        [
            float(total_variation(normalise(expert_counts(la, num_experts).astype(np.float64)),
                                  normalise(expert_counts(lb, num_experts).astype(np.float64))))
            for la, lb in zip(a, b)
        ]
    )


def partner_overlap(a: np.ndarray, b: np.ndarray, num_experts: int, top: int = 8) -> np.ndarray:
    """(num_moe_layers,) mean fraction of an expert's ``top`` partners shared by ``a`` and ``b``."""
    out = []
    for la, lb in zip(a, b):
        ta = np.argsort(-_coselections(la.reshape(-1, la.shape[-1]), num_experts), axis=1, kind="stable")[:, :top]
        tb = np.argsort(-_coselections(lb.reshape(-1, lb.shape[-1]), num_experts), axis=1, kind="stable")[:, :top]
        out.append(float(np.mean([len(set(x) & set(y)) / top for x, y in zip(ta, tb)])))
    return np.array(out)



def partner_top(num_experts: int) -> int:
    """The partners :func:`realism_stats` counts: the same share of an expert's ``E - 1`` possible
    partners as the top 8 of 63 in the trained 64-expert model (8 for 64 experts, 32 for 256), so that
    the co-activation lift compares across expert counts (with a fixed 8, more experts alone raise it)."""
    return max(1, round(8 * (num_experts - 1) / 63))


def realism_stats(fit: np.ndarray, later: np.ndarray, num_experts: int, layers: np.ndarray | None = None) -> dict[str, float]:
    """Medians over MoE layers of the three statistics that compare routing with the trained model's.

    Parameters
    ----------
    fit : (num_moe_layers, sources, tokens, top_k) the sampled (fit) window.
    later : the same shape but tokens: a later window (held-out) or a later checkpoint's routing.
    num_experts : E.
    layers : indices of the MoE layers to measure (default: all).

    Returns
    -------
    ``load_max_over_mean`` (:func:`load_max_mean` of ``fit``), ``coactivation_lift`` (the
    :func:`partner_share` of ``fit`` over independent routing's, on :func:`partner_top` partners) and
    ``drift_load_tv`` (:func:`load_tv` of ``fit`` against ``later``).
    """
    if layers is not None:
        fit, later = fit[layers], later[layers]
    top = partner_top(num_experts)
    lift = partner_share(fit, num_experts, top=top) / partner_share(fit, num_experts, top=top, null=True)
    return {
        "load_max_over_mean": float(np.median(load_max_mean(fit, num_experts))),
        "coactivation_lift": float(np.median(lift)),
        "drift_load_tv": float(np.median(load_tv(fit, later, num_experts))),
    }
