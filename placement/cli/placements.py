"""``placement evaluate``, ``export``, ``verify`` and ``show``: one placement file each."""

from __future__ import annotations

import argparse
import json
import sys
import time

from placement.cli.common import EXIT_INVALID, EXIT_OK, _one_line
from placement.cli.printing import _summary_lines


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from placement.api import default_placement, evaluate_placement, load_instance, load_placement

    instance = load_instance(args.instance)
    if args.placement == "default":
        placement = default_placement(instance)
        title = f"{instance.name}: default layout"
    else:
        placement = load_placement(instance, args.placement)
        title = f"{instance.name}: {args.placement}"
    t0 = time.perf_counter()
    metrics = evaluate_placement(instance, placement)
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps(metrics, sort_keys=True))
    else:
        print("\n".join(_summary_lines(title, metrics)))
        print(f"  (evaluated in {elapsed:.2f} s)")
    return EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    import warnings

    from placement.api import export_placement
    from placement.consumers.export import LaunchWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LaunchWarning)
        files = export_placement(args.format, args.placement, args.output, args.instance,
                                 keep_router=args.keep_router, apply=args.apply)
    for w in caught:
        if issubclass(w.category, LaunchWarning):
            print(f"placement: warning: {_one_line(str(w.message))}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for path, text in files.items():
        print(f"wrote {path} ({args.format}, {len(text.encode()):,} bytes)")
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from placement.api import verify_placement

    rep = verify_placement(args.instance, args.placement)
    if rep.violations:
        n = len(rep.violations)
        print(f"placement: verify: {n} violation{'s' if n != 1 else ''} in {args.placement}", file=sys.stderr)
        for message in rep.violations:
            print(message, file=sys.stderr)
        return EXIT_INVALID
    print(f"valid: {args.placement} for {args.instance} (checks: {', '.join(rep.checks)})")
    for note in rep.notes:
        print(f"  note: {note}")
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    from placement.api import show_placement

    out = show_placement(args.placement, args.instance, args.output, window=args.window)
    print(f"wrote {out} (rack map, {out.stat().st_size:,} bytes)")
    return EXIT_OK
