"""Ladder rows from training logs (placement/runlogs, ``placement calibrate --from-logs``).

The fixture logs in tests/data/runlogs/ follow the stacks' format strings; each cites its source
lines in its first comment lines (Megatron-LM @d98e8a64 ``_print_args`` and ``training_log``,
Megatron-Bridge @067f987d ``log_non_default_values``, TorchTitan 0.3.0 ``MetricsProcessor.log``
and ``build_mesh``).  Expected figures below are counted by hand from the fixtures.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.predict.calibration import read_ladder
from placement.cli import main
from placement.core.model import InvalidInputError
from placement.core.perfdata import Architecture
from placement.sources.runlogs import rows_from_logs
from placement.sources.runlogs.common import SHAPE_FIELDS, Interval, clean_line, dedupe, steady_state
from placement.sources.runlogs.megatron import MCORE_DEFAULTS, MLA_DEFAULTS, _intervals

DATA = Path(__file__).resolve().parent / "data" / "runlogs"
DSV3 = DATA / "megatron_lm_dsv3.log"
QWEN3 = DATA / "megatron_lm_qwen3.log"
BRIDGE = DATA / "megatron_bridge_qwen3_30b.log"
TITAN = DATA / "torchtitan_dsv3.log"
TITAN_TOML = DATA / "torchtitan_dsv3.toml"

# One Megatron-LM iteration line exactly as training_log formats it (training.py lines 3567-3641).
ITERATION = (
    " [2026-08-22 10:03:00.003000] iteration        3/      20 | consumed samples:        12288 |"
    " elapsed time per iteration (ms): 13342.1 | throughput per GPU (TFLOP/s/GPU): 1275.8 |"
    " learning rate: 1.000000E-05 | global batch size:  4096 | lm loss: 1.005000E+01 |"
    " loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)


# ---------------------------------------------------------------------------------------------
# Launcher prefixes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        "0: hello | x",  # srun --label
        " 12: hello | x",  # srun --label, right-aligned task id
        "[rank3]: hello | x",  # torchrun --tee
        "[rank3]:hello | x",
        "[1,0]<stdout>:hello | x",  # Open MPI --tag-output
        "[pod/train-worker-3/pytorch] hello | x",  # kubectl logs --prefix
        "2026-08-22T10:00:00.123456789Z hello | x",  # kubectl logs --timestamps
        "[pod/w-0/c] 2026-08-22T10:00:00+00:00 hello | x",
        "\x1b[32m0: \x1b[0m[rank0]: hello | x\x1b[39m",  # colour codes around the prefixes
        "hello | x\r\n",
    ],
)
def test_clean_line_removes_every_launcher_prefix(raw):
    assert clean_line(raw) == "hello | x"


def test_clean_line_keeps_what_the_program_printed():
    # Megatron's own timestamp and a dotted argument line are the program's text, not a prefix.
    assert clean_line(ITERATION) == ITERATION
    assert clean_line("  num_layers ...................................... 61") == (
        "  num_layers ...................................... 61"
    )


_PREFIXES = ["0: ", "255: ", "[rank7]:", "[1,3]<stdout>:", "[pod/p-1/c] ", "2026-08-22T10:00:00.5Z ", "\x1b[36m"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(_PREFIXES), max_size=4))
def test_an_iteration_line_reads_the_same_under_any_stack_of_prefixes(prefixes):
    line = clean_line("".join(prefixes) + ITERATION)
    assert _intervals([line], "x") == [Interval(3, 13.3421, 1275.8, False)]


# ---------------------------------------------------------------------------------------------
# Duplicates, warm-up, broken intervals
# ---------------------------------------------------------------------------------------------
def test_dedupe_keeps_one_copy_per_step_in_step_order():
    a, b, c = Interval(2, 1.0), Interval(1, 2.0), Interval(2, 9.0)
    assert dedupe([a, b, c]) == [b, a]


def test_warm_up_rule_drops_two_intervals_or_one_when_few():
    many = [Interval(i, float(i)) for i in range(1, 6)]
    kept, note = steady_state(many, "x")
    assert [iv.step for iv in kept] == [3, 4, 5] and "dropped 2 warm-up" in note
    kept, _ = steady_state(many[:3], "x")
    assert [iv.step for iv in kept] == [2, 3]
    kept, _ = steady_state(many[:1], "x")
    assert [iv.step for iv in kept] == [1]
    broken = [Interval(1, 1.0), Interval(2, 1.0, broken=True)]
    with pytest.raises(InvalidInputError, match="skipped or NaN"):
        steady_state(broken, "x")


# ---------------------------------------------------------------------------------------------
# Rows from the fixtures (figures counted by hand)
# ---------------------------------------------------------------------------------------------
def _times_ms_dsv3() -> list[float]:
    # The fixture's elapsed times, read with a plain split (not the reader under test).
    out: dict[int, float] = {}
    for line in DSV3.read_text().splitlines():
        if "iteration " in line and "elapsed time per iteration (ms):" in line:
            step = int(line.split("iteration")[1].split("/")[0])
            if "number of nan iterations:   0" in line:
                out.setdefault(step, float(line.split("elapsed time per iteration (ms):")[1].split("|")[0]))
            else:
                out.setdefault(step, float("nan"))
    return [out[s] for s in sorted(out)]


def test_megatron_lm_deepseek_v3_row():
    (row,) = rows_from_logs([DSV3], "gb200")
    assert row["family"] == "deepseek_v3"
    assert (row["gpus"], row["tp"], row["cp"], row["pp"], row["vpp"], row["ep"], row["dp"]) == (256, 1, 1, 4, 4, 64, 64)
    assert (row["micro_batch"], row["global_batch"], row["seq_len"]) == (1, 4096, 4096)
    assert (row["precision"], row["dispatcher"], row["overlap"], row["expert_load"]) == ("mxfp8", "hybridep", "1f1b", "balanced")
    shape = row["shape"]
    assert (shape["num_layers"], shape["first_dense_layers"], shape["num_experts"], shape["top_k"]) == (61, 3, 256, 8)
    assert (shape["num_groups"], shape["groups_per_token"], shape["mtp_num_layers"]) == (8, 4, 1)
    assert (shape["attention"], shape["q_lora_rank"], shape["vocab_size"]) == ("mla", 1536, 129280)
    times = _times_ms_dsv3()
    assert len(times) == 20  # 26 iteration lines, 6 of them a second node's copy
    kept = [t for t in times[2:] if t == t]  # warm-up 2, iteration 11 has a NaN
    assert len(kept) == 17
    t_s = statistics.median(kept) / 1e3
    assert row["tokens_per_s_per_gpu"] == pytest.approx(4096 * 4096 / (t_s * 256), abs=1e-3)
    assert row["tflops_per_gpu"] == pytest.approx(1276.0, abs=0.15)  # printed as 1276.0 * 13340 / t with .1f
    assert "dropped 2 warm-up and 1 with skipped/NaN" in row["note"]


def test_megatron_lm_qwen3_row_from_kubectl_prefixed_log():
    (row,) = rows_from_logs([QWEN3], "gb300")
    assert row["family"] == "qwen3_235b_a22b"
    assert (row["pp"], row["vpp"], row["ep"], row["dp"], row["micro_batch"], row["global_batch"]) == (4, 12, 32, 64, 2, 8192)
    shape = row["shape"]
    assert (shape["attention"], shape["num_query_groups"], shape["kv_channels"]) == ("gqa", 4, 128)
    assert (shape["first_dense_layers"], shape["shared_expert_ffn_hidden_size"], shape["mtp_num_layers"]) == (0, 0, 0)
    assert shape["vocab_size"] == 151936  # the padded-vocab line's new size
    # Kept intervals 3..10 minus iteration 6 (one skipped iteration): median of
    # 24987 25010 24950 24999 25020 24960 25040 ms is 24999 ms.
    assert row["tokens_per_s_per_gpu"] == pytest.approx(8192 * 4096 / (24.999 * 256), abs=1e-3)
    assert row["tflops_per_gpu"] == pytest.approx(1306.6)


def test_megatron_bridge_row_needs_gpus_and_takes_mcore_defaults():
    with pytest.raises(InvalidInputError, match=r"megatron_bridge_qwen3_30b.log: .*number of GPUs.*--gpus"):
        rows_from_logs([BRIDGE], "b200")
    (row,) = rows_from_logs([BRIDGE], "b200", gpus=8)
    assert row["family"] == "qwen3_30b_a3b"
    # tp, pp, cp are at Megatron Core's defaults, so the summary does not print them.
    assert (row["tp"], row["pp"], row["cp"], row["vpp"], row["ep"], row["dp"]) == (1, 1, 1, 1, 8, 8)
    assert (row["precision"], row["dispatcher"], row["expert_load"]) == ("bf16", "alltoall", "routing")
    assert row["shape"]["swiglu"] is True and row["shape"]["num_groups"] == 1
    # Kept intervals 3..8: median of 12080 12101 12070 12095 12090 12060 is 12085 ms.
    assert row["tokens_per_s_per_gpu"] == pytest.approx(512 * 4096 / (12.085 * 8), abs=1e-3)
    # The vocabulary is not in the log: it comes from the family (Qwen/Qwen3-30B-A3B config.json).
    assert row["shape"]["vocab_size"] == 151936


def test_torchtitan_row_through_its_config_manager():
    (row,) = rows_from_logs([TITAN], "h100", config=str(TITAN_TOML))
    assert row["family"] == "deepseek_v3"
    # Mesh line pp=8 dp_shard=32 ep=32: 256 GPUs; TOML local_batch_size 8 x dp 32, microbatch 1.
    assert (row["gpus"], row["pp"], row["ep"], row["dp"]) == (256, 8, 32, 32)
    assert (row["micro_batch"], row["global_batch"], row["seq_len"]) == (1, 256, 4096)
    # tps of steps 30..100 without the NaN step 80: 352 349 351 348 350 353 347 -> median 350.
    assert row["tokens_per_s_per_gpu"] == 350.0 and "tflops_per_gpu" not in row
    assert "read by TorchTitan ConfigManager" in row["note"]
    assert row["shape"]["mtp_num_layers"] == 0


def test_torchtitan_config_manager_rejects_a_bad_value(tmp_path):
    pytest.importorskip("torchtitan")
    bad = tmp_path / "bad.toml"
    bad.write_text(TITAN_TOML.read_text().replace("local_batch_size = 8", 'local_batch_size = "eight"'))
    with pytest.raises(InvalidInputError, match="ConfigManager refuses"):
        rows_from_logs([TITAN], "h100", config=str(bad))


def test_every_row_carries_the_contract_shape():
    rows = rows_from_logs([DSV3, QWEN3], "gb300") + rows_from_logs([BRIDGE], "b200", gpus=8)
    arch = {f.name for f in dataclasses.fields(Architecture)}
    extra = {"num_layers", "first_dense_layers", "hidden_size", "num_experts", "top_k", "num_groups", "groups_per_token"}
    for row in rows:
        assert set(row["shape"]) == arch | extra == set(SHAPE_FIELDS)
        assert isinstance(row["family"], str) and row["family"]
        Architecture(**{k: row["shape"][k] for k in arch})


def test_mcore_defaults_match_the_installed_megatron_core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    base = {f.name: f.default for f in dataclasses.fields(tc.TransformerConfig)}
    mla = {f.name: f.default for f in dataclasses.fields(tc.MLATransformerConfig)}
    for k, v in MCORE_DEFAULTS.items():
        assert base[k] == v, k
    for k, v in MLA_DEFAULTS.items():
        assert mla[k] == v, k


# ---------------------------------------------------------------------------------------------
# The CLI: round trip, one-line errors
# ---------------------------------------------------------------------------------------------
def test_from_logs_round_trips_through_a_ladder_file(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    args = ["calibrate", "--from-logs", str(DSV3), str(QWEN3), "--gpu", "gb200"]
    assert main(args + ["--write-rows", str(rows)]) == 0
    first = capsys.readouterr().out
    table = first[first.index("row "):].replace(f"wrote {rows}\n", "")
    assert [r.name for r in read_ladder(rows)] == ["megatron_lm_dsv3", "megatron_lm_qwen3"]
    assert main(["calibrate", str(rows)]) == 0
    assert capsys.readouterr().out == table
    # The same logs give byte-identical rows.
    again = tmp_path / "again.json"
    assert main(args + ["--write-rows", str(again)]) == 0
    assert again.read_bytes() == rows.read_bytes()


def test_from_logs_after_a_ladder_adds_the_rows(tmp_path, capsys):
    ladder = tmp_path / "ladder.json"
    assert main(["calibrate", "--from-logs", str(DSV3), "--gpu", "gb200", "--write-rows", str(ladder)]) == 0
    doc = json.loads(ladder.read_text())
    doc["rows"][0]["name"] = "published"
    ladder.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["calibrate", str(ladder), "--from-logs", str(QWEN3), "--gpu", "gb200"]) == 0
    out = capsys.readouterr().out
    assert "published" in out and "megatron_lm_qwen3" in out


def _strip(path: Path, tmp_path: Path, *needles: str) -> Path:
    out = tmp_path / path.name
    out.write_text("".join(ln for ln in path.read_text().splitlines(True) if not any(n in ln for n in needles)))
    return out


@pytest.mark.parametrize(
    "make,extra,message",
    [
        (lambda t: BRIDGE, [], "megatron_bridge_qwen3_30b.log: the log does not say the number of GPUs (give --gpus N)"),
        (lambda t: _strip(DSV3, t, " num_experts "), [], "megatron_lm_dsv3.log: the log does not say num_experts"),
        (lambda t: _strip(DSV3, t, " seq_length "), [], "megatron_lm_dsv3.log: the log does not say the seq len"),
        (lambda t: _strip(DSV3, t, "iteration "), [], "megatron_lm_dsv3.log: no training step lines found"),
        (lambda t: TITAN, [], "torchtitan_dsv3.log: a TorchTitan log needs its job configuration"),
        (lambda t: TITAN_TOML, [], "torchtitan_dsv3.toml: no Megatron-LM arguments block"),
        (lambda t: DSV3, ["--gpus", "128"], "megatron_lm_dsv3.log: --gpus 128 disagrees with the log's 256 GPUs"),
    ],
)
def test_a_log_missing_a_fact_exits_2_in_one_line(tmp_path, capsys, make, extra, message):
    rows = tmp_path / "rows.json"
    code = main(["calibrate", "--from-logs", str(make(tmp_path)), "--gpu", "gb200", "--write-rows", str(rows)] + extra)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not rows.exists()


def test_two_runs_in_one_file_exit_2(tmp_path, capsys):
    mixed = tmp_path / "mixed.log"
    mixed.write_text(DSV3.read_text() + QWEN3.read_text())
    assert main(["calibrate", "--from-logs", str(mixed), "--gpu", "gb200"]) == 2
    assert "two runs in one file" in capsys.readouterr().err


def test_log_options_need_from_logs(capsys):
    assert main(["calibrate", "--gpu", "gb200"]) == 2
    assert "--gpu: only with --from-logs" in capsys.readouterr().err
    assert main(["calibrate", "--from-logs", str(DSV3)]) == 2
    assert "--gpu: required with --from-logs" in capsys.readouterr().err


def test_the_same_log_twice_in_one_file_gives_the_same_row(tmp_path):
    doubled = tmp_path / DSV3.name
    doubled.write_text(DSV3.read_text() + DSV3.read_text())  # two nodes' copies, concatenated
    assert rows_from_logs([doubled], "gb200")[0] | {"source": ""} == rows_from_logs([DSV3], "gb200")[0] | {"source": ""}


def test_a_row_with_a_shape_predicts_as_the_same_row_with_its_named_model(tmp_path):
    from placement.predict.calibration import calibrate, default_ladder_path
    from placement.sources.runlogs.common import KNOWN_FAMILIES

    doc = json.loads(default_ladder_path().read_text())
    named = next(r for r in doc["rows"] if r["name"] == "gb200_mxfp8_2608")
    shaped = {k: v for k, v in named.items() if k != "model"} | {
        "name": "shaped", "family": "deepseek_v3", "shape": KNOWN_FAMILIES["deepseek_v3"]}
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"version": 1, "rows": [named, shaped]}))
    a, b = calibrate(read_ladder(path), ()).results
    assert (a.predicted_tflops_per_gpu, a.predicted_tokens_per_s_per_gpu) == (
        b.predicted_tflops_per_gpu, b.predicted_tokens_per_s_per_gpu)


@pytest.mark.parametrize("field", ["shape", "family"])
def test_a_ladder_row_needs_its_family_and_shape(tmp_path, field):
    from placement.predict.calibration import default_ladder_path

    doc = json.loads(default_ladder_path().read_text())
    row = {k: v for k, v in doc["rows"][0].items() if k != field}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"version": 1, "rows": [row]}))
    with pytest.raises(InvalidInputError, match=rf"rows\[0\].*{field}"):
        read_ladder(path)


def test_megatron_bridge_deepseek_v3_row_takes_mla_defaults():
    (row,) = rows_from_logs([DATA / "megatron_bridge_dsv3.log"], "gb300", gpus=256)
    shape = row["shape"]
    # multi_latent_attention, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim are at
    # MLATransformerConfig's defaults, so the summary does not print them.
    assert (shape["attention"], shape["q_lora_rank"], shape["kv_lora_rank"], shape["qk_pos_emb_head_dim"]) == ("mla", 1536, 512, 64)
    assert shape["vocab_size"] == 129280  # "Using preset vocab_size: 129280 over the tokenizer ..."
    assert (row["pp"], row["vpp"], row["ep"], row["dp"], row["dispatcher"], row["overlap"]) == (2, 8, 32, 128, "hybridep", "1f1b")
    # Kept 3..10: 10432 10412 10423 10405 10429 10420 10416 10426 ms -> median (10420 + 10423) / 2.
    assert row["tokens_per_s_per_gpu"] == pytest.approx(4096 * 4096 / (10.4215 * 256), abs=1e-3)


@pytest.mark.parametrize("freq,first", [("([0]*3+[1]*58)", 3), ("[0]*1+[1]*60", 1), ("1", 0)])
def test_moe_layer_freq_as_typed_is_read(tmp_path, freq, first):
    text = DSV3.read_text().replace(str([0] * 3 + [1] * 58), freq)
    log = tmp_path / "freq.log"
    log.write_text(text)
    (row,) = rows_from_logs([log], "gb200")
    assert row["shape"]["first_dense_layers"] == first
    # The family is matched on layers, hidden size, experts and top-k only (common.family_of).
    assert row["family"] == "deepseek_v3"


def test_moe_layer_freq_with_interleaved_dense_layers_is_refused(tmp_path):
    log = tmp_path / "freq.log"
    log.write_text(DSV3.read_text().replace(str([0] * 3 + [1] * 58), "2"))
    with pytest.raises(InvalidInputError, match="moe_layer_freq=2"):
        rows_from_logs([log], "gb200")


def test_torchtitan_without_mesh_line_takes_gpus(tmp_path):
    log = _strip(TITAN, tmp_path, "Building device mesh")
    with pytest.raises(InvalidInputError, match="number of GPUs"):
        rows_from_logs([log], "h100", config=str(TITAN_TOML))
    (row,) = rows_from_logs([log], "h100", config=str(TITAN_TOML), gpus=256)
    assert (row["gpus"], row["dp"], row["global_batch"]) == (256, 32, 256)


def test_torchtitan_launch_arguments_as_config():
    pytest.importorskip("torchtitan")
    launch = "--module deepseek_v3 --config deepseek_v3_671b --parallelism.pipeline_parallel_degree 8"
    (row,) = rows_from_logs([TITAN], "h100", config=launch)
    # deepseek_v3_671b's registry config: local_batch_size 4, seq_len 4096; the mesh line's dp 32.
    assert (row["gpus"], row["dp"], row["global_batch"], row["seq_len"]) == (256, 32, 128, 4096)
    assert "launch arguments" in row["note"]
    with pytest.raises(InvalidInputError, match="Config function 'nope' not found"):
        rows_from_logs([TITAN], "h100", config="--module deepseek_v3 --config nope")
