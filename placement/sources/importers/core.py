"""The shared core of the importers: router calls of ranks -> the instance's routing windows.

Every reader (:mod:`~placement.sources.importers.megatron`, :mod:`~placement.sources.importers.sglang`,
:mod:`~placement.sources.importers.vllm`) turns its files into :class:`RouterCall` s, one per router
invocation it recorded: who recorded it (a global rank, or directly a data-parallel source), the
step or forward pass, the layer, and where its ``(tokens, top_k)`` logical expert ids are.  The
readers validate ids while they scan (range, top-k width, distinct experts per token, expert-group
limits), drop padding and map physical to logical ids; :func:`build_routing` then

1. maps each global rank to its (tp, cp, dp, pp) coordinates with the layout's order string
   (Megatron-Core's ``RankGenerator``: first name fastest) and a stage-local layer number to the
   model layer ``stage_layers[pp][local]``; a rank outside the world, a layer its stage does not
   hold, or a layer that is not a MoE layer is an input error naming the file and record;
2. keeps the calls of tensor-parallel index 0 (without sequence parallelism every TP rank routes
   the same tokens, with it each routes a 1/tp slice: either way TP index 0 is a fair sample and
   counting the others would duplicate tokens); all context-parallel ranks of a source count, in
   CP order;
3. checks that every (source, step) covers the same MoE layers with the same number of tokens per
   layer (a token keeps its position across layers, so co-activation survives the import) and, for
   training traces, that every source recorded the same steps;
4. splits the steps in time: the first steps are the fit window (``topk``, what solvers see) and the
   last ``heldout_steps`` steps (default: a quarter, at least one) the held-out window, never by
   shuffling tokens; with ``windows = N > 1`` the fit steps are cut into ``N`` runs of consecutive
   steps (as equal as possible, oldest first), each its own sampled window (``routing.window_tokens``);
5. equalises tokens per source: in each window (each sampled window) every source keeps the same number of tokens, the
   smallest number any source recorded there (capped by ``max_tokens_per_source``), taken evenly
   spaced over the source's token stream (the same positions at every layer), so that no source
   is over-represented and a window spans all its steps.

The scan keeps only a locator per call; ids are read again in the second pass for the tokens kept,
so memory stays proportional to the kept tokens, not to the size of the traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from placement.formats import MAX_ROUTING_IDS
from placement.core.model import InvalidInputError, MoEModel, ParallelLayout, Routing

__all__ = [
    "RouterCall",
    "ImportOptions",
    "ImportResult",
    "IdChecker",
    "build_routing",
    "DEFAULT_MAX_TOKENS_PER_SOURCE",
]

# Tokens kept per source and window unless told otherwise: 16x the committed instances' 128, well
# inside MAX_ROUTING_IDS for DeepSeek-V3 sizes (58 layers x 64 sources x 2048 x 8 = 61 M ids).
DEFAULT_MAX_TOKENS_PER_SOURCE = 2048


@dataclass(frozen=True)
class RouterCall:
    """One router invocation recorded by one rank.

    ``where`` names the file and record for error messages (``path: record 12``).  Exactly one of
    ``rank`` (a global rank) and ``source`` (a data-parallel index, for stacks that record per
    data-parallel rank) is set.  ``layer`` is stage-local when ``local_layer`` is true (Megatron's
    ``decoder.layers.<i>``), else the model layer index.  ``load()`` returns the ``(num_tokens,
    top_k)`` logical expert ids, already validated by the reader.
    """

    where: str
    step: int
    layer: int
    num_tokens: int
    load: Callable[[], np.ndarray] = field(repr=False, compare=False)
    rank: int | None = None
    source: int | None = None
    local_layer: bool = False


@dataclass(frozen=True)
class ImportOptions:
    """How windows are cut: ``heldout_steps`` (None: a quarter of the steps, at least 1), the cap
    on tokens per source and window, and whether all sources share their steps (training steps:
    one split for all; serving forward passes or requests: each source split on its own)."""

    heldout_steps: int | None = None
    max_tokens_per_source: int = DEFAULT_MAX_TOKENS_PER_SOURCE
    aligned_steps: bool = True  # every source recorded the same steps (training); False: per source
    #: time-ordered sampled windows the fit steps are cut into (``routing.window_tokens``); 1 = one
    windows: int = 1


@dataclass(frozen=True)
class ImportResult:
    """The routing windows and a deterministic provenance record (no wall-clock values)."""

    routing: Routing
    provenance: dict


class LoadedIds:
    """A :attr:`RouterCall.load` for ids already in memory: returns them, (tokens, top_k) int64."""

    __slots__ = ("ids",)

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids

    def __call__(self) -> np.ndarray:
        return self.ids


def check_phy2log_map(p2l: np.ndarray, model: MoEModel, where: str, field: str) -> None:
    """Refuse a stack's physical -> logical expert map that does not fit the model.

    ``p2l``: (num_layers, physical experts) logical ids (int64); ``where``: the file (and record);
    ``field``: the map's name in the stack's dump.

    Raises
    ------
    InvalidInputError
        On another shape, or a logical id outside ``[0, num_experts)``.
    """
    if p2l.ndim != 2 or p2l.shape[0] != model.num_layers:
        raise InvalidInputError(
            f"{where}: {field}: expected (num_layers={model.num_layers}, physical experts), found shape {p2l.shape}"
        )
    if p2l.size and (p2l.min() < 0 or p2l.max() >= model.num_experts):
        raise InvalidInputError(f"{where}: {field}: logical ids must lie in [0, {model.num_experts})")


class IdChecker:
    """Validates one call's ``(tokens, top_k)`` logical ids against the model; used by readers."""

    def __init__(self, model: MoEModel) -> None:
        self.model = model

    def check(self, ids: np.ndarray, where: str) -> np.ndarray:
        m = self.model
        if ids.ndim != 2 or ids.shape[1] != m.top_k:
            raise InvalidInputError(f"{where}: expected (tokens, top_k={m.top_k}) expert ids, found shape {ids.shape}")
        if ids.size == 0:
            return ids.astype(np.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= m.num_experts:
            bad = lo if lo < 0 else hi
            raise InvalidInputError(f"{where}: expert id {bad} is outside [0, {m.num_experts}) (model.num_experts)")
        s = np.sort(ids, axis=1)
        if m.top_k > 1 and np.any(s[:, 1:] == s[:, :-1]):
            t = int(np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))[0])
            raise InvalidInputError(f"{where}: token {t} lists the same expert twice")
        if m.group_limited:
            grp = s // m.experts_per_group
            used = 1 + (grp[:, 1:] != grp[:, :-1]).sum(axis=1)
            if used.max() > m.groups_per_token:
                t = int(np.argmax(used))
                raise InvalidInputError(
                    f"{where}: token {t} uses {int(used[t])} expert groups, more than the model's "
                    f"groups_per_token={m.groups_per_token} (check model.num_groups / groups_per_token)"
                )
        return ids.astype(np.int64)


def _even_positions(available: int, keep: int) -> np.ndarray:
    """``keep`` positions spread evenly over ``range(available)`` (deterministic, ascending)."""
    return (np.arange(keep, dtype=np.int64) * available) // keep


def build_routing(
    calls: Iterable[RouterCall],
    model: MoEModel,
    parallel: ParallelLayout,
    options: ImportOptions = ImportOptions(),
    *,
    label: str = "traces",
) -> ImportResult:
    """Build the fit and held-out routing windows from router calls.

    Parameters
    ----------
    calls : the readers' router calls, in file order (order matters within a rank and layer).
    model, parallel : the instance's model and layout (ranks, stages, sources).
    options : window split and token cap.
    label : names the input in messages that concern no single record.

    Returns
    -------
    ImportResult
        ``routing.topk``: (num_moe_layers, dp, fit_tokens, top_k); ``routing.heldout_topk``:
        (num_moe_layers, dp, heldout_tokens, top_k); and the provenance.

    Raises
    ------
    InvalidInputError
        One line naming the file and record (or ``label``) for every inconsistency.
    """
    moe_pos = {layer: i for i, layer in enumerate(model.moe_layers)}
    world = parallel.world_size
    coords = parallel.rank_coords
    l2s = parallel.layer2stage
    skipped_tp = 0
    n_calls = 0
    # (source, step) -> moe position -> list of (cp, sequence number, call)
    table: dict[tuple[int, int], dict[int, list[tuple[int, int, RouterCall]]]] = {}
    first_where: dict[tuple[int, int], str] = {}
    for seq, call in enumerate(calls):
        n_calls += 1
        if call.step < 0:
            raise InvalidInputError(f"{call.where}: step {call.step} is negative")
        if call.rank is not None:
            if not 0 <= call.rank < world:
                raise InvalidInputError(
                    f"{call.where}: rank {call.rank} is outside the parallel layout's {world} ranks "
                    f"(tp*cp*dp*pp = {parallel.tp}*{parallel.cp}*{parallel.dp}*{parallel.pp})"
                )
            tp, cp = int(coords["tp"][call.rank]), int(coords["cp"][call.rank])
            source, stage = int(coords["dp"][call.rank]), int(coords["pp"][call.rank])
            who = f"rank {call.rank} (stage {stage}, data-parallel {source})"
        else:
            assert call.source is not None
            if not 0 <= call.source < parallel.dp:
                raise InvalidInputError(
                    f"{call.where}: data-parallel rank {call.source} is outside the layout's dp={parallel.dp}"
                )
            tp, cp, source, stage = 0, 0, call.source, -1
            who = f"data-parallel rank {source}"
        if call.local_layer:
            if stage < 0:
                raise InvalidInputError(f"{call.where}: a stage-local layer needs a global rank")
            layers = parallel.stage_layers[stage]
            if not 0 <= call.layer < len(layers):
                raise InvalidInputError(
                    f"{call.where}: layer {call.layer} (local to the stage) is out of range: {who} "
                    f"holds {len(layers)} layers (parallel.stage_layers[{stage}])"
                )
            layer = layers[call.layer]
        else:
            layer = call.layer
            held = parallel.pp - 1 if model.is_mtp(layer) else l2s.get(layer)  # MTP: the last stage
            if stage >= 0 and held != stage:
                raise InvalidInputError(
                    f"{call.where}: layer {layer} is not held by {who} (parallel.stage_layers)"
                )
        if layer not in moe_pos:
            raise InvalidInputError(
                f"{call.where}: layer {layer} is not a MoE layer of the model (model.moe_layers)"
            )
        if tp != 0:
            skipped_tp += 1
            continue
        key = (source, call.step)
        table.setdefault(key, {}).setdefault(moe_pos[layer], []).append((cp, seq, call))
        first_where.setdefault(key, call.where)
    if not table:
        raise InvalidInputError(f"{label}: no router records of MoE layers found")

    # Every (source, step) covers every MoE layer with the same number of tokens at each layer.
    L = model.num_moe_layers
    tokens: dict[tuple[int, int], int] = {}
    for key, per_layer in table.items():
        source, step = key
        missing = [model.moe_layers[i] for i in range(L) if i not in per_layer]
        if missing:
            holders = _holders(parallel, source, missing[0])
            raise InvalidInputError(
                f"{first_where[key]}: step {step} of data-parallel rank {source} has records of "
                f"{len(per_layer)} of the {L} MoE layers, none of layer {_few(missing)}{holders}: mixed steps "
                f"with different layer sets, or the traces of a pipeline stage are missing"
            )
        counts = {i: sum(c.num_tokens for _, _, c in lst) for i, lst in per_layer.items()}
        values = sorted(counts.values())
        want = max(values, key=lambda v: (values.count(v), v))  # the majority's count
        for i, n in counts.items():
            if n != want:
                c = per_layer[i][0][2]
                raise InvalidInputError(
                    f"{c.where}: step {step} of data-parallel rank {source} routes {n} tokens at layer "
                    f"{model.moe_layers[i]} but {want} at its other MoE layers: every MoE layer of a step "
                    f"must see the same tokens"
                )
        tokens[key] = want

    sources = sorted({s for s, _ in table})
    missing_sources = [d for d in range(parallel.dp) if d not in sources]
    if missing_sources:
        raise InvalidInputError(
            f"{label}: no records from data-parallel ranks {_few(missing_sources)} of dp={parallel.dp} "
            f"(each source needs the traces of its ranks)"
        )
    steps_of = {d: sorted(st for s, st in table if s == d) for d in sources}
    if options.aligned_steps:
        for d in sources:
            if steps_of[d] != steps_of[0]:
                extra = sorted(set(steps_of[d]) ^ set(steps_of[0]))
                raise InvalidInputError(
                    f"{label}: data-parallel rank {d} recorded steps {_few(steps_of[d])} but rank 0 "
                    f"recorded {_few(steps_of[0])} (differ at step {extra[0]})"
                )
    windows_of: dict[int, dict[str, list[int]]] = {}
    for d in sources:
        steps = steps_of[d]
        if len(steps) < 2:
            raise InvalidInputError(
                f"{label}: data-parallel rank {d} recorded {len(steps)} step; at least 2 are needed "
                f"(fit and held-out windows)"
            )
        held_n = options.heldout_steps if options.heldout_steps is not None else max(1, len(steps) // 4)
        if not 1 <= held_n < len(steps):
            raise InvalidInputError(
                f"--heldout-steps: expected 1..{len(steps) - 1} of the {len(steps)} steps recorded by "
                f"data-parallel rank {d}, found {held_n}"
            )
        windows_of[d] = {"fit": steps[: len(steps) - held_n], "heldout": steps[len(steps) - held_n :]}

    n_win = int(options.windows)
    if n_win > 1:  # cut every source's fit steps into n_win consecutive runs (time order kept)
        for d in sources:
            fit_steps = windows_of[d]["fit"]
            if len(fit_steps) < n_win:
                raise InvalidInputError(
                    f"--windows: {n_win} sampled windows need at least {n_win} fit steps, but data-parallel "
                    f"rank {d} has {len(fit_steps)} (the others are held out)"
                )
            cuts = [len(fit_steps) * i // n_win for i in range(n_win + 1)]
            for w in range(n_win):
                windows_of[d][f"fit{w}"] = fit_steps[cuts[w] : cuts[w + 1]]
    names = ["fit", "heldout"] if n_win <= 1 else [f"fit{w}" for w in range(n_win)] + ["heldout"]
    arrays: dict[str, np.ndarray] = {}
    prov_windows: dict[str, dict] = {}
    for name in names:
        avail = [sum(tokens[(d, st)] for st in windows_of[d][name]) for d in range(parallel.dp)]
        keep = min(min(avail), options.max_tokens_per_source)
        if keep < 1:
            d = int(np.argmin(avail))
            raise InvalidInputError(f"{label}: data-parallel rank {d} routed no token in the {name} window")
        if L * parallel.dp * keep * model.top_k > MAX_ROUTING_IDS:
            fits = max(1, MAX_ROUTING_IDS // (L * parallel.dp * model.top_k))
            raise InvalidInputError(
                f"--max-tokens-per-source: {keep} tokens per source would put {L * parallel.dp * keep * model.top_k:,} "
                f"expert ids in the {name} window, more than an instance holds ({MAX_ROUTING_IDS:,}); use at most {fits}"
            )
        out = np.empty((L, parallel.dp, keep, model.top_k), dtype=np.uint16 if model.num_experts <= 65535 else np.int64)
        for d in range(parallel.dp):
            pos = _even_positions(avail[d], keep)
            for i in range(L):
                out[i, d] = _gather(table, d, i, windows_of[d][name], pos, model.top_k)
        arrays[name] = out
        steps_doc: list[int] | list[list[int]]
        if options.aligned_steps:
            steps_doc = [int(s) for s in windows_of[0][name]]
        else:
            steps_doc = [[int(s) for s in windows_of[d][name]] for d in range(parallel.dp)]
        prov_windows[name] = {
            "steps": steps_doc,
            "tokens_per_source": int(keep),
            "tokens_recorded_per_source": [int(a) for a in avail],
        }
    window_tokens: tuple[int, ...] | None = None
    if n_win > 1:
        window_tokens = tuple(int(arrays[f"fit{w}"].shape[2]) for w in range(n_win))
        arrays["fit"] = np.concatenate([arrays.pop(f"fit{w}") for w in range(n_win)], axis=2)
        sampled_windows = [prov_windows.pop(f"fit{w}") for w in range(n_win)]
        prov_windows = {"sampled": sampled_windows, **prov_windows}  # type: ignore[dict-item]
    provenance = {
        "windows": prov_windows,
        "router_calls": n_calls,
        "router_calls_skipped_tensor_parallel_duplicates": skipped_tp,
        "split": "by step: fit = earlier steps, heldout = the last steps",
        "equalise": "per window, every source keeps the smallest source's token count (capped), evenly spaced",
    }
    if n_win > 1:
        provenance["split"] = (f"by step: {n_win} sampled windows of consecutive earlier steps, oldest first, "
                               "heldout = the last steps")
    return ImportResult(Routing(arrays["fit"], arrays["heldout"], window_tokens), provenance)


def _gather(
    table: dict[tuple[int, int], dict[int, list[tuple[int, int, RouterCall]]]],
    source: int,
    moe_index: int,
    steps: Sequence[int],
    positions: np.ndarray,
    top_k: int,
) -> np.ndarray:
    """The ids at ``positions`` of one source's token stream at one layer over ``steps``.

    The stream is the source's calls in (step, CP rank, file order); only calls holding a kept
    position are loaded.
    """
    out = np.empty((len(positions), top_k), dtype=np.int64)
    start = 0
    for st in steps:
        for _, _, call in sorted(table[(source, st)][moe_index], key=lambda t: (t[0], t[1])):
            stop = start + call.num_tokens
            lo, hi = np.searchsorted(positions, [start, stop])
            if hi > lo:
                ids = call.load()
                if ids.shape != (call.num_tokens, top_k):
                    raise InvalidInputError(f"{call.where}: changed while being read (shape {ids.shape})")
                out[lo:hi] = ids[positions[lo:hi] - start]
            start = stop
    return out


def _holders(parallel: ParallelLayout, source: int, layer: int) -> str:
    """`` (expected from rank r)``: the TP/CP-index-0 rank of ``source`` whose stage holds ``layer``."""
    stage = parallel.layer2stage.get(layer)
    if stage is None:
        return ""
    c = parallel.rank_coords
    hit = np.flatnonzero((c["dp"] == source) & (c["pp"] == stage) & (c["tp"] == 0) & (c["cp"] == 0))
    return f" (expected from rank {int(hit[0])}, stage {stage})" if hit.size else ""


def _few(values: Sequence[int], limit: int = 6) -> str:
    vals = [str(v) for v in values[:limit]]
    return ", ".join(vals) + (f", ... ({len(values)} in all)" if len(values) > limit else "")
