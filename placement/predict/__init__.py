"""Prediction: the one evaluator and the step-time model built on it.

:mod:`~placement.predict.cost` (cross-domain bytes, load, the report every command prints),
:mod:`~placement.predict.performance` (step time and TFLOP/s per GPU),
:mod:`~placement.predict.compute` (GEMM-shape compute), :mod:`~placement.predict.calibration` (the
measured ladder, fits and cross-validation), :mod:`~placement.predict.imbalance`,
:mod:`~placement.predict.pipeline_split`, :mod:`~placement.predict.replica_cost` (replicas' price)
and :mod:`~placement.predict.moves` (what a re-placement moves).  Imports only
:mod:`placement.core` and :mod:`placement.formats`.
"""
