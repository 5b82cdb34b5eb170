"""The committed ``instances/real_*``: shapes, and how recorded windows become instances.

Byte sizes are DeepSeek-V3's (hidden size 7,168, FP8 dispatch, BF16 combine) so that the bytes
compare with the other committed instances; the routing is the small model's.

=====================  ===========================================================================
instance               contents
=====================  ===========================================================================
``real_ep64``          wide EP: one EP-64 group (TP1 CP1 PP1 EP64 DP64) on 4 domains of 4 trays x
                       4 GPUs, all free (the layout is forced, only the expert maps matter);
                       sampled window 0 and held-out window 1, both routed by the final checkpoint
``real_ep64_c10``      the same shape and the same bytes, both windows routed by the checkpoint
``real_ep64_c50``      at 10 % (50 %) of training: with ``real_ep64`` a time-ordered series
``real_drift``         the same shape: sampled = window 0 at 10 % of training, held-out = window 1
                       of the final checkpoint (fit early, run late)
``real_robust``        the same shape, two time-ordered sampled windows (``routing.window_tokens``):
                       window 0 at 10 % and at 50 % of training; held-out = window 1 of the final
                       checkpoint (:func:`assemble_robust` writes it from the committed files)
``real_pp_frag``       fragmented racks and pipeline parallelism: TP1 CP1 PP2 EP32 DP64 (128
                       ranks) on 3 NVL72 racks with 20 trays down unevenly (136 GPUs free)
=====================  ===========================================================================

Each checkpoint's windows are stored as a whole instance (``real_ep64_c10``, ``real_ep64_c50``,
``real_ep64``); ``routing.generator.series`` lists them in time order, and ``real_robust`` holds
the first two's sampled windows as one instance's time-ordered windows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from placement.formats import write_instance
from placement.core.model import (
    Cluster,
    Instance,
    MoEModel,
    ParallelLayout,
    Routing,
    combine_bytes_bf16,
    dispatch_bytes_fp8,
)
from placement.sources.realroute.corpus import Corpus, load_corpus
from placement.sources.realroute.record import TrainConfig, WindowSpec, draw_window, record_window, train

if TYPE_CHECKING:
    from placement.sources.realroute.moe import MoEConfig

__all__ = ["LayoutSpec", "EP64", "PP_FRAG", "build_all", "SERIES", "ROBUST_SERIES", "windows_instance",
           "robust_instance", "assemble_robust"]

HIDDEN_SIZE = 7168  # DeepSeek-V3, for the byte sizes only
SERIES = ("real_ep64_c10", "real_ep64_c50", "real_ep64")
#: ``real_robust``: the sampled windows of the 10 % and 50 % checkpoints, held-out from the final model.
ROBUST_SERIES = ("real_ep64_c10", "real_ep64_c50")


@dataclass(frozen=True)
class LayoutSpec:
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    stage_sizes: tuple[int, ...]
    num_domains: int
    trays_per_domain: int
    gpus_per_tray: int
    trays_down: int
    down_weights: tuple[float, ...]  # relative chance of a down tray in each domain (uneven)
    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int = 1024


EP64 = LayoutSpec(1, 1, 64, 64, 1, (6,), 4, 4, 4, 0, (1.0, 1.0, 1.0, 1.0))
PP_FRAG = LayoutSpec(1, 1, 32, 64, 2, (3, 3), 3, 18, 4, 20, (0.5, 0.3, 0.2))

EP64_WINDOWS = WindowSpec(seed=64, num_sources=64, sequences_per_source=8, tokens_per_sequence=32)
PP_FRAG_WINDOWS = WindowSpec(seed=32, num_sources=64, sequences_per_source=8, tokens_per_sequence=32)
HELDOUT_SEQUENCES = 4  # of the held-out window, per source


def _digits(kinds: np.ndarray) -> list[str]:
    """Per source, the kind index of each recorded sequence as one string of digits."""
    return ["".join(str(int(k)) for k in row) for row in kinds]


def _down_trays(spec: LayoutSpec, seed: int) -> list[int]:
    rng = np.random.default_rng([seed, 4])
    n = spec.num_domains * spec.trays_per_domain
    w = np.repeat(np.asarray(spec.down_weights, dtype=np.float64), spec.trays_per_domain)
    return sorted(int(h) for h in rng.choice(n, size=spec.trays_down, replace=False, p=w / w.sum()))


def _instance(
    name: str,
    description: str,
    spec: LayoutSpec,
    model_cfg: MoEConfig,
    topk: np.ndarray,
    held: np.ndarray,
    seed: int,
    provenance: dict[str, Any],
) -> Instance:
    assert sum(spec.stage_sizes) == model_cfg.num_layers and len(spec.stage_sizes) == spec.pp
    bounds = np.cumsum((0,) + spec.stage_sizes)
    model = MoEModel(
        name="realroute-moe-64e",
        num_layers=model_cfg.num_layers,
        moe_layers=tuple(range(model_cfg.first_moe_layer, model_cfg.num_layers)),
        num_experts=model_cfg.num_experts,
        top_k=model_cfg.top_k,
        num_groups=model_cfg.num_groups,
        groups_per_token=model_cfg.groups_per_token,
        hidden_size=HIDDEN_SIZE,
        dispatch_bytes_per_token=dispatch_bytes_fp8(HIDDEN_SIZE),
        combine_bytes_per_token=combine_bytes_bf16(HIDDEN_SIZE),
    )
    parallel = ParallelLayout(
        tp=spec.tp,
        cp=spec.cp,
        ep=spec.ep,
        dp=spec.dp,
        pp=spec.pp,
        order="tp-cp-ep-dp-pp",
        stage_layers=tuple(tuple(range(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])),
        seq_len=spec.seq_len,
        micro_batch=spec.micro_batch,
        global_batch=spec.global_batch,
    )
    available = np.ones(spec.num_domains * spec.trays_per_domain * spec.gpus_per_tray, dtype=bool)
    for h in _down_trays(spec, seed):
        available[h * spec.gpus_per_tray : (h + 1) * spec.gpus_per_tray] = False
    cluster = Cluster(
        num_domains=spec.num_domains,
        trays_per_domain=spec.trays_per_domain,
        gpus_per_tray=spec.gpus_per_tray,
        available=available,
        nvlink_gbps=900.0,
        scaleout_gbps=100.0,
    )
    return Instance(
        name=name,
        model=model,
        parallel=parallel,
        cluster=cluster,
        routing=Routing(topk, held),
        cost_mode="per_domain",
        description=description,
        extra={"generator": provenance},
    )


def build_all(
    outdir: str | Path,
    *,
    seed: int = 0,
    steps: int = 500,
    log: Callable[[str], None] = print,
    corpus: Corpus | None = None,
) -> list[Path]:
    """Train, record and write every ``real_*`` instance into ``outdir``; return the JSON paths."""
    from placement.sources.realroute.moe import MoEConfig

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    corpus = corpus or load_corpus()
    model_cfg = MoEConfig()
    train_cfg = TrainConfig(steps=steps, seed=seed)
    checkpoints = train(corpus, model_cfg, train_cfg, log=log)
    steps_of = [s for s, _ in checkpoints]
    base = {
        "function": "placement.realroute",
        "command": "python -m placement.sources.realroute OUTDIR" + ("" if seed == 0 else f" --seed {seed}") + ("" if steps == 500 else f" --steps {steps}"),
        "model": asdict(model_cfg),
        "train": asdict(train_cfg),
        "corpus": corpus.describe(),
        "checkpoint_steps": steps_of,
        "window_sampled": 0,
        "window_heldout": 1,
        "tokens": "per source: sequences of seq_len bytes from the source's text mix; the last tokens_per_sequence of each",
    }

    def windows(wspec: WindowSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        seq0, kinds0 = draw_window(corpus, wspec, 0, model_cfg.seq_len)
        seq1, kinds1 = draw_window(corpus, wspec, 1, model_cfg.seq_len)
        return seq0, seq1[:, :HELDOUT_SEQUENCES], kinds0, kinds1[:, :HELDOUT_SEQUENCES]

    written: list[Path] = []
    emitted: dict[str, Instance] = {}

    def emit(inst: Instance) -> None:
        path = outdir / f"{inst.name}.json"
        write_instance(inst, path)
        written.append(path)
        emitted[inst.name] = inst
        log(f"wrote {path} and {path.with_suffix('.npz').name}")

    # Wide EP: the same bytes routed by every checkpoint.
    s0, s1, k0, k1 = windows(EP64_WINDOWS)
    tps = EP64_WINDOWS.tokens_per_sequence
    routed = [(step, record_window(model_cfg, state, s0, tps), record_window(model_cfg, state, s1, tps)) for step, state in checkpoints]
    kinds_doc = {"kinds": list(corpus.kinds), "sampled_sequence_kinds": _digits(k0), "heldout_sequence_kinds": _digits(k1)}
    shape_doc = {"window": asdict(EP64_WINDOWS), "heldout_sequences_per_source": HELDOUT_SEQUENCES, **kinds_doc}
    final_step = steps_of[-1]
    for name, (step, topk, held) in zip(SERIES, routed):
        frac = step / steps
        emit(
            _instance(
                name,
                f"Recorded routing of placement.realroute's 64-expert model at step {step} of {steps} "
                f"({frac:.0%} of training), wide EP: one EP-64 group on 4 domains of 16 GPUs.",
                EP64,
                model_cfg,
                topk,
                held,
                seed,
                {**base, **shape_doc, "checkpoint_step": step, "heldout_checkpoint_step": step, "series": list(SERIES)},
            )
        )
    # Two time-ordered sampled windows (10 %, 50 %), held-out from the final model (for --fit).
    emit(robust_instance([emitted[n] for n in ROBUST_SERIES], emitted[SERIES[-1]]))
    emit(
        _instance(
            "real_drift",
            f"Drift: sampled window routed at step {routed[0][0]} of {steps} (10% of training), held-out "
            f"window by the final model (step {final_step}); wide EP as real_ep64.",
            EP64,
            model_cfg,
            routed[0][1],
            routed[-1][2],
            seed,
            {**base, **shape_doc, "checkpoint_step": routed[0][0], "heldout_checkpoint_step": final_step, "series": list(SERIES)},
        )
    )
    # Fragmented racks with pipeline parallelism: own windows, final checkpoint.
    s0, s1, k0, k1 = windows(PP_FRAG_WINDOWS)
    tps = PP_FRAG_WINDOWS.tokens_per_sequence
    state = checkpoints[-1][1]
    emit(
        _instance(
            "real_pp_frag",
            "Recorded routing of placement.realroute's 64-expert model (final checkpoint) on fragmented "
            "racks: TP1 CP1 PP2 EP32 DP64 on 3 NVL72 racks with 20 trays down unevenly (136 of 216 free).",
            PP_FRAG,
            model_cfg,
            record_window(model_cfg, state, s0, tps),
            record_window(model_cfg, state, s1, tps),
            seed,
            {
                **base,
                "window": asdict(PP_FRAG_WINDOWS),
                "heldout_sequences_per_source": HELDOUT_SEQUENCES,
                "kinds": list(corpus.kinds),
                "sampled_sequence_kinds": _digits(k0),
                "heldout_sequence_kinds": _digits(k1),
                "checkpoint_step": final_step,
                "heldout_checkpoint_step": final_step,
            },
        )
    )
    return written


def windows_instance(name: str, description: str, sampled: list[Instance], heldout: Instance) -> Instance:
    """One instance with several time-ordered sampled windows, oldest first.

    ``sampled``: instances of one shape whose ``topk`` become the windows (``routing.window_tokens``);
    ``heldout``: the instance whose ``heldout_topk`` scores it.  The first instance gives model,
    layout and cluster; every other must have the same (checked).
    """
    first = sampled[0]
    for inst in [*sampled[1:], heldout]:
        if (inst.model, inst.parallel, inst.cost_mode) != (first.model, first.parallel, first.cost_mode) or not (
            np.array_equal(inst.cluster.available, first.cluster.available)
        ):
            raise ValueError(f"{inst.name}: not the shape of {first.name}")
    assert heldout.routing.heldout_topk is not None
    topk = np.concatenate([np.asarray(i.routing.topk) for i in sampled], axis=2)
    counts = tuple(int(i.routing.topk.shape[2]) for i in sampled)
    gen = dict(first.extra.get("generator", {}))
    gen.update(
        {
            "windows_from": [i.name for i in sampled],
            "window_checkpoint_steps": [i.extra.get("generator", {}).get("checkpoint_step") for i in sampled],
            "heldout_from": heldout.name,
            "heldout_checkpoint_step": heldout.extra.get("generator", {}).get("heldout_checkpoint_step"),
        }
    )
    gen.pop("checkpoint_step", None)
    return Instance(
        name=name,
        model=first.model,
        parallel=first.parallel,
        cluster=first.cluster,
        routing=Routing(topk, heldout.routing.heldout_topk, counts),
        cost_mode=first.cost_mode,
        description=description,
        extra={"generator": gen},
        performance=first.performance,
    )


def assemble_robust(indir: str | Path, outdir: str | Path | None = None) -> Path:
    """Write ``real_robust`` from the committed series in ``indir`` (into ``outdir``, default ``indir``).

    Sampled windows: ``real_ep64_c10``'s and ``real_ep64_c50``'s sampled windows (the same token
    bytes routed at 10 % and 50 % of training), in that order; held-out: ``real_ep64``'s held-out
    window (other bytes, the final model).  No training: the arrays are the committed ones.
    """
    from placement.formats import read_instance

    indir = Path(indir)
    outdir = indir if outdir is None else Path(outdir)
    sampled = [read_instance(indir / f"{n}.json") for n in ROBUST_SERIES]
    final = read_instance(indir / f"{SERIES[-1]}.json")
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "real_robust.json"
    write_instance(robust_instance(sampled, final), path)
    return path


def robust_instance(sampled: list[Instance], final: Instance) -> Instance:
    """``real_robust`` from the 10 % and 50 % instances (their sampled windows) and the final one
    (its held-out window)."""
    steps = [s.extra.get("generator", {}).get("checkpoint_step") for s in sampled]
    return windows_instance(
        "real_robust",
        f"Two time-ordered sampled windows, the same tokens routed at steps {steps[0]} and {steps[1]} of "
        f"placement.realroute's training (10% and 50%); held-out window by the final model; wide EP as real_ep64.",
        sampled,
        final,
    )
