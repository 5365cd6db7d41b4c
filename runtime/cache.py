"""The ahead-of-time cache's lookup: where a code object lives and whether a cached file may load.

Both the loader (``epgen.loader``, which reads the cache) and the builder (``epgen.aot``, which
writes it) import this module; it imports neither. Layout and keys: ``epgen.aot``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from epgen.codegen.arch import ARCH_TRAITS, traits
from epgen.codegen.offline import ToolchainMissing, code_object_key, code_object_problem

CACHE_ENV = "EPGEN_CACHE_DIR"

def cache_dir() -> Path:
    """``$EPGEN_CACHE_DIR`` when set and not empty, else ``~/.cache/epgen``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "epgen"


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
        path and the reason) and are misses.
    """
    directory = cache_dir() if directory is None else Path(directory)
    if arch not in ARCH_TRAITS or not (directory / arch).is_dir():
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


def _warn(message: str) -> None:
    warnings.warn(f"{message}; compiling at runtime instead", RuntimeWarning, stacklevel=2)
