"""Where instances and clusters come from.

:mod:`~placement.sources.generator` (synthetic routing), :mod:`~placement.sources.instances` (the
committed instances), :mod:`~placement.sources.importers` (recorded routing from Megatron-Core,
SGLang, vLLM), :mod:`~placement.sources.realroute` (routing of a trained model),
:mod:`~placement.sources.discovery` (Slurm, Kubernetes, nvidia-smi) and
:mod:`~placement.sources.runlogs` (measured runs for the ladder).
"""
