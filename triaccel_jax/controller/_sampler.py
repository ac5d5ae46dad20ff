"""``ElasticSampler``: batches of any size from a deterministic per-epoch permutation (docs/design.md §6).

A change of batch size between two draws neither drops nor repeats a sample: the sampler keeps a
cursor into the epoch's permutation, and a draw that runs past the end of an epoch takes the rest
of it and continues in the next epoch's permutation. The permutation of epoch ``e`` depends only
on ``(seed, e)``, so the sampler's whole state is three integers, saved as JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated
from typing import Any

import numpy as np

from triaccel_jax._src import validation
from triaccel_jax._src.readonly import ReadOnly
from triaccel_jax.controller import _state_record as state_record

STATE_FORMAT = "triaccel_jax.controller.ElasticSampler"


class ElasticSampler:
    """Serves sample indices in batches of any size, each sample once per epoch.

    Args:
      num_examples: size of the data set, >= 1.
      seed: seed of the per-epoch permutations.
      shuffle: False serves ``0, 1, ..., num_examples - 1`` in order every epoch.

    Example:
      >>> from triaccel_jax.controller import ElasticSampler
      >>> sampler = ElasticSampler(10, seed=0)
      >>> first = sampler.take(4)
      >>> rest = sampler.take(6)  # another batch size: no sample dropped or repeated
      >>> sorted([*first, *rest]) == list(range(10)), sampler.epoch, sampler.cursor
      (True, 1, 0)
    """

    def __init__(self, num_examples: int, *, seed: int = 0, shuffle: bool = True) -> None:
        self._num_examples = validation.check_integer("num_examples", num_examples, 1, strict=True)
        self._seed = validation.check_integer("seed", seed, 0, strict=True)
        self._shuffle = bool(shuffle)
        self._epoch = 0
        self._cursor = 0
        self._order = self.order(0)

    @property
    def num_examples(self) -> int:
        return self._num_examples

    epoch = ReadOnly[int]("The epoch the next sample comes from (0-based).")

    cursor = ReadOnly[int]("Position of the next sample in the current epoch's permutation.")

    @property
    def samples_seen(self) -> int:
        """Samples served since the start of epoch 0."""
        return self._epoch * self._num_examples + self._cursor

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of ``range(num_examples)`` served in ``epoch``."""
        if not self._shuffle:
            return np.arange(self._num_examples)
        return np.random.default_rng([self._seed, epoch]).permutation(self._num_examples)

    def take(self, batch_size: int) -> np.ndarray:
        """The indices of the next ``batch_size`` samples (int64); advances the cursor."""
        batch_size = validation.check_integer("batch_size", batch_size, 1, strict=True)
        parts, needed = [], batch_size
        while needed:
            part = self._order[self._cursor : self._cursor + needed]
            parts.append(part)
            needed -= len(part)
            self._cursor += len(part)
            if self._cursor == self._num_examples:
                self._epoch, self._cursor = self._epoch + 1, 0
                self._order = self.order(self._epoch)
        return np.concatenate(parts).astype(np.int64)

    def saved_state(self) -> SamplerState:
        """The sampler's saved state (:meth:`state_dict` encodes it).

        Example:
          >>> from triaccel_jax.controller import ElasticSampler
          >>> sampler = ElasticSampler(10, seed=0)
          >>> _ = sampler.take(4)
          >>> saved = sampler.saved_state()
          >>> saved.epoch, saved.cursor
          (0, 4)
          >>> again = ElasticSampler(10, seed=0)
          >>> again.load_saved_state(saved)
          >>> again.cursor
          4
        """
        return SamplerState(
            format=STATE_FORMAT,
            num_examples=self._num_examples,
            seed=self._seed,
            shuffle=self._shuffle,
            epoch=self._epoch,
            cursor=self._cursor,
        )

    def load_saved_state(self, saved: SamplerState) -> None:
        """Continues from :meth:`saved_state`'s output, which must come from the same data set.

        Raises:
          ValueError: the state was saved for another data set or seed, or its cursor is past
            the data set.
        """
        self._check_saved_for_me(dataclasses.asdict(saved))
        if saved.cursor >= self._num_examples:
            raise ValueError(
                f"sampler cursor {saved.cursor} is past the data set ({self._num_examples})"
            )
        self._epoch, self._cursor = saved.epoch, saved.cursor
        self._order = self.order(saved.epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position as JSON-ready data."""
        return state_record.encode(self.saved_state())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output, which must come from the same data set.

        Raises:
          ValueError: the state is malformed (the field named) or was saved for another data
            set or seed.
        """
        # Which data set first: a state of another one is named as such, whatever it holds.
        self._check_saved_for_me(state)
        saved = state_record.decode(SamplerState, state, "sampler", what="sampler state")
        self.load_saved_state(saved)

    def _check_saved_for_me(self, state: Any) -> None:
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a sampler state: expected a mapping with format {STATE_FORMAT!r}"
            )
        for key in ("num_examples", "seed", "shuffle"):
            mine = getattr(self, f"_{key}")
            if state.get(key) != mine:
                raise ValueError(
                    f"the sampler state was saved with {key}={state.get(key)!r}, this sampler "
                    f"has {key}={mine!r}"
                )

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(num_examples={self._num_examples}, seed={self._seed}, "
            f"epoch={self._epoch}, cursor={self._cursor})"
        )


@dataclasses.dataclass(frozen=True)
class SamplerState:
    """What an :class:`ElasticSampler` saves: its data set and seed (checked on loading) and
    its position.

    Attributes:
      format: ``"triaccel_jax.controller.ElasticSampler"``.
      num_examples, seed, shuffle: the sampler's settings.
      epoch: the epoch being served.
      cursor: the position in that epoch's permutation.

    Example:
      >>> from triaccel_jax.controller import ElasticSampler
      >>> ElasticSampler(10, seed=0).saved_state()  # doctest: +NORMALIZE_WHITESPACE
      SamplerState(format='triaccel_jax.controller.ElasticSampler', num_examples=10, seed=0,
                   shuffle=True, epoch=0, cursor=0)
    """

    format: str
    num_examples: int
    seed: int
    shuffle: bool
    epoch: Annotated[int, state_record.AtLeast(0)]
    cursor: Annotated[int, state_record.AtLeast(0)]
