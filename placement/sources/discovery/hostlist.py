"""Slurm host lists: ``gb[001-018,025]``, ``gb001,gb002``, ``r[1-2]-n[01-04]``.

Hand-written rather than a dependency: the syntax is small (comma-separated names, each with
bracketed ranges or values whose zero padding the lower bound gives; several brackets expand as
a cartesian product, last fastest, as Slurm's ``scontrol show hostnames`` does), and an error
must name the offending token.
"""

from __future__ import annotations

import itertools
import re

from placement.core.model import InvalidInputError

__all__ = ["expand_hostlist", "MAX_HOSTLIST_HOSTS"]

MAX_HOSTLIST_HOSTS = 2**20  # a bound checked before expanding, so "n[0-999999999]" fails early

_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_NAME_CHARS = re.compile(r"[A-Za-z0-9._\-]*")


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise InvalidInputError(f"host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InvalidInputError(f"host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise InvalidInputError(f"host list {text!r}: '[' without ']' (truncated?)")
    parts.append(text[start:])
    return parts


def _values(token: str, body: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InvalidInputError(f"host list: {token!r}: expected numbers or ranges like 001-018 in brackets, found {item!r}")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise InvalidInputError(f"host list: {token!r}: range {item!r} runs backwards")
        if b - a + 1 > MAX_HOSTLIST_HOSTS:
            raise InvalidInputError(f"host list: {token!r}: range {item!r} has more than {MAX_HOSTLIST_HOSTS} hosts")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(f"{v:0{width}d}" for v in range(a, b + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """The host names of a Slurm host list, in its order (duplicates kept).

    Raises
    ------
    InvalidInputError
        Unbalanced brackets, a bad range, characters that are not in host names, too many hosts.
    """
    text = text.strip()
    if not text:
        return []
    hosts: list[str] = []
    for token in _split_top(text):
        if not token:
            raise InvalidInputError(f"host list {text!r}: empty name (two commas in a row?)")
        pieces = _BRACKET.split(token)  # literal, body, literal, body, ..., literal
        literals, bodies = pieces[0::2], pieces[1::2]
        for lit in literals:
            if not _NAME_CHARS.fullmatch(lit):
                raise InvalidInputError(f"host list: {token!r}: unexpected characters in {lit!r}")
        choices = [_values(token, b) for b in bodies]
        total = 1
        for c in choices:
            total *= len(c)
        if len(hosts) + total > MAX_HOSTLIST_HOSTS:
            raise InvalidInputError(f"host list {text[:40]!r}: more than {MAX_HOSTLIST_HOSTS} hosts")
        for combo in itertools.product(*choices):
            name = literals[0] + "".join(v + lit for v, lit in zip(combo, literals[1:]))
            hosts.append(name)
    return hosts
