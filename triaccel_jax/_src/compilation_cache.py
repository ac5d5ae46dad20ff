"""JAX's persistent compilation cache: where it lives, turning it on for a process or one job.

JAX can write every compiled executable to a folder and read it back in a later process
(``jax_compilation_cache_dir``), so a second identical run compiles nothing (docs/design.md
§8). The controller (:func:`enable_by_default`, ``ControllerConfig.compilation_cache``) and the
main job (:func:`persistent_cache`) turn it on by default, in the user's cache folder
(``$XDG_CACHE_HOME/triaccel_jax/jax``, else ``~/.cache/triaccel_jax/jax``) rather than under
``--output-dir``: an executable depends on the program, the JAX version and the device, which
JAX's cache key already holds, not on where results are written, so runs writing to different
output folders share their compiles. ``--compilation-cache DIR`` or the environment variable
``TRIACCEL_COMPILATION_CACHE`` moves it; ``--no-compilation-cache`` or
``TRIACCEL_COMPILATION_CACHE=0`` (or ``off``) turns it off. The flag wins over the variable. A
cache folder the user set in JAX's own configuration is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import jax
from jax._src import compilation_cache as jax_cache

ENVIRONMENT_VARIABLE = "TRIACCEL_COMPILATION_CACHE"
OFF_VALUES = ("0", "off", "false", "no", "")

# JAX writes an entry only if it took >= 1 s to compile and is not tiny, by default; the main
# job's steps on a small model compile in well under a second, and those are exactly the
# compiles a second run should not repeat, so every executable is written.
_SETTINGS = {
    "jax_enable_compilation_cache": True,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def default_cache_dir(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """The user's cache folder for the main job's compiles (see the module docstring)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "triaccel_jax" / "jax"


def resolve_cache_dir(
    flag_dir: pathlib.Path | None,
    disabled: bool,
    environ: Mapping[str, str] | None = None,
) -> pathlib.Path | None:
    """The cache folder the job uses, or ``None`` when the cache is off.

    Args:
      flag_dir: ``--compilation-cache DIR``, if given.
      disabled: ``--no-compilation-cache`` was given.
      environ: the environment (default ``os.environ``), read for ``TRIACCEL_COMPILATION_CACHE``.

    Returns:
      The folder, or ``None``.

    Example::

      >>> resolve_cache_dir(None, False, {"TRIACCEL_COMPILATION_CACHE": "off"}) is None
      True
      >>> str(resolve_cache_dir(None, False, {"TRIACCEL_COMPILATION_CACHE": "/tmp/c"}))
      '/tmp/c'
      >>> str(resolve_cache_dir(pathlib.Path("/x"), False, {"TRIACCEL_COMPILATION_CACHE": "0"}))
      '/x'
    """
    environ = os.environ if environ is None else environ
    if disabled:
        return None
    if flag_dir is not None:
        return flag_dir
    value = environ.get(ENVIRONMENT_VARIABLE)
    if value is None:
        return default_cache_dir(environ)
    if value.strip().lower() in OFF_VALUES:
        return None
    return pathlib.Path(value).expanduser()


@contextlib.contextmanager
def persistent_cache(path: pathlib.Path | None) -> Iterator[None]:
    """Within the block, JAX reads and writes compiled executables under ``path``.

    ``None`` turns the persistent cache off within the block. JAX's settings and its cache
    object are process-wide, so they are restored on exit: a caller in the same process (a test
    counting compiles, say) is not left reading executables from the job's folder.

    Args:
      path: the cache folder (created if missing), or ``None``.

    Example::

      >>> import tempfile
      >>> with persistent_cache(pathlib.Path(tempfile.mkdtemp())):
      ...     _ = jax.jit(lambda x: x + 1)(1.0)
    """
    names = ("jax_compilation_cache_dir", *_SETTINGS)
    saved = {name: getattr(jax.config, name) for name in names}
    if path is None:
        settings: dict[str, Any] = {
            "jax_enable_compilation_cache": False,
            "jax_compilation_cache_dir": None,
        }
    else:
        path.mkdir(parents=True, exist_ok=True)
        settings = {**_SETTINGS, "jax_compilation_cache_dir": str(path)}
    # JAX opens its cache once per process, at the first compile; resetting makes it open the
    # folder set here (and again the caller's on exit).
    jax_cache.reset_cache()
    try:
        for name, value in settings.items():
            jax.config.update(name, value)
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        jax_cache.reset_cache()


def enable_by_default(environ: Mapping[str, str] | None = None) -> pathlib.Path | None:
    """Turns JAX's persistent compilation cache on for the rest of the process, in the folder
    :func:`resolve_cache_dir` gives (``TRIACCEL_COMPILATION_CACHE``, else the user's cache
    folder), unless JAX's own ``jax_compilation_cache_dir`` is already set (the user chose;
    nothing is changed), JAX's cache is switched off (``jax_enable_compilation_cache`` False, as
    the main job's ``--no-compilation-cache`` leaves it), or the variable turns it off.

    Unlike :func:`persistent_cache` this is not undone: a controller compiles for as long as it
    trains, and every later compile of the process may read and write the folder. Calling it
    again changes nothing.

    Returns:
      The folder in use (the user's own when set), or None when the cache is off.

    Example:
      >>> import jax
      >>> from triaccel_jax._src.compilation_cache import enable_by_default
      >>> saved = jax.config.jax_compilation_cache_dir
      >>> jax.config.update("jax_compilation_cache_dir", "/tmp/my_jax_cache")
      >>> str(enable_by_default({"TRIACCEL_COMPILATION_CACHE": "/tmp/other"}))  # the user's kept
      '/tmp/my_jax_cache'
      >>> jax.config.update("jax_compilation_cache_dir", saved)
    """
    chosen = jax.config.jax_compilation_cache_dir
    if chosen:
        return pathlib.Path(chosen)
    if not jax.config.jax_enable_compilation_cache:
        return None
    path = resolve_cache_dir(None, False, environ)
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax_cache.reset_cache()
    for name, value in {**_SETTINGS, "jax_compilation_cache_dir": str(path)}.items():
        jax.config.update(name, value)
    return path
