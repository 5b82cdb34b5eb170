"""Mt-KaHyPar as a peer: experts to domains by hypergraph partitioning, then within-domain balancing.

Hypergraph partitioning is the strongest general tool for this problem.  Per
MoE layer, on the default rank layout (sources fixed where the default puts them):

- Blocks: the nodes of the layer's stage (:func:`solvers.eplb.stage_rank_nodes`): the NVLink
  domains its EP group touches (with several EP groups per stage, the classes of EP ranks that share
  a domain in every group, a refinement of the domains, so the objective below is then an upper
  bound on the true cost rather than equal to it).
- Vertices: the ``E`` experts and one source vertex per block, fixed to its block, all of weight 1
  (Mt-KaHyPar 1.7 mishandles zero-weight fixed vertices: it crashes or misplaces them).
- Nets (``per_domain`` cost mode): each sampled token is a net over its source's block vertex and
  its ``top_k`` experts; identical nets are merged into one with the count as its weight.  The
  connectivity-minus-one (KM1) objective of a net is then exactly the number of remote domains the
  token reaches: the ``per_domain`` cost.  (``per_pair`` cost mode: one two-pin net per (source
  block, expert) pair, weighted by its count; KM1 = cut = remote (token, expert) pairs, exact too.)
- Balance: exact capacities, block ``b`` holds ``(EP ranks in b) x (experts per rank)`` experts,
  set (plus one for the source vertex) as individual target block weights.  Should Mt-KaHyPar return a block over its capacity, a
  greedy repair moves the experts with the smallest exact KM1 increase to blocks with room.
- Two starts, the better kept: Mt-KaHyPar's own multilevel partition, and its V-cycle refinement
  (``improve_partition``, 3 V-cycles) of the contiguous default's map; lower KM1 on the sampled
  tokens wins.  A partitioner alone lost to the contiguous default on ``dsv3_ep256`` (its
  group-limited routing makes contiguous groups strong); refining the default too is how a careful
  user would run it, and it keeps this peer at least as good as the default on the sampled tokens.
- Then the experts of each block go onto its EP ranks by the same within-domain balancing as ours,
  :func:`solvers.experts.balance_ranks` (longest-processing-time packing, then swaps that lower the
  busiest rank, on each EP group's normalised load).

- Deadline: Mt-KaHyPar has no time limit and cannot be interrupted, and one layer of a wide
  instance takes tens of seconds, so each layer is partitioned in a child process that streams the
  best start finished so far (the initial map, then its refinement, then the partitioner's own
  answer, the costliest); at the deadline or a stop request the child is killed and the layer keeps
  that best (``cut_layers`` in the details).  A complete layer is the same as in-process.

Mt-KaHyPar runs with the ``DETERMINISTIC_QUALITY`` preset (falling back to ``DETERMINISTIC`` on
versions without it), ``options.num_workers`` threads and ``mtkahypar.set_seed(options.seed)``:
the same seed gives the same placement whatever the thread count.  ``mtkahypar`` is an optional
extra: ``pip install -e '.[peers]'``.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

import numpy as np

from placement.predict.cost import LayoutIndex
from placement.core.model import CostMode, Instance, InvalidInputError, Placement, SolverError
from solvers.base import SolveOptions, SolveResult, heuristic_result
from solvers.default import default_rank2gpu
from solvers.eplb import stage_rank_nodes
from solvers.experts.balance import balance_ranks  # the within-domain balancing ours uses too (a shared step)
from solvers.experts.problem import build_layer_problem
from solvers.kernels import keeps_expert_groups
from solvers.kernels.hypergraph import RUNTIME, _mtkahypar, km1, partition_context, repair_capacities  # noqa: F401  (re-exported)
from solvers.registry import register

__all__ = ["layer_nets", "km1", "partition_layer", "partition_layer_starts", "repair_capacities", "kahypar_phy2log",
           "solve_kahypar"]

log = logging.getLogger(__name__)



def layer_nets(
    topk: np.ndarray, src_block: np.ndarray, num_experts: int, cost_mode: CostMode
) -> tuple[np.ndarray, np.ndarray]:
    """The merged nets of one layer.

    Parameters
    ----------
    topk : (dp, tokens_per_source, top_k) expert ids of the layer's sampled tokens.
    src_block : (dp, tokens_per_source) block of each token's source.
    num_experts : E; source vertex of block ``b`` is ``E + b``.
    cost_mode : ``per_domain`` (one net per token) or ``per_pair`` (one net per token-expert pair).

    Returns
    -------
    nets : (num_nets, pins) int64 vertex ids, first pin the source vertex.
    weights : (num_nets,) int64 number of merged tokens (or pairs).
    """
    k = topk.shape[-1]
    src = (np.asarray(src_block, dtype=np.int64) + num_experts).reshape(-1, 1)
    experts = np.sort(np.asarray(topk, dtype=np.int64).reshape(-1, k), axis=1)
    if cost_mode == "per_pair":
        rows = np.column_stack([np.repeat(src[:, 0], k), experts.reshape(-1)])
    else:
        rows = np.hstack([src, experts])
    nets, weights = np.unique(rows, axis=0, return_counts=True)
    return nets.astype(np.int64), weights.astype(np.int64)


# Tie order of the starts: on equal KM1 the partitioner's answer wins, then the refinement, then the
# initial map itself (the order the peer has always used).
_START_RANK = {"partitioner": 0, "refined": 1, "initial": 2}


def partition_layer_starts(
    topk: np.ndarray,
    src_block: np.ndarray,
    capacities: np.ndarray,
    cost_mode: CostMode,
    *,
    initial: np.ndarray | None = None,
    vcycles: int = 3,
    seed: int = 0,
    num_threads: int = 1,
) -> Iterator[tuple[np.ndarray, dict]]:
    """The best expert-to-block map so far, after each start of :func:`partition_layer` finishes.

    Same parameters as :func:`partition_layer`.  Yields ``(expert2block, facts)`` first for
    ``initial`` (no work), then after its V-cycle refinement, then after Mt-KaHyPar's own partition
    (the costliest start: on a 64-expert layer with 90k distinct tokens about 25 s against 9 s for
    the refinement); each time the best of the starts finished so far, so a caller that must stop
    early keeps the last one it received.  The last item is :func:`partition_layer`'s answer.
    ``facts`` also carries ``"complete"`` (true on the last item only); KM1 of a start not yet run
    is ``None``.
    """
    capacities = np.asarray(capacities, dtype=np.int64)
    num_experts = int(capacities.sum())
    k = len(capacities)
    nets, weights = layer_nets(topk, src_block, num_experts, cost_mode)
    if k == 1:
        e2b = np.zeros(num_experts, dtype=np.int64)
        yield e2b, {"km1": 0, "km1_partitioner": 0, "km1_initial": None, "km1_refined": None,
                    "start": "partitioner", "repaired_moves": 0, "complete": True}
        return
    fixed = np.arange(k)
    movable = np.arange(num_experts)
    facts: dict = {"km1": None, "km1_partitioner": None, "km1_initial": None, "km1_refined": None,
                   "start": None, "repaired_moves": 0, "complete": False}
    best: np.ndarray | None = None

    def offer(v2b: np.ndarray, value: int, name: str, moves: int) -> None:
        nonlocal best
        if best is None or (value, _START_RANK[name]) < (facts["km1"], _START_RANK[facts["start"]]):
            best = v2b
            facts.update(km1=value, start=name, repaired_moves=moves)

    start: np.ndarray | None = None
    if initial is not None:
        start = np.concatenate([np.asarray(initial, dtype=np.int64), fixed])
        if not (np.bincount(start[:num_experts], minlength=k) <= capacities).all():
            raise InvalidInputError("partition_layer: the initial map exceeds a block's capacity")
        facts["km1_initial"] = km1(nets, weights, start)
        offer(start, facts["km1_initial"], "initial", 0)
        assert best is not None
        yield best[:num_experts], dict(facts)
    mtk = _mtkahypar()
    init = RUNTIME.initializer(num_threads)
    # Source vertices weigh 1 (zero-weight fixed vertices crash or get misplaced in Mt-KaHyPar 1.7),
    # so every block's target weight is its capacity plus its one source vertex.
    ctx = partition_context(mtk, init, k, capacities + 1)
    num_vertices = num_experts + k
    hg = init.create_hypergraph(ctx, num_vertices, len(nets), nets.tolist(), [1] * num_vertices, weights.tolist())
    hg.add_fixed_vertices([-1] * num_experts + list(range(k)), k)

    def finish(v2b: np.ndarray) -> tuple[np.ndarray, int, int]:
        if not (v2b[num_experts:] == fixed).all():
            raise SolverError("Mt-KaHyPar moved a fixed source vertex out of its block")
        repaired = repair_capacities(nets, weights, v2b, movable, capacities)
        return repaired, km1(nets, weights, repaired), int((repaired != v2b).sum())

    if start is not None:
        mtk.set_seed(int(seed))
        phg = hg.create_partitioned_hypergraph(ctx, k, start.tolist())
        phg.improve_partition(ctx, int(vcycles))
        refined, refined_km1, refined_moves = finish(np.asarray(phg.get_partition(), dtype=np.int64))
        facts["km1_refined"] = refined_km1
        offer(refined, refined_km1, "refined", refined_moves)
        assert best is not None
        yield best[:num_experts], dict(facts)
    mtk.set_seed(int(seed))
    own = np.asarray(hg.partition(ctx).get_partition(), dtype=np.int64)
    facts["km1_partitioner"] = km1(nets, weights, own)
    partitioned, partitioned_km1, partitioned_moves = finish(own)
    offer(partitioned, partitioned_km1, "partitioner", partitioned_moves)
    facts["complete"] = True
    assert best is not None
    yield best[:num_experts], dict(facts)


def partition_layer(
    topk: np.ndarray,
    src_block: np.ndarray,
    capacities: np.ndarray,
    cost_mode: CostMode,
    *,
    initial: np.ndarray | None = None,
    vcycles: int = 3,
    seed: int = 0,
    num_threads: int = 1,
) -> tuple[np.ndarray, dict]:
    """Experts of one layer to blocks with Mt-KaHyPar (KM1, fixed sources, exact capacities).

    Parameters
    ----------
    topk : (dp, tokens_per_source, top_k) expert ids of the layer's sampled tokens.
    src_block : (dp, tokens_per_source) block of each token's source.
    capacities : (k,) experts each block holds; ``sum == E``.
    cost_mode : see :func:`layer_nets`.
    initial : (E,) a block of each expert within capacities (e.g. the contiguous default's).  When
        given, Mt-KaHyPar also refines it with ``vcycles`` V-cycles (``improve_partition``) and the
        best of its own partition, the refinement and ``initial`` itself (lowest KM1; in that order
        on ties) is returned, so the answer is never worse than ``initial`` on these tokens.
    vcycles : V-cycles of the refinement of ``initial``.
    seed, num_threads : Mt-KaHyPar's seed (set before each of its calls) and thread count.

    Returns
    -------
    expert2block : (E,) int64 block of each expert, within capacities.
    facts : ``{"km1", "km1_partitioner", "km1_initial", "km1_refined", "start", "repaired_moves"}``:
        KM1 in merged-net weight units (sampled tokens, or pairs), the partitioner's own answer
        before repair, the initial map and its refinement (``None`` without ``initial``), which
        answer won (``partitioner``, ``refined`` or ``initial``), and the moves the repair made.
    """
    *_, (e2b, facts) = partition_layer_starts(
        topk, src_block, capacities, cost_mode, initial=initial, vcycles=vcycles, seed=seed, num_threads=num_threads
    )
    facts.pop("complete")
    return e2b, facts


class _PartitionWorker:
    """A child process that runs :func:`partition_layer_starts` and streams each best-so-far back.

    Mt-KaHyPar has no wall-clock limit (its Python API 1.7 has none, and its C++ context marks
    "time limit in seconds" as not supported) and a call cannot be interrupted from Python; one
    layer of a wide instance takes tens of seconds.  So the partitioning runs in a child process:
    the parent waits for its answers until the deadline (or a stop request), keeps the last best it
    received and kills the child if it is still working.  A child that finished its call is kept
    for the next one (starting one costs an interpreter and the imports, about 1 s of CPU).  The
    child is a fresh interpreter (``python -c``, not ``multiprocessing``'s spawn, which would re-run
    the caller's main script) talking over a socket pair; it exits when the parent's end closes.
    """

    def __init__(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `solvers` is importable
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        code = "import sys; from solvers.kahypar import _worker_main; _worker_main(int(sys.argv[1]))"
        with child_sock:
            self._proc = subprocess.Popen([sys.executable, "-c", code, str(child_sock.fileno())],
                                          pass_fds=[child_sock.fileno()], env=env, stdin=subprocess.DEVNULL)
        self._conn = multiprocessing.connection.Connection(parent_sock.detach())
        self._sender: threading.Thread | None = None

    def start(self, job: dict) -> None:
        """Send ``job`` (keyword arguments of :func:`partition_layer_starts`) without blocking: the
        job can exceed the socket's buffer, so a thread sends it and the deadline holds even while
        the child is still starting up."""
        self._sender = threading.Thread(target=_send_quietly, args=(self._conn, job), name="placement-kahypar-send",
                                        daemon=True)
        self._sender.start()

    def wait(self, options: SolveOptions, deadline: float) -> tuple[tuple[np.ndarray, dict] | None, bool]:
        """Collect the answers of the job :meth:`start` sent, until it completes or the deadline.

        Returns
        -------
        best : the last ``(expert2block, facts)`` received, or ``None`` if none arrived in time.
        alive : whether the child finished the call and may be reused (else it was killed).
        """
        sender = self._sender
        assert sender is not None, "wait() before start()"
        best: tuple[np.ndarray, dict] | None = None
        try:
            while True:
                left = deadline - time.monotonic()
                if options.stop_requested() or left <= 0:
                    self.kill()
                    return best, False
                if not self._conn.poll(min(left, _POLL_S)):
                    if self._proc.poll() is not None:
                        raise EOFError
                    continue
                kind, payload = self._conn.recv()
                if kind == "error":
                    self.kill()
                    raise payload
                best = payload
                if payload[1]["complete"]:
                    return best, True
        except (EOFError, OSError):
            self.kill()
            if options.stop_requested():  # a signal to the process group may have ended the child first
                return best, False
            raise SolverError(f"Mt-KaHyPar's worker process died (exit code {self._proc.returncode})") from None
        finally:
            sender.join()

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._conn.close()


_POLL_S = 0.05  # seconds between checks of the deadline and the stop request while a layer runs
_IDLE_WORKERS: list[_PartitionWorker] = []
_IDLE_LOCK = threading.Lock()


def _close_idle_workers() -> None:
    """At exit: close the idle children's sockets (they exit on EOF) and reap them."""
    with _IDLE_LOCK:
        workers, _IDLE_WORKERS[:] = list(_IDLE_WORKERS), []
    for worker in workers:
        worker._conn.close()
        try:
            worker._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            worker.kill()


atexit.register(_close_idle_workers)


def _send_quietly(conn: Any, job: dict) -> None:
    try:
        conn.send(job)
    except (OSError, ValueError):  # the child was killed at the deadline while the job was in flight
        pass


def _worker_main(fd: int) -> None:
    """The child's loop: one job at a time, every best-so-far sent back; EOF ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us itself
    conn = multiprocessing.connection.Connection(fd)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            for item in partition_layer_starts(**job):
                conn.send(("best", item))
        except (EOFError, OSError):
            return
        except Exception as exc:  # re-raised in the parent
            try:
                conn.send(("error", exc))
            except Exception:
                conn.send(("error", SolverError(f"Mt-KaHyPar failed: {exc!r}")))


_T = TypeVar("_T")


def _partition_until(
    job: dict, options: SolveOptions, deadline: float, meanwhile: Callable[[], _T]
) -> tuple[tuple[np.ndarray, dict] | None, _T]:
    """The best map :func:`partition_layer_starts` reaches by ``deadline`` (``None``: none), in a
    child process that is killed at the deadline or on a stop request, and ``meanwhile()``, which
    the parent runs while the child works (so that it is not left for after the deadline)."""
    with _IDLE_LOCK:
        worker = _IDLE_WORKERS.pop() if _IDLE_WORKERS else None
    if worker is None:
        worker = _PartitionWorker()
    worker.start(job)
    try:
        extra = meanwhile()
    except BaseException:
        worker.kill()
        raise
    best, alive = worker.wait(options, deadline)
    if alive:
        with _IDLE_LOCK:
            _IDLE_WORKERS.append(worker)
    return best, extra


def kahypar_phy2log(
    instance: Instance, rank2gpu: np.ndarray, options: SolveOptions
) -> tuple[np.ndarray, list[dict]]:
    """(num_moe_layers, E) expert maps by Mt-KaHyPar plus within-block balancing, and per-layer facts.

    The deadline (or a stop request) is polled while a layer is partitioned, not only between
    layers: a layer cut short keeps the best of its starts finished by then (``"cut": true`` in its
    facts; the contiguous map, unbalanced, if only that was reached), and layers not reached keep
    the contiguous map (``"solved": false``).
    """
    m = instance.model
    topk = instance.routing.topk
    epr = instance.experts_per_rank
    layout = LayoutIndex(instance, rank2gpu, instance.routing.tokens_per_source)
    deadline = options.resolved_deadline()
    stage_of = instance.moe_layer2stage
    nodes = {int(s): stage_rank_nodes(instance, rank2gpu, int(s)) for s in np.unique(stage_of)}
    phy2log = np.tile(np.arange(m.num_experts, dtype=np.int64), (m.num_moe_layers, 1))
    facts: list[dict] = []
    for li in range(m.num_moe_layers):
        if options.stop_requested() or time.monotonic() >= deadline:
            facts.append({"layer": li, "solved": False})
            continue
        s = int(stage_of[li])
        rank2node = nodes[s]
        src_block = rank2node[layout.rank2eprank[layout.src_rank[s]]]  # (dp, T)
        capacities = np.bincount(rank2node) * epr
        t0 = time.monotonic()
        contiguous = rank2node[np.arange(m.num_experts) // epr]  # the default's expert -> block
        job = {"topk": np.asarray(topk[li]), "src_block": src_block, "capacities": capacities,
               "cost_mode": instance.cost_mode, "initial": contiguous, "seed": options.seed,
               "num_threads": options.num_workers}
        # Within-domain balancing: the same as ours (solvers.experts.balance_ranks) on its classes,
        # which are these blocks under another numbering; its problem is built while the child works.
        best, problem = _partition_until(job, options, deadline, lambda: build_layer_problem(
            instance, rank2gpu, li, group_preserving=False, validation_fraction=0.0, layout=layout))
        if best is None or (not best[1]["complete"] and best[1]["start"] == "initial"):
            facts.append({"layer": li, "solved": False, **({"cut": True, **best[1]} if best is not None else {})})
            continue
        e2b, info = best
        complete = info.pop("complete")
        node2class = np.empty(len(capacities), dtype=np.int64)
        node2class[rank2node] = problem.rank2class
        if not (node2class[rank2node] == problem.rank2class).all() or len(np.unique(node2class)) != len(node2class):
            raise SolverError(f"layer {li}: the partition blocks are not the expert placer's classes")
        expert2slot = balance_ranks(problem, node2class[e2b])
        phy2log[li] = np.argsort(expert2slot)
        facts.append({"layer": li, "solved": complete, **({} if complete else {"cut": True}),
                      "blocks": len(capacities), **info})
        log.debug("kahypar layer %d: km1 %d in %.2f s", li, info["km1"], time.monotonic() - t0)
        options.report(f"kahypar: layer {li + 1}/{m.num_moe_layers}, km1 {info['km1']}"
                       + ("" if complete else f" (cut at the deadline, best start {info['start']})"))
    return phy2log, facts


@register("kahypar")
def solve_kahypar(instance: Instance, options: SolveOptions) -> SolveResult:
    """Mt-KaHyPar per MoE layer on the default rank layout, then within-domain balancing.

    Raises
    ------
    SolverError
        When ``mtkahypar`` is not installed (``pip install -e '.[peers]'``).
    """
    _mtkahypar()  # fail early with the install hint
    rank2gpu = default_rank2gpu(instance)
    phy2log, facts = kahypar_phy2log(instance, rank2gpu, options)
    # unsolved: layers that keep the contiguous map; cut: layers whose partitioning the deadline stopped
    unsolved = [f["layer"] for f in facts if not f["solved"] and f.get("start", "initial") == "initial"]
    cut = [f["layer"] for f in facts if f.get("cut")]
    params = {
        "layout": "default",
        "preset": "DETERMINISTIC_QUALITY",
        "objective": "km1",
        "starts": ["partitioner", "contiguous default + 3 V-cycles"],
    }
    return heuristic_result(instance, Placement(rank2gpu, phy2log), "kahypar", params=params,
                            details={"layers": facts, "unsolved_layers": unsolved, "cut_layers": cut},
                            group_preserving=keeps_expert_groups(phy2log, instance.model.experts_per_group))
