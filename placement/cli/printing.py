"""The tables and lines the commands print (bytes in decimal units, per optimizer step)."""

from __future__ import annotations

from typing import Callable, TYPE_CHECKING

if TYPE_CHECKING:
    from placement.core.model import Instance
    from solvers.base import SolveResult


def _gb(x: float) -> str:
    """Bytes in decimal units (kB = 10^3 B ... TB = 10^12 B), four significant figures."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.4g} {unit}"
    return f"{x:.0f} B"


def _summary_lines(title: str, m: dict) -> list[str]:
    has_held = "heldout_cross_domain_bytes_per_step" in m
    lines = [f"{title}  (cost mode {m['cost_mode']}, per optimizer step)"]

    def row(label: str, key: str, fmt: Callable[[float], str]) -> None:
        held = f"   held-out {fmt(m['heldout_' + key])}" if has_held else ""
        lines.append(f"  {label:<38}{fmt(m[key]):>16}{held}")

    row("cross-domain all-to-all bytes", "cross_domain_bytes_per_step", _gb)
    row("busiest NIC (one direction)", "max_gpu_cross_domain_bytes_per_step", _gb)
    row("intra-domain (NVLink) bytes", "intra_domain_bytes_per_step", _gb)
    row("remote domains per token", "remote_domains_per_token", lambda v: f"{v:.3f}")
    row("remote experts per token", "remote_experts_per_token", lambda v: f"{v:.3f}")
    row("expert load max/mean (worst layer)", "expert_load_max_over_mean", lambda v: f"{v:.3f}")
    if "expert_load_lasting_max_over_mean" in m:  # sampling noise removed (placement.predict.imbalance)
        row("  lasting (noise removed, priced)", "expert_load_lasting_max_over_mean", lambda v: f"{v:.3f}")
    row("all-to-all time, slowest stage", "alltoall_time_s_per_step", lambda v: f"{v:.2f} s")
    if "predicted_step_time_s" in m:  # the instance has a performance block
        for label, key, fmt in _PREDICTED_ROWS:
            row(label, key, fmt)
        for label, key, fmt in _BAND_ROWS:
            if f"{key}_{_SETTINGS[0]}" in m:
                held = f"   held-out {_band(m, 'heldout_' + key, fmt)}" if has_held else ""
                lines.append(f"  {label:<38}{_band(m, key, fmt):>16}{held}")
    return lines


# The step-time model's settings of its uncertain terms (placement.predict.performance.SETTINGS) and the
# band rows: label, report key without prefix and setting suffix, format.
_SETTINGS = ("low", "mid", "high")
_BAND_ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("predicted step s, low/mid/high", "predicted_step_time_s", lambda v: f"{v:.4g}"),
    ("predicted TFLOP/s/GPU, low/mid/high", "predicted_tflops_per_gpu", lambda v: f"{v:,.1f}"),
]


def _band(m: dict, key: str, fmt: Callable[[float], str]) -> str:
    """``low / mid / high`` of ``key`` (the report's ``{key}_{setting}`` values)."""
    return " / ".join(fmt(m[f"{key}_{s}"]) for s in _SETTINGS)


# Predicted step time rows (placement.predict.performance): label, report key without prefix, format.
_PREDICTED_ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("predicted step time", "predicted_step_time_s", lambda v: f"{v:.4g} s"),
    ("predicted tokens/s per GPU", "predicted_tokens_per_s_per_gpu", lambda v: f"{v:,.0f}"),
    ("predicted TFLOP/s per GPU", "predicted_tflops_per_gpu", lambda v: f"{v:,.1f}"),
    ("predicted exposed all-to-all", "predicted_exposed_alltoall_s_per_step", lambda v: f"{v:.4g} s"),
    ("predicted pipeline bubble share", "predicted_bubble_share", lambda v: f"{v:.3f}"),
]


def _moves_lines(previous: str, mv: dict) -> list[str]:
    """What the re-placement moved and gained against the previous placement."""
    lines = [f"  re-placement of {previous}: {mv['moved_replicas']:,} of {mv['replicas_total']:,} expert replicas moved "
             f"({100 * mv['moved_share']:.1f}%), {_gb(mv['moved_bytes_cross_rack'])} across racks, "
             f"{_gb(mv['moved_bytes_nvlink'])} over NVLink ({_gb(mv['bytes_per_replica'])} each), "
             f"move time {mv['move_time_s']:.3g} s"]
    gain = mv.get("gain", {})
    parts = []
    if "heldout_cross_domain_bytes_per_step" in gain:
        parts.append(f"cross-domain bytes (h-o) {_gb(gain['heldout_cross_domain_bytes_per_step'])}")
    if "heldout_predicted_step_time_s" in gain:
        parts.append(f"predicted step time (h-o) {gain['heldout_predicted_step_time_s']:.4g} s")
    if parts:
        lines.append("  gain per step against the previous placement: " + ", ".join(parts))
    if mv.get("payback_steps") is not None:
        lines.append(f"  the move pays back in {mv['payback_steps']:.3g} steps (move time / step time gained)")
    elif mv.get("payback_steps_bytes") is not None:
        lines.append(f"  the move pays back in {mv['payback_steps_bytes']:.3g} steps (cross-rack bytes moved / "
                     "cross-domain bytes saved per step)")
    elif mv["moved_replicas"]:
        lines.append("  the move does not pay back: no held-out gain")
    return lines


def _footprint_lines(instance: Instance, result: SolveResult) -> list[str]:
    """Each pipeline stage's GPUs per NVLink domain: one line per stage that straddles domains."""
    from solvers.layout import stage_footprints

    feet = (result.details.get("layout") or {}).get("stage_footprints") if isinstance(result.details, dict) else None
    if feet is None:
        feet = stage_footprints(instance, result.placement.rank2gpu)
    whole = [f"s{s} d{f[0][0]}" for s, f in enumerate(feet) if len(f) == 1]
    lines = [f"  stages inside one NVLink domain: {len(whole)} of {len(feet)}" + (f" ({', '.join(whole)})" if whole else "")]
    for s, f in enumerate(feet):
        if len(f) > 1:
            lines.append(f"  stage {s} over {len(f)} domains (domain:GPUs): " + " + ".join(f"d{d}:{n}" for d, n in f))
    split = result.details.get("pipeline_layout") if isinstance(result.details, dict) else None
    if split:  # the pipeline layer split the solve chose (placement.predict.pipeline_split)
        own = split["candidates"]["instance"]
        lines.append(f"  pipeline layout: {split['chosen']} (instance's {own['layout']}; predicted step, sampled: "
                     f"{split['candidates'][split['candidate']]['predicted_step_time_s']:.4g} s against "
                     f"{own['predicted_step_time_s']:.4g} s)")
    return lines
