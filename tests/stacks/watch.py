"""What the runtime hooks may not do per call: build a tensor from Python data.

:func:`host_tensor_watch` records every ``torch.tensor`` / ``torch.as_tensor`` /
``torch.from_numpy`` call whose caller is ``placement/consumers/runtime.py`` while a block runs (a forward
and backward with the map installed): each such call is a host-to-device copy and a stream sync on
a GPU, and illegal inside CUDA-graph capture.  The stacks' own calls are not counted.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

WATCHED = ("tensor", "as_tensor", "from_numpy")


@contextlib.contextmanager
def host_tensor_watch() -> Iterator[list[str]]:
    """Yield the list the calls made from placement/consumers/runtime.py are appended to (by name)."""
    import torch

    import placement.consumers.runtime

    runtime_file = str(Path(placement.consumers.runtime.__file__).resolve())
    calls: list[str] = []
    originals = {name: getattr(torch, name) for name in WATCHED}

    def watch(name: str, original):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            if str(Path(sys._getframe(1).f_code.co_filename).resolve()) == runtime_file:
                calls.append(name)
            return original(*args, **kwargs)

        return wrapped

    for name, original in originals.items():
        setattr(torch, name, watch(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)
