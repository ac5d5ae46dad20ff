"""Warnings attributed to the user's code: the first frame outside this package.

A warning raised deep inside the controller's loop would otherwise name a line of the library
(``.../triaccel_jax/controller/_controller.py:705``), which tells the user nothing about which of
their calls it concerns, and a fixed ``stacklevel`` is wrong for every other call path.
"""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first calling frame outside triaccel_jax.

    Example:
      >>> import warnings
      >>> from triaccel_jax._src import caller
      >>> with warnings.catch_warnings(record=True) as seen:
      ...     warnings.simplefilter("always")
      ...     caller.warn("said once")
      >>> seen[0].filename == caller.__file__, str(seen[0].message)  # here, not in caller.py
      (False, 'said once')
    """
    frame = sys._getframe(1)
    level = 2  # 1 is this function; 2 its caller
    while frame.f_back is not None and _is_ours(frame.f_code):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def _is_ours(code) -> bool:
    """A frame of this package, or the ``__init__`` a dataclass of it generated."""
    name = code.co_filename
    if name.startswith("<"):
        return code.co_name == "__init__" and name == "<string>"
    return os.path.abspath(name).startswith(_PACKAGE)
