"""Payload dtypes: one row per dtype, read by the spec, the renderer and the runtime."""

from __future__ import annotations

import attrs


@attrs.frozen
class DTypeInfo:
    """One payload dtype.

    Attributes:
        name: short name used in specs, entry names and CLI flags.
        bits: bits per element.
        torch_name: attribute of ``torch`` naming the dtype of the tensors that carry it; for fp4
            that is uint8 holding two e2m1 codes (element 2i in the low nibble).
        description: what the bits mean.
    """

    name: str
    bits: int
    torch_name: str
    description: str

    def row_bytes(self, hidden: int) -> int:
        """Bytes of one row of ``hidden`` elements."""
        return hidden * self.bits // 8

    def columns(self, hidden: int) -> int:
        """Columns of a torch tensor holding one row of ``hidden`` elements."""
        import torch

        return self.row_bytes(hidden) // torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self):
        """The matching ``torch.dtype``."""
        import torch

        return getattr(torch, self.torch_name)


DTYPES: dict[str, DTypeInfo] = {
    d.name: d
    for d in (
        DTypeInfo(name="bf16", bits=16, torch_name="bfloat16", description="bfloat16"),
        DTypeInfo(name="fp8", bits=8, torch_name="float8_e4m3fn",
                  description="fp8 e4m3, OCP flavour (e4m3fn: bias 7, no infinities, max 448) on every arch"),
        DTypeInfo(name="fp4", bits=4, torch_name="uint8",
                  description="fp4 e2m1 (OCP MX), two codes per byte, element 2i in the low nibble"),
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
