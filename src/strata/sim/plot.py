"""`strata simulate --plot`: hit rate against cache size, one line per policy, the bounds beside.

matplotlib is imported here only, with the non-interactive Agg backend, so the rest of the
simulator runs without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from strata.sim.result import ReplayResult

_BOUND_STYLE = {
    "belady": {"color": "black", "linestyle": "--", "marker": "s"},
    "belady-per-layer": {"color": "dimgray", "linestyle": "-.", "marker": "s"},
    "oracle-static": {"color": "gray", "linestyle": ":", "marker": "d"},
}


def plot_hit_rates(results: Sequence[ReplayResult], path: str | os.PathLike[str],
                   title: str = "") -> None:
    """Write a PNG of hit rate against slots, a line per policy label, bounds dashed.

    Raises:
        ImportError: matplotlib is not installed (`pip install matplotlib`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float]]] = {}
    for result in results:
        lines.setdefault(result.policy, []).append((result.slots, result.hit_rate))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for label, points in lines.items():
            points.sort()
            xs, ys = zip(*points, strict=True)
            style = _BOUND_STYLE.get(label, {"marker": "o"})
            ax.plot(xs, ys, label=label, **style)
        ax.set_xlabel("cache size (slots)")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0.0, 1.0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
        if title:
            ax.set_title(title, fontsize="medium")
        fig.tight_layout()
        fig.savefig(os.fspath(path), format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
