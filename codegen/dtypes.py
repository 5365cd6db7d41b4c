"""Payload dtypes: one row per dtype, read by the spec, the renderer and the runtime."""

from __future__ import annotations

import attrs


@attrs.frozen
class DTypeInfo:
    """One payload dtype.

    Attributes:
        name: short name used in specs, entry names and CLI flags.
        bits: bits per element.
        torch_name: attribute of ``torch`` that holds the matching dtype.
    """

    name: str
    bits: int
    torch_name: str

    def row_bytes(self, hidden: int) -> int:
        """Bytes of one row of ``hidden`` elements."""
        return hidden * self.bits // 8

    @property
    def torch_dtype(self):
        """The matching ``torch.dtype``."""
        import torch

        return getattr(torch, self.torch_name)


DTYPES: dict[str, DTypeInfo] = {
    d.name: d
    for d in (
        DTypeInfo(name="bf16", bits=16, torch_name="bfloat16"),
    )
}


def dtype_info(name: str) -> DTypeInfo:
    """Return the row of dtype ``name``.

    Raises:
        ValueError: unknown dtype (the message lists the known ones).
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype={name!r}: unknown dtype; known: {', '.join(DTYPES)}") from None
