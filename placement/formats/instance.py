"""The instance file: JSON plus a referenced ``.npz`` of routing, read with every check before the
model objects are built (one :class:`~placement.core.model.InvalidInputError` line naming the file
and field), and written byte-reproducibly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import re
import stat
import string
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from placement.core.model import Cluster, Instance, InvalidInputError, MoEModel, ParallelLayout, Routing, SUPPORTED_ETP
from placement.core.perfdata import Architecture, Performance
from placement.core.pipeline_layout import parse_layout, render_layout, stage_decoder_layers, validate_chunks
from placement.formats.files import atomic_write_bytes, atomic_write_text, dumps
from placement.formats.schema import validate
from placement.formats.spec import (
    INSTANCE_SCHEMA_VERSION,
    INSTANCE_SPEC,
    MAX_GBPS,
    MAX_GPUS,
    MAX_JSON_BYTES,
    MAX_LAYER_EXPERTS,
    MAX_NPZ_BYTES,
    MAX_ROUTING_IDS,
    MIN_GBPS,
    _GQA_FIELDS,
    _MLA_FIELDS,
)

# ---------------------------------------------------------------------------------------------
# Instance
# ---------------------------------------------------------------------------------------------
def _read_input_file(path: Path, what: str, max_bytes: int, label: str) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; errors start with ``label``.

    FIFOs, devices and directories are refused before anything is read (``/dev/zero`` as an
    instance must not fill memory; a FIFO must not block the command).
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        raise InvalidInputError(f"{label}: {what} file not found") from None
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL in the path
        raise InvalidInputError(f"{label}: cannot read {what} file: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise InvalidInputError(f"{label}: expected a {what} file, found a directory")
    if not stat.S_ISREG(info.st_mode):
        raise InvalidInputError(f"{label}: expected a regular {what} file")
    too_big = f"{label}: the {what} file is larger than the limit of {max_bytes:,} bytes"
    if info.st_size > max_bytes:
        raise InvalidInputError(too_big)
    try:
        with path.open("rb") as fh:
            # read(n) allocates n bytes up front: ask for the size stat gave, more only if it grew
            raw = fh.read(info.st_size + 1)
            if len(raw) > info.st_size:
                raw += fh.read(max_bytes + 1 - len(raw))
    except OSError as exc:
        raise InvalidInputError(f"{label}: cannot read {what} file: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:  # grew since stat
        raise InvalidInputError(too_big)
    return raw


def _load_json(path: Path, what: str) -> tuple[Any, bytes]:
    raw = _read_input_file(path, what, MAX_JSON_BYTES, str(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path}: not UTF-8 text") from None
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys), raw
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise InvalidInputError(f"{path}: malformed JSON: nested too deeply") from None
    except ValueError as exc:  # non-finite constants, duplicate keys, integers of > 4300 digits
        raise InvalidInputError(f"{path}: malformed JSON: {exc}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in an object")
        out[key] = value
    return out


def _fail(where: Path, path: str, msg: str) -> InvalidInputError:
    return InvalidInputError(f"{where}: {path}: {msg}")


def _check_instance_semantics(doc: dict, where: Path) -> None:
    m, p, c = doc["model"], doc["parallel"], doc["cluster"]
    # Sizes first: nothing below (or in the model) may allocate by an unchecked product.
    world = p["tp"] * p["cp"] * p["dp"] * p["pp"]
    if world > MAX_GPUS:
        raise _fail(where, "parallel", f"tp*cp*dp*pp = {world} ranks exceeds the limit of {MAX_GPUS:,}")
    n_gpus = c["num_domains"] * c["trays_per_domain"] * c["gpus_per_tray"]
    if n_gpus > MAX_GPUS:
        raise _fail(
            where, "cluster", f"num_domains*trays_per_domain*gpus_per_tray = {n_gpus} GPUs exceeds the limit of {MAX_GPUS:,}"
        )
    if len(m["moe_layers"]) * m["num_experts"] > MAX_LAYER_EXPERTS:
        raise _fail(where, "model.num_experts", f"MoE layers x experts exceeds the limit of {MAX_LAYER_EXPERTS:,}")
    for key in ("nvlink_gbps", "scaleout_gbps"):
        if not MIN_GBPS <= c[key] <= MAX_GBPS:
            raise _fail(where, f"cluster.{key}", f"expected between {MIN_GBPS:g} and {MAX_GBPS:g} (10^9 bytes/s), found {c[key]}")
    L = m["num_layers"]
    moe = m["moe_layers"]
    if any(b <= a for a, b in zip(moe, moe[1:])):
        raise _fail(where, "model.moe_layers", "expected strictly ascending layer indices")
    mtp = m.get("mtp_num_layers", 0)
    if moe[-1] >= L + mtp:
        raise _fail(
            where,
            "model.moe_layers",
            f"layer {moe[-1]} is out of range for num_layers={L}"
            + (f" + mtp_num_layers={mtp}" if mtp else " (an MTP layer needs model.mtp_num_layers)"),
        )
    E, G = m["num_experts"], m["num_groups"]
    if E % G:
        raise _fail(where, "model.num_groups", f"{G} groups do not divide num_experts={E}")
    if m["groups_per_token"] > G:
        raise _fail(where, "model.groups_per_token", f"{m['groups_per_token']} exceeds num_groups={G}")
    if m["top_k"] > E:
        raise _fail(where, "model.top_k", f"top_k={m['top_k']} exceeds num_experts={E}")
    if G > 1 and m["top_k"] > m["groups_per_token"] * (E // G):
        raise _fail(where, "model.top_k", "top_k exceeds the experts of groups_per_token groups")
    names = p["order"].split("-")
    if sorted(names) != sorted(["tp", "cp", "ep", "dp", "pp"]):
        raise _fail(where, "parallel.order", f"expected a permutation of tp-cp-ep-dp-pp, found {p['order']!r}")
    per_stage = p["tp"] * p["cp"] * p["dp"]
    if per_stage % p["ep"]:
        raise _fail(where, "parallel.ep", f"ep={p['ep']} does not divide tp*cp*dp={per_stage}")
    slots = p.get("expert_slots_per_rank", -(-E // p["ep"]))
    if slots * p["ep"] < E:
        raise _fail(
            where,
            "parallel.expert_slots_per_rank" if "expert_slots_per_rank" in p else "parallel.ep",
            f"more experts than slots: {E} experts > {p['ep']} EP ranks x {slots} slots",
        )
    if slots * p["ep"] != E:
        raise _fail(
            where,
            "parallel.expert_slots_per_rank" if "expert_slots_per_rank" in p else "parallel.ep",
            f"{p['ep']} EP ranks x {slots} slots != {E} experts (redundant slots are not supported)",
        )
    if p.get("etp", 1) not in SUPPORTED_ETP:
        raise _fail(
            where,
            "parallel.etp",
            f"expert-tensor-parallel size {p['etp']} is not supported (only {', '.join(map(str, SUPPORTED_ETP))}: "
            "each expert whole on one GPU); launch Megatron with --expert-tensor-parallel-size 1",
        )
    _check_pipeline_layout(doc, where)
    if len(p["stage_layers"]) != p["pp"]:
        raise _fail(where, "parallel.stage_layers", f"expected {p['pp']} stages (pp), found {len(p['stage_layers'])}")
    seen = sorted(x for st in p["stage_layers"] for x in st)
    if seen != list(range(L)):
        raise _fail(where, "parallel.stage_layers", f"expected every layer 0..{L - 1} exactly once")
    if p["global_batch"] % (p["dp"] * p["micro_batch"]):
        raise _fail(where, "parallel.global_batch", "must be a multiple of dp * micro_batch")
    bad = [g for g in c.get("unavailable_gpus", []) if g >= n_gpus]
    if bad:
        raise _fail(where, "cluster.unavailable_gpus", f"GPU id {bad[0]} is out of range (cluster has {n_gpus})")
    if len(set(c.get("unavailable_gpus", []))) != len(c.get("unavailable_gpus", [])):
        raise _fail(where, "cluster.unavailable_gpus", "duplicate GPU ids")
    trays = [tuple(t) for t in c.get("unavailable_trays", [])]
    for i, t in enumerate(trays):
        if len(t) != 2 or t[0] >= c["num_domains"] or t[1] >= c["trays_per_domain"]:
            raise _fail(where, f"cluster.unavailable_trays[{i}]", f"expected [domain, tray] in range, found {list(t)}")
    if len(set(trays)) != len(trays):
        raise _fail(where, "cluster.unavailable_trays", "duplicate trays")
    # A GPU listed on its own and again through its tray: the two lists disagree about what is
    # down (usually a wrong tray or GPU index), so it is refused rather than silently merged.
    down_trays = {(d, t): i for i, (d, t) in enumerate(trays)}
    per_domain = c["trays_per_domain"] * c["gpus_per_tray"]
    for g in c.get("unavailable_gpus", []):
        tray = (g // per_domain, (g % per_domain) // c["gpus_per_tray"])
        if tray in down_trays:
            raise _fail(
                where,
                "cluster.unavailable_gpus",
                f"GPU {g} is in tray {list(tray)}, already unavailable as cluster.unavailable_trays[{down_trays[tray]}]",
            )
    _check_host_format(where, c.get("host_format", "rack{domain:02d}-tray{tray:02d}"), c)
    if "hosts" in c:
        _check_hosts(where, c)
    if "domain_names" in c and len(c["domain_names"]) != c["num_domains"]:
        raise _fail(where, "cluster.domain_names", f"expected {c['num_domains']} names (num_domains), found {len(c['domain_names'])}")
    if "performance" in doc:
        _check_performance(doc, where)


def _layout_mtp_layers(doc: dict) -> int:
    """MTP layers of an instance document: the model's, else the performance architecture's."""
    m = doc["model"].get("mtp_num_layers", 0)
    return m or doc.get("performance", {}).get("architecture", {}).get("mtp_num_layers", 0)


def _check_pipeline_layout(doc: dict, where: Path) -> None:
    """Parse and check ``parallel.pipeline_model_parallel_layout``; fill ``stage_layers`` from it.

    Megatron-Core 0.16.1's rules (:func:`placement.core.pipeline_layout.validate_chunks`); a given
    ``stage_layers`` must list the same layers per stage as the layout.
    """
    p = doc["parallel"]
    field = "parallel.pipeline_model_parallel_layout"
    if "pipeline_model_parallel_layout" not in p:
        if "stage_layers" not in p:
            raise _fail(where, "parallel.stage_layers", "required when parallel.pipeline_model_parallel_layout is absent")
        return
    try:
        chunks = parse_layout(p["pipeline_model_parallel_layout"], field)
        validate_chunks(chunks, p["pp"], doc["model"]["num_layers"], _layout_mtp_layers(doc), field)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{where}: {exc}") from None
    derived = [list(x) for x in stage_decoder_layers(chunks, p["pp"])]
    if "stage_layers" in p and [sorted(x) for x in p["stage_layers"]] != derived:
        raise _fail(where, "parallel.stage_layers", "disagrees with parallel.pipeline_model_parallel_layout "
                    "(leave it out, or list each stage's decoder layers as the layout numbers them)")
    p["stage_layers"] = derived


def _check_performance(doc: dict, where: Path) -> None:
    perf, p = doc["performance"], doc["parallel"]
    for key in (
        "gemm_efficiency",
        "expert_gemm_efficiency",
        "fp8_gemm_ratio",
        "nvlink_dispatch_efficiency",
        "nvlink_combine_efficiency",
        "nic_efficiency",
        "overlap_efficiency",
    ):
        if perf.get(key, 0.5) > 1:
            raise _fail(where, f"performance.{key}", f"expected a fraction <= 1, found {perf[key]}")
    arch = perf["architecture"]
    needed = _MLA_FIELDS if arch["attention"] == "mla" else _GQA_FIELDS
    for key in needed:
        if arch.get(key, 0) < 1:
            raise _fail(
                where, f"performance.architecture.{key}", f"expected an integer >= 1 for {arch['attention']} attention"
            )
    if arch["attention"] == "gqa" and arch["num_attention_heads"] % arch["num_query_groups"]:
        raise _fail(where, "performance.architecture.num_query_groups", "must divide num_attention_heads")
    mtp = doc["model"].get("mtp_num_layers", 0)
    if mtp and arch.get("mtp_num_layers", 0) != mtp:
        raise _fail(
            where,
            "performance.architecture.mtp_num_layers",
            f"expected {mtp}, as model.mtp_num_layers (found {arch.get('mtp_num_layers', 0)})",
        )
    vpp = perf.get("vpp", 1)
    num_layers = doc["model"]["num_layers"]
    if "pipeline_model_parallel_layout" in p:
        stages = len(parse_layout(p["pipeline_model_parallel_layout"]))
        if stages != vpp * p["pp"]:
            raise _fail(where, "performance.vpp", f"vpp={vpp} but parallel.pipeline_model_parallel_layout has "
                        f"{stages} stages = pp * {stages // p['pp']}")
        _check_overlap(where, perf.get("overlap", "1f1b"), p["pp"], vpp, p["ep"], arch.get("mtp_num_layers", 0))
        return
    slots = [sum(1 for layer in s if layer < num_layers) for s in p["stage_layers"]]
    slots[0] += 1
    slots[-1] += arch.get("mtp_num_layers", 0) + 1
    for s, n in enumerate(slots):
        if n % vpp:
            raise _fail(
                where,
                "performance.vpp",
                f"vpp={vpp} does not divide stage {s}'s {n} layer slots (layers, +1 embedding on the first "
                "stage, +MTP layers +1 output layer on the last)",
            )
    _check_overlap(where, perf.get("overlap", "1f1b"), p["pp"], vpp, p["ep"], arch.get("mtp_num_layers", 0))


def _check_overlap(where: Path, overlap: str, pp: int, vpp: int, ep: int, mtp_num_layers: int) -> None:
    """Megatron-Core's rules for ``overlap_moe_expert_parallel_comm`` (the ``1f1b`` overlap).

    ``TransformerConfig.__post_init__`` (megatron/core/transformer/transformer_config.py of
    NVIDIA/Megatron-LM) asserts: a virtual pipeline size when PP > 1, expert parallelism > 1, and at
    most one MTP layer.  A refused combination is an input error naming the field to change.
    """
    if overlap != "1f1b":
        return
    if pp > 1 and vpp < 2:
        raise _fail(
            where,
            "performance.vpp",
            f"overlap 1f1b with pp={pp} needs vpp > 1 (Megatron-Core refuses the EP all-to-all overlap "
            "without a virtual pipeline when PP > 1); set vpp or overlap none",
        )
    if ep < 2:
        raise _fail(where, "performance.overlap", "overlap 1f1b needs expert parallelism (ep > 1); use overlap none")
    if mtp_num_layers > 1:
        raise _fail(
            where,
            "performance.architecture.mtp_num_layers",
            f"overlap 1f1b supports at most one MTP layer in Megatron-Core, found {mtp_num_layers}",
        )


def _performance(doc: dict) -> Performance:
    perf = doc["performance"]
    arch = perf["architecture"]
    architecture = Architecture(**{k: arch[k] for k in arch})
    return Performance(**{k: v for k, v in perf.items() if k != "architecture"}, architecture=architecture)


def performance_document(perf: Performance) -> dict:
    """The ``performance`` block of an instance document, every field explicit."""
    out: dict[str, Any] = {}
    for key, value in dataclasses.asdict(perf).items():
        if key == "peak_tflops" and not value:
            continue
        if key == "architecture":
            value = {k: v for k, v in value.items() if v or k in ("shared_expert_ffn_hidden_size", "mtp_num_layers", "swiglu")}
        out[key] = value
    return out


_HOST_FIELDS = ("domain", "tray", "host")
_HOST_SPEC = re.compile(r"0?[1-9]?[0-9]?[dxX]?")  # "", "d", "02d", "3", "x": bounded width, no fill


def _check_host_format(where: Path, fmt: str, c: dict) -> None:
    """Host name patterns go into SLURM host files: one printable token, distinct per host."""
    field = "cluster.host_format"
    if not fmt or any(ch.isspace() or not ch.isprintable() for ch in fmt):
        raise _fail(where, field, "expected a non-empty pattern without spaces or control characters")
    try:
        parts = list(string.Formatter().parse(fmt))
    except ValueError as exc:
        raise _fail(where, field, f"bad pattern: {exc}") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in _HOST_FIELDS:
            raise _fail(where, field, f"unknown field {{{name}}} (expected {{domain}}, {{tray}} or {{host}})")
        if conversion is not None or not _HOST_SPEC.fullmatch(spec or ""):
            raise _fail(where, field, f"format of {{{name}}} must look like 02d, found {spec!r}")
    trays = c["trays_per_domain"]
    seen: dict[str, int] = {}
    for host in range(c["num_domains"] * trays):
        name = fmt.format(domain=host // trays, tray=host % trays, host=host)
        if name in seen:
            raise _fail(where, field, f"hosts {seen[name]} and {host} get the same name {name!r}")
        seen[name] = host


def _check_hosts(where: Path, c: dict) -> None:
    """Real host names go into SLURM host files and launch scripts: one token each, distinct."""
    hosts = c["hosts"]
    if len(hosts) != c["num_domains"]:
        raise _fail(where, "cluster.hosts", f"expected one list per domain ({c['num_domains']}), found {len(hosts)}")
    seen: dict[str, str] = {}
    for d, names in enumerate(hosts):
        if len(names) > c["trays_per_domain"]:
            raise _fail(where, f"cluster.hosts[{d}]", f"{len(names)} hosts, more than trays_per_domain={c['trays_per_domain']}")
        for t, name in enumerate(names):
            field = f"cluster.hosts[{d}][{t}]"
            if not name or any(ch.isspace() or not ch.isprintable() for ch in name):
                raise _fail(where, field, f"expected a host name without spaces or control characters, found {name!r}")
            if name in seen:
                raise _fail(where, field, f"host {name!r} is listed twice (also {seen[name]})")
            seen[name] = field


def _resolve_npz(where: Path, rel: str) -> Path:
    if not rel or "\0" in rel:
        raise _fail(where, "routing.file", f"expected a file name, found {rel!r}")
    if os.path.isabs(rel):
        raise _fail(where, "routing.file", "expected a path relative to the instance's folder")
    try:
        base = where.resolve().parent
        target = (base / rel).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, names too long
        raise _fail(where, "routing.file", f"cannot resolve {rel!r}: {exc}") from None
    if base != target and base not in target.parents:
        raise _fail(where, "routing.file", f"path {rel!r} escapes the instance's folder")
    return target


_NPZ_MEMBERS = {"topk.npy": "topk", "heldout_topk.npy": "heldout_topk"}


def _load_npz(where: Path, npz_path: Path, doc: dict) -> tuple[dict[str, np.ndarray], bytes]:
    """The routing arrays of ``npz_path``, each header checked before its data is read.

    Only the two expected members are accepted; a member's dtype, shape and size are checked
    against the instance from its ``.npy`` header, so a compressed "zip bomb" or a shape like
    ``(10**9, ...)`` is refused before anything is allocated, and object (pickled) arrays are
    refused without being unpickled.
    """
    label = f"{where}: routing.file: {npz_path.name}"
    raw = _read_input_file(npz_path, ".npz", MAX_NPZ_BYTES, label)
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            names = zf.namelist()
            for name in names:
                if name not in _NPZ_MEMBERS:
                    raise _fail(
                        where, "routing.file", f"unexpected array {name!r} in {npz_path.name} (expected topk, heldout_topk)"
                    )
            if len(set(names)) != len(names):
                raise _fail(where, "routing.file", f"{npz_path.name} holds an array twice")
            for member, key in _NPZ_MEMBERS.items():
                if member not in names:
                    raise _fail(where, f"routing.{key}", f"missing array in {npz_path.name}")
                arrays[key] = _read_npy_member(where, zf, member, key, doc)
    except (InvalidInputError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - any parser failure on untrusted bytes is bad input
        raise _fail(
            where, "routing.file", f"not a readable .npz (truncated or corrupt): {type(exc).__name__}: {exc}"
        ) from None
    return arrays, raw


def _read_npy_member(where: Path, zf: zipfile.ZipFile, member: str, key: str, doc: dict) -> np.ndarray:
    fmt = np.lib.format
    with zf.open(member) as fh:
        version = fmt.read_magic(fh)
        if version == (1, 0):
            shape, fortran_order, dtype = fmt.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran_order, dtype = fmt.read_array_header_2_0(fh)
        else:
            raise _fail(where, "routing.file", f"array {key}: unsupported .npy format version {version}")
        if dtype.hasobject:
            raise _fail(where, "routing.file", f"array {key} holds pickled objects, which are refused")
        _check_topk_header(where, key, tuple(shape), dtype, doc)
        count = math.prod(shape)
        if count > MAX_ROUTING_IDS:
            raise _fail(where, f"routing.{key}", f"{count:,} expert ids exceed the limit of {MAX_ROUTING_IDS:,}")
        nbytes = count * dtype.itemsize
        data = fh.read(nbytes)
        if len(data) != nbytes:
            raise _fail(where, f"routing.{key}", f"truncated: {len(data)} of {nbytes} data bytes")
        if fh.read(1):  # also makes zipfile verify the member's CRC
            raise _fail(where, f"routing.{key}", "trailing bytes after the array data")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")


def _check_topk_header(where: Path, field: str, shape: tuple[int, ...], dtype: np.dtype, doc: dict) -> None:
    m, p = doc["model"], doc["parallel"]
    want = (len(m["moe_layers"]), p["dp"], None, m["top_k"])
    if dtype.kind not in "iu" or dtype.itemsize > 8:
        raise _fail(where, f"routing.{field}", f"expected an integer array, found dtype {dtype}")
    if len(shape) != 4 or shape[0] != want[0] or shape[1] != want[1] or shape[3] != want[3] or shape[2] < 1:
        raise _fail(
            where,
            f"routing.{field}",
            f"expected shape (num_moe_layers={want[0]}, dp={want[1]}, tokens>=1, top_k={want[3]}), found {shape}",
        )


def _check_topk(where: Path, field: str, a: np.ndarray, doc: dict) -> np.ndarray:
    m = doc["model"]
    _check_topk_header(where, field, a.shape, a.dtype, doc)
    E = m["num_experts"]
    if a.size and (a.min() < 0 or a.max() >= E):
        raise _fail(where, f"routing.{field}", f"expert ids must lie in [0, {E}), found {int(a.min())}..{int(a.max())}")
    s = np.sort(a, axis=-1)
    if np.any(s[..., 1:] == s[..., :-1]):
        raise _fail(where, f"routing.{field}", "a token lists the same expert twice")
    G = m["num_groups"]
    if G > 1 and m["groups_per_token"] < G:
        grp = s // (E // G)
        ngroups = 1 + (grp[..., 1:] != grp[..., :-1]).sum(axis=-1)
        if ngroups.max() > m["groups_per_token"]:
            raise _fail(
                where,
                f"routing.{field}",
                f"a token uses {int(ngroups.max())} expert groups, more than groups_per_token={m['groups_per_token']}",
            )
    return a.astype(np.uint16 if E <= 65535 else np.int64)


def _window_tokens(where: Path, doc: dict, topk: np.ndarray) -> tuple[int, ...] | None:
    """``routing.window_tokens`` checked against ``topk`` (None when absent: one sampled window)."""
    wt = doc["routing"].get("window_tokens")
    if wt is None:
        return None
    if sum(wt) != topk.shape[2]:
        raise _fail(where, "routing.window_tokens",
                    f"the windows' {sum(wt)} tokens per source differ from topk's {topk.shape[2]}")
    return tuple(int(t) for t in wt)


def model_from_section(m: dict) -> MoEModel:
    """The :class:`MoEModel` of an instance's (already validated) ``model`` section."""
    return MoEModel(
        name=m["name"],
        num_layers=m["num_layers"],
        moe_layers=tuple(m["moe_layers"]),
        num_experts=m["num_experts"],
        top_k=m["top_k"],
        num_groups=m["num_groups"],
        groups_per_token=m["groups_per_token"],
        hidden_size=m["hidden_size"],
        dispatch_bytes_per_token=m["dispatch_bytes_per_token"],
        combine_bytes_per_token=m["combine_bytes_per_token"],
        dispatch_grad_bytes_per_token=m.get("dispatch_grad_bytes_per_token", 0),
        combine_grad_bytes_per_token=m.get("combine_grad_bytes_per_token", 0),
        mtp_num_layers=m.get("mtp_num_layers", 0),
    )


def cluster_from_section(c: dict) -> Cluster:
    """The :class:`Cluster` of an instance's (already validated) ``cluster`` section: unavailable
    trays and GPUs become the ``available`` mask."""
    n_gpus = c["num_domains"] * c["trays_per_domain"] * c["gpus_per_tray"]
    available = np.ones(n_gpus, dtype=bool)
    available[c.get("unavailable_gpus", [])] = False
    for d, t in c.get("unavailable_trays", []):
        h = d * c["trays_per_domain"] + t
        available[h * c["gpus_per_tray"] : (h + 1) * c["gpus_per_tray"]] = False
    host_names: list[str] | None = None
    if "hosts" in c:  # tray slots past a domain's hosts are empty: no host, no GPUs to use
        host_names = []
        for d, names in enumerate(c["hosts"]):
            host_names.extend(list(names) + [""] * (c["trays_per_domain"] - len(names)))
            first = (d * c["trays_per_domain"] + len(names)) * c["gpus_per_tray"]
            available[first : (d + 1) * c["trays_per_domain"] * c["gpus_per_tray"]] = False
    return Cluster(
        num_domains=c["num_domains"],
        trays_per_domain=c["trays_per_domain"],
        gpus_per_tray=c["gpus_per_tray"],
        available=available,
        nvlink_gbps=float(c["nvlink_gbps"]),
        scaleout_gbps=float(c["scaleout_gbps"]),
        host_format=c.get("host_format", "rack{domain:02d}-tray{tray:02d}"),
        host_names=tuple(host_names) if host_names is not None else None,
        domain_names=tuple(c["domain_names"]) if "domain_names" in c else None,
    )


def cluster_section(c: Cluster) -> dict:
    """The ``cluster`` section of an instance (or the cluster fields of a cluster file) for ``c``:
    whole unavailable trays as trays, the rest as GPUs; ``hosts`` and ``domain_names`` when set."""
    trays: list[list[int]] = []
    gpus: list[int] = []
    gpt = c.gpus_per_tray
    unavailable = np.flatnonzero(~np.asarray(c.available))
    for h in sorted({int(g) // gpt for g in unavailable}):
        members = [h * gpt + i for i in range(gpt)]
        if all(not c.available[g] for g in members):
            trays.append([h // c.trays_per_domain, h % c.trays_per_domain])
        else:
            gpus.extend(g for g in members if not c.available[g])
    out: dict[str, Any] = {
        "num_domains": c.num_domains,
        "trays_per_domain": c.trays_per_domain,
        "gpus_per_tray": c.gpus_per_tray,
        "nvlink_gbps": c.nvlink_gbps,
        "scaleout_gbps": c.scaleout_gbps,
        "host_format": c.host_format,
        "unavailable_gpus": gpus,
        "unavailable_trays": trays,
    }
    if c.host_names is not None:  # absent without real names (older files byte for byte)
        t = c.trays_per_domain
        out["hosts"] = [[n for n in c.host_names[d * t : (d + 1) * t] if n] for d in range(c.num_domains)]
    if c.domain_names is not None:
        out["domain_names"] = list(c.domain_names)
    return out


def read_instance(path: str | os.PathLike) -> Instance:
    """Read and validate an instance file and its routing ``.npz``.

    Raises
    ------
    InvalidInputError
        With one line naming the file, the field path, what was expected and found.
    """
    where = Path(path)
    doc, raw = _load_json(where, "instance")
    validate(doc, INSTANCE_SPEC, str(where))
    _check_instance_semantics(doc, where)
    npz_path = _resolve_npz(where, doc["routing"]["file"])
    arrays, npz_raw = _load_npz(where, npz_path, doc)
    topk = _check_topk(where, "topk", arrays["topk"], doc)
    held = _check_topk(where, "heldout_topk", arrays["heldout_topk"], doc)
    window_tokens = _window_tokens(where, doc, topk)

    m, p, c = doc["model"], doc["parallel"], doc["cluster"]
    model = model_from_section(m)
    parallel = ParallelLayout(
        tp=p["tp"],
        cp=p["cp"],
        ep=p["ep"],
        dp=p["dp"],
        pp=p["pp"],
        order=p["order"],
        stage_layers=tuple(tuple(s) for s in p["stage_layers"]),
        seq_len=p["seq_len"],
        micro_batch=p["micro_batch"],
        global_batch=p["global_batch"],
        etp=p.get("etp", 1),
        pipeline_layout=parse_layout(p["pipeline_model_parallel_layout"]) if "pipeline_model_parallel_layout" in p else (),
    )
    cluster = cluster_from_section(c)
    digest = hashlib.sha256(raw + b"\0" + npz_raw).hexdigest()
    return Instance(
        name=doc["name"],
        model=model,
        parallel=parallel,
        cluster=cluster,
        routing=Routing(topk, held, window_tokens),
        cost_mode=doc["cost_mode"],
        description=doc.get("description", ""),
        sha256=digest,
        extra={"generator": doc["routing"].get("generator", {}), "path": str(where)},
        performance=_performance(doc) if "performance" in doc else None,
        apply=doc.get("apply"),
    )


def instance_document(instance: Instance, npz_name: str) -> dict:
    """The JSON document of an instance (without its arrays)."""
    m, p, c = instance.model, instance.parallel, instance.cluster
    doc = {
        "schema_version": INSTANCE_SCHEMA_VERSION,
        "name": instance.name,
        "description": instance.description,
        "cost_mode": instance.cost_mode,
        **({"apply": instance.apply} if instance.apply is not None else {}),  # absent: not stated
        "model": {
            "name": m.name,
            "num_layers": m.num_layers,
            "moe_layers": list(m.moe_layers),
            "num_experts": m.num_experts,
            "top_k": m.top_k,
            "num_groups": m.num_groups,
            "groups_per_token": m.groups_per_token,
            "hidden_size": m.hidden_size,
            "dispatch_bytes_per_token": m.dispatch_bytes_per_token,
            "combine_bytes_per_token": m.combine_bytes_per_token,
            "dispatch_grad_bytes_per_token": m.dispatch_grad_bytes_per_token,
            "combine_grad_bytes_per_token": m.combine_grad_bytes_per_token,
            **({"mtp_num_layers": m.mtp_num_layers} if m.mtp_num_layers else {}),
        },
        "parallel": {
            "tp": p.tp,
            "cp": p.cp,
            "ep": p.ep,
            "dp": p.dp,
            "pp": p.pp,
            "order": p.order,
            "stage_layers": [list(s) for s in p.stage_layers],
            "expert_slots_per_rank": m.num_experts // p.ep,
            "seq_len": p.seq_len,
            "micro_batch": p.micro_batch,
            "global_batch": p.global_batch,
            **({"etp": p.etp} if p.etp != 1 else {}),  # absent means 1 (keeps older files byte for byte)
            **({"pipeline_model_parallel_layout": render_layout(p.pipeline_layout)} if p.pipeline_layout else {}),
        },
        "cluster": cluster_section(c),
        "routing": {"file": npz_name, "generator": instance.extra.get("generator", {})},
    }
    if instance.routing.window_tokens is not None:  # absent for one window (older files byte for byte)
        routing_doc: dict = doc["routing"]  # type: ignore[assignment]
        routing_doc["window_tokens"] = list(instance.routing.window_tokens)
    if instance.performance is not None:
        doc["performance"] = performance_document(instance.performance)
    return doc


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """A byte-for-byte reproducible compressed .npz (fixed zip timestamps)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(arrays):
            arr = np.ascontiguousarray(arrays[name])
            member = io.BytesIO()
            np.lib.format.write_array(member, arr, allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, member.getvalue(), compresslevel=9)
    return buf.getvalue()


def write_instance(instance: Instance, path: str | os.PathLike) -> None:
    """Write ``instance`` as ``path`` (JSON) and ``path`` with suffix ``.npz``, atomically each."""
    path = Path(path)
    npz_name = path.with_suffix(".npz").name
    if instance.routing.heldout_topk is None:
        raise InvalidInputError("routing.heldout_topk: cannot write an instance without its held-out window")
    dtype = np.uint8 if instance.model.num_experts <= 256 else np.uint16
    atomic_write_bytes(
        path.with_suffix(".npz"),
        _npz_bytes({"topk": instance.routing.topk.astype(dtype), "heldout_topk": instance.routing.heldout_topk.astype(dtype)}),
    )
    atomic_write_text(path, dumps(instance_document(instance, npz_name)))


