"""Training text that ships with the operating system and the Python interpreter (numpy only).

Six *kinds* of text, each read in sorted path order and cut at ``max_bytes_per_kind``:

=============  ====================================================================================
kind           files
=============  ====================================================================================
``prose``      Python's language and library reference (``pydoc_data/topics.py`` of the stdlib)
``legal``      ``/usr/share/common-licenses/*`` and ``/usr/share/doc/*/copyright``
``python``     the standard library's top-level ``*.py`` modules
``c``          ``/usr/include/*.h``
``man_en``     English manual pages, ``/usr/share/man/man1/*.gz`` (troff source)
``man_intl``   German, French and Spanish manual pages, ``/usr/share/man/{de,fr,es}/man1/*.gz``
=============  ====================================================================================

The bytes of every kind are hashed (``Corpus.sha256``); the recorded instances keep the hashes,
so a regeneration on a machine with different files is visible in the provenance.
"""

from __future__ import annotations

import gzip
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["KINDS", "Corpus", "load_corpus"]

KINDS: tuple[str, ...] = ("prose", "legal", "python", "c", "man_en", "man_intl")


def _kind_files(kind: str) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if kind == "prose":
        return [stdlib / "pydoc_data" / "topics.py"]
    if kind == "legal":
        lic = sorted(p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())
        return lic + sorted(Path("/usr/share/doc").glob("*/copyright"))
    if kind == "python":
        return sorted(stdlib.glob("*.py"))
    if kind == "c":
        return sorted(Path("/usr/include").glob("*.h"))
    if kind == "man_en":
        return sorted(Path("/usr/share/man/man1").glob("*.gz"))
    if kind == "man_intl":
        return [p for lang in ("de", "fr", "es") for p in sorted(Path(f"/usr/share/man/{lang}/man1").glob("*.gz"))]
    raise ValueError(f"unknown text kind {kind!r}")


def _read(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, gzip.BadGzipFile):
        return b""


@dataclass(frozen=True)
class Corpus:
    """``texts[k]``: (n_k,) uint8 bytes of kind ``KINDS[k]``; ``sha256[k]`` their hash."""

    kinds: tuple[str, ...]
    texts: tuple[np.ndarray, ...]
    sha256: tuple[str, ...]

    def describe(self) -> dict[str, dict[str, object]]:
        return {k: {"bytes": int(t.size), "sha256": h} for k, t, h in zip(self.kinds, self.texts, self.sha256)}


def load_corpus(max_bytes_per_kind: int = 1_000_000) -> Corpus:
    """Read every kind (see the module docstring), each cut at ``max_bytes_per_kind`` bytes.

    Raises
    ------
    FileNotFoundError
        When a kind has fewer than 64 KiB of text on this machine.
    """
    texts, hashes = [], []
    for kind in KINDS:
        parts: list[bytes] = []
        total = 0
        for path in _kind_files(kind):
            data = _read(path)
            if not data:
                continue
            parts.append(data)
            total += len(data)
            if total >= max_bytes_per_kind:
                break
        blob = b"".join(parts)[:max_bytes_per_kind]
        if len(blob) < 65536:
            raise FileNotFoundError(f"text kind {kind!r}: only {len(blob)} bytes found on this machine")
        texts.append(np.frombuffer(blob, dtype=np.uint8).copy())
        hashes.append(hashlib.sha256(blob).hexdigest())
    return Corpus(KINDS, tuple(texts), tuple(hashes))
