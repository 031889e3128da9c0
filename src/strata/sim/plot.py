"""`strata simulate --plot`: hit rate against cache size, overall and on decode steps alone, a line
per policy, the bounds (Belady, the oracle static set) beside.

Cache sizes are powers of two in practice, so the x axis is log2 with a tick at every size
replayed. Policies often coincide (`static` and `coldest-in-loan` with a fixed K/V; two
variants of one policy), so each line has its own marker and line style, and the points of
each line are nudged sideways by a small, fixed fraction of a doubling: equal values stay
visible side by side instead of one line hiding another. The format comes from the file's
suffix (`PLOT_FORMATS`); the output carries no date or software version, so the same results
write the same bytes with one matplotlib.

matplotlib is imported here only, with the non-interactive Agg backend, so the rest of the
simulator runs without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata.formats.trace import DECODE
from strata.sim.result import ReplayResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOT_FORMATS = ("png", "pdf", "svg")
PANELS = ("hit rate", "decode hit rate")

# Bounds: black and grey, dashed, drawn under the policies.
_BOUND_STYLE = {
    "belady": {"color": "black", "linestyle": "--", "marker": "s"},
    "belady-per-layer": {"color": "dimgray", "linestyle": "-.", "marker": "s"},
    "oracle-static": {"color": "gray", "linestyle": ":", "marker": "D"},
}
# Policies: markers and line styles cycle at different lengths, so no two of the first 35
# policies look alike even where their lines coincide.
_MARKERS = ("o", "^", "v", "<", ">", "P", "X")
_LINESTYLES = ("-", (0, (5, 2)), (0, (1, 1)), (0, (3, 1, 1, 1)), (0, (5, 1, 1, 1, 1, 1)))
_NUDGE = 0.025  # of a doubling, between neighbouring lines


def plot_format(path: str | os.PathLike[str]) -> str:
    """The format `path`'s suffix asks for; ValueError naming the ones there are."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        given = f"suffix .{suffix}" if suffix else "no suffix"
        raise ValueError(f"{os.fspath(path)} has {given}; the plot's format comes from it: "
                         f"{', '.join('.' + f for f in PLOT_FORMATS)}")
    return suffix


def check_plot_target(path: str | os.PathLike[str]) -> str:
    """`plot_format(path)`, once matplotlib is known to import (ImportError if not)."""
    fmt = plot_format(path)
    import matplotlib  # noqa: F401

    return fmt


def _decode_rate(result: ReplayResult) -> float | None:
    accesses, hits = result.phase_counts(DECODE)
    return hits / accesses if accesses else None


def _series(results: Sequence[ReplayResult]) -> dict[str, list[tuple[int, float, float | None]]]:
    """label -> [(slots, hit rate, decode hit rate)] by slots, in the order labels first come."""
    lines: dict[str, list[tuple[int, float, float | None]]] = {}
    for result in results:
        lines.setdefault(result.policy, []).append(
            (result.slots, result.hit_rate, _decode_rate(result)))
    for points in lines.values():
        points.sort(key=lambda point: point[0])
    return lines


def _style(label: str, index: int) -> dict[str, Any]:
    if label in _BOUND_STYLE:
        return {**_BOUND_STYLE[label], "zorder": 2, "linewidth": 1.2}
    return {"marker": _MARKERS[index % len(_MARKERS)],
            "linestyle": _LINESTYLES[index % len(_LINESTYLES)], "zorder": 3, "linewidth": 1.5,
            "markersize": 6, "markerfacecolor": "none", "markeredgewidth": 1.4}


def hit_rate_figure(results: Sequence[ReplayResult], title: str = "",
                    subtitle: str = "") -> Figure:
    """The figure `plot_hit_rates` writes: two panels (`PANELS`), hit rate and decode hit rate
    against slots on a log2 axis, a line per result label.

    Raises:
        ImportError: matplotlib is not installed (`pip install matplotlib`).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    lines = _series(results)
    sizes = sorted({slots for points in lines.values() for slots, _, _ in points})
    if sizes and sizes[0] < 1:
        raise ValueError("a cache of 0 slots has no place on the plot's log2 axis; plot sizes "
                         ">= 1 slot")
    fig = Figure(figsize=(10, 4.6), dpi=120, layout="constrained")
    axes = fig.subplots(1, 2, sharex=True, sharey=True)
    policies = [label for label in lines if label not in _BOUND_STYLE]
    middle = (len(lines) - 1) / 2
    for index, (label, points) in enumerate(lines.items()):
        style = _style(label, policies.index(label) if label in policies else 0)
        shift = 2 ** ((index - middle) * _NUDGE)
        xs = [slots * shift for slots, _, _ in points]
        for ax, column in zip(axes, (1, 2), strict=True):
            ys = [point[column] for point in points]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, label=label, **style)
    for ax, name in zip(axes, PANELS, strict=True):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sizes))  # a tick at every size replayed
        ax.xaxis.set_minor_locator(NullLocator())
        formatter = ScalarFormatter()
        formatter.set_scientific(False)
        ax.xaxis.set_major_formatter(formatter)
        ax.set_xlabel("cache size (slots, log2)")
        ax.set_ylabel(name)
        ax.set_title(name, fontsize="medium")
        ax.set_ylim(0.0, 1.0)
        ax.grid(True, alpha=0.3)
    # Every line is in the overall panel; the decode panel lacks those of no decode steps.
    axes[1].legend(*axes[0].get_legend_handles_labels(), loc="lower right", fontsize="small")
    if title or subtitle:
        fig.suptitle("\n".join(filter(None, [title, subtitle])), fontsize="medium")
    return fig


def plot_hit_rates(results: Sequence[ReplayResult], path: str | os.PathLike[str],
                   title: str = "", subtitle: str = "") -> None:
    """Write `hit_rate_figure` to `path` in the format of its suffix (`plot_format`).

    Raises:
        ValueError: the suffix is not one of PLOT_FORMATS.
        ImportError: matplotlib is not installed (`pip install matplotlib`).
        OSError: the file cannot be written.
    """
    fmt = plot_format(path)
    fig = hit_rate_figure(results, title, subtitle)
    # No date, no version: the same results write the same bytes (SVG's ids from a fixed salt).
    metadata = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None},
                "svg": {"Date": None, "Creator": None}}[fmt]
    import matplotlib

    with matplotlib.rc_context({"svg.hashsalt": "strata", "svg.fonttype": "none"}):
        fig.savefig(os.fspath(path), format=fmt, metadata=metadata)
