"""The training stage: one pure training step, shared by the controller and Flax's train state.

:func:`make_train_step` builds the step the :class:`triaccel_jax.Controller` compiles (gradients
accumulated over micro-batches, dynamic loss scaling, the optional fused update, and the step's
metrics, among them the squared gradient norms of a gradient-noise-scale estimate).
:func:`apply_gradients` is the update itself, shared with
:meth:`triaccel_jax.flax.TrainState.apply_gradients`: unscaling, the finite check, the fused or
unfused optimizer update, and the skip of an overflowing step. See ``docs/design.md``
(section 5).
"""

from triaccel_jax.training._noise_norms import value_and_grad_with_noise
from triaccel_jax.training._step import ACCEPTED_LOSS_FORMS
from triaccel_jax.training._step import AppliedGradients
from triaccel_jax.training._step import NoiseNorms
from triaccel_jax.training._step import StepOutput
from triaccel_jax.training._step import abstract_step_arguments
from triaccel_jax.training._step import apply_gradients
from triaccel_jax.training._step import check_loss_structure
from triaccel_jax.training._step import loss_keywords
from triaccel_jax.training._step import loss_scaling_for
from triaccel_jax.training._step import make_train_step
from triaccel_jax.training._step import normalize_loss_fn

__all__ = (
    "ACCEPTED_LOSS_FORMS",
    "AppliedGradients",
    "NoiseNorms",
    "StepOutput",
    "abstract_step_arguments",
    "apply_gradients",
    "check_loss_structure",
    "loss_keywords",
    "loss_scaling_for",
    "make_train_step",
    "normalize_loss_fn",
    "value_and_grad_with_noise",
)
