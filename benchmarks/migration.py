"""Live expert migration: the predicted time of a DeepSeek-V3-sized migration, beside the measured
CPU time of the transfer logic at small scale.

**Predicted** (``instances/dsv3_256.json``: DeepSeek-V3, 58 MoE layers of 256 experts, EP 64 x
DP 64 x PP 4 on 4 NVL72-class racks, NVLink 900 GB/s and 100 GB/s NICs per GPU, the cost model's
bandwidths).  One expert's state is ``P * 14`` bytes, ``P = 3 * 7168 * 2048``: BF16 weights, an
FP32 master copy and Adam's two FP32 moments (616.6 MB; :func:`placement.core.movecount.replica_state_bytes`
with one replica per expert, as this layout has one EP group per stage).  Re-placements that swap
``k`` pairs of experts between two EP ranks in every MoE layer, the partner inside the same rack
(NVLink) or in another rack (NICs), are counted by GPU with :func:`placement.core.movecount.count_moves`:
the busiest GPU's send or receive time is the predicted migration time.  (Under the default layout
the EP group of pipeline stage 0 lies in one rack: its layers have no cross-rack swap.)

**Measured**: :func:`placement.consumers.migrate.migrate` on TorchTitan 0.3.0 ``GroupedExperts`` (``w1``,
``w2``, ``w3`` stacked over local experts, ``torch.optim.Adam`` state after one step), EP =
``--world`` gloo processes on this machine's CPU, ``--layers`` MoE layers of ``--experts``
experts, each expert ``3 * dim * hidden`` FP32 parameters plus two FP32 moments (12 bytes per
parameter); half of each rank's experts swap with the next rank's.  Reported: bytes sent by the
busiest rank, the point-to-point batch's time, the whole call's time (plan, agreement, scratch,
commit, map switch), medians of ``--repeat`` runs, one torch thread per rank.  Loopback gloo on a shared CPU says what the
logic costs, not what NVLink does.

Usage::

    python benchmarks/migration.py [--world 2] [--layers 2] [--experts 8] [--dim 256] [--hidden 512]
                                   [--repeat 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

DSV3_EXPERT_PARAMS = 3 * 7168 * 2048


def predicted(pairs_per_layer: Sequence[int] = (1, 4, 16, 32)) -> list[dict[str, Any]]:
    """Predicted migration times on instances/dsv3_256.json (module docstring)."""
    import placement
    from placement.core.model import Placement
    from placement.core.movecount import count_moves, replica_state_bytes
    from solvers.default import default_placement

    inst = placement.load_instance(ROOT / "instances" / "dsv3_256.json")
    bpr = replica_state_bytes(inst, params=DSV3_EXPERT_PARAMS, sharded_optimizer=False)
    base = default_placement(inst)
    per_rank = inst.experts_per_rank
    groups = inst.parallel.stage_ep_groups  # (pp, G, ep) global ranks
    dom = inst.cluster.gpu2domain[np.asarray(base.rank2gpu)[groups]]  # (pp, G, ep) domain of each EP rank
    rows = []
    for scope in ("nvlink", "cross_rack"):
        for k in pairs_per_layer:
            phy2log = np.array(base.phy2log, copy=True)
            for layer, stage in enumerate(inst.moe_layer2stage):
                d = dom[stage, 0]  # every EP group of the stage has the same shape under the default layout
                free = list(range(d.shape[0]))
                for _ in range(k):  # slot 0 of one EP rank <-> slot 0 of a partner in the same / another rack
                    pair = next(((a, b) for a in free for b in free if a < b and (d[a] == d[b]) == (scope == "nvlink")),
                                None)
                    if pair is None:  # this stage's EP group lies in one rack: no cross-rack move
                        break
                    a, b = pair
                    free.remove(a)
                    free.remove(b)
                    pa, pb = a * per_rank, b * per_rank
                    phy2log[layer, [pa, pb]] = phy2log[layer, [pb, pa]]
            mc = count_moves(inst, base, Placement(base.rank2gpu, phy2log), bytes_per_replica=bpr)
            rows.append({"scope": scope, "pairs_per_layer": k, "moved_experts": mc.moved_replicas,
                         "moved_bytes": mc.moved_bytes, "bytes_per_expert": bpr,
                         "predicted_s": mc.move_time_s})
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one intra-op thread per rank: ranks share the machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torchtitan.models.common.moe import GroupedExperts

    from placement import runtime as rt
    from placement.consumers.migrate import migrate

    per_rank = args.experts // world

    class MoE(torch.nn.Module):  # what migrate reads: routed_experts.inner_experts, a router
        def __init__(self) -> None:
            super().__init__()
            self.router = torch.nn.Linear(args.dim, args.experts, bias=False)
            self.routed_experts = torch.nn.Module()
            self.routed_experts.inner_experts = GroupedExperts(
                GroupedExperts.Config(dim=args.dim, hidden_dim=args.hidden, num_experts=per_rank))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = MoE()

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): Block() for i in range(args.layers)})
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    opt.zero_grad()
    identity = {i: list(range(args.experts)) for i in range(args.layers)}
    live = rt.install_torchtitan(model, identity)
    group = dist.new_group(list(range(world)))
    half = per_rank // 2
    results = []
    for rep in range(args.repeat):
        maps = {}
        for layer in range(args.layers):
            phy2log = list(live.phy2log(layer))
            for r in range(0, world, 2):  # the first half of rank r's slots <-> rank r+1's
                for j in range(half):
                    a, b = r * per_rank + j, (r + 1) % world * per_rank + j
                    phy2log[a], phy2log[b] = phy2log[b], phy2log[a]
            maps[layer] = phy2log
        rep_ = migrate(model, opt, maps, live_map=live, group=group)
        results.append(rep_.to_dict())
    Path(f"{out}.rank{rank}").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measured(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`_worker` on ``args.world`` processes and summarise (module docstring)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "m.json")
        mp.spawn(_worker, args=(args.world, _free_port(), args, out), nprocs=args.world, join=True)
        runs = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.world)]
    per_expert = 3 * args.dim * args.hidden * 12
    sent = max(r[0]["sent_bytes"] for r in runs)
    transfer = statistics.median(max(r[i]["transfer_s"] for r in runs) for i in range(args.repeat))
    total = statistics.median(max(r[i]["total_s"] for r in runs) for i in range(args.repeat))
    return {"world": args.world, "layers": args.layers, "experts": args.experts, "bytes_per_expert": per_expert,
            "moved_experts": runs[0][0]["moved_replicas"], "busiest_rank_sent_bytes": sent,
            "transfer_s_median": transfer, "total_s_median": total,
            "transfer_gbps": sent / transfer / 1e9 if transfer > 0 else None}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.world < 2 or args.world % 2 or args.experts % args.world or args.experts // args.world < 2:
        ap.error("--world must be even and >= 2, with at least 2 experts per rank")
    rows = predicted()
    print("predicted, DeepSeek-V3 (instances/dsv3_256.json), 616.6 MB per expert (BF16 + FP32 master + Adam):")
    print(f"  {'scope':<11} {'pairs/layer':>11} {'experts':>8} {'moved GB':>9} {'predicted s':>12}")
    for r in rows:
        print(f"  {r['scope']:<11} {r['pairs_per_layer']:>11} {r['moved_experts']:>8} {r['moved_bytes'] / 1e9:>9.1f} "
              f"{r['predicted_s']:>12.3f}")
    m = measured(args)
    print(f"measured, CPU gloo, EP {m['world']}, {m['layers']} layers x {m['experts']} experts of "
          f"{m['bytes_per_expert'] / 1e6:.2f} MB (FP32 + Adam): {m['moved_experts']} experts moved, busiest rank "
          f"sent {m['busiest_rank_sent_bytes'] / 1e6:.1f} MB; transfer {m['transfer_s_median'] * 1e3:.1f} ms "
          f"({m['transfer_gbps']:.2f} GB/s), whole call {m['total_s_median'] * 1e3:.1f} ms (medians of {args.repeat})")
    if args.json:
        from placement.formats import atomic_write_text

        atomic_write_text(args.json, json.dumps({"predicted": rows, "measured": m}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
