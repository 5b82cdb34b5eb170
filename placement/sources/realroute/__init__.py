"""A real routing source of the project's own (optional; the training part needs ``torch``).

A small DeepSeek-V3-style MoE (:mod:`placement.sources.realroute.moe`: sigmoid router, 8 expert groups
with group-limited top-8 of 64 experts, aux-loss-free balancing bias, a shared expert) is trained
on CPU on text that ships with the machine (:mod:`~placement.sources.realroute.corpus`); its routing is
recorded at checkpoints per data-parallel source (:mod:`~placement.sources.realroute.record`) and written
as ordinary instances, ``instances/real_*`` (:mod:`~placement.sources.realroute.build`). Regenerate::

    python -m placement.sources.realroute instances/

:mod:`placement.core.stats` (numpy only, the statistics ``placement stats`` prints) measures load
skew, co-activation, source differences and drift of any routing array; ``python -m
placement.sources.realroute --stats`` tabulates them. Importing this package does not import torch.
See docs/real_routing.md.
"""
