"""What the training and serving stacks read and run.

:mod:`~placement.consumers.export` (placement files in each stack's format),
:mod:`~placement.consumers.launch` and :mod:`~placement.consumers.hostfile` (launch files),
:mod:`~placement.consumers.maxtext` (JAX mesh order), :mod:`~placement.consumers.runtime` and
:mod:`~placement.consumers.replica_runtime` (the expert map inside a running job),
:mod:`~placement.consumers.migrate` (moving experts at a step boundary) and
:mod:`~placement.consumers.checkpoint` (checkpoint rewriting).
"""
