"""The main job's PNG plots: learning curves, the batch and memory timeline, the precision map and
the step scales.

Each figure is made by its own function, which returns the matplotlib ``Figure`` (the tests read
its artists: which lines are drawn, in which style, within which limits); :func:`write_plots`
saves them. What each figure does so that every run and every leaf stays visible:

* curves: FP32 and static bf16 train nearly the same curve, so FP32 is drawn wide and faint
  beneath and bf16 dashed and narrow on top, each with its own marker;
* memory: the step peaks on a linear scale from zero, and the memory limit drawn only when it is
  within :data:`LIMIT_DRAWN_WITHIN` times the largest peak (on a CPU the limit is half the free
  RAM, thousands of times a small model's step); otherwise it is written as text;
* precision: each run's compute dtype per leaf over the training steps (FP32 all fp32, static
  bf16 all bf16, Tri-Accel's plans where they start), with each segment's dtype written in it
  and, under the panels, why Tri-Accel's precision stayed or moved;
* optimizer state: each run's state bytes stacked by the format its leaves are stored in (fp32,
  bf16, int8, int4, other), each segment's MiB written in it, XLA's compiled figure of the whole
  state marked beside each bar;
* step scales: each leaf in its own colour, line style and marker, a line that another one
  covers drawn wider beneath it (scales clipped to the same bound coincide), and beside the lines
  each leaf's range over training on a row of its own.
"""

from __future__ import annotations

import math
import pathlib
import textwrap
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np

# Runs' styles. FP32 and static bf16 nearly coincide: the wide faint line beneath, the dashed
# narrow one on top, so that both show.
RUN_STYLES: dict[str, dict[str, Any]] = {
    "fp32": {"color": "tab:blue", "ls": "-", "lw": 3.4, "alpha": 0.5, "marker": "o", "zorder": 2},
    "bf16": {
        "color": "tab:orange",
        "ls": "--",
        "lw": 1.6,
        "alpha": 1.0,
        "marker": "s",
        "zorder": 3,
    },
    "triaccel": {
        "color": "tab:green",
        "ls": "-",
        "lw": 1.6,
        "alpha": 1.0,
        "marker": "^",
        "zorder": 4,
    },
}
_MARKER_SIZES = {"o": 9.0, "s": 5.0, "^": 6.0}
# The compute dtypes' colours in the precision map.
DTYPE_COLORS = {"fp32": "#9ecae1", "bf16": "#fdae6b", "fp16": "#a1d99b", "fp8_e4m3": "#fc9272"}
# The state formats' colours in the optimizer-state plot (the compute dtypes' where they share a
# name), stacked in the registry's order.
FORMAT_COLORS = {
    "fp32": DTYPE_COLORS["fp32"],
    "bf16": DTYPE_COLORS["bf16"],
    "fp16": DTYPE_COLORS["fp16"],
    "int8": "#31a354",
    "int8_dynamic": "#74c476",
    "int4": "#756bb1",
    "other": "#d9d9d9",
}
# The memory limit is drawn when it is at most this many times the largest step peak.
LIMIT_DRAWN_WITHIN = 10.0
# Step-scale lines: leaf i gets colour i % 10, line style i % 4, marker i % 8 (unique up to 40).
_LEAF_LINESTYLES = ("-", "--", "-.", ":")
_LEAF_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window or window <= 1:
        return values
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")


def _run_style(name: str) -> dict[str, Any]:
    return dict(RUN_STYLES.get(name, {"ls": "-", "lw": 1.6, "marker": "o", "zorder": 5}))


def curves_figure(results: Sequence[Any], labels: Mapping[str, str]) -> Any:
    """Training loss against samples seen and test accuracy per epoch, one line per run."""
    plt = _pyplot()
    figure, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        style = _run_style(r.name)
        marker = style.pop("marker")
        label = labels.get(r.name, r.name)
        samples = np.array([h["samples"] for h in r.history]) / 1000
        losses = np.array([h["loss"] for h in r.history])
        window = max(1, len(losses) // 50)
        smooth = _smooth(losses, window)
        loss_ax.plot(samples[len(samples) - len(smooth) :], smooth, label=label, **style)
        epochs = np.arange(1, len(r.epoch_accuracy) + 1)
        acc_ax.plot(
            epochs,
            100 * np.array(r.epoch_accuracy),
            label=label,
            marker=marker,
            ms=_MARKER_SIZES.get(marker, 6.0),
            **style,
        )
    loss_ax.set(
        title="Training loss (moving average)",
        xlabel="samples seen (thousands)",
        ylabel="cross-entropy (nats)",
    )
    acc_ax.set(title="Test accuracy after each epoch", xlabel="epoch", ylabel="accuracy (%)")
    acc_ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    return figure


def _finite_max(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return max(finite) if finite else math.nan


def batch_memory_figure(elastic: Any) -> Any:
    """Tri-Accel's batch size (with the gradient noise scale) and step memory over the steps."""
    plt = _pyplot()
    figure, (batch_ax, mem_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    steps = [h["step"] for h in elastic.history]
    batch_ax.step(
        steps,
        [h["batch"] for h in elastic.history],
        where="post",
        color="tab:green",
        label="batch size",
    )
    for event in elastic.events:
        if event["kind"] in ("grow", "shrink", "oom"):
            batch_ax.axvline(event["step"], color="grey", ls=":", lw=1)
    batch_ax.set(
        title="Tri-Accel: batch size and memory over training", ylabel="batch size (samples)"
    )
    batch_ax.legend(loc="lower right")
    noise = [h.get("noise_scale", math.nan) for h in elastic.history]
    if any(math.isfinite(n) and n > 0 for n in noise):
        noise_ax = batch_ax.twinx()
        noise_ax.plot(steps, noise, color="tab:orange", lw=1, label="gradient noise scale B_simple")
        noise_ax.set(ylabel="noise scale (samples)")
        noise_ax.set_yscale("log")
        noise_ax.legend(loc="upper left")

    peaks = [h["peak_mib"] for h in elastic.history]
    limits = [h["limit_mib"] for h in elastic.history]
    mem_ax.plot(steps, peaks, color="tab:purple", label="step peak (measured or compiled)")
    top_peak, limit = _finite_max(peaks), _finite_max(limits)
    if math.isfinite(limit) and (
        not math.isfinite(top_peak) or limit <= LIMIT_DRAWN_WITHIN * top_peak
    ):
        mem_ax.plot(steps, limits, color="tab:red", ls="--", label="memory limit")
        mem_ax.set_ylim(0, 1.1 * max(limit, top_peak if math.isfinite(top_peak) else 0.0))
    elif math.isfinite(top_peak):
        if math.isfinite(limit):
            # On a scale that holds the limit, the peaks would be a line along the bottom.
            mem_ax.text(
                0.01,
                0.96,
                f"memory limit {limit:,.0f} MiB, {limit / top_peak:,.0f}x the largest step "
                "peak: not drawn, so that the peaks stay readable",
                transform=mem_ax.transAxes,
                va="top",
                fontsize=8,
                color="tab:red",
            )
        mem_ax.set_ylim(0, 1.3 * top_peak)
    mem_ax.set(xlabel="training step", ylabel="memory (MiB)")
    mem_ax.legend(loc="lower right")
    for ax in (batch_ax, mem_ax):
        ax.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def _segments(run: Any) -> list[tuple[float, float, dict[str, str]]]:
    """``(first step, end step, {leaf: dtype})`` of each policy a run trained under."""
    policies = sorted(run.policies, key=lambda p: p["step"])
    end = max(getattr(run, "steps", 0), policies[-1]["step"] + 1)
    starts = [p["step"] for p in policies]
    return [
        (start, stop, p["leaves"])
        for start, stop, p in zip(starts, [*starts[1:], end], policies, strict=True)
        if stop > start
    ]


def precision_figure(
    results: Sequence[Any], labels: Mapping[str, str], note: str | None = None
) -> Any:
    """Each run's compute dtype per leaf over the training steps, one panel per run.

    Args:
      results: the runs; those with ``policies`` get a panel.
      labels: the panel title of each run name.
      note: a sentence on why Tri-Accel's precision stayed or moved, written under the panels.

    Returns:
      The figure.
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    runs = [r for r in results if r.policies]
    paths = sorted({path for r in runs for p in r.policies for path in p["leaves"]})
    figure, axes = plt.subplots(
        1,
        len(runs),
        figsize=(3.2 * len(runs) + 1.6, max(3.0, 0.32 * len(paths) + 2.2)),
        sharey=True,
        squeeze=False,
    )
    used: set[str] = set()
    for ax, run in zip(axes[0], runs, strict=True):
        segments = _segments(run)
        span = segments[-1][1] - segments[0][0]
        for start, stop, leaves in segments:
            for row, path in enumerate(paths):
                dtype = leaves.get(path)
                if dtype is None:
                    continue
                used.add(dtype)
                ax.barh(
                    row,
                    stop - start,
                    left=start,
                    height=0.8,
                    color=DTYPE_COLORS.get(dtype, "lightgrey"),
                    edgecolor="white",
                    label=dtype,
                )
                if stop - start >= 0.2 * span:
                    ax.text((start + stop) / 2, row, dtype, ha="center", va="center", fontsize=7)
        ax.set_xlim(segments[0][0], segments[-1][1])
        ax.set(title=labels.get(run.name, run.name), xlabel="training step")
        ax.title.set_fontsize(10)
    axes[0][0].set_yticks(range(len(paths)), paths, fontsize=7)
    axes[0][0].set_ylabel("parameter leaf")
    axes[0][0].invert_yaxis()
    handles = [
        Patch(color=DTYPE_COLORS.get(d, "lightgrey"), label=d) for d in DTYPE_COLORS if d in used
    ]
    figure.legend(handles=handles, title="compute dtype", loc="center right", fontsize=8)
    figure.suptitle("Compute precision per parameter leaf over training")
    if note:
        figure.text(0.01, 0.01, textwrap.fill(note, 110), fontsize=7.5, va="bottom")
    bottom = 0.06 + 0.035 * (len(textwrap.wrap(note, 110)) if note else 0)
    figure.tight_layout(rect=(0, bottom, 1 - 1.5 / figure.get_figwidth(), 0.95))
    return figure


def state_memory_figure(results: Sequence[Any], labels: Mapping[str, str]) -> Any:
    """Each run's optimizer-state bytes, stacked by the format its leaves are stored in.

    One horizontal bar per run (those with ``state_bytes``), its segments in
    :data:`FORMAT_COLORS`, in the registry's order (most precise first), each labelled with its
    format and MiB where it is wide enough; a black tick marks XLA's compiled figure of the
    whole state (``state_compiled_bytes``), with the bytes per parameter written after the bar.

    Args:
      results: the runs (``name``, ``state_bytes``, ``state_compiled_bytes``, ``parameters``).
      labels: the row label of each run name.

    Returns:
      The figure.
    """
    from triaccel_jax.cli._results import ordered_formats

    plt = _pyplot()
    from matplotlib.patches import Patch

    runs = [r for r in results if r.state_bytes]
    figure, ax = plt.subplots(figsize=(10, 1.0 + 0.8 * max(len(runs), 1)))
    totals = [sum(r.state_bytes.values()) / 2**20 for r in runs]
    compiled = [
        None if r.state_compiled_bytes is None else r.state_compiled_bytes / 2**20 for r in runs
    ]
    widest = max([*totals, *(c for c in compiled if c is not None), 1e-9])
    used: list[str] = []
    for row, run in enumerate(runs):
        left = 0.0
        for name in ordered_formats(run.state_bytes):
            width = run.state_bytes[name] / 2**20
            if name not in used:
                used.append(name)
            ax.barh(
                row,
                width,
                left=left,
                height=0.6,
                color=FORMAT_COLORS.get(name, "lightgrey"),
                edgecolor="white",
                label=name,
            )
            if width >= 0.12 * widest:
                ax.text(
                    left + width / 2,
                    row,
                    f"{name}\n{width:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                )
            left += width
        mark = compiled[row]
        if mark is not None:
            ax.plot([mark, mark], [row - 0.4, row + 0.4], color="black", lw=2)
        per = getattr(run, "state_bytes_per_parameter", None)
        text = f"{totals[row]:.2f} MiB" + (f", {per:.2f} B/param" if per is not None else "")
        ax.text(max(totals[row], mark or 0.0) + 0.02 * widest, row, text, va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [labels.get(r.name, r.name) for r in runs])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.35 * widest)
    ax.set(
        title="Optimizer state by storage format",
        xlabel="MiB (stored leaves; black tick: XLA's compiled figure of the whole state)",
    )
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Patch(color=FORMAT_COLORS.get(n, "lightgrey"), label=n) for n in ordered_formats(used)
    ]
    ax.legend(handles=handles, title="format", loc="lower right", fontsize=8)
    figure.tight_layout()
    return figure


def _covering_counts(values: list[np.ndarray], tolerance: float = 1e-6) -> list[int]:
    """For each line, how many lines drawn after it (on top) cover part of it: equal at two
    consecutive records (a segment), or at the one record there is."""
    counts = []
    for i, mine in enumerate(values):
        count = 0
        for later in values[i + 1 :]:
            equal = np.abs(mine - later) <= tolerance * np.maximum(1.0, np.abs(mine))
            count += bool(np.any(equal[1:] & equal[:-1]) if len(equal) > 1 else np.all(equal))
        counts.append(count)
    return counts


def step_scales_figure(elastic: Any, bounds: tuple[float, float] | None = None) -> Any:
    """Tri-Accel's per-leaf step scales over the steps, and each leaf's range over training.

    Args:
      elastic: the Tri-Accel run (``step_scales``: ``[{"step", "scales": {leaf: scale}}]``).
      bounds: the scale's lower and upper bound, drawn as lines; default
        :func:`triaccel_jax.triaccel`'s ``min_scale`` and ``max_scale``.

    Returns:
      The figure.
    """
    plt = _pyplot()
    if bounds is None:
        import inspect

        from triaccel_jax import transforms

        # The main job's Tri-Accel keeps triaccel's default bounds.
        defaults = inspect.signature(transforms.triaccel).parameters
        bounds = (float(defaults["min_scale"].default), float(defaults["max_scale"].default))
    paths = sorted(elastic.step_scales[0]["scales"])
    steps = [record["step"] for record in elastic.step_scales]
    values = [
        np.array([record["scales"][path] for record in elastic.step_scales], float)
        for path in paths
    ]
    covering = _covering_counts(values)
    colors = plt.get_cmap("tab10").colors
    figure, (line_ax, range_ax) = plt.subplots(
        1,
        2,
        figsize=(12, max(4.0, 0.3 * len(paths) + 2) + 0.25 * math.ceil(len(paths) / 4)),
        gridspec_kw={"width_ratios": [3, 1.3]},
    )
    for i, (path, scales) in enumerate(zip(paths, values, strict=True)):
        under = covering[i]
        style = {
            "color": colors[i % len(colors)],
            "ls": _LEAF_LINESTYLES[i % len(_LEAF_LINESTYLES)],
            "marker": _LEAF_MARKERS[i % len(_LEAF_MARKERS)],
        }
        # A line that later lines cover is drawn beneath them, solid, wider and faint (a halo
        # around them), with bigger markers: scales held at the same bound stay visible.
        line_ax.plot(
            steps,
            scales,
            label=path,
            lw=1.4 + 2.4 * under,
            ms=4 + 2.5 * under,
            alpha=0.45 if under else 1.0,
            zorder=2 + i,
            **(style | {"ls": "-"} if under else style),
        )
        range_ax.hlines(i, scales.min(), scales.max(), color=style["color"], lw=2, ls=style["ls"])
        range_ax.plot(scales[-1], i, color=style["color"], marker=style["marker"], ms=7)
    for line in (line_ax.axhline, range_ax.axvline):
        line(1.0, color="grey", ls=":", lw=1)
        for bound in bounds:
            line(bound, color="tab:red", ls=(0, (1, 3)), lw=1)
    line_ax.set(
        title="Tri-Accel: per-leaf step-size scale (the learning rate's multiplier)",
        xlabel="training step",
        ylabel=f"step scale (bounds {bounds[0]:g} and {bounds[1]:g}, dotted red)",
    )
    low, high = line_ax.get_ylim()
    range_ax.set_xlim(low, high)
    range_ax.set_yticks(range(len(paths)), paths, fontsize=7)
    range_ax.yaxis.tick_right()
    range_ax.invert_yaxis()
    range_ax.set(title="range over training; marker: last", xlabel="step scale")
    range_ax.title.set_fontsize(9)
    for ax in (line_ax, range_ax):
        ax.grid(alpha=0.3)
    line_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4)
    figure.tight_layout()
    return figure


def write_plots(
    results: Sequence[Any],
    output: pathlib.Path,
    *,
    labels: Mapping[str, str],
    precision_note: str | None = None,
) -> list[pathlib.Path]:
    """Writes ``curves.png``, ``batch_memory.png``, ``precision_map.png``, ``step_scales.png`` and
    ``state_memory.png``; returns the paths.

    Args:
      results: the runs' results (``name``, ``history``, ``epoch_accuracy``, ``policies``,
        ``step_scales``, ``steps``, ``state_bytes``, ``state_compiled_bytes``).
      output: the folder to write to.
      labels: the legend label of each run name.
      precision_note: why Tri-Accel's precision stayed or moved, written under the precision map.

    Returns:
      The paths written.
    """
    plt = _pyplot()
    figures = [("curves.png", curves_figure(results, labels))]
    elastic = next((r for r in results if r.name == "triaccel"), None)
    if elastic is not None and elastic.history:
        figures.append(("batch_memory.png", batch_memory_figure(elastic)))
    if any(r.policies for r in results):
        figures.append(("precision_map.png", precision_figure(results, labels, precision_note)))
    if elastic is not None and elastic.step_scales:
        figures.append(("step_scales.png", step_scales_figure(elastic)))
    if any(getattr(r, "state_bytes", None) for r in results):
        figures.append(("state_memory.png", state_memory_figure(results, labels)))
    written = []
    for name, figure in figures:
        written.append(output / name)
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)
    return written
