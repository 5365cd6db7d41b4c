"""A progress bar over compiles for the command line."""

from __future__ import annotations

import sys

from rich.console import Console


class Progress:
    """A rich progress bar over ``total`` compiles on stderr (nothing when quiet or when stderr is
    not a terminal: logs get no bar residue)."""

    def __init__(self, total: int, label: str, quiet: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = None if quiet or not sys.stderr.isatty() else Progress(
            TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
            transient=True)
        self._task = self._bar.add_task(label, total=total) if self._bar else None

    def __enter__(self):
        if self._bar:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar:
            self._bar.stop()

    def advance(self):
        if self._bar:
            self._bar.advance(self._task)
