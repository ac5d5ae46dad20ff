"""Checkpoints: params, optimizer state, policy and the controller's state, with orbax.

:class:`Checkpointer` saves arrays with orbax and a JSON record (policy, controller state, each
array's shape, dtype and CRC-32) beside them; restoring verifies the record and raises
:class:`CheckpointError` naming the step and the problem.
"""

from triaccel_jax.checkpoint._checkpointer import Checkpointer
from triaccel_jax.checkpoint._checkpointer import CheckpointError

__all__ = ("CheckpointError", "Checkpointer")
