"""The rank layout: which physical GPU runs each rank of the job.

For Megatron-Core and TorchTitan, which accept no expert map, the rank layout is the main lever:
it decides how each EP group spreads over NVLink domains and which data-parallel replica, with its
own routing statistics, sits in which domain.  :func:`plan_layout` maps the job's ranks onto the
available GPUs in four steps (docs/layout.md has the walk-through, a map of the modules and the
measurements behind the constants).

Step 1, blocks (:mod:`.blocks`).  The ranks of a pipeline stage split into *blocks*: the smallest
    sets of ranks closed under "same TP x CP group" (the ``tp*cp`` ranks of one data-parallel
    replica, kept inside a tray, or a domain when wider than a tray) and "same EP group".  With the
    default order ``tp-cp-ep-dp-pp`` and ``tp*cp`` dividing ``ep`` a block is one EP group.  A
    block whose ranks all sit in one NVLink domain moves no byte across domains.
Step 2, footprints, jointly with the experts at domain granularity.  A block's *shape*
    (:mod:`.shapes`) is the multiset of its GPU counts per domain (tray-granular where the free
    GPUs allow it).  A shape is priced by placing experts on its parts (:mod:`.experts_on_parts`:
    an assignment-problem start and a swap search with exact incremental deltas) for a few MoE
    layers spread over the model, so its price already contains the best expert placement found
    for it (:mod:`.scorer`, built on :mod:`placement.predict.cost`'s primitives); a block pays that price
    per layer times its stage's MoE layers.  A MILP (:mod:`.milp`, HiGHS through
    ``scipy.optimize.milp``) picks one shape per block and its domains under the domains'
    free-GPU capacities; shapes are priced lazily, column-generation style (:mod:`.pricing`), and
    every straddling (block, shape) a round picks is scored exactly before the next round.

    Objectives.  ``bottleneck`` minimises the slowest stage's all-to-all time (per layer the busier
    of its busiest NIC and its NVLink floor, summed over the stage), total bytes as a tie-breaker.
    ``total`` (the default) minimises total cross-domain bytes per step *subject to no stage being
    slower than the default layout's slowest stage* (on the estimator): a bytes-optimal footprint
    may leave a 4-GPU sliver of an EP group in another rack, whose few NICs then carry the stage's
    whole cross-rack traffic.

    Candidates (:mod:`.candidates`).  Complete layouts are scored on the estimator and compete at
    the end: the ``default`` layout, ``packed`` (:func:`solvers.packed.packed_rank2gpu`, whole EP
    groups packed into racks, best fit), ``first_fit`` (blocks with most MoE layers first, each
    into the tightest domain that holds it), under group-preserving maps ``first_fit, whole expert
    groups`` (first fit in parts of one group position, so no group position straddles domains),
    the MILP's pick and the pick with moved replicas (Step 3).  The default and packed layouts are scored before anything else, whatever the
    budget, so the layout returned at any limit is never worse than either on the estimator.
Step 3, data-parallel sources (:mod:`.replicas`).  On a straddling block, replicas and experts
    are alternated (replicas to parts by an assignment problem, experts placed again) until neither
    improves; the moved replicas are kept only if no worse on held-back validation tokens.  Under
    group-preserving maps whole group positions' replicas move together (across racks too), so
    the positions' make-ups, and with them the experts' parts, stay realisable.
Step 4, concrete GPUs.  Each block's parts get whole free trays of their domain first, in tray
    order, so TP/CP groups stay inside a tray; parts are laid out as consecutive EP-rank slices
    (larger parts first), so under ``consumer`` ``deepep``/``hybridep`` (equal shapes only) every
    EP group holds equal consecutive slices per domain by construction (:mod:`.rules`).

The choice.  Among the candidates within the cap, the best on the objective; then the evaluator
has the last word on time: the chosen layout with its expert map must have
``placement.predict.cost.evaluate(...).alltoall_time_s_per_step`` no larger than the default layout's as
the ``default`` solver gives it (contiguous experts), else the next candidate is checked, and the
default layout with contiguous experts always passes.  Each stage and layer gets one expert map
(the costliest block's); the estimate scores every EP group of the stage with it, so its bytes
are the evaluator's; its times are close but not exact (the NVLink floor of the contiguous map).
Under ``step_time`` (the default objective, an instance with a ``performance`` block) the search
runs for ``total`` and for ``bottleneck`` on a split budget and ALL candidates are ranked by the
predicted step time (:class:`placement.predict.performance.StepTimeModel` on the evaluator's metrics of the
candidate with its map re-dealt inside classes), bytes breaking ties; the default layout with
contiguous experts is among them (docs/layout.md, step 11).

Determinism and the clock (:mod:`.budget`).  The layout's work is sized by a deterministic budget
(``LAYOUT_WORK_SHARE * options.time_limit_s`` predicted seconds): every optional step is started
only if its *predicted* cost fits what is left, predicted from sizes and counts, never from the
clock; HiGHS gets a node limit and every other step is a pure function of its inputs.  The
wall-clock deadline and stop requests are the safety net, polled between steps and between the
layers of every scoring; when it fires the log says so (a warning) and
``LayoutPlan.wall_clock_cut`` is set, but the placement file records no wall-clock fact.
"""

from __future__ import annotations

from solvers.layout.blocks import Block, layout_blocks, stage_footprints
from solvers.layout.candidates import estimate_layout
from solvers.layout.experts_on_parts import PartPlacement, place_on_parts
from solvers.layout.milp import FootprintModel
from solvers.layout.plan import LAYOUT_TIME_SHARE, LAYOUT_WORK_SHARE, LayoutPlan, plan_layout
from solvers.layout.scorer import BlockScorer, ShapeScore
from solvers.layout.shapes import shape_candidates

__all__ = [
    "LayoutPlan",
    "Block",
    "PartPlacement",
    "ShapeScore",
    "FootprintModel",
    "layout_blocks",
    "place_on_parts",
    "shape_candidates",
    "BlockScorer",
    "stage_footprints",
    "estimate_layout",
    "plan_layout",
    "LAYOUT_TIME_SHARE",
    "LAYOUT_WORK_SHARE",
]
