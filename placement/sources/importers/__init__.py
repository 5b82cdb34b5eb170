"""Importers of recorded routing statistics: real traces in, a normal instance out.

One module per source and one shared core:

- :mod:`~placement.sources.importers.core`: router calls -> fit and held-out windows (ranks to stages and
  data-parallel sources, stage-local to model layers, split by step, tokens equalised per source);
- :mod:`~placement.sources.importers.megatron`: Megatron-LM's ``router_trace_rank{r}.jsonl`` (streamed);
- :mod:`~placement.sources.importers.sglang`: SGLang ``per_token`` expert distribution dumps;
- :mod:`~placement.sources.importers.vllm`: vLLM ``routed_experts`` captures (writer and reader);
- :mod:`~placement.sources.importers.recorder`: forward hooks that write Megatron's schema from any PyTorch
  router (TorchTitan, Megatron-Core releases without the tracer);
- :mod:`~placement.sources.importers.build`: sections + traces -> :class:`~placement.core.model.Instance`.

``placement import`` and ``placement stats`` are the command-line side; the README section "Bring
your own routing statistics" walks through each stack.
"""

from placement.sources.importers.build import SOURCES, import_instance, read_sections
from placement.sources.importers.core import DEFAULT_MAX_TOKENS_PER_SOURCE, ImportOptions, RouterCall, build_routing

__all__ = [
    "SOURCES",
    "import_instance",
    "read_sections",
    "build_routing",
    "ImportOptions",
    "RouterCall",
    "DEFAULT_MAX_TOKENS_PER_SOURCE",
]
