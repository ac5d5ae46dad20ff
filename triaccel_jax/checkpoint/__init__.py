"""Checkpoints: params, optimizer state, policy and the controller's state, with orbax.

:class:`Checkpointer` saves arrays with orbax and a JSON record (policy, controller state, each
array's shape, dtype and CRC-32) beside them; restoring verifies the record and raises
:class:`CheckpointError` naming the step and the problem.

orbax is the ``checkpoint`` extra: without it, importing this package raises an ``ImportError``
that says ``pip install -e '.[checkpoint]'``. orbax itself is imported on the first save
or restore (it takes about a second), and ``import triaccel_jax`` imports this package only when
``triaccel_jax.Checkpointer`` or ``triaccel_jax.CheckpointError`` is first used.
"""

from triaccel_jax._src import extras as _extras

# Found, not imported: a missing orbax is an error naming the extra here, at the import, rather
# than a bare "No module named 'orbax'" at the first save. Hence imports after code:
# ruff: noqa: E402
_extras.require("checkpoint", "triaccel_jax.checkpoint")

from triaccel_jax.checkpoint._checkpointer import Checkpointer
from triaccel_jax.checkpoint._checkpointer import CheckpointError

__all__ = ("CheckpointError", "Checkpointer")
