"""The main job's plots, read through their matplotlib artists (not their pixels): every run and
every leaf stays visible, the memory limit does not flatten the peaks, the precision map shows
each run's dtypes over the steps and says why Tri-Accel's stayed where they were."""

from __future__ import annotations

import math
import types

import matplotlib
import numpy as np
import pytest

from triaccel_jax.cli import _plots as plots
from triaccel_jax.cli import _runs as runs

plt = plots._pyplot()  # matplotlib.pyplot on the Agg backend

LEAVES = ("Conv_0/kernel", "Dense_0/bias", "Dense_0/kernel")


def _history(steps, *, loss_shift=0.0, peak=2.0, limit=math.nan, batch=32):
    return [
        {
            "step": s,
            "samples": s * batch,
            "loss": 2.0 * math.exp(-s / 20) + loss_shift,
            "batch": batch,
            "peak_mib": peak + 0.01 * s,
            "limit_mib": limit,
            "noise_scale": 100.0,
        }
        for s in range(1, steps + 1)
    ]


def _run(
    name,
    *,
    steps=40,
    policies=None,
    step_scales=(),
    history=None,
    accuracy=(0.6, 0.8),
    state_bytes=None,
    state_compiled_bytes=None,
):
    return types.SimpleNamespace(
        name=name,
        steps=steps,
        history=history if history is not None else _history(steps),
        epoch_accuracy=list(accuracy),
        events=[],
        policies=policies if policies is not None else [],
        step_scales=list(step_scales),
        state_bytes=dict(state_bytes or {}),
        state_compiled_bytes=state_compiled_bytes,
        state_bytes_per_parameter=None,
    )


def _uniform(dtype, step=0):
    return {"step": step, "leaves": {leaf: dtype for leaf in LEAVES}}


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_fp32_and_bf16_curves_that_coincide_both_stay_visible():
    # Identical histories and accuracies: FP32's line is exactly under bf16's.
    results = [_run("fp32"), _run("bf16"), _run("triaccel", accuracy=(0.7, 0.9))]
    figure = plots.curves_figure(results, runs.RUN_LABELS)
    for ax in figure.axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        fp32, bf16 = lines["FP32 AdamW"], lines["static bf16 AdamW"]
        np.testing.assert_array_equal(fp32.get_ydata(), bf16.get_ydata())
        # bf16 is drawn on top, narrower and dashed: FP32's wide line shows on both sides.
        assert bf16.get_zorder() > fp32.get_zorder()
        assert bf16.get_linewidth() < fp32.get_linewidth() / 1.5
        assert bf16.get_linestyle() != fp32.get_linestyle()
        assert bf16.get_alpha() in (None, 1.0) and fp32.get_alpha() < 1.0
        assert lines["Tri-Accel"].get_zorder() > bf16.get_zorder()
    # In the accuracy panel each run has its own marker too.
    accuracy_lines = figure.axes[1].get_lines()
    assert len({line.get_marker() for line in accuracy_lines}) == 3
    assert len({(line.get_linestyle(), line.get_marker()) for line in accuracy_lines}) == 3


def _memory_axes(figure):
    return next(ax for ax in figure.axes if ax.get_ylabel() == "memory (MiB)")


def test_a_memory_limit_far_above_the_peaks_is_written_not_drawn():
    history = _history(40, peak=2.0, limit=11_587.0)
    figure = plots.batch_memory_figure(_run("triaccel", history=history))
    ax = _memory_axes(figure)
    assert [line.get_label() for line in ax.get_lines()] == ["step peak (measured or compiled)"]
    peaks = [h["peak_mib"] for h in history]
    low, high = ax.get_ylim()
    # The peaks fill the panel instead of lying along its bottom: linear, from 0, top near them.
    assert ax.get_yscale() == "linear" and low == 0
    assert max(peaks) <= high <= 2 * max(peaks)
    texts = " ".join(text.get_text() for text in ax.texts)
    assert "memory limit 11,587 MiB" in texts and "not drawn" in texts


def test_a_memory_limit_near_the_peaks_is_drawn_within_the_axes():
    history = _history(40, peak=2.0, limit=4.0)
    figure = plots.batch_memory_figure(_run("triaccel", history=history))
    ax = _memory_axes(figure)
    lines = {line.get_label(): line for line in ax.get_lines()}
    np.testing.assert_array_equal(lines["memory limit"].get_ydata(), 4.0)
    assert ax.get_ylim()[1] >= 4.0 and not ax.texts


def _bars(ax):
    """``{row: [(start, stop, colour)]}`` of a precision panel's bars."""
    rows: dict[int, list] = {}
    for patch in ax.patches:
        row = round(patch.get_y() + patch.get_height() / 2)
        start = patch.get_x()
        colour = matplotlib.colors.to_hex(patch.get_facecolor())
        rows.setdefault(row, []).append((start, start + patch.get_width(), colour))
    return {row: sorted(bars) for row, bars in rows.items()}


def test_the_precision_map_shows_each_runs_dtypes_over_the_steps():
    plan = {"step": 20, "leaves": {**_uniform("fp32")["leaves"], "Dense_0/kernel": "bf16"}}
    results = [
        _run("fp32", steps=60, policies=[_uniform("fp32")]),
        _run("bf16", steps=60, policies=[_uniform("bf16")]),
        _run("triaccel", steps=40, policies=[_uniform("fp32"), plan]),
    ]
    figure = plots.precision_figure(results, runs.RUN_LABELS, note="Tri-Accel: a note.")
    panels = {ax.get_title(): ax for ax in figure.axes}
    assert set(panels) == {"FP32 AdamW", "static bf16 AdamW", "Tri-Accel"}
    fp32, bf16 = (matplotlib.colors.to_hex(plots.DTYPE_COLORS[d]) for d in ("fp32", "bf16"))
    rows = list(LEAVES)  # sorted, top to bottom
    # The fixed runs: one bar per leaf over all their steps, in their dtype.
    for title, colour in (("FP32 AdamW", fp32), ("static bf16 AdamW", bf16)):
        assert _bars(panels[title]) == {row: [(0, 60, colour)] for row in range(len(rows))}
    # Tri-Accel: Dense_0/kernel moves to bf16 at step 20; the others stay fp32 to step 40.
    bars = _bars(panels["Tri-Accel"])
    assert bars[rows.index("Dense_0/kernel")] == [(0, 20, fp32), (20, 40, bf16)]
    assert bars[rows.index("Conv_0/kernel")] == [(0, 20, fp32), (20, 40, fp32)]
    assert panels["Tri-Accel"].get_xlim() == (0, 40)
    # Each segment says its dtype in words, not only in colour.
    assert {t.get_text() for t in panels["Tri-Accel"].texts} == {"fp32", "bf16"}
    title = "Compute precision per parameter leaf over training"
    assert [t.get_text() for t in figure.texts] == [title, "Tri-Accel: a note."]
    labels = [t.get_text() for t in figure.legends[0].get_texts()]
    assert labels == ["fp32", "bf16"]


def test_a_precision_map_without_a_note_has_no_footnote():
    figure = plots.precision_figure([_run("fp32", policies=[_uniform("fp32")])], runs.RUN_LABELS)
    assert len(figure.texts) == 1  # the title alone
    assert [ax.get_title() for ax in figure.axes] == ["FP32 AdamW"]


def _scales(steps, values):
    return [
        {"step": step, "scales": {leaf: values[leaf][i] for leaf in values}}
        for i, step in enumerate(steps)
    ]


def test_step_scales_held_at_the_same_bound_stay_visible():
    steps = [10, 20, 30, 40]
    values = {
        "Conv_0/kernel": [2.0, 2.0, 2.0, 2.0],  # held at the upper bound ...
        "Dense_0/bias": [1.2, 1.0, 0.7, 0.5],  # ... meets Dense_0/kernel at its last record only
        "Dense_0/kernel": [2.0, 2.0, 1.0, 0.5],  # ... covers Conv_0/kernel over two segments
    }
    elastic = _run("triaccel", step_scales=_scales(steps, values))
    figure = plots.step_scales_figure(elastic, bounds=(0.5, 2.0))
    line_ax, range_ax = figure.axes
    lines = {line.get_label(): line for line in line_ax.get_lines() if line.get_label() in values}
    assert set(lines) == set(values)
    for leaf, line in lines.items():
        np.testing.assert_array_equal(line.get_ydata(), values[leaf])
    # Every leaf has its own colour and marker.
    assert len({(line.get_color(), line.get_marker()) for line in lines.values()}) == 3
    # Conv_0/kernel, covered by Dense_0/kernel, is beneath it and wider: both show.
    under, over = lines["Conv_0/kernel"], lines["Dense_0/kernel"]
    assert under.get_zorder() < over.get_zorder()
    assert under.get_linewidth() > over.get_linewidth() + 1.5
    # Meeting at one record is no cover: Dense_0/bias keeps the plain width.
    assert lines["Dense_0/bias"].get_linewidth() == over.get_linewidth()
    # The bounds are drawn, in the lines' panel and the ranges' panel.
    bounds = {tuple(line.get_ydata()) for line in line_ax.get_lines() if line not in lines.values()}
    assert {(0.5, 0.5), (2.0, 2.0), (1.0, 1.0)} <= bounds
    # The range panel gives each leaf a row of its own, named, with its min-max and last value.
    assert [t.get_text() for t in range_ax.get_yticklabels()] == sorted(values)
    segments = range_ax.collections[0].get_segments() + [
        s for c in range_ax.collections[1:] for s in c.get_segments()
    ]
    spans = sorted((float(s[0][1]), float(s[0][0]), float(s[1][0])) for s in segments)
    assert spans == [(0.0, 2.0, 2.0), (1.0, 0.5, 1.2), (2.0, 0.5, 2.0)]
    lasts = sorted(
        (float(line.get_ydata()[0]), float(line.get_xdata()[0]))
        for line in range_ax.get_lines()
        if line.get_marker() not in ("None", None, "")
    )
    assert lasts == [(0.0, 2.0), (1.0, 0.5), (2.0, 0.5)]


MIB = 2**20
STATES = {
    "fp32": {"fp32": 8 * MIB, "other": 16},
    "bf16": {"fp32": 8 * MIB, "other": 16},
    # Moments in int8 and int4 beside the signals' float32 and bf16 leaves, listed out of order.
    "triaccel": {"int4": MIB // 2, "other": 40_000, "int8": 2 * MIB, "fp32": 4 * MIB, "bf16": MIB},
}


def test_the_state_plot_stacks_each_runs_bytes_by_format():
    results = [
        _run(name, state_bytes=states, state_compiled_bytes=sum(states.values()) + 1000)
        for name, states in STATES.items()
    ]
    figure = plots.state_memory_figure(results, runs.RUN_LABELS)
    (ax,) = figure.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "FP32 AdamW",
        "static bf16 AdamW",
        "Tri-Accel",
    ]
    bars = _bars(ax)
    colours = {name: matplotlib.colors.to_hex(c) for name, c in plots.FORMAT_COLORS.items()}
    # Each run a stack, most precise format first, each segment as wide as its MiB.
    for row, (name, states) in enumerate(STATES.items()):
        order = [f for f in ("fp32", "bf16", "int8", "int4", "other") if f in states]
        expected, left = [], 0.0
        for fmt in order:
            expected.append((left, left + states[fmt] / MIB, colours[fmt]))
            left += states[fmt] / MIB
        assert len(bars[row]) == len(expected), name
        for got, want in zip(bars[row], expected, strict=True):
            np.testing.assert_allclose(got[:2], want[:2], rtol=1e-9, atol=1e-12)
            assert got[2] == want[2]
    # Wide segments say their format and MiB; XLA's compiled figure is a tick at its bytes.
    texts = {t.get_text() for t in ax.texts}
    assert {"fp32\n8.00", "fp32\n4.00", "int8\n2.00"} <= texts
    ticks = [line.get_xdata()[0] for line in ax.get_lines()]
    np.testing.assert_allclose(ticks, [(sum(v.values()) + 1000) / MIB for v in STATES.values()])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["fp32", "bf16", "int8", "int4", "other"]


def test_write_plots_writes_the_five_pictures_and_closes_them(tmp_path):
    scales = _scales([10, 20], {leaf: [1.0, 1.5] for leaf in LEAVES})
    results = [
        _run("fp32", policies=[_uniform("fp32")], state_bytes=STATES["fp32"]),
        _run("bf16", policies=[_uniform("bf16")], state_bytes=STATES["bf16"]),
        _run(
            "triaccel",
            policies=[_uniform("fp32")],
            step_scales=scales,
            state_bytes=STATES["triaccel"],
        ),
    ]
    written = plots.write_plots(
        results, tmp_path, labels=runs.RUN_LABELS, precision_note="Tri-Accel: stayed fp32."
    )
    names = [
        "curves.png",
        "batch_memory.png",
        "precision_map.png",
        "step_scales.png",
        "state_memory.png",
    ]
    assert [p.name for p in written] == names
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == []
