"""Differences of generated sources, grouped by variant: a committed catalogue folder against
what the templates render now, or two specs of one shape that differ in some fields.

A ``Chunk`` is one variant's pair of texts; ``unified`` turns it into a unified diff.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import attrs

from epgen.codegen.catalogue import read_manifest
from epgen.codegen.render import render
from epgen.codegen.spec import KernelSpec


@attrs.frozen
class Chunk:
    """One variant's two texts: ``variant`` (e.g. ``dispatch sm_90`` or a catalogue path), the
    names of its sides ``a_name``/``b_name`` and their texts."""

    variant: str
    a_name: str
    b_name: str
    a_text: str
    b_text: str

    def unified(self, context: int = 3) -> str:
        """The unified diff from a to b with ``context`` lines of context."""
        return "".join(difflib.unified_diff(self.a_text.splitlines(True), self.b_text.splitlines(True), self.a_name,
                                            self.b_name, n=context))


class FieldChangeError(ValueError):
    """A FIELD=VALUE change names no KernelSpec field, or one field twice; ``item`` is the change."""

    def __init__(self, item: str, message: str):
        super().__init__(message)
        self.item = item


class ChangedSpecError(ValueError):
    """A spec with one side's changes breaks a rule: the KernelSpec's message; ``side`` is "a"
    or "b"."""

    def __init__(self, side: str, message: str):
        super().__init__(message)
        self.side = side


CHANGEABLE = tuple(sorted({f.name for f in attrs.fields(KernelSpec)} - {"op"}))
"""The KernelSpec fields a change may set (every field but op)."""


def field_changes(items) -> dict:
    """{field: value} of ``FIELD=VALUE`` strings (``-`` in a field reads as ``_``; an integer
    value becomes an int).

    Raises:
        FieldChangeError: an item without ``=``, a field not in ``CHANGEABLE`` or a field twice.
    """
    changes = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in CHANGEABLE:
            raise FieldChangeError(item, f"write FIELD=VALUE with FIELD one of {', '.join(CHANGEABLE)}")
        if key in changes:
            raise FieldChangeError(item, f"{key} is already set to {changes[key]!r}; give each field once")
        changes[key] = int(value) if value.lstrip("-").isdigit() else value
    return changes


def spec_pair_chunks(specs: list[KernelSpec], a_changes: dict, b_changes: dict) -> list[Chunk]:
    """For each spec, its render with ``a_changes`` against its render with ``b_changes``, where
    they differ.

    Raises:
        ChangedSpecError: a changed spec breaks a rule.
    """
    chunks = []
    for base in specs:
        pair = []
        for side, changes in (("a", a_changes), ("b", b_changes)):
            try:
                pair.append(render(base.replace(**changes)))
            except ValueError as e:
                raise ChangedSpecError(side, str(e)) from e
        ta, tb = pair
        if ta.text != tb.text:
            chunks.append(Chunk(f"{base.op.value} {base.arch}", ta.entry, tb.entry, ta.text, tb.text))
    return chunks


def catalogue_chunks(directory: Path, files: dict[str, str]) -> list[Chunk]:
    """The files of ``directory`` (a committed catalogue) against ``files`` (``render_files``),
    where they differ, and the generated sources its manifest lists that ``files`` no longer has."""
    chunks = []
    for rel, text in files.items():
        p = directory / rel
        old = p.read_text(errors="replace") if p.is_file() else ""
        if old != text:
            chunks.append(Chunk(rel, f"{directory}/{rel} (committed)", f"{rel} (templates now)", old, text))
    listed = read_manifest(directory) or []
    for rel in dict.fromkeys(listed):
        if rel not in files and (directory / rel).is_file():
            chunks.append(Chunk(rel, f"{directory}/{rel} (committed)", "(not rendered any more)",
                                (directory / rel).read_text(errors="replace"), ""))
    return chunks
