"""Flax integration: a ``TrainState`` that forwards optax extra arguments and holds a policy.

``nnx.Optimizer(model, triaccel_jax.triaccel(...), wrt=nnx.Param)`` needs nothing from here: it
forwards keyword arguments of ``update`` to ``tx.update`` already, and
:func:`triaccel_jax.signals` reads its ``opt_state``.
"""

from triaccel_jax._src.train_state import TrainState

__all__ = ("TrainState",)
