"""Train the small MoE on local text, record its routing at checkpoints, write project instances.

Needs the optional ``torch`` extra. The whole run is deterministic for a fixed seed on one machine
(``torch.set_num_threads(1)``, deterministic algorithms, numpy ``default_rng`` for every draw).

Data-parallel sources are domain-sharded loaders: source ``j`` draws its mix over the text kinds
once, ``mix_j ~ Dirichlet(source_mix_concentration * uniform)`` (total concentration), and keeps it in every window and
at every checkpoint. A recorded *window* is, for every source, ``sequences_per_source`` sequences
of ``MoEConfig.seq_len`` bytes, each from a kind drawn from the source's mix at a uniform offset;
the model routes the whole sequence and the recorder keeps the top-k ids of the last
``tokens_per_sequence`` positions of each (full context), sorted ascending within a token.
The same windows (the same bytes) are routed by every checkpoint, so checkpoints differ only by
the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from typing import TYPE_CHECKING, Any, Callable

from placement.sources.realroute.corpus import Corpus

if TYPE_CHECKING:
    from placement.sources.realroute.moe import MoEConfig

__all__ = ["TrainConfig", "WindowSpec", "train", "sample_source_mixes", "draw_window", "record_window"]


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 500
    batch_sequences: int = 8
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    seed: int = 0
    checkpoint_fractions: tuple[float, ...] = (0.1, 0.5, 1.0)


@dataclass(frozen=True)
class WindowSpec:
    """Which bytes a recorded window routes: per source, sequences drawn from its text mix."""

    seed: int
    num_sources: int
    sequences_per_source: int
    tokens_per_sequence: int
    source_mix_concentration: float = 6.0  # total; 6 kinds -> Dirichlet(1, ..., 1), uniform on the simplex


def _torch() -> Any:
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    return torch


def _sequences(corpus: Corpus, kinds: np.ndarray, rng: np.random.Generator, length: int) -> np.ndarray:
    """(len(kinds), length) uint8: one sequence from each given kind at a uniform offset."""
    out = np.empty((len(kinds), length), dtype=np.uint8)
    for i, k in enumerate(kinds):
        text = corpus.texts[int(k)]
        start = int(rng.integers(0, text.size - length))
        out[i] = text[start : start + length]
    return out


def train(
    corpus: Corpus, model_cfg: MoEConfig, cfg: TrainConfig, log: Callable[[str], None] = print
) -> list[tuple[int, dict[str, Any]]]:
    """Train :class:`~placement.sources.realroute.moe.MoELM` on ``corpus``; return ``[(step, state_dict)]``.

    Each step draws ``batch_sequences`` sequences of ``seq_len + 1`` bytes, each from a kind drawn
    uniformly (the global mix); AdamW with linear warm-up and cosine decay; after every optimizer
    step each MoE layer updates its balancing bias from that step's load. ``state_dict`` copies are
    kept after the steps ``round(f * steps)`` for ``f`` in ``checkpoint_fractions``.
    """
    torch = _torch()
    from placement.sources.realroute.moe import MoELM

    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng([cfg.seed, 1])
    model = MoELM(model_cfg)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}], lr=cfg.lr
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * t)))

    keep = sorted({max(1, round(f * cfg.steps)) for f in cfg.checkpoint_fractions})
    out: list[tuple[int, dict[str, Any]]] = []
    model.train()
    for step in range(cfg.steps):
        kinds = rng.integers(0, len(corpus.kinds), size=cfg.batch_sequences)
        seq = torch.from_numpy(_sequences(corpus, kinds, rng, model_cfg.seq_len + 1).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, model_cfg.vocab_size), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for layer in model.moe_layers:
            layer.update_bias()
        if step % 50 == 0 or step + 1 == cfg.steps:
            log(f"step {step + 1}/{cfg.steps} loss {loss.item():.3f} (nats/byte)")
        if step + 1 in keep:
            out.append((step + 1, copy.deepcopy(model.state_dict())))
    return out


def sample_source_mixes(spec: WindowSpec, num_kinds: int) -> np.ndarray:
    """(num_sources, num_kinds) text mix of every source: Dirichlet around the uniform mix."""
    rng = np.random.default_rng([spec.seed, 2])
    alpha = np.full(num_kinds, spec.source_mix_concentration / num_kinds)
    return rng.dirichlet(alpha, size=spec.num_sources)


def draw_window(corpus: Corpus, spec: WindowSpec, window: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of one window: ``(sequences (S, n, seq_len) uint8, kinds (S, n) int)``."""
    mixes = sample_source_mixes(spec, len(corpus.kinds))
    rng = np.random.default_rng([spec.seed, 3, window])
    S, n = spec.num_sources, spec.sequences_per_source
    kinds = np.stack([rng.choice(len(corpus.kinds), size=n, p=mixes[j]) for j in range(S)])
    seqs = np.stack([_sequences(corpus, kinds[j], rng, seq_len) for j in range(S)])
    return seqs, kinds


def record_window(model_cfg: MoEConfig, state: dict[str, Any], sequences: np.ndarray, tokens_per_sequence: int, chunk: int = 16) -> np.ndarray:
    """Route ``sequences`` (S, n, seq_len) with the checkpoint ``state``, ``chunk`` sequences at a time.

    Returns
    -------
    (num_moe_layers, S, n * tokens_per_sequence, top_k) uint8 expert ids, sorted within a token.
    """
    torch = _torch()
    from placement.sources.realroute.moe import MoELM

    model = MoELM(model_cfg)
    model.load_state_dict(state)
    S, n, T = sequences.shape
    flat = torch.from_numpy(sequences.reshape(S * n, T).astype(np.int64))
    ids = torch.cat([model.route(flat[i : i + chunk]) for i in range(0, S * n, chunk)], dim=1).numpy()
    ids = ids.reshape(ids.shape[0], S, n, T, -1)[:, :, :, T - tokens_per_sequence :, :]
    ids = np.sort(ids.reshape(ids.shape[0], S, n * tokens_per_sequence, -1), axis=-1)
    return ids.astype(np.uint8 if model_cfg.num_experts <= 256 else np.uint16)
