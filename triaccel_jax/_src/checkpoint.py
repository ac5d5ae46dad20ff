"""``Checkpointer``: orbax checkpoints of the training state, the policy and the controller.

Arrays (params, optimizer state, BatchNorm statistics) go through orbax's standard pytree
handler; the policy, the controller's state (with the sampler's cursor) and any user metadata go
in a JSON item beside them. Orbax writes each step to a temporary folder and renames it when
complete, so an interrupted save leaves the previous checkpoint usable. Loading never unpickles
anything: both items are data formats (DESIGN §6, issue 5).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax

from triaccel_jax._src import policy as policy_lib

META_FORMAT = "triaccel_jax.checkpoint"
META_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or not one of triaccel_jax's."""


def _orbax() -> Any:
    """orbax.checkpoint, imported on first use (it is slow to import and only needed here)."""
    import orbax.checkpoint

    return orbax.checkpoint


def _abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


class Checkpointer:
    """Saves and restores training checkpoints in a folder, one sub-folder per step.

    Args:
      directory: where the checkpoints go (created if missing).
      max_to_keep: how many recent checkpoints to keep (None: all).

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> import triaccel_jax
      >>> state = {"params": {"w": jnp.arange(3.0)}, "step": jnp.int32(7)}
      >>> with tempfile.TemporaryDirectory() as folder:
      ...     checkpointer = triaccel_jax.Checkpointer(folder)
      ...     checkpointer.save(7, state, metadata={"note": "hi"})
      ...     restored, meta = checkpointer.restore(state)
      ...     checkpointer.close()
      >>> restored["params"]["w"].tolist(), meta["metadata"]
      ([0.0, 1.0, 2.0], {'note': 'hi'})
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = 3) -> None:
        self.directory = pathlib.Path(directory).absolute()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(
                f"cannot create checkpoint folder {self.directory}: {error}"
            ) from None
        if not os.access(self.directory, os.W_OK):
            raise CheckpointError(f"checkpoint folder {self.directory} is not writable")
        ocp = _orbax()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # -- save -----------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        policy: policy_lib.PrecisionPolicy | None = None,
        controller_state: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Writes checkpoint ``step`` and waits until it is complete on disk.

        Args:
          step: the step number (the sub-folder's name).
          state: a pytree of arrays (e.g. a Flax train state).
          policy: the precision policy to save (taken from ``state.policy`` when None).
          controller_state: :meth:`triaccel_jax.Controller.state_dict`'s output.
          metadata: JSON-serialisable user data.
        """
        if policy is None:
            policy = getattr(state, "policy", None)
        meta = {
            "format": META_FORMAT,
            "version": META_VERSION,
            "step": int(step),
            "policy": None if policy is None else json.loads(policy.to_json()),
            "controller": None if controller_state is None else dict(controller_state),
            "metadata": None if metadata is None else dict(metadata),
        }
        ocp = _orbax()
        try:
            json.dumps(meta)
        except TypeError as error:
            raise TypeError(f"checkpoint metadata must be JSON-serialisable: {error}") from None
        self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )
        self._manager.wait_until_finished()

    def save_controller(
        self, controller: Any, *, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """Saves a :class:`triaccel_jax.Controller`'s training state and its own state."""
        arrays = {
            "params": controller.params,
            "opt_state": controller.opt_state,
            "model_state": controller.model_state,
        }
        self.save(
            controller.step_count,
            arrays,
            policy=controller.policy,
            controller_state=controller.state_dict(),
            metadata=metadata,
        )

    # -- restore --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps with a complete checkpoint, ascending."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, template: Any, *, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Reads checkpoint ``step`` (default the latest) into the structure of ``template``.

        Args:
          template: a pytree like the saved state (concrete or ``jax.ShapeDtypeStruct``
            leaves); its dtypes must match, so give a train state the saved policy first
            (:meth:`read_metadata` then ``state.with_policy``) or use :meth:`restore_state`.
          step: which checkpoint; default the latest.

        Returns:
          ``(state, meta)``: the restored pytree and the JSON item (``"policy"``,
          ``"controller"``, ``"metadata"``).

        Raises:
          CheckpointError: no such checkpoint, or it cannot be read (the message says which).
        """
        step = self._resolve(step)
        meta = self.read_metadata(step)
        ocp = _orbax()
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(template)), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as error:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} could not be restored into the given "
                f"template: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
            ) from error
        return restored["state"], meta

    def restore_state(self, state: Any, *, step: int | None = None) -> Any:
        """Restores a train state, first switching it to the saved policy (so dtypes match)."""
        step = self._resolve(step)
        meta = self.read_metadata(step)
        if meta["policy"] is not None and hasattr(state, "with_policy"):
            state = state.with_policy(
                policy_lib.PrecisionPolicy.from_json(json.dumps(meta["policy"]))
            )
        restored, _ = self.restore(state, step=step)
        return restored

    def restore_controller(self, controller: Any, *, step: int | None = None) -> dict[str, Any]:
        """Restores a controller saved by :meth:`save_controller`; returns the user metadata."""
        step = self._resolve(step)
        meta = self.read_metadata(step)
        if meta["controller"] is None:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} holds no controller state"
            )
        if meta["policy"] is not None:
            policy = policy_lib.PrecisionPolicy.from_json(json.dumps(meta["policy"]))
            controller.set_policy(policy)
        template = {
            "params": controller.params,
            "opt_state": controller.opt_state,
            "model_state": controller.model_state,
        }
        arrays, _ = self.restore(template, step=step)
        controller.params = arrays["params"]
        controller.opt_state = arrays["opt_state"]
        controller.model_state = arrays["model_state"]
        controller.load_state_dict(meta["controller"])
        return meta["metadata"]

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON item of checkpoint ``step`` (default the latest), validated."""
        step = self._resolve(step)
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} has no metadata item ({path}); it "
                "is incomplete or was not written by triaccel_jax"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(
                f"checkpoint metadata {path} is not valid JSON: {error}"
            ) from None
        if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
            raise CheckpointError(f"{path} is not a triaccel_jax checkpoint's metadata")
        if meta.get("version") != META_VERSION:
            raise CheckpointError(f"checkpoint version {meta.get('version')!r} is not supported")
        return meta

    def close(self) -> None:
        """Waits for pending writes and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.directory} (have {steps})"
            )
        return step
