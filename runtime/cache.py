"""The ahead-of-time cache's lookup: where a code object lives and whether a cached file may load.

Both the loader (``epgen.loader``, which reads the cache) and the builder (``epgen.aot``, which
writes it) import this module; it imports neither. Layout and keys: ``epgen.aot``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from epgen.codegen.arch import ARCH_TRAITS, traits
from epgen.codegen.atomic import path_name_problem
from epgen.codegen.offline import ToolchainMissing, code_object_key, code_object_problem

CACHE_ENV = "EPGEN_CACHE_DIR"

def cache_dir() -> Path:
    """``$EPGEN_CACHE_DIR`` when set and not empty, else ``~/.cache/epgen``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "epgen"


def directory_problem(directory: Path | None = None) -> str | None:
    """Why the file system cannot name the cache directory ``directory`` (default
    ``cache_dir()``): a component longer than its ``NAME_MAX`` (usually 255 bytes) or the whole
    over ``PATH_MAX`` (``epgen.codegen.atomic.path_name_problem``), or None. The message names
    ``EPGEN_CACHE_DIR=...`` when the directory is the default taken from that variable, else
    ``cache directory ...``, the value abbreviated when huge."""
    env = os.environ.get(CACHE_ENV)
    if directory is None and env:
        return path_name_problem(f"{CACHE_ENV}=", env)
    return path_name_problem("cache directory", cache_dir() if directory is None else directory)


def code_object_path(directory: Path, arch: str, key: str) -> Path:
    """``<directory>/<arch>/<key><.hsaco|.cubin>``."""
    return Path(directory) / arch / f"{key}{traits(arch).code_object_suffix}"


def find_code_object(text: str, arch: str, directory: Path | None = None) -> Path | None:
    """The cached code object of ``text`` for ``arch``, or None.

    Args:
        text: rendered kernel source.
        arch: the GPU's target name; an unknown one (no epgen target) is a miss.
        directory: cache directory (default ``cache_dir()``).

    Returns:
        The path of a file that passed ``code_object_problem`` for ``arch``; None when there is
        none, without querying any compiler if ``<directory>/<arch>`` does not exist. A file that
        cannot be read or fails the check, and a cache that cannot be keyed because the offline
        compiler is missing, are reported with ``warnings.warn`` (RuntimeWarning, naming the
        path and the reason) and are misses. So is a directory the file system cannot name
        (``directory_problem``: e.g. ``$EPGEN_CACHE_DIR`` with a component over 255 bytes),
        reported once a process per directory: every kernel of an op would meet it.
    """
    if arch not in ARCH_TRAITS:
        return None
    problem = directory_problem(directory)
    if problem is not None:
        if problem not in _REPORTED:
            _REPORTED.add(problem)
            _warn(f"{problem}; ahead-of-time code objects not used")
        return None
    directory = cache_dir() if directory is None else Path(directory)
    if not (directory / arch).is_dir():
        return None
    try:
        path = code_object_path(directory, arch, code_object_key(text, arch))
    except ToolchainMissing as e:
        _warn(f"{directory / arch}: ahead-of-time code objects not used, their key needs the offline compiler's "
              f"identity: {e}")
        return None
    try:
        image = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(f"{path}: cannot be read ({e.strerror or e}){_REBUILD}")
        return None
    problem = code_object_problem(image, arch)
    if problem is not None:
        _warn(f"{path}: {problem}{_REBUILD}")
        return None
    return path


_REBUILD = " (run epgen build again, or delete the file)"
_REPORTED: set[str] = set()
"""The ``directory_problem`` messages this process has warned of (each once)."""


def _warn(message: str) -> None:
    warnings.warn(f"{message}; compiling at runtime instead", RuntimeWarning, stacklevel=2)
