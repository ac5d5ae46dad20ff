"""The main job's PNG plots: learning curves, the batch and memory timeline, the precision map."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np

_COLORS = {"fp32": "tab:blue", "bf16": "tab:orange", "triaccel": "tab:green"}
_DTYPE_CODES = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8_e4m3": 3}


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


def write_plots(
    results: Sequence[Any], output: pathlib.Path, *, labels: Mapping[str, str]
) -> list[pathlib.Path]:
    """Writes ``curves.png``, ``batch_memory.png``, ``precision_map.png`` and ``step_scales.png``;
    returns the paths.

    Args:
      results: the runs' results (``name``, ``history``, ``epoch_accuracy``, ``policies``).
      output: the folder to write to.
      labels: the legend label of each run name.

    Returns:
      The paths written.
    """
    plt = _pyplot()
    written = []

    figure, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        samples = np.array([h["samples"] for h in r.history]) / 1000
        losses = np.array([h["loss"] for h in r.history])
        window = max(1, len(losses) // 50)
        smooth = _smooth(losses, window)
        loss_ax.plot(
            samples[len(samples) - len(smooth) :],
            smooth,
            label=labels[r.name],
            color=_COLORS[r.name],
        )
        epochs = np.arange(1, len(r.epoch_accuracy) + 1)
        acc_ax.plot(
            epochs,
            100 * np.array(r.epoch_accuracy),
            "o-",
            label=labels[r.name],
            color=_COLORS[r.name],
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
    written.append(output / "curves.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)

    elastic = next((r for r in results if r.name == "triaccel"), None)
    if elastic is not None and elastic.history:
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
            noise_ax.plot(
                steps, noise, color="tab:orange", lw=1, label="gradient noise scale B_simple"
            )
            noise_ax.set(ylabel="noise scale (samples)")
            noise_ax.set_yscale("log")
            noise_ax.legend(loc="upper left")
        mem_ax.plot(
            steps,
            [h["peak_mib"] for h in elastic.history],
            color="tab:purple",
            label="step peak (measured or compiled)",
        )
        mem_ax.plot(
            steps,
            [h["limit_mib"] for h in elastic.history],
            color="tab:red",
            ls="--",
            label="memory limit",
        )
        mem_ax.set(xlabel="training step", ylabel="memory (MiB)")
        mem_ax.set_yscale("log")
        mem_ax.legend(loc="lower right")
        for ax in (batch_ax, mem_ax):
            ax.grid(alpha=0.3)
        figure.tight_layout()
        written.append(output / "batch_memory.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)

    if elastic is not None and elastic.policies:
        paths = sorted(elastic.policies[0]["leaves"])
        grid = np.array(
            [[_DTYPE_CODES[p["leaves"][path]] for p in elastic.policies] for path in paths]
        )
        figure, ax = plt.subplots(
            figsize=(max(5, 1 + 0.5 * len(elastic.policies)), max(3, 0.3 * len(paths) + 1.5))
        )
        cmap = plt.get_cmap("viridis", len(_DTYPE_CODES))
        image = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(_DTYPE_CODES) - 0.5)
        ax.set_yticks(range(len(paths)), paths, fontsize=7)
        ax.set_xticks(range(len(elastic.policies)))
        ax.set(
            title="Tri-Accel: compute precision per leaf",
            xlabel="re-plan (0: start)",
            ylabel="parameter leaf",
        )
        bar = figure.colorbar(image, ax=ax, ticks=list(_DTYPE_CODES.values()))
        bar.ax.set_yticklabels(list(_DTYPE_CODES))
        bar.set_label("compute dtype")
        figure.tight_layout()
        written.append(output / "precision_map.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)

    if elastic is not None and elastic.step_scales:
        paths = sorted(elastic.step_scales[0]["scales"])
        steps = [record["step"] for record in elastic.step_scales]
        figure, ax = plt.subplots(figsize=(9, 4))
        for path in paths:
            ax.plot(steps, [record["scales"][path] for record in elastic.step_scales], label=path)
        ax.axhline(1.0, color="grey", ls=":", lw=1)
        ax.set(
            title="Tri-Accel: per-layer step-size scale (the learning rate's multiplier)",
            xlabel="training step",
            ylabel="step scale",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        figure.tight_layout()
        written.append(output / "step_scales.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)
    return written
