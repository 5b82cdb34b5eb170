"""Small statistics of a routing array, real or synthetic (numpy only, self-contained).

Every function takes ``topk``: (num_moe_layers, sources, tokens, top_k) expert ids, the shape of
an instance's ``routing.topk``.

- :func:`load_max_mean`: per layer, the busiest expert's (token, expert) pairs over the mean.
- :func:`partner_share`: per layer, the mean over experts of the share of an expert's
  co-selections (other experts chosen by the same token) taken by its ``top`` most frequent
  partners; with ``null=True`` the same statistic for *independent* routing with the same
  per-expert loads and the same number of tokens (seeded sampling without replacement), so the
  ratio of the two measures co-activation beyond what loads and sampling noise give.
- :func:`source_tv`: per layer, the mean over pairs of sources of the total variation between
  their expert-load distributions; with ``null=True`` after shuffling tokens across sources
  (what a fully shuffled loader gives at that sample size).
- :func:`load_tv`: per layer, the total variation between two arrays' global expert-load
  distributions (drift between checkpoints, or window-to-window sampling noise).
- :func:`partner_overlap`: per layer, the mean over experts of the fraction of its ``top``
  partners in one array that are also among its ``top`` partners in another.
"""

from __future__ import annotations

import numpy as np

__all__ = ["load_max_mean", "partner_share", "source_tv", "load_tv", "partner_overlap", "summary"]


def _loads(layer: np.ndarray, num_experts: int) -> np.ndarray:
    return np.bincount(layer.reshape(-1).astype(np.int64), minlength=num_experts).astype(np.float64)


def load_max_mean(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """(num_moe_layers,) busiest expert's load over the mean load."""
    out = []
    for layer in topk:
        c = _loads(layer, num_experts)
        out.append(c.max() / c.mean())
    return np.array(out)


def _coselections(tokens: np.ndarray, num_experts: int) -> np.ndarray:
    """(E, E) counts of tokens that chose both experts (zero diagonal); ``tokens`` (N, k)."""
    onehot = np.zeros((tokens.shape[0], num_experts), dtype=np.float64)
    np.put_along_axis(onehot, tokens.astype(np.int64), 1.0, axis=1)
    co = onehot.T @ onehot
    np.fill_diagonal(co, 0.0)
    return co


def _top_share(co: np.ndarray, top: int) -> float:
    tot = co.sum(axis=1)
    best = -np.sort(-co, axis=1)[:, :top].sum(axis=1)
    ok = tot > 0
    return float(np.mean(best[ok] / tot[ok]))


def _independent(loads: np.ndarray, n_tokens: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n_tokens, k) independent draws without replacement whose expected loads match ``loads``.

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
            tokens = _independent(_loads(tokens, num_experts), tokens.shape[0], tokens.shape[1], rng)
        out.append(_top_share(_coselections(tokens, num_experts), top))
    return np.array(out)


def _tv(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return 0.5 * np.abs(p - q).sum(axis=-1)


def source_tv(topk: np.ndarray, num_experts: int, null: bool = False, seed: int = 0) -> np.ndarray:
    """(num_moe_layers,) mean over source pairs of the TV between their load distributions."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in topk:
        if null:
            S, T, k = layer.shape
            layer = layer.reshape(S * T, k)[rng.permutation(S * T)].reshape(S, T, k)
        c = np.stack([_loads(src, num_experts) for src in layer])
        p = c / c.sum(axis=1, keepdims=True)
        i, j = np.triu_indices(p.shape[0], 1)
        out.append(float(_tv(p[i], p[j]).mean()))
    return np.array(out)


def load_tv(a: np.ndarray, b: np.ndarray, num_experts: int) -> np.ndarray:
    """(num_moe_layers,) TV between the global expert-load distributions of ``a`` and ``b``."""
    out = []
    for la, lb in zip(a, b):
        pa, pb = _loads(la, num_experts), _loads(lb, num_experts)
        out.append(float(_tv(pa / pa.sum(), pb / pb.sum())))
    return np.array(out)


def partner_overlap(a: np.ndarray, b: np.ndarray, num_experts: int, top: int = 8) -> np.ndarray:
    """(num_moe_layers,) mean fraction of an expert's ``top`` partners shared by ``a`` and ``b``."""
    out = []
    for la, lb in zip(a, b):
        ta = np.argsort(-_coselections(la.reshape(-1, la.shape[-1]), num_experts), axis=1, kind="stable")[:, :top]
        tb = np.argsort(-_coselections(lb.reshape(-1, lb.shape[-1]), num_experts), axis=1, kind="stable")[:, :top]
        out.append(float(np.mean([len(set(x) & set(y)) / top for x, y in zip(ta, tb)])))
    return np.array(out)


def summary(topk: np.ndarray, num_experts: int, top: int = 8) -> dict[str, float]:
    """Medians over layers of the statistics above (one routing array)."""
    share = partner_share(topk, num_experts, top)
    share0 = partner_share(topk, num_experts, top, null=True)
    return {
        "load_max_mean": float(np.median(load_max_mean(topk, num_experts))),
        "partner_share": float(np.median(share)),
        "partner_share_null": float(np.median(share0)),
        "partner_share_ratio": float(np.median(share / share0)),
        "source_tv": float(np.median(source_tv(topk, num_experts))),
        "source_tv_null": float(np.median(source_tv(topk, num_experts, null=True))),
    }
