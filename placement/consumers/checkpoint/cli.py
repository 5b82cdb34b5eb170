"""``python -m placement.consumers.checkpoint FORMAT PERMUTATION SRC DST``: permute a checkpoint offline."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from placement.consumers.checkpoint.dcp import DcpStats, permute_dcp
from placement.consumers.checkpoint.megatron_legacy import permute_megatron_legacy
from placement.consumers.checkpoint.orbax import permute_orbax
from placement.core.model import InfeasibleError, InvalidInputError, PlacementError
from placement.core.progress import progress

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m placement.consumers.checkpoint FORMAT PERMUTATION SRC DST``: permute a checkpoint offline."""
    parser = argparse.ArgumentParser(
        prog="python -m placement.consumers.checkpoint",
        description="Renumber the experts of a checkpoint with a permutation written by placement export.",
    )
    parser.add_argument("format", choices=["megatron-torch-dist", "megatron-legacy", "torchtitan-dcp", "orbax"])
    parser.add_argument("permutation", help="the JSON written by placement export --format megatron|torchtitan")
    parser.add_argument("src", help="source checkpoint directory")
    parser.add_argument("dst", help="destination directory (must not exist)")
    parser.add_argument("--layer-offsets", default="", help="megatron-legacy: PP:FIRST_LAYER,... per pipeline rank")
    parser.add_argument(
        "--second-index", choices=["pp", "ep"], default=None, help="megatron-legacy: what NNN of mp_rank_TT_NNN is"
    )
    parser.add_argument(
        "--keep-router", action="store_true", help="DCP formats: move the experts only (for placement.consumers.runtime's map)"
    )
    parser.add_argument(
        "--bucket-layout", default=None,
        help="megatron-torch-dist: the distributed optimizer's bucket layout (dp_reshardable), "
        "from placement.consumers.checkpoint.write_megatron_bucket_layout",
    )
    parser.add_argument("--num-layers", type=int, default=None, help="DCP formats: decoder layers (MTP layer J is num_layers + J)")
    parser.add_argument("--workers", type=int, default=1, help="DCP formats: local processes, one storage file each")
    parser.add_argument(
        "--cache-mb", type=int, default=64, help="DCP formats: MB of source chunks a worker keeps (its memory ceiling)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar (drawn on a terminal only)")
    args = parser.parse_args(argv)
    try:
        if args.format in ("megatron-torch-dist", "torchtitan-dcp"):
            if args.workers < 1 or args.cache_mb < 0:
                raise InvalidInputError(f"--workers {args.workers} / --cache-mb {args.cache_mb}: expected >= 1 / >= 0")
            stats = DcpStats()
            with progress(None, "checkpoint: storage files", "B", quiet=args.quiet, unit_scale=True) as bar:
                changed = permute_dcp(
                    args.src, args.dst, args.permutation,
                    stack="megatron" if args.format == "megatron-torch-dist" else "torchtitan",
                    keep_router=args.keep_router, bucket_layout=args.bucket_layout, num_layers=args.num_layers,
                    workers=args.workers, cache_bytes=args.cache_mb << 20, stats=stats, progress=bar.report,
                )
            if stats.files_skipped:
                print(f"resumed: {stats.files_skipped} of {stats.files_total} storage files were already done", file=sys.stderr)
        elif args.format == "megatron-legacy":
            offsets = {}
            for part in filter(None, args.layer_offsets.split(",")):
                pp, _, first = part.partition(":")
                if not (pp.isdigit() and first.isdigit()):
                    raise InvalidInputError(f"--layer-offsets: expected PP:FIRST_LAYER, found {part!r}")
                offsets[int(pp)] = int(first)
            changed = permute_megatron_legacy(
                args.src, args.dst, args.permutation, layer_offsets=offsets or None, second_index=args.second_index
            )
        else:
            changed = permute_orbax(args.src, args.dst, args.permutation)
    except InfeasibleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except (InvalidInputError, PlacementError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"permuted {len(changed)} entries; wrote {args.dst}")
    return 0
