"""Megatron-Core's pipeline layout: parse, validate and render ``pipeline_model_parallel_layout``.

A layout says what every (virtual) pipeline stage holds, one character per item: ``E`` the
embedding, ``t`` a decoder (transformer) layer, ``m`` a multi-token-prediction layer, ``L`` the
loss (final norm, output layer and cross-entropy of the main head and of every MTP head); ``|``
separates stages, ``,`` is cosmetic, ``(...)*n`` and ``x*n`` repeat.  Example: Megatron-Bridge's
DeepSeek-V3 PP16 layout (``src/megatron/bridge/recipes/deepseek/deepseek_v3.py`` of
NVIDIA-NeMo/Megatron-Bridge at 05d003fb) is ``Et*4|(t*4|)*14,tmL``.

The parsed form, a *chunk list*, is a tuple of ``pp * vpp`` strings over ``EtmL`` in Megatron's
order: chunk ``i`` runs on pipeline rank ``i % pp`` as its virtual stage ``i // pp``
(``PipelineParallelLayerLayout.__init__`` in ``megatron/core/transformer/
pipeline_parallel_layer_layout.py`` of megatron-core 0.16.1).  Decoder layers are numbered in chunk
order (``get_layer_offset``), so with ``vpp > 1`` a pipeline rank holds non-contiguous layers.

:func:`validate_chunks` applies the rules of ``validate_layer_layout`` (same package and version)
and raises :class:`~placement.core.model.InvalidInputError` naming the field instead of asserting.
"""

from __future__ import annotations

import re
from dataclasses import replace

from placement.core.model import Instance, InvalidInputError

__all__ = [
    "LAYOUT_ITEMS",
    "parse_layout",
    "render_layout",
    "validate_chunks",
    "legacy_chunks",
    "stage_decoder_layers",
    "chunk_decoder_layers",
    "item_stage",
    "split_into_virtual_stages",
    "chunks_from_counts",
    "with_layout",
    "instance_chunks",
    "stage_items",
    "p2p_bytes_per_boundary",
]

#: The layout characters, as Megatron-Core 0.16.1's ``parse_str_to_list`` maps them.
LAYOUT_ITEMS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
_MAX_EXPANDED = 1_000_000  # characters of an unrolled layout: more is a typo, refused before allocating
_PAREN = re.compile(r"\(([^)]+)\)\*(\d+)")
_SINGLE = re.compile(r"(.)\*(\d+)")


def _unroll(pattern: re.Pattern[str], text: str, field: str) -> str:
    def repl(match: re.Match[str]) -> str:
        n = int(match.group(2))
        if n * len(match.group(1)) > _MAX_EXPANDED:
            raise InvalidInputError(f"{field}: repetition {match.group(0)!r} unrolls past {_MAX_EXPANDED:,} characters")
        return match.group(1) * n

    out = pattern.sub(repl, text)
    if len(out) > _MAX_EXPANDED:
        raise InvalidInputError(f"{field}: the layout unrolls past {_MAX_EXPANDED:,} characters")
    return out


def parse_layout(text: str, field: str = "pipeline_model_parallel_layout") -> tuple[str, ...]:
    """The chunk list of a layout string, unrolled as Megatron-Core 0.16.1 unrolls it.

    Parameters
    ----------
    text : e.g. ``"Ett|(tt|)*14,t|(tt|)*15,mL"``.
    field : the field path named in errors.

    Returns
    -------
    tuple of ``pp * vpp`` strings over ``EtmL`` (a chunk may be empty).

    Raises
    ------
    InvalidInputError
        An unknown character or an absurd repetition.

    Examples
    --------
    >>> parse_layout("Et*3|(tt|)*2,m|L")
    ('Ettt', 'tt', 'tt', 'm', 'L')
    """
    if not isinstance(text, str) or not text:
        raise InvalidInputError(f"{field}: expected a non-empty layout string, found {text!r}")
    s = text.replace(",", "")
    s = _unroll(_PAREN, s, field)
    s = _unroll(_SINGLE, s, field)
    chunks = tuple(s.split("|"))
    for i, chunk in enumerate(chunks):
        bad = [c for c in chunk if c not in LAYOUT_ITEMS]
        if bad:
            raise InvalidInputError(
                f"{field}: invalid layer character {bad[0]!r} in stage {i} ({chunk!r}); known: {', '.join(LAYOUT_ITEMS)}"
            )
    return chunks


def _render_chunk(chunk: str) -> str:
    """``Etttt`` -> ``Et*4``: runs of three or more identical items as ``x*n``."""
    out = []
    for m in re.finditer(r"(.)\1*", chunk):
        run = m.group(0)
        out.append(f"{run[0]}*{len(run)}" if len(run) >= 3 else run)
    return "".join(out)


def render_layout(chunks: tuple[str, ...] | list[str]) -> str:
    """The compact layout string of a chunk list: runs of equal chunks as ``(c|)*n``.

    ``parse_layout(render_layout(c)) == tuple(c)`` for every chunk list over ``EtmL``.

    Examples
    --------
    >>> render_layout(("Ett",) + ("tt",) * 14 + ("t",) + ("tt",) * 15 + ("mL",))
    'Ett|(tt|)*14,t|(tt|)*15,mL'
    """
    chunks = list(chunks)
    if not chunks:
        raise ValueError("render_layout: no chunks")
    parts: list[str] = []
    i = 0
    while i < len(chunks):
        j = i
        while j + 1 < len(chunks) and chunks[j + 1] == chunks[i]:
            j += 1
        n = j - i + 1
        body = _render_chunk(chunks[i])
        last = j == len(chunks) - 1
        if n >= 2 and body:
            # The final run keeps its last chunk outside the repetition (no trailing "|").
            reps = n - 1 if last else n
            parts.append(f"({body}|)*{reps}," if reps >= 2 else f"{body}|")
            parts.append(body if last else "")
        else:
            for k in range(n):
                parts.append(body + ("" if last and k == n - 1 else "|"))
        i = j + 1
    return "".join(parts)


def validate_chunks(chunks: tuple[str, ...], pp: int, num_layers: int, mtp_num_layers: int,
                    field: str = "pipeline_model_parallel_layout") -> int:
    """Check a chunk list against Megatron-Core 0.16.1's rules; return ``vpp``.

    Rules (``PipelineParallelLayerLayout.__init__`` and ``validate_layer_layout``): the number of
    chunks is a multiple of ``pp``; the first item (in chunk order) is ``E`` and the last ``L``,
    each exactly once; ``num_layers`` items ``t`` and ``mtp_num_layers`` items ``m``; no ``t``
    after the first ``m``; MTP only in a pipeline rank's last virtual stage, all MTP layers in one
    chunk.

    Raises
    ------
    InvalidInputError
        Naming ``field`` and the broken rule.
    """
    def fail(msg: str) -> InvalidInputError:
        return InvalidInputError(f"{field}: {msg}")

    if pp < 1 or len(chunks) % pp:
        raise fail(f"{len(chunks)} stages is not a multiple of pp={pp}")
    vpp = len(chunks) // pp
    flat = "".join(chunks)
    if not flat or flat[0] != "E":
        raise fail(f"the first layer must be the embedding E, found {flat[:1]!r}")
    if flat[-1] != "L":
        raise fail(f"the last layer must be the loss L, found {flat[-1]!r}")
    if flat.count("E") != 1 or flat.count("L") != 1:
        raise fail("the embedding E and the loss L must each appear exactly once")
    if flat.count("t") != num_layers:
        raise fail(f"{flat.count('t')} decoder layers t, expected num_layers={num_layers}")
    if flat.count("m") != mtp_num_layers:
        raise fail(f"{flat.count('m')} MTP layers m, expected mtp_num_layers={mtp_num_layers}")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise fail("decoder layers t must all come before the MTP layers m")
    for i, chunk in enumerate(chunks):
        if "m" in chunk:
            if i // pp != vpp - 1:
                raise fail(f"MTP in stage {i} (virtual stage {i // pp} of pipeline rank {i % pp}): Megatron-Core "
                           "keeps MTP in a rank's last virtual stage")
            if chunk.count("m") != mtp_num_layers:
                raise fail("all MTP layers must be in one stage")
    return vpp


def legacy_chunks(stage_layers: tuple[tuple[int, ...], ...], num_layers: int, mtp_num_layers: int) -> tuple[str, ...]:
    """The ``pp`` chunks of an instance without a layout: ``E`` first, MTP and ``L`` last.

    ``stage_layers[s]`` must be contiguous and in order (a layout numbers layers in chunk order).
    """
    chunks = ["t" * sum(1 for x in s if x < num_layers) for s in stage_layers]
    chunks[0] = "E" + chunks[0]
    chunks[-1] = chunks[-1] + "m" * mtp_num_layers + "L"
    return tuple(chunks)


def chunk_decoder_layers(chunks: tuple[str, ...]) -> list[tuple[int, ...]]:
    """(pp * vpp,) the decoder layer indices each chunk holds (numbered in chunk order)."""
    out: list[tuple[int, ...]] = []
    nxt = 0
    for chunk in chunks:
        n = chunk.count("t")
        out.append(tuple(range(nxt, nxt + n)))
        nxt += n
    return out


def stage_decoder_layers(chunks: tuple[str, ...], pp: int) -> tuple[tuple[int, ...], ...]:
    """(pp,) the sorted decoder layer indices each pipeline rank holds over its virtual stages."""
    per = chunk_decoder_layers(chunks)
    return tuple(tuple(sorted(x for i in range(s, len(chunks), pp) for x in per[i])) for s in range(pp))


def item_stage(chunks: tuple[str, ...], pp: int, item: str) -> int:
    """The pipeline rank holding the first ``item`` (``E``, ``m`` or ``L``), or -1 when absent."""
    for i, chunk in enumerate(chunks):
        if item in chunk:
            return i % pp
    return -1


def split_into_virtual_stages(stage_chunks: tuple[str, ...], vpp: int) -> tuple[str, ...]:
    """Spread a ``vpp = 1`` layout over ``vpp`` virtual stages, keeping each rank's contents.

    Rank ``s`` keeps the items of ``stage_chunks[s]``; its decoder layers are split as evenly as
    possible over its virtual stages (earlier ones get the remainder), ``E`` stays in the first
    virtual stage and ``m``, ``L`` go to the last.  Megatron numbers layers in chunk order, so the
    ranks keep their layer counts, not their layer indices.  Used for a recipe written for
    ``vpp = 1`` (Megatron-Bridge's PP16 DeepSeek-V3 layout) run with an instance's ``vpp``.

    Examples
    --------
    >>> split_into_virtual_stages(("Etttt", "tttt", "tmL"), 2)
    ('Ett', 'tt', 't', 'tt', 'tt', 'mL')
    """
    pp = len(stage_chunks)
    out = [[""] * pp for _ in range(vpp)]
    for s, chunk in enumerate(stage_chunks):
        n = chunk.count("t")
        sizes = [n // vpp + (1 if v < n % vpp else 0) for v in range(vpp)]
        for v in range(vpp):
            out[v][s] = ("E" if v == 0 and "E" in chunk else "") + "t" * sizes[v]
        out[vpp - 1][s] += "m" * chunk.count("m") + ("L" if "L" in chunk else "")
    return tuple(c for row in out for c in row)


def chunks_from_counts(counts: list[int], mtp_chunk: int, mtp_num_layers: int) -> tuple[str, ...]:
    """A chunk list with ``counts[i]`` decoder layers in chunk ``i``, ``E`` first, ``L`` last,
    and the MTP layers at the end of chunk ``mtp_chunk`` (ignored when ``mtp_num_layers`` is 0)."""
    chunks = ["t" * n for n in counts]
    chunks[0] = "E" + chunks[0]
    if mtp_num_layers:
        chunks[mtp_chunk] += "m" * mtp_num_layers
    chunks[-1] += "L"
    return tuple(chunks)


def with_layout(instance: Instance, chunks: tuple[str, ...]) -> Instance:
    """``instance`` with the pipeline layout ``chunks`` (its stages' layers re-derived).

    Raises
    ------
    InvalidInputError
        When ``chunks`` breaks Megatron-Core's rules (:func:`validate_chunks`) or the number of
        virtual stages differs from the performance block's ``vpp``.
    """
    par = instance.parallel
    perf = instance.performance
    mtp = perf.architecture.mtp_num_layers if perf is not None else instance.model.mtp_num_layers
    vpp = validate_chunks(tuple(chunks), par.pp, instance.model.num_layers, mtp)
    if perf is not None and vpp != perf.vpp:
        raise InvalidInputError(f"pipeline_model_parallel_layout: {len(chunks)} stages = pp * {vpp}, "
                                f"but performance.vpp is {perf.vpp}")
    parallel = replace(par, pipeline_layout=tuple(chunks), stage_layers=stage_decoder_layers(tuple(chunks), par.pp))
    return replace(instance, parallel=parallel)


def instance_chunks(instance: Instance) -> tuple[str, ...]:
    """The instance's chunk list: its layout, or :func:`legacy_chunks` of its stage layers."""
    par = instance.parallel
    if par.pipeline_layout:
        return par.pipeline_layout
    perf = instance.performance
    mtp = perf.architecture.mtp_num_layers if perf is not None else instance.model.mtp_num_layers
    return legacy_chunks(par.stage_layers, instance.model.num_layers, mtp)


def stage_items(instance: Instance, mtp_num_layers: int) -> list[list[tuple[str, int]]]:
    """(pp,) what each pipeline stage holds, in run order: ``("E", 0)``, ``("t", layer)``,
    ``("m", j)`` (MTP layer ``j``), ``("L", 0)``.

    From ``parallel.pipeline_layout`` (every virtual stage of a rank, in virtual-stage order) or,
    without one, ``stage_layers`` with ``E`` on the first stage and the MTP layers and ``L`` on the
    last.
    """
    par = instance.parallel
    n = instance.model.num_layers
    if not par.pipeline_layout:
        out: list[list[tuple[str, int]]] = [[("t", x) for x in layers if x < n] for layers in par.stage_layers]
        out[0].insert(0, ("E", 0))
        out[-1].extend([("m", j) for j in range(mtp_num_layers)] + [("L", 0)])
        return out
    out = [[] for _ in range(par.pp)]
    layer = mtp = 0
    for i, chunk in enumerate(par.pipeline_layout):
        for c in chunk:
            if c == "t":
                out[i % par.pp].append(("t", layer))
                layer += 1
            elif c == "m":
                out[i % par.pp].append(("m", mtp))
                mtp += 1
            else:
                out[i % par.pp].append((c, 0))
    return out


def p2p_bytes_per_boundary(instance: Instance) -> float:
    """Bytes one rank sends across one pipeline boundary per micro-batch, one direction.

    Megatron-Core sends the activations ``micro_batch x seq_len / cp x hidden`` in BF16 (2 bytes),
    split over the ``tp`` ranks with sequence parallelism (``p2p_communication.py``,
    ``get_tensor_shapes`` in ``schedules.py``); the backward sends their gradient, the same size.
    """
    par = instance.parallel
    return float(par.micro_batch * par.seq_len / par.cp * instance.model.hidden_size * 2 / par.tp)
