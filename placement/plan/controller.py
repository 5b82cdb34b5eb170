"""Re-place experts during training: record routing, solve off the critical path, migrate when it pays.

(Hot-expert replicas are re-planned inline from a window of recent routing counts:
:class:`ReplicaController`, at the end of this module.)

A :class:`ReplacementController` lives in the training loop of every rank (``after_step(step)``
once per optimizer step).  Every ``every_steps`` steps it runs one cycle:

1. **Record**: the last ``record_steps`` steps before the cycle's end, the project's
   :class:`placement.sources.importers.recorder.RouterRecorder` hooks the routers and writes each rank's
   ``router_trace_rank{r}.jsonl`` (logical expert ids: the live map remaps after the router, in
   Megatron-Core's ``MoELayer.route`` and before TorchTitan's ``routed_experts``, so the router's
   forward hooks see logical ids).
2. **Solve in the background**: rank 0 starts ``python -m placement.plan.controller`` (a separate
   process, so the training process only polls a file): it imports the traces onto the job's base
   instance (:func:`placement.import_routing`), and re-places against the running placement
   (``solve(previous=..., max_moved_bytes=... | move_cost=...)``, ``cpsat``, group-breaking maps:
   the live map is applied at dispatch time) within ``time_limit_s``; the answer and its move
   report are written atomically.  A solve that misses ``time_limit_s + grace_s`` is killed and
   the cycle is skipped.
3. **Apply at a step boundary**: at the first ``after_step`` after the answer is there, rank 0
   decides and broadcasts (one small broadcast per step while a solve is pending): apply when
   the predicted payback (``payback_steps``: the busiest GPU's move time over the predicted step-time
   gain; without a step-time model, ``payback_steps_bytes``: cross-rack bytes moved over
   cross-domain bytes saved per step) is at most ``payback_within_steps``.  Then every rank
   calls :func:`placement.consumers.migrate.migrate` in its EP group.

Each decision is logged (``logging`` logger ``placement.plan.controller``, and on rank 0 one JSON line
per cycle in ``work_dir/controller.jsonl``): the step, the decision and why, what moved (replicas
per layer, bytes), the predicted move time (the move report's ``move_time_s``, from the cluster's
NVLink and NIC bandwidths) and the measured migration time, the predicted gain and payback.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from placement.core.model import InvalidInputError, Placement

__all__ = ["ReplacementController", "ReplicaController", "CycleLog", "solve_request"]

log = logging.getLogger("placement.plan.controller")

Stack = Literal["megatron", "torchtitan"]


@dataclass
class CycleLog:
    """One cycle's record (a line of ``controller.jsonl``)."""

    cycle: int
    step: int
    decision: str  # "applied", "skipped: <why>", "failed: <MigrationError>" (the old placement kept)
    solve: dict[str, Any] = field(default_factory=dict)  # status, objective, moved replicas/bytes, predicted times
    migration: dict[str, Any] = field(default_factory=dict)  # placement.consumers.migrate.MigrationReport.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {"cycle": self.cycle, "step": self.step, "decision": self.decision, "solve": self.solve,
                "migration": self.migration}


def _write_json(path: Path, doc: Any) -> None:
    from placement.formats import atomic_write_text

    atomic_write_text(path, json.dumps(doc, indent=1))


def solve_request(request: dict[str, Any]) -> dict[str, Any]:
    """The background solve: traces + base instance + running placement -> new maps and move report.

    ``request`` keys: ``stack``, ``traces`` (paths), ``base`` (instance JSON), ``rank2gpu``,
    ``phy2log`` ((L, E) running maps), ``time_limit_s``, ``max_moved_bytes`` / ``move_cost``,
    ``expert_params``, ``sharded_optimizer``, ``seed``.
    """
    from placement.api import import_routing, solve

    inst = import_routing(request["stack"], request["traces"], base=request["base"])
    previous = Placement(np.asarray(request["rank2gpu"]), np.asarray(request["phy2log"]))
    result = solve(inst, solver="cpsat", time_limit_s=float(request["time_limit_s"]), seed=int(request.get("seed", 0)),
                   num_workers=int(request.get("num_workers", 1)), group_preserving=False, previous=previous,
                   max_moved_bytes=request.get("max_moved_bytes"), move_cost=request.get("move_cost"),
                   expert_params=request.get("expert_params"),
                   sharded_optimizer=bool(request.get("sharded_optimizer", True)))
    moves = dict(result.details.get("moves", {}))
    return {"moe_layers": list(inst.model.moe_layers), "phy2log": result.placement.phy2log.tolist(),
            "status": result.status, "moves": moves, "solve_s": result.wall_s}


class ReplacementController:
    """Record routing, re-place in the background, migrate at a step boundary (module docstring).

    Parameters
    ----------
    model, optimizer : this rank's model and optimizer (what :func:`placement.consumers.migrate.migrate` takes).
    live_map : the live map ``install_megatron`` / ``install_torchtitan`` returned.
    placement : the job's running :class:`Placement` for ``base`` (``rank2gpu`` and the maps the
        live map holds, one row per MoE layer of the instance).
    base : the instance JSON the job was placed with (model, parallel layout, cluster; its routing
        is replaced by the recorded one).
    stack : ``megatron`` or ``torchtitan`` (routers found and traces read the stack's way).
    work_dir : a folder every rank can write (traces per cycle, requests, answers, the log).
    rank : this process's global rank.
    every_steps, record_steps : a cycle every ``every_steps`` steps, recording its last ``record_steps``.
    time_limit_s : the solve's budget; ``grace_s`` more and it is killed.
    max_moved_bytes, move_cost : the move budget (at most one; ``placement solve --max-moved-bytes
        / --move-cost``).
    payback_within_steps : apply only an answer that pays back its move within this many steps.
    expert_params : parameters per routed expert (default: counted from the model's first MoE layer).
    layers : model layer index of each MoE layer of ``base`` (default ``base``'s ``moe_layers``).
    group : the EP process group for the migration (default: Megatron-Core's).

    Under pipeline parallelism each stage's controller records its own routers, rank 0 solves for
    every stage, and each rank migrates the layers its model holds (``local_layers``); the traces go
    to ``work_dir``, which every rank must be able to write and rank 0 to read.
    """

    def __init__(self, model: Any, optimizer: Any, live_map: Any, *, placement: Placement,
                 base: str | os.PathLike[str], stack: Stack, work_dir: str | os.PathLike[str], rank: int,
                 every_steps: int = 1000, record_steps: int = 20, time_limit_s: float = 60.0, grace_s: float = 30.0,
                 max_moved_bytes: float | None = None, move_cost: float | None = None,
                 payback_within_steps: float = 100.0, expert_params: int | None = None,
                 layers: Sequence[int] | None = None, group: Any = None, seed: int = 0) -> None:
        if stack not in ("megatron", "torchtitan"):
            raise InvalidInputError(f"stack: expected megatron or torchtitan, found {stack!r}")
        if not 0 < record_steps <= every_steps:
            raise InvalidInputError(f"record_steps: expected 1..every_steps ({every_steps}), found {record_steps}")
        self.model, self.optimizer, self.live_map = model, optimizer, live_map
        self.placement, self.base, self.stack = placement, str(base), stack
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.rank = int(rank)
        self.every_steps, self.record_steps = int(every_steps), int(record_steps)
        self.time_limit_s, self.grace_s = float(time_limit_s), float(grace_s)
        self.max_moved_bytes, self.move_cost = max_moved_bytes, move_cost
        self.payback_within_steps = float(payback_within_steps)
        self.group, self.seed = group, seed
        if layers is None:
            from placement.formats import read_instance

            layers = read_instance(self.base).model.moe_layers
        self.layers = [int(x) for x in layers]
        from placement.consumers.migrate import moe_layers_of

        self.local_layers = [layer for layer in moe_layers_of(model) if layer in self.layers]  # this stage's
        if not self.local_layers:
            raise InvalidInputError(f"layers: the model holds none of the instance's MoE layers {self.layers[:6]}")
        if placement.phy2log.shape[0] != len(self.layers):
            raise InvalidInputError(f"placement: phy2log: {placement.phy2log.shape[0]} MoE layers, the instance has "
                                    f"{len(self.layers)}")
        self.expert_params = expert_params if expert_params is not None else self._count_expert_params()
        self.cycle = 0
        self.history: list[CycleLog] = []
        self._recorder: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._solve_log: Any = None
        self._pending: tuple[int, Path, float] | None = None  # (cycle, answer path, kill-after monotonic)

    # -- helpers ---------------------------------------------------------------------------------
    def _count_expert_params(self) -> int:
        from placement.consumers.migrate import _expert_params

        _, params = _expert_params(self.model, self.local_layers[:1])
        slot = params[self.local_layers[0]][0]
        return int(sum(p[0].numel() if row is not None else p.numel() for _, p, row in slot))

    def _routers(self) -> dict[int, Any]:
        from placement.sources.importers.recorder import megatron_routers, torchtitan_routers

        return megatron_routers(self.model) if self.stack == "megatron" else torchtitan_routers(self.model)

    def _cycle_dir(self, cycle: int) -> Path:
        return self.work_dir / f"cycle{cycle}"

    # -- the loop --------------------------------------------------------------------------------
    def after_step(self, step: int) -> CycleLog | None:
        """Call once per optimizer step on every rank, after ``zero_grad`` (a step boundary).

        Returns the cycle's :class:`CycleLog` when a decision was taken at this step, else None.
        """
        from placement.sources.importers.recorder import RouterRecorder

        pos = (step + 1) % self.every_steps
        if self._recorder is not None:
            self._recorder.advance_step()
            if pos == 0:
                self._recorder.close()
                self._recorder = None
                self._launch(step)
        elif pos == (self.every_steps - self.record_steps) % self.every_steps and self._pending is None:
            self._recorder = RouterRecorder(self._cycle_dir(self.cycle), self.rank, self._routers())
        if self._pending is not None and self._recorder is None:
            return self._poll(step)
        return None

    def _launch(self, step: int) -> None:
        import torch.distributed as dist

        cycle, cdir = self.cycle, self._cycle_dir(self.cycle)
        self.cycle += 1
        dist.barrier()  # every rank's trace is on disk
        answer = cdir / "answer.json"
        if self.rank == 0:
            phy2log = self.placement.phy2log  # the running maps of every stage (a stage's live map holds its own)
            request = {"stack": self.stack, "traces": sorted(str(p) for p in cdir.glob("router_trace_rank*.jsonl")),
                       "base": self.base, "rank2gpu": self.placement.rank2gpu.tolist(), "phy2log": phy2log.tolist(),
                       "time_limit_s": self.time_limit_s, "max_moved_bytes": self.max_moved_bytes,
                       "move_cost": self.move_cost, "expert_params": self.expert_params,
                       "sharded_optimizer": True, "seed": self.seed}
            _write_json(cdir / "request.json", request)
            self._solve_log = open(cdir / "solve.log", "wb")
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "placement.plan.controller", str(cdir / "request.json"), str(answer)],
                stdout=subprocess.DEVNULL, stderr=self._solve_log)
        self._pending = (cycle, answer, time.monotonic() + self.time_limit_s + self.grace_s)
        log.info("step %d: cycle %d recorded %d steps; re-placement solve started", step, cycle, self.record_steps)

    def _poll(self, step: int) -> CycleLog | None:
        import torch
        import torch.distributed as dist

        assert self._pending is not None
        cycle, answer, kill_after = self._pending
        # rank 0: 0 = still solving, 1 = apply, 2 = skip
        code, why = 0, ""
        doc: dict[str, Any] | None = None
        if self.rank == 0:
            assert self._proc is not None
            if self._proc.poll() is None and time.monotonic() > kill_after:
                self._proc.kill()
                self._proc.wait()
                code, why = 2, f"the solve missed its deadline ({self.time_limit_s + self.grace_s:.0f} s)"
            elif self._proc.poll() is not None:
                if self._proc.returncode != 0 or not answer.exists():
                    code, why = 2, f"the solve failed (exit {self._proc.returncode}, see {answer.parent / 'solve.log'})"
                else:
                    doc = json.loads(answer.read_text())
                    code, why = self._decide(doc)
        flag = torch.tensor([code], dtype=torch.int64)
        dist.broadcast(flag, src=0)
        if int(flag.item()) == 0:
            return None
        box: list[Any] = [doc, why]
        dist.broadcast_object_list(box, src=0)
        doc, why = box[0], str(box[1])
        self._pending, self._proc = None, None
        self._close_log()
        entry = CycleLog(cycle, step, "applied" if int(flag.item()) == 1 else f"skipped: {why}",
                         solve=self._solve_summary(doc) if doc else {})
        if int(flag.item()) == 1 and doc is not None:
            from placement.consumers.migrate import migrate

            maps = {layer: row for layer, row in zip(self.layers, doc["phy2log"]) if layer in self.local_layers}
            from placement.consumers.migrate import MigrationError

            t0 = time.perf_counter()
            try:
                report = migrate(self.model, self.optimizer, maps, live_map=self.live_map, group=self.group)
            except MigrationError as e:  # every rank raised it; the old placement is intact
                entry.decision = f"failed: {e}"
            else:
                entry.migration = {**report.to_dict(), "measured_migration_s": time.perf_counter() - t0}
                self.placement = Placement(self.placement.rank2gpu, np.asarray(doc["phy2log"]))
        self.history.append(entry)
        s, m = entry.solve, entry.migration
        log.info("step %d: cycle %d %s; moved %s replicas (%s bytes by the move report), predicted move %.3g s, "
                 "measured migration %s s, payback %s steps", step, cycle, entry.decision, s.get("moved_replicas"),
                 s.get("moved_bytes"), s.get("predicted_move_time_s") or 0.0, m.get("measured_migration_s"),
                 s.get("payback_steps"))
        if self.rank == 0:
            with (self.work_dir / "controller.jsonl").open("a") as f:
                f.write(json.dumps(entry.to_dict()) + "\n")
        return entry

    def _decide(self, doc: dict[str, Any]) -> tuple[int, str]:
        moves = doc.get("moves", {})
        if doc["moe_layers"] != self.layers:
            return 2, f"the answer's MoE layers {doc['moe_layers']} are not the job's {self.layers}"
        if not moves.get("moved_replicas"):
            return 2, "the answer moves nothing"
        payback = moves.get("payback_steps")
        if payback is None:
            payback = moves.get("payback_steps_bytes")
        if payback is None:
            return 2, "no predicted gain"
        if payback > self.payback_within_steps:
            return 2, f"payback {payback:.3g} steps > {self.payback_within_steps:g}"
        return 1, f"payback {payback:.3g} steps"

    @staticmethod
    def _solve_summary(doc: dict[str, Any]) -> dict[str, Any]:
        moves = doc.get("moves", {})
        payback = moves.get("payback_steps")
        return {"status": doc.get("status"), "solve_s": doc.get("solve_s"),
                "moved_replicas": moves.get("moved_replicas"), "moved_replicas_per_layer":
                moves.get("moved_replicas_per_layer"), "moved_bytes": moves.get("moved_bytes"),
                "predicted_move_time_s": moves.get("move_time_s"), "gain": moves.get("gain"),
                "payback_steps": payback if payback is not None else moves.get("payback_steps_bytes"),
                "payback_unit": "steps" if payback is not None else "steps (bytes)"}

    def _close_log(self) -> None:
        if self._solve_log is not None:
            self._solve_log.close()
            self._solve_log = None

    def close(self) -> None:
        """Remove the recorder's hooks and stop a running solve."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._close_log()


class ReplicaController:
    """Re-plan hot-expert replicas from recent routing, at step boundaries, on every rank.

    Every step (``after_step``) it takes the tokens each logical expert got on this rank since the
    last step (:meth:`placement.consumers.replica_runtime.InstalledReplicas.take_counts`, counted by the
    routing hooks) into a window of the last ``window_steps`` steps; every ``every_steps`` steps it
    sums the window over ``group`` (one all-reduce), puts each layer's redundant slots where
    ``rule`` (:func:`placement.core.replicas.replicate`, ``hottest`` or ``eplb``) puts them for those
    loads (:func:`placement.consumers.replica_runtime.replica_plan`: the base permutation kept), and, when a
    map changes, calls ``installed.replan`` (:func:`placement.consumers.migrate.migrate`: weights and optimizer
    state go with every created or moved replica).  Only recent routing counts: replicas chosen on
    the whole history lag a shift of the hot experts (UltraEP's criticism of EPLB, arXiv 2606.04101);
    ``window_steps`` is how far back it looks.  The plan is a deterministic function of the summed
    counts, so every rank computes the same maps with no broadcast.

    This is separate from :class:`ReplacementController` (which records traces and solves the
    cross-rack permutation in a background process): choosing replicas is cheap enough to run inline.

    Parameters
    ----------
    installed : the :class:`placement.consumers.replica_runtime.InstalledReplicas` of this rank's model.
    optimizer : the job's optimizer (what ``migrate`` takes; the DistributedOptimizer included).
    rule : ``hottest`` or ``eplb``.
    every_steps : a re-plan every this many steps (at steps ``every_steps - 1``, ``2 * every_steps - 1``, ...).
    window_steps : the recent steps whose counts the re-plan reads.
    group : the ranks whose counts are summed (default: the world; under pipeline parallelism the
        ranks of this stage, which hold the same layers).
    ep_group, state_group : ``migrate``'s ``group`` and ``state_group``.
    rank2domain : ``(ep,)`` NVLink domain of each EP rank, for ``hottest`` (replicas stay in the domain).
    """

    def __init__(self, installed: Any, optimizer: Any, *, rule: str = "hottest", every_steps: int = 100,
                 window_steps: int = 20, group: Any = None, ep_group: Any = None, state_group: Any = None,
                 rank2domain: np.ndarray | None = None) -> None:
        from collections import deque

        if rule not in ("hottest", "eplb"):
            raise InvalidInputError(f"rule: expected hottest or eplb, found {rule!r}")
        if every_steps < 1:
            raise InvalidInputError(f"every_steps: expected a positive count, found {every_steps}")
        if window_steps < 1:
            raise InvalidInputError(f"window_steps: expected a positive count, found {window_steps}")
        self.installed, self.optimizer, self.rule = installed, optimizer, rule
        self.every_steps, self.window_steps = int(every_steps), int(window_steps)
        self.group, self.ep_group, self.state_group, self.rank2domain = group, ep_group, state_group, rank2domain
        self._window: deque[dict[int, Any]] = deque(maxlen=self.window_steps)  # per step {layer: (E,) device tensor}
        self.history: list[dict[str, Any]] = []

    def recent_loads(self) -> dict[int, np.ndarray]:
        """``{layer: (E,) tokens per logical expert}`` over the window, summed over ``group`` (on the
        counters' device, as NCCL needs; the one host copy of the re-plan)."""
        import torch
        import torch.distributed as dist

        layers = sorted({layer for counts in self._window for layer in counts})
        if not layers:
            return {}
        rows = []
        for layer in layers:
            parts = [counts[layer] for counts in self._window if layer in counts]
            rows.append(torch.stack(parts).sum(0))
        total = torch.stack(rows)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, group=self.group)
        local = total.cpu().numpy().astype(np.int64)
        return {layer: local[i].copy() for i, layer in enumerate(layers)}

    def after_step(self, step: int) -> dict[str, Any] | None:
        """Call once per optimizer step on every rank, after ``zero_grad`` (a step boundary).
        Returns the re-plan's record (``step``, ``decision``, ``maps``, ``loads``, the migration
        report) at a re-plan step, else None."""
        from placement.consumers.migrate import MigrationError

        self._window.append(self.installed.take_counts(on_device=True))  # no host synchronisation per step
        if (step + 1) % self.every_steps:
            return None
        loads = self.recent_loads()
        maps = self.installed.maps_from_loads(loads, self.rule, self.rank2domain)
        changed = sorted(layer for layer, row in maps.items()
                         if not np.array_equal(row, self.installed.phy2log(layer)))
        entry: dict[str, Any] = {"step": step, "window_steps": len(self._window),
                                 "loads": {k: v.tolist() for k, v in loads.items()},
                                 "maps": {k: v.tolist() for k, v in maps.items()}, "changed": changed}
        if not changed:
            entry["decision"] = "unchanged"
        else:
            t0 = time.perf_counter()
            try:
                report = self.installed.replan({k: maps[k] for k in changed}, self.optimizer, group=self.ep_group,
                                               state_group=self.state_group)
            except MigrationError as e:  # every rank raised it; the old maps and state are intact
                entry["decision"] = f"failed: {e}"
            else:
                entry["decision"] = "applied"
                entry["migration"] = {**report.to_dict(), "measured_migration_s": time.perf_counter() - t0}
        log.info("step %d: replica re-plan from %d recent steps: %s (layers %s)", step, len(self._window),
                 entry["decision"], changed)
        self.history.append(entry)
        return entry


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m placement.plan.controller REQUEST.json ANSWER.json``: the background solve."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m placement.plan.controller REQUEST.json ANSWER.json", file=sys.stderr)
        return 2
    from placement.core.model import PlacementError

    try:
        answer = solve_request(json.loads(Path(args[0]).read_text()))
    except PlacementError as e:
        print(f"placement.plan.controller: {e}", file=sys.stderr)
        return e.exit_code
    _write_json(Path(args[1]), answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
