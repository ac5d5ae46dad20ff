"""MetricWriterCallback: a controller's steps and decisions written to a metric writer.

The callback is tested against a recording writer, and against :class:`TensorBoardWriter`, whose
event files are read back record by record (TFRecord framing, tensorboardX's ``Event`` protos).
"""

from __future__ import annotations

import collections
import math
import struct
import subprocess
import sys

import optax
import pytest

import triaccel_jax
from triaccel_jax.controller import Event
from triaccel_jax.controller import MetricWriterCallback
from triaccel_jax.controller import TensorBoardWriter

STEP_SCALARS = {
    "loss",
    "loss_scale",
    "skipped",
    "batch_size",
    "micro_batch",
    "seconds",
    "samples_per_second",
}  # and peak_bytes and limit_bytes, once measured


class RecordingWriter:
    """A metric writer that keeps what it is given: ``scalars[step]``, ``texts[step]``."""

    def __init__(self):
        self.scalars: dict[int, dict[str, float]] = {}
        self.texts: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
        self.flushes = 0
        self.closed = False

    def write_scalars(self, step, scalars):
        assert step not in self.scalars, f"step {step} written twice"
        self.scalars[step] = dict(scalars)

    def write_texts(self, step, texts):
        self.texts[step].extend(texts.items())

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


@pytest.mark.slow
def test_every_step_and_every_decision_is_written(make_controller):
    writer = RecordingWriter()
    callback = MetricWriterCallback(writer)
    # An injected rate, so that the rate itself is known and written beside its factor.
    tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-2)
    # The memory rule, so that the batch grows (and the rate with it) within the 8 steps.
    controller = make_controller(callback=callback, tx=tx, batch_rule="memory")
    callback.write_events(controller.events)
    infos = controller.run(8)
    callback.close()
    assert writer.closed and writer.flushes == 1

    assert sorted(writer.scalars) == list(range(1, 9))
    for info in infos:
        scalars = writer.scalars[info.step]
        assert set(scalars) >= STEP_SCALARS, STEP_SCALARS - set(scalars)
        assert scalars["loss"] == info.loss
        assert scalars["batch_size"] == info.batch_size
        assert scalars["micro_batch"] == info.micro_batch
        assert scalars["loss_scale"] == info.metrics["loss_scale"]
        assert scalars.get("peak_bytes") == info.peak_bytes
        assert scalars.get("limit_bytes") == info.limit_bytes
        assert all(isinstance(v, float) and math.isfinite(v) for v in scalars.values())
    # The batch grew, and the learning-rate factor written follows the controller's events.
    assert writer.scalars[1]["batch_size"] < writer.scalars[8]["batch_size"]
    assert writer.scalars[8]["limit_bytes"] == 20_000 and writer.scalars[8]["peak_bytes"] > 0
    changes = [e for e in controller.events if e.kind == "learning_rate"]
    assert changes
    for step, scalars in writer.scalars.items():
        # An event taken at step k (before step k + 1 ran) comes with step k + 1's info.
        known = [e for e in changes if e.step < step]
        assert scalars.get("learning_rate") == (known[-1].new if known else None), step
        expected_factor = known[-1].figures["factor"] if known else None
        assert scalars.get("learning_rate_factor") == expected_factor, step

    # Every event, the start-up ones included, as a text at its step.
    written = sorted((step, tag) for step, items in writer.texts.items() for tag, _ in items)
    assert written == sorted((e.step, f"events/{e.kind}") for e in controller.events)
    grow = next(e for e in controller.events if e.kind == "grow")
    text = dict(writer.texts[grow.step])["events/grow"]
    assert text.startswith(f"{grow.old} -> {grow.new}: {grow.reason}")
    assert f"limit_bytes={grow.figures['limit_bytes']}" in text


def test_every_thins_the_scalars_but_not_the_events(make_controller):
    writer = RecordingWriter()
    controller = make_controller(callback=MetricWriterCallback(writer, every=3, prefix="train/"))
    controller.run(10)
    assert sorted(writer.scalars) == [3, 6, 9]
    assert all(name.startswith("train/") for s in writer.scalars.values() for name in s)
    assert {"train/loss", "train/batch_size"} <= set(writer.scalars[3])
    tags = [tag for items in writer.texts.values() for tag, _ in items]
    stepped = [e for e in controller.events if e.kind != "start"]  # start came before step 1
    assert sorted(tags) == sorted(f"train/events/{e.kind}" for e in stepped)


def test_a_loss_metric_is_written_and_a_non_number_is_not(make_controller):
    writer = RecordingWriter()
    callback = MetricWriterCallback(writer)
    info = (
        make_controller(steps_in_flight=0)
        .step()
        ._replace(
            metrics={"loss": 0.5, "loss_scale": 1.0, "skipped": 0.0, "accuracy": 0.75, "note": "x"}
        )
    )
    callback(info)
    assert writer.scalars[1]["accuracy"] == 0.75
    assert "note" not in writer.scalars[1]


def test_without_tensorboardx_a_folder_is_an_import_error_naming_the_extra(monkeypatch, tmp_path):
    # None in sys.modules makes the import fail, as when tensorboardX is not installed.
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[tensorboard\]'") as error:
        MetricWriterCallback(tmp_path / "logs")
    # The package is not on PyPI yet: the message also says what works from a clone.
    assert "pip install -e '.[tensorboard]' (in a clone of triaccel_jax)" in str(error.value)
    assert "pip install tensorboardX" in str(error.value)
    assert not (tmp_path / "logs").exists()
    # A writer given as an object needs no tensorboardX.
    MetricWriterCallback(RecordingWriter())


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="lacks write_texts, flush"):
        MetricWriterCallback(object.__new__(type("W", (), {"write_scalars": print})))
    with pytest.raises(ValueError, match="every"):
        MetricWriterCallback(RecordingWriter(), every=0)
    with pytest.raises(TypeError, match="prefix"):
        MetricWriterCallback(RecordingWriter(), prefix=1)
    with pytest.raises(TypeError, match="Event objects"):
        MetricWriterCallback(RecordingWriter()).write_events([("grow", 1, 2)])


def test_importing_triaccel_jax_and_the_callback_imports_no_writer_library():
    code = (
        "import sys, triaccel_jax; "
        "from triaccel_jax.controller import MetricWriterCallback; "
        "print(sorted(m for m in ('tensorboardX', 'tensorflow', 'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def read_tensorboard(logdir) -> dict[str, dict[int, object]]:
    """Every scalar and text in ``logdir``'s event files, by tag and step.

    An event file is a sequence of TFRecords (a little-endian uint64 length, its masked CRC, the
    bytes, their masked CRC), each one serialised ``Event``."""
    from tensorboardX.proto import event_pb2

    values: dict[str, dict[int, object]] = collections.defaultdict(dict)
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            record = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    values[value.tag][event.step] = value.simple_value
                elif value.HasField("tensor"):  # a text: a string tensor
                    values[value.tag][event.step] = value.tensor.string_val[0]
    return values


def test_tensorboard_files_are_written_without_tensorflow_and_read_back(tmp_path, make_controller):
    logdir = tmp_path / "logs"
    callback = MetricWriterCallback(logdir, prefix="train/")
    controller = make_controller(callback=callback)
    callback.write_events(controller.events)
    infos = controller.run(6)
    callback.close()
    assert list(logdir.glob("events.out.tfevents.*"))
    assert "tensorflow" not in sys.modules

    values = read_tensorboard(logdir)
    for name in STEP_SCALARS:
        assert sorted(values[f"train/{name}"]) == list(range(1, 7)), name
    for info in infos:
        assert values["train/loss"][info.step] == pytest.approx(info.loss, rel=1e-6)
        assert values["train/batch_size"][info.step] == info.batch_size
    texts = {tag: v for tag, v in values.items() if "/events/" in tag}
    for event in controller.events:
        text = texts[f"train/events/{event.kind}/text_summary"][event.step]
        assert isinstance(text, bytes) and event.reason in text.decode()
    assert isinstance(controller.events[0], Event)


def test_the_writer_takes_a_clu_style_call_sequence(tmp_path):
    writer = TensorBoardWriter(tmp_path)
    writer.write_scalars(3, {"a": 1.5, "b": 2})
    writer.write_texts(3, {"note": "hello"})
    writer.flush()
    writer.close()
    values = read_tensorboard(tmp_path)
    assert values["a"] == {3: 1.5} and values["b"] == {3: 2.0}
    assert values["note/text_summary"] == {3: b"hello"}
