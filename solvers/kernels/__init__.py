"""Shared kernels of the solvers: small, general algorithms with one test suite each.

- :mod:`solvers.kernels.assignment`: items to classes with exact class counts (the slot-expanded
  assignment problem; exact, a sort for two classes).
- :mod:`solvers.kernels.swap`: best-improvement swap search on nets with exact incremental deltas.
- :mod:`solvers.kernels.packing`: longest-processing-time packing with cardinality limits.
- :mod:`solvers.kernels.classes`: domain classes, the EP ranks that share a domain in every EP group.
- :mod:`solvers.kernels.expert_groups`: whether expert maps keep expert groups whole.
- :mod:`solvers.kernels.balanced`: load-balanced expert maps, EPLB-style hierarchical packing.
- :mod:`solvers.kernels.crossings`: crossings of weighted nets and bytes per crossing, both from
  the primitives :mod:`placement.predict.cost` exports.
- :mod:`solvers.kernels.hypergraph`: the Mt-KaHyPar partitioner's runtime and context, KM1, capacity
  repair (shared by the peer :mod:`solvers.kahypar` and the search's partitioner start).
- :mod:`solvers.kernels.drift`: how much of a fitted gain the next routing window keeps.

Kernels know nothing about layers or options: arrays in, arrays out (``bytes_per_crossing`` reads an
instance's sizes only).
"""

from solvers.kernels.assignment import assign_to_counts
from solvers.kernels.balanced import balanced_phy2log
from solvers.kernels.classes import domain_classes
from solvers.kernels.crossings import bytes_per_crossing, net_crossings_of
from solvers.kernels.expert_groups import keeps_expert_groups
from solvers.kernels.packing import lpt_pack
from solvers.kernels.swap import NetSwapSearch

__all__ = ["assign_to_counts", "domain_classes", "bytes_per_crossing", "net_crossings_of", "lpt_pack",
           "NetSwapSearch", "keeps_expert_groups", "balanced_phy2log"]
