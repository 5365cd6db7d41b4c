"""Atomic file writes, shared by the catalogue (``epgen generate``) and the ahead-of-time cache
(``epgen build``), and the file system's limits on names, which the command line checks of its
output paths and the cache of its directory before any work (``path_name_problem``)."""

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


NAME_MAX = 255
"""Bytes a file or folder name may have where ``os.pathconf(folder, "PC_NAME_MAX")`` cannot be
read (Linux's ext4, xfs, btrfs and tmpfs all say 255)."""
PATH_MAX = 4096
"""Bytes of a path, its terminating zero included, where ``os.pathconf(folder, "PC_PATH_MAX")``
cannot be read (Linux's ``PATH_MAX``)."""


def name_too_long(path) -> str | None:
    """Why the file system would refuse ``path`` as too long (``ENAMETOOLONG``, errno 36, from
    any open, stat or mkdir of it), or None.

    Two rules, lengths in bytes of the file system encoding (``os.fsencode``): every component
    (file or folder name) at most ``NAME_MAX`` of the folder it lies in (``os.pathconf`` of the
    nearest existing folder, else ``NAME_MAX`` here), and the path as given (``~`` expanded) at
    most ``PATH_MAX`` less its terminating zero. It only asks ``os.path.isdir`` and
    ``os.pathconf`` of existing folders, which never raise here; it creates nothing.

    Returns:
        e.g. ``the name 'xxxx...xxxx' is 300 bytes; a file or folder name may have at most 255 bytes
        on this file system (NAME_MAX)``.
    """
    text = os.path.expanduser(os.fspath(path))
    p = Path(text)
    try:
        folder = Path(p.anchor) if p.anchor else Path.cwd()
    except OSError:  # the current directory was removed: no folder to ask
        folder = None
    known = folder  # the deepest existing folder on the way, whose file system is asked
    limit = _pathconf(known, "PC_NAME_MAX", NAME_MAX)
    for part in p.parts[1:] if p.anchor else p.parts:
        size = len(os.fsencode(part))
        if size > limit:
            return (f"the name {abbreviate(part)!r} is {size} bytes; a file or folder name may have at most {limit} "
                    "bytes on this file system (NAME_MAX)")
        if folder is not None:
            folder = folder / part
            if os.path.isdir(folder):
                known, limit = folder, _pathconf(folder, "PC_NAME_MAX", limit)
            else:
                folder = None  # nothing below a missing folder exists: the rest takes known's limit
    path_max = _pathconf(known, "PC_PATH_MAX", PATH_MAX)
    size = len(os.fsencode(text))
    if size >= path_max:
        return (f"the path is {size} bytes; a path may have at most {path_max - 1} bytes (PATH_MAX {path_max}, its "
                "terminating zero included)")
    return None


def abbreviate(text: str, width: int = 60) -> str:
    """``text`` when it has at most ``width`` characters, else its first and last characters
    around ``...``, ``width`` characters in all (for messages about huge arguments)."""
    if len(text) <= width:
        return text
    tail = (width - 3) // 3
    return f"{text[:width - 3 - tail]}...{text[-tail:]}"


def path_name_problem(argument: str, path, suffix: str = "") -> str | None:
    """``name_too_long`` of ``path`` + ``suffix`` as a message that names where the path came from,
    or None when the file system takes it.

    Args:
        argument: how the user gave the path: a flag (``-o``: the message starts ``-o PATH: ``)
            or an environment variable as ``NAME=`` (``NAME=PATH: ``); PATH abbreviated
            (``abbreviate``).
        path: the path as given.
        suffix: what is appended to ``path`` for the files written (``epgen bench -o PREFIX``
            writes ``PREFIX.env.txt``: pass the longest); the message still shows ``path``.
    """
    reason = name_too_long(os.fspath(path) + suffix)
    if reason is None:
        return None
    return f"{argument}{'' if argument.endswith('=') else ' '}{abbreviate(os.fspath(path))}: {reason}"


def _pathconf(folder: Path | None, name: str, default: int) -> int:
    """``os.pathconf(folder, name)``, or ``default`` without a folder or where it cannot be read."""
    if folder is None:
        return default
    try:
        value = os.pathconf(folder, name)
    except (OSError, ValueError, AttributeError):  # AttributeError: no os.pathconf (Windows)
        return default
    return value if value > 0 else default
