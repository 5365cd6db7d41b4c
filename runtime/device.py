"""The GPU as torch and CuPy see it: its arch name and CuPy's view of torch's current stream."""

from __future__ import annotations

from epgen.codegen.arch import ARCH_TRAITS


def device_arch(device_index: int) -> str:
    """Target name of torch device ``device_index``, a key of ``ARCH_TRAITS``.

    CUDA: ``sm_<major><minor>`` from the compute capability. ROCm (``torch.version.hip`` set):
    the processor of ``gcnArchName`` without its target features, e.g. ``gfx950:sramecc+:xnack-``
    -> ``gfx950`` (a leading target triple, ``amdgcn-amd-amdhsa--gfx950``, is dropped as well).

    Raises:
        ValueError: the GPU's arch is not one epgen generates kernels for (the message names
            the device, the arch as reported and the supported arches).
    """
    import torch

    props = torch.cuda.get_device_properties(device_index)
    if getattr(torch.version, "hip", None):
        reported = props.gcnArchName
        arch = reported.split(":")[0].rsplit("-", 1)[-1]
    else:
        reported = f"compute capability {props.major}.{props.minor}"
        arch = f"sm_{props.major}{props.minor}"
    if arch not in ARCH_TRAITS:
        raise ValueError(f"GPU arch {arch!r} (device {device_index}, {reported!r}): epgen generates kernels for "
                         f"{', '.join(ARCH_TRAITS)}")
    return arch


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
