"""Flax integration: a train state and a Linen interceptor that apply a precision policy.

* :class:`TrainState`: Flax's train state that forwards optax extra arguments (and refuses a
  keyword that is neither a field nor an extra argument), keeps the policy's compute copy, and
  scales the loss while the policy computes a leaf in fp16 or fp8;
* :func:`apply_with_policy` runs a Linen module on master params under a policy (it casts the
  params and each layer's inputs), :func:`precision_interceptor` is the interceptor behind it;
* :func:`from_train_state` builds a :class:`triaccel_jax.Controller` that continues a train
  state (its step count starting at the state's), :func:`to_train_state` gives the state back
  advanced to the controller's step.

``nnx.Optimizer(model, triaccel_jax.triaccel(...), wrt=nnx.Param)`` needs nothing from here: it
forwards keyword arguments of ``update`` to ``tx.update`` already, and
:func:`triaccel_jax.signals` reads its ``opt_state``. Importing this package imports Flax; without
it (``pip install -e '.[flax]'`` in a clone installs it) the import raises an ``ImportError`` that
names the extra.
"""

from triaccel_jax._src import extras as _extras

# Before the submodules import Flax: a missing Flax is an error naming the extra, not a bare
# "No module named 'flax'" from deep inside. Hence imports after code:
# ruff: noqa: E402
_extras.require("flax", "triaccel_jax.flax")

from triaccel_jax.flax._controller import from_train_state
from triaccel_jax.flax._controller import to_train_state
from triaccel_jax.flax._precision import apply_with_policy
from triaccel_jax.flax._precision import precision_interceptor
from triaccel_jax.flax._train_state import TrainState

__all__ = (
    "TrainState",
    "apply_with_policy",
    "from_train_state",
    "precision_interceptor",
    "to_train_state",
)
