"""Atomic file writes, shared by the catalogue (``epgen generate``) and the ahead-of-time cache
(``epgen build``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder renamed over it
    (``os.replace``), so a reader sees the old file or the new one, and a symlink at ``path`` is
    replaced by the file instead of followed (nothing outside the folder is written). Creates the
    parent folders; the file gets the mode ``open()`` would give it (0o666 less the umask).

    Raises:
        OSError: the folder or the file cannot be written (the temporary file is removed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a shared cache must be readable as open() would make it
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; set it straight back
    os.umask(mask)
    return mask
