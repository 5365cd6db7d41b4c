"""Argument checks and block reshaping shared by the codecs, the quantizers and the wire reference.

Every check raises ValueError naming the argument, its value (or the first offending entry) and
the rule (a tensor argument that is not a tensor: TypeError, from ``epgen.tensors.check_tensor``).
"""

from __future__ import annotations

import torch

from epgen.tensors import check_tensor

ELEMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # all exact in float32
BLOCK_DTYPES = (torch.float32, torch.bfloat16)


def check_block(block, *, even: bool) -> int:
    if not isinstance(block, int) or isinstance(block, bool):
        raise ValueError(f"block={block!r}: must be an int")
    if block < 1 or (even and block % 2):
        raise ValueError(f"block={block}: must be a positive{' even' if even else ''} int")
    return block


def _where(mask: torch.Tensor) -> str:
    """'[i, j]' of the first (row-major) True entry of mask ('' for a 0-d tensor)."""
    idx = mask.nonzero()[0].tolist()
    return f"[{', '.join(map(str, idx))}]" if idx else ""


def first_bad(name: str, mask: torch.Tensor, values: torch.Tensor) -> str:
    """'name[i, j]=value' of the first True entry of mask, plus how many more there are."""
    where = _where(mask)
    value = values[mask][0].item()
    count = int(mask.sum())
    more = f" ({count - 1} more)" if count > 1 else ""
    return f"{name}{where}={value!r}{more}"


def check_codes(name: str, codes, limit: int | None = None) -> torch.Tensor:
    codes = check_tensor(name, codes, dtype=torch.uint8)
    if limit is not None:
        bad = codes > limit
        if bool(bad.any()):
            raise ValueError(f"{first_bad(name, bad, codes)}: codes must be in [0, {limit}]")
    return codes


def padded_blocks(v: torch.Tensor, block: int) -> torch.Tensor:
    """[T, H] -> [T, ceil(H / block), block], the last block zero-padded."""
    pad = (-v.shape[1]) % block
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    return v.reshape(v.shape[0], v.shape[1] // block, block)


def unblock(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[T, nb, block] -> [T, H] (the padding dropped)."""
    return t.reshape(t.shape[0], -1)[:, :hidden].contiguous() if t.shape[0] else t.reshape(0, hidden)


def amax_scale(xb: torch.Tensor, qmax: float) -> torch.Tensor:
    """float32 [T, B]: fl(amax / qmax) (true division), 1.0 where that is 0."""
    amax = xb.abs().amax(dim=-1)
    scale = amax / torch.full_like(amax, qmax)  # tensor / tensor: a true IEEE division
    return torch.where(scale == 0, torch.ones_like(scale), scale)
