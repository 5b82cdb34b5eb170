"""Routing recorded by the stacks' own code on CPU, imported and solved.

- Megatron-Core 0.16.1: a tiny GPTModel with MoE (tests/stacks/tiny.py); its ``TopKRouter``
  returns ``(probs, routing_map)``.  Its wheel has no router tracer (Megatron-LM's
  ``megatron/core/transformer/moe/router_trace.py`` is newer), so :class:`RouterRecorder` writes
  the tracer's schema from forward hooks, emulating a dp=2 x pp=2 job: each data-parallel rank's
  tokens run through the model, stage 0's routers recorded as one rank and stage 1's as another,
  with stage-local layer numbers as Megatron's ``decoder.layers.<i>`` names give them.
- TorchTitan 0.3.0: two ``MoE`` modules of ``torchtitan/models/common/moe.py`` in a row, their
  ``TokenChoiceTopKRouter`` returning ``(scores, expert_ids (B, L, K), scores_BLE)``.

Skipped only when the packages are missing (the ``consumers`` extra installs them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from placement.cli import main
from placement.formats import read_instance

pytestmark = pytest.mark.filterwarnings("ignore")  # the stacks warn about missing TE/Apex/CUDA

E, K = 8, 2
CLUSTER = {"num_domains": 2, "trays_per_domain": 2, "gpus_per_tray": 1, "nvlink_gbps": 900.0, "scaleout_gbps": 100.0}


def _write_sections(folder: Path, num_layers: int, parallel: dict) -> list[str]:
    model = {
        "name": "tiny-real", "num_layers": num_layers, "moe_layers": list(range(num_layers)), "num_experts": E,
        "top_k": K, "num_groups": 1, "groups_per_token": 1, "hidden_size": 32, "dispatch_bytes_per_token": 36,
        "combine_bytes_per_token": 64,
    }
    args = []
    for key, doc in (("model", model), ("parallel", parallel), ("cluster", CLUSTER)):
        path = folder / f"{key}.json"
        path.write_text(json.dumps(doc))
        args += [f"--{key}", str(path)]
    return args


def _sorted_ids(ids: np.ndarray) -> np.ndarray:
    return np.sort(np.asarray(ids, dtype=np.int64), axis=-1)


@pytest.fixture(scope="session")
def megatron_gpt():
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from tests.stacks.tiny import megatron_tiny_gpt

    return megatron_tiny_gpt(num_layers=4, num_experts=E, top_k=K)


def test_megatron_core_router_trace_imports_and_solves(megatron_gpt, tmp_path, capsys):
    import torch

    from placement.sources.importers.recorder import RouterRecorder, megatron_routers

    model, forward = megatron_gpt
    routers = megatron_routers(model)
    assert sorted(routers) == [0, 1, 2, 3]
    steps, micro, batch, seq = 4, 2, 2, 6
    parallel = {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 2, "order": "tp-cp-ep-dp-pp",
                "stage_layers": [[0, 1], [2, 3]], "seq_len": seq, "micro_batch": batch, "global_batch": 2 * micro * batch}
    seen: dict[tuple[int, int], list[np.ndarray]] = {}  # (dp, layer) -> routing maps in call order
    traces = tmp_path / "traces"
    gen = torch.Generator().manual_seed(0)
    for d in range(2):
        current: dict = {}
        spies = [routers[i].register_forward_hook(
            lambda mod, inp, out, i=i: seen.setdefault((d, i), []).append(out[1].nonzero()[:, 1].reshape(-1, K).numpy()))
            for i in range(4)]
        # rank = dp + 2 * pp (order tp-cp-ep-dp-pp); stage s records its routers with local numbers
        recs = [RouterRecorder(traces, rank=d + 2 * s, routers={j: routers[2 * s + j] for j in range(2)}) for s in range(2)]
        for _ in range(steps):
            for _ in range(micro):
                assert forward(torch.randint(0, 128, (batch, seq), generator=gen)).shape == (batch, seq, 128)
            for r in recs:
                r.advance_step()
        for r in recs:
            r.close()
        for h in spies:
            h.remove()
        _ = current
    files = sorted(str(p) for p in traces.iterdir())
    assert [Path(f).name for f in files] == [f"router_trace_rank{r}.jsonl" for r in range(4)]
    first = json.loads(Path(files[0]).read_text().splitlines()[0])
    assert set(first) == {"step", "stage", "block", "layer", "rank", "num_tokens", "topk", "top_indices"}

    out = tmp_path / "mc.json"
    args = _write_sections(tmp_path, 4, parallel)
    assert main(["import", "--from", "megatron", *files, *args, "-o", str(out)]) == 0, capsys.readouterr().err
    inst = read_instance(out)
    per_call = batch * seq
    fit_calls = (steps - 1) * micro  # the last step of four is held out
    assert inst.routing.topk.shape == (4, 2, fit_calls * per_call, K)
    for d in range(2):
        for layer in range(4):
            calls = seen[(d, layer)]
            assert len(calls) == steps * micro
            np.testing.assert_array_equal(_sorted_ids(inst.routing.topk[layer, d]), np.concatenate(calls[:fit_calls]))
            np.testing.assert_array_equal(_sorted_ids(inst.routing.heldout_topk[layer, d]), np.concatenate(calls[fit_calls:]))
    capsys.readouterr()
    assert main(["solve", str(out), "--time-limit", "20", "--workers", "1", "-o", str(tmp_path / "p.json")]) == 0
    assert main(["verify", str(out), str(tmp_path / "p.json")]) == 0


@pytest.fixture(scope="session")
def torchtitan_moes():
    pytest.importorskip("torch")
    pytest.importorskip("triton")  # torchtitan 0.3.0 imports it unconditionally
    pytest.importorskip("torchtitan")
    from tests.stacks.tiny import torchtitan_tiny_moe

    return [torchtitan_tiny_moe(dim=16, num_experts=E, top_k=K, seed=s) for s in (0, 1)]


def test_torchtitan_moe_router_recorded_imports_and_solves(torchtitan_moes, tmp_path, capsys):
    import torch

    from placement.sources.importers.recorder import RouterRecorder

    moes = torchtitan_moes
    parallel = {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1, "order": "tp-cp-ep-dp-pp", "stage_layers": [[0, 1]],
                "seq_len": 5, "micro_batch": 3, "global_batch": 6}
    seen: dict[tuple[int, int], list[np.ndarray]] = {}
    traces = tmp_path / "traces"
    gen = torch.Generator().manual_seed(1)
    steps = 5
    for d in range(2):
        spies = [moes[i].router.register_forward_hook(
            lambda mod, inp, out, i=i: seen.setdefault((d, i), []).append(out[1].reshape(-1, K).numpy().copy()))
            for i in range(2)]
        rec = RouterRecorder(traces, rank=d, routers={0: moes[0].router, 1: moes[1].router})
        for _ in range(steps):
            with torch.no_grad():
                x = torch.randn(3, 5, 16, generator=gen)
                moes[1](moes[0](x))
            rec.advance_step()
        rec.close()
        for h in spies:
            h.remove()
    files = sorted(str(p) for p in traces.iterdir())
    out = tmp_path / "tt.json"
    args = _write_sections(tmp_path, 2, parallel)
    assert main(["import", "--from", "torchtitan", *files, *args, "-o", str(out), "--heldout-steps", "2"]) == 0, \
        capsys.readouterr().err
    inst = read_instance(out)
    assert inst.routing.topk.shape == (2, 2, 3 * 15, K) and inst.routing.heldout_topk.shape == (2, 2, 2 * 15, K)
    for d in range(2):
        for layer in range(2):
            np.testing.assert_array_equal(inst.routing.topk[layer, d], np.concatenate(seen[(d, layer)][:3]))
            np.testing.assert_array_equal(inst.routing.heldout_topk[layer, d], np.concatenate(seen[(d, layer)][3:]))
    capsys.readouterr()
    assert main(["solve", str(out), "--time-limit", "20", "--workers", "1", "-o", str(tmp_path / "p.json")]) == 0
