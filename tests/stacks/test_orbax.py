"""Orbax (orbax-checkpoint 0.12.8, jax 0.10.2) PyTree checkpoint of a MaxText-style MoE, on CPU.

MaxText itself is not installed (it needs TPU/GPU-only dependencies); the tree is named and shaped
as MaxText's source says: ``src/MaxText/layers/moe.py`` (AI-Hypercomputer/maxtext, commit
019f0175a343e1ef28535d4eb1257e2402a92e3f), ``RoutedMoE``: ``wi_0`` / ``wi_1`` (E, emb, mlp), ``wo``
(E, mlp, emb), ``gate`` = ``GateLogit`` with ``kernel`` (emb, E) and ``bias`` (E,), under
``MoeBlock_0``; scanned layers insert the layer axis at ``param_scan_axis`` = 1.  The optimizer
state is optax's Adam, whose ``mu`` / ``nu`` mirror the parameter tree.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from placement import checkpoint as ck  # noqa: E402
from placement.core.model import InvalidInputError  # noqa: E402
from placement.core.permutation import PERMUTATION_KIND, PERMUTATION_VERSION  # noqa: E402
from tests.stacks.tiny import GROUP_PRESERVING, NUM_EXPERTS  # noqa: E402

EMB, MLP, L, K = 8, 6, 2, 2
MOE_LAYERS = (3, 5)  # model layers; scan positions 0 and 1


def params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    block = {
        "wi_0": rng.normal(size=(NUM_EXPERTS, L, EMB, MLP)).astype(np.float32),
        "wi_1": rng.normal(size=(NUM_EXPERTS, L, EMB, MLP)).astype(np.float32),
        "wo": rng.normal(size=(NUM_EXPERTS, L, MLP, EMB)).astype(np.float32),
        "gate": {"kernel": rng.normal(size=(EMB, L, NUM_EXPERTS)).astype(np.float32),
                 "bias": (0.1 * rng.normal(size=(NUM_EXPERTS, L))).astype(np.float32)},
    }
    return {"params": {"decoder": {"moe_layers": {"DeepSeekMoeBlock_0": {"MoeBlock_0": block}},
                                   "decoder_norm": {"scale": np.ones(EMB, np.float32)}}}}


def forward(p, x):
    """Scanned DeepSeek-style routed MoE: sigmoid scores, bias for selection only, top-k."""
    block = p["params"]["decoder"]["moe_layers"]["DeepSeekMoeBlock_0"]["MoeBlock_0"]
    for layer in range(L):
        scores = jax.nn.sigmoid(x @ block["gate"]["kernel"][:, layer, :])
        _, idx = jax.lax.top_k(scores + block["gate"]["bias"][:, layer], K)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        out = jnp.zeros_like(x)
        for k in range(K):
            e = idx[:, k]
            h = jax.nn.silu(jnp.einsum("td,tdf->tf", x, block["wi_0"][e, layer])) * jnp.einsum("td,tdf->tf", x, block["wi_1"][e, layer])
            out = out + w[:, k, None] * jnp.einsum("tf,tfd->td", h, block["wo"][e, layer])
        x = x + out
    return x


def loss(p, x):
    return jnp.mean(forward(p, x) ** 2)


def test_orbax_save_permute_restore_same_outputs_and_next_step(tmp_path):
    p = params(0)
    opt = optax.adam(1e-2)
    state = opt.init(p)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, EMB)).astype(np.float32))
    updates, state = opt.update(jax.grad(loss)(p, x), state, p)
    p = optax.apply_updates(p, updates)
    with ocp.PyTreeCheckpointer() as c:
        c.save(str(tmp_path / "src"), {"params": p, "opt_state": state})
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "maxtext", "num_experts": NUM_EXPERTS,
           "num_groups": 2, "group_limited": True, "layers": {str(l): GROUP_PRESERVING for l in MOE_LAYERS}}
    changed = ck.permute_orbax(tmp_path / "src", tmp_path / "dst", doc)
    assert "opt_state/0/mu/params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0" in changed
    assert "params/params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel" in changed
    with ocp.PyTreeCheckpointer() as c:
        back = c.restore(str(tmp_path / "dst"), item={"params": p, "opt_state": state})
    q, qstate = back["params"], back["opt_state"]
    wi = q["params"]["decoder"]["moe_layers"]["DeepSeekMoeBlock_0"]["MoeBlock_0"]["wi_0"]
    orig = p["params"]["decoder"]["moe_layers"]["DeepSeekMoeBlock_0"]["MoeBlock_0"]["wi_0"]
    assert np.array_equal(np.asarray(wi[:, 1]), np.asarray(orig[GROUP_PRESERVING, 1]))
    np.testing.assert_allclose(np.asarray(forward(q, x)), np.asarray(forward(p, x)), atol=1e-6, rtol=0)
    # the next optimizer step is the same step, permuted
    up_p, _ = opt.update(jax.grad(loss)(p, x), state, p)
    up_q, _ = opt.update(jax.grad(loss)(q, x), qstate, q)
    p2, q2 = optax.apply_updates(p, up_p), optax.apply_updates(q, up_q)
    np.testing.assert_allclose(np.asarray(forward(q2, x)), np.asarray(forward(p2, x)), atol=1e-5, rtol=0)


def test_orbax_unknown_leaf_under_moe_block_is_refused(tmp_path):
    p = params(0)
    p["params"]["decoder"]["moe_layers"]["DeepSeekMoeBlock_0"]["MoeBlock_0"]["odd"] = np.zeros((3,), np.float32)
    with ocp.PyTreeCheckpointer() as c:
        c.save(str(tmp_path / "src"), p)
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "num_experts": NUM_EXPERTS,
           "layers": {str(l): GROUP_PRESERVING for l in MOE_LAYERS}}
    with pytest.raises(InvalidInputError, match="MoeBlock_0/odd"):
        ck.permute_orbax(tmp_path / "src", tmp_path / "dst", doc)
    assert not (tmp_path / "dst").exists()


def test_orbax_with_the_maxtext_export_document(tmp_path):
    """The document ``placement export --format maxtext`` writes: rows keyed by scan position."""
    p = params(1)
    with ocp.PyTreeCheckpointer() as c:
        c.save(str(tmp_path / "src"), p)
    block = "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0"
    tensors = [{"path": f"{block}/wi_0", "expert_axis": 0, "layer_axis": 1},
               {"path": f"{block}/gate/kernel", "expert_axis": 2, "layer_axis": 1},
               {"path": f"{block}/gate/bias", "expert_axis": 0, "layer_axis": 1}]
    doc = {"kind": "placement.maxtext", "version": 1, "experts": {
        "num_experts": NUM_EXPERTS, "num_groups": 2, "group_limited": True, "tree_root": "params/params",
        "tensors": tensors, "layers": {"0": GROUP_PRESERVING, "1": list(range(NUM_EXPERTS))}}}
    ck.permute_orbax(tmp_path / "src", tmp_path / "dst", doc)
    with ocp.PyTreeCheckpointer() as c:
        back = c.restore(str(tmp_path / "dst"), item=p)
    get = lambda t: t["params"]["decoder"]["moe_layers"]["DeepSeekMoeBlock_0"]["MoeBlock_0"]["gate"]["kernel"]  # noqa: E731
    assert np.array_equal(np.asarray(get(back))[:, 0], get(p)[:, 0][:, GROUP_PRESERVING])
    assert np.array_equal(np.asarray(get(back))[:, 1], get(p)[:, 1])
    bad = {**doc, "experts": {**doc["experts"], "tensors": [{**tensors[0], "expert_axis": 1}]}}
    with pytest.raises(InvalidInputError, match="wi_0"):
        ck.permute_orbax(tmp_path / "src", tmp_path / "dst2", bad)
