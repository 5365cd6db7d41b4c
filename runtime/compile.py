"""Compile rendered sources at runtime with CuPy (NVRTC on CUDA, hiprtc on ROCm).

Modules are cached in memory by (device, source key); CuPy's own disk cache (keyed on the source
text and options) makes a second process skip the compile.
"""

from __future__ import annotations

import hashlib

from .codegen.render import RUNTIME_OPTIONS

_FUNCTIONS: dict[tuple[int, str], object] = {}


def load_kernel(text: str, entry: str):
    """Compile ``text`` for the current CuPy device (once per process) and return ``entry``.

    Returns:
        cupy.RawKernel-like function object, launchable with ``(grid, block, args, stream=...)``.

    Raises:
        cupy.cuda.compiler.CompileException: the runtime compiler rejected the source.
    """
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (device, hashlib.sha256(text.encode()).hexdigest())
    fn = _FUNCTIONS.get(key)
    if fn is None:
        module = cupy.RawModule(code=text, options=RUNTIME_OPTIONS)
        fn = module.get_function(entry)
        _FUNCTIONS[key] = fn
    return fn


def device_arch(device_index: int) -> str:
    """Target name of a torch device: ``sm_<major><minor>`` on CUDA, the gfx name on ROCm."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


_STREAMS: dict[int, object] = {}


def cupy_stream(device):
    """CuPy's view of torch's current stream on ``device`` (cached per stream)."""
    import cupy
    import torch

    ts = torch.cuda.current_stream(device)
    s = _STREAMS.get(ts.cuda_stream)
    if s is None:
        s = cupy.cuda.Stream.from_external(ts) if hasattr(ts, "__cuda_stream__") else \
            cupy.cuda.ExternalStream(ts.cuda_stream, ts.device.index)
        _STREAMS[ts.cuda_stream] = s
    return s
