"""Run Megatron-Core 0.16.1's ``DistributedOptimizer`` on CPU (child processes only: global patches).

Besides :func:`tests.stacks.tiny.install_cpu_patches`, the optimizer path hard-codes CUDA in three
ways (megatron/core/optimizer/distrib_optimizer.py and optimizer.py, 0.16.1): it allocates small
tensors with ``device='cuda'`` (the found-inf flag, the loss scale), it sorts parameters by
``Tensor.type()`` strings that name CUDA types (``'torch.cuda.FloatTensor'``,
``'torch.cuda.BFloat16Tensor'``), and a checkpoint gather calls ``Tensor.cuda()``.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["install_optimizer_cpu_patches"]


def install_optimizer_cpu_patches() -> None:
    """Redirect ``device='cuda'`` allocations to the CPU, report CPU tensors' ``type()`` as the CUDA
    type names the optimizer expects, and make ``Tensor.cuda()`` a no-op.  For good: child processes only."""
    import torch

    def cpu_device(make: Any) -> Any:
        @functools.wraps(make)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)

        return wrapped

    for factory in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, factory, cpu_device(getattr(torch, factory)))
    plain_type = torch.Tensor.type

    def type_as_cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name or not name.startswith("torch."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_as_cuda  # type: ignore[method-assign,assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign,assignment,misc]
