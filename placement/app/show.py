"""``placement show``: a rack-map picture of a placement, PNG or SVG.

One panel per NVLink domain (rack), its trays as rows (tray 0 at the top) and the GPUs of a tray
as columns, so the picture reads like the racks themselves.  Each GPU that runs a rank is coloured
by its pipeline stage and labelled with the stage index (``stage.group`` when a stage has more
than one EP group, whose index also sets the cell's hatch); idle GPUs (free but unused) are white
with a dashed edge, unavailable ones dark grey and crossed.  Cells of an EP group that straddles
domains have a thick black edge; each such group is named, with its cross-domain bytes per
optimizer step, under the panel of the domain that holds its largest part, and a table under the
panels gives its GPUs per domain and its bytes again.  The title and the table take every number
from the evaluator (:func:`placement.predict.cost.evaluate`, its ``cross_domain_bytes_per_ep_group``) on
the held-out window when the instance has one (else the sampled window, and the title says so).

:func:`rack_map` computes what is drawn (numpy only); :func:`rack_map_figure` draws it with
matplotlib (imported here only, so the rest of the package never needs it: ``pip install
'placement[show]'``); :func:`draw_placement` writes the file atomically; :func:`show_files` is
what the CLI runs.  The same inputs give the same file byte for byte (no date in the SVG, a fixed
SVG id salt, text kept as text in the SVG).
"""

from __future__ import annotations

import inspect
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from placement.core.checker import check
from placement.predict.cost import Metrics, Window, evaluate
from placement.formats import atomic_write_bytes, read_instance, read_placement
from placement.core.model import Instance, InvalidInputError, Placement, PlacementError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "IDLE",
    "UNAVAILABLE",
    "SUFFIXES",
    "Straddler",
    "RackMap",
    "rack_map",
    "stage_colors",
    "rack_map_figure",
    "draw_placement",
    "check_output_path",
    "show_files",
]

IDLE = -1  # gpu2stage value of a free GPU that runs no rank
UNAVAILABLE = -2  # gpu2stage value of a GPU that is down
SUFFIXES = (".png", ".svg")
MAX_TABLE_ROWS = 24  # straddling EP groups listed one per line; the rest summed in one line
_MAX_FOOTPRINT = 10  # domains named per table line
_MAX_NOTES = 3  # straddling EP groups named under one panel
_LEGEND_ROWS = 26  # legend entries per column
_CELL_MAX_IN = 0.3  # inches per GPU cell, at most
_CELL_MIN_IN = 0.06
_MAX_WIDTH_IN = 15.0  # the rack panels, not counting the legend
_MAX_HEIGHT_IN = 12.0
_DPI = 120
_TRAY_LABEL_W = 1.2  # cell units left of the first panel of a row, for tray numbers
_TABLE_PT = 8.5
_IDLE_EDGE = "#8c8c8c"
_DOWN_FACE = "#3a3a3a"
_DOWN_HATCH = "#bdbdbd"
_GROUP_HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--")


@dataclass(frozen=True)
class Straddler:
    """One EP group whose GPUs sit in more than one NVLink domain.

    footprint : ((domain, GPUs), ...) sorted by GPUs (most first), then domain.
    cross_domain_bytes_per_step : the evaluator's bytes of the tokens the group's ranks send.
    """

    stage: int
    group: int
    footprint: tuple[tuple[int, int], ...]
    cross_domain_bytes_per_step: float


@dataclass(frozen=True)
class RackMap:
    """What the picture shows.

    gpu2stage : (num_gpus,) pipeline stage of the rank on each GPU, or ``IDLE`` / ``UNAVAILABLE``.
    gpu2group : (num_gpus,) EP group within its stage of the rank on each GPU, -1 where none.
    straddlers : the EP groups over more than one domain, most cross-domain bytes first.
    metrics : the evaluator's metrics on ``window``.
    """

    gpu2stage: np.ndarray
    gpu2group: np.ndarray
    straddlers: tuple[Straddler, ...]
    metrics: Metrics
    window: str


def rack_map(instance: Instance, placement: Placement, window: Window | None = None) -> RackMap:
    """Per-GPU stage and EP group, the straddling EP groups and the evaluator's metrics.

    Parameters
    ----------
    instance, placement : a placement that passed :func:`placement.core.checker.check`.
    window : ``"heldout"`` (default when the instance has one) or ``"sampled"``.
    """
    if window is None:
        window = "heldout" if instance.routing.heldout_topk is not None else "sampled"
    if window not in ("heldout", "sampled"):
        raise InvalidInputError(f"window: expected 'heldout' or 'sampled', found {window!r}")
    par, cl = instance.parallel, instance.cluster
    gpu2stage = np.where(cl.available, IDLE, UNAVAILABLE).astype(np.int64)
    gpu2group = np.full(cl.num_gpus, -1, dtype=np.int64)
    groups = par.stage_ep_groups  # (pp, G, ep) ranks
    rank2gpu = np.asarray(placement.rank2gpu, dtype=np.int64)
    group_gpus = rank2gpu[groups]  # (pp, G, ep)
    for s in range(par.pp):
        for g in range(groups.shape[1]):
            gpu2stage[group_gpus[s, g]] = s
            gpu2group[group_gpus[s, g]] = g
    metrics = evaluate(instance, placement, window=window)
    per_group = metrics.cross_domain_bytes_per_ep_group
    straddlers = []
    for s in range(par.pp):
        for g in range(groups.shape[1]):
            doms, counts = np.unique(cl.gpu2domain[group_gpus[s, g]], return_counts=True)
            if len(doms) > 1:
                foot = tuple(sorted(((int(d), int(n)) for d, n in zip(doms, counts)), key=lambda dn: (-dn[1], dn[0])))
                straddlers.append(Straddler(s, g, foot, float(per_group[s][g])))
    straddlers.sort(key=lambda x: (-x.cross_domain_bytes_per_step, x.stage, x.group))
    return RackMap(gpu2stage, gpu2group, tuple(straddlers), metrics, window)


def stage_colors(pp: int) -> list[str]:
    """(pp,) colour (``#rrggbb``) of each stage: tab10, or tab20's saturated then light shades.

    Greys are left out (they mark idle and unavailable GPUs).  Beyond 18 stages, evenly spaced
    hues (the cells' stage labels tell neighbours apart).
    """
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    if pp <= 10:
        return [to_hex(colormaps["tab10"](i)) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9, 7)[:pp]]
    if pp <= 18:
        order = [i for i in range(0, 20, 2) if i != 14] + [i for i in range(1, 20, 2) if i != 15]
        return [to_hex(colormaps["tab20"](i)) for i in order[:pp]]
    return [to_hex(colormaps["hsv"](i / pp)) for i in range(pp)]


def _mix(color: str, towards: str, t: float) -> str:
    """``color`` moved a fraction ``t`` towards ``towards``."""
    from matplotlib.colors import to_hex, to_rgb

    a, b = to_rgb(color), to_rgb(towards)
    return to_hex((a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1]), a[2] + t * (b[2] - a[2])))


def _text_color(color: str) -> str:
    """Black on light colours, white on dark ones."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _bytes_text(x: float) -> str:
    """Decimal units (kB = 10^3 B ... TB = 10^12 B), four significant figures, as the CLI prints."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.4g} {unit}"
    return f"{x:.0f} B"


def _cell_in(grid_w: float, grid_h: float) -> float:
    """Inches per cell unit: as large as the caps allow."""
    return max(_CELL_MIN_IN, min(_CELL_MAX_IN, _MAX_WIDTH_IN / grid_w, _MAX_HEIGHT_IN / grid_h))


def _grid(num_domains: int, panel_w: float, panel_h: float, cols: int) -> tuple[float, float]:
    rows = math.ceil(num_domains / cols)
    return cols * panel_w + _TRAY_LABEL_W, rows * panel_h


def _panel_columns(num_domains: int, panel_w: float, panel_h: float) -> int:
    """Panels per row: the largest GPU cells within the size caps; on ties fewer rows, then fewer columns."""
    best, best_key = num_domains, (-math.inf, 0)
    for cols in range(1, num_domains + 1):
        rows = math.ceil(num_domains / cols)
        key = (round(_cell_in(*_grid(num_domains, panel_w, panel_h, cols)), 6), -rows)
        if key > best_key:
            best, best_key = cols, key
    return best


def _seconds_text(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def rack_map_figure(
    instance: Instance, placement: Placement, *, window: Window | None = None, label: str = ""
) -> Figure:
    """The rack map of ``placement`` as a matplotlib figure (not attached to pyplot).

    Parameters
    ----------
    instance, placement : a placement that passed :func:`placement.core.checker.check`.
    window : the evaluator's window for the bytes shown (default: held-out when present).
    label : what the placement is (e.g. ``"solver cpsat"``), shown in the title.

    Returns
    -------
    matplotlib.figure.Figure
        One axes holding the panels and the table of straddling EP groups, a figure legend and a
        title.  GPU cells are drawn by patch collections with gids ``"gpus-unavailable"``,
        ``"gpus-idle"`` and ``"gpus-group-<g>"`` (one per hatch), every cell with its own face
        colour; table lines have gids ``"straddler-<stage>-<group>"``, the notes under the panels
        ``"straddler-note-<stage>-<group>"``.
    """
    from matplotlib.collections import Collection, PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.font_manager import FontProperties
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.textpath import TextToPath

    rm = rack_map(instance, placement, window)
    par, cl, met = instance.parallel, instance.cluster, rm.metrics
    ngroups = par.ep_groups_per_stage
    colors = stage_colors(par.pp)
    gpt, tpd, nd = cl.gpus_per_tray, cl.trays_per_domain, cl.num_domains
    n_idle = int((rm.gpu2stage == IDLE).sum())
    n_down = int((rm.gpu2stage == UNAVAILABLE).sum())
    window_name = "held-out" if rm.window == "heldout" else "sampled"

    # Geometry in cell units (one GPU cell is one unit), then inches per unit.
    # Each straddling EP group is also named under the panel of the domain with its largest part.
    footers: dict[int, list[Straddler]] = {}
    for x in rm.straddlers:
        footers.setdefault(x.footprint[0][0], []).append(x)
    footer_line = 0.62
    gap_x, header_h = 1.3, (1.6 if gpt >= 4 else 2.2) + (0.8 if cl.host_names or cl.domain_names else 0.0)
    gap_y = 0.8 + footer_line * min(_MAX_NOTES, max((len(v) for v in footers.values()), default=0))
    panel_w, panel_h = gpt + gap_x, tpd + header_h + gap_y
    cols = _panel_columns(nd, panel_w, panel_h)
    grid_w, grid_h = _grid(nd, panel_w, panel_h, cols)
    cell_in = _cell_in(grid_w, grid_h)
    cell_pt = cell_in * 72
    label_pt = min(8.0, 0.42 * cell_pt) if ngroups == 1 else min(6.5, 0.3 * cell_pt)
    small_pt = max(5.0, min(9.0, 0.45 * cell_pt))
    thick = max(0.8, min(2.2, 0.09 * cell_pt))

    # The texts: title, legend entries, and one table line per straddling EP group (most bytes first).
    title = [
        f"{instance.name}" + (f": {label}" if label else ""),
        f"TP{par.tp} CP{par.cp} PP{par.pp} EP{par.ep} DP{par.dp}: {par.world_size:,} ranks on {cl.num_gpus:,} GPUs "
        f"({nd} NVLink domains x {tpd} trays x {gpt} GPUs), {n_idle} idle, {n_down} unavailable",
        f"per optimizer step ({met.cost_mode}, {window_name} window): cross-domain all-to-all "
        f"{_bytes_text(met.cross_domain_bytes_per_step)}, slowest stage's all-to-all "
        f"{_seconds_text(met.alltoall_time_s_per_step)}, "
        f"{len(rm.straddlers)} of {par.pp * ngroups} EP groups over several domains",
    ]
    mlayers = np.bincount(instance.moe_layer2stage, minlength=par.pp)
    handles: list[Any] = []
    for s in range(par.pp):
        n_moe = int(mlayers[s])
        handles.append(Patch(facecolor=colors[s], edgecolor=colors[s],
                             label=f"stage {s}: {int((rm.gpu2stage == s).sum())} GPUs, "
                                   f"{n_moe} MoE layer{'s' if n_moe != 1 else ''}"))
    if ngroups > 1:
        for g in range(min(ngroups, len(_GROUP_HATCHES))):
            repeat = " (hatches repeat)" if ngroups > len(_GROUP_HATCHES) and g == 0 else ""
            handles.append(Patch(facecolor="#d9d9d9", edgecolor="#555555", linewidth=0.0, hatch=_GROUP_HATCHES[g],
                                 label=f"EP group {g} of each stage (label stage.group){repeat}"))
    handles.append(Patch(facecolor="white", edgecolor=_IDLE_EDGE, linestyle=(0, (2, 1.5)), linewidth=0.8,
                         label=f"idle (free, unused): {n_idle} GPUs"))
    handles.append(Patch(facecolor=_DOWN_FACE, edgecolor=_DOWN_HATCH, hatch="xx", linewidth=0,
                         label=f"unavailable: {n_down} GPUs"))
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=thick,
                         label=f"EP group over several domains: {len(rm.straddlers)} of {par.pp * ngroups}"))
    table = [f"EP groups over several domains: cross-domain bytes per step of the tokens each sends ({window_name} window)"]
    gids = ["straddler-table"]
    if not rm.straddlers:
        table.append("  none: every EP group is inside one NVLink domain")
        gids.append("straddler-none")
    for x in rm.straddlers[:MAX_TABLE_ROWS]:
        name = f"stage {x.stage}" + (f" group {x.group}" if ngroups > 1 else "")
        foot = " + ".join(f"d{d}:{n}" for d, n in x.footprint[:_MAX_FOOTPRINT])
        if len(x.footprint) > _MAX_FOOTPRINT:
            foot += f" + {len(x.footprint) - _MAX_FOOTPRINT} more"
        table.append(f"  {name:<16} {_bytes_text(x.cross_domain_bytes_per_step):>10}   "
                     f"{len(x.footprint)} domains (domain:GPUs) {foot}")
        gids.append(f"straddler-{x.stage}-{x.group}")
    rest = rm.straddlers[MAX_TABLE_ROWS:]
    if rest:
        table.append(f"  ... and {len(rest)} more, {_bytes_text(sum(x.cross_domain_bytes_per_step for x in rest))} together")
        gids.append("straddler-rest")

    # Sizes in inches, from the fonts' own metrics: the figure fits its texts without a tight bbox.
    measure = TextToPath()

    def width_in(text: str, size: float, family: str = "DejaVu Sans") -> float:
        w, _, _ = measure.get_text_width_height_descent(text, FontProperties(family=family, size=size), ismath=False)
        return w / 72

    pad_in, legend_pt, table_pt, title_pt = 0.2, 8.5, _TABLE_PT, 10.0
    title_w = max(width_in(t, title_pt) for t in title)
    title_h = len(title) * title_pt * 1.45 / 72 + 0.15
    legend_cols = math.ceil(len(handles) / _LEGEND_ROWS)
    legend_w = legend_cols * (0.5 + max(width_in(h.get_label(), legend_pt) for h in handles))
    legend_h = (math.ceil(len(handles) / legend_cols) + 1) * legend_pt * 1.75 / 72 + 0.2
    table_w = max(width_in(t, table_pt, "DejaVu Sans Mono") for t in table)
    line_in = table_pt * 1.5 / 72
    panels_w, panels_h = grid_w * cell_in, grid_h * cell_in
    body_h = max(panels_h, legend_h)
    ax_h = body_h + 0.1 + len(table) * line_in
    fig_w = 2 * pad_in + max(panels_w + 0.2 + legend_w, title_w, table_w)
    fig_h = 2 * pad_in + title_h + ax_h
    fig = Figure(figsize=(fig_w, fig_h), dpi=_DPI)
    ax = fig.add_axes((pad_in / fig_w, pad_in / fig_h, panels_w / fig_w, ax_h / fig_h))
    ax.set_xlim(-_TRAY_LABEL_W, grid_w - _TRAY_LABEL_W)
    ax.set_ylim(ax_h / cell_in, 0)  # y grows downwards, in cell units
    ax.axis("off")
    fig.text(pad_in / fig_w, 1 - pad_in / fig_h, "\n".join(title), ha="left", va="top", fontsize=title_pt,
             linespacing=1.45)
    legend = fig.legend(handles=handles, loc="upper left", ncols=legend_cols, fontsize=legend_pt, frameon=False, handlelength=1.4,
                        handleheight=1.1, borderaxespad=0.0, title="GPU colour = pipeline stage", title_fontsize=9,
                        alignment="left",
                        bbox_to_anchor=((pad_in + panels_w + 0.2) / fig_w, 1 - (pad_in + title_h) / fig_h))
    legend.set_gid("legend")

    # Panels: a header per domain, tray numbers left of each row of panels, one cell per GPU.
    straddling = {(x.stage, x.group) for x in rm.straddlers}
    cells: dict[str, list[tuple[int, float, float]]] = {}  # hatch key -> (gpu, x, y) of each cell
    for d in range(nd):
        r, c = divmod(d, cols)
        x0, y0 = c * panel_w, r * panel_h + header_h
        states = rm.gpu2stage[d * tpd * gpt : (d + 1) * tpd * gpt]
        facts = [f"{int((states >= 0).sum())} used"]
        facts += [f"{n} {what}" for n, what in (((states == IDLE).sum(), "idle"), ((states == UNAVAILABLE).sum(), "down")) if n]
        head = f"domain {d}"
        if cl.domain_names is not None or cl.host_names is not None:  # the scheduler's names
            names = [cl.host_name(d * tpd + t) for t in range(tpd) if cl.host_names is None or cl.host_names[d * tpd + t]]
            head = (f"{cl.domain_name(d)}" if cl.domain_names is not None else head) + (
                f"\n{names[0]}..{names[-1]}" if len(names) > 1 else f"\n{names[0]}")
        ax.text(x0 + gpt / 2, y0 - 0.25, f"{head}\n" + (", " if gpt >= 4 else "\n").join(facts),
                ha="center", va="bottom", fontsize=small_pt, linespacing=1.1).set_gid(f"domain-{d}")
        notes = footers.get(d, [])
        for i, x in enumerate(notes[:_MAX_NOTES]):
            name = f"s{x.stage}" + (f".{x.group}" if ngroups > 1 else "")
            more = f" (+{len(notes) - _MAX_NOTES} in the table)" if i == _MAX_NOTES - 1 and len(notes) > _MAX_NOTES else ""
            ax.text(x0 + gpt / 2, y0 + tpd + 0.15 + i * footer_line, f"{name}: {_bytes_text(x.cross_domain_bytes_per_step)}{more}",
                    ha="center", va="top", fontsize=small_pt * 0.9, color="black", fontweight="bold").set_gid(
                        f"straddler-note-{x.stage}-{x.group}")
        if c == 0:
            for t in range(tpd):
                ax.text(x0 - 0.2, y0 + t + 0.5, str(t), ha="right", va="center", fontsize=small_pt * 0.8, color="#555555")
        for t in range(tpd):
            for k in range(gpt):
                gpu = (d * tpd + t) * gpt + k
                s, g = int(rm.gpu2stage[gpu]), int(rm.gpu2group[gpu])
                key = "unavailable" if s == UNAVAILABLE else "idle" if s == IDLE else f"group-{g % len(_GROUP_HATCHES)}"
                cells.setdefault(key, []).append((gpu, x0 + k + 0.06, y0 + t + 0.06))
                if s >= 0 and label_pt >= 3.5:  # the stage (and EP group) of every GPU
                    ax.text(x0 + k + 0.5, y0 + t + 0.52, str(s) if ngroups == 1 else f"{s}.{g}", ha="center",
                            va="center", fontsize=label_pt, color=_text_color(colors[s]),
                            bbox=dict(boxstyle="square,pad=0.1", facecolor=colors[s], linewidth=0) if ngroups > 1 else None)

    # GPU cells: one collection per hatch (fast to draw); each cell keeps its own colours.
    # matplotlib >= 3.10 takes hatch colours apart from edge colours; before, hatches use the edge's.
    per_cell_hatch = "hatchcolors" in inspect.signature(Collection.__init__).parameters
    for key in sorted(cells):
        gpus = [cell[0] for cell in cells[key]]
        n = len(gpus)
        face: list[str]
        styles: list[Any]
        rects = [Rectangle((x, y), 0.88, 0.88) for _, x, y in cells[key]]
        if key == "unavailable":
            face, edge, hatchc = [_DOWN_FACE] * n, [_DOWN_HATCH] * n, [_DOWN_HATCH] * n
            widths, styles, hatch = [0.0] * n, ["solid"] * n, "xx"
        elif key == "idle":
            face, edge, hatchc = ["white"] * n, [_IDLE_EDGE] * n, [_IDLE_EDGE] * n
            widths, styles, hatch = [0.8] * n, [(0, (2, 1.5))] * n, ""
        else:
            stages = [int(rm.gpu2stage[gpu]) for gpu in gpus]
            wide = [(s, int(rm.gpu2group[gpu])) in straddling for s, gpu in zip(stages, gpus)]
            face = [colors[s] for s in stages]
            hatchc = [_mix(colors[s], _text_color(colors[s]), 0.5) for s in stages]
            edge = ["black" if w else h for w, h in zip(wide, hatchc)]
            widths, styles = [thick if w else 0.0 for w in wide], ["solid"] * n
            hatch = _GROUP_HATCHES[int(key.split("-")[1])] if ngroups > 1 else ""
        extra: dict[str, Any] = {"hatchcolors": hatchc} if per_cell_hatch else {}
        coll = PatchCollection(rects, facecolors=face, edgecolors=edge, linewidths=widths, linestyles=styles,
                               hatch=hatch or None, match_original=False, zorder=1, **extra)
        coll.set_gid(f"gpus-{key}")
        ax.add_collection(coll)

    y = (body_h + 0.1) / cell_in
    for text, gid in zip(table, gids):
        ax.text(-_TRAY_LABEL_W, y, text, ha="left", va="top", fontsize=table_pt, family="DejaVu Sans Mono").set_gid(gid)
        y += line_in / cell_in
    return fig


def check_output_path(path: str | os.PathLike) -> Path:
    """The output path, refused (``InvalidInputError``) unless it ends in .png or .svg in a writable folder."""
    out = Path(path)
    if out.suffix.lower() not in SUFFIXES:
        raise InvalidInputError(f"-o: {out}: expected a file name ending in .png or .svg, found {out.suffix or 'no suffix'!r}")
    if out.is_dir():
        raise InvalidInputError(f"-o: {out} is a directory")
    if not out.parent.is_dir():
        raise InvalidInputError(f"-o: folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise InvalidInputError(f"-o: folder {out.parent} is not writable")
    return out


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlacementError("placement show needs matplotlib: pip install 'placement[show]'") from None


def draw_placement(
    instance: Instance,
    placement: Placement,
    path: str | os.PathLike,
    *,
    window: Window | None = None,
    label: str = "",
) -> Path:
    """Write the rack map of ``placement`` to ``path`` (``.png`` or ``.svg``) atomically.

    The placement is checked first (:func:`placement.core.checker.check`); an invalid one, or a path
    with another suffix, raises ``InvalidInputError`` and nothing is written.  Returns the path.
    """
    out = check_output_path(path)
    problems = check(instance, placement)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InvalidInputError(f"placement: {problems[0]}{more}")
    _require_matplotlib()
    from matplotlib import rc_context

    fmt = out.suffix.lower()[1:]
    buf = io.BytesIO()
    # Deterministic files: no date, fixed ids, text as text (smaller, searchable SVG).
    with rc_context({"svg.hashsalt": "placement-show", "svg.fonttype": "none", "font.family": "DejaVu Sans",
                     "font.monospace": ["DejaVu Sans Mono"], "hatch.linewidth": 0.6}):
        fig = rack_map_figure(instance, placement, window=window, label=label)
        metadata = {"Date": None} if fmt == "svg" else {}
        fig.savefig(buf, format=fmt, dpi=_DPI, metadata=metadata)
    atomic_write_bytes(out, buf.getvalue())
    return out


def show_files(
    placement_path: str | os.PathLike | None,
    instance_path: str | os.PathLike | None,
    output_path: str | os.PathLike | None,
    *,
    window: Window | None = None,
) -> Path:
    """What ``placement show`` runs: read, check that the two files belong together, draw, write.

    ``placement_path`` ``"default"`` draws the default layout (then ``output_path`` is required);
    ``output_path`` ``None`` writes beside the placement file with the suffix ``.png``.

    Raises
    ------
    InvalidInputError
        A missing or malformed file, a wrong suffix, a placement made for another instance or one
        the checker rejects; nothing is written.
    """
    if placement_path is None:
        raise InvalidInputError("PLACEMENT: expected a placement file or 'default'")
    is_default = str(placement_path) == "default"
    if output_path is None:
        if is_default:
            raise InvalidInputError("-o: the default layout has no placement file to write beside: give -o map.png")
        output_path = Path(placement_path).with_suffix(".png")
        if Path(output_path) == Path(placement_path):
            raise InvalidInputError(f"-o: {placement_path} ends in .png: give -o")
    out = check_output_path(output_path)
    _require_matplotlib()
    if is_default:
        if instance_path is None:
            raise InvalidInputError("--instance: the default layout needs the instance file")
        from solvers.default import default_placement

        instance = read_instance(instance_path)
        return draw_placement(instance, default_placement(instance), out, window=window, label="default layout")
    placement, doc = read_placement(placement_path)
    named = doc["instance"]
    if instance_path is None:
        raise InvalidInputError(f"--instance: show needs the instance file (the placement names instance {named['name']!r})")
    instance = read_instance(instance_path)
    from placement.consumers.export import require_placement_of

    require_placement_of(instance, placement, doc, placement_path, instance_path)
    return draw_placement(instance, placement, out, window=window,
                          label=f"solver {doc['solver']}" + replica_label(doc, instance.parallel.ep))


def replica_label(doc: dict, ep: int) -> str:
    """The title's replica marker: ``", + N redundant expert slots (k per GPU, rule R)"``, or ``""``."""
    block = doc.get("replicas")
    if not block or not block.get("num_redundant_experts"):
        return ""
    n = int(block["num_redundant_experts"])
    return f", + {n} redundant expert slots per MoE layer ({n // ep} per GPU, rule {block.get('rule')})"
