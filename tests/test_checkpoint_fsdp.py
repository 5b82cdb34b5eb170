"""Megatron FSDP's ``fsdp_dtensor`` checkpoints, permuted by :func:`placement.consumers.checkpoint.permute_dcp`.

Megatron FSDP needs CUDA, so no checkpoint here is written by Megatron's own code: the keys and
shapes below are those read from its source (megatron-core 0.16.1 as installed, and Megatron-LM
core_v0.16.1 for ``megatron/training`` and ``tools``, which the wheel does not ship), and the
checkpoint is written by ``torch.distributed.checkpoint.save`` from the same nested dict Megatron
saves, so the flattened names are DCP's own:

- ``megatron/training/checkpointing.py`` (core_v0.16.1) l. 643-655: ``fsdp_dtensor`` is a plain
  ``torch.distributed.checkpoint.save`` of ``{"model": ..., "optimizer": ..., ...}``; l. 897-938:
  ``model`` is ``state_dict_for_save_checkpoint()``, ``optimizer`` is
  ``DistributedOptimizer.sharded_state_dict`` with ``distrib_optim_sharding_type="fsdp_dtensor"``;
  l. 955-974 ``preprocess_fsdp_dtensor_state_dict``: ``_extra_state`` dropped, SwiGLU's fc1 split
  in ``_w`` / ``_v``, then ``handle_experts_in_state_dict`` (model keys only).
- ``megatron/core/transformer/fsdp_dtensor_checkpoint.py`` (0.16.1) l. 92-147
  ``handle_experts_in_state_dict``: local expert ids become global (``local_experts.{e}.``,
  ``linear_fc1.weight{e}``, ``weight{e}_w`` / ``_v``); l. 199-219 and 293-296: which keys are
  SwiGLU's (expert, shared-expert and dense ``linear_fc1``, grouped and sequential); l. 308-322:
  the optimizer's ``exp_avg`` / ``exp_avg_sq`` of those keys are split the same way; l. 328-336:
  every ``._extra_state`` is deleted.
- ``megatron/core/optimizer/distrib_optimizer.py`` (0.16.1) l. 1154-1173 ``_param_name``: the
  optimizer names a parameter by the wrapped chunk's ``named_parameters()`` name with global
  expert ids; l. 1347-1369 ``sharded_param_state_fsdp_dtensor``: ``{"state": {name: torch Adam
  state (exp_avg, exp_avg_sq, step)}, "param_to_group_meta": {name: group without params}}``.
- ``megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py`` (0.16.1) l. 2513-2525:
  the parameters the model saves are the FP32 main weights (``main_weight_buffer``): the master
  copies are the ``model.`` entries, there is no separate ``fp32_param`` state.
- ``tools/checkpoint/checkpoint_inspector.py`` (core_v0.16.1) l. 341-342: the prefixes on disk,
  ``model.module.`` and ``optimizer.state.module.module.module.`` (FSDP adapter, MegatronFSDP,
  Float16Module).
- ``megatron/core/transformer/moe/router.py`` (0.16.1) l. 173: ``expert_bias`` (E,) persistent;
  ``local_tokens_per_expert`` is not persistent.
- MTP: ``mtp.layers.J.transformer_layer.*`` in 0.16.1; Megatron-LM main renames the module
  ``mtp_model_layer`` and maps it back to ``transformer_layer`` before saving
  (``handle_mtp_in_state_dict``, ``fsdp_dtensor_checkpoint.py`` on main).

Uneven sharding (FSDP shards each parameter's rows over the data-parallel ranks at offsets that
differ per parameter) is written chunk by chunk in :func:`test_uneven_row_chunks_of_experts_move`.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from benchmarks.checkpoint_stream import _Writer  # noqa: E402
from placement import checkpoint as ck  # noqa: E402
from placement.core.model import InvalidInputError  # noqa: E402
from placement.core.permutation import PERMUTATION_KIND, PERMUTATION_VERSION  # noqa: E402
from tests.test_checkpoint_stream import _read_all  # noqa: E402

E, H, F, V = 8, 6, 4, 10
NUM_LAYERS = 2  # decoder layer 0 dense, layer 1 MoE; MTP layer 0 is model layer 2
MODEL, OPT, META = "module.", "module.module.module.", "optimizer.param_to_group_meta."
PERMS = {1: [3, 0, 7, 5, 1, 2, 6, 4], 2: [6, 7, 0, 1, 4, 5, 2, 3]}


def _moe(prefix: str, grouped: bool) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(per-expert name templates with ``{e}``, router entries) of one MoE layer, with shapes."""
    if grouped:  # TEGroupedMLP: linear_fc1.weight{e}, SwiGLU split
        experts = {f"{prefix}mlp.experts.linear_fc1.weight{{e}}_w": (F, H), f"{prefix}mlp.experts.linear_fc1.weight{{e}}_v": (F, H),
                   f"{prefix}mlp.experts.linear_fc2.weight{{e}}": (H, F)}
    else:  # SequentialMLP
        experts = {f"{prefix}mlp.experts.local_experts.{{e}}.linear_fc1.weight_w": (F, H),
                   f"{prefix}mlp.experts.local_experts.{{e}}.linear_fc1.weight_v": (F, H),
                   f"{prefix}mlp.experts.local_experts.{{e}}.linear_fc2.weight": (H, F)}
    router = {f"{prefix}mlp.router.weight": (E, H)}
    return experts, router


def _layout(grouped: bool) -> tuple[dict[str, tuple[int, ...]], dict[int, dict[str, tuple[int, ...]]], dict[int, dict[str, tuple[int, ...]]]]:
    """(other parameters, per-expert templates by model layer, router parameters by model layer)."""
    dense = {
        "embedding.word_embeddings.weight": (V, H),
        "decoder.layers.0.self_attention.linear_qkv.weight": (3 * H, H),
        "decoder.layers.0.mlp.linear_fc1.weight_w": (F, H),
        "decoder.layers.0.mlp.linear_fc1.weight_v": (F, H),
        "decoder.layers.0.mlp.linear_fc2.weight": (H, F),
        "decoder.layers.1.self_attention.linear_qkv.weight": (3 * H, H),
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight_w": (F, H),
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight_v": (F, H),
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": (H, F),
        "mtp.layers.0.eh_proj.weight": (H, 2 * H),
        "output_layer.weight": (V, H),
    }
    experts, routers = {}, {}
    for layer, prefix in ((1, "decoder.layers.1."), (2, "mtp.layers.0.transformer_layer.")):
        experts[layer], routers[layer] = _moe(prefix, grouped)
    return dense, experts, routers


def _value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    import zlib

    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _megatron_state(grouped: bool) -> dict:
    """The nested dict Megatron's save_checkpoint hands to torch.distributed.checkpoint.save."""
    dense, experts, routers = _layout(grouped)
    params: dict[str, tuple[int, ...]] = dict(dense)
    for layer in experts:
        params.update(routers[layer])
        params.update({t.format(e=e): s for t, s in experts[layer].items() for e in range(E)})
    model = {MODEL + n: _value("model." + n, s) for n, s in params.items()}
    for prefix in ("decoder.layers.1.", "mtp.layers.0.transformer_layer."):
        model[MODEL + prefix + "mlp.router.expert_bias"] = _value(prefix + "expert_bias", (E,))
    state, meta = {}, {}
    for i, (n, s) in enumerate(sorted(params.items())):
        state[OPT + n] = {"exp_avg": _value("m." + n, s), "exp_avg_sq": _value("v." + n, s).abs(),
                          "step": torch.tensor(1000.0)}
        # one group per parameter here (Megatron groups by wd / lr multipliers), so a moved
        # expert's entry is seen to move with it
        meta[OPT + n] = {"lr": 1e-4 * (1 + i), "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8,
                         "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": ".experts." in n}
    return {"model": model, "optimizer": {"state": state, "param_to_group_meta": meta},
            "opt_param_scheduler": {"num_steps": 1000}, "iteration": 1000, "checkpoint_version": 3.0}


def _doc() -> dict:
    return {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "megatron", "num_experts": E,
            "layers": {str(k): v for k, v in PERMS.items()}}


def _save(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def _moves(grouped: bool, keep_router: bool) -> dict[str, str]:
    """Destination entry -> source entry, for every entry that moves."""
    _, experts, routers = _layout(grouped)
    moves = {}
    for layer, perm in PERMS.items():
        for t in experts[layer]:
            for p, old in enumerate(perm):
                for pre, suf in (("model." + MODEL, ""), ("optimizer.state." + OPT, ".exp_avg"),
                                 ("optimizer.state." + OPT, ".exp_avg_sq"),
                                 (META + OPT, ".lr"), (META + OPT, ".is_expert_parallel")):
                    moves[pre + t.format(e=p) + suf] = pre + t.format(e=old) + suf
    return moves


def _router_rows(grouped: bool) -> dict[str, list[int]]:
    _, _, routers = _layout(grouped)
    rows = {}
    for layer, perm in PERMS.items():
        for name in routers[layer]:
            for pre, suf in (("model." + MODEL, ""), ("optimizer.state." + OPT, ".exp_avg"),
                             ("optimizer.state." + OPT, ".exp_avg_sq")):
                rows[pre + name + suf] = perm
        bias = "model." + MODEL + next(iter(routers[layer])).replace("router.weight", "router.expert_bias")
        rows[bias] = perm
    return rows


@pytest.mark.parametrize("grouped", [True, False], ids=["te_grouped", "sequential"])
@pytest.mark.parametrize("keep_router", [False, True], ids=["checkpoint", "runtime"])
def test_fsdp_dtensor_experts_router_moments_and_group_meta_move(tmp_path, grouped, keep_router):
    src, dst = tmp_path / "iter_0001000", tmp_path / "perm"
    _save(_megatron_state(grouped), src)
    changed = ck.permute_dcp(src, dst, _doc(), keep_router=keep_router)
    src_t, src_o = _read_all(src)
    dst_t, dst_o = _read_all(dst)
    assert set(dst_t) == set(src_t) and set(dst_o) == set(src_o)
    moves = _moves(grouped, keep_router)
    rows = {} if keep_router else _router_rows(grouped)
    assert "model.module.decoder.layers.1.mlp.router.weight" in rows or keep_router
    for key, t in dst_t.items():
        if key in moves:
            assert torch.equal(t, src_t[moves[key]]), key
        elif key in rows:
            assert torch.equal(t, src_t[key][torch.tensor(rows[key])]), key
        else:
            assert torch.equal(t, src_t[key]), key
    for key, b in dst_o.items():
        assert b == src_o[moves.get(key, key)], key
    # the engine reports every expert and router tensor of a permuted layer, and nothing else
    moved = {k for k in moves if k in src_t}
    assert moved | set(rows) == set(changed) - {k for k in changed if k in dst_o}
    assert not keep_router or not any(".router." in k for k in changed)


def test_uneven_row_chunks_of_experts_move(tmp_path):
    """FSDP's uneven sharding: each expert's rows split over two ranks at its own offset."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    w = _Writer(src, 2)
    values = {}
    rows = 5
    for layer_name in ("decoder.layers.0.", "mtp.layers.0.transformer_layer."):
        for pre, suf in (("model.module.", ""), ("optimizer.state.module.module.module.", ".exp_avg")):
            for e in range(E):
                key = f"{pre}{layer_name}mlp.experts.local_experts.{e}.linear_fc2.weight{suf}"
                values[key] = _value(key, (rows, H))
                cut = 1 + e % (rows - 1)
                w.tensor(0, key, (rows, H), torch.float32, (0, 0), values[key][:cut])
                w.tensor(1, key, (rows, H), torch.float32, (cut, 0), values[key][cut:])
            key = f"{pre}{layer_name}mlp.router.weight{suf}"
            values[key] = _value(key, (E, H))
            w.tensor(0, key, (E, H), torch.float32, (0, 0), values[key][:3])
            w.tensor(1, key, (E, H), torch.float32, (3, 0), values[key][3:])
    w.close()
    perms = {0: PERMS[1], 1: PERMS[2]}  # one decoder layer: MTP layer 0 is model layer 1
    doc = {**_doc(), "layers": {str(k): v for k, v in perms.items()}}
    ck.permute_dcp(src, dst, doc)
    out, _ = _read_all(dst)
    for key, t in out.items():
        layer = 1 if ".mtp." in key else 0
        perm = perms[layer]
        if ".router." in key:
            assert torch.equal(t, values[key][torch.tensor(perm)]), key
        else:
            e = int(key.split("local_experts.")[1].split(".")[0])
            assert torch.equal(t, values[key.replace(f"local_experts.{e}.", f"local_experts.{perm[e]}.")]), key


def test_unknown_entry_under_an_expert_module_is_refused_by_name(tmp_path):
    src = tmp_path / "src"
    state = _megatron_state(grouped=True)
    odd = "module.decoder.layers.1.mlp.experts.linear_fc1.scale_inv"  # no expert id in the name
    state["model"][odd] = torch.ones(E)
    _save(state, src)
    with pytest.raises(InvalidInputError, match=r"model\.module\.decoder\.layers\.1\.mlp\.experts\.linear_fc1\.scale_inv"):
        ck.permute_dcp(src, tmp_path / "dst", _doc())
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_virtual_pipeline_chunks_are_refused_by_name(tmp_path):
    """Under VPP Megatron saves ``model0``, ``model1``, ... (chunk-local layer numbers) and a
    ChainedOptimizer's ``{0: ..., 1: ...}`` (``checkpointing.py`` l. 897-900, ``optimizer.py``
    ``ChainedOptimizer.sharded_state_dict``, 0.16.1): refused, naming an expert entry."""
    src = tmp_path / "src"
    state = _megatron_state(grouped=False)
    state["model0"] = state.pop("model")
    state["optimizer"] = {0: state["optimizer"]}
    _save(state, src)
    with pytest.raises(InvalidInputError, match=r"^(model0|optimizer\.0)\.\S*\.mlp\.(experts|router)\."):
        ck.permute_dcp(src, tmp_path / "dst", _doc())
    assert sorted(os.listdir(tmp_path)) == ["src"]
