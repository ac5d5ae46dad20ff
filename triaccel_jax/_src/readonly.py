"""``ReadOnly``: a public, read-only view of a private attribute.

An object whose state is changed only by its own methods still shows much of that state: the
controller its params and optimizer state, the sampler its epoch and cursor. A property per
attribute says the same three lines each time; this descriptor says it once, with the
attribute's docstring, and refuses assignment with an error that names the attribute.
"""

from __future__ import annotations

from typing import Any
from typing import Generic
from typing import TypeVar
from typing import overload

T = TypeVar("T")


class ReadOnly(Generic[T]):
    """The attribute ``_<name>`` of the instance, read as ``<name>`` and never assigned.

    Args:
      doc: the attribute's docstring.

    Example:
      >>> from triaccel_jax._src.readonly import ReadOnly
      >>> class Counter:
      ...     count = ReadOnly[int]("Steps counted so far.")
      ...
      ...     def __init__(self):
      ...         self._count = 0
      ...
      ...     def step(self):
      ...         self._count += 1
      >>> counter = Counter()
      >>> counter.step()
      >>> counter.count, Counter.count.__doc__
      (1, 'Steps counted so far.')
      >>> counter.count = 5
      Traceback (most recent call last):
      ...
      AttributeError: Counter.count is read-only: Steps counted so far.
    """

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> ReadOnly[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, f"_{self._name}")

    def __set__(self, obj: object, value: Any) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self._name} is read-only: {self.__doc__}")
