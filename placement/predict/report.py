"""The report every command prints: the evaluator's figures on both windows, priced at each setting.

:func:`report` runs :func:`placement.predict.cost.evaluate` on the sampled and the held-out window and,
when the instance has a ``performance`` block, the step-time model
(:class:`placement.predict.performance.StepTimeModel`) on each; :func:`setting_step_models` and
:func:`band_report` give the low / mid / high band of the uncertain terms and :func:`max_min_regret`
the choice that holds across it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from placement.core.model import Instance, InvalidInputError, Placement
from placement.core.replicas import ReplicaMap
from placement.predict.cost import LayoutIndex, Metrics, evaluate
from placement.predict.performance import SETTINGS, StepTimeModel, performance_settings

__all__ = ["report", "setting_step_models", "band_report", "RegretChoice", "max_min_regret"]


def report(instance: Instance, placement: Placement, replicas: ReplicaMap | None = None) -> dict:
    """Metrics on the sampled and the held-out window, in the instance's cost mode, as one dict.

    Keys of the sampled window are plain (``cross_domain_bytes_per_step``, ...); the held-out
    window's carry the prefix ``heldout_``; per-layer and per-stage arrays are included.  A
    placement that carries a pipeline layout is scored with it (:mod:`placement.core.pipeline_layout`).
    ``replicas``: price these redundant expert slots too (:func:`evaluate`); their map must extend
    ``placement.phy2log``.
    """
    if replicas is not None:
        from placement.predict.replica_cost import check_replica_map

        check_replica_map(instance, replicas)
        bad = replicas.problems(placement.phy2log)
        if bad:
            raise InvalidInputError(bad[0])
    if placement.pipeline_layout:
        from placement.core.pipeline_layout import with_layout

        instance = with_layout(instance, placement.pipeline_layout)
    layout = LayoutIndex(instance, placement.rank2gpu, instance.routing.tokens_per_source)
    out: dict = {}
    sampled = evaluate(instance, placement, window="sampled", layout=layout, replicas=replicas).to_dict()
    out.update(sampled)
    if instance.routing.heldout_topk is not None:
        held = evaluate(instance, placement, window="heldout", layout=layout, replicas=replicas).to_dict()
        for key, value in held.items():
            if key not in ("cost_mode", "window"):
                out[f"heldout_{key}"] = value
    out.pop("window", None)
    if instance.performance is not None:  # predicted step time (placement.predict.performance)
        step_model = StepTimeModel(instance)
        models = setting_step_models(instance)
        out.update(step_model.predict_metrics(Metrics(**sampled), placement.rank2gpu).to_dict())
        out.update(band_report(models, Metrics(**sampled), placement.rank2gpu))
        if instance.routing.heldout_topk is not None:
            out.update(step_model.predict_metrics(Metrics(**held), placement.rank2gpu).to_dict("heldout_"))
            out.update(band_report(models, Metrics(**held), placement.rank2gpu, "heldout_"))
    return out


# ---------------------------------------------------------------------------------------------
# The step-time model's uncertainty: a low / mid / high band, and the max-min-regret choice
# ---------------------------------------------------------------------------------------------
def setting_step_models(instance: Instance) -> dict[str, StepTimeModel]:
    """One :class:`~placement.predict.performance.StepTimeModel` per setting of the uncertain terms
    (:data:`placement.predict.performance.SETTINGS`: ``low``, ``mid``, ``high``;
    :func:`placement.predict.performance.performance_settings`), in that order.

    Raises
    ------
    ValueError
        The instance has no ``performance`` block.
    """
    if instance.performance is None:
        raise ValueError(f"instance {instance.name!r} has no performance block")
    variants = performance_settings(instance.performance)
    return {name: StepTimeModel(instance, variants[name]) for name in SETTINGS}


def band_report(models: Mapping[str, StepTimeModel], metrics: Metrics, rank2gpu: np.ndarray | None,
                prefix: str = "") -> dict[str, float]:
    """``{prefix}predicted_step_time_s_{setting}`` and ``{prefix}predicted_tflops_per_gpu_{setting}``
    of every setting in ``models`` (:func:`setting_step_models`) for one window's ``metrics``."""
    out: dict[str, float] = {}
    for name, model in models.items():
        pred = model.predict_metrics(metrics, rank2gpu)
        out[f"{prefix}predicted_step_time_s_{name}"] = float(pred.step_time_s)
        out[f"{prefix}predicted_tflops_per_gpu_{name}"] = float(pred.tflops_per_gpu)
    return out


@dataclass(frozen=True)
class RegretChoice:
    """What :func:`max_min_regret` chose.

    index : the chosen candidate.
    worst_ratio : (candidates,) each candidate's worst, over the settings, ratio of the best step
        time of that setting to its own (1 = the fastest at every setting).
    best_by_setting : per setting, the candidate with the fastest step at that setting alone.
    """

    index: int
    worst_ratio: list[float]
    best_by_setting: dict[str, int]

    @property
    def differs(self) -> bool:
        """True when some setting alone would choose another candidate than the robust choice."""
        return any(i != self.index for i in self.best_by_setting.values())


def max_min_regret(step_times_s: Sequence[Mapping[str, float]], *, rtol: float = 1e-9) -> RegretChoice:
    """The candidate whose worst ratio to the best candidate of each setting is largest.

    Parameters
    ----------
    step_times_s : per candidate, ``{setting: predicted step seconds}`` (every candidate the same
        settings), in order of preference: within ``rtol`` of the best worst ratio the earlier
        candidate wins.

    Examples
    --------
    >>> c = max_min_regret([{"low": 2.0, "high": 1.0}, {"low": 1.5, "high": 1.2}])
    >>> c.index, c.worst_ratio, c.best_by_setting
    (1, [0.75, 0.8333333333333334], {'low': 1, 'high': 0})
    """
    if not step_times_s:
        raise ValueError("max_min_regret: no candidates")
    settings = list(step_times_s[0])
    best = {s: min(float(t[s]) for t in step_times_s) for s in settings}
    worst = [min(best[s] / float(t[s]) if float(t[s]) > 0 else 1.0 for s in settings) for t in step_times_s]
    top = max(worst)
    index = next(i for i, w in enumerate(worst) if w >= top * (1 - rtol))
    by_setting = {s: next(i for i, t in enumerate(step_times_s) if float(t[s]) <= best[s] * (1 + rtol))
                  for s in settings}
    return RegretChoice(index, worst, by_setting)
