"""TorchTitan training logs, with the job configuration given beside them.

Format strings read in the installed TorchTitan 0.3.0:

- ``torchtitan/components/metrics.py`` ``MetricsProcessor.log``: every ``metrics.log_freq`` steps,
  ``step: {step:2}  loss: {loss:8.5f}  grad_norm: {grad_norm:7.4f}  memory:
  {max_reserved_gib:5.2f}GiB({max_reserved_pct:.2f}%)  tps: {round(tps):,}  tflops: {tflops:,.2f}
  mfu: {mfu:.2f}%`` (``mfu: N/A`` under quantization), each field preceded by an ANSI colour code;
  ``tps`` is tokens per second per GPU (divided by the non-data-parallel size).
- ``torchtitan/distributed/parallel_dims.py`` ``build_mesh``: ``Building device mesh with
  parallelism: pp={}, dp_replicate={}, dp_shard={}, cp={}, tp={}, ep={}`` (resolved sizes:
  ``dp_shard`` is never -1 there).
- ``torchtitan/tools/logging.py``: every line is ``[titan] <asctime> - root - INFO - <message>``.

The job configuration (``--config``) is a TOML file in the layout of the TorchTitan releases that
read TOML (``[model] name, flavor``, ``[training] local_batch_size, global_batch_size, seq_len``,
``[parallelism] ..._degree``).  When the installed TorchTitan has a config-registry function for the
model (``<name>_<flavor>``, e.g. ``deepseek_v3_671b``), the file's ``[training]`` and
``[parallelism]`` keys are passed as overrides to TorchTitan's own ``ConfigManager``, so TorchTitan
checks every key and value; otherwise the TOML is read as it is.  TorchTitan 0.3.0 itself reads no
TOML: its launch arguments (``--module deepseek_v3 --config deepseek_v3_671b --parallelism...``)
may be given as ``--config`` instead, and go to its ConfigManager as they are.  TorchTitan's ``tflops`` counts
FLOPs its own way (``get_dense_model_nparams_and_flops``), so the row carries tokens/s only.
"""

from __future__ import annotations

import contextlib
import io
import importlib
import re
import shlex
import sys
from typing import Any

from placement.core.model import InvalidInputError
from placement.sources.runlogs.common import KNOWN_FAMILIES, Interval, RunRecord

__all__ = ["looks_like", "read", "job_config", "registry_job_config"]

_STEP = re.compile(
    r"\bstep:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)\s+memory:\s*[\d.]+GiB\([\d.]+%\)\s+"
    r"tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*(\S+)"
)
_MESH = re.compile(
    r"Building device mesh with parallelism: pp=(\d+), dp_replicate=(\d+), dp_shard=(\d+), cp=(\d+), tp=(\d+), ep=(\d+)"
)
# (TorchTitan model name, flavor) -> known family.
_FLAVORS = {("deepseek_v3", "671B"): "deepseek_v3", ("qwen3", "235B-A22B"): "qwen3_235b_a22b",
            ("qwen3", "30B-A3B"): "qwen3_30b_a3b"}
_TRAINING_KEYS = ("local_batch_size", "global_batch_size", "seq_len")
_PARALLEL_KEYS = ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                  "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree",
                  "pipeline_parallel_microbatch_size")


def looks_like(lines: list[str]) -> bool:
    return any(_STEP.search(ln) for ln in lines)


def _through_config_manager(doc: dict[str, Any], name: str, flavor: str, where: str) -> dict[str, Any] | None:
    """The training and parallelism values after TorchTitan's ConfigManager has parsed the TOML's
    keys as overrides of the registry config ``<name>_<flavor>``; None when TorchTitan lacks it."""
    try:
        from torchtitan.config.manager import ConfigManager
    except ImportError:
        return None
    fn = f"{name}_{flavor.lower().replace('-', '_')}"
    try:
        registry = importlib.import_module(f"torchtitan.models.{name}.config_registry")
    except ImportError:
        return None
    if not hasattr(registry, fn):
        return None
    args = ["--module", name, "--config", fn]
    for section, keys in (("training", _TRAINING_KEYS), ("parallelism", _PARALLEL_KEYS)):
        for k, v in doc.get(section, {}).items():
            if k in keys:
                args += [f"--{section}.{k}", str(v)]
    return _values(_parse(ConfigManager, args, where))


def _parse(manager: Any, args: list[str], where: str) -> Any:
    """TorchTitan's ``ConfigManager().parse_args(args)``; its refusals as InvalidInputError."""
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            return manager().parse_args(args)
    except SystemExit:  # tyro rejects a key or value and exits
        raise InvalidInputError(f"{where}: TorchTitan's ConfigManager refuses it: {sink.getvalue().strip()[-300:]}") from None
    except (ValueError, TypeError, AssertionError, ImportError) as e:  # its own checks
        raise InvalidInputError(f"{where}: TorchTitan's ConfigManager refuses it: {e}") from None


def _values(cfg: Any) -> dict[str, Any]:
    return {
        **{k: getattr(cfg.training, k) for k in _TRAINING_KEYS},
        **{k: getattr(cfg.parallelism, k) for k in _PARALLEL_KEYS},
    }


def registry_job_config(command: str) -> dict[str, Any]:
    """The values a row needs from TorchTitan 0.3.0's own launch arguments (``--module M --config
    F [--section.key value ...]``, as given to ``torchtitan.train``), parsed by its ConfigManager.
    Precision from the model's converters (``Float8...`` -> fp8, ``MXFP8...`` -> mxfp8)."""
    try:
        from torchtitan.config.manager import ConfigManager
    except ImportError:
        raise InvalidInputError(f"--config {command!r}: reading TorchTitan's launch arguments needs torchtitan installed") from None
    try:
        args = shlex.split(command)
    except ValueError as e:
        raise InvalidInputError(f"--config: {e}") from None
    cfg = _parse(ConfigManager, args, f"--config {command!r}")
    spec = repr(cfg.model_spec)
    converters = ["mx"] if "MXFP8" in spec else ["float8"] if "Float8" in spec else []
    return {"model_name": cfg.model_spec.name, "flavor": cfg.model_spec.flavor, "converters": converters,
            "read_by": "TorchTitan ConfigManager (launch arguments)", **_values(cfg)}


def job_config(path: str) -> dict[str, Any]:
    """The values a row needs from a TorchTitan TOML job configuration (``model_name``,
    ``flavor``, ``converters``, ``read_by`` and the training/parallelism keys)."""
    try:  # tomllib from Python 3.11; the same parser as the tomli package before
        toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    except ImportError:
        raise InvalidInputError(f"{path}: reading TOML needs Python 3.11 or the tomli package") from None
    try:
        with open(path, "rb") as f:
            doc = toml.load(f)
    except OSError as e:
        raise InvalidInputError(f"{path}: cannot read: {e.strerror or e}") from None
    except toml.TOMLDecodeError as e:
        raise InvalidInputError(f"{path}: not TOML: {e}") from None
    model = doc.get("model", {})
    name, flavor = model.get("name"), model.get("flavor")
    if not isinstance(name, str) or not isinstance(flavor, str):
        raise InvalidInputError(f"{path}: [model] name and flavor are missing (the model's shape)")
    values = _through_config_manager(doc, name, flavor, path)
    read_by = "TorchTitan ConfigManager"
    if values is None:
        read_by = "the TOML parser alone (the installed TorchTitan has no registry config for this model)"
        values = {**{k: v for k, v in doc.get("training", {}).items() if k in _TRAINING_KEYS},
                  **{k: v for k, v in doc.get("parallelism", {}).items() if k in _PARALLEL_KEYS}}
    converters = list(model.get("converters", [])) + [s for s in ("float8", "mx") if s in doc]
    return {"model_name": name, "flavor": flavor, "converters": converters, "read_by": read_by, **values}


def read(path: str, lines: list[str], config: str | None, gpus_given: int | None = None) -> RunRecord:
    """A TorchTitan log: its mesh line and step lines, with the TOML job configuration ``config``
    (``gpus_given``: ``--gpus``, for a log without the mesh line and a TOML with ``dp_shard`` -1)."""
    if config is None:
        raise InvalidInputError(f"{path}: a TorchTitan log needs its job configuration: give --config TOML")
    job = registry_job_config(config) if config.lstrip().startswith("--") else job_config(config)
    family = _FLAVORS.get((job["model_name"], job["flavor"]))
    if family is None:
        raise InvalidInputError(
            f"{config}: the model's shape: TorchTitan model {job['model_name']} flavor {job['flavor']} is no known family"
        )
    shape = dict(KNOWN_FAMILIES[family])
    shape["mtp_num_layers"] = 0  # TorchTitan's registry flavors build no MTP layer unless asked
    mesh = None
    for ln in lines:
        m = _MESH.search(ln)
        if m:
            mesh = tuple(int(x) for x in m.groups())
    if mesh is not None:
        pp, dp_rep, dp_shard, cp, tp, ep = mesh
        gpus: int | None = pp * dp_rep * dp_shard * cp * tp
    else:
        pp = int(job.get("pipeline_parallel_degree", 1))
        dp_rep = int(job.get("data_parallel_replicate_degree", 1))
        dp_shard = int(job.get("data_parallel_shard_degree", -1))
        cp, tp = int(job.get("context_parallel_degree", 1)), int(job.get("tensor_parallel_degree", 1))
        ep = int(job.get("expert_parallel_degree", 1))
        if dp_shard < 0 and gpus_given is not None and gpus_given % (pp * dp_rep * cp * tp) == 0:
            dp_shard = gpus_given // (pp * dp_rep * cp * tp)
        gpus = pp * dp_rep * dp_shard * cp * tp if dp_shard > 0 else None
    local = job.get("local_batch_size")
    seq = job.get("seq_len")
    dp = gpus // (pp * cp * tp) if gpus else (dp_rep * dp_shard if dp_shard > 0 else None)
    gbs = job.get("global_batch_size", -1)
    if (gbs is None or gbs < 0) and local is not None and dp is not None:
        gbs = local * dp
    micro = int(job.get("pipeline_parallel_microbatch_size", 1)) if pp > 1 else local
    conv = " ".join(job["converters"])
    precision = "mxfp8" if "mx" in conv else "fp8" if "float8" in conv else "bf16"
    intervals = []
    for ln in lines:
        m = _STEP.search(ln)
        if m:
            loss = float(m.group(2))
            tps = float(m.group(4).replace(",", ""))
            intervals.append(Interval(int(m.group(1)), tps, None, loss != loss or loss in (float("inf"), float("-inf"))))
    return RunRecord(
        path=path,
        stack="TorchTitan",
        gpus=gpus,
        tp=tp,
        cp=cp,
        pp=pp,
        vpp=1,
        ep=ep,
        micro_batch=micro,
        global_batch=gbs if gbs and gbs > 0 else None,
        seq_len=seq,
        precision=precision,
        dispatcher="alltoall",
        overlap="none",
        expert_load="routing",
        shape=shape,
        intervals=intervals,
        measure="tokens_per_s_per_gpu",
        notes=[f"job config {config} read by {job['read_by']}; TorchTitan's EP all-to-all priced as alltoall"],
    )
