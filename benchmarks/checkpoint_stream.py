"""Streaming permutation of a Megatron-Core ``torch_dist`` checkpoint with DeepSeek-V3's key layout.

Writes a synthetic checkpoint the way ``dist_checkpointing.save`` lays it out (one storage file
per rank, ``.metadata``, ``metadata.json``, ``common.pt``) with DeepSeek-V3's structure at a
smaller hidden size and fewer layers: 3 dense layers then MoE layers (stacked ``decoder.layers.*``
tensors, experts as axis 1, one chunk per layer and expert), an MTP layer with its own MoE
(``mtp.layers.0.transformer_layer.mlp.*``, model layer ``num_layers``), per-expert
``_extra_state`` objects, and the distributed optimizer in Megatron's default ``dp_reshardable``
layout (BF16 parameters, FP32 ``param`` / ``exp_avg`` / ``exp_avg_sq`` in flat buckets: a dense
optimizer ``chained_0`` and an expert optimizer ``chained_1`` with one ``dp_group_idx`` per
expert-parallel rank) with its bucket layout.  Then permutes it with
:func:`placement.consumers.checkpoint.permute_dcp` (every MoE layer and the MTP layer moved across EP
ranks) and prints the peak resident memory of all its processes, the bytes per second per worker
and the time this rate projects for a 9.4 TB DeepSeek-V3 checkpoint (weights, FP32 master weights
and Adam moments) on a stated number of hosts.

    python benchmarks/checkpoint_stream.py --gb 2 --gb 20 [--workers 2] [--dir /work/tmp-ckpt]

Each size is generated, permuted, spot-checked and deleted in turn.  Times depend on the disk and
on the machine's load (quote ``uptime`` with them).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DSV3_TOTAL_BYTES = 9.4e12  # DeepSeek-V3 with Adam: 1.3 TB BF16 weights + ~8 TB FP32 master weights and moments


@dataclass(frozen=True)
class Shape:
    """The synthetic model: DeepSeek-V3's structure, scaled down.

    ``dense_layers`` dense decoder layers then ``moe_layers`` MoE layers, ``experts`` routed
    experts over ``ep`` expert-parallel ranks, one MTP layer (MoE).
    """

    moe_layers: int
    dense_layers: int = 3
    hidden: int = 512
    moe_ffn: int = 256
    dense_ffn: int = 1024
    experts: int = 64
    ep: int = 8
    vocab: int = 4096

    @property
    def num_layers(self) -> int:
        return self.dense_layers + self.moe_layers

    def moe_layer_ids(self) -> list[int]:
        """Model layer indices of the MoE layers, the MTP layer (``num_layers``) last."""
        return list(range(self.dense_layers, self.num_layers)) + [self.num_layers]

    def bytes_per_moe_layer(self) -> int:
        per_expert = 3 * self.moe_ffn * self.hidden
        return self.experts * per_expert * (2 + 3 * 4) + self.experts * self.hidden * (4 + 3 * 4)


def shape_for(gb: float, **kw: Any) -> Shape:
    """The shape whose checkpoint is about ``gb`` GB (at least one MoE layer)."""
    base = Shape(moe_layers=1, **kw)
    fixed = _fixed_bytes(base)
    layers = max(1, round((gb * 1e9 - fixed) / base.bytes_per_moe_layer()) - 1)  # the MTP layer is one more
    return Shape(moe_layers=layers, **kw)


def _fixed_bytes(s: Shape) -> int:
    h = s.hidden
    attn = 4 * h * h + 2 * h
    dense = attn * s.num_layers + 3 * s.dense_ffn * h * s.dense_layers + 2 * s.vocab * h + 3 * s.moe_ffn * h * s.moe_layers
    return dense * (2 + 3 * 4)


# ---------------------------------------------------------------------------------------------
# Writing a torch_dist checkpoint chunk by chunk
# ---------------------------------------------------------------------------------------------
class _Writer:
    """Storage files and ``.metadata`` of a DCP checkpoint, one chunk at a time (bounded memory)."""

    def __init__(self, root: Path, ranks: int) -> None:
        self.root = root
        self.files = {r: open(root / f"__{r}_0.distcp", "wb") for r in range(ranks)}
        self.tensors: dict[str, Any] = {}
        self.objects: set[str] = set()
        self.storage: dict[Any, Any] = {}

    def tensor(self, rank: int, fqn: str, size: tuple[int, ...], dtype: Any, offsets: tuple[int, ...], data: Any) -> None:
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
        )

        if fqn not in self.tensors:
            self.tensors[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [])
        self.tensors[fqn].chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(data.shape)))
        f = self.files[rank]
        start = f.tell()
        torch.save(data.to(dtype).contiguous(), f)
        self.storage[MetadataIndex(fqn, offsets)] = _StorageInfo(f"__{rank}_0.distcp", start, f.tell() - start)

    def obj(self, rank: int, fqn: str, payload: bytes) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        self.objects.add(fqn)
        f = self.files[rank]
        start = f.tell()
        f.write(payload)
        self.storage[MetadataIndex(fqn)] = _StorageInfo(f"__{rank}_0.distcp", start, len(payload))

    def close(self) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

        for f in self.files.values():
            f.close()
        sd_md: dict[str, Any] = dict(self.tensors)
        sd_md.update({k: BytesStorageMetadata() for k in sorted(self.objects)})
        with open(self.root / ".metadata", "wb") as f:
            pickle.dump(Metadata(state_dict_metadata=sd_md, storage_data=self.storage), f)
        (self.root / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                            "common_backend": "torch", "common_backend_version": 1}))
        import torch

        torch.save({"args": None, "iteration": 1000}, self.root / "common.pt")


def _fill(shape: tuple[int, ...], key: str, random: bool) -> Any:
    """Chunk data: random (tests) or a cheap pattern that still differs per chunk (large runs)."""
    import torch

    seed = zlib.crc32(key.encode())
    if random:
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return torch.full(shape, float(seed % 997) / 997.0)


def write_checkpoint(root: Path, s: Shape, *, random: bool = False) -> dict[str, Any]:
    """Write the synthetic checkpoint into ``root`` (created); return its bucket layout document."""
    import torch

    from placement.consumers.checkpoint.megatron_dist import BUCKET_LAYOUT_KIND

    root.mkdir(parents=True)
    w = _Writer(root, s.ep)
    bf16, fp32 = torch.bfloat16, torch.float32
    h, f, L, E, el = s.hidden, s.moe_ffn, s.num_layers, s.experts, s.experts // s.ep
    moe = list(range(s.dense_layers, L))
    # model: dense parameters on rank 0 (a real job spreads them over its ranks: same keys)
    dense: list[tuple[str, tuple[int, ...], list[int] | None]] = [
        ("embedding.word_embeddings.weight", (s.vocab, h), None),
        ("decoder.layers.input_layernorm.weight", (L, h), list(range(L))),
        ("decoder.layers.self_attention.linear_q_down_proj.weight", (L, h, h), list(range(L))),
        ("decoder.layers.self_attention.linear_kv_down_proj.weight", (L, h, h), list(range(L))),
        ("decoder.layers.self_attention.linear_kv_up_proj.weight", (L, h, h), list(range(L))),
        ("decoder.layers.self_attention.linear_proj.weight", (L, h, h), list(range(L))),
        ("decoder.layers.pre_mlp_layernorm.weight", (L, h), list(range(L))),
        ("decoder.layers.mlp.linear_fc1.weight", (L, 2 * s.dense_ffn, h), list(range(s.dense_layers))),
        ("decoder.layers.mlp.linear_fc2.weight", (L, h, s.dense_ffn), list(range(s.dense_layers))),
        ("decoder.layers.mlp.shared_experts.linear_fc1.weight", (L, 2 * f, h), moe),
        ("decoder.layers.mlp.shared_experts.linear_fc2.weight", (L, h, f), moe),
        ("decoder.layers.mlp.router.weight", (L, E, h), moe),
        ("mtp.layers.0.eh_proj.weight", (h, 2 * h), None),
        ("mtp.layers.0.transformer_layer.self_attention.linear_proj.weight", (h, h), None),
        ("mtp.layers.0.transformer_layer.mlp.router.weight", (E, h), None),
        ("decoder.final_layernorm.weight", (h,), None),
        ("output_layer.weight", (s.vocab, h), None),
    ]
    rows: list[list[Any]] = []
    dense_dtype = str((bf16, fp32))
    pos = 0
    dense_parts: list[tuple[str, tuple[int, ...], int | None, int]] = []  # fqn, chunk shape, layer, bucket start
    for fqn, size, layers in dense:
        is_router = ".mlp.router.weight" in fqn
        for layer in (layers if layers is not None else [None]):
            shape = size[1:] if layer is not None else size
            offsets = ((layer,) + (0,) * (len(size) - 1)) if layer is not None else (0,) * len(size)
            w.tensor(0, fqn, size, fp32 if is_router else bf16, offsets,
                     _fill(((1,) if layer is not None else ()) + shape, f"{fqn}{offsets}", random))
            numel = 1
            for d in shape:
                numel *= d
            model_layer = layer if layer is not None else (L if fqn.startswith("mtp.") else None)
            family = fqn.replace("decoder.layers.", "decoder.layers.{}.").replace("mtp.layers.0.transformer_layer.", "mtp.layers.{}.")
            rows.append([0, 0, 0, dense_dtype, 0, pos, numel, family, model_layer, None, 0, is_router])
            dense_parts.append((fqn, shape, model_layer, pos))
            pos += numel
    for state in ("param", "exp_avg", "exp_avg_sq"):
        key = f"chained_0.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_{dense_dtype}.bucket_idx_0.{state}"
        for fqn, shape, _, start in dense_parts:
            numel = 1
            for d in shape:
                numel *= d
            w.tensor(0, key, (pos,), fp32, (start,), _fill((numel,), f"{key}{fqn}{start}", random))
    w.obj(0, "chained_0.optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1", pickle.dumps({"param_groups": []}))
    # experts: rank r holds experts r*el .. (r+1)*el-1 of every MoE layer and of the MTP layer
    layer_ids = moe + [L]
    for r in range(s.ep):
        bucket_pos: dict[int, int] = {}
        for b, layer in enumerate(layer_ids):
            mtp = layer == L
            for e in range(r * el, (r + 1) * el):
                for name, shape in (("linear_fc1", (2 * f, h)), ("linear_fc2", (h, f))):
                    if mtp:
                        fqn = f"mtp.layers.0.transformer_layer.mlp.experts.experts.{name}.weight"
                        w.tensor(r, fqn, (E,) + shape, bf16, (e, 0, 0), _fill((1,) + shape, f"{fqn}{e}", random))
                        w.obj(r, f"mtp.layers.0.transformer_layer.mlp.experts.experts.{name}._extra_state/shard_{e}_{E}",
                              pickle.dumps(("extra", layer, e)))
                    else:
                        fqn = f"decoder.layers.mlp.experts.experts.{name}.weight"
                        w.tensor(r, fqn, (L, E) + shape, bf16, (layer, e, 0, 0), _fill((1, 1) + shape, f"{fqn}{layer}.{e}", random))
                        w.obj(r, f"decoder.layers.mlp.experts.experts.{name}._extra_state/shard_{layer}.{e}_{L}.{E}",
                              pickle.dumps(("extra", layer, e)))
                    numel = shape[0] * shape[1]
                    start = bucket_pos.get(b, 0)
                    fam = ("mtp.layers.{}." if mtp else "decoder.layers.{}.") + f"mlp.experts.local_experts.{{}}.{name}.weight"
                    rows.append([1, r, 0, dense_dtype, b, start, numel, fam, layer, e, 0, False])
                    bucket_pos[b] = start + numel
        for b, layer in enumerate(layer_ids):
            total = bucket_pos[b]
            for state in ("param", "exp_avg", "exp_avg_sq"):
                key = f"chained_1.optimizer.distributed.dp_group_idx_{r}.gbuf_idx_0.dtype_{dense_dtype}.bucket_idx_{b}.{state}"
                for row in rows:
                    if row[0] == 1 and row[1] == r and row[4] == b:
                        w.tensor(r, key, (total,), fp32, (row[5],), _fill((row[6],), f"{key}{row[5]}", random))
        w.obj(r, f"chained_1.optimizer.distributed.dp_group_idx_{r}.optimizer/shard_0_1", pickle.dumps({"param_groups": []}))
    # per-layer router state
    for layer in moe:
        w.tensor(0, "decoder.layers.mlp.router.expert_bias", (L, E), fp32, (layer, 0), _fill((1, E), f"bias{layer}", random))
    w.tensor(0, "mtp.layers.0.transformer_layer.mlp.router.expert_bias", (E,), fp32, (0,), _fill((E,), "mtpbias", random))
    w.close()
    return {"kind": BUCKET_LAYOUT_KIND, "version": 1,
            "fields": ["chain", "dp", "gbuf", "dtype", "bucket", "start", "numel", "family", "layer", "expert", "tp", "router"],
            "params": rows}


def permutation_doc(s: Shape, seed: int = 0) -> dict[str, Any]:
    """A permutation for every MoE layer and the MTP layer (experts move across EP ranks)."""
    import numpy as np

    from placement.core.permutation import PERMUTATION_KIND, PERMUTATION_VERSION

    rng = np.random.default_rng(seed)
    layers = {str(layer): rng.permutation(s.experts).tolist() for layer in s.moe_layer_ids()}
    return {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "megatron", "num_experts": s.experts,
            "layers": layers}


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------
class PeakRss:
    """Peak of the summed resident memory of this process and its children, sampled every 20 ms."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        import psutil

        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._sample())
            self._stop.wait(0.02)

    def __enter__(self) -> "PeakRss":
        self.baseline_bytes = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


def spot_check(src: Path, dst: Path, s: Shape, doc: dict[str, Any]) -> int:
    """Compare a few permuted chunks of ``dst`` with their source chunks; returns chunks checked."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md_s = dcp.FileSystemReader(str(src)).read_metadata()
    md_d = dcp.FileSystemReader(str(dst)).read_metadata()

    def chunk(root: Path, md: Any, fqn: str, off: tuple[int, ...]) -> Any:
        info = md.storage_data[MetadataIndex(fqn, off)]
        with open(root / info.relative_path, "rb") as f:
            f.seek(info.offset)
            return torch.load(io.BytesIO(f.read(info.length)), weights_only=True)

    checked = 0
    for layer in (s.moe_layer_ids()[0], s.moe_layer_ids()[-2]):
        perm = doc["layers"][str(layer)]
        for p in (0, s.experts - 1):
            fqn = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
            got = chunk(dst, md_d, fqn, (layer, p, 0, 0))
            want = chunk(src, md_s, fqn, (layer, perm[p], 0, 0))
            if not torch.equal(got, want):
                raise AssertionError(f"{fqn} layer {layer} expert {p}: not the source expert {perm[p]}")
            checked += 1
    return checked


def run_size(gb: float, base: Path, workers: int, cache_mb: int, hosts: int, workers_per_host: int) -> dict[str, Any]:
    from placement.consumers.checkpoint import DcpStats, permute_dcp

    s = shape_for(gb)
    work = Path(tempfile.mkdtemp(prefix="ckpt_stream_", dir=base))
    try:
        src, dst = work / "src", work / "dst"
        t0 = time.perf_counter()
        layout = write_checkpoint(src, s)
        (work / "layout.json").write_text(json.dumps(layout))
        gen_s = time.perf_counter() - t0
        size_bytes = _dir_bytes(src)
        doc = permutation_doc(s)
        stats = DcpStats()
        with PeakRss() as rss:
            t0 = time.perf_counter()
            permute_dcp(src, dst, doc, bucket_layout=work / "layout.json", workers=workers, cache_bytes=cache_mb << 20,
                        stats=stats)
            wall_s = time.perf_counter() - t0
        checked = spot_check(src, dst, s, doc)
        rate = size_bytes / wall_s / workers
        return {"gb": size_bytes / 1e9, "moe_layers": s.moe_layers, "experts": s.experts, "hidden": s.hidden,
                "files": stats.files_total, "generate_s": gen_s, "permute_s": wall_s, "peak_rss_gb": rss.peak_bytes / 1e9,
                "baseline_rss_gb": rss.baseline_bytes / 1e9, "gbps_per_worker": rate / 1e9, "checked": checked,
                "projected_9_4tb_s": DSV3_TOTAL_BYTES / (rate * hosts * workers_per_host)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, action="append", help="checkpoint size(s) in GB (default 2 and 20)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-mb", type=int, default=64)
    parser.add_argument("--dir", default="/work/tmp-ckpt" if Path("/work").is_dir() else tempfile.gettempdir())
    parser.add_argument("--hosts", type=int, default=32, help="hosts of the 9.4 TB projection")
    parser.add_argument("--workers-per-host", type=int, default=8, help="workers per host of the projection")
    args = parser.parse_args(argv)
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    results = []
    for gb in args.gb or [2.0, 20.0]:
        r = run_size(gb, base, args.workers, args.cache_mb, args.hosts, args.workers_per_host)
        results.append(r)
        print(f"{r['gb']:6.2f} GB ({r['moe_layers']} MoE layers + MTP, {r['experts']} experts, hidden {r['hidden']}, "
              f"{r['files']} files): permuted in {r['permute_s']:.1f} s with {args.workers} workers, "
              f"peak RSS {r['peak_rss_gb']:.3f} GB (all processes; {r['baseline_rss_gb']:.3f} GB before), "
              f"{r['gbps_per_worker']:.3f} GB/s per worker; "
              f"9.4 TB on {args.hosts} hosts x {args.workers_per_host} workers: {r['projected_9_4tb_s'] / 60:.1f} min", flush=True)
    if len(results) > 1:
        growth = results[-1]["peak_rss_gb"] / results[0]["peak_rss_gb"] - 1
        print(f"peak RSS growth from {results[0]['gb']:.1f} GB to {results[-1]['gb']:.1f} GB: {100 * growth:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
