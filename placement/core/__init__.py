"""The data model at the bottom of the package: instances, placements and the checker.

:mod:`~placement.core.model` (instances, clusters, placements, errors), :mod:`~placement.core.perfdata`
(what a GPU and a model need for step-time figures), :mod:`~placement.core.pipeline_layout`
(Megatron-Core's pipeline layouts), :mod:`~placement.core.replicas` (redundant expert slots),
:mod:`~placement.core.permutation` (expert permutations), :mod:`~placement.core.checker` (the
independent checker every emitted placement passes), :mod:`~placement.core.stats` (routing
statistics), :mod:`~placement.core.dispatch` (the dispatchers' node rules),
:mod:`~placement.core.movecount` (moved experts), :mod:`~placement.core.progress` and the executors
(:mod:`~placement.core.executor`).  Nothing here imports anything above it.
"""
