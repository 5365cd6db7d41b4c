"""The one check of a tensor argument, shared by the op, the references and the layers.

``per_rank`` splits an argument into one value per rank an op drives. ``check_tensor`` raises the first rule a value breaks, naming the argument, the value's property
and the rule: ``TypeError`` for a value that is not a tensor, ``ValueError`` for the rest. It
imports torch only, so every wing of the package may use it (``tests/codegen/test_imports.py``).
"""

from __future__ import annotations

import torch


def check_tensor(name: str, value, *, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
                 dim: int | None = None, shape: tuple[int | None, ...] | None = None,
                 device: torch.device | None = None, contiguous: bool = False, vector_bytes: int = 0) -> torch.Tensor:
    """Return ``value`` once it is a torch.Tensor that keeps every rule given, checked in this order:
    ``dtype`` (one dtype or a tuple of those allowed), ``dim`` (the number of dimensions),
    ``shape`` (each entry a size, or None for any; implies its length as ``dim``), ``device``,
    ``contiguous``, and ``vector_bytes`` (a nonempty tensor's data starts on a multiple of this
    many bytes: a kernel moves its rows with vector accesses of that size; 0 = no rule).

    Raises:
        TypeError: ``value`` is not a torch.Tensor, e.g. "x: must be a torch.Tensor, got list".
        ValueError: the first rule broken, e.g. "x.dtype=torch.float32: must be torch.bfloat16",
            "x.shape=[4, 8]: must be [*, 7168]", "x.shape=[4]: must be 2-D",
            "x.device=cpu: must be cuda:0", "x: must be contiguous (call .contiguous() first)",
            "x.data_ptr()=0x...2: 2 bytes past a 16-byte boundary; ...".
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: must be a torch.Tensor, got {type(value).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,) if dtype is not None else ()
    if dtypes and value.dtype not in dtypes:
        raise ValueError(f"{name}.dtype={value.dtype}: must be {' or '.join(str(d) for d in dtypes)}")
    if shape is not None:
        if value.dim() != len(shape) or any(want is not None and got != want for got, want in zip(value.shape, shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}.shape={list(value.shape)}: must be {want}")
    elif dim is not None and value.dim() != dim:
        raise ValueError(f"{name}.shape={list(value.shape)}: must be {dim}-D")
    if device is not None and value.device != device:
        raise ValueError(f"{name}.device={value.device}: must be {device}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous() first)")
    if vector_bytes and value.numel() and value.data_ptr() % vector_bytes:
        raise ValueError(f"{name}.data_ptr()={value.data_ptr():#x}: {value.data_ptr() % vector_bytes} bytes past a "
                         f"{vector_bytes}-byte boundary; the kernels move its rows with {vector_bytes}-byte vector "
                         f"accesses, so it must start on one (a view at an odd storage offset: pass .clone())")
    return value


def per_rank(value, name: str, ranks: int, virtual: bool, optional: bool = False) -> list:
    """An op's argument as one value per rank it drives: in virtual mode a list or tuple with one
    entry per rank (a tensor would split into its rows), else the one rank's value.

    Args:
        value: the argument as the caller passed it.
        name: its name, for the error.
        ranks: the ranks the op drives in this process.
        virtual: the op drives every rank in this process.
        optional: None stands for None on every rank.

    Raises:
        TypeError: virtual mode and not a list or tuple of ``ranks`` entries.
    """
    if not virtual:
        return [value]
    if value is None and optional:
        return [None] * ranks
    if not isinstance(value, (list, tuple)) or len(value) != ranks:
        got = type(value).__name__ + (f" of {len(value)}" if isinstance(value, (list, tuple)) else "")
        raise TypeError(f"{name}: virtual mode takes a list of {ranks} tensors (one per rank), got {got}")
    return list(value)
