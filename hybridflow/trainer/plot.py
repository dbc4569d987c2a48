"""Training curves from a run's metrics.jsonl as PNG files (`hybridflow plot RUN_DIR`).

Draws with matplotlib's Agg canvas directly, without pyplot, so plotting from
inside a training process changes no global backend state and needs no display.
"""
from __future__ import annotations

import math
from pathlib import Path

from hybridflow.trainer.tracking import METRICS_FILE, read_metrics

# Panels of metrics.png, in this order; absent or all-NaN metrics are skipped.
PLOT_METRICS = (
    "reward/mean",
    "val/accuracy",
    "actor/kl",
    "actor/entropy",
    "response/length_mean",
    "actor/clip_frac",
    "critic/vf_loss",
    "actor/grad_norm",
)


class PlotError(ValueError):
    """The run's metrics cannot be plotted (nothing to draw)."""


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Finite (step, value) pairs of `key`, by step; a step logged twice keeps its last value."""
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in record:
            by_step[int(record["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_run(run_dir: Path | str) -> list[Path]:
    """Write `run_dir/plots/metrics.png` (a grid of the key metrics vs step); return the paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file {path} (written by the 'jsonl' logger)")
    try:
        records = read_metrics(path)
    except ValueError as exc:  # a corrupt line, named by read_metrics
        raise PlotError(str(exc)) from exc
    panels = [(key, *_series(records, key)) for key in PLOT_METRICS]
    panels = [p for p in panels if p[1]]
    if not panels:
        found = sorted({k for r in records for k in r} - {"step"})
        raise PlotError(f"nothing to plot in {path}: none of {', '.join(PLOT_METRICS)} has a "
                        f"finite value (metrics present: {', '.join(found) or 'none'})")

    ncols = 1 if len(panels) == 1 else 2 if len(panels) <= 4 else 3
    nrows = math.ceil(len(panels) / ncols)
    width, height = 4.5 * ncols, 3.0 * nrows
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (key, steps, values) in zip(axes, panels):
        # Markers make sparse series (validation every N steps) visible.
        ax.plot(steps, values, marker="o" if len(steps) <= 50 else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(run_dir.resolve().name)
    # Margins fixed in inches (room for tick labels, titles and the suptitle): matplotlib's constrained
    # layout measures every text first, most of a plot's cost.
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, bottom=0.55 / height, top=1 - 0.6 / height,
                        wspace=0.75 * ncols / width, hspace=1.1 * nrows / height)

    out = run_dir / "plots" / "metrics.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=100)
    return [out]
